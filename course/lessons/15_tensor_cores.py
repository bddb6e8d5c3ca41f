# %% [markdown]
# # 15 · Tensor cores: the instruction
#
# Lessons 08 to 10 built FlashAttention on the GPU's FP32 units: one fused multiply-add per thread per
# instruction. Every recent NVIDIA GPU also has **tensor cores**, units that multiply small matrices, and
# PyTorch's attention uses them even for float32 inputs. numba-cuda has no tensor-core API, but a Numba
# kernel can emit any PTX instruction, and `flashlab.kernels.mma` does exactly that. Three lessons open up
# `variant="tensor"`, a FlashAttention-2 written in pure Python on `mma.sync`: this one is about the
# instruction itself, lesson 16 builds the forward kernel from it, and lesson 17 the backward.
#
# **After this lesson you can**
# - say what one warp-level matrix instruction computes, who takes part, and how much more work it does
#   than an FP32 instruction;
# - measure a hardware ceiling without fooling yourself: random operands, an A/B in one run, clocks recorded;
# - read and draw the fragment layouts of `mma.m16n8k16` (float16/bfloat16) and `mma.m16n8k8` (tf32):
#   which lane holds which element of A, B and C in which register;
# - say which lane gives which row address to `ldmatrix`, and why V is loaded with `ldmatrix.trans`;
# - explain why P never leaves registers between S = QKᵀ and O = PV;
# - split a float32 number into two tf32 numbers and say what 3xTF32 costs and buys, against 1xTF32,
#   float16 and bfloat16, and why long sums stay out of the tensor core's accumulator.
#
# Sources: PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions" (`mma`, its fragment layouts,
# `ldmatrix`) and "cvt"; 3xTF32 from NVIDIA's CUTLASS 2.8 and Ootomo and Yokota, "Recovering single precision
# accuracy from Tensor Cores while surpassing the FP32 theoretical peak performance" (2022, arXiv 2203.03341);
# Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores" (PeerJ Computer Science,
# 2021) for how tensor cores add.

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import device, fragments as F
from flashlab.hardware import GPUS
from flashlab.kernels import mma
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
    print(f"3xTF32 (three tf32 mma per product, section 5; derived as the tf32 ceiling / 3, not measured, and an "
          f"upper bound: it leaves out the split's own instructions): {three / PUBLISHED_FP32['H100']:.1f} times "
          "the FP32 units' peak")

# %% [markdown]
# Two things to read off. Tensor cores are in another league than the FP32 units, so moving attention's
# two products onto them is the next big step. And `mma.sync` does not reach the datasheet number on an
# H100: Hopper's full tensor-core rate needs `wgmma`, an asynchronous instruction of a *warpgroup* (4 warps)
# that reads B (and optionally A) straight from shared memory. Without it, `mma.sync` reaches about two
# thirds of the peak (FlashAttention-3 blog post, July 2024, note 1, citing Luo et al., arXiv 2402.13499).
# That figure comes from other code on other inputs, so it is no check of ours; the next paragraph is about
# why two ceilings measured in two ways need not agree. FlashAttention-3 is built on `wgmma`. It finds its
# shared-memory operands through *matrix descriptors* that encode a swizzled layout, and runs asynchronously
# between fences and commit/wait groups; lesson 20 builds FlashAttention-3 on it, from the same kind of Numba
# `@intrinsic` this lesson uses. Lessons 15–17 stay with `mma.sync`: every GPU since Ampere has it (and, in its
# m16n8k8 form, Colab's T4), and its fragments are the ones `wgmma` keeps.
#
# **Measuring a ceiling honestly.** A tensor core's speed can depend on the data: multiplying zeros, or the
# same few bits again and again, toggles few transistors, and a GPU that has reached its power limit lowers its
# clock when the bits toggle more (Horace He, "Strangely, Matrix Multiplications on GPUs Run Faster When Given
# 'Predictable' Data!", 2024). A kernel that feeds its `mma` constants, as a benchmark without input data is
# tempted to, can measure a ceiling no real product reaches. Three habits:
# - feed random operands, different for each independent chain, loaded from memory so that the compiler
#   cannot fold them;
# - compare two variants in one run, alternating them, with the same compiled kernels where possible (here
#   only the data differ), so that a difference between runs, a warmer GPU or another clock, is not read as
#   a difference between the variants;
# - record the SM clock and the power beside each number: a reading near the board's power limit says the limit
#   may be in play, one well below it says it was not.
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
# the same clock with a lower rate points at the instruction itself, a lower clock at something that throttled
# it. In the committed H200 run, random operands ran at a lower clock than constant ones, *and* at a lower
# average board power, every reading well under the H200's 700 W limit: the clock drop is real, but these
# readings do not show the power limit as its cause (the board's power is averaged over about a second, and the
# GPU may throttle on other grounds). Where the file records neither clock nor power, the honest statement is
# that a gap is unexplained.

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


A = F.round_f16(rng.standard_normal((16, 16)))  # values float16 can hold exactly
B = F.round_f16(rng.standard_normal((16, 8)))
C = rng.standard_normal((16, 8)).astype(np.float32)
a = F.registers16(F.to_fragments(A, "m16n8k16", "A"))  # two 16-bit values per register
b = F.registers16(F.to_fragments(B, "m16n8k16", "B"))
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

# %% [markdown]
# Which lane points where: for a 16 x 16 A operand, `ldmatrix.x4` loads four 8 x 8 matrices, and lanes 8i to
# 8i + 7 give the row addresses of matrix i (PTX ISA, "ldmatrix"). Matrix i lands in register i of every lane,
# so the order of the four matrices must be the A fragment's: rows 0-7, then rows 8-15 of the first 8 columns,
# then the same for the next 8.

# %%
from flashlab.viz import kernel_tiles

kernel_tiles.plot_ldmatrix_x4_addresses()
plt.show()


from flashlab.kernels.demo import kernel_source, ldmatrix_both

print(kernel_source(ldmatrix_both))  # one warp, 32 rows of 16 bytes, read back both ways

values = np.add.outer(10 * np.arange(32), np.arange(8)).astype(np.float32)  # row r, col j holds 10 r + j
words = F.registers16(values)
plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
ldmatrix_both[1, 32](words, plain, trans)
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
# dropping $a_{small} b_{small}$, which is at or below fp32's rounding level (so 3xTF32 lands close to fp32's
# accuracy, not exactly on it). Three `mma` per product: section 1 printed
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
# tensor cores for one key tile at a time and added to O with an fp32 multiply-add (lesson 16, step 5). CUTLASS's
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
# ## Summary
#
# - One `mma.sync` is a matrix product of the whole warp; each lane brings its fragment of A, B and C.
# - A ceiling is measured on random operands, in one run for an A/B, with the clock and power beside it: the bits a
#   tensor core multiplies can change its speed, and the clock and power say what can and cannot explain it.
# - The fragment layouts decide the code: a quad of lanes shares rows, so row reductions need two shuffles;
#   C's layout is A's, so P stays in registers; B runs down columns, so V comes through `ldmatrix.trans`.
# - tf32 has float16's precision and float32's range; 3xTF32 buys back fp32 accuracy with three products, as
#   long as long sums are not left to the tensor core's truncating accumulator.
#
# Next, lesson 16 builds the FlashAttention-2 forward from these pieces.
#
# **Exercises:** [15_tensor_cores](../exercises/15_tensor_cores.ipynb): write the fragment map, emulate a
# warp's mma in NumPy from packed registers, split float32 into tf32 parts and build a 3xTF32 product.
