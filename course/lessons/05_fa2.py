# %% [markdown]
# # 05 · FlashAttention-2: swap the loops, normalise once, skip what the mask hides
#
# **After this lesson you can**
# - explain why putting the query blocks in the outer loop lets $O_i, m_i, l_i$ stay on chip;
# - delay the division by $l$ to the end, and count the non-matmul FLOPs it saves;
# - skip the key blocks a causal mask hides entirely, and say how much work that saves;
# - explain how FA2 spreads one head over many thread blocks, one per query block;
# - compare FA1's and FA2's HBM traffic for any $N$, $d$, $M$ and block sizes.

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import HBMModel, flash_attention_v1, flash_attention_v2, reference_attention, relative_error, viz

rng = np.random.default_rng(0)
N, d = flashlab.size(1024, 256), 64
q, k, v = (rng.standard_normal((N, d)).astype(np.float32) for _ in range(3))

# %% [markdown]
# ## Loop order
#
# Same tiles, other order. Both pictures are traced from flashlab's implementations; as in lesson 04 the
# arrows join only the first 12 steps, and the numbers give the whole order: FA1 goes on down each column
# of tiles, FA2 along each row.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
viz.plot_tile_order("fa1", 128, 128, 32, 32, ax=axes[0])
viz.plot_tile_order("fa2", 128, 128, 32, 32, ax=axes[1])
fig.tight_layout()

# %% [markdown]
# FlashAttention-2 (arXiv 2307.08691, Algorithm 1) puts the query blocks outside. A query block $Q_i$
# is loaded once, then meets every $K_j, V_j$ in turn, and its running $O_i, m_i, l_i$ never leave the
# chip until the row of tiles is finished: one write of $O_i$ per block instead of one per key block.
# The price is that $K$ and $V$ are now read once per query block. Per head, in elements:
#
# | | reads | writes |
# | --- | --- | --- |
# | FA1 | $2Nd$ ($K,V$) $+\ T_c N(d + d + 2)$ ($Q_i, O_i, m_i, l_i$) | $T_c N (d + 2)$ |
# | FA2 | $Nd$ ($Q$) $+\ T_r N \cdot 2d$ ($K_j, V_j$) | $N(d+1)$ ($O$, lse) |
#
# FA2 reads about as much, and writes far less:

# %%
ios = {}
for name, algo in (("FA1", flash_attention_v1), ("FA2", flash_attention_v2)):
    ios[name] = HBMModel()
    o, lse = algo(q, k, v, io=ios[name])
    print(f"{name}: error {relative_error(o, reference_attention(q, k, v)[0]):.1e}, "
          f"read {ios[name].bytes_read:,} B, written {ios[name].bytes_written:,} B")

# %% [markdown]
# ## Normalise once, at the end
#
# FA1 divides $O_i$ by $l_i$ after every tile, then multiplies the division back out at the next one.
# FA2 keeps an *unnormalised* $\tilde O_i$ on chip,
#
# $$ \tilde O_i \leftarrow e^{m_i - m_i'}\,\tilde O_i + \tilde P_{ij} V_j, $$
#
# and divides once, $O_i = \tilde O_i / l_i$, after the last key block. It saves only the
# log-sum-exp $\mathrm{lse}_i = m_i + \log l_i$ for the backward pass instead of both $m$ and $l$
# (arXiv 2307.08691, Section 3.1.1). The FLOPs it drops are non-matmul ones, which matter beyond their
# number: on an A100 tensor cores do matmuls at 312 TFLOP/s, everything else runs at 19.5, sixteen
# times slower. Both runs above counted their FLOPs:

# %%
viz.plot_io_compare(ios);

# %% [markdown]
# ## Causal masking: skip whole blocks
#
# With a causal mask, query $i$ sees keys $j \le i$. A tile entirely above the diagonal would be all
# $-\infty$: FA2 does not visit it at all (its inner loop stops at the block holding the last key
# visible to the block's last row). Only the tiles on the diagonal need a mask inside:

# %%
viz.plot_causal_blocks(256, 256, 32, 32);

# %% [markdown]
# For $T$ blocks per side it computes $T(T+1)/2$ of $T^2$ tiles: close to half the work and traffic for
# long sequences.

# %%
full, causal = HBMModel(), HBMModel()
flash_attention_v2(q, k, v, io=full)
flash_attention_v2(q, k, v, causal=True, io=causal)
print(f"causal / full: matmul FLOPs {causal.matmul_flops / full.matmul_flops:.2f}, "
      f"HBM bytes {causal.hbm_bytes / full.hbm_bytes:.2f}")

# %% [markdown]
# ## Work split over the sequence
#
# A GPU runs a kernel as a grid of **thread blocks**: groups of up to 1024 threads that run together on
# one SM, share its SRAM and can wait for one another at a barrier; separate blocks run independently, and
# the GPU hands each to an SM with room for it (CUDA C++ Programming Guide, "Thread Hierarchy"; lesson 07
# writes them).
#
# On a GPU each query block of FA2 is an independent job: it reads $K$ and $V$ and writes only its own
# rows of $O$. So FA2 launches one thread block per (batch, head, query block), where FA1 launched one
# per (batch, head) and walked all tiles in it (arXiv 2307.08691, Section 3.2). Colors are thread
# blocks:

# %%
viz.plot_work_split(256, 256, 32, 32, causal=True);

# %% [markdown]
# Under the causal mask the thread blocks get unequal rows of work (right); the GPU's scheduler starts
# the next waiting block on whichever SM frees up first. What the split buys is work for every SM: with
# long sequences, batches are small, and an A100 has 108 SMs to fill. The FA2 paper calls this
# *occupancy*. In CUDA's own, narrower sense, the one later lessons use, occupancy is how many **warps**
# an SM keeps active at once against the most it could (CUDA C++ Best Practices Guide, "Occupancy"); a
# warp is a group of 32 threads of one block that the SM issues each instruction to together (CUDA C++
# Programming Guide, "SIMT Architecture"). Here we only count whether every SM gets a thread block at all:

# %%
viz.plot_occupancy(tr=flashlab.size(64, 16));

# %% [markdown]
# ## FA1 against FA2, all sizes
#
# The traffic curves from the closed forms (checked against instrumented runs by the tests):

# %%
viz.plot_traffic_vs_n(d=64, M=16384, causal=False);

# %% [markdown]
# ## Explore
#
# Sliders for $N$, $d$, $M$ and both block sizes; a checkbox for the causal mask. Blocks that do not fit
# $M$ fall back to the paper's rule. (Without widgets, or in the fast mode: a grid over $M$ and causal on/off.)

# %%
viz.fa_explorer();

# %% [markdown]
# Things to try: for FA2 the *query* block size now sets how often $K, V$ are re-read (compare with the
# heatmap of lesson 04, where only the key block size mattered for FA1); with the causal mask on, see
# the gap to naive attention grow with $N$.
#
# **Exercises:** [05_fa2](../exercises/05_fa2.ipynb): decide which key blocks a causal query block
# must visit, write the FA2 forward, and count the thread blocks and FLOPs of FA2's grid.
