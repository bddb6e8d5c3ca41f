# %% [markdown]
# # 03 · Softmax: safe, online, and in pieces
#
# **After this lesson you can**
# - show why softmax straight from its definition overflows, and fix it by subtracting the row maximum;
# - compute a row's maximum and normalising sum in a single pass (online softmax);
# - merge the (max, sum) statistics of two parts of a row into those of the whole row: the one idea
#   that lets FlashAttention work on tiles.

# %%
import numpy as np

import flashlab
from flashlab import merge_softmax_states, naive_softmax, online_softmax, online_softmax_stats, relative_error, safe_softmax, viz

rng = np.random.default_rng(0)

# %% [markdown]
# ## Overflow
#
# Softmax turns a row of scores into probabilities: $\mathrm{softmax}(x)_j = e^{x_j} / \sum_i e^{x_i}$.
# The exponential grows so fast that it leaves the range of a floating-point number early:

# %%
viz.plot_overflow();

# %% [markdown]
# Attention scores are dot products and easily reach such values. Once one term is `inf`, the sum is
# `inf` and `inf / inf` is `NaN`:

# %%
x = np.array([[1000.0, 1001.0, 1002.0]], dtype=np.float32)
print("definition, [1000, 1001, 1002]:", naive_softmax(x))
print("definition, [80, 90]:          ", naive_softmax(np.array([[80.0, 90.0]], dtype=np.float32)))
print("safe,       [1000, 1001, 1002]:", safe_softmax(x))

# %% [markdown]
# ## Safe softmax
#
# Multiplying top and bottom by $e^{-c}$ changes nothing, for any constant $c$:
#
# $$ \mathrm{softmax}(x)_j = \frac{e^{x_j - c}}{\sum_i e^{x_i - c}}. $$
#
# Choosing $c = m = \max_i x_i$ makes every exponent $\le 0$, so no term exceeds 1 and the largest is
# exactly 1 (the sum cannot vanish). `flashlab.safe_softmax` does this. It costs three passes over the
# row: one for the max, one for the sum $l = \sum_i e^{x_i - m}$, one to divide. In attention a row of
# $S$ has one entry per key, so every pass means going through all of $K$ again.
#
# ## Online softmax: max and sum in one pass
#
# Milakov and Gimelshein (arXiv 1805.02867) fuse the first two passes. Walk along the row keeping a
# running max $m$ and a running sum $l$ measured *relative to the current max*. When a new element
# raises the max, every term already in the sum is too large by the factor $e^{m_{\text{new}} -
# m_{\text{old}}}$, so the sum is first scaled down. Watch it happen (red arrows):

# %%
stream = np.array([0.5, 1.0, 0.2, 2.5, 1.8, -0.5, 1.0, 2.0, 4.0, 3.1, 0.0, 1.5])
viz.plot_online_softmax(stream);

# %% [markdown]
# In symbols, element $x_j$ updates the state $(m, l)$ to
#
# $$ m' = \max(m, x_j), \qquad l' = l\, e^{m - m'} + e^{x_j - m'}, $$
#
# starting from $(m, l) = (-\infty, 0)$. `flashlab.online_softmax_stats` is that loop; after it one more
# pass divides $e^{x_j - m}/l$. It agrees with the three-pass version, huge inputs included:

# %%
rows = rng.standard_normal((4, flashlab.size(1000, 200))) * 30 + 500  # large, spread-out scores
m, l = online_softmax_stats(rows)
print("max agrees:", np.allclose(m, rows.max(axis=-1)))
print("sum agrees:", np.allclose(l, np.exp(rows - rows.max(axis=-1, keepdims=True)).sum(axis=-1)))
print("softmax error vs safe:", relative_error(online_softmax(rows), safe_softmax(rows)))

# %% [markdown]
# ## Step through it
#
# Move $j$ along the row. The box shows the update with numbers; the lower panel shows what normalising
# *now* would give, $e^{x_i - m_j} / l_j$ for the elements seen so far, against the final softmax
# (dashed). At a step where the max grows (red title) the old sum is first multiplied by
# $e^{m_{\text{old}} - m_{\text{new}}} < 1$: every term in it was measured against the old max. At the
# last step the bars fill the dashed outlines exactly.

# %%
viz.online_softmax_explorer(stream);

# %% [markdown]
# ## Merging two partial states
#
# The update above is a special case of something more useful. Take any split of a row into chunks
# $a$ and $b$, with states $(m_a, l_a)$ and $(m_b, l_b)$ computed separately. The state of the whole row is
#
# $$ m = \max(m_a, m_b), \qquad l = l_a\, e^{m_a - m} + l_b\, e^{m_b - m}: $$
#
# each sum is moved onto the common max before adding. (A single element $x_j$ is the chunk state
# $(x_j, 1)$, which gives back the online update.) Below, a row is cut into three chunks, each summarised
# on its own, then merged:

# %%
viz.plot_merge(stream, [4, 8]);

# %% [markdown]
# Merging is associative and commutative, so the chunks can be processed in any order, or in
# parallel, and combined at the end. An empty chunk, $(-\infty, 0)$, changes nothing:

# %%
row = rng.standard_normal(flashlab.size(4096, 512)) * 5
chunks = np.array_split(row, 7)
states = [online_softmax_stats(c) for c in chunks]

def merge_all(states):
    m, l = -np.inf, 0.0
    for m_c, l_c in states:
        m, l = merge_softmax_states(m, l, m_c, l_c)
    return m, l

m_full, l_full = online_softmax_stats(row)
for label, order in [("left to right", states), ("right to left", states[::-1]),
                     ("shuffled + empty", [states[i] for i in rng.permutation(7)] + [(-np.inf, 0.0)])]:
    m, l = merge_all(order)
    print(f"{label:17s} m error {abs(m - m_full):.1e}, l relative error {abs(l - l_full) / l_full:.1e}")

# %% [markdown]
# This is exactly what tiled attention needs. A row of $S$ is too long to hold on chip, so it arrives one
# key block at a time; each block gives a chunk state, merged into the running one. The output row
# $O_i = \sum_j P_{ij} V_j$ is rescaled by the same factor $e^{m_{\text{old}} - m_{\text{new}}}$ as $l$:
# lesson 04 builds FlashAttention from this (arXiv 2205.14135, Section 3.1).
#
# **Exercises:** [03_softmax](../exercises/03_softmax.ipynb): write safe softmax, the one-pass
# statistics, and the merge.
