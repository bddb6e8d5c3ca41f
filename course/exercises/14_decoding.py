# %% [markdown]
# # Exercises 14: split-KV attention for decoding
#
# Goes with lesson [14 decoding](../notebooks/14_decoding.ipynb). Split-KV attention ("Flash-Decoding")
# splits a long KV cache into chunks, computes a partial softmax state (m, l, O) for each chunk
# independently (on a GPU: one thread block per chunk), and merges the states. You will write both halves
# in NumPy; `flashlab.decoding` holds the library's versions, and the checker compares with the exact
# float64 attention. Then you will work out how fast a decoding step can possibly be.

# %%
import numpy as np

import flashlab

# %% [markdown]
# ## 1. One chunk's partial state
#
# For queries `q` (Nq, d) and one chunk of keys `k_c` (n, d) and values `v_c` (n, dv), return
#
#     S = scale * q k_c^T            (Nq, n)
#     m = row max of S               (Nq,)
#     l = row sum of exp(S - m)      (Nq,)
#     O = exp(S - m) v_c             (Nq, dv), NOT divided by l
#
# O stays unnormalised, as FlashAttention-2 keeps it inside its loop: the merge divides once, at the end.
# Compute in float32 for float16/float32 inputs (float64 for float64).

# %%
def chunk_partial(q, k_c, v_c, scale):
    """(m, l, O) of every query row over one chunk of keys."""
    ### BEGIN SOLUTION
    ct = np.float64 if q.dtype == np.float64 else np.float32
    S = (q.astype(ct) @ k_c.astype(ct).T) * ct(scale)
    m = S.max(axis=-1)
    P = np.exp(S - m[:, None])
    return m, P.sum(axis=-1), P @ v_c.astype(ct)
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
q, k, v = rng.standard_normal((1, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
m, l, O = chunk_partial(q, k, v, 0.5)
print(m, l, O / l[:, None])
print(flashlab.reference_attention(q, k, v, scale=0.5)[0])  # one chunk: O / l is already the answer

# %%
flashlab.check("chunk_partial", chunk_partial)

# %% [markdown]
# ## 2. Merging the chunks
#
# `m` and `l` have shape (n_splits, Nq), `O` has shape (n_splits, Nq, dv): one state per chunk. Each
# chunk's l and O are relative to its own max m_c. Bring every chunk to the common max
# m = max_c m_c with the factor exp(m_c - m), then add:
#
#     l_total = sum_c exp(m_c - m) l_c        O_total = sum_c exp(m_c - m) O_c
#     o = O_total / l_total                   lse = m + log(l_total)
#
# Return `(o, lse)`. A chunk with no keys (m = -inf, l = 0, O = 0) must change nothing. This is
# `merge_softmax_states` from lesson 03 for many chunks at once, with O carried along.

# %%
def merge_partials(m, l, O):
    """(o, lse) from per-chunk states m, l (n_splits, Nq) and O (n_splits, Nq, dv)."""
    ### BEGIN SOLUTION
    m_all = m.max(axis=0)
    w = np.exp(m - m_all)  # (n_splits, Nq): how much each chunk shrinks to the common max
    l_all = (w * l).sum(axis=0)
    o = (w[..., None] * O).sum(axis=0) / l_all[:, None]
    return o, m_all + np.log(l_all)
    ### END SOLUTION


# %%
q, k, v = rng.standard_normal((2, 8)), rng.standard_normal((30, 8)), rng.standard_normal((30, 8))
bounds = [(0, 10), (10, 20), (20, 30)]
parts = [chunk_partial(q, k[a:b], v[a:b], 8 ** -0.5) for a, b in bounds]
m, l, O = (np.stack(x) for x in zip(*parts))
o, lse = merge_partials(m, l, O)
ref_o, ref_lse = flashlab.reference_attention(q, k, v)
print(flashlab.relative_error(o, ref_o), flashlab.relative_error(lse, ref_lse))

# %%
flashlab.check("merge_partials", merge_partials)

# %% [markdown]
# ## 3. How fast can a decoding step be?
#
# However well it splits the work, attention for `Nq` queries against a cache of `Nk` keys cannot beat two
# limits: the GPU must move its bytes through HBM (at `bandwidth` bytes/s), and do its arithmetic (at
# `peak_flops` FLOP/s). Write the lower bound on the time of one attention call for B sequences, H heads,
# head dimension d and `itemsize` bytes per number: it reads q, k and v and writes o, each once, and every
# query meets every key (no mask, no GQA). Return the time in seconds and which limit sets it, `"memory"`
# or `"compute"`.

# %%
def decode_time(B, H, Nq, Nk, d, itemsize, peak_flops, bandwidth):
    """(lower bound on the time in seconds, "memory" or "compute": which limit gives it)."""
    ### BEGIN SOLUTION
    bytes_moved = B * H * (2 * Nq * d + 2 * Nk * d) * itemsize  # q and o, k and v
    flops = 4 * B * H * Nq * Nk * d  # Q K^T and P V, 2 Nq Nk d each
    t_memory, t_compute = bytes_moved / bandwidth, flops / peak_flops
    return max(t_memory, t_compute), ("memory" if t_memory >= t_compute else "compute")
    ### END SOLUTION


# %% [markdown]
# An H100 SXM does about 989 TFLOP/s of dense FP16 products on its tensor cores (NVIDIA's H100 datasheet
# gives 1979 with 2:4 sparsity, half that without; the FA3 paper uses 989) and moves 3.35 TB/s through
# HBM3. How does the bound grow as more queries share one read of the cache, as when speculative
# decoding checks several drafted tokens in one step?

# %%
for nq in (1, 8, 64, 256, 1024):
    seconds, bound = decode_time(1, 16, nq, 32768, 128, 2, 989e12, 3.35e12)
    print(f"Nq = {nq:4d}: at least {seconds * 1e6:7.1f} µs, {bound}-bound")

# %%
flashlab.check("decode_time", decode_time)

# %% [markdown]
# ## 4. Think about it
#
# - From exercise 3: up to how many queries per cache read does decoding stay memory-bound on an H100 in
#   FP16? What does that say about the cost of checking 8 drafted tokens at once instead of 1?
# - Lesson 14's split-KV kernel moved about 166 GB/s, torch's SDPA about 3.5 TB/s (the lesson's
#   table). Which one runs near a memory bound, and what did the lesson say our kernel is missing?
# - With one query and Nk = 32768 keys split into 256 chunks, how many numbers does the merge read, and
#   how does that compare with the 2 * 32768 * d numbers of K and V the chunks read (d = 128)?
# - Your merge reads all chunks at once. Write it instead as a loop that merges one chunk at a time into
#   a running state: which function of lesson 03 does the loop body become?
