# %% [markdown]
# # 15 · Tensor cores from Python
#
# Lessons 08 to 10 built FlashAttention on the GPU's FP32 units: one fused multiply-add per thread per
# instruction. Every recent NVIDIA GPU also has **tensor cores**, units that multiply small matrices, and
# PyTorch's attention uses them even for float32 inputs. numba-cuda has no tensor-core API, but a Numba
# kernel can emit any PTX instruction, and `flashlab.kernels.mma` does exactly that. This lesson opens up
# `variant="tensor"`, a FlashAttention-2 forward written in pure Python on `mma.sync`.
#
# **After this lesson you can**
# - say what one warp-level matrix instruction computes, who takes part, and how much more work it does
#   than an FP32 instruction;
# - read and draw the fragment layouts of `mma.m16n8k16` (float16/bfloat16) and `mma.m16n8k8` (tf32):
#   which lane holds which element of A, B and C in which register;
# - explain why P never leaves registers between S = QKᵀ and O = PV, and why V is loaded with
#   `ldmatrix.trans`;
# - split a float32 number into two tf32 numbers and say what 3xTF32 costs and buys, against 1xTF32,
#   float16 and bfloat16;
# - follow the tensor kernel step by step, run it in the CUDA simulator, and read its measured speed
#   against PyTorch, the FP32 kernels and the tensor cores' own ceiling;
# - read a kernel's instruction mix from Nsight Compute's counters, say why a kernel can be bound by issue
#   slots while its tensor cores wait, and keep address arithmetic out of the loop;
# - place a kernel on the roofline and say when a traffic model's bytes are not HBM's;
# - skip O's rescale when no row's max grew, or (as FlashAttention-4 does) until it grew past a threshold, say
#   why the result stays exact, and estimate how often each rescales;
# - measure a hardware ceiling without fooling yourself: random operands, an A/B in one run, clocks recorded;
# - say which fragment layouts the five products of the backward use, why dS must be transposed on its
#   way to dQ, and why dQ is accumulated with atomics.
#
# Sources: PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions" (`mma`, its fragment layouts,
# `ldmatrix`), "cp.async" and "cvt"; FlashAttention-2 (Dao 2023, arXiv 2307.08691) for the algorithm and
# its split of the work between warps; 3xTF32 from NVIDIA's CUTLASS 2.8 and Ootomo and Yokota,
# "Recovering single precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak
# performance" (2022, arXiv 2203.03341); Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA
# tensor cores" (PeerJ Computer Science, 2021) for how tensor cores add; PTX ISA "vote.sync" for the warp
# vote; FlashAttention-4 (Zadouri et al. 2026, arXiv 2603.05451) for the rescale threshold.

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import device, fragments as F, reference_attention, relative_error
from flashlab.hardware import GPUS
from flashlab.kernels import flash_attention, forward, mma, tensor
from flashlab.roofline import PUBLISHED, PUBLISHED_FP32
from flashlab.viz import tensor as tviz

cuda = device.get_cuda()
ON_GPU = device.has_gpu()
CC = device.device_limits()["cc"]  # None in the simulator
rng = np.random.default_rng(0)
print("running on:", device.device_limits()["name"], "" if ON_GPU else "(every warp instruction is emulated)")

# %% [markdown]
# ## 1. One instruction, a whole warp
#
# An FP32 instruction of a warp does 32 multiply-adds, one per lane. A **warp-level matrix instruction**
# does a whole small matrix product: `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` computes
#
# $$D = A\,B + C, \qquad A: 16\times16 \text{ (float16)},\quad B: 16\times 8 \text{ (float16)},\quad C, D: 16\times 8 \text{ (float32)}$$
#
# as **one** instruction of the warp. No lane holds a matrix: the 32 lanes each bring a few elements of A,
# B and C in their registers, and each gets back a few elements of D. `.sync` and `.aligned` say that all
# 32 lanes must execute the same `mma` together (PTX ISA): it cannot sit inside an `if` that only some
# lanes take. The shape is in the name, m16 n8 k16, and the operand types at the end.

# %%
M, N, K = F.SHAPES["m16n8k16"]
per_mma, per_ffma = M * N * K, 32
print(f"one mma.m16n8k16: {per_mma} multiply-adds; one FFMA warp instruction: {per_ffma}; "
      f"ratio {per_mma // per_ffma}")
h100 = GPUS["H100"]
print(f"an H100 SM has {h100.tensor_cores_per_sm} tensor cores, one per scheduler partition, next to its "
      f"{h100.fp32_per_sm} FP32 lanes")

# %% [markdown]
# More work per instruction is only worth it if the hardware keeps up. `benchmarks/timing/mma_ceiling.py` measures
# what a pure-Python Numba kernel gets out of each `mma` flashlab wraps: every warp runs 8 independent chains
# of mma on registers, no memory traffic at all, so this is the ceiling for any kernel built from them. Next
# to it, two datasheet numbers of the H100 SXM: the FP32 units' peak (lessons 08 to 10 worked under it) and
# the dense FP16 tensor-core peak. The title names the GPU the ceiling was measured on and what its operands
# held.

# %%
ceiling = tviz.load_mma_ceiling()
tviz.plot_mma_ceiling(ceiling, PUBLISHED_FP32["H100"], PUBLISHED["H100"].peak_flops)
plt.show()
if "fp16 m16n8k16" in ceiling and "3xTF32 (3 tf32 mma per product)" in ceiling:
    print(f"from {tviz.mma_ceiling_file().name}: {ceiling['gpu']}, {ceiling['operands']} operands"
          + (f", {ceiling['date']}" if ceiling["date"] else ""))
    fp16 = ceiling["fp16 m16n8k16"] * 1e12
    print(f"measured fp16 mma.sync: {fp16 / PUBLISHED_FP32['H100']:.1f} times an H100's FP32 units' peak, "
          f"{fp16 / PUBLISHED['H100'].peak_flops:.0%} of its datasheet's dense FP16 number")
    three = ceiling["3xTF32 (3 tf32 mma per product)"] * 1e12
    print(f"3xTF32 (three tf32 mma per product, section 5): {three / PUBLISHED_FP32['H100']:.1f} times the FP32 "
          "units' peak")

# %% [markdown]
# Two things to read off. Tensor cores are in another league than the FP32 units, so moving attention's
# two products onto them is the next big step. And `mma.sync` does not reach the datasheet number on an
# H100: Hopper's full tensor-core rate needs `wgmma`, an asynchronous instruction of a *warpgroup* (4 warps)
# that reads B (and optionally A) straight from shared memory. Without it, `mma.sync` reaches about two
# thirds of the peak (FlashAttention-3 blog post, July 2024, note 1, citing Luo et al., arXiv 2402.13499).
# That figure comes from other code on other inputs, so it is no check of ours; the next paragraph is about
# why two ceilings measured in two ways need not agree. FlashAttention-3 is built on `wgmma`. A Numba
# `@intrinsic` could emit it too, but it finds its shared-memory operands through *matrix descriptors* that
# encode a swizzled layout, and runs asynchronously between fences and commit/wait groups: more machinery than
# this course builds. We stay with `mma.sync`, which every GPU since Ampere has (and, in its m16n8k8 form,
# Colab's T4).
#
# **Measuring a ceiling honestly.** A tensor core's power draw depends on the data: multiplying zeros, or the
# same few bits again and again, toggles few transistors, and a GPU held at its power limit lowers its clock
# when the bits toggle more (Horace He, "Strangely, Matrix Multiplications on GPUs Run Faster When Given
# 'Predictable' Data!", 2024). A kernel that feeds its `mma` constants, as a benchmark without input data is
# tempted to, measures a ceiling no real product reaches. Three habits:
# - feed random operands, different for each independent chain, loaded from memory so that the compiler
#   cannot fold them;
# - compare two variants in one run, alternating them, with the same compiled kernels where possible (here
#   only the data differ), so that a difference between runs, a warmer GPU or another clock, is not read as
#   a difference between the variants;
# - record the SM clock and the power beside each number, which says whether the power limit was in play.
#
# The script does all three: by default it measures random operands and, in the same run, the constant
# 0/1-bit words a kernel without data would use. The cell prints whatever A/B the committed file holds.

# %%
rows_ceiling = tviz.mma_ceiling_rows()
kinds = sorted({r["operands"] for r in rows_ceiling})
for r in rows_ceiling:
    measured = isinstance(r.get("sm_clock_mhz"), float) and isinstance(r.get("power_w"), float)
    clock = f", SM clock {r['sm_clock_mhz']:.0f} MHz, {r['power_w']:.0f} W" if measured else ""
    print(f"{r['instruction']:32s} {r['operands']:18s} {r['tflops']:6.1f} TFLOP/s{clock}")
if len(kinds) == 1:
    print(f"\nthis file holds {kinds[0]} operands only and no clocks: it cannot say how much of each number is "
          "the data. Rerun the script on a GPU for the A/B.")
f16_bf16 = {r["instruction"]: r["tflops"] for r in rows_ceiling if r["operands"] == ceiling.get("operands")}
if {"fp16 m16n8k16", "bf16 m16n8k16"} <= set(f16_bf16):
    print(f"fp16 / bf16, same instruction shape, {ceiling['operands']} operands: "
          f"{f16_bf16['fp16 m16n8k16'] / f16_bf16['bf16 m16n8k16']:.2f}")

# %% [markdown]
# How to read an fp16 / bf16 gap. The two instructions do the same work per cycle on paper, so a gap means
# the hardware did not run both at the same rate, not that one format is cheaper. The same bits mean different
# numbers in the two formats, so even "constant" operands toggle different circuits; and two numbers from one
# run, one after the other, can differ by clock. Where the file records the clock and the power, compare them:
# the same clock with a lower rate points at the instruction itself, a lower clock at the power limit. Where it
# records neither, the honest statement is that the gap is unexplained.

# %% [markdown]
# ## 2. Fragments: who holds what
#
# Which lane brings which element is fixed by the PTX ISA ("Matrix Fragments for mma.m16n8k16"). Each
# lane's share is its **fragment**. The figure draws all three operands with every cell coloured by the
# lane that holds it and labelled with that lane and the element's place in the lane's fragment (`a0`,
# `a1`, ...). It is drawn from `flashlab.fragments.fragment_map`, the same table the simulator's emulation
# uses and a GPU test checks against the hardware, so the picture cannot disagree with the kernel.

# %%
tviz.plot_fragments("f16")
plt.show()

# %% [markdown]
# What to see:
#
# - The lanes come in **quads**: lanes 4g to 4g+3 share rows. Call g = lane // 4 the *group* and
#   t = lane % 4 the lane's place in its quad. In C and D, lane (g, t) holds columns 2t and 2t+1 of rows g
#   and g+8: four fp32 values, c0 to c3.
# - A is 16-bit: two neighbours of a row (a0 and a1, a2 and a3, ...) share one 32-bit register, the first in
#   its low half. Eight values, four registers.
# - B is K x N, and a lane's values run down a *column* of B: rows 2t and 2t+1 (and 8 further down), column g.
#   That is the `.col` in the instruction's name; `.row` is A's layout.
#
# The tf32 form is m16n8k8, with one tf32 value per 32-bit register. Same C, another A and B:

# %%
tviz.plot_fragments("tf32", lane=13)
plt.show()

# %% [markdown]
# Slide through the lanes (or, without widgets, look at three of them): which cells does lane 0 hold, and
# lane 31? Which lanes hold row 0 of A?

# %%
tviz.fragment_explorer();

# %% [markdown]
# ### One mma, live
#
# Now run the instruction. The host code below lays A, B and C out as fragments with
# `flashlab.fragments`, packs the 16-bit pairs into 32-bit registers, and a kernel of one warp hands each
# lane's registers to `mma_f16_m16n8k16`. In the simulator, `flashlab.kernels.mma` emulates the warp: the 32
# lanes meet, the product is computed once from their fragments, and each lane leaves with its own four
# results. On a GPU it is the real instruction (Colab's T4, an sm_75 GPU, has no m16n8k16: there the same
# registers go through two m16n8k8).

# %%
MMA16 = mma.mma_f16_m16n8k16 if CC is None or CC >= (8, 0) else mma.mma_f16_m16n8k8x2


@cuda.jit
def one_mma(a, b, c, d):
    lane = cuda.threadIdx.x
    r = MMA16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
              c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        d[lane, i] = r[i]


def registers16(frags):
    """(32, 2n) 16-bit values per lane -> (32, n) uint32 registers, element 2r in the low half of register r."""
    bits = F.to_bits16(frags, "float16")
    return np.ascontiguousarray(F.pack16(bits[:, 0::2], bits[:, 1::2]))


A = F.round_f16(rng.standard_normal((16, 16)))  # values float16 can hold exactly
B = F.round_f16(rng.standard_normal((16, 8)))
C = rng.standard_normal((16, 8)).astype(np.float32)
a = registers16(F.to_fragments(A, "m16n8k16", "A"))
b = registers16(F.to_fragments(B, "m16n8k16", "B"))
c = np.ascontiguousarray(F.to_fragments(C, "m16n8k16", "C"))
d = np.zeros((32, 4), np.float32)
one_mma[1, 32](a, b, c, d)
D = F.from_fragments(d, "m16n8k16", "C")
print("lane 13's registers: A", [hex(x) for x in a[13]], " B", [hex(x) for x in b[13]])
print("largest difference from A @ B + C in float64:", np.abs(D - (A.astype(np.float64) @ B + C)).max())

# %% [markdown]
# ## 3. Getting operands in: ldmatrix, and why V needs `.trans`
#
# A kernel keeps its K and V tiles in shared memory, row-major: one row per key, d values along it. To
# multiply, each lane needs its fragment in registers. Loading element by element is slow, so PTX has
# `ldmatrix`: the warp loads four 8 x 8 matrices of 16-bit values at once, each of 8 lanes pointing at one
# 16-byte row, and every lane receives the elements its fragment needs, two neighbours of one row per
# matrix (`flashlab.kernels.mma.ldmatrix_x4`).
#
# For S = QKᵀ, B is Kᵀ: element (dim, key). A lane's B values run down a column of B, dims 2t and 2t+1 of
# key g, and those are neighbours in a row of K in memory: plain `ldmatrix`. For O = PV, B is V itself:
# element (key, dim). Now the lane needs keys 2t and 2t+1 of dim g, two different rows of V.
# `ldmatrix.trans` transposes each 8 x 8 matrix on the way, so the same 16-byte row reads deliver exactly
# that. No transposed copy of V is ever made.

# %%
tviz.plot_ldmatrix()
plt.show()


@cuda.jit
def load_both(rows, plain, trans):
    sh = cuda.shared.array(128, np.uint32)  # 32 rows of 8 halves = 4 words
    lane = cuda.threadIdx.x
    for w in range(4):
        sh[lane * 4 + w] = rows[lane, w]
    cuda.syncthreads()
    start = np.intp(lane * 4)  # lane 8m + r points at row r of matrix m
    p = mma.ldmatrix_x4(sh, start)
    q = mma.ldmatrix_x4_trans(sh, start)
    for i in range(4):
        plain[lane, i] = p[i]
        trans[lane, i] = q[i]


values = np.add.outer(10 * np.arange(32), np.arange(8)).astype(np.float32)  # row r, col j holds 10 r + j
words = registers16(values)
plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
load_both[1, 32](words, plain, trans)
for name, regs in (("ldmatrix", plain), ("ldmatrix.trans", trans)):
    lo, hi = F.unpack16(regs[5, 0])
    print(f"{name:15s} lane 5, matrix 0: ({F.from_bits16(lo, 'float16'):g}, {F.from_bits16(hi, 'float16'):g})"
          "   (value 10 r + j sits at row r, column j)")

# %% [markdown]
# ## 4. Why P can stay in registers
#
# FlashAttention-2's inner loop computes S = QKᵀ for a tile, turns S into P with the online softmax, and
# multiplies P V. On tensor cores each product is cut into pieces of the instruction's shape: **m-tiles** of
# 16 rows, **n-tiles** of 8 columns of the result, and **k-steps** of 16 (8 for tf32) along the inner
# dimension, one `mma` per (m-tile, n-tile, k-step). S comes out of the first `mma` as **C fragments**, and P
# goes into the
# second as **A fragments**. If those were different layouts, P would have to travel through shared memory
# to be reshuffled between lanes. Look at the two side by side: for a 16-key step, the C fragments of two
# 8-key n-tiles of S (left) and the A fragment of P (right).

# %%
tviz.plot_p_in_registers("f16")
plt.show()
same = np.array_equal(tviz.c_tiles_as_a("f16"), F.fragment_map("m16n8k16", "A"))
print("C fragments of n-tiles 2kk and 2kk+1 == A fragment of k-step kk:", same)

# %% [markdown]
# Every lane already holds exactly the P values it must bring to P V: c0, c1 of the first n-tile are its a0,
# a1; c2, c3 are a2, a3; the second n-tile gives a4 to a7. The kernel only packs two fp32 values into one
# 32-bit register of float16 (or bfloat16) pairs, `pack_f16x2`, and P never touches shared memory. This is
# where a tensor-core FlashAttention saves most against its FP32 cousin: lesson 09's register kernel writes
# P to shared memory, transposed, so that other threads can multiply it with V.
#
# In tf32 the match is not exact: m16n8k8 tf32 wants columns t and t+4 where C gives 2t and 2t+1.

# %%
tviz.plot_p_in_registers("tf32")
plt.show()

# %% [markdown]
# Same rows, other columns. But the order of the k dimension of a product is ours to choose, as long as P's
# columns and V's rows are renumbered the same way: the kernel reads column t as key 2t and column t+4 as key
# 2t+1, and loads V's rows in that order too. Still no data moves between lanes.

# %% [markdown]
# ## 5. Number formats: tf32 and 3xTF32
#
# In the formats this lesson uses, tensor cores multiply 16-bit or 19-bit numbers, never full fp32 (they also
# take FP64, FP8 and 8- and 4-bit integers, on the GPUs that have those formats):
#
# | format | exponent bits | significand bits (with the implicit 1) | largest value |
# | --- | --- | --- | --- |
# | float32 | 8 | 24 | about 3.4e38 |
# | tf32 | 8 | 11 | about 3.4e38 |
# | float16 | 5 | 11 | 65504 |
# | bfloat16 | 8 | 8 | about 3.4e38 |
#
# tf32 ("TensorFloat-32") keeps float32's exponent and float16's precision; the values still sit in 32-bit
# registers, and `cvt.rna.tf32.f32` rounds a float32 to the nearest tf32 value, ties away from zero. So one
# tf32 product ("1xTF32") has float16's relative error, thousands of times fp32's.
#
# **3xTF32** gets fp32 accuracy back with three tf32 products. Split each input into a big part, rounded to
# tf32, and a small part, the remainder rounded to tf32 too: x = big + small holds about 21 significant
# bits. Then
#
# $$a\,b \approx a_{big}\,b_{big} + a_{big}\,b_{small} + a_{small}\,b_{big},$$
#
# dropping $a_{small} b_{small}$, which is below fp32's resolution. Three `mma` per product: section 1 printed
# how that rate compares with the FP32 units' peak. torch's SDPA uses the same trick for float32.
#
# The figure measures all of this in NumPy, with `flashlab.fragments`' rounding: C = A B computed the way a
# chain of `mma` does (exact products, each k-step added to an fp32 accumulator) from inputs rounded to each
# format, against float64, and for 3xTF32 also with the tensor core's own way of adding, explained below.
# Left, growing inner dimension; right, entries scaled from tiny to huge.

# %%
errors = tviz.format_errors(sizes=flashlab.size((16, 64, 256, 1024, 4096), (16, 256, 1024)),
                            trials=flashlab.size(2, 1))
tviz.plot_format_errors(errors)
plt.show()
for fmt in tviz.FORMATS:
    print(f"{fmt:20s} error at K = {errors['sizes'][-1]}: {errors['size'][fmt][-1]:.1e}")

# %% [markdown]
# Read it: tf32 and float16 lie on top of each other (same 11 significand bits); bfloat16, with 3 bits fewer,
# is about 2³ = 8 times worse. On the right, float16 loses tiny entries (they fall below its smallest normal
# number) and overflows on huge ones, while tf32 and bfloat16 have float32's range.
#
# The green 3xTF32 line lands next to fp32 arithmetic, because that model adds every k-step to its accumulator
# the way an fp32 add does, rounding to nearest. A tensor core does not. Fasi, Higham, Mikaitis and Pranesh
# ("Numerical behavior of NVIDIA tensor cores", PeerJ Computer Science, 2021) probed the GPUs they had: the
# products are exact, but the sum of the products and C is formed by aligning every term to the largest one
# and **truncating** the bits that fall off, with no guard bits, and the result is truncated again to fp32.
# A truncation always errs the same way, so over a long chain of `mma` its errors add up instead of
# cancelling, and what it cuts first is the low bits of 3xTF32's correction terms, the very part that buys
# back fp32 accuracy. The two other 3xTF32 lines follow that model (`tviz.tensor_product`): summed over all of
# K inside the tensor core, the error grows with K and leaves fp32 behind; summed 64 columns at a time and
# added in fp32, it stays at fp32's level. Hence the rule: **keep long sums out of the tensor core's
# accumulator.** Ootomo and Yokota (2022) run each `mma` block from zero and add its result to an fp32
# accumulator with ordinary, round-to-nearest fp32
# adds. This course's 3xTF32 kernel follows the same rule where the sums are long: S = QKᵀ accumulates its d/8
# k-steps inside the tensor core (a short chain), but O = PV, a sum over all N keys, is summed from zero on the
# tensor cores for one key tile at a time and added to O with an fp32 multiply-add (step 5 below). CUTLASS's
# 3xTF32 GEMM (its `OpMultiplyAddFastF32` warp operator) keeps the accumulator in the tensor core and issues
# the two small products before the big one, so that they are added while the accumulator is still small.
#
# The exponential is the other place where range matters, in every format: exp overflows float32 above
# ln(3.4e38), about 88.7, so a softmax subtracts the row max before exponentiating even in fp32 (lesson 03).
# What is specific to 16 bits is what gets *stored* in them: S, m, l and the running O stay in fp32
# registers; only P, which lies in [0, 1], and the final O are rounded to 16 bits.

# %%
print(f"largest x with exp(x) finite in float32: {np.log(np.finfo(np.float32).max):.2f}; "
      f"in float16: {np.log(np.finfo(np.float16).max):.2f}")

# %% [markdown]
# ## 6. The kernel, step by step
#
# `flashlab/kernels/tensor.py` is lesson 09's FlashAttention-2 forward with every product on tensor cores.
# A thread block of `warps` warps owns `16 x m_tiles x warps` query rows of one (batch, head). Each warp owns
# `m_tiles` m-tiles of 16 rows (two for float16 and bfloat16 by default, one in float32) and never talks to the
# other warps about S or P, as in FA2 (Section 3.3 of the paper). Two m-tiles make every K and V fragment that
# a warp reads from shared memory feed two `mma` instead of one. The cells below print its code, read from the
# module itself: first the kernel body, which is a list of steps, then each step as the float16 build binds it.
# The module builds one kernel for several precisions and options (bfloat16, tf32 and 3xTF32 for float32
# inputs, the sm_75 build, the library's options); each of those binds its own version of a step when the
# kernel is compiled, so the float16 path you read here has no branch for the others.

# %%
print(tensor.float16_source("body"))

# %% [markdown]
#
# **Step 1. Q's fragments, loaded once.** A warp's rows of Q are the A operand of every S = QKᵀ of the
# loop, so each lane loads its A fragments once, for each of its m-tiles, and keeps them in registers (a
# 16-bit row of d values is d/2 words; column `8ks + t` is the lane's word of k-step `ks`).

# %%
print(tensor.float16_source("load_q"))

# %% [markdown]
# **Step 2. K and V tiles, double-buffered.** The block copies each tile of `block_k` keys of K and V into
# shared memory with `cp.async` (sm_80 and later): the copy goes from global to shared memory without
# passing through registers, and the threads go on working meanwhile. Tile j+1 is copied into the other
# half of a two-stage buffer while the warps compute on tile j; `cp_async_wait(1)` waits for all but the
# newest copy, a barrier for everyone's.
#
# Rows are padded by 16 bytes, for the banks of lesson 08. A warp's shared-memory access of 16 bytes per
# lane (`ldmatrix`'s row addresses, a 128-bit load) asks for 512 bytes, four times what 32 banks of 4 bytes
# deliver in one pass. The hardware serves it in four **phases of 8 lanes**: 8 × 16 bytes = 128 bytes, one
# word from each bank if the 8 addresses fall on different banks. So conflicts only count among the 8 lanes
# of a phase, and the 8 lanes of an `ldmatrix` phase point at 8 consecutive rows of a tile. At d = 64 in
# float16 a row is 128 bytes, exactly the 32 banks, so all 8 rows would start in bank 0: an 8-way conflict.
# With 16 bytes of padding, row r starts 4r banks further on, and the 8 rows cover all 32 banks once:

# %%
from flashlab import memory_access as ma

row_words = 64 * 2 // 4  # one row of K at d = 64 in float16: 32 words
for pad in (0, 4):
    phase = [(r * (row_words + pad)) + w for r in range(8) for w in range(4)]  # 8 lanes, 4 words (16 bytes) each
    print(f"rows padded by {4 * pad:2d} bytes: one phase of ldmatrix needs {ma.bank_conflict_degree(phase)} pass(es)")
tviz.plot_double_buffer()
plt.show()
print(tensor.float16_source("copy_tile"))

# %% [markdown]
# **What the copies and loads cost in instructions.** Bytes are not the only price: every address a thread
# computes is an instruction too, and instructions are a budget of their own. Some words first. **SASS** is
# the GPU's machine code; **ptxas**, NVIDIA's assembler, compiles the PTX that Numba emits into it. In SASS an
# `mma` on 16-bit inputs is an **HMMA**, an `ldmatrix` an **LDSM**, a `cp.async` an **LDGSTS**, and **IMAD**
# is an integer multiply-add, the workhorse of address arithmetic (and of plain moves).
#
# Why the count matters: each of an SM's four partitions has one scheduler, which issues at most one
# instruction per cycle, for one of its warps. An HMMA keeps the partition's tensor core busy for several
# cycles, and during those cycles the scheduler can issue the softmax, the loads and the address arithmetic
# of the warps beside it. The tensor core stays busy only if everything else fits in those gaps: when a tile's
# other instructions outnumber what its HMMAs leave room for, the kernel is bound by issue slots, not by the
# tensor cores. This is why FlashAttention-2 (Section 3.1) cuts the non-matmul work, and why FlashAttention-4
# goes further (it computes part of its exponentials with polynomials on the FP32 units and skips rescales).
#
# Nsight Compute counts how often each SASS instruction ran; `benchmarks/profiling/sass_mix.py` turns that
# into the mix of the loop body, per warp and key tile, of the float16 forward at d = 64, for three builds of
# the same code that differ only in their address arithmetic and in the rescale of step 4:

# %%
mix = tviz.load_sass_mix()
tviz.plot_instruction_mix(mix)
plt.show()
if mix:
    for label, counts in mix["loop_body"].items():
        groups = tviz.instruction_groups(counts)
        total = sum(counts.values())
        print(f"{mix['labels'][label]}:\n    {total} instructions per warp and tile, {counts.get('HMMA', 0)} HMMA "
              f"({total / counts['HMMA']:.1f} instructions to issue per HMMA), "
              f"{groups['integer: addresses, indices, compares']} integer, {groups['softmax arithmetic']} softmax")

# %% [markdown]
# The biggest bar beside the HMMAs is the softmax: hundreds of instructions (max, exponentials, sums, the
# rescale) against 128 HMMA per tile. Address arithmetic was the second biggest in the first build, and it
# teaches a rule that carries over to any kernel:
#
# - **Hoist 64-bit address arithmetic out of the loop.** A global address is 64 bits, and multiplying a row
#   index by a stride in 64 bits costs several 32-bit instructions. A thread copies the same chunk of every K
#   and V tile, so compute the tile's first address once per tile and the chunk's offset inside the tile once
#   per kernel.
# - **Use 32-bit offsets.** Shared memory is addressed with 32 bits, and an offset inside a tile fits in 32 bits.
# - **Let ptxas fold constants.** When an address is visibly "base register + constant", ptxas writes the
#   constant into the instruction, `LDSM [R16+0x20]`, and the add disappears. It can only do so if it sees the
#   arithmetic: an address converted inside inline assembly is opaque to it, so flashlab's intrinsics compute
#   the 32-bit shared address before the assembly. Six LDSMs of the loop, with a computed address each, and
#   with one base register and folded constants:

# %%
if mix and "ldsm_sass" in mix:
    for label, lines in (("an address register each", mix["ldsm_sass"]["before"]),
                         ("one base, constants folded", mix["ldsm_sass"]["after"])):
        print(f"{label}:\n    " + "\n    ".join(lines))

# %% [markdown]
# The HMMA and softmax bars are the same in the first two builds; the integer bar fell by more than half. The
# third build also skips O's rescale in tiles where no row's max grew (step 4), which lowers the softmax bar
# (its count is an average over tiles). FA2's CUDA C++ gets the same effect from CuTe's layouts: each thread's
# pointers into K and V are computed once and advanced by one tile of rows per iteration (`flash_fwd_kernel.h`).

# **Step 3. S = QKᵀ on tensor cores.** For each k-step of d and each 8-key n-tile: the lane's A registers
# (Q), two B registers (K, from one `ldmatrix_x4` for two n-tiles, used by each of the warp's m-tiles), and
# the n-tile's four C registers, which accumulate over the k-steps. (The float32 builds bind another version of
# this step: tf32 reads K's B values with plain shared loads, and 3xTF32 splits both operands with `round_tf32`
# and runs the big x big products in one chain and the two corrections in another: independent chains keep the
# tensor cores busy.)

# %%
print(tensor.float16_source("scores"))

# %% [markdown]
# **Step 3b. The mask, only where a tile needs one.** Keys past Nk and, under causal masking, keys after a row
# are set to a large negative number, so that exp2 gives them p = 0. Only a tile that crosses the end of the
# keys or the diagonal can hold such a key, so the test runs once per tile and the per-entry loop only there.
# The library's options (windows, ALiBi, softcap) bind another mask step, which transforms and masks every
# tile through the options module (`flashlab/kernels/options.py`).

# %%
print(tensor.float16_source("mask"))

# %% [markdown]
# **Step 4. The online softmax on C fragments.** In each m-tile a lane holds two rows, g and g+8, and two
# columns of each n-tile. The row's max and sum need all of its columns, which sit in the 4 lanes of the quad: after each
# lane takes the max over its own values, two butterfly exchanges `shfl_xor(x, 1)` and `shfl_xor(x, 2)`
# give every lane of the quad the row's max (`shfl.sync.bfly`: lane i receives the value of lane i ^ mask).
# Lesson 09's kernel combined its threads' row maxima through shared memory; here two register exchanges do.

# %%
tviz.plot_quad_reduction()
plt.show()

S_tile = rng.standard_normal((16, 8))
frags = F.to_fragments(S_tile, "m16n8k16", "C")  # (32 lanes, c0..c3)
own = np.stack([frags[:, :2].max(axis=1), frags[:, 2:].max(axis=1)], axis=1)  # rows g and g+8
lanes = np.arange(32)
after1 = np.maximum(own, own[lanes ^ 1])  # shfl_xor(x, 1)
after2 = np.maximum(after1, after1[lanes ^ 2])  # shfl_xor(x, 2)
print("every lane of quad g now holds the max of rows g and g+8:",
      np.array_equal(after2[:, 0], S_tile.max(axis=1)[lanes // 4]),
      np.array_equal(after2[:, 1], S_tile.max(axis=1)[lanes // 4 + 8]))
print(tensor.float16_source("softmax"))

# %% [markdown]
# The row *sum* l is not exchanged inside the loop: each lane keeps its share and the quad adds them once, at
# the very end (step 6). Only the max must agree at every step, because P = exp(S - m) uses it.
#
# O's rescale is skipped where it would change nothing. If no row of an m-tile got a larger max from this
# tile, every alpha is exp2(0) = 1, and the lane's 32 multiplies of O (at d = 64) would leave it as it is.
# `vote_any(grew)` (PTX `vote.sync.any`) tells every lane whether the flag is true in *any* lane of the warp,
# so the whole warp takes the same branch (no divergence). On random scores the chance that a row's max
# grows at tile j is about 1/(j + 1), and an m-tile has 16 rows, so the vote says "rescale" often.
#
# FlashAttention-4 (Zadouri et al. 2026, arXiv 2603.05451; `flash_attn/cute/softmax.py`) asks less: it keeps
# the max it last rescaled with, m_used, and rescales only when a tile's max exceeds m_used by more than a
# **threshold**, 8 in log2 units for 16-bit inputs. Below the threshold it goes on with the stale m_used, and
# the result is still exact, because nothing requires m_used to be the true max. O, l and the final division
# all use the same m_used:
#
# $$O = \frac{\sum_j e^{s_j - m_{used}}\, v_j}{\sum_j e^{s_j - m_{used}}} = \frac{\sum_j e^{s_j}\, v_j}{\sum_j e^{s_j}}\quad\text{for any } m_{used}.$$
#
# The max is subtracted only to keep the exponentials in range. A stale max lets P exceed 1, up to
# 2⁸ = 256, which float16 and bfloat16 hold easily, and l and O are fp32. How often does an m-tile of 16 rows
# rescale, with the threshold at 0 (this kernel's vote) and at 8 log2 units (FA4's)? Below, for the scores
# of random Q and K at d = 64 with block_k = 64, and for the same scores with key 0 raised by 6 in every row:
# one early key that dominates, as the "attention sink" keys that trained language models have (Xiao et al.
# 2023, arXiv 2309.17453).

# %%
q_r, k_r = rng.standard_normal((2, flashlab.size(4096, 512), 64)).astype(np.float32)
S_random = q_r @ k_r.T / 8  # scale 1/sqrt(64)
S_sink = S_random.copy()
S_sink[:, 0] += 6
fa4 = 8 * np.log(2)  # 8 in log2 units, in the natural-log units of these scores
curves = {"random scores": tviz.max_growth(S_random), "key 0 raised by 6": tviz.max_growth(S_sink),
          "random scores, threshold 8 (log2)": tviz.max_growth(S_random, threshold=fa4)}
tviz.plot_max_growth(curves)
plt.show()
for name, grew in curves.items():
    print(f"{name:34s}: O rescaled in {grew.mean():6.1%} of (m-tile, key tile) pairs")
mix = tviz.load_sass_mix()
if mix:
    print(f"the kernel's counters, float16 random inputs at N = 4096 (B1 H16), threshold 0: "
          f"{mix['rescale_share']['now']:.1%}")
S_few, V_few = S_random[:64], rng.standard_normal((S_random.shape[1], 8))
o_stale, p_max = tviz.stale_max_output(S_few, V_few, threshold=fa4)
P_exact = np.exp(S_few - S_few.max(axis=1, keepdims=True))
o_exact = P_exact @ V_few / P_exact.sum(axis=1, keepdims=True)
print(f"with a stale max (threshold 8 in log2 units): largest P {p_max:.2f}, largest difference from the exact "
      f"softmax output {np.abs(o_stale - o_exact).max():.1e}")

# **Step 5. O += PV, P straight from registers.** Section 4 in code: two n-tiles of P packed into one A
# fragment (`pack`), V's B fragments through `ldmatrix_x4_trans`. (The 3xTF32 build sums each tile's PV from
# zero on the tensor cores and adds it to O with an fp32 multiply-add: a tensor-core accumulator summing
# thousands of keys rounds differently from fp32 adds, and its error grows with N.)

# %%
print(tensor.float16_source("pv"))

# %% [markdown]
# **Step 6. Finish.** Add up each row's l over its quad, divide once, write O (16-bit outputs packed in
# pairs again) and the log-sum-exp the backward pass needs.

# %%
print(tensor.float16_source("finish"))

# %% [markdown]
# ### Run it
#
# In the simulator, on one warp per block and a shape that is not a multiple of anything (under a second
# per run on a 2-core CPU: every `mma`, `ldmatrix` and shuffle is a meeting of 32 Python threads); on a GPU, at
# a real size.
# float16 and float32 (3xTF32 and 1xTF32) through the public API; bfloat16 needs torch tensors on a GPU.

# %%
nq, nk, d = device.kernel_size(1000, 20), device.kernel_size(1000, 37), device.kernel_size(64, 16)
tile = {} if ON_GPU else {"block_q": 16, "block_k": 16}  # one warp per block in the simulator
q, k, v = (rng.standard_normal((1, 2, n, d)) for n in (nq, nk, nk))
for dtype, precision in ((np.float16, None), (np.float32, "3xtf32"), (np.float32, "tf32")):
    if CC is not None and CC < (8, 0) and dtype == np.float32:
        print("float32 on tensor cores needs tf32 mma (compute capability 8.0); skipped on this GPU")
        continue
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
    o, lse = flash_attention(qd, kd, vd, causal=True, variant="tensor", precision=precision, **tile)
    ref, ref_lse = reference_attention(qd.astype(np.float64), kd.astype(np.float64), vd.astype(np.float64),
                                       causal=True)
    print(f"{np.dtype(dtype).name:8s} {precision or 'f16':7s} Nq={nq} Nk={nk} d={d} causal: "
          f"o error {relative_error(o, ref):.1e}, lse error {relative_error(lse, ref_lse):.1e}")

# %% [markdown]
# On a GPU, time it against torch's SDPA in the same dtype, at B = 1, H = 16, N = 4096, d = 64 (CUDA events,
# median of 10 after warm-up; the first call compiles), twice: the whole `flash_attention` call, and the
# launch alone on arrays prepared once (`forward.prepare`, what `benchmarks/timing/bench_kernels.py` times). The
# difference is flashlab's Python work per call: checking the inputs, wrapping torch's memory for Numba,
# allocating the outputs. While Python works the GPU waits, so the events see it. Without a GPU this cell
# does nothing; section 7 shows the committed measurements.

# %%
if ON_GPU:
    import torch

    from flashlab.bench import attention_flops, time_cuda, tflops

    Bt, Ht, Nt, dt = 1, 16, 4096, 64
    flops = attention_flops(Bt, Ht, Nt, Nt, dt)
    for tdtype in (torch.float16,) if CC < (8, 0) else (torch.float16, torch.bfloat16, torch.float32):
        qt, kt, vt = (torch.randn(Bt, Ht, Nt, dt, device="cuda", dtype=tdtype) for _ in range(3))
        call = time_cuda(lambda: flash_attention(qt, kt, vt, variant="tensor"), warmup=2, reps=10)["median_ms"]
        launch = time_cuda(forward.prepare(qt, kt, vt)[0], warmup=2, reps=10)["median_ms"]
        sdpa = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt), warmup=2,
                         reps=10)["median_ms"]
        print(f"{str(tdtype):15s} flash_attention call {tflops(flops, call):6.1f} TFLOP/s, launch alone "
              f"{tflops(flops, launch):6.1f}, torch SDPA {tflops(flops, sdpa):6.1f}")

# %% [markdown]
# float16's error comes from rounding the output (and P) to float16; 3xTF32 is at fp32's level, 1xTF32 at
# float16's, as section 5 predicted. `tests/test_tensor_kernel.py` runs the same checks, on ragged,
# causal and single-key shapes, in the simulator and on a GPU.

# %% [markdown]
# ## 7. How fast is it?
#
# `benchmarks/timing/bench_kernels.py` times the tensor kernel in each precision, the register kernel (lesson 09,
# fp32 units) and torch's SDPA in the *same* dtype, at B = 1, H = 16 (CUDA events, medians; its file is
# `flashlab/data/h100_tensor.csv`). Solid lines are flashlab, dashed ones torch.

# %%
rows = tviz.load_tensor_results()
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
for ax, dd in zip(axes, (64, 128)):
    tviz.plot_tensor_speed(rows, d=dd, ax=ax)
fig.tight_layout()
plt.show()
if rows:
    n_max = max(r["N"] for r in rows)
    for r in rows:
        if r["N"] == n_max and r["causal"] == 0:
            print(f"N={r['N']} d={r['d']:3d} {r['impl']:24s} {r['tflops']:6.1f} TFLOP/s, "
                  f"{r['ratio']:.0%} of torch SDPA in {r['dtype']}")
else:
    print("no benchmark data found (flashlab/data/h100_tensor.csv is missing from this install)")

# %% [markdown]
# **On a T4** (Colab's GPU, compute capability 7.5) the same kernel builds differently, and the planner says
# how: float16 runs as two `m16n8k8` per k16 step with copies through registers (no `cp.async`), and
# bfloat16 and float32 have no tensor-core path at all. What the datasheets allow there, against the H100:

# %%
from flashlab.kernels import plan as kplan
from flashlab.roofline import PUBLISHED, PUBLISHED_FP32

for gpu_name in ("T4", "H100"):
    print(f"{gpu_name}: datasheet FP16 tensor cores {PUBLISHED[gpu_name].peak_flops / 1e12:.0f} TFLOP/s, "
          f"{PUBLISHED[gpu_name].peak_flops / PUBLISHED_FP32[gpu_name]:.0f} times its FP32 units")
t4_plan = kplan.plan((1, 16, 4096, 64), dtype="float16", variant="tensor", device="T4")
print("\n".join(t4_plan.explain().splitlines()[:3]))
print("(no T4 run is recorded: the figures above are the H100's)")

# %% [markdown]
# And against the instruction's own ceiling from section 1: how much of what `mma.sync` can do from Numba
# does the whole kernel get? Attention's FLOPs counted as 4·N²·d, as everywhere in the course.

# %%
tviz.plot_ceiling_shares(rows, ceiling)
plt.show()

# %% [markdown]
# On lesson 10's roofline, with the measured `mma.sync` ceilings as roofs. The kernel's intensity comes from
# lesson 10's traffic model: Q read and O written once, K and V read from HBM once per query block. Before you
# run the cell: left or right of the ridge points?

# %%
from flashlab.viz import gpu as gviz

fwd, _ = gviz.load_forward_results()
N_roof, d_roof = 4096, 64
points = tviz.tensor_roofline_points(rows, N=N_roof, d=d_roof)
reg = [r for r in fwd if r.get("N") == N_roof and r.get("d") == d_roof and r.get("impl") == "flashlab register fp32"]
if reg:
    points["flashlab register fp32"] = (gviz.kernel_intensity(N_roof, d_roof, 128), reg[0]["tflops"] * 1e12)
gviz.plot_kernel_roofline(points, roofs=tviz.mma_roofs(ceiling))
plt.show()
if "flashlab tensor f16" in points and "fp16 m16n8k16" in ceiling:
    intensity, achieved = points["flashlab tensor f16"]
    bw = PUBLISHED["H100"].bandwidth
    print(f"float16 kernel: {intensity:.0f} FLOP/byte by the model, {achieved / 1e12:.0f} TFLOP/s measured")
    print(f"ridge points: measured mma.sync roof {ceiling['fp16 m16n8k16'] * 1e12 / bw:.0f} FLOP/byte, "
          f"datasheet {PUBLISHED['H100'].peak_flops / bw:.0f}")
    print(f"what HBM allows at that intensity: {bw / 1e12:.2f} TB/s x {intensity:.0f} = {bw * intensity / 1e12:.0f} TFLOP/s")
    kv_bytes = 16 * 2 * N_roof * d_roof * 2  # K and V of all 16 heads, float16
    print(f"K and V of all 16 heads: {kv_bytes / 2**20:.0f} MiB, against {GPUS['H100'].l2_bytes / 2**20:.0f} MiB of L2; "
          f"read from HBM once per head, the intensity would be "
          f"{gviz.kernel_intensity(N_roof, d_roof, N_roof, bytes_per_element=2):.0f} FLOP/byte")

# %% [markdown]
# By the model's count the float16 kernel sits *left* of both ridge points, on the sloped part of the roofline
# where a kernel is memory-bound. Yet memory is not what holds it back, for two reasons the cell prints. First,
# even if every byte of the model came from HBM, the bandwidth would allow more than the kernel reaches.
# Second, the count is pessimistic: the thread blocks that run at the same time include many query blocks of
# one head, and they all walk the same K and V tiles in the same order, tile 0 first, at about the same time;
# the first block to read a tile brings it into L2 and the others find it there. At N = 4096 the K and V of
# all heads fit in L2 together, so HBM sees each of them about once, and counted that way the intensity is far
# right of every ridge. What separates the kernel from its roof happens inside the SM: the instruction mix of
# section 6.
#
# What the measurements say, and what they do not:
#
# - The speed and the ratios come from one benchmark file on one H100; rerun the script for your GPU, and
#   always compare with torch measured in the same run. The scripts are in the course's repository, not in
#   the installed package: in Colab, `!git clone` the repository named in the setup cell at the top, and run
#   the same command from inside the clone.
# - In float32, SDPA also runs 3xTF32 on tensor cores: the printed ratios say how close the kernel gets.
#   1xTF32 is faster than 3xTF32 because it gives up accuracy; a fair comparison names its precision.
# - In float16 and bfloat16, SDPA's kernels are FlashAttention-2's (and cuDNN's): compiled C++ tuned over
#   years, where ours is one Python module. The next section lists where they differ.
#
# ## 8. The backward on tensor cores
#
# Lesson 06's backward has five matrix products per tile. `flashlab/kernels/tensor_backward.py` runs them
# on `mma.sync` with the forward's tricks, and one new one. Its thread block owns a block of keys, and each
# warp owns 16 of them, so that dK and dV (one row per key) can sit in registers for the whole loop over
# query tiles, as O does in the forward. The figure shows one block (4 warps, a tile of 32 queries) and
# where each operand comes from.

# %%
tviz.plot_backward_block(warps=4, block_q=32, query=5)
plt.show()

# %% [markdown]
# What to see:
#
# - A warp's accumulators must have *keys* as rows, so every warp computes its band of the transposes,
#   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, instead of S and dP. Its rows are the warp's 16 keys, its columns the tile's
#   queries, and it comes out of the `mma` as C fragments (section 4's picture, turned on its side).
# - Pᵀ and dSᵀ, computed from those C fragments, are exactly the A operands of dV += Pᵀ dO and
#   dK += dSᵀ Q: two 8-query n-tiles of C are one 16-query k-step of A, as P was in the forward. dK and
#   dV never leave the warp.
# - dQ is the odd one out. Its rows are queries, and one query's row of dS (outlined) is a *column* of dSᵀ
#   that crosses every warp's band, 16 keys in each. So dSᵀ goes through shared memory before the warps
#   split dQ's tile between them.
#
# The five products, with the operands each `mma` gets (16-bit inputs; section 3 for `ldmatrix`):
#
# | product | A operand (16 rows) | B operand | C / D |
# | --- | --- | --- | --- |
# | Sᵀ = K Qᵀ | K: `ldmatrix` from shared memory | Q: `ldmatrix` (stored row-major, read as B's columns) | Sᵀ, rows = keys |
# | dPᵀ = V dOᵀ | V: held in registers (or `ldmatrix` when the tile keeps V in shared memory) | dO: `ldmatrix` | dPᵀ, rows = keys |
# | dV += Pᵀ dO | Pᵀ: straight from Sᵀ's C fragments (section 4's trick) | dO: `ldmatrix.trans` (like V in the forward) | dV in registers |
# | dK += dSᵀ Q | dSᵀ: straight from its C fragments | Q: `ldmatrix.trans` | dK in registers |
# | dQ += dS K | dS: `ldmatrix.trans` of dSᵀ, **after a trip through shared memory** | K: `ldmatrix.trans` | added to dQ with atomics |
#
# Between the products, Pᵀ = exp(scale·Sᵀ − lse) and dSᵀ = Pᵀ ∘ (dPᵀ − D) are computed in fp32 on the C
# fragments. lse and D belong to queries, so they now index *columns*. Pᵀ and dSᵀ are rounded to 16 bits
# before their products, as in FlashAttention-2. In float32 (1xTF32 and 3xTF32) the kernel reads every
# operand from shared memory with plain 32-bit loads instead of `ldmatrix`, and reuses C fragments as A
# fragments with section 4's renumbering of the k index.
#
# Even within one warp, dS's values sit in the wrong lanes for dQ: the figure colours every cell by the
# lane that holds it, as a C fragment of dSᵀ (left) and as the A fragment dQ's `mma` needs (right).

# %%
tviz.plot_ds_transpose(lane=5)
plt.show()
src = tviz.ds_sources()
moved = (src[:, :, 1] != np.arange(32)[:, None]).mean()
print(f"{moved:.1%} of the A fragment's values sit in another lane's C fragment")

# %% [markdown]
# So each warp stores its dSᵀ to shared memory, key-major: C's neighbours c0, c1 (columns 2t and 2t+1) are
# neighbouring queries of one key, so they go out as one packed 32-bit word. The block synchronises, and
# `ldmatrix.trans` reads the stored 8 x 8 blocks back transposed: query-major, which is exactly dS's A
# fragment, the same instruction that turns V around in the forward. Here is that round trip for one
# warp's 16 keys x 16 queries, with section 3's `load_both` kernel doing the reading (the simulator's
# `ldmatrix`, or the real one on a GPU):

# %%
dS_T = F.round_f16(rng.standard_normal((16, 16)))  # one warp's dSᵀ: 16 keys x 16 queries
c_tiles = [F.to_fragments(dS_T[:, 8 * n:8 * n + 8], "m16n8k16", "C") for n in range(2)]  # n-tile n: queries 8n..

# Store: lane (g, t) writes (c0, c1) to row g and (c2, c3) to row g + 8, word 4n + t (queries 8n + 2t, + 1).
lanes = np.arange(32)
g, t = lanes // 4, lanes % 4
stored = np.zeros((16, 8), np.uint32)  # rows = keys, 8 words = 16 queries
for n, c in enumerate(c_tiles):
    bits = F.to_bits16(c, "float16")
    stored[g, 4 * n + t] = F.pack16(bits[:, 0], bits[:, 1])
    stored[g + 8, 4 * n + t] = F.pack16(bits[:, 2], bits[:, 3])

# Read: ldmatrix.x4.trans, register r from the 8 x 8 block of keys 8 (r // 2).. and query words 4 (r % 2)..
blocks = np.concatenate([stored[8 * (r // 2):8 * (r // 2) + 8, 4 * (r % 2):4 * (r % 2) + 4] for r in range(4)])
plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
load_both[1, 32](np.ascontiguousarray(blocks), plain, trans)
want = registers16(F.to_fragments(dS_T.T, "m16n8k16", "A"))  # dS (rows = queries) as dQ's A operand
print("ldmatrix.trans of the stored dSᵀ is dS's A fragment:", np.array_equal(trans, want))
print("plain ldmatrix of the same words is not:", not np.array_equal(plain, want))

# %% [markdown]
# **Why atomics for dQ.** Each block holds one block of keys, so it sees only its share of a query's dQ;
# the other key blocks hold the rest. Two ways to add the shares up:
#
# - a second pass that loops over the key blocks of each query block. It must recompute Sᵀ and dPᵀ, two
#   more of the five products, and read K and V again. All five have the same size (Nq·Nk·d multiply-adds),
#   so that is 2/5 = 40% more FLOPs;
# - float32 `atomicAdd` into a dQ accumulator in global memory, then a cast to q's dtype. FlashAttention-2
#   does this (its `dq_accum`), and so does this kernel.
#
# The atomics' price: float32 additions happen in the order blocks finish, so dQ can change in its last
# bits from run to run, where dK and dV (written once, by one block) do not. The GPU test suite checks both
# (`tests/test_tensor_backward.py`). Under grouped-query attention (lesson 18's topic: fewer K/V heads than
# query heads), a block walks the query tiles of every query head that shares its K/V head, so dK and dV
# add up in registers and need no atomics either.
#
# The kernel runs in the simulator like the forward, every `mma` and `ldmatrix` emulated for the warp; on
# a small ragged, causal problem against float64 gradients:

# %%
from flashlab.kernels import flash_attention_backward

qb, kb, vb, dob = (rng.standard_normal((1, 1, n, 16)).astype(np.float16) for n in (19, 23, 23, 19))
f64 = [x.astype(np.float64) for x in (qb, kb, vb, dob)]
ob, lseb = reference_attention(*f64[:3], causal=True)
want_grads = flashlab.flash_attention_v2_backward(*f64[:3], ob, lseb, f64[3], causal=True)
got_grads = flash_attention_backward(qb, kb, vb, ob.astype(np.float16), lseb.astype(np.float32), dob, causal=True,
                                     variant="tensor", block_q=16, block_k=16)
for name, g, w in zip(("dQ", "dK", "dV"), got_grads, want_grads):
    print(f"{name}: relative error {relative_error(g.astype(np.float64), w):.1e} (float16 inputs and outputs)")

# %% [markdown]
# On a GPU this backward is the default for float16 and bfloat16 gradients (float32 keeps the FP32-unit
# kernel unless you ask for `variant="tensor"`, which runs 3xTF32). `bash benchmarks/check_tensor_backward_gpu.sh bench`
# times it against torch SDPA's backward in the same dtype and the same run (`flashlab/data/tensor_backward.json`);
# the dashed line is SDPA.

# %%
bwd = tviz.load_backward_results()
if bwd:
    tviz.plot_backward_speed(bwd)
    plt.show()
    for r in (r for r in bwd["rows"] if r["n"] == 4096):
        print(f"d={r['d']:3d} causal={str(r['causal']):5s} {r['dtype']:8s} tile {r['config']:18s} "
              f"{r['tflops']:5.1f} TFLOP/s, {r['vs_sdpa']:4.0%} of SDPA; {r['regs']} registers/thread, "
              f"{r['smem_bytes'] // 1024} KB shared")
    for dt, r in bwd["dq_run_to_run"].items():
        print(f"dQ run to run ({dt}): largest change {r['dq_max_rel']:.1e} of max |dQ|; "
              f"dK and dV identical: {r['dk_dv_identical']}")
else:
    print("no benchmark data found (flashlab/data/tensor_backward.json is missing from this install)")

# %% [markdown]
# Read the printed rows for this run's numbers. On the H100 the 16-bit backward runs at about a third of
# SDPA's speed at N = 4096 (more under causal masking), and 3xTF32 at d = 64 at about SDPA's own float32
# speed (less at d = 128). These are whole calls, host included: the checks, the plan and numba's typing of
# three kernels' arguments happen once per shape and options, and later calls only allocate the gradients
# and launch (`kernels/prepared.py`; `docs/runs/tensor-backward.md` shows what that saved).
#
# **Bigger tiles need more than 48 KB.** The kernel's shared memory is one *dynamic* array (lesson 7), sized
# at launch, and the kernel opts in to more than 48 KB where the device allows it. That is what lets a block
# own 128 keys (8 warps) at d = 128: 78 KB, where a 48 KB tile holds 64 keys. Each block then streams Q_i and
# dO_i and adds its dQ atomics once for twice as many keys; at d = 128 the bigger tile measured 1.37x faster
# than the 48 KB one (`benchmarks/results/logs-tensor-backward/tiles_dynamic_h100.txt`). The registers tell the rest of the story:
# an SM has 64K of them, so a tile that needs close to 255 a thread fits 8 warps per SM, too few to hide all
# of the latency of the shared-memory loads between the `mma`. The atomics' price is visible too: dQ moves in
# its last bits between identical calls, while dK and dV come out bit for bit the same.
#
# How much shared memory each tile needs, against what a block may have (bars: `BackwardTile.shared_words`,
# the layout the kernel uses; lines: static shared memory, and the opt-in limits of a T4 and an H100):

# %%
from flashlab.kernels import tensor_backward as tb

tiles = [("16-bit d128, 16x64", 128, "f16", tb.BackwardTile(4, 16, 2)),
         ("16-bit d128, 32x128 (default)", 128, "f16", tb.BackwardTile(*tb.DEFAULT_TILES["16-bit"][128])),
         ("16-bit d64, 32x128", 64, "f16", tb.BackwardTile(8, 32, 2)),
         ("16-bit d64, 64x128 (default)", 64, "f16", tb.BackwardTile(*tb.DEFAULT_TILES["16-bit"][64])),
         ("3xTF32 d64, 32x64 V shared (default)", 64, "3xtf32", tb.BackwardTile(*tb.DEFAULT_TILES["float32"][64])),
         ("3xTF32 d128, 16x64 V shared (default)", 128, "3xtf32", tb.BackwardTile(*tb.DEFAULT_TILES["float32"][128]))]
kib = [4 * tile.shared_words(d, prec) / 1024 for _, d, prec, tile in tiles]
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.barh([name for name, *_ in tiles], kib, color="tab:blue")
for x, label, style in ((48, "48 KB: static shared memory", ":"), (64, "64 KB: a T4's opt-in limit", "--"),
                        (GPUS["H100"].shared_per_block / 1024, "227 KB: an H100's opt-in limit", "-")):
    ax.axvline(x, color="tab:red", linestyle=style, label=label)
ax.legend(loc="center right", fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("shared memory per block (KB)")
ax.set_title("The tensor backward's tiles (block_q x block_k)")
plt.tight_layout()
plt.show()
for (name, *_), k in zip(tiles, kib):
    print(f"{name:40s} {k:6.1f} KB {'fits 48 KB' if k <= 48 else 'needs the opt-in'}")

# %% [markdown]
# ## 9. Where this kernel differs from FlashAttention-2 and -3
#
# - **Tile sizes.** FA2's d = 64 forward gives a block of 4 warps 128 query rows and 128 keys per tile
#   (`Flash_fwd_kernel_traits<64, 128, 128, 4>`), so each warp has two m-tiles, as ours has for 16-bit inputs;
#   ours takes 64 keys per tile at d = 64, because it keeps to 48 KB and its registers run out sooner. FA2 does
#   not keep two m-tiles at every head dimension: at d = 192 and 256 its tiles are 128 rows for 8 warps or 64
#   rows for 4 (`Flash_fwd_kernel_traits<256, 64, 64, 4>`, in `flash_fwd_launch_template.h`), one m-tile of 16
#   rows per warp, because a warp's O accumulators grow with d and the registers run out. In float32 ours keeps
#   one m-tile per warp for the same reason: 3xTF32's extra fragments need the registers.
# - **Shared memory.** The forward here uses static shared memory, which caps a block at 48 KB; an H100
#   block may use up to 227 KB with the dynamic opt-in (`flashlab.hardware`), which only our backward uses
#   (up to 104 KB). FA2 and FA3 use that room for bigger tiles and deeper pipelines in both passes.
# - **Layouts.** FA2 (through CUTLASS's CuTe) *swizzles* its shared-memory layouts, permuting 16-byte chunks
#   by XOR so that neither the copies nor `ldmatrix` conflict on banks; we pad each row by 16 bytes, which
#   costs a little memory.
# - **Compilation.** FA2 is CUDA C++ compiled ahead of time, with templates specialised per head dimension;
#   ours is compiled by Numba when first called, specialised per (d, tile, causal, precision).
# - **Hopper.** FlashAttention-3 replaces `mma.sync` with `wgmma` (a warpgroup of 4 warps, operands read
#   from shared memory, asynchronous) and `cp.async` with TMA (one thread copies a whole tile), and splits
#   warps into producers and consumers (lesson 11). That is how it gets past `mma.sync`'s ceiling.
# - **The backward pass** (section 8) gives each warp 16 keys and all of a query tile, so a block of 128
#   keys needs 8 warps. FA2's d = 128 backward on sm80 also has 8 warps for 128 keys x 64 queries, but lays
#   them out 4 x 2 over dK and dV's keys and dimensions (its `Flash_bwd_kernel_traits`), so each warp holds
#   32 keys x 64 dimensions of them, where ours holds 16 keys x 128. Ours keeps V's fragments in registers (16-bit) or in shared
#   memory (3xTF32), where FA2 tunes this per head dimension.

# %%
print(f"shared memory per block: H100 {GPUS['H100'].shared_per_block // 1024} KB with the opt-in, "
      f"{GPUS['H100'].static_shared_per_block // 1024} KB static (what the forward kernels use)")

# %% [markdown]
# ## Summary
#
# - One `mma.sync` is a matrix product of the whole warp; each lane brings its fragment of A, B and C.
# - The fragment layouts decide the code: a quad of lanes shares rows, so row reductions need two shuffles;
#   C's layout is A's, so P stays in registers; B runs down columns, so V comes through `ldmatrix.trans`.
# - tf32 has float16's precision and float32's range; 3xTF32 buys back fp32 accuracy with three products, as
#   long as long sums are not left to the tensor core's truncating accumulator.
# - A kernel's instructions are a budget: one issue per cycle per scheduler, shared by the softmax, the address
#   arithmetic and the HMMAs. Hoist 64-bit address work out of the loop; skip rescales that change nothing.
# - A roofline point is only as good as its byte count: bytes that L2 serves are not HBM's.
# - A FlashAttention-2 forward on tensor cores fits in one Python module, runs in the simulator, and its
#   measured speed shows both how far tensor cores go past FP32 units and how far a first kernel stays from
#   the hardware's ceiling.
# - The backward keeps dK and dV in registers by giving each warp 16 keys, so it computes Sᵀ and dPᵀ; Pᵀ
#   and dSᵀ feed dV and dK straight from registers, but dQ needs dS with queries as rows, which means a
#   trip through shared memory and `ldmatrix.trans`, and float32 atomics to sum the key blocks' shares.
#
# **Exercises:** [15_tensor_cores](../exercises/15_tensor_cores.ipynb): write the fragment map, emulate a
# warp's mma in NumPy from packed registers, split float32 into tf32 parts and build a 3xTF32 product,
# write the S = QKᵀ step of one warp as a Numba kernel on `mma.sync`, graded in the simulator, find
# where each value of the backward's dS fragment sits in the warp's dSᵀ, and count the shared memory a
# backward tile needs (which tiles fit 48 KB, and which need the opt-in).
