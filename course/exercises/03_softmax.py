# %% [markdown]
# # Exercises 03: softmax, safely and online
#
# Goes with lesson [03 softmax](../notebooks/03_softmax.ipynb). Three building blocks of FlashAttention:
# a softmax that cannot overflow, the one-pass *online* statistics of Milakov and Gimelshein
# (arXiv 1805.02867), and merging the statistics of two chunks of a row, which is what tiling needs
# (FlashAttention, arXiv 2205.14135, Section 3.1).
#
# All functions work along the **last axis** of their input, so a matrix is a stack of rows.

# %%
import numpy as np

import flashlab

# %% [markdown]
# ## 1. Safe softmax
#
# `exp(x)` overflows to `inf` once x > 709 in float64 (> 88 in float32), and `inf / inf` is NaN. Since
# softmax(x) = softmax(x - c) for any constant c, subtract the row max: every exponent becomes <= 0.
# Entries equal to `-inf` (masked scores) must get probability 0. Return the input's dtype (for float16
# inputs, compute in float32).

# %%
def safe_softmax(x):
    """Softmax along the last axis: exp(x - max) / sum(exp(x - max)), in x's dtype."""
    ### BEGIN SOLUTION
    work = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    e = np.exp(work - work.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)
    ### END SOLUTION


# %%
x = np.array([[1.0, 2.0, 3.0], [1000.0, 1001.0, 1002.0]])
print(safe_softmax(x))  # both rows: [0.090 0.245 0.665]

# %%
flashlab.check("safe_softmax", safe_softmax)

# %% [markdown]
# ## 2. Online softmax statistics
#
# Safe softmax reads each row three times (max, sum, normalise). The online version finds the max `m`
# and the sum `l = sum_j exp(x_j - m)` in **one** pass: walk along the row keeping a running max and a
# running sum. When element x_j raises the max from m to m_new, the terms already in `l` were taken
# relative to the old max, so `l` must be rescaled by `exp(m - m_new)` before `exp(x_j - m_new)` is added.
#
# Write the loop over the last axis, one element (one column of x) at a time, updating all rows at once.
# Start from m = -inf, l = 0. Return `m` and `l` in x's dtype (or a more precise float).
#
# The check holds you to one pass: it hands your function an array that notes how it is read. Reading
# `x[..., j]` column after column (or a block of columns at a time) is one pass; `m = x.max(-1)` followed by
# `np.exp(x - m)` reads every row twice, and the check says so even when m and l come out right.

# %%
def online_softmax_stats(x):
    """One pass along the last axis: returns (m, l), m = max(x), l = sum(exp(x - m)), shapes x.shape[:-1]."""
    ### BEGIN SOLUTION
    work = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    m = np.full(x.shape[:-1], -np.inf, work.dtype)
    l = np.zeros(x.shape[:-1], work.dtype)
    for j in range(x.shape[-1]):
        m_new = np.maximum(m, work[..., j])
        l = l * np.exp(m - m_new) + np.exp(work[..., j] - m_new)
        m = m_new
    return m, l
    ### END SOLUTION


# %%
m, l = online_softmax_stats(x)
print(m, l)
print("softmax from the statistics:", np.exp(x - m[:, None]) / l[:, None])

# %%
flashlab.check("online_softmax_stats", online_softmax_stats)

# %% [markdown]
# ## 3. Merging two partial states
#
# Split a row into chunks a and b and compute (m_a, l_a) and (m_b, l_b) separately. The statistics of the
# whole row follow from those two alone: bring both sums to the common max, then add. This is how
# FlashAttention combines one block of keys with the next, and how split-KV decoding combines the work
# of different thread blocks.
#
# A chunk that has seen nothing is `(m, l) = (-inf, 0)`; merging with it must change nothing, and two
# empty chunks merge to an empty one (careful: `-inf - (-inf)` is NaN).

# %%
def merge_softmax_states(m_a, l_a, m_b, l_b):
    """Statistics (m, l) of the union of two disjoint chunks of the same rows, l = sum exp(x - m)."""
    ### BEGIN SOLUTION
    m = np.maximum(m_a, m_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # both chunks empty: any finite value works
    return m, l_a * np.exp(m_a - m_safe) + l_b * np.exp(m_b - m_safe)
    ### END SOLUTION


# %%
row = np.array([0.5, 3.0, -1.0, 7.0, 2.0])
a, b = online_softmax_stats(row[:2]), online_softmax_stats(row[2:])
print("merged:", merge_softmax_states(*a, *b), " whole row:", online_softmax_stats(row))

# %%
flashlab.check("merge_softmax_states", merge_softmax_states)
