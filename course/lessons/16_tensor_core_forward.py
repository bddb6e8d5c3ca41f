# %% [markdown]
# # 16 · The tensor-core forward
#
# Lesson 15 took one `mma.sync` apart: who holds which element, how `ldmatrix` brings operands in, and why P
# can stay in registers. This lesson puts those pieces together into `variant="tensor"`'s forward, lesson 09's
# FlashAttention-2 with both products on tensor cores, written in pure Python, and then asks what holds it
# back from the instruction's ceiling.
#
# **After this lesson you can**
# - follow the tensor kernel step by step: Q's fragments, the double-buffered K/V copies, S = QKᵀ, the mask,
#   the online softmax on C fragments with two shuffles, O += PV with P from registers, and the finish;
# - say why shared-memory rows are padded (or swizzled), from the 8-lane phases of a 16-byte access;
# - read a kernel's instruction mix from Nsight Compute's counters, check whether issue slots can be what keeps
#   its tensor cores waiting (here they are not), and keep address arithmetic out of the loop;
# - skip O's rescale when no row's max grew, or (as FlashAttention-4 does) until it grew past a threshold, say
#   why the result stays exact, and estimate how often each rescales;
# - run the kernel in the CUDA simulator, read its measured speed against PyTorch, the FP32 kernels and the
#   tensor cores' ceiling, and place it on the roofline, saying when a traffic model's bytes are not HBM's.
#
# Sources: FlashAttention-2 (Dao 2023, arXiv 2307.08691) for the algorithm and its split of the work between
# warps; PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions", "cp.async", "shfl.sync" and
# "vote.sync"; FlashAttention-4 (Zadouri et al. 2026, arXiv 2603.05451) for the rescale threshold.

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import device, fragments as F, reference_attention, relative_error
from flashlab.hardware import GPUS
from flashlab.kernels import flash_attention, forward, tensor
from flashlab.roofline import PUBLISHED
from flashlab.viz import tensor as tviz

ON_GPU = device.has_gpu()
CC = device.device_limits()["cc"]  # None in the simulator
rng = np.random.default_rng(0)
ceiling = tviz.load_mma_ceiling()  # lesson 15, section 1: what mma.sync reaches from Numba
print("running on:", device.device_limits()["name"], "" if ON_GPU else "(every warp instruction is emulated)")

# %% [markdown]
# ## 1. The kernel, step by step
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
#
# Why the warps split the query rows and not the keys: split the keys, and every warp ends a tile with a partial
# max, sum and O for every row, which the warps must merge through shared memory, with barriers, before the next
# tile; split the rows, and each warp owns its rows' statistics outright (left: FlashAttention-1's kernels;
# right: FlashAttention-2's, and this one).


# %%
from flashlab.viz import kernel_tiles

kernel_tiles.plot_warp_partition()
plt.show()

# %% [markdown]
# Then the tiles, from the block down to one instruction: the block's query rows split into one band per warp,
# each band into 16-row m-tiles; the key tile into 8-key n-tiles; and each (m-tile, n-tile) pair of S is one
# `mma` per 16-dim k-step.

# %%
tile = tensor.choose_tile(64, "f16")  # the float16 forward's default tile at d = 64
kernel_tiles.plot_tile_hierarchy(block_q=tile.block_q, block_k=tile.block_k, warps=tile.warps, m_tiles=tile.m_tiles)
plt.show()
print(tile)

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

# %% [markdown]
# Padding is one fix; FlashAttention-2 (through CuTe) uses the other, a **swizzle**: the rows stay 128 bytes
# apart, but chunk c of row r is stored at chunk c ^ (r % 8) of its row. Each row still holds all its chunks,
# only permuted, so nothing is wasted, and the 8 rows of a phase again land in 8 different bank groups. The price
# is that every address goes through the XOR. The three layouts of a 128-byte-row tile, each chunk labelled with
# its bank group (the outlined column is what one `ldmatrix` phase reads):

# %%
kernel_tiles.plot_swizzle_vs_padding(128)
plt.show()
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
# into the mix of the loop body, per warp and key tile, of the float16 forward at d = 64, for three variants of
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
# Is that budget what limits this kernel? Count how long one HMMA keeps a partition's tensor core busy: at the
# `mma.sync` ceiling of lesson 15, with the clock recorded beside it, each partition finishes so many FLOPs a
# cycle, and one m16n8k16 is 2 · 16 · 8 · 16 of them. (The ceiling was measured on an H200, whose SM is the H100's.)

# %%
ceil_row = next((r for r in tviz.mma_ceiling_rows() if r["instruction"] == "fp16 m16n8k16"
                 and r["operands"] == "random" and isinstance(r.get("sm_clock_mhz"), float)), None)
if mix and ceil_row:
    per_partition = ceil_row["tflops"] * 1e12 / (ceil_row["sm_clock_mhz"] * 1e6 * GPUS["H100"].sms * 4)
    hmma_cycles = 2 * 16 * 8 * 16 / per_partition
    now = mix["loop_body"]["now"]
    needed = sum(now.values()) / now["HMMA"]
    print(f"one HMMA keeps a partition's tensor core busy {hmma_cycles:.1f} cycles at the ceiling; the loop issues "
          f"{needed:.1f} instructions per HMMA (the HMMA included): "
          + ("the issue budget has room for the whole mix" if needed < hmma_cycles else "the mix overflows it"))

# %% [markdown]
# So issue slots are not this kernel's limit. Nsight Compute's scheduler statistics for an earlier build
# (`benchmarks/results/h100/`) show fewer than three warps per scheduler and, in about half of all cycles, no
# warp ready to issue: latency. Each warp's softmax is a chain of dependent instructions, `ldmatrix` and `mma`
# have latencies of their own, and registers and shared memory keep the warps too few to hide them. The mix
# still matters: every instruction in a dependent chain adds its latency.
#
# The biggest bar beside the HMMAs is the softmax: hundreds of instructions (max, exponentials, sums, the
# rescale) against 128 HMMA per tile. Address arithmetic is the second biggest in the variant that computes
# 64-bit addresses in the loop, and it teaches a rule that carries over to any kernel:
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
# The HMMA and softmax bars are the same in the first two variants; the integer bar is less than half as tall in
# the second. The third variant also skips O's rescale in tiles where no row's max grew (step 4), which lowers
# the softmax bar (its count is an average over tiles). FA2's CUDA C++ gets the same effect from CuTe's layouts: each thread's
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

# %% [markdown]
# **Step 5. O += PV, P straight from registers.** Lesson 15's section 4 in code: two n-tiles of P packed into one A
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
# does nothing; section 2 shows the committed measurements.

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
# float16's, as lesson 15's section 5 predicted. `tests/test_tensor_kernel.py` runs the same checks, on ragged,
# causal and single-key shapes, in the simulator and on a GPU.

# %% [markdown]
# ## 2. How fast is it?
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
from flashlab.roofline import PUBLISHED_FP32

for gpu_name in ("T4", "H100"):
    print(f"{gpu_name}: datasheet FP16 tensor cores {PUBLISHED[gpu_name].peak_flops / 1e12:.0f} TFLOP/s, "
          f"{PUBLISHED[gpu_name].peak_flops / PUBLISHED_FP32[gpu_name]:.0f} times its FP32 units")
t4_plan = kplan.plan((1, 16, 4096, 64), dtype="float16", variant="tensor", device="T4")
print("\n".join(t4_plan.explain().splitlines()[:3]))
print("(no T4 run is recorded: the figures above are the H100's)")

# %% [markdown]
# And against the instruction's own ceiling from lesson 15's section 1: how much of what `mma.sync` can do from Numba
# does the whole kernel get? Attention's FLOPs counted as 4·N²·d, as everywhere in the course. Lesson 15's rule
# applies here too: compare numbers from one machine. The ceiling was measured on an H200, so the shares below
# take the same kernel timed on an H200 too (the `mma.sync` column of lesson 20's benchmark, random data; two
# runs a day apart, so read them to a few percent).

# %%
import csv

h200 = [r for r in csv.DictReader(open(tviz.DATA / "wgmma_forward.csv"))
        if r["B"] == "1" and r["causal"] == "0" and r["N"] == "16384"]
ceil = {r["instruction"].split()[0]: r for r in tviz.mma_ceiling_rows() if r["operands"] == "random"}
fig, ax = plt.subplots(figsize=(6, 2.8))
for i, r in enumerate(h200):
    fmt = "fp16" if r["dtype"] == "float16" else "bf16"
    share = float(r["tensor_tflops"]) / ceil[fmt]["tflops"]
    ax.bar(i, share, color="#4c72b0" if fmt == "fp16" else "#dd8452")
    ax.text(i, share, f"{share:.0%}", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(h200)), [f"{r['dtype']}\nd = {r['d']}" for r in h200])
ax.set(ylim=(0, 1.05), ylabel="kernel / mma.sync ceiling",
       title=f"{h200[0]['gpu']}: the tensor kernel's share of its ceiling (N = 16384, not causal)")
plt.tight_layout()
plt.show()

# %% [markdown]
# On lesson 10's roofline of the H100, where these kernels ran. (The measured `mma.sync` roof of lesson 15 was an
# H200's, whose memory is faster: its ridge would sit elsewhere, so it is not drawn on the H100's roofline.) The
# kernel's intensity comes from lesson 10's traffic model: Q read and O written once, K and V read from HBM once
# per query block. Before you run the cell: left or right of the ridge point?

# %%
from flashlab.viz import gpu as gviz

fwd, _ = gviz.load_forward_results()
N_roof, d_roof = 4096, 64
points = tviz.tensor_roofline_points(rows, N=N_roof, d=d_roof)
reg = [r for r in fwd if r.get("N") == N_roof and r.get("d") == d_roof and r.get("impl") == "flashlab register fp32"]
if reg:
    points["flashlab register fp32"] = (gviz.kernel_intensity(N_roof, d_roof, 128), reg[0]["tflops"] * 1e12)
gviz.plot_kernel_roofline(points)  # the H100's roofs: its datasheet, the machine these kernels ran on
plt.show()
if "flashlab tensor f16" in points:
    intensity, achieved = points["flashlab tensor f16"]
    bw = PUBLISHED["H100"].bandwidth
    print(f"float16 kernel: {intensity:.0f} FLOP/byte by the model, {achieved / 1e12:.0f} TFLOP/s measured")
    print(f"ridge point of the H100's datasheet: {PUBLISHED['H100'].peak_flops / bw:.0f} FLOP/byte")
    print(f"what HBM allows at that intensity: {bw / 1e12:.2f} TB/s x {intensity:.0f} = {bw * intensity / 1e12:.0f} TFLOP/s")
    kv_bytes = 16 * 2 * N_roof * d_roof * 2  # K and V of all 16 heads, float16
    print(f"K and V of all 16 heads: {kv_bytes / 2**20:.0f} MiB, against {GPUS['H100'].l2_bytes / 2**20:.0f} MiB of L2; "
          f"read from HBM once per head, the intensity would be "
          f"{gviz.kernel_intensity(N_roof, d_roof, N_roof, bytes_per_element=2):.0f} FLOP/byte")

# %% [markdown]
# By the model's count the float16 kernel sits *left* of the ridge point, on the sloped part of the roofline
# where a kernel is memory-bound. Yet memory is not what holds it back, for two reasons the cell prints. First,
# even if every byte of the model came from HBM, the bandwidth would allow more than the kernel reaches.
# Second, the count is pessimistic: the thread blocks that run at the same time include many query blocks of
# one head, and they all walk the same K and V tiles in the same order, tile 0 first, at about the same time;
# the first block to read a tile brings it into L2 and the others find it there. At N = 4096 the K and V of
# all heads fit in L2 together, so HBM sees each of them about once, and counted that way the intensity is far
# right of the ridge. What separates the kernel from its roof happens inside the SM: not the issue budget, which
# section 1 showed has room, but latency with few warps per scheduler.
#
# What the measurements say, and what they do not:
#
# - The speed and the ratios come from one benchmark file on one H100; rerun the script (in the course's
#   repository, not the installed package) for your GPU, and compare with torch measured in the same run.
# - In float32, SDPA also runs 3xTF32 on tensor cores: the printed ratios say how close the kernel gets.
#   1xTF32 is faster than 3xTF32 because it gives up accuracy; a fair comparison names its precision.
# - In float16 and bfloat16, SDPA's kernels are FlashAttention-2's (and cuDNN's): compiled C++ tuned over
#   years, where ours is one Python module. The next section lists where they differ.

# %% [markdown]
# ## 3. Where this kernel differs from FlashAttention-2 and -3
#
# - **Tile sizes.** FA2's d = 64 forward gives 4 warps 128 query rows and 128 keys per tile
#   (`Flash_fwd_kernel_traits<64, 128, 128, 4>`): two m-tiles per warp, as ours has for 16-bit inputs, but ours
#   takes 64 keys, within 48 KB and its registers. At d = 192 and 256 FA2 drops to one m-tile per warp
#   (`flash_fwd_launch_template.h`), as our float32 builds do: the accumulators grow with d.
# - **Shared memory.** This forward uses static shared memory, which caps a block at 48 KB; an H100 block may
#   use up to 227 KB with the dynamic opt-in (`flashlab.hardware`), which our backward (lesson 17) and lesson
#   20's wgmma forward use. FA2 and FA3 use that room for bigger tiles and deeper pipelines.
# - **Layouts.** FA2 (through CUTLASS's CuTe) *swizzles* its shared-memory layouts, permuting 16-byte chunks
#   by XOR so that neither the copies nor `ldmatrix` conflict on banks; we pad each row by 16 bytes, which
#   costs a little memory.
# - **Compilation.** FA2 is CUDA C++ compiled ahead of time, with templates specialised per head dimension;
#   ours is compiled by Numba when first called, specialised per (d, tile, causal, precision).
# - **Hopper.** FlashAttention-3 replaces `mma.sync` with `wgmma` (a warpgroup of 4 warps, operands read
#   from shared memory, asynchronous) and `cp.async` with TMA (one thread copies a whole tile), and splits
#   warps into producers and consumers (lesson 11). That is how it gets past `mma.sync`'s ceiling; lesson 20
#   builds it.

# %%
print(f"shared memory per block: H100 {GPUS['H100'].shared_per_block // 1024} KB with the opt-in, "
      f"{GPUS['H100'].static_shared_per_block // 1024} KB static (what this forward uses)")

# %% [markdown]
# ## Summary
#
# - A FlashAttention-2 forward on tensor cores is a list of steps in one Python module: Q's fragments once,
#   K and V double-buffered with `cp.async`, S = QKᵀ, the mask where a tile needs it, the online softmax on C
#   fragments, O += PV with P from registers, and the finish.
# - Shared-memory conflicts count among the 8 lanes of a 16-byte access's phase: pad (or swizzle) rows so
#   those 8 rows start in different banks.
# - Instructions are a budget, one issue per cycle per scheduler: count it before blaming it. This kernel's mix
#   fits; latency with few warps holds it back. Hoist address work out of the loop; skip rescales that can wait.
# - A roofline point is only as good as its byte count: bytes that L2 serves are not HBM's.
#
# Next, lesson 17 runs the backward's five products on the same instructions.
#
# **Exercises:** [16_tensor_core_forward](../exercises/16_tensor_core_forward.ipynb): write the S = QKᵀ step
# of one warp as a Numba kernel on `mma.sync`, graded in the simulator, derive the smallest row padding that
# keeps `ldmatrix` free of bank conflicts, and plan which chunks of a K tile each thread copies.
