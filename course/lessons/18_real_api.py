# %% [markdown]
# # 18 · The real API: the FlashAttention library's options
#
# **After this lesson you can**
# - read the options of the FlashAttention library's `flash_attn_func` and friends (GQA/MQA, `window_size`,
#   causal alignment, `alibi_slopes`, `softcap`, `dropout_p`, packed variable-length batches with
#   `cu_seqlens`, a paged KV cache with a `block_table`) and say what each does to the score matrix S;
# - say, for each option, which (query block, key block) tiles a FlashAttention kernel visits, which it
#   skips, and what it computes inside a tile;
# - check each option in flashlab's NumPy FlashAttention-2 against the explicit float64 reference
#   `flashlab.reference_attention`, which builds every option as a full Nq x Nk mask or bias;
# - say where flashlab differs from the library;
# - predict with a two-line model what packing a batch buys over a loop of launches, and check the prediction
#   against measured times;
# - name what else a user of the library meets: `deterministic`, `return_attn_probs`, `max_seqlen_q/k`, the
#   in-place cache append of `flash_attn_with_kvcache`, and the limits FA2 enforces.
#
# Every section shows a figure, then the formula, then code that checks flashlab against the reference.
# No algorithm is written here: the lesson calls `flashlab.reference`, `flashlab.tiled`, `flashlab.varlen`,
# `flashlab.dropout` and `flashlab.decoding`, where each one lives once.
#
# Sources: FlashAttention-2 (Dao 2023, arXiv 2307.08691), whose library exposes these options; MQA (Shazeer
# 2019, arXiv 1911.02150); GQA (Ainslie et al. 2023, arXiv 2305.13245); sliding-window attention in
# Longformer (Beltagy et al. 2020, arXiv 2004.05150) and Mistral 7B (Jiang et al. 2023, arXiv 2310.06825);
# ALiBi (Press et al. 2021, arXiv 2108.12409); logit soft-capping in Gemma 2 (Gemma Team 2024, arXiv
# 2408.00118); PagedAttention (Kwon et al. 2023, arXiv 2309.06180).

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import decoding, dropout, varlen
from flashlab.viz import real_api as fig

rng = np.random.default_rng(0)
err = flashlab.relative_error


def qkv(B, H, H_kv, nq, nk, d=16):
    """Fresh random q (B, H, Nq, d), k and v (B, H_kv, Nk, d)."""
    return rng.standard_normal((B, H, nq, d)), rng.standard_normal((B, H_kv, nk, d)), rng.standard_normal((B, H_kv, nk, d))


# %% [markdown]
# ## 0. One call, many options
#
# The library's forward is one function, `flash_attn_func(q, k, v, dropout_p, softmax_scale, causal,
# window_size, softcap, alibi_slopes, deterministic, return_attn_probs)`, plus `flash_attn_varlen_func` for
# packed batches and `flash_attn_with_kvcache` for decoding from a (paged) cache. flashlab's NumPy functions
# take the same options under the same names, and two of their own:
#
# | library option | what it changes | flashlab |
# | --- | --- | --- |
# | GQA / MQA (k, v with fewer heads) | which K/V head a query head reads | the same |
# | `causal`, `window_size=(left, right)` | the mask: a band around the diagonal, aligned bottom-right when Nq ≠ Nk | the same, plus `align="top_left"` (PyTorch's causal) |
# | `alibi_slopes` (H,) or (B, H) | a bias added to S | the same |
# | `softcap` | S squashed into (−softcap, softcap) | the same |
# | `dropout_p` | P multiplied by a random 0 / (1/(1−p)) mask, drawn from torch's CUDA generator | the same mask rule, from an explicit `seed` |
# | `cu_seqlens_q/k`, `max_seqlen_q/k` (varlen) | a batch without padding | `varlen.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)` |
# | `block_table`, `cache_seqlens` (paged KV) | where the keys are stored | `decoding.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens)` |
#
# The library has no `align` option: its causal mask and windows are always aligned bottom-right. Nor does
# it take a seed: its Philox generator gets its state (seed and offset) from torch's CUDA generator, so
# `torch.manual_seed` decides the mask. flashlab takes both explicitly so that a lesson can show PyTorch's
# alignment next to the library's, and a dropout mask can be rebuilt from its key alone.
#
# What a user of the library also meets (read from `flash_attn/flash_attn_interface.py` and
# `csrc/flash_attn/flash_api.cpp` of the flash-attention repository):
#
# - `deterministic=True` selects a backward that gives the same bits on every run, slower and with more
#   memory. The default backward adds dQ's shares from all key blocks with atomics, in whatever order the
#   blocks finish (lesson 17, section 2), so dQ can change in its last bits; the forward is always
#   deterministic.
# - `return_attn_probs=True` also returns the lse and P (with the dropout pattern encoded in its signs),
#   for testing only; FA2's C++ accepts it only together with dropout.
# - `flash_attn_varlen_func` requires `max_seqlen_q` and `max_seqlen_k` beside the cu_seqlens: they size the
#   grid, and computing them from cu_seqlens, which live on the GPU, would cost a wait for the device.
# - `flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...)` appends the new keys and values to the cache
#   **in place**, at positions `cache_seqlens`, and attends in the same kernel. Given `rotary_cos` and
#   `rotary_sin`, it applies rotary embeddings to the new keys (and queries) at those positions;
#   `cache_batch_idx` says which rows of the cache each sequence uses (not with a paged cache). It has no
#   backward pass.
# - FA2's paged cache needs pages of a multiple of 256 keys (`page_block_size % 256 == 0` in `flash_api.cpp`):
#   the page of 4 keys in section 7's picture would be refused.
# - FA2 refuses softcap together with dropout ("Softcapping does not support dropout for now"); flashlab
#   combines them.
#
# Every section below runs flashlab's NumPy code on the CPU; flashlab's GPU kernels take the same options,
# forward and backward ([docs/package.md](../docs/package.md) has the table).
#
# ## 1. GQA and MQA: fewer K/V heads than query heads

# %%
fig1, axes = plt.subplots(1, 3, figsize=(13, 2.4))
for ax, (H, H_kv) in zip(axes, [(8, 8), (8, 2), (8, 1)]):
    fig.plot_gqa_map(H, H_kv, ax=ax)
plt.show()

# %% [markdown]
# Multi-head attention (MHA) gives every query head its own K and V. Multi-query attention (MQA, Shazeer 2019)
# keeps one K/V head for all of them; grouped-query attention (GQA, Ainslie et al. 2023) sits between, with
# H_kv K/V heads each shared by a group of G = H / H_kv consecutive query heads:
#
# $$O_h = \mathrm{softmax}\!\left(\text{scale}\cdot Q_h K_{g(h)}^\top\right) V_{g(h)}, \qquad g(h) = \lfloor h / G \rfloor .$$
#
# Nothing changes inside a tile; only the K/V head a thread block loads. What it buys is a KV cache H / H_kv
# times smaller, and for decoding (lesson 14) that many times fewer bytes to read per token, provided the
# kernel packs the G query heads of a group into one block so the group reads its K/V head once. With one
# query per sequence, packing is a reshape: q of shape (B, H, 1, d) is q of shape (B, H_kv, G, d), G rows of one
# (batch, K/V head). On tensor cores those G ≤ 16 rows fill a 16-row mma tile that one query would have padded
# anyway, so the group costs what one head costs: `kernels.paged_decoding`'s tensor variant decodes this way
# (benchmarks/timing/bench_paged.py measures it). The check: GQA must equal MHA with each K/V head repeated G times.

# %%
q, k, v = qkv(2, 8, 2, 9, 13)
o, lse = flashlab.flash_attention_v2(q, k, v, causal=True, block_q=4, block_k=4)
o_ref, _ = flashlab.reference_attention(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), causal=True)
print(f"GQA (H = 8, H_kv = 2) in FA2 vs MHA with K, V repeated: relative error {err(o, o_ref):.1e}")
for H_kv in (8, 2, 1):
    print(f"H = 8, H_kv = {H_kv}: the KV cache holds {2 * H_kv} head-rows per token instead of {2 * 8}")

# %% [markdown]
# ## 2. Sliding window and alignment: which tiles are visited
#
# Below, each square is one tile, a block of `block_q` query rows against a block of `block_k` keys.
# Teal tiles lie entirely inside the visible band (no mask needed), orange tiles straddle its edge (the kernel
# builds a mask for them), grey tiles see nothing and are **skipped**: the kernel never loads their K and V.
# The black lines are the band's edges.

# %%
nq, nk, bq, bk = 20, 40, 4, 8
fig2, axes = plt.subplots(2, 3, figsize=(13, 6.5))
settings = [(True, (-1, -1), "top_left"), (True, (-1, -1), "bottom_right"), (False, (12, 0), "bottom_right"),
            (False, (6, 0), "top_left"), (False, (6, 0), "bottom_right"), (False, (4, 4), "bottom_right")]
for ax, (causal, window, align) in zip(axes.flat, settings):
    fig.plot_tile_grid(nq, nk, bq, bk, causal=causal, window_size=window, align=align, ax=ax)
fig2.tight_layout()
plt.show()

# %% [markdown]
# Query i sits at position pos_i among the keys and sees key j when
#
# $$\text{pos}_i - \text{left} \le j \le \text{pos}_i + \text{right}, \qquad \text{pos}_i = \begin{cases} i & \text{top\_left} \\ i + N_k - N_q & \text{bottom\_right}\end{cases}$$
#
# with −1 meaning unbounded on that side; causal is the window (−1, 0). With Nq = Nk the two alignments
# agree. They differ when Nq ≠ Nk: `top_left` (PyTorch's `is_causal`) lines query 0 up with key 0, while
# `bottom_right` (the FA library's causal since version 2.1) lines the *last* query up with the *last* key,
# which is what decoding and chunked prefill need: new queries come after all cached keys. With Nq > Nk,
# causal and bottom_right, the first Nq − Nk rows see no key at all: their output is 0 and their lse is +∞
# by the library's convention (the check below prints them).
#
# Sliding windows (Longformer; Mistral 7B uses a window of 4096 keys) make attention's cost linear in N:
# a query block meets about (left + block_q) / block_k + 1 key blocks, however long the sequence is. Count
# the visited tiles as N grows:

# %%
for n in (256, 512, 1024, 2048):
    causal_tiles = (fig.tile_classes(n, n, 64, 64, causal=True) > 0).sum()
    window_tiles = (fig.tile_classes(n, n, 64, 64, window_size=(128, 0)) > 0).sum()
    print(f"N = {n:5d}: causal visits {causal_tiles:4d} tiles, window (128, 0) visits {window_tiles:3d}")

# %% [markdown]
# FA2 skips exactly the grey tiles: its loop over key blocks runs only over the range the band touches
# (exercise 1 asks you to compute that range). The check: flashlab's FA2 with windows and both alignments
# against the explicit mask of `reference_attention`, rows that see nothing included.

# %%
q, k, v = qkv(1, 2, 2, 20, 40)
for causal, window, align in settings + [(True, (-1, -1), "bottom_right")]:
    o, lse = flashlab.flash_attention_v2(q, k, v, causal=causal, window_size=window, align=align, block_q=4, block_k=8)
    o_ref, lse_ref = flashlab.reference_attention(q, k, v, causal=causal, window_size=window, align=align)
    print(f"causal={causal!s:5}, window={window}, {align:12}: error {err(o, o_ref):.1e}")
q2, k2, v2 = qkv(1, 1, 1, 12, 5)  # Nq > Nk: the first rows see no key
o, lse = flashlab.flash_attention_v2(q2, k2, v2, causal=True, align="bottom_right", block_q=4, block_k=4)
print("Nq = 12, Nk = 5, causal bottom_right: lse of the first rows:", lse[0, 0, :8])

# %% [markdown]
# ## 3. ALiBi: a bias instead of position embeddings

# %%
fig3, axes = plt.subplots(1, 2, figsize=(11, 3.4))
fig.plot_alibi(0.25, 12, 24, (4, 8, 4, 8), align="top_left", ax=axes[0])
fig.plot_alibi(0.25, 12, 24, (4, 8, 4, 8), align="bottom_right", ax=axes[1])
fig3.tight_layout()
plt.show()

# %% [markdown]
# ALiBi (Press et al. 2021) adds no position embedding; it lowers each score in proportion to the distance
# between query and key, with one slope per head:
#
# $$S_{ij} \mathrel{+}= -m_h\,\lvert \text{pos}_i - j\rvert, \qquad m_h = 2^{-8(h+1)/H} \text{ (the paper's slopes for H a power of 2)}.$$
#
# Within a tile (framed in cyan) the bias is a function of the tile's corner (i0, j0) and the alignment only,
# so a kernel computes it from indices, never loads it. The check:

# %%
H = 4
slopes = 2.0 ** (-8 * np.arange(1, H + 1) / H)
print("slopes:", slopes)
q, k, v = qkv(2, H, 2, 10, 23)
for align in ("top_left", "bottom_right"):
    o, _ = flashlab.flash_attention_v2(q, k, v, causal=True, align=align, alibi_slopes=slopes, block_q=4, block_k=8)
    o_ref, _ = flashlab.reference_attention(q, k, v, causal=True, align=align, alibi_slopes=slopes)
    print(f"ALiBi + causal, {align}: error {err(o, o_ref):.1e}")

# %% [markdown]
# ## 4. Softcap: bounded scores

# %%
fig.plot_softcap(5.0)
plt.show()

# %% [markdown]
# Gemma 2 (arXiv 2408.00118) caps its attention logits at 50 with
#
# $$S \leftarrow c \tanh(S / c),$$
#
# the identity for |S| ≪ c and never beyond ±c, applied to the scaled scores before the mask. In a kernel it
# is one tanh per score of every visited tile, and the backward multiplies dS by the derivative
# 1 − tanh²(S / c). The check, forward and backward (the backward against central differences of the
# reference):

# %%
q, k, v = qkv(1, 2, 1, 8, 8, d=8)
q = q * 4  # scores large enough for the cap to matter
o, lse = flashlab.flash_attention_v2(q, k, v, softcap=2.0, causal=True, block_q=4, block_k=4)
o_ref, _ = flashlab.reference_attention(q, k, v, softcap=2.0, causal=True)
print(f"softcap forward: error {err(o, o_ref):.1e}")


def directional(f, x, dx, eps=1e-6):
    """(f(x + eps dx) - f(x - eps dx)) / (2 eps): a derivative of f along dx."""
    return (f(x + eps * dx) - f(x - eps * dx)) / (2 * eps)


do, dq_dir = rng.standard_normal(o.shape), rng.standard_normal(q.shape)
dq, dk, dv = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do, softcap=2.0, causal=True, block_q=4, block_k=4)
loss = lambda q_: (flashlab.reference_attention(q_, k, v, softcap=2.0, causal=True)[0] * do).sum()  # noqa: E731
print(f"softcap backward: <dq, dir> = {(dq * dq_dir).sum():.8f}, central difference {directional(loss, q, dq_dir):.8f}")

# %% [markdown]
# ## 5. Dropout, regenerated in the backward

# %%
fig.plot_dropout_tiles(seed=3, p=0.3, nq=16, nk=24, block_q=4, block_k=8)
plt.show()

# %% [markdown]
# Dropout on attention multiplies P by a random mask Z (each entry kept with probability 1 − p) and rescales:
#
# $$O = \left(P \circ \tfrac{Z}{1-p}\right) V, \qquad Z_{ij} = [\,\text{hash}(\text{seed}, b, h, i, j) \ge \lfloor p\, 2^{32} \rfloor\,].$$
#
# FlashAttention never stores the Nq x Nk mask; the backward regenerates it. For that, Z must be a pure
# function of the entry's *key* (seed, batch, head, row, column), not the state of a generator that is read
# in order: the forward and the backward visit tiles in different orders, and different blocks run at
# once. The figure builds the whole mask, then the same mask tile by tile, bottom block first: identical.
# (The lse stays that of P before dropout, so the backward's P = exp(S − lse) needs nothing else.)
#
# The check: forward and backward with dropout against the reference, which builds Z in full from the same
# key; the backward with other tile sizes than the forward's; and dq against central differences.

# %%
q, k, v = qkv(1, 2, 2, 9, 11, d=8)
kw = dict(dropout_p=0.25, seed=1234, causal=True)
o, lse = flashlab.flash_attention_v2(q, k, v, block_q=4, block_k=4, **kw)
o_ref, lse_ref = flashlab.reference_attention(q, k, v, **kw)
print(f"dropout forward: error {err(o, o_ref):.1e}; kept fraction {(dropout.keep_scale(1234, 0.25, 0, 0, np.arange(9)[:, None], np.arange(11)) > 0).mean():.2f}")
do = rng.standard_normal(o.shape)
g1 = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do, block_q=4, block_k=4, **kw)
g2 = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do, block_q=3, block_k=5, **kw)
print(f"backward with other tiles than the forward's: max difference {max(np.abs(a - b).max() for a, b in zip(g1, g2)):.1e}")
loss = lambda q_: (flashlab.reference_attention(q_, k, v, **kw)[0] * do).sum()  # noqa: E731
dq_dir = rng.standard_normal(q.shape)
print(f"dropout backward: <dq, dir> = {(g1[0] * dq_dir).sum():.8f}, central difference {directional(loss, q, dq_dir):.8f}")

# %% [markdown]
# ## 6. Variable-length batches: packing without padding

# %%
lengths_q, lengths_k = np.array([5, 7, 8]), np.array([6, 7, 11])
cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (lengths_q, lengths_k))
opts = dict(causal=True, align="bottom_right", window_size=(4, 0))
fig.plot_varlen_mask(cu_q, cu_k, **opts)
plt.show()

# %% [markdown]
# A padded batch of sequences of lengths 5, 7, 8 is a (3, 8) array with rows of padding that the kernel
# still multiplies. `flash_attn_varlen_func` instead packs them one after another into (total, H, d) and
# passes the boundaries as cumulative lengths, `cu_seqlens_q = [0, 5, 12, 20]`: sequence b holds rows
# cu_seqlens_q[b] … cu_seqlens_q[b+1] − 1, and likewise its keys with `cu_seqlens_k` (here 6, 7 and 11
# keys: some already cached). Each sequence attends only to its own keys, a block-diagonal mask over the
# packed rows, with each block masked by the options (here causal, bottom-right, a window of 4):
#
# $$O_{[c_b, c_{b+1})} = \mathrm{attention}\!\left(Q_{[c_b, c_{b+1})},\, K_{[c'_b, c'_{b+1})},\, V_{[c'_b, c'_{b+1})}\right).$$
#
# A kernel never visits the white area: each thread block finds its sequence from cu_seqlens and loops
# over that sequence's keys only. FA2 launches a grid of (ceil(max_seqlen_q / block_q), batch, heads) thread
# blocks, as if every sequence were the longest; a block whose query rows start past its sequence's end
# returns at once (`flash_fwd_kernel.h`), so the padding costs a launch slot, not work. That is why it needs
# `max_seqlen_q`. flashlab's `kernels.flash_attention_varlen` does it another way, its own design: the host
# makes a table of every query block of every sequence as (sequence, first row), heaviest first, and launches
# one thread block per entry and head, so no block is empty and the long ones start first. That is closer to
# FlashAttention-3's varlen scheduler on Hopper, which hands out the longest remaining tiles first
# (`hopper/tile_scheduler.hpp`). The two schedules for one head of a batch of mixed lengths, 128-row blocks:

# %%
from flashlab.viz import kernel_tiles

mixed = [700, 33, 128, 1, 260, 90]
kernel_tiles.plot_varlen_grid(mixed, block_q=128)
plt.show()
launched, working = kernel_tiles.varlen_blocks(mixed, 128)
print(f"FA2's grid: {launched} blocks per head, {launched - working} of them idle; the packed list: {working}")

# %% [markdown]
# The check: the packed call (with GQA too) against the reference run on each sequence alone.

# %%
H, H_kv, d = 4, 2, 8
q = rng.standard_normal((cu_q[-1], H, d))
k, v = rng.standard_normal((cu_k[-1], H_kv, d)), rng.standard_normal((cu_k[-1], H_kv, d))
o, lse = varlen.flash_attention_varlen(q, k, v, cu_q, cu_k, block_q=4, block_k=4, **opts)
worst = 0.0
for b in range(len(lengths_q)):
    sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
    seq = lambda x, rows: x[rows].transpose(1, 0, 2)[None]  # noqa: E731  (1, heads, n_b, d)
    o_b, _ = flashlab.reference_attention(seq(q, sl_q), seq(k, sl_k), seq(v, sl_k), **opts)
    worst = max(worst, err(seq(o, sl_q), o_b))
print(f"varlen vs each sequence alone: worst relative error {worst:.1e}")
padded, packed = len(lengths_q) * lengths_q.max() * lengths_k.max(), (lengths_q * lengths_k).sum()
print(f"scores of a padded batch: {padded}; of the packed one: {packed} ({packed / padded:.2f} of them)")

# %% [markdown]
# **Packing against a loop of launches: a model first.** A loop launches one kernel per sequence; one packed
# launch runs them all. Two lines say what each costs. Let t_i be sequence i's work at the rate of a launch
# that fills the GPU, f_i ≤ 1 the share of the SMs its own grid fills (its thread blocks over the SM count),
# and t_launch what one launch costs at least (host work and launch latency):
#
# $$T_{loop} \approx \sum_i \max\!\left(t_{launch},\ \frac{t_i}{f_i}\right), \qquad T_{packed} \approx t_{launch} + \sum_i t_i .$$
#
# A short sequence's launch is bound by t_launch or by idle SMs; a long one fills the GPU by itself and costs
# the loop nothing extra. `benchmarks/timing/bench_varlen.py` timed two uncausal batches on one GPU: 256
# sequences of 32 to 1024 tokens, and 64 sequences of 129 to 4096. **Predict before you run the next cell:**
# for which batch does one packed launch gain more over the loop, and roughly how much?
#
# The cell fills in the model: the rate from the tensor kernel's measured TFLOP/s at N = 4096
# (`flashlab/data/h100_tensor.csv`), t_launch from the batch of short sequences, whose launches are all shorter
# than a launch costs (so its loop time per sequence is about t_launch), and the kernel's default block of 128
# query rows. Then it prints the measurement (`flashlab/data/varlen.json`).

# %%
from flashlab.hardware import GPUS
from flashlab.viz import tensor as tviz

runs = fig.load_varlen_results()
speed = {(r["d"], r["causal"]): r["tflops"] for r in tviz.load_tensor_results()
         if r["impl"] == "flashlab tensor f16" and r["N"] == 4096}
short = [r for r in runs if max(r["lens"]) <= 1024 and not r["causal"]]
if runs and short and speed:
    t_launch = short[0]["ms"]["flashlab loop"] * 1e-3 / len(short[0]["lens"])
    print(f"t_launch from the short batch: {t_launch * 1e6:.0f} µs; rate at N = 4096: "
          f"{speed[(runs[0]['d'], 0)]:.0f} TFLOP/s (causal {speed[(runs[0]['d'], 1)]:.0f})")
    for run in runs:
        rate = speed[(run["d"], int(run["causal"]))] * 1e12
        model = fig.launch_model(run["lens"], run["H"], run["d"], run["causal"], rate, t_launch, GPUS["H100"].sms)
        ms = run["ms"]
        print(f"{fig.varlen_batch_name(run):24s} model: loop {model['loop_ms']:5.2f} ms, "
              f"packed {model['packed_ms']:5.2f} ms, loop / packed {model['loop_ms'] / model['packed_ms']:4.2f}  |  "
              f"measured: loop {ms['flashlab loop']:5.2f}, packed {ms['flashlab varlen']:5.2f}, "
              f"loop / packed {ms['flashlab loop'] / ms['flashlab varlen']:4.2f}")

# %% [markdown]
# t_launch was fitted on the short batch's loop, so that one number agrees by construction; the packed times and
# the mixed batch are the model's real test, and it gets their order and rough size right. Over many short sequences the loop pays t_launch (or idle
# SMs) hundreds of times and packing wins by a wide margin. Over mixed lengths up to 4096, most of the work is
# in long sequences whose own launches fill the GPU: packing saves only the short sequences' launches and idle
# SMs, a modest gain. No speed-up of the kernel changes that much, because it shortens the loop's long
# launches as much as the packed one. What the model leaves out (waves that leave SMs idle at the end of a
# grid, how the packed launch orders its blocks, a rate that is not the same at every length) is what the
# measurement adds. The figure shows all five ways `bench_varlen.py` ran each batch, padding included: padding
# does the most work of all, since every sequence pays for the longest.

# %%
fig.plot_varlen_speed(runs)
plt.show()

# %% [markdown]
# ## 7. A paged KV cache: a block table

# %%
page_size, num_pages = 4, 8
block_table = np.array([[5, 1, 7], [2, 0, 0], [3, 6, 4]])
cache_seqlens = np.array([10, 3, 12])
fig.plot_block_table(block_table, cache_seqlens, page_size, num_pages)
plt.show()

# %% [markdown]
# A server decoding many sequences cannot reserve each one's longest possible cache up front. PagedAttention
# (Kwon et al. 2023, the vLLM paper) stores keys and values in fixed-size pages, like virtual memory: the
# cache is one pool `k_cache` of shape (num_pages, page_size, H_kv, d), and row b of `block_table` lists the
# physical pages of sequence b in order. Key `pos` of sequence b lives at
#
# $$\text{k\_cache}\big[\text{block\_table}[b, \lfloor \text{pos} / \text{page\_size}\rfloor],\ \text{pos} \bmod \text{page\_size}\big], \qquad 0 \le \text{pos} < \text{cache\_seqlens}[b].$$
#
# Only the last page of a sequence is partly empty. The unused entries of a row (row 1 above: 3 keys, one
# page) hold a placeholder, here 0, that is never read: only positions below cache_seqlens[b] are. (vLLM
# also lets sequences with a common prefix point at the same pages.) The kernel reads a page at a time
# through the table instead of a contiguous K; the attention itself is split-KV decoding (lesson 14) with
# causal bottom-right alignment. The check: `paged_attention` against the reference on each sequence's keys
# gathered into a contiguous array.

# %%
B, H, H_kv, d, nq = 3, 4, 2, 8, 2
k_cache, v_cache = rng.standard_normal((2, num_pages, page_size, H_kv, d))
q = rng.standard_normal((B, H, nq, d))
o, lse = decoding.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, causal=True, num_splits=2)
for b in range(B):
    pos = np.arange(cache_seqlens[b])
    keys = k_cache[block_table[b, pos // page_size], pos % page_size].transpose(1, 0, 2)  # (H_kv, n, d)
    vals = v_cache[block_table[b, pos // page_size], pos % page_size].transpose(1, 0, 2)
    o_b, _ = flashlab.reference_attention(q[b:b + 1], keys[None], vals[None], causal=True, align="bottom_right")
    n_pages = len(set(pos // page_size))
    print(f"sequence {b} ({cache_seqlens[b]:2d} keys on {n_pages} page{'s' * (n_pages > 1)}): error {err(o[b:b + 1], o_b):.1e}")
reserved = B * block_table.shape[1] * page_size
print(f"slots in use: {cache_seqlens.sum()} of {reserved} reserved by the table ({cache_seqlens.sum() / reserved:.2f})")

# %% [markdown]
# ## 8. Where flashlab differs from the FlashAttention library
#
# - **Options.** flashlab adds `align` (PyTorch's top-left causal beside the library's bottom-right) and an
#   explicit dropout `seed`; it lacks the library's rotary embeddings, in-place cache append and
#   `deterministic` switch. Which flashlab kernel takes which option is in the feature table of
#   [docs/package.md](../docs/package.md).
# - **ALiBi's constant.** The library's causal kernels add +m·j instead of −m·|pos_i − j|: under a causal
#   mask (j ≤ pos_i) the two differ by m·pos_i, a constant per row, which cancels in the softmax. The output
#   is the same, the lse is not. flashlab uses −m·|pos_i − j| everywhere (`reference.alibi_bias`).
# - **Dropout's generator.** The library runs Philox, a counter-based generator, with a state (seed and offset)
#   drawn from torch's CUDA generator and the entry's position as counter; flashlab hashes the same kind of
#   key, (seed, batch, head, row, col), with a smaller integer hash (`flashlab.dropout`). Same property,
#   different masks: a mask from one cannot be checked against the other.
# - **Rows that see no key** get o = 0 and lse = +∞ in both, so the backward's exp(S − lse) is 0, never NaN.
# - **Checking the block table.** The library never checks the table's values: an out-of-range page index
#   reads the wrong memory. `kernels.paged_decoding` checks them by default, on the GPU for torch tensors,
#   and waits for the answer; `check_tables=False` skips the check and the wait, as the library does. In a
#   decoding loop the table and the lengths change every step, so the kernel takes them as arguments and
#   never reads their values on the host (its split count comes from the table's capacity).
# - **Layouts.** flashlab's dense functions take (B, H, N, d) like PyTorch's SDPA; the library takes
#   (B, N, H, d). varlen uses the library's packed (total, H, d) and its lse of shape (H, total).
# - **Packed batches.** The library's varlen grid covers max_seqlen_q for every sequence and lets empty
#   blocks exit; flashlab's launch lists only the blocks that have work, heaviest first (section 6).
#
# ## Summary
#
# - GQA/MQA changes which K/V head a query head reads, not what happens in a tile; its gain is a smaller
#   KV cache, fully realised in decoding when the query heads of a group share one read.
# - Causal and sliding windows are one band, placed by the alignment; tiles outside it are skipped, so a
#   window makes the cost linear in N.
# - ALiBi and softcap change the scores of visited tiles and are computed from indices, never loaded.
# - Dropout's mask is a pure function of (seed, batch, head, row, col), so the backward regenerates it.
# - varlen and the paged KV cache change only where rows and keys are found: cu_seqlens and a block table.
#
# **Next:** compute visited key blocks, ALiBi's two forms, softcap's backward, a varlen batch and grid, and a
# block-table lookup yourself: [exercises/18_real_api.ipynb](../exercises/18_real_api.ipynb).
