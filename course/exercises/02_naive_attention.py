# %% [markdown]
# # Exercises 02: naive attention
#
# Goes with lesson [02 naive attention](../notebooks/02_naive_attention.ipynb). You will write attention
# the textbook way, in three steps, and count the bytes those steps move through HBM
# (FlashAttention, arXiv 2205.14135, Algorithm 0).
#
# Shapes follow the papers: `Q` is (Nq, d), `K` is (Nk, d), `V` is (Nk, dv). The scores are scaled by
# 1/sqrt(d), as in `torch.nn.functional.scaled_dot_product_attention`.

# %%
import numpy as np

import flashlab

# %% [markdown]
# ## 1. Attention in three steps
#
# 1. `S = Q @ K.T / sqrt(d)`: one score per (query, key) pair, an Nq x Nk matrix.
# 2. `P = softmax(S)` along each row. With `causal=True`, query i may only see keys j <= i: set the other
#    scores to `-inf` first. Subtract each row's max before `exp` so large scores cannot overflow.
# 3. `O = P @ V`.
#
# Compute in float32 when the inputs are float16 (float64 inputs: float64) and return `O` in the
# inputs' dtype.

# %%
def naive_attention(Q, K, V, causal=False):
    """O = softmax(Q K^T / sqrt(d)) V, row-wise softmax; causal: query i sees keys j <= i.

    Q: (Nq, d), K: (Nk, d), V: (Nk, dv) -> O: (Nq, dv), dtype of Q.
    """
    ### BEGIN SOLUTION
    work = np.float64 if Q.dtype == np.float64 else np.float32
    q, k, v = Q.astype(work), K.astype(work), V.astype(work)
    S = q @ k.T / np.sqrt(Q.shape[-1])
    if causal:
        i = np.arange(Q.shape[0])[:, None]
        j = np.arange(K.shape[0])[None, :]
        S = np.where(j <= i, S, -np.inf)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    P = P / P.sum(axis=-1, keepdims=True)
    return (P @ v).astype(Q.dtype)
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
Q, K, V = rng.standard_normal((4, 8)), rng.standard_normal((6, 8)), rng.standard_normal((6, 3))
print(naive_attention(Q, K, V, causal=True))
print("matches flashlab's reference:", np.allclose(naive_attention(Q, K, V, causal=True),
                                                   flashlab.reference_attention(Q, K, V, causal=True)[0]))

# %%
flashlab.check("naive_attention", naive_attention)

# %% [markdown]
# ## 2. HBM traffic of the three steps
#
# Suppose each step is its own GPU kernel: it reads its inputs from HBM and writes its output back.
#
# | step | reads | writes |
# | --- | --- | --- |
# | `S = Q K^T` | Q, K | S |
# | `P = softmax(S)` | S | P |
# | `O = P V` | P, V | O |
#
# Count the bytes moved, for `V` of width d (dv = d).

# %%
def naive_hbm_bytes(Nq, Nk, d, bytes_per_element):
    """Bytes read plus bytes written by the three kernels of naive attention (Q: Nq x d, K, V: Nk x d)."""
    ### BEGIN SOLUTION
    reads = Nq * d + Nk * d + Nq * Nk + Nq * Nk + Nk * d  # Q, K; S; P, V
    writes = Nq * Nk + Nq * Nk + Nq * d  # S; P; O
    return bytes_per_element * (reads + writes)
    ### END SOLUTION


# %%
for N in (1024, 4096, 16384):
    print(f"N = {N:6d}, d = 64, float16: {naive_hbm_bytes(N, N, 64, 2) / 2**20:9.1f} MiB")

# %%
flashlab.check("naive_hbm_bytes", naive_hbm_bytes)

# %% [markdown]
# The N² terms (S and P, each written once and read once) dominate as soon as N is larger than d:
# quadrupling N multiplies the traffic by almost 16.
