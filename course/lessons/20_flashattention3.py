# %% [markdown]
# # 20 · FlashAttention-3 on Hopper
#
# **After this lesson you can**
# - say what Hopper's warpgroup MMA (`wgmma`) changes against lesson 15's `mma.sync`, and read its accumulator
#   layout;
# - build the 64-bit matrix descriptor that tells `wgmma` where a swizzled tile's k-step lives;
# - follow a tile from HBM to the tensor cores: a TMA copy, an mbarrier's phases, a ring of shared-memory slots;
# - read the schedule of FlashAttention-3's consumer warpgroups (warp specialisation, intra-warpgroup overlap,
#   pingpong) in a kernel written in Python, and in its measured timeline beside lesson 11's model;
# - say why the backward splits over keys, where each of its products finds its operands, and what dQ's
#   reduction costs;
# - say where the course's kernel stops short of the real FlashAttention-3.
#
# Sources: Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, "FlashAttention-3: Fast and Accurate Attention with
# Asynchrony and Low-precision" (arXiv 2407.08608), sections 3.1–3.2; NVIDIA's PTX ISA, sections "Asynchronous
# Warpgroup Level Matrix Multiply-Accumulate" (wgmma, its fragments and descriptors), "Tensor copy" (TMA and its
# swizzle modes) and "mbarrier". The kernel is our own: `flashlab/kernels/wgmma.py`, on the intrinsics of
# `flashlab/kernels/hopper.py`.
#
# Without a Hopper GPU this lesson runs the kernel in Numba's CUDA simulator, where every Hopper instruction is
# emulated exactly, and draws the measurements the project made on an H200.

# %%
import csv
import inspect

import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import fragments as F
from flashlab import pipeline, timeline
from flashlab.kernels import hopper, wgmma

DATA = pipeline.DATA
rows = list(csv.DictReader(open(DATA / "wgmma_forward.csv")))
ceiling = {(r["instruction"], r["operands"]): r for r in csv.DictReader(open(DATA / "mma_ceiling.csv"))}

# %% [markdown]
# ## 1. Why a new instruction
#
# Lessons 15–17 built FlashAttention-2 on `mma.sync`: one warp multiplies a 16 × 8 tile by a 8 × 16 one, its
# operands in registers, and waits for the answer. On Hopper the same instruction still works, but it cannot
# feed the tensor cores: a loop of nothing but `mma.sync` reaches well under the datasheet's dense fp16 rate,
# and the FA2-style kernel stays at the speed of torch's FlashAttention-2 backend. Hopper's answer is
# `wgmma.mma_async`:
#
# | | `mma.sync` (lesson 15) | `wgmma.mma_async` |
# | --- | --- | --- |
# | who | one warp (32 threads) | one warpgroup (4 consecutive warps, 128 threads) |
# | shape (16-bit) | m16n8k16 | m64nNk16, N = 8, 16, …, 256 |
# | A | registers | shared memory (by descriptor) or registers |
# | B | registers (after `ldmatrix`) | shared memory (by descriptor) |
# | timing | the warp waits for D | issued, committed as a group, waited for later |
#
# Larger tiles per instruction and operands read straight from shared memory remove the `ldmatrix` traffic that
# limited lesson 16's kernel, and asynchrony lets a warpgroup issue products and keep computing. Here are both
# instructions and both kernels, measured on an H200:

# %%
h200 = [r for r in rows if r["B"] == "1" and r["N"] == "16384" and r["causal"] == "0" and r["dtype"] == "float16"]
labels = ["mma.sync loop\n(random fp16)"] + [f"d = {r['d']}" for r in h200]
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.bar([0], [float(ceiling["fp16 m16n8k16", "random"]["tflops"])], color="#9e9e9e")
for i, r in enumerate(h200):
    for j, (key, color, name) in enumerate([("tensor_tflops", "#4c72b0", "flashlab tensor (mma.sync)"),
                                            ("fa2_tflops", "#8172b2", "torch FA2 backend"),
                                            ("wgmma_tflops", "#dd8452", "flashlab wgmma (this lesson)"),
                                            ("sdpa_tflops", "#55a868", "torch SDPA (FA3-class)")]):
        ax.bar(1 + i + (j - 1.5) * 0.2, float(r[key]), width=0.2, color=color, label=name if i == 0 else None)
ax.axhline(989, color="black", ls=":", lw=1, label="datasheet dense fp16 peak")
ax.set_xticks(range(len(labels)), labels)
ax.set(ylabel="TFLOP/s", title=f"{h200[0]['gpu']}, forward, B = 1, H = 16, N = 16384, float16 ({h200[0]['date']})")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
plt.tight_layout()
plt.show()

# %% [markdown]
# The mma.sync loop is a ceiling for any kernel built on it, and lesson 16's kernel sits well below even that;
# the wgmma kernel of this lesson goes past the ceiling, close to torch's own FA3-class attention.
#
# ## 2. A warpgroup's accumulator
#
# `wgmma` accumulates D (64 × N, fp32) in the registers of its 128 threads. Warp w holds rows 16w to 16w + 15,
# and inside a warp the layout is lesson 15's C fragment, repeated every 8 columns: lane (g, t) = (lane // 4,
# lane % 4) holds rows g and g + 8 and columns 2t and 2t + 1 of each 8-column group. Here is who holds what of a
# 64 × 32 accumulator:

# %%
fmap = F.wgmma_fragment_map(32)  # [thread, element] -> (row, column)
owner = np.zeros((64, 32), int)
for thread in range(128):
    owner[fmap[thread, :, 0], fmap[thread, :, 1]] = thread
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 2]})
axes[0].imshow(owner // 32, cmap="tab10", vmax=9, aspect="auto")
axes[0].set(title="which warp holds each element of D (64 x 32)", xlabel="column", ylabel="row")
lanes = owner[:16, :16]  # warp 0's rows, the first two 8-column groups
axes[1].imshow(lanes // 4, cmap="tab10", vmax=9, aspect="auto")
for r in range(16):
    for c in range(16):
        axes[1].text(c, r, str(lanes[r, c]), ha="center", va="center", fontsize=6)
axes[1].set(title="warp 0, columns 0-15: the lane holding each element (colour: g = lane // 4)",
            xlabel="column")
plt.tight_layout()
plt.show()
print("thread 5 (g = 1, t = 1) holds elements at (row, col):", [tuple(x) for x in fmap[5, :8].tolist()], "...")

# %% [markdown]
# Two consequences carry over from lessons 15–16 unchanged. The online softmax works on these fragments as it
# did: a row lives in the 4 lanes of a quad, so its max and sum need two `shfl_xor`. And an accumulator's
# elements 8k to 8k + 7, packed to 16 bits in pairs, are exactly the four A registers of a k16 step with A from
# registers: P never leaves the registers between S = Q Kᵀ and O += P V. A check in NumPy, with the model the
# simulator and the GPU tests use:

# %%
rng = np.random.default_rng(0)
a = F.from_bits16(F.to_bits16(rng.standard_normal((64, 16)), "float16"), "float16")
b = F.from_bits16(F.to_bits16(rng.standard_normal((16, 32)), "float16"), "float16")
d_frags = F.wgmma_to_fragments(F.wgmma_mma(a, b), 32)  # each thread's 16 registers of D
a_frags = F.wgmma_to_fragments(F.wgmma_mma(a, b)[:, :16], operand="A")  # columns 0-15 as an A operand
print("A fragment of columns 0-15 == D elements 0-7 of every thread:", np.array_equal(a_frags, d_frags[:, :8]))

# %% [markdown]
# ## 3. Descriptors and the 128-byte swizzle
#
# `wgmma` reads A and B from shared memory in a fixed pattern: "core matrices" of 8 rows × 16 bytes. Which core
# matrix sits where is described by a 64-bit **matrix descriptor**: a start address, two byte offsets (LBO, the
# leading dimension's, and SBO, the stride dimension's) and a swizzle mode. The swizzle is the one of lesson 16:
# chunk c (16 bytes) of row r is stored at chunk c ^ (r % 8), so that the 8 rows of one column of chunks fall in
# 8 different groups of banks. Hopper's TMA writes tiles in exactly this layout, so the kernel never
# rearranges data: TMA writes, wgmma reads.

# %%
tile_rows = 16
offsets = F.tile_offsets(tile_rows, 128, 2, 128)  # a 16 x 128 tile of 16-bit values, two boxes of 64 columns
chunk_at = np.zeros((tile_rows, 16), int)  # [row, where a chunk is stored] = which chunk of the row it is
for r in range(tile_rows):
    for c in range(16):  # logical chunk c: values 8c .. 8c + 7 of the row
        o = offsets[r, 8 * c]
        chunk_at[r, (o // (tile_rows * 128)) * 8 + o % 128 // 16] = c
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.imshow(chunk_at % 8, cmap="tab10", vmax=9, aspect="auto")
for r in range(tile_rows):
    for s in range(16):
        ax.text(s, r, str(chunk_at[r, s]), ha="center", va="center", fontsize=7)
ax.axvline(7.5, color="black")
ax.set(xlabel="stored 16-byte chunk (box 0: 0-7, box 1: 8-15)", ylabel="row",
       title="which logical chunk TMA stores where (128-byte swizzle, two 64-column boxes)")
plt.tight_layout()
plt.show()

# %% [markdown]
# For S = Q Kᵀ both operands are "K-major": the dimension wgmma sums over (d) runs along the rows. A k16 step
# starts 32 bytes further along the rows, in box k0 // 64; the swizzle acts on address bits, so adding 32 to the
# start address of a swizzled tile is right, as long as the tile begins on a 1024-byte boundary. For O += P V the
# B operand is V, stored row-major as it arrives: keys down, d across. wgmma sums over the keys, which here run
# *down* the tile: V is "MN-major", the descriptor says so (a transpose bit in the instruction), and LBO steps
# from one 64-column box to the next along d. Exercise 1 builds these descriptors; `flashlab.fragments` holds the
# model the simulator and the GPU tests check:

# %%
for name, tile, major, k0 in [("Q, step 0", 128, "K", 0), ("Q, step 5", 128, "K", 80), ("V, step 1", 128, "MN", 16)]:
    start, lbo, sbo = F.operand_descriptor(tile, 128, major, k0, 128)
    print(f"{name:10s} start +{start:5d} bytes, LBO {lbo:5d}, SBO {sbo:4d}: "
          f"descriptor 0x{F.matrix_descriptor(1024 + start, lbo, sbo, 128):016x}")

# %% [markdown]
# ## 4. TMA and the mbarrier ring
#
# **TMA** (the Tensor Memory Accelerator) copies a 2-D box of a matrix into shared memory when one thread asks:
# `cp.async.bulk.tensor` with a *tensor map* (the matrix's address, shape, strides, box and swizzle, encoded on
# the host by `cuTensorMapEncodeTiled`). Rows past the end of the matrix arrive as zeros. A map has up to five
# dimensions with any strides that are multiples of 16 bytes: this course's kernels use four, (B, H, N, d), so
# that one map serves every head, and a GPT's heads (`x.view(B, N, H, d).transpose(1, 2)` of one linear layer's
# output) are read where they lie, with no copy. The thread does not wait: the copy reports to an **mbarrier**, a 64-bit counter in shared memory that completes a *phase* when the
# expected arrivals have arrived and the expected bytes have landed (`arrive.expect_tx` announces them). Phases
# alternate parity 0, 1, 0, …; `try_wait.parity p` returns once the phase of parity p has completed.
#
# The kernel streams K and V through a ring of `stages` slots. Tile j goes to slot j % stages; for the slot it is
# fill number j // stages, so the consumers wait for parity (j // stages) % 2 on its "full" barrier, and the
# producer, before refilling it, waits for the consumers' release of the previous fill on its "empty" barrier.
# Exercise 2 asks for these parities. With two stages:

# %%
fig, ax = plt.subplots(figsize=(9, 1.8))
for j in range(8):
    slot, full, empty = pipeline.ring_fill(j, 2)
    ax.add_patch(plt.Rectangle((j, slot), 0.9, 0.9, color=["#4c72b0", "#dd8452"][full], alpha=0.8))
    ax.text(j + 0.45, slot + 0.45, f"K/V {j}\nfull p={full}\nempty p={'-' if empty is None else empty}",
            ha="center", va="center", fontsize=7, color="white")
ax.set(xlim=(0, 8), ylim=(2, 0), yticks=[0.45, 1.45], yticklabels=["slot 0", "slot 1"], xticks=[],
       title="tiles through a two-stage ring: the parity each side waits for")
plt.tight_layout()
plt.show()

# %% [markdown]
# Our kernel gives K and V separate barriers in each slot, and the consumers release K as soon as S = Q Kᵀ is
# done rather than at the end of the tile. With two stages, the copy of K for two tiles ahead then starts while
# this tile's softmax runs, instead of after it.
#
# ## 5. The kernel: a producer and consumers
#
# A thread block owns 64 query rows per consumer warpgroup (two consumers at d = 128, three at d = 64) and one
# more warpgroup, the **producer**. One producer thread issues every TMA copy: Q once, then K and V tile by tile
# into the ring. `setmaxnreg` hands registers from the producer, which needs almost none, to the consumers, which
# hold S, P and O. The kernel is launched with 65536 / threads registers a thread (168 with two consumers), the
# count the driver reports, but ptxas compiles the code after each `setmaxnreg` for its new budget: at d = 128
# the consumers' code uses up to 200 of its 240 registers, the producer's 8 of 24 (read from the machine code
# that ptxas 13.0 makes, `benchmarks/profiling/setmaxnreg_regions.py`). Each consumer runs this loop (the kernel's own source):

# %%
source = inspect.getsource(wgmma._kernel)
loop = source[source.index("        for j in range(1, n_tiles)"):source.index("        last = (n_tiles")]
print("\n".join(line for line in loop.splitlines() if "stamp(" not in line))  # less the timeline build's stamps

# %% [markdown]
# Read it as a list of steps, each a device function or one instruction:
#
# 1. wait until K_j (and V_{j−1}, long since landed) are in their slots;
# 2. take this warpgroup's turn (pingpong, below), fence the registers, issue S_j = Q K_jᵀ and then
#    O += P_{j−1} V_{j−1}: two commit groups, both running asynchronously; pass the turn on;
# 3. `wgmma_wait(1)`: groups complete in order, so this returns when S_j is done while P V may still run;
#    release K_j; mask and run the online softmax on S_j's registers, *under* the P V product
#    (FA3's intra-warpgroup overlap: P V reads P_{j−1}'s registers, the softmax writes only S's);
# 4. `wgmma_wait(0)`: release V_{j−1}, rescale O and pack P_j into the A registers for the next iteration.
#
# The same call as every other variant runs it, here on a small ragged causal problem with grouped-query heads,
# against float64: on a Hopper GPU, or else in the simulator. A process that holds another GPU (Colab's T4) can
# neither run sm_90a code nor switch to the simulator, so there `hopper.run_here_or_simulated` runs the function
# in a separate Python on the simulator; that is why the function imports what it uses.

# %%
def forward_against_float64(n_q, n_k, heads):
    import numpy as np

    import flashlab
    from flashlab.kernels.forward import flash_attention

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, heads, n_q, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, n_k, 64)).astype(np.float16) for _ in range(2))
    o, lse = flash_attention(q, k, v, causal=True, variant="wgmma", block_k=64)
    ref, ref_lse = flashlab.reference_attention(*(x.astype(np.float64) for x in (q, np.repeat(k, heads, 1),
                                                                                 np.repeat(v, heads, 1))), causal=True)
    print(f"Nq = {n_q}, Nk = {n_k}, {heads} query head(s) sharing 1 K/V head: max |O - O_float64| = "
          f"{np.abs(o - ref).max():.1e} (float16 rounds at {2 ** -11:.1e} relative), max |lse error| = "
          f"{np.abs(lse - ref_lse).max():.1e}")


hopper.run_here_or_simulated(forward_against_float64, flashlab.size(200, 100), flashlab.size(260, 110),
                             flashlab.size(2, 1))

# %% [markdown]
# ## 6. Pingpong and overlap, predicted and measured
#
# Lesson 11 modelled FA3's schedule with three units (copies, tensor cores, exponentials) and idealised costs.
# The kernel has a build that stamps `%globaltimer` (a nanosecond clock) whenever a warpgroup passes a step, in
# the first block of the grid. Pingpong is the turn in step 2: the consumers take turns issuing their products
# (named barriers, round robin), so that while one warpgroup works through its softmax another's products
# occupy the tensor cores. Here is lesson 11's model beside one block of the real kernel on an H200:

# %%
model = timeline.fa3_schedule(6, t_load=0.5, t_gemm=1.0, t_softmax=1.0, **timeline.CONFIGS["+ both (FA3)"])
measured = pipeline.measured_timeline(d=128)
fig, axes = plt.subplots(2, 1, figsize=(11, 5.2))
timeline.plot_timeline(model, axes[0], title="lesson 11's model: pingpong and intra-warpgroup overlap")
pipeline.plot_measured_timeline(measured, axes[1], until=12)
axes[1].set_title(f"measured: {measured['gpu']}, d = {measured['d']}, N = {measured['N']}, first block, "
                  f"{measured['consumers']} consumers ({measured['date']})")
plt.tight_layout()
plt.show()
for d in (64, 128):
    run = pipeline.measured_timeline(d=d)
    means = pipeline.phase_means(run)
    print(f"d = {d}, {run['consumers']} consumers, mean microseconds per tile: "
          + ", ".join(f"{name} {t:.2f}" for name, t in means.items()))

# %% [markdown]
# What the measurement says (the white gaps in a consumer's row are O's rescale, P's packing and the barrier
# waits; the producer's long bars are mostly waits for a slot to be released, which is as it should be):
#
# - **The softmax is the long pole.** S comes back from the tensor cores in a fraction of the softmax's time,
#   and P V of the previous tile finishes *inside* the softmax (the short green bars): the intra-warpgroup
#   overlap works as designed. Each consumer then spends most of a tile on exponentials, maxima and sums of its
#   64 × block_k scores, on the FP32 and special-function units.
# - **The turns cost waiting.** A consumer is often ready before its turn comes: pingpong orders the products,
#   and with two or three consumers whose softmax is longer than the products, a consumer waits for the others'
#   issue. This is why the kernel uses three consumers at d = 64, where the products are shortest against the
#   softmax: more warpgroups share the tensor cores' idle time.
# - **The model's ratio was optimistic for the GEMMs' side.** Lesson 11 assumed a softmax as long as one GEMM; the
#   stamps show it several times longer than S alone. FA4 (for Blackwell) goes after exactly this: a cheaper
#   exponential and a rescale of O only when the row maximum grows by enough.
#
# Exercise 4 asks for a consumer's order of steps: most orders are wrong in a way a test on a small input
# would never show (a register read while a product in flight still reads it), or right and slow.
#
# ## 7. The speed, and where the course's kernel stops short
#
# Against torch's default attention (FA3-class on Hopper) and its FlashAttention-2 backend, in the same run, over
# the 48 shapes of the project's bar (N 4096 to 16384, d 64 and 128, causal or not, B·H 16 or 64, float16 and
# bfloat16):

# %%
ratio = np.array([float(r["wgmma_tflops"]) / float(r["sdpa_tflops"]) for r in rows])
ratio_fa2 = np.array([float(r["wgmma_tflops"]) / float(r["fa2_tflops"]) for r in rows])
fig, ax = plt.subplots(figsize=(10, 3))
order = np.argsort(ratio)
ax.bar(range(len(rows)), ratio[order], color=["#dd8452" if rows[i]["d"] == "64" else "#4c72b0" for i in order])
ax.axhline(1, color="black", lw=0.8)
ax.axhline(0.85, color="gray", ls=":", lw=0.8)  # the project's bar for this kernel
ax.set(xticks=[], ylabel="wgmma / torch SDPA", xlabel="the 48 shapes, sorted (orange: d = 64, blue: d = 128)",
       title=f"{rows[0]['gpu']}, {rows[0]['date']}")
plt.tight_layout()
plt.show()
ratio_tensor = np.array([float(r["wgmma_tflops"]) / float(r["tensor_tflops"]) for r in rows])
print(f"against torch SDPA: {ratio.min():.2f} to {ratio.max():.2f} (median {np.median(ratio):.2f}); "
      f"against torch's FA2 backend: {ratio_fa2.min():.2f} to {ratio_fa2.max():.2f}")
for r, x in zip(rows, ratio_tensor):
    if x < 1:
        print(f"slower than the mma.sync kernel: B = {r['B']}, N = {r['N']}, d = {r['d']}, "
              f"{'causal' if r['causal'] == '1' else 'full'}, {r['dtype']}: {x:.2f} of its speed")

# %% [markdown]
# The kernel is FlashAttention-3's forward in its structure, but not in every detail. Where it differs:
#
# - **One block per query tile.** FA3 runs a persistent kernel: each block loops over many tiles, handed out by a
#   scheduler, so the next tile's loads overlap this one's epilogue. Ours pays a block's start and end per tile,
#   which shows most at N = 4096.
# - **The epilogue.** O goes from registers straight to global memory; FA3 stages it through shared memory and
#   stores it with TMA.
# - **Scope.** float16 and bfloat16, d = 64 and 128, causal, GQA and ragged lengths. No fp8 (lesson 11's block
#   quantisation), no varlen, paged K/V or the library's other options (those run on `variant="tensor"`). Its
#   backward is section 8's.
#
# `flashlab.torch` uses this kernel on Hopper for 16-bit inputs at d = 64 and 128 without options: it beat the
# `mma.sync` kernel at all but one of the shapes measured (the exception is in the cell below).
#
# ## 8. The backward on wgmma
#
# The backward (lesson 06's formulas, lesson 17's kernel on `mma.sync`) moves to `wgmma` the same way. A block owns
# 128 keys, 64 for each of two consumer warpgroups (wgmma's M is 64): it keeps K_j and V_j in shared memory and
# accumulates dK_j and dV_j in registers while a producer warpgroup streams the query tiles Q_i and dO_i (128
# queries at d = 64, 64 at d = 128) through the ring, which both consumers read. As in the forward's two-consumer
# build, `setmaxnreg` leaves the producer 24 registers a thread and gives the consumers 240: at d = 128 the dK and
# dV accumulators alone take 128. dK and dV are indexed by keys, so each belongs to one block. dQ is indexed by
# queries, and every key block contributes to every query row: that sum crosses blocks. Here is where each of the
# five products finds its operands in `flashlab/kernels/wgmma_backward.py`:

# %%
print(f"{'product':16s} {'A':>22s} {'B':>22s}")
for product, (a_place, a_major, b_place, b_major) in pipeline.BACKWARD_OPERANDS.items():
    print(f"{product:16s} {a_place + ', ' + a_major + '-major':>22s} {b_place + ', ' + b_major + '-major':>22s}")

# %% [markdown]
# Three things to read off. P^T and dS^T never leave the registers for dV and dK: their accumulators are A
# fragments, as P was in the forward. dO and Q are summed over their rows (the queries), so wgmma reads them
# MN-major, with no transposed copy. And dQ = dS K needs dS with queries as rows, while the accumulator holds dS^T
# with keys as rows: threads cannot swap rows for columns across the warpgroup, so dS^T goes once to shared memory
# (swizzled, as TMA would have written it) and the next wgmma reads it MN-major: the transpose is in the
# descriptor. Once both consumers' rows of dS^T are there, each forms its part of dQ over all 128 keys: at d = 64
# the rows of 64 of the tile's 128 queries (wgmma's M is 64), at d = 128 half of the columns of its 64 queries.
#
# dQ's shares are added to a float32 accumulator with atomics, one share per key block. The kernel does not issue
# them thread by thread: each warp writes its rows of the share to shared memory as float32, and one instruction
# per row, `cp.reduce.async.bulk ... .add.f32`, has the copy engine add the row to global memory, element by
# element and atomically, while the warpgroup goes on to the next tile. The other way is a second kernel over
# query blocks that recomputes dS and forms dQ itself. Count both (exercise 6):

# %%
for n in (4096, 16384):
    for block_k in (64, 128):
        atomic_bytes, second_bytes = pipeline.dq_traffic(n, n, 128, 64, block_k)
        print(f"N = {n}, d = 128, 64 queries x {block_k} keys: atomics {atomic_bytes / 2**30:.2f} GiB, "
              f"a second pass re-reads {second_bytes / 2**30:.2f} GiB of K and V")

# %% [markdown]
# With float16 inputs and square tiles the bytes come out equal: the second pass gains nothing there, and it
# recomputes S and dP, two of the five products. The kernel's blocks of 128 keys halve the atomics. Atomics cost
# something else: the order in which blocks add their shares is not fixed, so dQ can differ in its last bits from one
# run to the next. A deterministic mode pays for a fixed order: with `deterministic=True`, a counter per query tile
# says how many key blocks have added their share, and key block j waits until it reads j, adds, waits for its adds to
# land, and counts one more. Blocks start in index order (what GPUs do in practice, though CUDA does not promise it),
# so the ones it waits for are already running or done. The price is that waiting, paid on every tile, and most under
# a causal mask: there key block j starts on its diagonal query tile, and may add to it only after blocks 0 to j - 1
# have, so each block starts a step behind the one before it and the last finishes about twice as late as its work
# alone would take. The measured cost is printed below the speed figure.
#
# The same public call runs it, here on o and lse from the float64 reference (rounded as the forward stores them),
# so that the check is the backward's alone (on a GPU other than Hopper, in a separate Python on the simulator, as
# above):

# %%
def backward_against_float64(n_q, n_k):
    import numpy as np

    import flashlab
    from flashlab.kernels import flash_attention_backward

    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((1, 1, n_q, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n_k, 64)).astype(np.float16) for _ in range(2))
    o, lse = flashlab.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    o, lse = o.astype(np.float16), lse.astype(np.float32)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, variant="wgmma")
    q64, k64, v64, do64 = (x[0, 0].astype(np.float64) for x in (q, k, v, do))
    s_ = np.where(np.arange(n_k)[None, :] > np.arange(n_q)[:, None], -np.inf, q64 @ k64.T / 8)
    p_ = np.exp(s_ - s_.max(-1, keepdims=True))
    p_ /= p_.sum(-1, keepdims=True)
    dp_ = do64 @ v64.T
    ds_ = p_ * (dp_ - (do64 * (p_ @ v64)).sum(-1, keepdims=True))
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ds_ @ k64 / 8, ds_.T @ q64 / 8, p_.T @ do64)):
        print(f"{name}: max |error| against float64 {np.abs(got[0, 0] - want).max():.1e}, largest value "
              f"{np.abs(want).max():.1f}")


hopper.run_here_or_simulated(backward_against_float64, flashlab.size(130, 80), flashlab.size(150, 100))

# %% [markdown]
# On an H200 it is faster than lesson 17's `mma.sync` backward at every shape measured, and at most shapes still
# short of torch's default backward, which is FlashAttention-3's own (the numbers, from a committed run):

# %%
bwd = list(csv.DictReader(open(DATA / "wgmma_backward.csv")))
shown = [r for r in bwd if r["B"] == "1" and r["dtype"] == "float16"]
fig, ax = plt.subplots(figsize=(9, 3.2))
for j, (key, color, name) in enumerate([("tensor_tflops", "#4c72b0", "flashlab tensor (mma.sync, lesson 17)"),
                                        ("wgmma_tflops", "#dd8452", "flashlab wgmma (this section)"),
                                        ("sdpa_tflops", "#55a868", "torch SDPA (FA3-class)")]):
    ax.bar([i + (j - 1) * 0.27 for i in range(len(shown))], [float(r[key]) for r in shown], width=0.27,
           color=color, label=name)
ax.set_xticks(range(len(shown)), [f"N {r['N']}\nd {r['d']}{' causal' if r['causal'] == '1' else ''}"
                                  for r in shown], fontsize=7)
ax.set(ylabel="TFLOP/s", title=f"{shown[0]['gpu']}, backward, B = 1, H = 16, float16 ({shown[0]['date']})")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
plt.tight_layout()
plt.show()
for name in ("tensor", "sdpa"):
    ratio = [float(r["wgmma_tflops"]) / float(r[name + "_tflops"]) for r in bwd]
    print(f"wgmma backward / {name + ' backward':15s}: {min(ratio):.2f} to {max(ratio):.2f} over {len(bwd)} shapes "
          f"({bwd[0]['gpu']}, {bwd[0]['date']})")
for causal in ("0", "1"):
    ratio = [float(r["deterministic_tflops"]) / float(r["wgmma_tflops"]) for r in bwd if r["causal"] == causal]
    print(f"deterministic=True / default, {'causal' if causal == '1' else 'full':6s}: {min(ratio):.2f} to "
          f"{max(ratio):.2f} of the speed")

# %% [markdown]
# `flashlab.torch` takes this backward on Hopper where it was measured faster, sequences of 512 and longer without
# options or grouped-query heads, and lesson 17's kernel elsewhere.
#
# Where it stops short of FlashAttention-3: a consumer waits for each tile's products before its softmax, with no
# second set of accumulators to overlap the next tile's; dQ's rows go out one bulk copy each where
# FlashAttention-3 stores a swizzled tile and reduces it with one TMA copy. At d = 128 the kernel hands dQ's rows to
# the producer warpgroup's second warp, as FlashAttention-3 does, so that the consumers meet once a tile; at d = 64
# that measured slower, and the consumers reduce dQ themselves (the hand-over gained 4-8% at d = 128:
# `benchmarks/results/h200/wgmma_backward_dq_warp.txt`).
#
# The missing overlap costs less than it looks, and the reason is worth knowing before you optimize any kernel:
# find what bounds it first. Nsight Compute on this kernel (d = 64, N = 16384, an H200;
# `benchmarks/results/h200/wgmma_backward_ncu_d64.txt`) counts about 8,000 warp instructions for each block's tile,
# started at 1.83 a cycle where the SM can start four, while the tile's five products would keep the tensor cores busy
# for only a third of its time. A kernel like that is bound by issuing instructions, and hiding the tensor cores'
# work under the softmax cannot help it: a version that issued the next tile's S^T and dP^T under this tile's dQ
# product ran 0.98-1.03x as fast. What helped was fewer instructions. P's mask compared 64-bit indices, 8
# instructions a score where the exponential needs 2, so at d = 64 the tiles that hold no key past the end, no
# query past the end and (causal) no key after a query now skip it: 1.03-1.23x
# (`benchmarks/results/h200/wgmma_backward_interior.txt`). Then, as FlashAttention-3 does at d = 64, tiles of 128
# queries, not 64: a tile's fixed instructions (its waits, barriers, descriptors and dQ's reduces) are spread over
# twice the scores, and the kernel ran 1.17-1.25x faster (`benchmarks/results/h200/wgmma_backward_block_q.txt`).
# At d = 128 the same tile would need 256 registers a thread for S^T, dP^T, dK and dV alone, more than the 240 a
# consumer gets, so there it keeps 64.
#
# If you write such a pipelined loop yourself, one trap: an ordinary instruction must not touch a wgmma's
# accumulator between its issue and the wait that covers it. When ptxas cannot prove that, for instance because a
# loop carries an accumulator in flight around its back edge and copies it there, it makes every wgmma of the
# kernel wait for the one before, and says so only in its verbose output (warning C7514). The results stay right;
# the first version of the pipelined loop above ran 0.71-0.81x as fast as the plain one for that reason.
#
# ## Summary
#
# - `wgmma` is a warpgroup's asynchronous m64nNk16: operands from shared memory through descriptors (A may come
#   from registers), issued, committed and waited for; its accumulator is lesson 15's C fragment, repeated.
# - Tiles stay in the layout TMA writes (128-byte swizzle, 64-column boxes); descriptors walk them in k16 steps.
# - A producer warpgroup feeds a ring of slots with TMA; mbarrier phases, counted by parity, say when a slot is
#   full and when it is free again.
# - Consumers issue S of this tile and P V of the last one back to back, run the softmax while P V computes, and
#   take turns on the tensor cores. Measured, the softmax is what remains on the critical path.
# - The backward splits over keys: dK and dV stay in a block's registers, dQ's shares cross blocks through
#   float32 atomic adds (bulk reduces from shared memory), and dS reaches dQ's product through shared memory,
#   transposed by the descriptor.
#
# **Next:** build a descriptor, the ring's parities, a two-box swizzled address, a consumer's schedule, the
# backward's operand table and dQ's traffic:
# [exercises/20_flashattention3.ipynb](../exercises/20_flashattention3.ipynb).
