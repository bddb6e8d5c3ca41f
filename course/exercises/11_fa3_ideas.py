# %% [markdown]
# # Exercises 11: FlashAttention-3 ideas
#
# Goes with lesson [11 FlashAttention-3 ideas](../notebooks/11_fa3_ideas.ipynb). You will quantise a
# tensor to FP8 (e4m3) with one scale per block of rows, as FA3 does for each tile of Q, K and V, and
# apply the random Hadamard rotation of incoherent processing.
#
# Write each function where it says `# YOUR CODE HERE`, run the small example, then the
# `flashlab.check(...)` cell: it tries your function on fresh random inputs and says what is wrong.

# %%
import numpy as np

import flashlab
from flashlab.fp8 import hadamard, round_e4m3

# %% [markdown]
# ## 1. Block quantisation
#
# `round_e4m3(a)` rounds every entry of `a` to the nearest e4m3 number (saturating at ±448). To use the
# whole e4m3 range, divide each block of `block` rows by its own scale `amax / 448`, where `amax` is the
# block's largest absolute value, before rounding. Then `codes * scale` gives back the block, up to the
# rounding. The last block may have fewer rows. A block of zeros would give `0 / 0`: give it scale 1.

# %%
def fp8_block_quantize(x, block):
    """x: (N, d) float64. Returns (codes, scales): codes (N, d) on the e4m3 grid, scales (ceil(N/block),).

    NumPy spec, for each b:  rows = x[b*block:(b+1)*block];  scales[b] = abs(rows).max() / 448 (1 if that is 0)
                             codes[b*block:(b+1)*block] = round_e4m3(rows / scales[b])
    """
    ### BEGIN SOLUTION
    n_blocks = -(-x.shape[0] // block)
    codes = np.empty_like(x, dtype=np.float64)
    scales = np.empty(n_blocks)
    for b in range(n_blocks):
        rows = x[b * block:(b + 1) * block]
        amax = np.abs(rows).max()
        scales[b] = amax / 448 if amax > 0 else 1.0
        codes[b * block:(b + 1) * block] = round_e4m3(rows / scales[b])
    return codes, scales
    ### END SOLUTION


# %%
x = np.random.default_rng(0).standard_normal((8, 4))
x[5, 1] = 40.0  # an outlier in the second block
codes, scales = fp8_block_quantize(x, 4)
print(scales)  # the second block's scale is much larger
print(np.abs(codes).reshape(2, 4, 4).max(axis=(1, 2)))  # each block's largest code is 448

# %%
flashlab.check("fp8_block_quantize", fp8_block_quantize)

# %% [markdown]
# ## 2. The incoherent-processing rotation
#
# With `H = hadamard(d)` (orthogonal: `H @ H.T` is the identity) and a random ±1 vector `signs`, the
# matrix `M = diag(signs) @ H` is orthogonal too, so `(q @ M) @ (k @ M).T == q @ k.T`. Rotate both.

# %%
def fp8_incoherent(q, k, signs):
    """q: (Nq, d), k: (Nk, d), signs: (d,) of +-1. Returns (q @ M, k @ M) with M = diag(signs) @ hadamard(d)."""
    ### BEGIN SOLUTION
    m = signs[:, None] * hadamard(q.shape[-1])
    return q @ m, k @ m
    ### END SOLUTION


# %%
rng = np.random.default_rng(1)
q, k = rng.standard_normal((3, 8)), rng.standard_normal((5, 8))
q2, k2 = fp8_incoherent(q, k, rng.choice([-1.0, 1.0], 8))
print(np.abs(q2 @ k2.T - q @ k.T).max())  # ~1e-15: the scores did not change

# %%
flashlab.check("fp8_incoherent", fp8_incoherent)
