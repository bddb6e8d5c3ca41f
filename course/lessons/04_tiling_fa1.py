# %% [markdown]
# # 04 · Tiling under an SRAM budget: FlashAttention-1
#
# **After this lesson you can**
# - follow FlashAttention-1's two loops over tiles of $Q$ and $K, V$, and the update each tile makes;
# - pick block sizes that fit an SRAM of $M$ elements;
# - compute the HBM traffic of FA1 as a function of $M$ and the block sizes, and check the formula
#   against an instrumented run;
# - explain why FA1 beats naive attention only once $M$ is well above $d^2$.

# %%
import numpy as np

import flashlab
from flashlab import HBMModel, default_block_sizes, flash_attention_v1, formula_traffic, reference_attention, relative_error, viz
from flashlab.iomodel import SRAMOverflowError

rng = np.random.default_rng(0)

# %% [markdown]
# ## The loops, as a picture
#
# Cut $Q$ into $T_r$ blocks of `block_q` rows ($B_r$ in the paper) and $K, V$ into $T_c$ blocks of
# `block_k` rows ($B_c$). The score matrix $S$ becomes a $T_r \times T_c$ grid of tiles $S_{ij} =
# Q_i K_j^\top / \sqrt d$, none of which is ever stored in HBM. This is the order in which
# `flash_attention_v1` computes them (traced from the code itself). The number in each tile is its step;
# the arrows join only the first 12 steps, to keep the picture readable, and the walk goes on the same
# way, down each column of tiles in turn:

# %%
viz.plot_tile_order("fa1", nq=128, nk=128, block_q=32, block_k=32);

# %% [markdown]
# The outer loop walks over key blocks $j$: it loads $K_j, V_j$ into SRAM once. The inner loop walks
# down all query blocks $i$, and for each one (FlashAttention, arXiv 2205.14135, Algorithm 1):
#
# 1. loads $Q_i$ and the row statistics $m_i, l_i$ and output rows $O_i$ accumulated so far from HBM;
# 2. computes $S_{ij} = Q_i K_j^\top/\sqrt d$ on chip, its row maxima $\tilde m$, $\tilde P = e^{S_{ij} -
#    \tilde m}$ and its row sums $\tilde l$;
# 3. merges the statistics exactly as in lesson 03: $m_i' = \max(m_i, \tilde m)$,
#    $l_i' = e^{m_i - m_i'} l_i + e^{\tilde m - m_i'} \tilde l$;
# 4. updates the output, keeping it normalised:
#    $O_i' = \big(l_i e^{m_i - m_i'} O_i + e^{\tilde m - m_i'} \tilde P V_j\big) / l_i'$;
# 5. writes $O_i', l_i', m_i'$ back to HBM.
#
# (flashlab writes step 2–3 with the new max directly, which is the same arithmetic.) After the last
# key block every row has seen every key, so $O$ is exact, not an approximation:

# %%
N, d = flashlab.size(1024, 256), 64
q, k, v = (rng.standard_normal((N, d)).astype(np.float32) for _ in range(3))
o, lse = flash_attention_v1(q, k, v, block_q=64, block_k=64)
o_ref, lse_ref = reference_attention(q, k, v)
print("O error:", relative_error(o, o_ref), "  lse error:", relative_error(lse, lse_ref))

# %% [markdown]
# ## The SRAM budget
#
# Four tiles stream through SRAM at once: $Q_i$ and $O_i$ ($B_r \times d$) and $K_j, V_j$
# ($B_c \times d$). (The score tile $S_{ij}$, $B_r \times B_c$, is on chip too, at most $M/4$ elements
# with the rule below; real kernels keep it in registers, and this model charges only the four d-wide
# tiles against $M$. $m_i, l_i$ are tiny.) The paper's rule gives each of the four about a quarter of
# the budget: $B_c = \lceil M / 4d \rceil$, $B_r = \min(B_c, d)$.

# %%
for M in (4096, 16384, 65536):
    print(f"M = {M:6d} elements ({M * 4 // 1024:3d} KiB of float32), d = {d}: (block_q, block_k) =", default_block_sizes(d, M))

# %% [markdown]
# `HBMModel(M)` enforces the budget: a run whose tiles do not fit is stopped with an explanation.

# %%
try:
    flash_attention_v1(q, k, v, block_q=128, block_k=128, io=HBMModel(M=16384))
except SRAMOverflowError as err:
    print("SRAMOverflowError:", err)

# %% [markdown]
# ## HBM traffic against SRAM size
#
# Count per (query block, key block) step: FA1 reads $Q_i, O_i, m_i, l_i$ ($2d+2$ elements per query
# row) and writes $O_i, m_i, l_i$ ($d+2$), so every query row moves $3d+4$ elements **once per key
# block**, $T_c = \lceil N/B_c\rceil$ times. $K$ and $V$ are read once; initialising $O, l, m$ and
# producing lse add $N(d+5)$. Total:
#
# $$ \text{traffic} = 2Nd + T_c \cdot N \cdot (3d + 4) + N(d+5) \approx \frac{3N^2 d}{B_c} \approx \frac{12\,N^2 d^2}{M}, $$
#
# which is the paper's $\Theta(N^2 d^2 / M)$ (Theorem 2). Naive attention moves $\Theta(N^2 + Nd)$, so
# FA1 moves less once $M$ is a constant factor above $d^2$: the curves below cross there. The star is an
# instrumented run at the default blocks for $M$ = 16384.

# %%
M = 16384
io = HBMModel(M=M)
flash_attention_v1(q, k, v, io=io)
t = formula_traffic("fa1", N, N, d, M=M)
print(f"instrumented: {io.hbm_bytes:,} bytes   formula: {(t['read'] + t['write']) * 4:,} bytes")
print(f"naive would move {sum(formula_traffic('naive', N, N, d).values()) * 4:,} bytes")
viz.plot_traffic_vs_sram(N, d, algorithms=("naive", "fa1"), mark=(M, io.hbm_bytes, "instrumented run"));

# %% [markdown]
# ## Which block size matters?
#
# For FA1 only $B_c$ appears in the count: the number of key blocks sets how often $Q$, $O$, $m$ and $l$
# make the round trip. $B_r$ only has to fit. Here is the traffic for every (block_q, block_k) at one
# budget (grey: the tiles overflow $M$; star: least traffic, with the largest tiles among ties):

# %%
viz.plot_block_heatmap("fa1", n=4096, d=d, M=16384);

# %% [markdown]
# Read it by columns. Every column has one colour: at a fixed block_k, changing block_q does not change
# FA1's traffic at all. Moving right, each doubling of block_k halves the round trips of $Q, O, m, l$,
# so the largest key block that fits wins. Here that is block_k = 64: block_k = 128 would not fit even
# beside the smallest query block, since $Q_i, O_i, K_j, V_j$ would need $2 \cdot (8 + 128) \cdot 64 =
# 17408$ elements, more than $M = 16384$. Every block_q up to 64 ties; the star takes the largest, which is
# also the paper's rule ($B_c = \lceil M/4d \rceil = 64$, $B_r = \min(B_c, d) = 64$). A smaller block_q
# would only pay if it freed enough room to double block_k.
# FA2 (lesson 05) swaps the loops and with them the roles of $B_r$ and $B_c$.
#
# ## Explore
#
# Move the sliders: sequence length $N$, head dimension $d$, SRAM size $M$ and both block sizes. The
# left plot places your blocks on the traffic curve; the right one shows all block sizes for your $M$.
# (Without widgets, or in the fast mode, you see a grid for a few values of $d$ and $M$ instead.)

# %%
viz.sram_explorer();

# %% [markdown]
# Things to try: halve $M$ and see which blocks stop fitting; double $d$ at fixed $M$ and watch the
# traffic grow four-fold ($d^2$); find the $M$ at which FA1 starts to beat naive attention for $d = 128$.
#
# **Exercises:** [04_tiling_fa1](../exercises/04_tiling_fa1.ipynb): choose block sizes for a budget,
# write one FA1 tile update, then the whole FA1 forward.
