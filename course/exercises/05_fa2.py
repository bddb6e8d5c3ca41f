# %% [markdown]
# # Exercises 05: FlashAttention-2
#
# Goes with lesson [05 FA2](../notebooks/05_fa2.ipynb). FlashAttention-2 (arXiv 2307.08691, Algorithm 1)
# swaps FA1's loops: the **outer** loop runs over query blocks, which are independent and can run in
# parallel, and the inner loop over key blocks. `O_i, m_i, l_i` then stay on chip for a whole row of
# tiles, and `O_i` is divided by `l_i` only once, at the end. With causal masking, key blocks that lie
# entirely after a query block's last row are skipped: about half the work.

# %%
import math

import numpy as np

import flashlab

# %% [markdown]
# ## 1. Which key blocks does a query block need?
#
# Query block i holds rows `i*block_q ... min((i+1)*block_q, Nq) - 1`; key block j holds keys from
# `j*block_k` on. Without masking every query block visits all `ceil(Nk / block_k)` key blocks. With
# causal masking (query r sees keys <= r), block i needs key blocks 0, 1, ... up to the last one that
# holds a key some row of the block can see.

# %%
def kv_blocks_to_visit(i, Nq, Nk, block_q, block_k, causal):
    """Number of key blocks (0, 1, ..., n-1) that query block i visits."""
    ### BEGIN SOLUTION
    n_blocks = math.ceil(Nk / block_k)
    if not causal:
        return n_blocks
    last_row = min((i + 1) * block_q, Nq) - 1
    return min(n_blocks, last_row // block_k + 1)
    ### END SOLUTION


# %%
print([kv_blocks_to_visit(i, 16, 16, 4, 4, causal=True) for i in range(4)])  # [1, 2, 3, 4]

# %%
flashlab.check("kv_blocks_to_visit", kv_blocks_to_visit)

# %% [markdown]
# ## 2. The FA2 forward
#
# For each query block i: start from `O_i = 0, l_i = 0, m_i = -inf`; for each key block j it must visit:
#
# - `S_ij = Q_i K_j^T / sqrt(d)`, masked to `-inf` above the diagonal when causal,
# - `m_new = max(m_i, rowmax(S_ij))`, `P = exp(S_ij - m_new[:, None])`,
# - `l_i = exp(m_i - m_new) * l_i + rowsum(P)`, `O_i = exp(m_i - m_new)[:, None] * O_i + P @ V_j` (**not** divided),
#
# then, after the inner loop, `O_i / l_i[:, None]` and `lse_i = m_i + log(l_i)`. Every query row sees key 0, so
# `l_i > 0` at the end; inside the loop a row can still have `m = -inf`. Under causal masking, key blocks
# that start after the block's last row must be skipped, not even loaded.
#
# Compute in float32 (float64 for float64 inputs); return `O` in Q's dtype.

# %%
def fa2_forward(Q, K, V, causal=False, block_q=16, block_k=16):
    """FlashAttention-2 forward. Q: (Nq, d), K: (Nk, d), V: (Nk, dv). Returns (O, lse)."""
    ### BEGIN SOLUTION
    work = np.float64 if Q.dtype == np.float64 else np.float32
    Nq, Nk, dv = Q.shape[0], K.shape[0], V.shape[1]
    scale = 1 / math.sqrt(Q.shape[1])
    O = np.empty((Nq, dv), Q.dtype)
    lse = np.empty(Nq, work)
    for i, q0 in enumerate(range(0, Nq, block_q)):
        Q_i = Q[q0:q0 + block_q].astype(work)
        r = len(Q_i)
        O_i, l_i, m_i = np.zeros((r, dv), work), np.zeros(r, work), np.full(r, -np.inf, work)
        for j in range(kv_blocks_to_visit(i, Nq, Nk, block_q, block_k, causal)):
            k0 = j * block_k
            K_j, V_j = K[k0:k0 + block_k].astype(work), V[k0:k0 + block_k].astype(work)
            S = Q_i @ K_j.T * scale
            if causal:
                rows, cols = np.arange(q0, q0 + r)[:, None], np.arange(k0, k0 + len(K_j))[None, :]
                S = np.where(cols <= rows, S, -np.inf)
            m_new = np.maximum(m_i, S.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            P = np.exp(S - m_safe[:, None])
            alpha = np.exp(m_i - m_safe)
            l_i = alpha * l_i + P.sum(axis=-1)
            O_i = alpha[:, None] * O_i + P @ V_j
            m_i = m_new
        O[q0:q0 + r] = O_i / l_i[:, None]
        lse[q0:q0 + r] = m_i + np.log(l_i)
    return O, lse
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
Q, K, V = rng.standard_normal((10, 4)), rng.standard_normal((13, 4)), rng.standard_normal((13, 4))
O, lse = fa2_forward(Q, K, V, causal=True, block_q=4, block_k=3)
O_ref, lse_ref = flashlab.reference_attention(Q, K, V, causal=True)
print("O error", flashlab.relative_error(O, O_ref), " lse error", flashlab.relative_error(lse, lse_ref))

# %%
flashlab.check("fa2_forward", fa2_forward)

# %% [markdown]
# ## 3. The work of FA2's grid
#
# On a GPU, FA2 launches one thread block per (batch, head, query block), and each walks over the key
# blocks its query block needs. How much does the whole grid compute? For B x H heads, `Q` of shape
# (Nq, d) and `K`, `V` of shape (Nk, d) per head, return
#
# - `thread_blocks`: how many thread blocks FA2 launches;
# - `matmul_flops`: the FLOPs of the two matrix products its thread blocks actually perform,
#   `S_ij = Q_i K_j^T` and `P_ij V_j`, at 2 FLOPs per multiply-add. A tile is computed as a whole
#   matrix product; the causal mask is applied to the scores afterwards.

# %%
def fa2_work(B, H, Nq, Nk, d, block_q, block_k, causal):
    """(thread_blocks, matmul_flops) of the FA2 forward on B x H heads."""
    ### BEGIN SOLUTION
    n_q_blocks = math.ceil(Nq / block_q)
    flops = 0
    for i in range(n_q_blocks):
        rows = min((i + 1) * block_q, Nq) - i * block_q  # the last query block may be short
        keys = min(kv_blocks_to_visit(i, Nq, Nk, block_q, block_k, causal) * block_k, Nk)
        flops += 2 * rows * keys * d * 2  # S_ij and P_ij V_j over whole tiles, diagonal ones too
    return B * H * n_q_blocks, B * H * flops
    ### END SOLUTION


# %%
blocks, causal_flops = fa2_work(1, 16, 4096, 4096, 64, 128, 64, causal=True)
_, full_flops = fa2_work(1, 16, 4096, 4096, 64, 128, 64, causal=False)
print(f"{blocks} thread blocks; causal computes {causal_flops / full_flops:.3f} of the full work")

# %%
flashlab.check("fa2_work", fa2_work)

# %% [markdown]
# Benchmarks (and this course's) count causal attention as half the full work, `2 B H N² d`. The kernel
# does a little more than that: the masked half of every diagonal tile. Smaller tiles waste less there,
# but each one costs its own loads and bookkeeping.
