# %% [markdown]
# # Exercises 18: the real API
#
# Goes with lesson [18 the real API](../notebooks/18_real_api.ipynb). Seven functions, each a piece of what a
# FlashAttention kernel does for one of the library's options, each followed by a cell that shows what it
# means:
#
# 1. the key blocks a query block visits under a sliding window and an alignment;
# 2. one tile of the ALiBi bias;
# 3. ALiBi under the causal mask: the library's `+slope * j` against `-slope * |pos_i - j|`;
# 4. softcap's factor in the backward, inside one tile;
# 5. a packed (varlen) batch, by looping the course's tiled FA2 over `cu_seqlens`;
# 6. FA2's varlen grid: how many of its thread blocks work and how many exit at once;
# 7. a K tile gathered through a paged cache's block table, across page boundaries.
#
# The checker compares each with flashlab's own semantics (`flashlab.reference_attention` and friends) on
# many random shapes.

# %%
import math

import numpy as np

import flashlab

# %% [markdown]
# ## 1. Which key blocks does a query block visit?
#
# Query rows come in blocks of `block_q`, keys in blocks of `block_k`. Query i sits at position
# `pos_i = i + offset` among the keys, with `offset = Nk - Nq` for `align="bottom_right"` and 0 for
# `"top_left"`, and sees the keys j with `pos_i - left <= j <= pos_i + right` (`window_size = (left, right)`,
# -1 meaning unbounded on that side; causal is the window (-1, 0)). Return the indices of the key blocks
# that query block `i_block` must visit, in increasing order: those that hold at least one key that at least
# one of its rows sees. The last blocks may be short (Nq, Nk need not be multiples of the block sizes), and
# a block whose rows see no key at all visits nothing.

# %%
def visited_key_blocks(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """Indices of the key blocks that query block i_block meets, in increasing order."""
    ### BEGIN SOLUTION
    left, right = window_size
    offset = Nk - Nq if align == "bottom_right" else 0
    first, last = i_block * block_q, min((i_block + 1) * block_q, Nq) - 1  # the block's rows
    lo = 0 if left < 0 else max(0, first + offset - left)  # the first key any of them sees
    hi = Nk - 1 if right < 0 else min(Nk - 1, last + offset + right)  # the last one
    if hi < lo:
        return []
    return list(range(lo // block_k, hi // block_k + 1))
    ### END SOLUTION


# %%
print(visited_key_blocks(2, 4, 4, 16, 16, (-1, 0), "top_left"))  # causal: blocks 0, 1, 2
print(visited_key_blocks(0, 4, 4, 6, 20, (-1, 0), "bottom_right"))  # 6 queries at the end of 20 keys

# %%
flashlab.check("visited_key_blocks", visited_key_blocks)

# %% [markdown]
# ## 2. One tile of the ALiBi bias
#
# ALiBi adds `-slope * |pos_i - j|` to the score of query i and key j (positions aligned as in exercise 1).
# A kernel builds this bias one tile at a time, from the tile's corner. Return the bias of the tile whose
# first row is `i0` and first key `j0`, as a float array: `block_q` rows and `block_k` keys, fewer at the
# edges (only rows < Nq and keys < Nk).

# %%
def alibi_tile(slope, i0, j0, block_q, block_k, Nq, Nk, align):
    """The ALiBi bias of one tile, shape (min(block_q, Nq - i0), min(block_k, Nk - j0))."""
    ### BEGIN SOLUTION
    offset = Nk - Nq if align == "bottom_right" else 0
    pos = np.arange(i0, min(i0 + block_q, Nq))[:, None] + offset
    j = np.arange(j0, min(j0 + block_k, Nk))[None, :]
    return -slope * np.abs(pos - j).astype(np.float64)
    ### END SOLUTION


# %%
print(alibi_tile(0.5, 0, 4, 2, 4, 4, 8, "bottom_right"))

# %%
flashlab.check("alibi_tile", alibi_tile)

# %% [markdown]
# ## 3. ALiBi under the causal mask: the same O, another lse
#
# flashlab adds ALiBi's bias `-slope * |pos_i - j|` everywhere. The library's causal kernels add `+slope * j`
# instead, a bias that depends on the key's column alone (`csrc/flash_attn/src/mask.h`; without the causal
# mask they use the distance, as flashlab does). Under the causal mask a visible key has `j <= pos_i`, so
# `-slope * |pos_i - j| = slope * j - slope * pos_i`: the two biases differ by `slope * pos_i`, one constant
# per row. What does that constant change?
#
# Compute one head's causal attention with each bias and return `((O_abs, lse_abs), (O_lin, lse_lin))`:
# `S = Q K^T / sqrt(d)` plus the bias (`-slope * |pos_i - j|` for "abs", `+slope * j` for "lin"), the causal
# mask aligned bottom-right as in the library (query i at `pos_i = i + Nk - Nq` sees the keys `j <= pos_i`),
# the softmax, `O = P V` and `lse_i = log sum_j exp(S_ij)` over the visible keys. A row that sees no key
# (when Nq > Nk) gets O = 0 and lse = +inf. Work in float64.

# %%
def alibi_causal_forms(Q, K, V, slope):
    """((O_abs, lse_abs), (O_lin, lse_lin)): causal, bottom-right attention of Q (Nq, d) on K (Nk, d), V (Nk, dv)
    with the bias -slope * |pos_i - j|, then with +slope * j."""
    ### BEGIN SOLUTION
    Nq, Nk = len(Q), len(K)
    pos = np.arange(Nq)[:, None] + (Nk - Nq)  # bottom-right: the last query sits on the last key
    j = np.arange(Nk)[None, :]
    S = Q @ K.T / math.sqrt(Q.shape[1])
    forms = []
    for bias in (-slope * np.abs(pos - j), slope * j + 0 * pos):
        S_b = np.where(j <= pos, S + bias, -np.inf)
        m = S_b.max(axis=1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)  # a row that sees no key: exp(-inf - 0) = 0, not NaN
        P = np.exp(S_b - m)
        l = P.sum(axis=1, keepdims=True)
        seen = l > 0
        O = (P @ V) / np.where(seen, l, 1.0)
        lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), np.inf)[:, 0]
        forms.append((O, lse))
    return tuple(forms)
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
Q, K, V = rng.standard_normal((5, 16)), rng.standard_normal((12, 16)), rng.standard_normal((12, 16))
(O_abs, lse_abs), (O_lin, lse_lin) = alibi_causal_forms(Q, K, V, slope=0.25)
print("largest |O_abs - O_lin|:", np.abs(O_abs - O_lin).max())
print("lse_lin - lse_abs:      ", lse_lin - lse_abs)
print("slope * pos_i:          ", 0.25 * (np.arange(5) + 12 - 5))

# %%
flashlab.check("alibi_causal_forms", alibi_causal_forms)

# %% [markdown]
# ## 4. Softcap's factor in the backward, inside one tile
#
# Softcap replaces the scaled scores S by `S' = softcap * tanh(S / softcap)` before the mask and the softmax.
# The backward's softmax step gives `dS' = P * (dP - D)`, the gradient with respect to S'; the chain rule
# through the cap multiplies it by the cap's derivative, `dS = dS' * (1 - tanh(S / softcap)^2)`, before
# `dQ += scale * dS K_j` and `dK += scale * dS^T Q_i` use it.
#
# A kernel need not keep S for that: the tile it holds is enough. You get one tile as the softmax saw it:
# `S_capped`, the capped scores, with -inf where the mask hides a key (a tile on the causal diagonal, say),
# and `dS_capped`, which is 0 there. Return dS for the tile, 0 at the masked entries, in the input's dtype.
# (FA2's backward recomputes the tile from Q_i K_j^T and keeps its tanh from before the mask,
# `csrc/flash_attn/src/flash_bwd_kernel.h`; here only the masked tile is left.)

# %%
def softcap_dS(S_capped, dS_capped, softcap):
    """dS (r, c): the gradient with respect to the uncapped scores S of a tile, from S' = softcap * tanh(S / softcap)
    (-inf where masked) and the gradient dS' with respect to S' (0 where masked)."""
    ### BEGIN SOLUTION
    visible = np.isfinite(S_capped)
    T = np.where(visible, S_capped, 0) / softcap  # tanh(S / softcap), recovered from the capped score
    return np.where(visible, dS_capped * (1 - T * T), 0).astype(S_capped.dtype)
    ### END SOLUTION


# %%
rng = np.random.default_rng(1)
cap = 4.0
S = 2 * cap * rng.standard_normal((4, 6))  # scores up to a few caps
visible = np.arange(6)[None, :] <= np.arange(4)[:, None] + 2  # a tile on a causal diagonal
G = np.where(visible, rng.standard_normal((4, 6)), 0.0)  # dS': 0 where masked
S_capped = np.where(visible, cap * np.tanh(S / cap), -np.inf)
dS = softcap_dS(S_capped, G, cap)
loss = lambda S_: (G * np.where(visible, cap * np.tanh(S_ / cap), 0)).sum()  # noqa: E731  (dS' is its gradient in S')
fd = np.zeros_like(S)
for i, j in zip(*np.nonzero(visible)):  # central differences, one score at a time
    E = np.zeros_like(S)
    E[i, j] = 1e-6
    fd[i, j] = (loss(S + E) - loss(S - E)) / 2e-6
print(f"largest |dS - central difference|: {np.abs(dS - fd).max():.1e}")
order = np.argsort(np.abs(S[visible]))
print("|S| / cap of the visible scores:", np.round(np.abs(S[visible])[order] / cap, 2))
print("their factor dS / dS':          ", np.round((dS[visible] / G[visible])[order], 3))

# %%
flashlab.check("softcap_dS", softcap_dS)

# %% [markdown]
# ## 5. A packed batch, one sequence at a time
#
# `flash_attn_varlen_func` takes a batch packed without padding: q of shape (total_q, H, d) holds sequence b in
# rows `cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1`, and k, v of shape (total_k, H_kv, d) hold its keys and values
# in rows `cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1`. Each sequence attends to its own keys only, and causal
# means the library's alignment, bottom-right, within each sequence.
#
# Write the packed call as a loop over the sequences that calls the course's tiled FA2,
# `flashlab.flash_attention_v2(q_b, k_b, v_b, causal=causal, align="bottom_right", block_q=block_q,
# block_k=block_k)`, on each sequence's arrays of shape (1, H, n_b, d) (it takes GQA: H_kv may divide H). Return
# `(o, lse)` in the library's varlen layouts: o of shape (total_q, H, dv) and lse of shape (H, total_q).
#
# A real batch has edge cases that `flash_attention_v2` refuses: a sequence without queries (it has nothing to
# write) and one without keys (its rows see no key, so they get o = 0 and lse = +inf).

# %%
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """(o (total_q, H, dv), lse (H, total_q)) of a packed batch, one flash_attention_v2 call per sequence."""
    ### BEGIN SOLUTION
    o = np.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), np.inf, np.float64 if q.dtype == np.float64 else np.float32)
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        keys = slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            continue  # no queries: nothing to write; no keys: o = 0 and lse = +inf, as filled
        seq = lambda x, r: x[r].transpose(1, 0, 2)[None]  # noqa: E731  (n_b, heads, d) -> (1, heads, n_b, d)
        o_b, lse_b = flashlab.flash_attention_v2(seq(q, rows), seq(k, keys), seq(v, keys), causal=causal,
                                                 align="bottom_right", block_q=block_q, block_k=block_k)
        o[rows] = o_b[0].transpose(1, 0, 2)
        lse[:, rows] = lse_b[0]
    return o, lse
    ### END SOLUTION


# %%
rng = np.random.default_rng(2)
cu_q, cu_k = np.array([0, 5, 12, 12, 20]), np.array([0, 6, 13, 17, 17])  # sequence 2: no queries; 3: no keys
q = rng.standard_normal((20, 4, 8))
k, v = rng.standard_normal((17, 2, 8)), rng.standard_normal((17, 2, 8))
o, lse = varlen_attention(q, k, v, cu_q, cu_k, causal=True, block_q=4, block_k=4)
o_lib, lse_lib = flashlab.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, align="bottom_right")
print(f"largest difference from flashlab.flash_attention_varlen: {np.abs(o - o_lib).max():.1e}")
print("lse of head 0, sequence 3 (no keys):", lse[0, 12:])

# %%
flashlab.check("varlen_attention", varlen_attention)

# %% [markdown]
# ## 6. FA2's varlen grid: blocks that work, blocks that exit
#
# A GPU kernel does not loop over the sequences on the host: it launches one grid for the whole packed batch.
# FA2 launches `(ceil(max_seqlen_q / block_q), batch, heads)` thread blocks (`flash_fwd_launch_template.h`),
# block (m, b, h) taking query rows `m * block_q, m * block_q + 1, ...` of sequence b for head h, as if every
# sequence were `max_seqlen_q` long. `max_seqlen_q` is an argument the caller passes, at least the longest
# sequence. A block whose first row lies at or past its sequence's end returns at once (`flash_fwd_kernel.h`).
#
# Return `(working, idle)`: how many blocks of that grid have query rows to compute, and how many exit at once.
# The cell after compares FA2's grid with flashlab's own varlen launch, which lists only the blocks that have
# rows, as (sequence, first row), the heaviest first (the lesson's section 6; closer to FlashAttention-3's
# scheduler).

# %%
def fa2_varlen_grid(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """(working, idle): the blocks of FA2's varlen grid that have query rows, and those that exit at once."""
    ### BEGIN SOLUTION
    lengths = np.diff(cu_seqlens_q)
    launched = math.ceil(max_seqlen_q / block_q) * len(lengths) * heads
    working = int(sum(math.ceil(n / block_q) for n in lengths)) * heads
    return working, launched - working
    ### END SOLUTION


# %%
rng = np.random.default_rng(3)
lens = rng.integers(129, 4097, 64)  # 64 sequences of 129 to 4096 tokens, as in the lesson's benchmark
cu = np.concatenate([[0], np.cumsum(lens)])
working, idle = fa2_varlen_grid(cu, int(lens.max()), 128, 16)
# flashlab's launch: one entry (sequence, first row) per query block with rows, heaviest first
table = flashlab.kernels.varlen.block_table(cu, cu, 128, 128, causal=True, bottom_right=True)
print(f"FA2's grid: {working + idle} blocks, {working} with rows, {idle} that exit at once")
print(f"flashlab's packed table: {len(table) * 16} blocks (16 heads), every one with rows")
print("its first entries (sequence, first row):", table[:3].tolist(), "of sequences", lens[table[:3, 0]].tolist(),
      "long")

# %%
flashlab.check("fa2_varlen_grid", fa2_varlen_grid)

# %% [markdown]
# ## 7. A K tile through the block table, across page boundaries
#
# A paged cache stores the keys of sequence b `page_size` at a time: key `pos` lies in slot `pos % page_size`
# of physical page `block_table[b, pos // page_size]`, for `0 <= pos < cache_seqlens[b]`. A kernel loads K one
# tile of `block_k` keys at a time. FA2 accepts only pages of a multiple of 256 keys, so that a tile never
# leaves its page: it reads the tile as `block_k` consecutive rows from one page and one offset
# (`flash_fwd_kernel.h`). With smaller pages (vLLM's hold 16 keys by default; flashlab's paged kernel takes any
# size) a tile can span two pages or more, and each row is found through the table.
#
# Return the tile of keys `k0 .. k0 + block_k - 1` of sequence b, from `k_cache` of shape (num_pages, page_size,
# d) (one K/V head), as a (block_k, d) array. Its rows at and past `cache_seqlens[b]` are zero, as a kernel
# fills the rest of its fixed-size tile: the slots there hold stale keys of other sequences, or do not exist.

# %%
def paged_k_tile(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """Keys k0 .. k0 + block_k - 1 of sequence b, shape (block_k, d), zero past cache_seqlens[b]."""
    ### BEGIN SOLUTION
    page_size = k_cache.shape[1]
    tile = np.zeros((block_k, k_cache.shape[2]), k_cache.dtype)
    pos = np.arange(k0, min(k0 + block_k, cache_seqlens[b]))  # only the keys the sequence has
    tile[:len(pos)] = k_cache[block_table[b, pos // page_size], pos % page_size]
    return tile
    ### END SOLUTION


# %%
k_cache = np.arange(8 * 4 * 2, dtype=np.float64).reshape(8, 4, 2)  # slot s of page p holds 8p + 2s, 8p + 2s + 1
block_table = np.array([[5, 1, 7], [2, 0, 3]])
cache_seqlens = np.array([10, 3])
print(paged_k_tile(k_cache, block_table, cache_seqlens, 0, 2, 8))  # keys 2..9 of sequence 0: pages 5, 1 and 7
print(paged_k_tile(k_cache, block_table, cache_seqlens, 1, 0, 4))  # sequence 1 has 3 keys

# %%
flashlab.check("paged_k_tile", paged_k_tile)

# %% [markdown]
# ## 8. Think about it
#
# - In exercise 1, how many key blocks does a query block visit with a window of (w, 0) and block_k = w,
#   however long the sequence? What does that make the cost of sliding-window attention, in N?
# - The backward recomputes P = exp(S - lse) with the lse the forward saved (exercise 3). What happens if the
#   forward used one ALiBi form and the backward the other: by what factor is row i of P off?
# - Gemma 2 caps its attention logits at 50. From exercise 4's factor: how large must a score be before its
#   gradient drops below a hundredth of dS'? What does a cap do to the scores that sit far beyond it?
# - Exercise 6: for which batches does FA2's grid hold the most idle blocks? An idle block exits at once: what
#   does it still cost?
# - Why must the dropout key use absolute row and column indices, not offsets inside the tile? (Hint: the
#   backward's tiles need not be the forward's.)
# - Exercise 7 zeroes the rows at `cache_seqlens[b]` and after, though the last page may have room there. Who
#   writes that slot next?
