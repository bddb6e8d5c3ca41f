# %% [markdown]
# # 14 · Decoding, one query against a long KV cache
#
# **After this lesson you can**
# - explain why FlashAttention-2 leaves most of a GPU idle when a model generates text one token at a time;
# - split the keys of a KV cache into chunks, compute a partial softmax state (m, l, O) per chunk, and merge
#   the states into exact attention (split-KV attention, "Flash-Decoding");
# - run the same algorithm as a Numba kernel (one thread block per chunk, then a merge kernel) and check it
#   against NumPy and the float64 reference;
# - choose the number of chunks from the number of SMs, and read a decoding benchmark in GB/s.
#
# Sources: FlashAttention-2 (Dao 2023, arXiv 2307.08691) for the loop structure; "Flash-Decoding for
# long-context inference" (Tri Dao, Daniel Haziza, Francisco Massa, Grigory Sizov; PyTorch blog and
# Stanford CRFM, October 2023) for the idea of splitting the keys. The post is a description with
# measurements, not a paper; what follows is our own implementation of the idea.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

import flashlab
from flashlab import decoding, size

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Why one query is a problem
#
# A language model generates text one token at a time. Each new token brings **one** query row per head;
# its keys and values are appended to the KV cache, which holds those of every earlier token. So decoding
# attention has Nq = 1 and Nk = the context length: thousands, up to hundreds of thousands.
#
# FlashAttention-2 parallelises over (batch, head, query block): with Nq = 1 there is one query block, so
# it launches B·H thread blocks. Each walks through all Nk keys alone. With B·H = 16 on a GPU with 132
# SMs, 116 SMs have nothing to do. Split-KV attention launches B·H·n_splits blocks instead, each over
# Nk / n_splits keys:

# %%
n_sm = 132  # an H100 SXM
bh = np.arange(1, 129)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
ax = axes[0]
ax.plot(bh, np.minimum(bh / n_sm, 1), label="FA2: B·H blocks")
for splits in (4, 16):
    ax.plot(bh, np.minimum(bh * splits / n_sm, 1), label=f"split-KV: B·H·{splits} blocks")
ax.set(xlabel="batch × heads (B·H)", ylabel="fraction of SMs with a block", title=f"Nq = 1 on {n_sm} SMs")
ax.legend(fontsize=8)

ax = axes[1]  # the algorithm: split the cache, one state per chunk, merge
ax.set(xlim=(0, 10), ylim=(0, 4.2), title="split-KV attention for one query")
ax.axis("off")
colors = plt.cm.viridis(np.linspace(0.15, 0.85, 4))
ax.text(0.1, 3.75, "KV cache (Nk keys)", fontsize=9)
for c in range(4):
    x0 = 0.1 + c * 2.4
    ax.add_patch(Rectangle((x0, 3.0), 2.3, 0.6, color=colors[c]))
    ax.text(x0 + 1.15, 3.3, f"chunk {c}", ha="center", va="center", color="white", fontsize=8)
    ax.add_patch(FancyArrowPatch((x0 + 1.15, 2.95), (x0 + 1.15, 2.15), arrowstyle="->", mutation_scale=10))
    ax.text(x0 + 1.15, 1.85, f"block {c}:\n(m{c}, l{c}, O{c})", ha="center", va="center", fontsize=8)
    ax.add_patch(FancyArrowPatch((x0 + 1.15, 1.45), (5, 0.75), arrowstyle="->", mutation_scale=10, color="gray"))
ax.text(5, 0.45, "merge: o = Σ e^(m_c−m) O_c / Σ e^(m_c−m) l_c", ha="center", fontsize=9,
        bbox=dict(boxstyle="round", fc="#eeeeee"))
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The algorithm
#
# Split the Nk keys into chunks c = 0, 1, …, of ⌈Nk / n_splits⌉ keys (the last may be shorter). For each
# query row and each chunk, independently, compute the chunk's softmax state, exactly what FA2 keeps for
# a row inside its loop (lesson 05):
#
# $$m_c = \max_{j \in c} S_j, \qquad l_c = \sum_{j \in c} e^{S_j - m_c}, \qquad O_c = \sum_{j \in c} e^{S_j - m_c}\, V_j .$$
#
# Then merge. Every chunk's l and O are relative to its own max, so bring them to the common max
# m = max_c m_c first:
#
# $$l = \sum_c e^{m_c - m}\, l_c, \qquad o = \frac{1}{l} \sum_c e^{m_c - m}\, O_c, \qquad \mathrm{lse} = m + \log l .$$
#
# The (m, l) half is `merge_softmax_states` from lesson 03, applied to many chunks; O rides along with
# the same factors. Nothing is approximate: the result is the same softmax(S) V as before, only summed
# in a different order. (The Flash-Decoding post stores each chunk's normalised output O_c / l_c and its
# log-sum-exp m_c + log l_c instead; that is the same state written differently.)
#
# `flashlab.decoding` holds the three steps in NumPy:

# %%
q = rng.standard_normal((2, 1, 64))  # 2 heads, one query, d = 64
k = rng.standard_normal((2, 1000, 64))
v = rng.standard_normal((2, 1000, 64))
m, l, O = decoding.split_kv_partials(q, k, v, num_splits=4)
print("chunks:", decoding.chunk_bounds(1000, 4))
print("m:", m.shape, " l:", l.shape, " O:", O.shape, "  (heads, chunks, Nq[, d])")
print("each chunk's max for head 0:", np.round(m[0, :, 0], 3))
o, lse = decoding.merge_partials(m, l, O)
o_ref, lse_ref = flashlab.reference_attention(q, k, v)
print(f"merged vs float64 reference: o {flashlab.relative_error(o, o_ref):.1e}, lse {flashlab.relative_error(lse, lse_ref):.1e}")

# %% [markdown]
# The merge is an exact identity, so the error should not depend on how the keys are split, including
# ragged chunks and a chunk per key:

# %%
q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((4, 2, 64), (4, 3000, 64), (4, 3000, 64)))
o_ref, _ = flashlab.reference_attention(q, k, v)
splits = [1, 2, 3, 7, 16, 64, 333, 3000]
errs = [flashlab.relative_error(decoding.flash_decoding(q, k, v, num_splits=s)[0], o_ref) for s in splits]
fig, ax = plt.subplots(figsize=(5.5, 3.0))
ax.plot(splits, errs, "o-")
ax.set(xscale="log", yscale="log", ylim=(1e-9, 1e-4), xlabel="num_splits", ylabel="relative error of o",
       title="float32 split-KV vs float64 reference")
plt.show()

# %% [markdown]
# ## 3. How many chunks?
#
# More chunks fill more SMs, but each adds a state (Nq · (d + 2) numbers) to write and merge, and chunks of
# a few keys waste the block's threads. Decoding reads each key and value once and does about 1 FLOP per
# byte read in float16 (4d FLOPs per key for the 4d bytes of its K and V rows; half that in float32): it is memory-bound (lesson 01), so the goal is to keep every SM streaming K and V. A simple model:
# every block streams its chunk at 1/n_SM of the GPU's bandwidth, blocks run in waves of n_SM, and the
# merge reads every state once. `decoding.default_num_splits` takes enough chunks to fill the SMs about
# twice, with at least 64 keys each.

# %%
model_time_us = decoding.model_time_us  # that model, one block per SM by default (its code: decoding.model_time_us??)


nk, d = 32768, 128
s = np.arange(1, 257)
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for bh in (8, 32, 128):
    ax.plot(s, model_time_us(bh, nk, d, s), label=f"B·H = {bh}")
    best = decoding.default_num_splits(bh, nk, n_sm=132)
    ax.plot(best, model_time_us(bh, nk, d, best), "k*", ms=9)
ax.set(xscale="log", yscale="log", xlabel="num_splits", ylabel="model time (µs)",
       title=f"A bandwidth model, Nk = {nk}, d = {d}, fp16 (★ = default_num_splits)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# A model, not a measurement: it ignores launch overhead (two launches instead of one; lesson 07 measured
# what each costs through Numba and from C++), the real per-SM bandwidth, and how many blocks share an SM. It shows the shape of the trade-off: time falls
# like 1/n_splits until the SMs are full, then flattens at total bytes / bandwidth, with saw teeth where
# one block too many starts another wave. With B·H = 128 the GPU is already nearly full without a split.
# The ★ (the library's rule) sits near, not always at, the model's best: the rule ignores the waves.
#
# ### Explore: split count against KV length
#
# Move Nk, B·H and the GPU (132 SMs on an H100, 40 on a T4) and compare ★ with the model's best; raise the
# splits past a wave boundary and watch the bottom picture gain a mostly idle wave. Where a setting was
# benchmarked (`benchmarks/results/decoding.md`, an H200 with 132 SMs), the measured speed-ups over one
# split are drawn against the model's. Change the blocks per SM, and compare:

# %%
from flashlab.viz.decoding import load_measured, measured_speedups, split_explorer

measured, _ = load_measured()
for nk in (1024, 65536):
    splits, speedup = measured_speedups(measured, 16, nk, 128)["float16"]
    model = [model_time_us(16, nk, 128, 1, blocks_per_sm=b) / model_time_us(16, nk, 128, splits, blocks_per_sm=b)
             for b in (1, 2, 4)]
    print(f"B·H = 16, Nk = {nk:5d}, {splits} splits vs 1: measured {speedup:4.1f}x faster (float16); "
          f"model {model[0]:4.1f}x, {model[1]:4.1f}x, {model[2]:4.1f}x at 1, 2, 4 blocks per SM")
split_explorer();

# %% [markdown]
# At Nk = 65536 the measurement lies between the model with 2 and with 4 blocks per SM. At Nk = 1024 it is
# far below every setting: the measured time hardly depends on the split there (1060.2 µs with one split,
# 876.5 with 16, in the table), so most of it goes to costs that do not shrink with the chunk, which the
# model leaves out.
#
# ## 4. The kernel
#
# `flashlab.kernels.decoding.flash_decoding` runs the algorithm as two kernels. The `split` kernel has a
# grid of (n_splits, H, B) blocks; block c walks over its chunk in tiles of BK keys:
#
# 1. copy the K tile into shared memory (neighbouring threads copy neighbouring numbers: coalesced);
# 2. thread (query, key) computes one score S = q · k;
# 3. a tree reduction in shared memory gives each query's tile max, the scores become P = 2^(S − m_new),
#    a second reduction gives the tile sum, and (m, l) are updated as in the online softmax;
# 4. thread (query, x) keeps O[query, x] in a register and adds Σ_j P_j V[j, x], reading V straight from
#    global memory, again neighbouring threads at neighbouring addresses.
#
# The `merge` kernel has one block per (query, head, batch) and one thread per output dimension. There are
# no warp shuffles (all reductions go through shared memory), so the CUDA simulator runs the same code.
# Here it runs on a tiny problem, ragged everywhere: 3 chunks of 67, 67 and 66 keys, tiles of 16 keys.

# %%
from flashlab.kernels.decoding import flash_decoding as decoding_kernel

q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 2, 16), (1, 2, 200, 16), (1, 2, 200, 16)))
o, lse, m_k, l_k, O_k = decoding_kernel(q, k, v, num_splits=3, threads=32, return_partials=True)
m_np, l_np, O_np = decoding.split_kv_partials(q, k, v, num_splits=3)
o_ref, lse_ref = flashlab.reference_attention(q, k, v)
print(f"kernel partials vs NumPy partials: m {flashlab.relative_error(m_k, m_np):.1e}, "
      f"l {flashlab.relative_error(l_k, l_np):.1e}, O {flashlab.relative_error(O_k, O_np):.1e}")
print(f"kernel output vs float64 reference: o {flashlab.relative_error(o, o_ref):.1e}, lse {flashlab.relative_error(lse, lse_ref):.1e}")

# %% [markdown]
# ## 5. On a GPU
#
# Measured with `benchmarks/timing/bench_decoding.py` on an NVIDIA H200 (132 SMs; CUDA events, median of 30 after
# warm-up), Nq = 1, batch 1, 16 heads, d = 128; the full table (more shapes) is in
# `benchmarks/results/decoding.md`:
#
# | Nk | dtype | FA2 kernel (µs) | split-KV, 1 split | split-KV, 17 splits | speed-up vs FA2 | torch SDPA (µs) |
# | --- | --- | --- | --- | --- | --- | --- |
# | 4096 | float16 | 3597 | 2246 | 766 | 4.7× | 64 |
# | 16384 | float16 | 20948 | 11019 | 1089 | 19× | 71 |
# | 65536 | float16 | 81970 | 43186 | 3241 | 25× | 153 |
# | 4096 | float32 | 5157 | 3331 | 764 | 6.8× | 428 |
# | 16384 | float32 | 20319 | 11429 | 1242 | 16× | 1626 |
# | 65536 | float32 | 79097 | 43652 | 3307 | 24× | 6394 |
#
# Three things to read from it. The split is what pays: the same kernel with one split is at most 1.9×
# faster than FA2. In float32, where torch's SDPA does not split the keys, the split-KV kernel is faster
# than torch from Nk = 16384. In float16, torch's flash/cuDNN path (which does split the keys, on tensor
# cores, with years of tuning) reaches 3.5 TB/s, 21× more than this kernel's 166 GB/s: our kernel is
# latency-bound (its P·V loop reads V from global memory one key at a time, and ~2 blocks per SM are too
# few to hide that). Staging V in shared memory and taking more splits are the next steps.
#
# With a GPU attached, the cell below measures the same comparison live.

# %%
if flashlab.device.has_gpu():
    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_attention

    cuda = flashlab.device.get_cuda()
    B, H, d = 1, 16, 128
    rows = []
    for nk in (4096, 16384, 65536):
        q, k, v = (cuda.to_device(rng.standard_normal((B, H, n, d)).astype(np.float16)) for n in (1, nk, nk))
        fa2 = time_cuda(lambda: flash_attention(q, k, v), reps=20)["median_ms"]
        split = time_cuda(lambda: decoding_kernel(q, k, v), reps=20)["median_ms"]
        gb = 2 * B * H * nk * d * 2 / 1e9
        rows.append((nk, fa2, split))
        print(f"Nk={nk:6d}: FA2 kernel {fa2 * 1e3:8.1f} µs ({gb / fa2 * 1e3:6.0f} GB/s)   "
              f"split-KV {split * 1e3:7.1f} µs ({gb / split * 1e3:6.0f} GB/s)   {fa2 / split:4.1f}x")
else:
    print("No GPU here: the simulator runs the kernels correctly but a thread at a time, in Python, so there is nothing to time.")

# %% [markdown]
# ## Summary
#
# - Decoding attends with one (or a few) queries to a long KV cache; FA2's grid of B·H·⌈Nq/Br⌉ blocks then
#   leaves most SMs idle.
# - Split-KV attention parallelises over keys: each chunk's (m, l, O) is computed independently and the
#   states are merged exactly with the factors e^(m_c − m), the merge of lesson 03 with O carried along.
# - The kernel: one block per (chunk, head, batch), reductions in shared memory, then a merge kernel.
#   Decoding is memory-bound, so measure it in GB/s against the GPU's bandwidth.
#
# **Next:** write the chunk's partial state and the merge yourself, and bound the time of a decoding step:
# [exercises/14_decoding.ipynb](../exercises/14_decoding.ipynb).
