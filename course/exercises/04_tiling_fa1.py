# %% [markdown]
# # Exercises 04: tiling and FlashAttention-1
#
# Goes with lesson [04 tiling and FA1](../notebooks/04_tiling_fa1.ipynb). You will size the tiles from an
# SRAM budget, write the update that folds one block of keys into a block of query rows, and put it in
# the loops of FlashAttention-1 (arXiv 2205.14135, Algorithm 1).
#
# Names as in the paper: a block of `block_q` (Br) query rows `Q_i`, a block of `block_k` (Bc) keys and
# values `K_j`, `V_j`, the scores `S_ij`, and per query row the running max `m`, the running sum `l` and
# the output `O`.

# %%
import math

import numpy as np

import flashlab

# %% [markdown]
# ## 1. Block sizes from the SRAM size
#
# With M elements of SRAM, FlashAttention-1 keeps four d-wide tiles on chip at once: `Q_i`, `K_j`, `V_j`
# and `O_i`, each (block rows) x d. Derive `block_k` as the number of rows for which four such tiles fill
# the M elements, rounded up as the paper does. The paper then caps `block_q` at d (arXiv 2205.14135,
# Algorithm 1, line 1); do the same.

# %%
def block_sizes(M, d):
    """(block_q, block_k) of FlashAttention-1 for an SRAM of M elements and head dimension d, as ints."""
    ### BEGIN SOLUTION
    block_k = math.ceil(M / (4 * d))
    return min(block_k, d), block_k
    ### END SOLUTION


# %%
print(block_sizes(16384, 64))  # 64 KiB of float32 SRAM, d = 64

# %%
flashlab.check("block_sizes", block_sizes)

# %% [markdown]
# ## 2. One FA1 step
#
# Query rows `i` have seen some keys already; their state is the max `m_i`, the sum `l_i` (relative to
# `m_i`) and the **normalised** output `O_i` (FA1 divides by l after every step). A new block of scores
# `S_ij` (rows x block keys, already scaled) and values `V_j` arrives. The new max is
# `m_new = max(m_i, rowmax(S_ij))`, and the block's own terms are `P = exp(S_ij - m_new[:, None])`.
#
# Derive the other two updates from what each quantity means, then write them:
#
# - `l_new` is the sum of exp(s - m_new) over every key seen so far. The old `l_i` holds the earlier keys,
#   but relative to `m_i`: what factor brings each of its terms to `m_new`?
# - `O_new` is softmax(all scores seen so far) times their values. The old `O_i` is that for the earlier
#   keys, already divided by `l_i`: undo that division, bring it to `m_new`, add the block's `P @ V_j`,
#   and divide by `l_new`. (A lesson 03 exercise, merge_softmax_states, did the same for l alone.)
#
# (`m_i`, `l_i` hold one value per row, shape (r,); `[:, None]` makes them (r, 1) so they scale rows,
# not columns.)
#
# Masking shows up as `-inf` scores. A row that has seen no key yet has `m = -inf, l = 0, O = 0`, and it
# stays that way if this block hides all its keys too; avoid computing `-inf - (-inf)`.

# %%
def fa1_update(O_i, l_i, m_i, S_ij, V_j):
    """Fold one block of scores into the rows' state. O_i: (r, dv) normalised, l_i, m_i: (r,),
    S_ij: (r, c), V_j: (c, dv). Returns (O_new, l_new, m_new)."""
    ### BEGIN SOLUTION
    m_new = np.maximum(m_i, S_ij.max(axis=-1))
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new)  # rows with nothing seen yet: exponents stay -inf
    P = np.exp(S_ij - m_safe[:, None])
    alpha = np.exp(m_i - m_safe)
    l_new = alpha * l_i + P.sum(axis=-1)
    denom = np.where(l_new > 0, l_new, 1.0)
    O_new = ((l_i * alpha)[:, None] * O_i + P @ V_j) / denom[:, None]
    return O_new, l_new, m_new
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
S = rng.standard_normal((2, 6))
V = rng.standard_normal((6, 3))
state = (np.zeros((2, 3)), np.zeros(2), np.full(2, -np.inf))  # nothing seen yet
for k0 in (0, 3):  # two blocks of three keys
    state = fa1_update(*state, S[:, k0:k0 + 3], V[k0:k0 + 3])
print(state[0])
print(flashlab.safe_softmax(S) @ V)  # the same

# %%
flashlab.check("fa1_update", fa1_update)

# %% [markdown]
# ## 3. The FlashAttention-1 loops
#
# FA1's **outer** loop runs over key/value blocks j and its **inner** loop over query blocks i. O, l and m
# live in HBM (here: full-size arrays): each inner step reads `O_i, l_i, m_i`, applies the update and
# writes them back. At the end, `lse = m + log(l)`, the log of each row's whole sum of `exp(S)`, which
# the backward pass needs. N need not be a multiple of the block sizes.
#
# Compute in float32 (float64 for float64 inputs); return `O` in Q's dtype.

# %%
def fa1_forward(Q, K, V, block_q, block_k):
    """Attention with FA1's loop order. Q: (Nq, d), K: (Nk, d), V: (Nk, dv). Returns (O, lse)."""
    ### BEGIN SOLUTION
    work = np.float64 if Q.dtype == np.float64 else np.float32
    Nq, Nk, dv = Q.shape[0], K.shape[0], V.shape[1]
    scale = 1 / math.sqrt(Q.shape[1])
    O = np.zeros((Nq, dv), work)
    l = np.zeros(Nq, work)
    m = np.full(Nq, -np.inf, work)
    for k0 in range(0, Nk, block_k):
        K_j, V_j = K[k0:k0 + block_k].astype(work), V[k0:k0 + block_k].astype(work)
        for q0 in range(0, Nq, block_q):
            rows = slice(q0, q0 + block_q)
            S_ij = Q[rows].astype(work) @ K_j.T * scale
            O[rows], l[rows], m[rows] = fa1_update(O[rows], l[rows], m[rows], S_ij, V_j)
    return O.astype(Q.dtype), m + np.log(l)
    ### END SOLUTION


# %%
Q, K, V = rng.standard_normal((10, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 4))
O, lse = fa1_forward(Q, K, V, block_q=4, block_k=3)
O_ref, lse_ref = flashlab.reference_attention(Q, K, V)
print("O error", flashlab.relative_error(O, O_ref), " lse error", flashlab.relative_error(lse, lse_ref))

# %%
flashlab.check("fa1_forward", fa1_forward)
