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

# %% [markdown]
# ## 3. Peak memory
#
# Traffic is one cost; room is another. Run the same three kernels on a batch: `Q` is (B, H, Nq, d),
# `K` is (B, H, Nk, d), `V` is (B, H, Nk, dv), and every array lives in HBM. The inputs stay allocated the
# whole time (the caller holds them). Each step allocates its output before it starts, and an
# intermediate is freed as soon as the last step that reads it has finished.
#
# How many bytes are allocated at the busiest moment? `dtype` is a NumPy dtype such as
# `np.dtype("float16")`; its `itemsize` is the bytes of one element. Think about every step, not only
# the one you expect to win.

# %%
def naive_peak_bytes(B, H, Nq, Nk, d, dv, dtype):
    """Peak bytes allocated by the three kernels of naive attention on B x H heads."""
    ### BEGIN SOLUTION
    inputs = Nq * d + Nk * d + Nk * dv  # Q, K, V: allocated all along
    step2 = inputs + Nq * Nk + Nq * Nk  # S and P
    step3 = inputs + Nq * Nk + Nq * dv  # P and O; S is gone
    return B * H * dtype.itemsize * max(step2, step3)
    ### END SOLUTION


# %%
for N in (4096, 16384, 65536):
    gb = naive_peak_bytes(1, 16, N, N, 64, 64, np.dtype("float16")) / 1e9
    print(f"B = 1, H = 16, N = {N:6d}, d = 64, float16: {gb:8.2f} GB")

# %%
flashlab.check("naive_peak_bytes", naive_peak_bytes)

# %% [markdown]
# This is the ideal: a real framework adds temporaries (the lesson measured NumPy's), and training
# keeps P for the backward pass as well. Even so, at N = 16384 sixteen heads of one sequence need
# 16 · 2 · 16384² · 2 bytes ≈ 17 GB in float16 for S and P alone. FlashAttention keeps neither in HBM:
# the inputs, the output and one log-sum-exp per query.
