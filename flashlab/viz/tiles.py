"""Pictures of the tiled loops (lessons 04-06): which (query block, key block) tiles are visited, in what
order, which are skipped under causal masking, and which thread block does which tiles.

The visit order is not redrawn from a description: `trace_tiles` runs flashlab's own implementation with
a recording `io` and reads off which Q and K blocks each step loaded.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

from ..iomodel import HBMModel
from ..tiled import flash_attention_v1, flash_attention_v2, flash_attention_v2_backward
from ._base import COLORS, LABELS, own_axes, subplots


class TileTracer(HBMModel):
    """An HBMModel that also records, for every on-chip step, which rows of Q and K it was working on."""

    def __init__(self, q, k, M=None):
        self._q, self._k = q, k
        super().__init__(M=M)

    def reset(self):
        super().reset()
        self.visits = []  # (first query row, first key row) per step, in order
        self._current = {}

    def _row(self, base, x):
        offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return offset // base.strides[-2]

    def read(self, name, x):
        base = {"Q": self._q, "K": self._k}.get(name)
        if base is not None and np.shares_memory(x, base):
            self._current[name] = self._row(base, x)
        return super().read(name, x)

    def sram(self, **shapes):
        super().sram(**shapes)
        self.visits.append((self._current["Q"], self._current["K"]))


def trace_tiles(algorithm, nq, nk, block_q, block_k, causal=False, d=4):
    """[(i, j), ...]: the (query block, key block) pairs `algorithm` computes, in the order it computes them.

    algorithm: "fa1", "fa2" or "fa2_backward". Runs flashlab's implementation on small random inputs.
    """
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))
    tracer = TileTracer(q, k)
    kw = dict(causal=causal, block_q=block_q, block_k=block_k)
    if algorithm == "fa1":
        flash_attention_v1(q, k, v, io=tracer, **kw)
    elif algorithm == "fa2":
        flash_attention_v2(q, k, v, io=tracer, **kw)
    elif algorithm == "fa2_backward":
        o, lse = flash_attention_v2(q, k, v, **kw)
        flash_attention_v2_backward(q, k, v, o, lse, rng.standard_normal(o.shape).astype(np.float32), io=tracer, **kw)
    else:
        raise ValueError(f"algorithm must be 'fa1', 'fa2' or 'fa2_backward'; got {algorithm!r}")
    return [(r // block_q, c // block_k) for r, c in tracer.visits]


def _grid_axes(ax, tr, tc, title):
    ax.set_xlim(0, tc)
    ax.set_ylim(tr, 0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(tc) + 0.5, [str(j) for j in range(tc)], fontsize=7)
    ax.set_yticks(np.arange(tr) + 0.5, [str(i) for i in range(tr)], fontsize=7)
    ax.set_xlabel("key block j (K_j, V_j)")
    ax.set_ylabel("query block i (Q_i)")
    ax.set_title(title, fontsize=10)
    ax.tick_params(length=0)


def _diagonal_cells(nq, nk, block_q, block_k):
    """Tiles holding at least one masked score: the last key of the tile comes after its first query."""
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    return {(i, j) for i in range(tr) for j in range(tc) if min((j + 1) * block_k, nk) - 1 > i * block_q}


ARROWS = 12  # plot_tile_order draws arrows through the first ARROWS tiles visited; the numbers give the rest


def plot_tile_order(algorithm, nq, nk, block_q, block_k, causal=False, ax=None, numbers=True):
    """The S matrix as a Tr x Tc grid of tiles, each numbered and shaded by when `algorithm` visits it.

    Tiles never visited (causal masking) stay grey and are crossed out; arrows follow the first ARROWS visits,
    and the axis label says so when there are more.
    """
    fig, ax = own_axes(ax, width=4.4, height=4.2)
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    order = trace_tiles(algorithm, nq, nk, block_q, block_k, causal)
    step = np.full((tr, tc), np.nan)
    for s, (i, j) in enumerate(order):
        step[i, j] = s
    ax.imshow(np.where(np.isnan(step), -1, step), cmap=ListedColormap(["#eeeeee"]), extent=(0, tc, tr, 0))
    shown = np.ma.masked_invalid(step)
    ax.imshow(shown, cmap="viridis", extent=(0, tc, tr, 0), vmin=0, vmax=max(len(order) - 1, 1), alpha=0.85)
    for i in range(tr):
        for j in range(tc):
            if np.isnan(step[i, j]):
                ax.plot([j + 0.15, j + 0.85], [i + 0.15, i + 0.85], color="#bbbbbb", lw=0.8)
                ax.plot([j + 0.15, j + 0.85], [i + 0.85, i + 0.15], color="#bbbbbb", lw=0.8)
            elif numbers and tr * tc <= 100:
                ax.text(j + 0.5, i + 0.5, str(int(step[i, j])), ha="center", va="center", fontsize=8, color="white")
    path = order[:ARROWS]
    for (i0, j0), (i1, j1) in zip(path[:-1], path[1:]):
        ax.annotate("", xy=(j1 + 0.5, i1 + 0.5), xytext=(j0 + 0.5, i0 + 0.5),
                    arrowprops=dict(arrowstyle="->", color="#ff7f0e", lw=1.2, shrinkA=6, shrinkB=6))
    for x in range(tc + 1):
        ax.axvline(x, color="white", lw=1)
    for y in range(tr + 1):
        ax.axhline(y, color="white", lw=1)
    loop = {"fa1": "outer j, inner i", "fa2": "outer i, inner j", "fa2_backward": "outer j, inner i"}[algorithm]
    _grid_axes(ax, tr, tc, f"{LABELS[algorithm]} visit order ({loop})" + (", causal" if causal else ""))
    if len(order) > len(path):  # say in the figure that the arrows stop, and how the order goes on
        walk = "row by row" if algorithm == "fa2" else "column by column"
        ax.set_xlabel(f"{ax.get_xlabel()}\narrows: steps 0–{len(path) - 1} only; the rest go on {walk}", fontsize=8)
    return fig


def plot_causal_blocks(nq, nk, block_q, block_k, ax=None):
    """Causal FA2: tiles computed in full, tiles cut by the diagonal (masked inside), tiles skipped."""
    fig, ax = own_axes(ax, width=4.6, height=4.2)
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    visited = set(trace_tiles("fa2", nq, nk, block_q, block_k, causal=True))
    cut = _diagonal_cells(nq, nk, block_q, block_k) & visited
    state = np.zeros((tr, tc))
    for i, j in visited:
        state[i, j] = 2 if (i, j) in cut else 1
    ax.imshow(state, cmap=ListedColormap(["#eeeeee", COLORS["fa2"], "#a6d96a"]), vmin=0, vmax=2,
              extent=(0, tc, tr, 0))
    ax.plot([0, nk / block_k], [0, nq / block_q], color="black", lw=1)  # the diagonal key = query
    for x in range(tc + 1):
        ax.axvline(x, color="white", lw=1)
    for y in range(tr + 1):
        ax.axhline(y, color="white", lw=1)
    n_skip = tr * tc - len(visited)
    _grid_axes(ax, tr, tc, f"causal: {len(visited) - len(cut)} full, {len(cut)} masked inside, {n_skip} skipped")
    ax.legend(handles=[Rectangle((0, 0), 1, 1, color=COLORS["fa2"]), Rectangle((0, 0), 1, 1, color="#a6d96a"),
                       Rectangle((0, 0), 1, 1, color="#eeeeee")],
              labels=["computed", "computed, then masked", "skipped"], fontsize=7, loc="upper right",
              bbox_to_anchor=(1.0, -0.15), ncol=3)
    return fig


def plot_work_split(nq, nk, block_q, block_k, causal=False, heads=2):
    """Who computes which tile. FA1 launches one thread block per (batch, head), which walks every tile;
    FA2 launches one per (batch, head, query block). Colors are thread blocks; bars count their tiles."""
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    visited = trace_tiles("fa2", nq, nk, block_q, block_k, causal)
    fig, axes = subplots(1, 3, width=12, height=3.9, gridspec_kw={"width_ratios": [1, 1, 0.9]})
    cmap = ListedColormap(["#eeeeee"] + [f"C{c}" for c in range(10)])
    for ax, who, title in ((axes[0], lambda i: 0, f"FA1: 1 thread block per head ({heads} heads → {heads})"),
                           (axes[1], lambda i: i, f"FA2: 1 per query block ({heads} heads → {heads * tr})")):
        owner = np.zeros((tr, tc))
        for i, j in visited:
            owner[i, j] = 1 + who(i) % 10
        ax.imshow(owner, cmap=cmap, vmin=0, vmax=10, extent=(0, tc, tr, 0), interpolation="nearest")
        for x in range(tc + 1):
            ax.axvline(x, color="white", lw=1)
        for y in range(tr + 1):
            ax.axhline(y, color="white", lw=1)
        _grid_axes(ax, tr, tc, title)
    work = np.bincount([i for i, _ in visited], minlength=tr)
    axes[2].barh(np.arange(tr), work, color=[f"C{i % 10}" for i in range(tr)])
    axes[2].set_ylim(tr - 0.5, -0.5)
    axes[2].set_xlabel("tiles computed")
    axes[2].set_ylabel("FA2 thread block (query block i)")
    axes[2].set_title("work per FA2 thread block" + (" (causal)" if causal else ""), fontsize=10)
    fig.tight_layout()
    return fig


def plot_occupancy(tr, n_sm=108, batch_heads=(1, 2, 4, 8, 16, 32, 64, 128), ax=None):
    """Fraction of SMs given work when FA1 launches batch*heads thread blocks and FA2 batch*heads*Tr.

    A simple count: a GPU with n_sm SMs (108 on an A100) runs one thread block per SM here.
    """
    fig, ax = own_axes(ax, width=6, height=3.4)
    bh = np.asarray(batch_heads, dtype=float)
    ax.plot(bh, np.minimum(1, bh / n_sm), "o-", color=COLORS["fa1"], label="FA1: batch·heads blocks")
    ax.plot(bh, np.minimum(1, bh * tr / n_sm), "s-", color=COLORS["fa2"], label=f"FA2: batch·heads·Tr blocks (Tr = {tr})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch × heads")
    ax.set_ylabel(f"fraction of {n_sm} SMs busy")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title("Parallelism over the sequence fills the GPU")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def backward_round_trips(nq, nk, block_q, block_k, causal=False, d=4):
    """{name: (reads, writes)} for dQ, dK and dV in one run of flashlab's FA2 backward, each counted in
    whole arrays (elements moved / elements of the array): how often each gradient crosses HBM."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))
    kw = dict(causal=causal, block_q=block_q, block_k=block_k)
    o, lse = flash_attention_v2(q, k, v, **kw)
    io = HBMModel(M=None)
    flash_attention_v2_backward(q, k, v, o, lse, rng.standard_normal(o.shape).astype(np.float32), io=io, **kw)
    s = io.summary()
    size = {"dQ": nq * d, "dK": nk * d, "dV": nk * d}
    return {n: (s["reads"].get(n, 0) / size[n], s["writes"].get(n, 0) / size[n]) for n in size}


def plot_backward_order(nq, nk, block_q, block_k, causal=False):
    """The FA2 backward's loops (lesson 06), traced from flashlab's code: the outer loop walks the key blocks
    j, the inner loop the query blocks i. Left: the visit order, with one key block's column marked (its dK_j,
    dV_j stay on chip while the inner loop runs down it) and one query block's row (its dQ_i is read from
    HBM, added to and written back at every tile of the row). Right: how often each gradient crosses HBM
    in the same run (backward_round_trips)."""
    fig, (left, right) = subplots(1, 2, width=10, height=4.6, gridspec_kw={"width_ratios": [1.1, 1]})
    plot_tile_order("fa2_backward", nq, nk, block_q, block_k, causal=causal, ax=left)
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    j, i = min(1, tc - 1), min(1, tr - 1)
    left.add_patch(Rectangle((j, 0), 1, tr, fill=False, ec=COLORS["fa2"], lw=3, zorder=6))
    left.add_patch(Rectangle((0, i), tc, 1, fill=False, ec=COLORS["naive"], lw=2, ls="--", zorder=6))
    left.text(j + 0.5, -0.08, f"dK_{j}, dV_{j}: on chip", ha="center", va="bottom", fontsize=8,
              color=COLORS["fa2"], fontweight="bold")
    left.text(tc + 0.05, i + 0.5, f"dQ_{i}:\nin HBM,\n+= at\neach tile", ha="left", va="center", fontsize=8,
              color=COLORS["naive"], fontweight="bold")
    left.set_title(f"{left.get_title()}\n", fontsize=10)

    trips = backward_round_trips(nq, nk, block_q, block_k, causal)
    names = list(trips)
    x = np.arange(len(names))
    reads = np.array([trips[n][0] for n in names])
    writes = np.array([trips[n][1] for n in names])
    right.bar(x - 0.18, reads, 0.36, color="#4c72b0", label="read from HBM")
    right.bar(x + 0.18, writes, 0.36, color="#dd8452", label="written to HBM")
    for xi, r, w in zip(x, reads, writes):
        right.text(xi - 0.18, r, f"{r:g}", ha="center", va="bottom", fontsize=8)
        right.text(xi + 0.18, w, f"{w:g}", ha="center", va="bottom", fontsize=8)
    right.set_xticks(x, names)
    right.set_ylabel("times the whole array crosses HBM")
    right.set_ylim(0, max(reads.max(), writes.max()) * 1.2 + 0.5)
    right.set_title(f"Gradients through HBM (Tc = {tc} key blocks)", fontsize=10)
    right.legend(fontsize=8, loc="upper right")
    right.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
