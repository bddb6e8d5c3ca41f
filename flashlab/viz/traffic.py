"""HBM traffic figures and the interactive tile-size explorers (lessons 04 and 05).

Curves come from flashlab.iomodel.formula_traffic (closed forms that tests check against instrumented
runs), so they are instant even at N = 64K. Block sizes that do not fit the SRAM budget M are found by
asking HBMModel itself, so the figures use the same budget convention as the algorithms.
"""
from __future__ import annotations

import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter

from ..iomodel import HBMModel, SRAMOverflowError, asymptotic_traffic, default_block_sizes, formula_traffic
from ._base import COLORS, LABELS, explore, human_bytes, own_axes, subplots, text_color_on

BLOCKS = (8, 16, 32, 64, 128, 256)
SRAMS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SEQS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _tiles(algorithm, block_q, block_k, d, dv=None):
    """{name: shape} of the tiles `algorithm` holds in SRAM at once."""
    dv = dv or d
    if algorithm == "fa2_backward":
        return dict(K_j=(block_k, d), V_j=(block_k, dv), dK_j=(block_k, d), dV_j=(block_k, dv),
                    Q_i=(block_q, d), dO_i=(block_q, dv), dQ_i=(block_q, d))
    return dict(Q_i=(block_q, d), K_j=(block_k, d), V_j=(block_k, dv), O_i=(block_q, dv))


def fits(algorithm, block_q, block_k, d, M, dv=None):
    """Do the tiles `algorithm` streams through SRAM fit in M elements at these block sizes?"""
    try:
        HBMModel(M).sram(**_tiles(algorithm, block_q, block_k, d, dv))
    except SRAMOverflowError:
        return False
    return True


def sram_need(algorithm, block_q, block_k, d, dv=None):
    """SRAM elements the tiles of `algorithm` take at these block sizes (HBMModel's budget convention)."""
    io = HBMModel(None)
    io.sram(**_tiles(algorithm, block_q, block_k, d, dv))
    return io.peak_sram


def traffic_bytes(algorithm, n, d, M, block_q=None, block_k=None, causal=False, bytes_per_element=4):
    """Total HBM bytes (read + write) of `algorithm` for one head with Nq = Nk = n, from the closed form."""
    t = formula_traffic(algorithm, n, n, d, block_q=block_q, block_k=block_k, causal=causal, M=M)
    return (t["read"] + t["write"]) * bytes_per_element


def plot_traffic_vs_sram(n, d, Ms=SRAMS, algorithms=("naive", "fa1", "fa2"), causal=False, ax=None, mark=None):
    """HBM bytes against SRAM size M, block sizes from the paper's rule at each M.

    mark: optional (M, bytes, label) point, e.g. a hand-picked block size or an instrumented run.
    """
    fig, ax = own_axes(ax, width=6, height=3.8)
    Ms = np.asarray(Ms)
    for alg in algorithms:
        y = [traffic_bytes(alg, n, d, int(M), causal=causal) for M in Ms]
        ax.plot(Ms, y, "o-", ms=3, color=COLORS[alg], label=LABELS[alg])
    if "fa1" in algorithms:  # the paper's Theta(N^2 d^2 / M), scaled to meet FA1 at the smallest M
        ref = traffic_bytes("fa1", n, d, int(Ms[0]), causal=causal) / asymptotic_traffic("fa1", n, d, int(Ms[0]))
        ax.plot(Ms, [ref * asymptotic_traffic("fa1", n, d, int(M)) for M in Ms], ":", color="black", lw=1,
                label="∝ N²d²/M (arXiv 2205.14135, Thm. 2)")
    if mark is not None:
        ax.plot([mark[0]], [mark[1]], "*", ms=13, color="black", zorder=5, label=mark[2])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("SRAM size M (elements)")
    ax.set_ylabel("HBM bytes (float32)")
    ax.set_title(f"HBM traffic vs SRAM size (N = {n}, d = {d})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def block_traffic_grid(algorithm, n, d, M, sizes=BLOCKS, causal=False):
    """(bytes, fits): two len(sizes) x len(sizes) arrays indexed [block_q, block_k]; bytes is NaN where the
    tiles do not fit in M."""
    out = np.full((len(sizes), len(sizes)), np.nan)
    ok = np.zeros_like(out, dtype=bool)
    for a, bq in enumerate(sizes):
        for b, bk in enumerate(sizes):
            ok[a, b] = fits(algorithm, bq, bk, d, M)
            if ok[a, b]:
                out[a, b] = traffic_bytes(algorithm, n, d, M, bq, bk, causal)
    return out, ok


def plot_block_heatmap(algorithm, n, d, M, sizes=BLOCKS, causal=False, mark=None, ax=None, compact=False):
    """HBM bytes for every (block_q, block_k); grey where the tiles overflow M; the best cell starred.
    When no block size fits, the panel says so instead of drawing a colour scale."""
    fig, ax = own_axes(ax, width=4.6, height=3.8)
    grid, ok = block_traffic_grid(algorithm, n, d, M, sizes, causal)
    ax.imshow(np.where(ok, np.nan, 1.0), cmap="Greys", vmin=0, vmax=5, origin="lower")  # overflow cells
    if ok.any():
        im = ax.imshow(np.log10(grid), cmap="viridis_r", origin="lower")
        area = np.outer(sizes, sizes)  # least traffic; among ties, the largest tiles (fewest loop steps)
        best = np.where(ok & (grid <= np.nanmin(grid) * (1 + 1e-9)), area, -1)
        a, b = np.unravel_index(np.argmax(best), best.shape)
        corner = 0.0 if compact else 0.3  # beside the cell's label, not on it
        ax.plot([b + corner], [a + corner], "*", color="white", ms=8 if corner else 12, mec="black")
    else:
        need = sram_need(algorithm, min(sizes), min(sizes), d)
        ax.text(0.5, 0.5, f"nothing fits in M = {M}:\nthe smallest tiles ({min(sizes)}×{min(sizes)})\n"
                f"need {need} elements", transform=ax.transAxes, ha="center", va="center",
                fontsize=7 if compact else 9, color="#b00000",
                bbox=dict(boxstyle="round", fc="white", ec="#b00000"), zorder=5)
    if not compact and mark is not None and mark[0] in sizes and mark[1] in sizes:
        a, b = sizes.index(mark[0]), sizes.index(mark[1])
        ax.add_patch(Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, ec="red", lw=2))
    if not compact and ok.any():
        for a in range(len(sizes)):
            for b in range(len(sizes)):
                if ok[a, b]:  # black or white, whichever reads better on this cell's colour
                    color = text_color_on(im.cmap(im.norm(np.log10(grid[a, b]))))
                    ax.text(b, a, human_bytes(grid[a, b]).replace(" ", "\n"), ha="center", va="center",
                            fontsize=6, color=color)
                else:
                    ax.text(b, a, "×", ha="center", va="center", fontsize=6, color="#777777")
        fig.colorbar(im, ax=ax, shrink=0.8, label="log10 bytes")
    ax.set_xticks(range(len(sizes)), sizes, fontsize=7)
    ax.set_yticks(range(len(sizes)), sizes, fontsize=7)
    ax.set_xlabel("block_k (Bc)")
    ax.set_ylabel("block_q (Br)")
    ax.set_title(f"{LABELS[algorithm]}: M = {M}, d = {d}", fontsize=9)
    return fig


def plot_traffic_vs_n(d, M, ns=SEQS, algorithms=("naive", "fa1", "fa2"), block_q=None, block_k=None,
                      causal=False, ax=None, mark_n=None):
    """HBM bytes against sequence length for each algorithm (Nq = Nk = N)."""
    fig, ax = own_axes(ax, width=6, height=3.8)
    for alg in algorithms:
        y = [traffic_bytes(alg, n, d, M, block_q, block_k, causal) for n in ns]
        ax.plot(ns, y, "o-", ms=3, color=COLORS[alg], label=LABELS[alg])
    if mark_n is not None:
        ax.axvline(mark_n, color="black", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("HBM bytes (float32)")
    blocks = "paper's rule" if block_q is None else f"Br={block_q}, Bc={block_k}"
    ax.set_title(f"d = {d}, M = {M}, {blocks}" + (", causal" if causal else ""), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def plot_io_compare(ios: dict, ax=None):
    """Side by side for instrumented runs {label: HBMModel}: HBM bytes, and matmul vs non-matmul FLOPs."""
    fig, (a, b) = subplots(1, 2, width=9, height=3.2)
    names = list(ios)
    x = np.arange(len(names))
    colors = [COLORS.get(ios[n].algorithm, "#777777") for n in names]
    a.bar(x, [ios[n].hbm_bytes for n in names], color=colors)
    a.set_xticks(x, names)
    a.set_ylabel("HBM bytes")
    a.set_title("memory traffic")
    for xi, n in zip(x, names):
        a.text(xi, ios[n].hbm_bytes, human_bytes(ios[n].hbm_bytes), ha="center", va="bottom", fontsize=8)
    b.bar(x, [ios[n].other_flops for n in names], color=colors)
    b.set_xticks(x, names)
    b.set_ylabel("non-matmul FLOPs")
    b.set_title("non-matmul FLOPs (exp, max, rescaling, division)")
    for xi, n in zip(x, names):
        io = ios[n]
        b.text(xi, io.other_flops, f"{io.other_flops:,}\n({io.other_flops / io.matmul_flops:.1%} of matmul)",
               ha="center", va="bottom", fontsize=7)
    for axis in (a, b):
        axis.set_ylim(0, axis.get_ylim()[1] * 1.25)
    fig.tight_layout()
    return fig


# --- explorers ------------------------------------------------------------------------------------

def _draw_sram(ax=None, N=4096, d=64, M=16384, block_q=64, block_k=64):
    if ax is not None:  # one small panel of the static grid
        return plot_block_heatmap("fa1", N, d, M, mark=(block_q, block_k), ax=ax, compact=True)
    fig, (left, right) = subplots(1, 2, width=11, height=4)
    ok = fits("fa1", block_q, block_k, d, M)
    mark = (M, traffic_bytes("fa1", N, d, M, block_q, block_k), f"your blocks {block_q}×{block_k}") if ok else None
    plot_traffic_vs_sram(N, d, algorithms=("naive", "fa1"), ax=left, mark=mark)
    left.axvline(M, color="black", lw=0.8, ls=":")
    if not ok:
        left.text(0.98, 0.96, f"{block_q}×{block_k} tiles do not fit in M = {M}", color="red", fontsize=8,
                  va="top", ha="right", transform=left.transAxes)
    plot_block_heatmap("fa1", N, d, M, mark=(block_q, block_k), ax=right)
    fig.tight_layout()
    return fig


def sram_explorer(interactive=None):
    """Lesson 04: FA1 traffic against SRAM size and block sizes. Sliders in a live kernel; a static grid of
    block-size heatmaps (rows: d, columns: M) when widgets are unavailable or in the fast mode."""
    controls = {"N": (SEQS, 4096), "d": ((32, 64, 128), 64), "M": (SRAMS, 16384),
                "block_q": (BLOCKS, 64), "block_k": (BLOCKS, 64)}
    return explore(_draw_sram, controls, {"d": (64, 128), "M": (4096, 16384, 65536)}, interactive=interactive,
                   title="FA1 HBM bytes over (block_q, block_k); ☆ = least traffic, grey = does not fit")


def _draw_fa(ax=None, N=4096, d=64, M=16384, block_q=64, block_k=64, causal=False):
    if not fits("fa2", block_q, block_k, d, M):
        block_q, block_k = default_block_sizes(d, M)
    if ax is not None:
        return plot_traffic_vs_n(d, M, block_q=block_q, block_k=block_k, causal=causal, ax=ax)
    fig, (left, right) = subplots(1, 2, width=11, height=4)
    plot_traffic_vs_n(d, M, block_q=block_q, block_k=block_k, causal=causal, ax=left, mark_n=N)
    algs = ("naive", "fa1", "fa2")
    vals = [traffic_bytes(a, N, d, M, block_q, block_k, causal) for a in algs]
    right.bar(range(3), vals, color=[COLORS[a] for a in algs])
    right.set_xticks(range(3), [LABELS[a] for a in algs], fontsize=8)
    for i, v in enumerate(vals):
        right.text(i, v, human_bytes(v), ha="center", va="bottom", fontsize=8)
    right.set_ylabel("HBM bytes")
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))  # "200 MB", not "2.0" x 1e8
    right.set_title(f"N = {N}: FA1 moves {vals[1] / vals[2]:.1f}× the bytes of FA2", fontsize=10)
    fig.tight_layout()
    return fig


def fa_explorer(interactive=None):
    """Lesson 05: naive, FA1 and FA2 traffic against N for chosen tiles (blocks that overflow M fall back to
    the paper's rule). Static fallback: rows causal off/on, columns M."""
    controls = {"N": (SEQS, 4096), "d": ((32, 64, 128), 64), "M": (SRAMS, 16384),
                "block_q": (BLOCKS, 64), "block_k": (BLOCKS, 64), "causal": ((False, True), False)}
    return explore(_draw_fa, controls, {"causal": (False, True), "M": (4096, 16384, 65536)},
                   interactive=interactive, title="HBM bytes vs N (top: full attention, bottom: causal)")
