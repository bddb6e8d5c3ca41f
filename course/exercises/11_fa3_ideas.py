# %% [markdown]
# # Exercises 11: FlashAttention-3 ideas
#
# Goes with lesson [11 FlashAttention-3 ideas](../notebooks/11_fa3_ideas.ipynb). You will quantise a
# tensor to FP8 (e4m3) with one scale per block of rows, as FA3 does for each tile of Q, K and V, apply
# the random Hadamard rotation of incoherent processing, and predict how much overlapping the softmax
# with the matrix products saves in one warpgroup's loop.
#
# Write each function where it says `# YOUR CODE HERE`, run the small example, then the
# `flashlab.check(...)` cell: it tries your function on fresh random inputs and says what is wrong.

# %%
import numpy as np

import flashlab
from flashlab.fp8 import E4M3_MAX, hadamard, round_e4m3

# %% [markdown]
# ## 1. Block quantisation
#
# `round_e4m3(a)` rounds every entry of `a` to the nearest e4m3 number; anything beyond ±448
# (`E4M3_MAX`) is clipped to ±448. Before rounding, a block of values is divided by a **scale**, and
# `codes * scale` gives the block back, up to the rounding. Split the rows of `x` into blocks of
# `block` rows (the last block may have fewer), and give each block its own scale, chosen so that
#
# 1. no value of the block is clipped, and
# 2. the scaled values are as large as (1) allows, so that small ones stay clear of e4m3's subnormals
#    (coarse steps below 2^-6) and of zero.
#
# Work out which scale meets both. A block of zeros meets both with any scale: give it 1 (and make sure
# it produces no NaN).

# %%
def fp8_block_quantize(x, block):
    """x: (N, d) float64. Returns (codes, scales): codes (N, d), each an e4m3 value; scales (ceil(N/block),),
    one per block of `block` rows, so that codes * (the row's block scale) ~= x."""
    ### BEGIN SOLUTION
    n_blocks = -(-x.shape[0] // block)
    codes = np.empty_like(x, dtype=np.float64)
    scales = np.empty(n_blocks)
    for b in range(n_blocks):
        rows = x[b * block:(b + 1) * block]
        amax = np.abs(rows).max()
        scales[b] = amax / E4M3_MAX if amax > 0 else 1.0
        codes[b * block:(b + 1) * block] = round_e4m3(rows / scales[b])
    return codes, scales
    ### END SOLUTION


# %%
x = np.random.default_rng(0).standard_normal((8, 4))
x[5, 1] = 40.0  # an outlier in the second block
codes, scales = fp8_block_quantize(x, 4)
print(scales)  # the second block's scale is much larger
print(np.abs(codes).reshape(2, 4, 4).max(axis=(1, 2)))  # each block's largest code: as large as allowed
print(flashlab.relative_error(codes * np.repeat(scales, 4)[:, None], x))  # a few percent at most

# %%
flashlab.check("fp8_block_quantize", fp8_block_quantize)

# %% [markdown]
# ## 2. The incoherent-processing rotation
#
# One outlier in a row of Q forces a large FP8 scale on its whole block, and every other value of the block
# loses precision. FA3 first multiplies Q and K by the same random orthogonal d x d matrix M: the scores do
# not change, because (Q M)(K M)^T = Q M M^T K^T = Q K^T, and a well-chosen M spreads an outlier over all d
# coordinates of its row. FA3's M has two parts (FlashAttention-3, arXiv 2407.08608, section 3.3):
#
# 1. flip the sign of each coordinate at random: coordinate i of every row of Q and of K is multiplied
#    by `signs[i]`, one of +1 or -1;
# 2. then mix the coordinates with the Hadamard matrix, which for d a power of two is built by doubling:
#    H_1 = [1], and H_2n is the 2 x 2 block matrix [[H_n, H_n], [H_n, -H_n]].
#
# Write `fp8_incoherent(q, k, signs)`: it returns (Q M, K M). Build the Hadamard matrix yourself (not with
# `flashlab.fp8.hadamard`), and check before you submit that your M is orthogonal: look at the length of
# a row of H_n.

# %%
def fp8_incoherent(q, k, signs):
    """q: (Nq, d), k: (Nk, d), signs: (d,) of +1/-1, d a power of two. Returns (q rotated, k rotated)."""
    ### BEGIN SOLUTION
    h = np.ones((1, 1))
    while h.shape[0] < q.shape[-1]:
        h = np.block([[h, h], [h, -h]])
    m = signs[:, None] * h / np.sqrt(q.shape[-1])  # flip coordinate i, then mix; rows of h have length sqrt(d)
    return q @ m, k @ m
    ### END SOLUTION


# %%
rng = np.random.default_rng(1)
q, k = rng.standard_normal((3, 8)), rng.standard_normal((5, 8))
q2, k2 = fp8_incoherent(q, k, rng.choice([-1.0, 1.0], 8))
print(np.abs(q2 @ k2.T - q @ k.T).max())  # ~1e-15: the scores did not change

# %%
flashlab.check("fp8_incoherent", fp8_incoherent)

# %% [markdown]
# ## 3. Overlapping softmax with the matrix products, in one warpgroup
#
# One consumer warpgroup of FA3 walks over `n_blocks` K/V blocks; a producer warp has already loaded
# them, so loads cost nothing here. Block j needs three steps:
#
# | step | runs on | takes | needs |
# | --- | --- | --- | --- |
# | QK_j: S_j = Q K_j^T | tensor cores | `t_gemm` | |
# | softmax_j: P_j from S_j | the warpgroup's own threads (exp units, FP32 units) | `t_softmax` | QK_j |
# | PV_j: O += P_j V_j | tensor cores | `t_gemm` | softmax_j |
#
# The tensor cores do one product at a time, in the order the warpgroup issues them, and the warpgroup
# does one softmax at a time.
#
# - `overlap=False`: program order, QK_j, softmax_j, PV_j, then the next block.
# - `overlap=True`, FA3's pipelining inside a warpgroup (FlashAttention-3, arXiv 2407.08608, section
#   3.2): before the loop, QK_0 and softmax_0. Iteration j = 1, 2, ... issues QK_j and then PV_{j-1} to
#   the tensor cores without waiting, waits for QK_j only, and runs softmax_j while PV_{j-1} may still
#   be running; the next iteration starts when softmax_j is done. After the loop, PV_{n-1}.
#
# Return the time at which the last PV finishes. Draw a timeline of three blocks for `t_gemm = 1,
# t_softmax = 2` and for `t_gemm = 2, t_softmax = 1` before you write the formula.

# %%
def fa3_loop_time(t_gemm, t_softmax, n_blocks, overlap):
    """Time for one warpgroup to finish n_blocks K/V blocks, in program order or pipelined (overlap=True)."""
    ### BEGIN SOLUTION
    if not overlap:
        return n_blocks * (2 * t_gemm + t_softmax)
    # QK_0 + softmax_0 alone; then each iteration: QK_j, and softmax_j beside PV_{j-1}; then PV_{n-1} alone.
    return t_gemm + t_softmax + (n_blocks - 1) * (t_gemm + max(t_gemm, t_softmax)) + t_gemm
    ### END SOLUTION


# %%
for g, s in ((1.0, 1.0), (1.0, 2.0), (2.0, 1.0)):
    slow, fast = fa3_loop_time(g, s, 64, False), fa3_loop_time(g, s, 64, True)
    print(f"t_gemm {g}, t_softmax {s}: in order {slow:.0f}, pipelined {fast:.0f}, speed-up {slow / fast:.2f}x")

# %%
flashlab.check("fa3_loop_time", fa3_loop_time)

# %% [markdown]
# ## 4. Think about it
#
# - Over many blocks, how much can this pipelining save at most, and at which ratio t_softmax / t_gemm?
# - Why can one warpgroup not reach the busiest unit's time, max(2 t_gemm, t_softmax) per block? What
#   does a second warpgroup (pingpong scheduling, lesson 11) change?
