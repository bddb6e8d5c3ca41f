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
from flashlab.roofline import PUBLISHED, PUBLISHED_FP32  # datasheet figures, for section 3

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

# %% [markdown]
# ## 3. Recompute or store?
#
# Is recomputing P actually cheaper than keeping it? Take the same fused, tiled backward in two variants
# that differ only in where each tile `P_ij` comes from (one head, no mask):
#
# - **store**: the forward writes P (Nq x Nk, `bytes_per_element` each) to HBM; the backward reads each
#   tile of it back;
# - **recompute**: the forward writes `lse` (Nq numbers, kept in float32 whatever the inputs' dtype); the
#   backward reads `lse_i` along with every tile it visits, recomputes `S_ij = scale * Q_i K_j^T`
#   (the `Q_i` and `K_j` tiles are on chip anyway: `dK_j` and `dQ_i` need them) and then `P_ij`.
#
# Return `extra_flops`, the matmul FLOPs the recompute variant adds (2 per multiply-add; ignore the
# element-wise work), `bytes_saved`, the HBM bytes it moves fewer than the store variant, and
# `recompute_wins`: whether, on a machine with `peak_flops` and `bandwidth` (lesson 01's roofline), the
# extra FLOPs take less time than the saved bytes would.

# %%
def recompute_tradeoff(Nq, Nk, d, block_k, bytes_per_element, peak_flops, bandwidth):
    """(extra_flops, bytes_saved, recompute_wins) of recomputing P instead of storing it, for one head."""
    ### BEGIN SOLUTION
    extra_flops = 2 * Nq * Nk * d  # S = Q K^T once more
    p_bytes = 2 * Nq * Nk * bytes_per_element  # P written by the forward, read by the backward
    lse_bytes = 4 * (Nq + math.ceil(Nk / block_k) * Nq)  # lse written once, read once per key block
    bytes_saved = p_bytes - lse_bytes
    return extra_flops, bytes_saved, extra_flops / peak_flops < bytes_saved / bandwidth
    ### END SOLUTION


# %%
for label, peak, bw, b in [("A100, float16, tensor cores", PUBLISHED["A100"].peak_flops, PUBLISHED["A100"].bandwidth, 2),
                           ("T4, float32, FP32 units", PUBLISHED_FP32["T4"], PUBLISHED["T4"].bandwidth, 4)]:
    for d in (64, 128):
        flops, saved, wins = recompute_tradeoff(4096, 4096, d, 64, b, peak, bw)
        print(f"{label}, d = {d:3d}: {flops / peak * 1e6:6.1f} µs of FLOPs vs {saved / bw * 1e6:6.1f} µs of "
              f"bytes -> {'recompute' if wins else 'store'}")

# %%
flashlab.check("recompute_tradeoff", recompute_tradeoff)

# %% [markdown]
# Recomputing does `2d` FLOPs for about `2 · bytes_per_element` bytes it saves per score: an arithmetic
# intensity near `d / bytes_per_element`, to compare with the machine's ridge point. On tensor cores the
# ridge is well above it and recomputing wins easily. On plain FP32 units at d = 128 this simple count
# says storing would be faster; FlashAttention recomputes anyway, because its products run on tensor
# cores and because storing P needs Nq x Nk of memory per head, which is what limits long sequences.
