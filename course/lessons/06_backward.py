# %% [markdown]
# # 06 · The backward pass: recompute instead of store
#
# **After this lesson you can**
# - write the gradients of attention, $dQ$, $dK$, $dV$, in terms of $P$, $dP$ and $D = \mathrm{rowsum}(dO \circ O)$;
# - rebuild any tile of $P$ from the saved log-sum-exp, $P_{ij} = e^{S_{ij} - \mathrm{lse}_i}$;
# - weigh what recomputation costs (extra FLOPs) against what it saves (memory and HBM traffic);
# - check a backward pass against finite differences.

# %%
import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

import flashlab
from flashlab import (HBMModel, flash_attention_v2, flash_attention_v2_backward, formula_traffic, naive_attention_backward,
                      reference_attention, relative_error, viz)

rng = np.random.default_rng(0)

# %% [markdown]
# ## What the forward pass keeps
#
# To differentiate $O = \mathrm{softmax}(QK^\top/\sqrt d)\,V$ we need $P$. A standard implementation
# keeps the $N \times N$ matrix from the forward pass. FlashAttention keeps one number per query
# instead, $\mathrm{lse}_i = m_i + \log l_i$, from which any entry of $P$ can be rebuilt:

# %%
viz.plot_saved_for_backward(2 ** np.arange(8, 17), d=64, bytes_per_element=2);

# %% [markdown]
# The plot counts P and O in float16, 2 bytes per element, as a model trained in float16 keeps them; lse is
# float32. At N = 16K, P is 512 MiB per head in float16; lse is 64 KiB.
#
# ## The gradients
#
# With $dO$ the gradient of the loss with respect to $O$ and scale $s = 1/\sqrt d$
# (FlashAttention-2, arXiv 2307.08691, Section 2.2):
#
# $$ dV = P^\top dO, \qquad dP = dO\,V^\top, \qquad dS_{ij} = P_{ij}\,(dP_{ij} - D_i), \qquad
#    dQ = s\, dS\, K, \qquad dK = s\, dS^\top Q, $$
#
# where $D_i = \sum_j P_{ij}\, dP_{ij}$. $dV$, $dP$, $dQ$ and $dK$ are the usual rules for a matrix
# product. $dS$ comes from the softmax, row by row. With $P_{ij} = e^{S_{ij}} / \sum_l e^{S_{il}}$, the
# softmax's Jacobian is
#
# $$ \frac{\partial P_{ij}}{\partial S_{ik}} = P_{ij}\,(\delta_{jk} - P_{ik}), \qquad
#    \delta_{jk} = 1 \text{ if } j = k, \text{ else } 0, $$
#
# and the chain rule sums over every $P_{ij}$ that $S_{ik}$ moves:
#
# $$ dS_{ik} = \sum_j dP_{ij}\, P_{ij}\,(\delta_{jk} - P_{ik})
#    = P_{ik}\, dP_{ik} - P_{ik} \sum_j P_{ij}\, dP_{ij} = P_{ik}\,(dP_{ik} - D_i). $$
#
# Written that way, $D_i$ needs a full row of $P$. But $dP_{ij} = dO_i \cdot V_j$, so
# $D_i = \sum_j P_{ij} (dO_i \cdot V_j) = dO_i \cdot \sum_j P_{ij} V_j = dO_i \cdot O_i$:
# $D = \mathrm{rowsum}(dO \circ O)$, one cheap pass over $O$ and $dO$, before any tile is touched.
# Both facts, checked on small inputs (where materialising $P$ is fine):

# %%
n, d = flashlab.size(512, 128), 64
q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
do = rng.standard_normal((n, d))
o, lse = reference_attention(q, k, v)
S = q @ k.T / np.sqrt(d)
P = np.exp(S - S.max(axis=1, keepdims=True))
P /= P.sum(axis=1, keepdims=True)
print("P rebuilt from lse:  ", relative_error(np.exp(S - lse[:, None]), P))
print("rowsum(P * dP) = rowsum(dO * O):", relative_error((P * (do @ v.T)).sum(axis=1), (do * o).sum(axis=1)))

# %% [markdown]
# ## The loops
#
# `flash_attention_v2_backward` (arXiv 2307.08691, Algorithm 2) loops over key blocks outside, so each
# thread block owns and accumulates its $dK_j, dV_j$ on chip; inside, for every query block it loads
# $Q_i, dO_i, \mathrm{lse}_i, D_i$, recomputes $S_{ij}$ and $P_{ij}$, and adds its share to $dQ_i$ in HBM.
# Traced from the code, with the counts of one instrumented run on the right:

# %%
viz.plot_backward_order(128, 128, 32, 32);

# %% [markdown]
# The order is FA1's (lesson 04), for the same reason: what stays on chip is what the outer loop owns.
# $dK_j$ and $dV_j$ (green column) collect a term from every query block while the inner loop runs down
# the column, and are written once. $dQ_i$ (red row) gets a term from every key block, one column apart,
# so it lives in HBM: read, added to and written back at each tile, plus one write to zero it first.
#
# ## What recomputation costs and saves
#
# The backward computes $S = QK^\top$ again: one extra $N\times N\times d$ matmul on top of the four it
# needs anyway. In exchange it never reads or writes an $N\times N$ array:

# %%
io_fwd, io_bwd = HBMModel(), HBMModel(M=16384)
q32, k32, v32, do32 = (x.astype(np.float32) for x in (q, k, v, do))
o32, lse32 = flash_attention_v2(q32, k32, v32, io=io_fwd)
flash_attention_v2_backward(q32, k32, v32, o32, lse32, do32, io=io_bwd)
print(f"matmul FLOPs, backward / forward: {io_bwd.matmul_flops / io_fwd.matmul_flops:.2f}  (5 matmuls vs 2)")
print(f"FA2 backward HBM traffic at N = {n}, M = 16384: {io_bwd.hbm_bytes:,} bytes")

# %% [markdown]
# A standard backward (arXiv 2205.14135, Algorithm 3) runs five separate steps that pass $N\times N$
# arrays through HBM: it reads $P$ twice, writes and reads $dP$, writes $dS$ and reads it twice, about
# $7N^2$ elements on top of $\sim 8Nd$ for the inputs and gradients. `naive_attention_backward` runs
# those five steps, so the model can count them, and the count matches the closed form:

# %%
io_std = HBMModel(M=None)
naive_attention_backward(q32, k32, v32, do32, io=io_std)
t_std = formula_traffic("naive_backward", n, n, q.shape[-1])
print(f"standard backward: {io_std.elements_read + io_std.elements_written:,} elements moved "
      f"(formula: {t_std['read'] + t_std['write']:,}); FA2 backward: {io_bwd.elements_read + io_bwd.elements_written:,}")

# %% [markdown]
# FlashAttention's backward (Algorithm 4) moves $\Theta(N^2 d^2 / M)$ (Theorem 5 of the same paper); FA2's
# backward has the same loops over the same tiles, so the same count holds. Both grow as $N^2$ for a
# fixed SRAM, so which one moves less depends on $M$ against $d^2$, just as in lesson 04:

# %%
ns, d_head = 2 ** np.arange(9, 17), 64
fig, ax = plt.subplots(figsize=(6.5, 3.8))
std = [sum(formula_traffic("naive_backward", int(m), int(m), d_head).values()) for m in ns]
ax.plot(ns, std, "--", color="#d62728", lw=2, label="standard backward (≈ 7N² + 8Nd)")
for M, style in ((16384, ":"), (65536, "-."), (98304, "-")):  # 98304 float16 = 192 KiB: an A100 SM's L1 + shared
    fa = [sum(formula_traffic("fa2_backward", int(m), int(m), d_head, M=M).values()) for m in ns]
    ax.plot(ns, fa, style, marker="o", ms=3, color="#9467bd", label=f"FA2 backward, M = {M}")
ax.set(yscale="log", xlabel="sequence length N", ylabel=f"elements moved through HBM (d = {d_head})")
ax.set_xscale("log", base=2)
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8);

# %% [markdown]
# With a small budget the tiled backward moves as many bytes as the standard one, or more: its small
# blocks re-read $Q$, $dO$ and $dQ$ once per key block. With the on-chip memory of a real SM it moves
# less, and it never needs the $N^2$ memory at all, which is what makes long sequences fit in the first
# place. The extra matmul for recomputing $S$ is cheap next to the time HBM traffic costs (lesson 01):
# FlashAttention's backward runs faster than the standard one despite the extra arithmetic
# (arXiv 2205.14135, Section 4).
#
# ## Gradient check
#
# Define the scalar $L(Q, K, V) = \sum O \circ dO$, whose gradient with respect to $O$ is $dO$. Nudge
# one entry of an input by $\pm\varepsilon$, recompute $L$ with the float64 reference, and the central
# difference $(L_+ - L_-)/2\varepsilon$ approximates that entry's gradient to about $\varepsilon^2$.
# Compare with flashlab's backward at a sample of entries, with and without the causal mask, and with a
# backward that has a bug:

# %%
n_fd, eps = flashlab.size(48, 24), 1e-5
q, k, v, do = (rng.standard_normal((n_fd, 16)) for _ in range(4))

def loss(q, k, v, causal):
    return float(np.sum(reference_attention(q, k, v, causal=causal)[0] * do))

def finite_differences(x, picks, causal):
    """(L+ - L-) / 2 eps at each picked entry of x, one of q, k, v (nudged in place, then restored)."""
    out = []
    for idx in picks:
        old = x[idx]
        x[idx] = old + eps
        up = loss(q, k, v, causal)
        x[idx] = old - eps
        down = loss(q, k, v, causal)
        x[idx] = old
        out.append((up - down) / (2 * eps))
    return np.array(out)

def backward_without_D(q, k, v, do):
    """A dense backward with a bug on purpose: the D term dropped from dS."""
    s = 1 / np.sqrt(q.shape[-1])
    P = np.exp(q @ k.T * s - reference_attention(q, k, v)[1][:, None])
    dS = P * (do @ v.T)  # right: P * (do @ v.T - D[:, None])
    return s * dS @ k, s * dS.T @ q, P.T @ do

inputs = dict(zip("QKV", (q, k, v)))
picks = {name: [tuple(rng.integers(n) for n in x.shape) for _ in range(flashlab.size(12, 6))] for name, x in inputs.items()}
numeric = {(causal, name): finite_differences(inputs[name], picks[name], causal)
           for causal, name in tqdm([(c, n) for c in (False, True) for n in "QKV"], desc="finite differences")}

runs = {}  # title -> (causal, (dQ, dK, dV))
for causal in (False, True):
    o, lse = flash_attention_v2(q, k, v, causal=causal, block_q=16, block_k=16)
    runs[f"flash_attention_v2_backward, causal={causal}"] = (
        causal, flash_attention_v2_backward(q, k, v, o, lse, do, causal=causal, block_q=16, block_k=16))
runs["a bug: D dropped from dS"] = (False, backward_without_D(q, k, v, do))

fig, axes = plt.subplots(1, 3, figsize=(13, 4))
for ax, (title, (causal, grads)) in zip(axes, runs.items()):
    for name, g, marker in zip("QKV", grads, "os^"):
        fd = numeric[causal, name]
        analytic = np.array([g[idx] for idx in picks[name]])
        err = np.max(np.abs(analytic - fd)) / np.max(np.abs(fd))
        ax.plot(fd, analytic, marker, mfc="none", label=f"d{name}: max rel. error {err:.0e}")
    lim = max(np.abs(ax.get_xlim()).max(), np.abs(ax.get_ylim()).max())
    ax.plot([-lim, lim], [-lim, lim], color="#999999", lw=0.8, zorder=0)
    ax.set(xlabel="finite difference", ylabel="backward's gradient", title=title)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# In the first two panels all points sit on the diagonal, with errors near $10^{-9}$ or below, the size a
# central difference with $\varepsilon = 10^{-5}$ leaves. The third is a backward with a bug, the $D$ term
# dropped from $dS$, on the same inputs: $dV$ does not involve $D$ and stays on the diagonal, while $dQ$
# and $dK$ land visibly off it. The exercise grader tries mistakes like this one (and others, a mask off
# by one) on your code.
#
# **Exercises:** [06_backward](../exercises/06_backward.ipynb): compute $D$, write the FA2
# backward pass, and weigh recomputing P against storing it on a roofline.
