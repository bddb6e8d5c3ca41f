# %% [markdown]
# # Exercises 18: the real API
#
# Goes with lesson [18 the real API](../notebooks/18_real_api.ipynb). Six small functions, each the piece of
# bookkeeping a FlashAttention kernel does for one of the library's options: which key blocks a query block
# visits under a sliding window, which K/V head a query head reads, what packing query heads saves, one
# tile of the ALiBi bias, the dropout mask regenerated from its key, and where a key lives in a paged cache.
# The checker compares each with flashlab's own semantics (`flashlab.reference_attention` and friends) on
# many random shapes.

# %%
import numpy as np

import flashlab
from flashlab import dropout

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
# ## 2. The GQA head map
#
# With grouped-query attention, q has H heads and k, v have H_kv (H_kv divides H). Which K/V head does query
# head `h` read? (Lesson 18's figure: groups of consecutive query heads.)

# %%
def kv_head(h, H, H_kv):
    """The K/V head that query head h reads."""
    ### BEGIN SOLUTION
    return h // (H // H_kv)
    ### END SOLUTION


# %%
print([kv_head(h, 8, 2) for h in range(8)])

# %%
flashlab.check("kv_head", kv_head)

# %% [markdown]
# ## 3. What packing query heads saves
#
# A decoding step reads the whole K and V caches: `seqlen` keys of dimension `d` per sequence and per K/V
# head, `itemsize` bytes a number. A kernel that gives each query head its own thread block reads its K/V
# head once per query head; one that packs the G = H / H_kv query heads of a group into one block reads
# each K/V head once. Return the bytes of K and V read from HBM by one step for B sequences.

# %%
def kv_bytes_read(B, H, H_kv, seqlen, d, itemsize, packed):
    """Bytes of K and V one decoding step reads, with (packed=True) or without the heads of a group packed."""
    ### BEGIN SOLUTION
    heads = H_kv if packed else H
    return 2 * B * heads * seqlen * d * itemsize
    ### END SOLUTION


# %%
for H_kv in (32, 8, 1):
    print(f"H_kv = {H_kv:2d}: packing reads {kv_bytes_read(1, 32, H_kv, 8192, 128, 2, False) / kv_bytes_read(1, 32, H_kv, 8192, 128, 2, True):.0f} times fewer bytes")

# %%
flashlab.check("kv_bytes_read", kv_bytes_read)

# %% [markdown]
# ## 4. One tile of the ALiBi bias
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
# ## 5. Regenerate the dropout mask
#
# The backward never reads a stored dropout mask: it calls the same generator with the same key. In
# flashlab the key is (seed, batch, head, row, col), hashed by `dropout.dropout_bits_array(seed, batch, head,
# row, col)` (index arrays broadcast), and an entry is kept when its hash is `>= dropout.keep_threshold(p)`.
# Return the boolean keep mask (True = kept) of the tile at query rows `rows` and key columns `cols`
# (1-D arrays of indices into the whole score matrix) of batch `b`, query head `h`.

# %%
def dropout_keep(seed, b, h, rows, cols, p):
    """Boolean keep mask, shape (len(rows), len(cols))."""
    ### BEGIN SOLUTION
    bits = dropout.dropout_bits_array(seed, b, h, rows[:, None], cols[None, :])
    return bits >= dropout.keep_threshold(p)
    ### END SOLUTION


# %%
print(dropout_keep(0, 0, 0, np.arange(4), np.arange(8), 0.5).astype(int))

# %%
flashlab.check("dropout_keep", dropout_keep)

# %% [markdown]
# ## 6. Where does a key live in a paged cache?
#
# The keys of sequence b are stored `page_size` at a time in pages of the cache; `block_table[b, n]` is the
# physical page that holds its n-th page of keys, and `cache_seqlens[b]` is how many keys it has. Return
# `(physical page, offset in the page)` of key `pos` of sequence `b`, or `None` when the sequence has no key
# at that position.

# %%
def physical_slot(block_table, cache_seqlens, b, pos, page_size):
    """(physical page, offset) of key pos of sequence b, or None if it does not exist."""
    ### BEGIN SOLUTION
    if not 0 <= pos < cache_seqlens[b]:
        return None
    return int(block_table[b, pos // page_size]), pos % page_size
    ### END SOLUTION


# %%
block_table = np.array([[7, 2, 5], [0, 3, 1]])
print(physical_slot(block_table, np.array([10, 4]), 0, 9, 4), physical_slot(block_table, np.array([10, 4]), 1, 4, 4))

# %%
flashlab.check("physical_slot", physical_slot)

# %% [markdown]
# ## 7. Think about it
#
# - In exercise 1, how many key blocks does a query block visit with a window of (w, 0) and block_k = w,
#   however long the sequence? What does that make the cost of sliding-window attention, in N?
# - Exercise 3 for an 8-to-1 GQA model: by what factor does packing cut the bytes a decoding step reads?
# - Why must the dropout key use absolute row and column indices, not offsets inside the tile? (Hint: the
#   backward's tiles need not be the forward's.)
# - Exercise 6 returns None at `pos == cache_seqlens[b]`, though the page may have room there. Who writes
#   that slot next?
