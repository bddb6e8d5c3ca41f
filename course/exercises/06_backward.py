# %% [markdown]
# # Exercises 06: the backward pass
#
# Goes with lesson [06 backward](../notebooks/06_backward.ipynb). FlashAttention never stores the Nq x Nk
# matrix P. The backward pass recomputes it tile by tile from the saved log-sum-exp,
# `P_ij = exp(S_ij - lse_i)`, and replaces the row sums of `P * dP` that the softmax gradient needs by
# one number per row, `D_i = rowsum(dO_i * O_i)` (arXiv 2205.14135, Appendix B; arXiv 2307.08691,
# Algorithm 2).
#
# With S = scale * Q K^T, P = softmax(S), O = P V and the incoming gradient dO:
# `dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - D)`, `dQ = scale * dS K`, `dK = scale * dS^T Q`.

# %%
import math

import numpy as np

import flashlab

# %% [markdown]
# ## 1. D = rowsum(dO ∘ O)
#
# For row i, `sum_j P_ij dP_ij = sum_j P_ij (dO_i · V_j) = dO_i · O_i`: one dot product of two length-dv
# rows instead of a sum over all Nk keys.

# %%
def delta(O, dO):
    """D with D[i] = sum_c dO[i, c] * O[i, c]; O, dO: (N, dv) -> D: (N,)."""
    ### BEGIN SOLUTION
    return np.sum(dO * O, axis=-1)
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
print(delta(rng.standard_normal((3, 4)), rng.standard_normal((3, 4))))

# %%
flashlab.check("delta", delta)

# %% [markdown]
# ## 2. The FA2 backward
#
# Outer loop over key blocks j (each owns its `dK_j`, `dV_j`), inner loop over query blocks i; `dQ`
# accumulates across the outer loop. For each tile: recompute `S_ij` (masked when causal) and
# `P_ij = exp(S_ij - lse_i)`, then add its share to `dV_j`, `dK_j` and `dQ_i` with the formulas above.
# Query blocks that cannot see key block j under causal masking can be skipped.
#
# Compute in float32 (float64 for float64 inputs); return the gradients in Q's dtype.

# %%
def fa2_backward(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16):
    """Gradients of attention. Q: (Nq, d), K: (Nk, d), V: (Nk, dv), O, dO: (Nq, dv), lse: (Nq,).
    Returns (dQ, dK, dV) shaped like Q, K, V."""
    ### BEGIN SOLUTION
    dtype = Q.dtype
    work = np.float64 if dtype == np.float64 else np.float32
    Q, K, V, O, lse, dO = (x.astype(work) for x in (Q, K, V, O, lse, dO))
    Nq, Nk = Q.shape[0], K.shape[0]
    scale = 1 / math.sqrt(Q.shape[1])
    D = delta(O, dO)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for k0 in range(0, Nk, block_k):
        cols = slice(k0, k0 + block_k)
        K_j, V_j = K[cols], V[cols]
        for q0 in range(0, Nq, block_q):
            rows = slice(q0, q0 + block_q)
            S = Q[rows] @ K_j.T * scale
            if causal:
                r, c = np.arange(q0, q0 + len(S))[:, None], np.arange(k0, k0 + len(K_j))[None, :]
                S = np.where(c <= r, S, -np.inf)
            P = np.exp(S - lse[rows, None])
            dV[cols] += P.T @ dO[rows]
            dS = P * (dO[rows] @ V_j.T - D[rows, None])
            dQ[rows] += scale * dS @ K_j
            dK[cols] += scale * dS.T @ Q[rows]
    return dQ.astype(dtype), dK.astype(dtype), dV.astype(dtype)
    ### END SOLUTION


# %%
Q, K, V = rng.standard_normal((9, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 4))
O, lse = flashlab.reference_attention(Q, K, V, causal=True)
dO = rng.standard_normal(O.shape)
grads = fa2_backward(Q, K, V, O, lse, dO, causal=True, block_q=4, block_k=3)
refs = flashlab.flash_attention_v2_backward(Q, K, V, O, lse, dO, causal=True)
print([f"{flashlab.relative_error(g, r):.1e}" for g, r in zip(grads, refs)])

# %%
flashlab.check("fa2_backward", fa2_backward)
