"""Figures of lessons 15-17 (tensor cores from Python), each drawn from flashlab.fragments or committed data.

fragments  plot_fragments, fragment_explorer, plot_p_in_registers, plot_ldmatrix, plot_quad_reduction
backward   plot_backward_block, ds_sources, plot_ds_transpose
formats    format_errors, plot_format_errors (fp16, bf16, 1xTF32, 3xTF32 products against float64)
kernel     plot_double_buffer (the code itself: flashlab.kernels.tensor.float16_source)
speed      load_mma_ceiling, load_tensor_results, plot_mma_ceiling, plot_tensor_speed, ceiling_shares,
           plot_ceiling_shares, mma_roofs (lesson 10's roofline)
mix        load_sass_mix, instruction_groups, plot_instruction_mix (the loop body's SASS, three builds)
rescale    max_growth, plot_max_growth (which key tiles make an m-tile rescale O, with or without a threshold)

Measured data, package data so that a pip-installed flashlab (Colab) has it too:
flashlab/data/mma_ceiling.csv (benchmarks/timing/mma_ceiling.py: random and constant operands, with the GPU, the
date and the clocks; until it exists, the older flashlab/data/h100_mma_ceiling.csv, constant 0/1-bit operands only),
flashlab/data/h100_tensor.csv (benchmarks/timing/bench_kernels.py --parts tensor), flashlab/data/h100_sass_mix.json
(benchmarks/profiling/sass_mix.py). A missing file makes the loaders return [] (or None) and the plots say so.
"""
from __future__ import annotations

import csv
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from .. import fragments as F
from ._base import explore, own_axes, subplots, text_color_on

DATA = Path(__file__).resolve().parent.parent / "data"
MMA_CSV, TENSOR_CSV = DATA / "mma_ceiling.csv", DATA / "h100_tensor.csv"
H100_MMA_CSV = DATA / "h100_mma_ceiling.csv"  # an older measurement: constant 0/1-bit operands, no clocks
CONSTANT_OPERANDS = "constant 0/1 bits"  # what benchmarks/timing/mma_ceiling.py calls its constant operands
CEILING_META = ("gpu", "operands", "date", "sm_clock_mhz", "power_w")  # load_mma_ceiling's keys that are no mma
SASS_MIX_JSON = DATA / "h100_sass_mix.json"
LAYOUTS = {"f16": ("m16n8k16", "float16"), "tf32": ("m16n8k8", "tf32")}  # the kernel's two mma shapes


# ------------------------------------------------------------------------------------------ fragments
def lane_color(lane: int):
    """One colour per lane: a hue per quad (g = lane // 4, the 4 lanes that share rows), a shade per t."""
    g, t = divmod(int(lane), 4)
    cmap = plt.get_cmap("tab20c" if g < 4 else "tab20b")
    return cmap(4 * (g % 4) + t)


def _draw_operand(ax, x0, y0, shape, operand, dtype, lane=None, col_offset=0, label=None, names=None, text=True,
                  row_labels=True):
    """One operand's cells at (x0, y0): colour = lane, text = lane and element name (only the highlighted
    lane's when text is False: small panels); `lane` highlights one lane."""
    fmap = F.fragment_map(shape, operand, dtype)
    rows, cols = F.operand_shape(shape, operand)
    letter = {"A": "a", "B": "b", "C": "c"}[operand]
    for L in range(32):
        for i, (r, c) in enumerate(fmap[L]):
            color = lane_color(L)
            faded = lane is not None and L != lane
            ax.add_patch(plt.Rectangle((x0 + c, y0 + r), 1, 1, facecolor=color, alpha=0.18 if faded else 1,
                                       edgecolor="black" if not faded and lane is not None else "white", lw=0.8))
            name = names(L, i) if names else f"{letter}{i}"
            if not text:
                continue
            ax.text(x0 + c + 0.5, y0 + r + 0.5, f"{L}\n{name}", ha="center", va="center", fontsize=6.5,
                    color="#999999" if faded else text_color_on(color), linespacing=0.9)
    ax.text(x0 + cols / 2, y0 - 0.6, label or operand, ha="center", va="bottom", fontsize=8)
    if not text:
        return rows, cols
    for c in range(0, cols, 4 if cols > 8 else 2):
        ax.text(x0 + c, y0 + rows + 0.3, str(c + col_offset), ha="center", va="top", fontsize=5.5, color="#555555")
    for r in range(0, rows, 4) if row_labels else ():
        ax.text(x0 - 0.2, y0 + r + 0.5, str(r), ha="right", va="center", fontsize=5.5, color="#555555")
    return rows, cols


def plot_fragments(layout="f16", lane=None, ax=None):
    """A (M x K), B (K x N) and C/D (M x N) of one mma, every cell coloured by the lane that holds it and
    labelled with that lane and the element's name in the lane's fragment (a0, a1, ...). layout: "f16"
    (mma.m16n8k16 with float16/bfloat16 inputs) or "tf32" (mma.m16n8k8 with tf32 inputs)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}; got {layout!r}")
    if lane is not None and not (isinstance(lane, (int, np.integer)) and 0 <= lane < 32):
        raise ValueError(f"lane must be an integer in 0..31 or None; got {lane!r}")
    shape, dtype = LAYOUTS[layout]
    M, N, K = F.SHAPES[shape]
    fig, ax = own_axes(ax, width=13 if K == 16 else 9.5, height=6.4 if K == 16 else 5)
    gap = 2.5
    per = {"A": K // 2 if dtype != "tf32" else 4, "B": K // 4 if dtype != "tf32" else 2, "C": 4}
    x = 0
    cells = K + 2 * N + 2 * gap + 1.7
    roomy = ax.get_position().width * fig.get_figwidth() / cells > 0.22  # inches per cell: room for labels?
    for op, (rows, cols) in (("A", (M, K)), ("B", (K, N)), ("C", (M, N))):
        what = {"A": f"A ({M} x {K})", "B": f"B ({K} x {N})", "C": f"C and D ({M} x {N}), fp32"}[op]
        _draw_operand(ax, x, 0, shape, op, dtype, lane, label=f"{what}: {per[op]} per lane" if roomy else op,
                      text=roomy)
        x += cols + gap
    ax.set_xlim(-1.2, x - gap + 0.5)
    ax.set_ylim(M + 1.2, -1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    if not roomy:  # a small panel of an explorer's static grid
        ax.set_title(f"{layout}: lane {lane}" if lane is not None else layout, fontsize=8)
        return fig
    regs = {"f16": "a0, a1 share one 32-bit register", "tf32": "one tf32 value per register"}
    who = f"lane {lane} highlighted" if lane is not None else "colour = lane"
    ax.set_title(f"mma.{shape}, {dtype} inputs ({who}; {regs[layout]})", fontsize=9)
    return fig


def fragment_explorer(interactive=None):
    """Slide through the 32 lanes of a warp and see which elements of A, B and C each one holds."""
    def draw(ax=None, lane=0, layout="f16"):
        return plot_fragments(layout, lane, ax=ax)

    return explore(draw, {"lane": (list(range(32)), 0), "layout": (list(LAYOUTS), "f16")},
                   {"layout": list(LAYOUTS), "lane": [0, 13, 31]}, title="Which elements of A, B, C one lane holds",
                   interactive=interactive)


def c_tiles_as_a(layout="f16"):
    """Per lane, the (row, key) positions of S held as C fragments of consecutive 8-key n-tiles, in the
    order the kernel reads them as P's A fragment of one k-step: two n-tiles (16 keys) for f16, one for
    tf32. Equal to fragment_map(A) for f16; for tf32 the columns differ (the kernel renumbers keys)."""
    shape, dtype = LAYOUTS[layout]
    C = F.fragment_map(shape, "C", dtype)
    if layout == "f16":
        return np.concatenate([C, C + np.array([0, 8])], axis=1)
    return C[:, [0, 2, 1, 3]]  # a0 <- c0, a1 <- c2, a2 <- c1, a3 <- c3: the kernel's order


def plot_p_in_registers(layout="f16", axes=None):
    """Left: S's C fragments (the output of S = Q K^T) for the keys of one k-step; right: the A fragment
    that k-step of O += P V needs. Same colour in the same cell = the lane already holds it."""
    shape, dtype = LAYOUTS[layout]
    K = F.SHAPES[shape][2]
    if axes is None:
        fig, axes = subplots(1, 2, width=13 if K == 16 else 10, height=6.4 if K == 16 else 5.2)
    fig = axes[0].figure
    ax = axes[0]
    tiles = K // 8
    for n in range(tiles):
        def names(L, i, n=n):
            return f"c{i}" + ("'" if n else "")
        _draw_operand(ax, 8 * n + 0.3 * n, 0, shape, "C", dtype, label=f"S, n-tile {n}: keys {8 * n}-{8 * n + 7}",
                      col_offset=8 * n, names=names, row_labels=n == 0)
    ax.set_xlim(-1.2, 8 * tiles + 0.3 * (tiles - 1) + 0.3)
    ax.set_ylim(17.5, -1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("S = Q Kᵀ comes out as C fragments" + ("\n(c' = second n-tile)" if tiles > 1 else ""), fontsize=9)
    ax = axes[1]
    _draw_operand(ax, 0, 0, shape, "A", dtype, label=f"P as the A operand of O += P V ({K} keys)")
    ax.set_xlim(-1.2, K + 0.3)
    ax.set_ylim(17.5, -1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    same = np.array_equal(c_tiles_as_a(layout), F.fragment_map(shape, "A", dtype))
    ax.set_title("...and O += P V wants them as A fragments:\n" + (
        "the same lanes hold the same cells, no data moves" if same else
        "same rows, other columns: read column t as key 2t, column t+4 as key 2t+1"), fontsize=9)
    fig.tight_layout()
    return fig


WARP_COLORS = plt.get_cmap("tab10").colors


def plot_backward_block(warps=4, block_q=32, query=5, ax=None):
    """One thread block of the tensor backward (lesson 17): a key block of 16 * warps keys, warp w owning keys
    16w..16w+15, and one tile of block_q queries. Each warp computes its band of S^T (rows = its keys) from K
    or V (A) and Q or dO (B), and feeds P^T and dS^T from registers into dV and dK, which stay in its
    registers. dQ's rows are queries: `query`'s row of dS is a column of dS^T crossing every warp's band, so
    dS^T goes through shared memory before the warps split dQ's tile."""
    if isinstance(warps, bool) or not isinstance(warps, (int, np.integer)) or not 1 <= warps <= 8:
        raise ValueError(f"warps must be an integer in 1..8; got {warps!r}")
    if isinstance(block_q, bool) or not isinstance(block_q, (int, np.integer)) or block_q < 16 or block_q % 16:
        raise ValueError(f"block_q must be a positive multiple of 16; got {block_q!r}")
    if isinstance(query, bool) or not isinstance(query, (int, np.integer)) or not 0 <= query < block_q:
        raise ValueError(f"query must be an integer in 0..{block_q - 1} (a query of the tile); got {query!r}")
    BK, BQ = 16 * warps, block_q
    fig, ax = own_axes(ax, width=13, height=max(5.5, 3 + 0.09 * BK))
    XK, XS, XD, XQ = 0, 18, 18 + BQ + 14, 18 + 2 * BQ + 26  # key block, S^T, dS^T in shared memory, dQ_i
    small = dict(ha="center", va="center", fontsize=7)
    for w in range(warps):
        color, y = WARP_COLORS[w], 16 * w
        ax.add_patch(plt.Rectangle((XK, y), 10, 16, facecolor=color, edgecolor="white", lw=1, gid=f"keys {w}"))
        ax.text(XK + 5, y + 8, f"warp {w}\nkeys\n{16 * w}-{16 * w + 15}", color=text_color_on(color), **small)
        ax.add_patch(plt.Rectangle((XS, y), BQ, 16, facecolor=color, alpha=0.45, edgecolor="white", lw=1,
                                   gid=f"S^T {w}"))
        ax.add_patch(plt.Rectangle((XD, y), BQ, 16, facecolor=color, alpha=0.2, edgecolor="white", lw=1,
                                   gid=f"dS^T {w}"))
        ax.text(XS + BQ / 2, y + 8, f"warp {w}" + (": C fragments" if BQ >= 32 else ""), **small)
    for x in range(8, BQ, 8):  # n-tiles of 8 queries
        ax.plot([XS + x, XS + x], [0, BK], color="white", lw=0.6, ls="--")
    ax.add_patch(plt.Rectangle((XS, -9), BQ, 5, facecolor="#dddddd", edgecolor="black", lw=0.5))
    ax.text(XS + BQ / 2, -6.5, f"Qᵢ, dOᵢ: {BQ} queries (shared memory)", **small)
    for x0 in (XS, XD):  # query's row of dS = one column of dS^T, 16 values in every warp's band
        ax.add_patch(plt.Rectangle((x0 + query, 0), 1, BK, fill=False, edgecolor="black", lw=1.6,
                                   gid="query column"))
    ax.add_patch(plt.Rectangle((XQ, 0), 16, BQ, facecolor="#eeeeee", edgecolor="black", lw=0.5, gid="dQ"))
    ax.add_patch(plt.Rectangle((XQ, query), 16, 1, fill=False, edgecolor="black", lw=1.6, gid="query row"))
    ax.text(XQ + 8, (query + 1 + BQ) / 2 if query < BQ / 2 else query / 2, "dQᵢ\n(rows =\nqueries)", **small)
    ax.text(XK + 5, -1, "Kⱼ, Vⱼ in;\ndKⱼ, dVⱼ in\nregisters", ha="center", va="bottom", fontsize=7)
    arrow = dict(arrowstyle="->", lw=1, color="#333333")
    ax.annotate("", (XS - 0.5, BK / 2), (XK + 10.5, BK / 2), arrowprops=arrow)
    ax.text((XK + 10 + XS) / 2, BK / 2 - 1, "A: K, V", ha="center", va="bottom", fontsize=7)
    ax.annotate("", (XS + BQ / 2, -0.5), (XS + BQ / 2, -3.5), arrowprops=arrow)
    ax.text(XS + BQ / 2 + 1, -2, "B: Q, dO", ha="left", va="center", fontsize=7)
    ax.annotate("", (XK + 5, BK + 0.5), (XS + BQ / 2, BK + 0.5),
                arrowprops=dict(arrow, connectionstyle="arc3,rad=-0.25"))
    ax.text((XK + XS + BQ) / 2 - 2, BK + 6.5, "dV += Pᵀ dO, dK += dSᵀ Q: A straight from the C fragments;\n"
            "dK, dV stay in each warp's registers", ha="center", va="top", fontsize=7)
    ax.annotate("", (XD - 0.5, BK / 2), (XS + BQ + 0.5, BK / 2), arrowprops=arrow)
    ax.text((XS + BQ + XD) / 2, BK / 2 - 1, "store,\nsync", ha="center", va="bottom", fontsize=7)
    ax.annotate("", (XQ - 0.5, BQ / 2), (XD + BQ + 0.5, BQ / 2), arrowprops=arrow)
    ax.text((XD + BQ + XQ) / 2, BQ / 2 - 1, "A = dS:\nldmatrix\n.trans", ha="center", va="bottom", fontsize=7)
    ax.text(XS + BQ / 2 - 1, -2, "Sᵀ, dPᵀ → Pᵀ, dSᵀ", ha="right", va="center", fontsize=7)
    ax.text(XD + BQ / 2, -1, "dSᵀ in shared memory\n(16-bit pairs)", ha="center", va="bottom", fontsize=7)
    ax.text(XQ + 8, BQ + 1, "warps split it:\n+= dS K, then\natomicAdd to\ndq_accum", ha="center", va="top",
            fontsize=7)
    ax.text(XQ + 8, -1, f"query {query}", ha="center", va="bottom", fontsize=7)
    ax.set_xlim(XK - 1, XQ + 17)
    ax.set_ylim(BK + 10, -11)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"One block of the tensor backward: block_k = {BK} keys, {warps} warps of 16 keys, a tile of "
                 f"{BQ} queries\n(outlined: query {query}'s row of dS, a column of dSᵀ that crosses every warp)",
                 fontsize=9)
    return fig


def ds_sources() -> np.ndarray:
    """(32, 8, 3): for element i of lane L's A fragment of dS (16 queries x 16 keys, m16n8k16), the
    (n-tile, lane, c index) of the C fragments of dS^T (16 keys x 16 queries, two m16n8 n-tiles) holding it:
    where the tensor backward's dQ += dS K finds each value of its A operand (lesson 17)."""
    A = F.fragment_map("m16n8k16", "A", "float16")  # (query, key) per (lane, i)
    C = F.fragment_map("m16n8k16", "C", "float16")  # (key, query % 8) per (lane, c)
    where = {(int(r), int(c)): (L, i) for L in range(32) for i, (r, c) in enumerate(C[L])}
    out = np.zeros((32, 8, 3), np.int64)
    for L in range(32):
        for i, (query, key) in enumerate(A[L]):
            out[L, i] = (query // 8, *where[(int(key), int(query % 8))])
    return out


def plot_ds_transpose(lane=5, axes=None):
    """Left: dS^T as each warp holds it after the backward's products (C fragments: rows = the warp's 16
    keys, two 8-query n-tiles); right: dS as dQ += dS K needs it (A fragment: rows = queries). Colour = the
    lane holding the cell; `lane`'s eight A values are outlined on the right and their sources on the left."""
    if axes is None:
        fig, axes = subplots(1, 2, width=13, height=6.4)
    fig = axes[0].figure
    src = ds_sources()[lane]
    ax = axes[0]
    for n in range(2):
        def names(L, i, n=n):
            return f"c{i}" + ("'" if n else "")
        _draw_operand(ax, 8 * n + 0.3 * n, 0, "m16n8k16", "C", "float16", col_offset=8 * n, names=names,
                      label=f"dSᵀ, n-tile {n}: queries {8 * n}-{8 * n + 7}", row_labels=n == 0)
    C = F.fragment_map("m16n8k16", "C", "float16")
    for n, L, c in src:
        r, col = C[L, c]
        ax.add_patch(plt.Rectangle((8 * n + 0.3 * n + col, r), 1, 1, fill=False, edgecolor="black", lw=2.2))
    ax.set_xlim(-1.2, 16.6)
    ax.set_ylim(17.5, -1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"dSᵀ (rows = keys) as C fragments; outlined: where lane {lane}'s values are", fontsize=9)
    ax = axes[1]
    _draw_operand(ax, 0, 0, "m16n8k16", "A", "float16", lane=lane, label="dS as the A operand of dQ += dS K")
    ax.set_xlim(-1.2, 16.3)
    ax.set_ylim(17.5, -1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    moved = int((src[:, 1] != lane).sum())
    ax.set_title(f"dS (rows = queries): lane {lane} needs {moved} of its 8 values from other lanes", fontsize=9)
    fig.tight_layout()
    return fig


def plot_ldmatrix(axes=None):
    """One 8 x 8 block of 16-bit values in shared memory (rows = keys, as K and V are stored) and the two
    values lane 5 receives: ldmatrix gives a lane two neighbours of one row (what K's B fragment needs),
    ldmatrix.trans two neighbours of one column (what V's B fragment needs)."""
    if axes is None:
        fig, axes = subplots(1, 2, width=10, height=5)
    fig = axes[0].figure
    C = F.fragment_map("m16n8k16", "C")[:, :2]  # rows g, columns 2t, 2t+1: how ldmatrix deals one 8x8 matrix
    for ax, trans in zip(axes, (False, True)):
        for L in range(32):
            for r, c in C[L]:
                rr, cc = (c, r) if trans else (r, c)
                color = lane_color(L)
                ax.add_patch(plt.Rectangle((cc, rr), 1, 1, facecolor=color, alpha=1 if L == 5 else 0.35,
                                           edgecolor="black" if L == 5 else "white", lw=1.2 if L == 5 else 0.6))
                ax.text(cc + 0.5, rr + 0.5, str(L), ha="center", va="center", fontsize=7,
                        color=text_color_on(color) if L == 5 else "#555555")
        ax.set_xlim(-0.2, 8.2)
        ax.set_ylim(8.3, -0.3)
        ax.set_aspect("equal")
        ax.set_xticks(np.arange(8) + 0.5, range(8), fontsize=7)
        ax.set_yticks(np.arange(8) + 0.5, range(8), fontsize=7)
        ax.set_xlabel("dims (consecutive in memory: one 32-bit word = 2 values)", fontsize=8)
        ax.set_ylabel("keys (rows of K or V in shared memory)", fontsize=8)
        ax.set_title(("ldmatrix.trans: lane 5 gets keys 2t, 2t+1 of dim g\n(V in O += P V: B[key, dim])" if trans
                      else "ldmatrix: lane 5 gets dims 2t, 2t+1 of key g\n(K in S = Q Kᵀ: B[dim, key])"), fontsize=9)
    fig.tight_layout()
    return fig


def plot_quad_reduction(values=(3.0, 7.0, 1.0, 5.0), ax=None):
    """The max of one row of S, whose 8-key n-tile sits in the 4 lanes of a quad (2 values each): each lane
    takes the max of its own values, then two butterfly exchanges, shfl_xor 1 and shfl_xor 2."""
    fig, ax = own_axes(ax, width=6, height=2.8)
    vals = [np.asarray(values, float)]
    for mask in (1, 2):
        v = vals[-1]
        vals.append(np.maximum(v, v[np.arange(4) ^ mask]))
    for step, v in enumerate(vals):
        y = -1.3 * step
        for lane in range(4):
            ax.add_patch(plt.Rectangle((1.6 * lane, y), 1.1, 0.7, facecolor=lane_color(lane), edgecolor="black",
                                       lw=0.5))
            ax.text(1.6 * lane + 0.55, y + 0.35, f"{v[lane]:g}", ha="center", va="center", fontsize=9,
                    color=text_color_on(lane_color(lane)))
            if step < 2:
                other = lane ^ (1 << step)
                ax.annotate("", (1.6 * lane + 0.55, y - 0.55), (1.6 * other + 0.55, y),
                            arrowprops=dict(arrowstyle="->", lw=0.7, color="#555555"))
        ax.text(-0.3, y + 0.35, ("own max", "shfl_xor 1", "shfl_xor 2")[step], ha="right", va="center", fontsize=8)
    for lane in range(4):
        ax.text(1.6 * lane + 0.55, 1.0, f"lane t={lane}", ha="center", fontsize=8)
    ax.set_xlim(-2.6, 6.3)
    ax.set_ylim(-3.0, 1.4)
    ax.axis("off")
    ax.set_title("A row's max over its quad: two exchanges, and all 4 lanes agree", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------- formats
def _kstep_product(A, B, k_step):
    """A @ B as a chain of mma: each k-step's products summed exactly, added to an fp32 accumulator."""
    acc = np.zeros((A.shape[0], B.shape[1]), np.float32)
    for k0 in range(0, A.shape[1], k_step):
        acc = (acc.astype(np.float64) + A[:, k0:k0 + k_step] @ B[k0:k0 + k_step]).astype(np.float32)
    return acc


def _truncate(x, exponent, bits=24):
    """x (float64) cut toward zero to a multiple of 2**(exponent - bits + 1): the bits below a `bits`-bit
    significand whose leading bit has weight 2**exponent."""
    q = np.ldexp(1.0, exponent - bits + 1)
    return np.trunc(x / q) * q


def _tc_add(acc, terms):
    """acc + sum(terms) as a tensor core forms it (Fasi et al. 2021): the products are exact, every term is aligned
    to the largest one and truncated to fp32's 24 bits there (no guard bits), the aligned terms are added, and
    the sum is truncated to fp32. acc: (m, n); terms: (m, k, n), float64."""
    allterms = np.concatenate([acc[:, None, :], terms], axis=1)
    big = np.abs(allterms).max(axis=1)
    with np.errstate(divide="ignore"):
        emax = np.where(big > 0, np.floor(np.log2(np.where(big > 0, big, 1.0))), 0).astype(int)
    total = _truncate(allterms, emax[:, None, :]).sum(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(total != 0, np.floor(np.log2(np.where(total != 0, np.abs(total), 1.0))), 0).astype(int)
    return _truncate(total, e)


def _tc_chain(A, Bs, k_step, restart=None):
    """sum_i A_i @ B_i (pairs of float64 tf32 parts, k-steps of k_step) on a truncating tensor-core accumulator.
    restart: every `restart` columns of k the chain starts from zero and its sum is added to an fp32 accumulator
    with a round-to-nearest fp32 add (the kernel's way for long sums); None: one chain over all of k."""
    n_k = A[0].shape[1]
    out = np.zeros((A[0].shape[0], Bs[0].shape[1]), np.float32)
    block = restart or n_k
    for b0 in range(0, n_k, block):
        acc = np.zeros(out.shape)
        for k0 in range(b0, min(b0 + block, n_k), k_step):
            s = slice(k0, min(k0 + k_step, b0 + block))
            for a, b in zip(A, Bs):  # one mma per pair, in order, into the same accumulator
                acc = _tc_add(acc, a[:, s, None] * b[None, s, :])
        out = (out.astype(np.float64) + acc).astype(np.float32)
    return out


def tensor_product(A, B, fmt):
    """A @ B for float32 inputs as a tensor-core kernel computes it in format `fmt`:
    "fp16" / "bf16" (inputs rounded, mma.m16n8k16), "tf32" (rounded by cvt.rna, m16n8k8), "3xtf32" (big*big
    in one chain, big*small + small*big in another, added in fp32, as kernels/tensor.py), or "fp32" (plain
    float32 arithmetic, NumPy). These add each k-step to the accumulator as an fp32 add does (round to nearest).
    Two more follow a tensor core's own truncating accumulation (Fasi et al. 2021; the small products issued
    before the big one, in one accumulator): "3xtf32 tc" sums all of k in the tensor core; "3xtf32 tc, fp32
    adds" sums 64 columns of k at a time in it, from zero, and adds each sum to an fp32 accumulator."""
    A, B = np.asarray(A, np.float32), np.asarray(B, np.float32)
    f64 = np.float64
    if fmt == "fp32":
        return A @ B
    if fmt in ("fp16", "bf16"):
        r = F.round_f16 if fmt == "fp16" else F.round_bf16
        return _kstep_product(r(A).astype(f64), r(B).astype(f64), 16)
    if fmt == "tf32":
        return _kstep_product(F.round_tf32(A).astype(f64), F.round_tf32(B).astype(f64), 8)
    if fmt in ("3xtf32", "3xtf32 tc", "3xtf32 tc, fp32 adds"):
        (Ab, As), (Bb, Bs) = (tuple(x.astype(f64) for x in F.split_tf32(M)) for M in (A, B))
        if fmt != "3xtf32":
            return _tc_chain((As, Ab, Ab), (Bb, Bs, Bb), 8, restart=64 if fmt.endswith("adds") else None)
        big = _kstep_product(Ab, Bb, 8)
        acc = np.zeros_like(big)
        for k0 in range(0, A.shape[1], 8):  # the correction chain: two mma per k-step into one accumulator
            s = slice(k0, k0 + 8)
            acc = (acc.astype(f64) + As[:, s] @ Bb[s]).astype(np.float32)
            acc = (acc.astype(f64) + Ab[:, s] @ Bs[s]).astype(np.float32)
        return big + acc
    raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}")


FORMATS = ("bf16", "fp16", "tf32", "3xtf32", "3xtf32 tc", "3xtf32 tc, fp32 adds", "fp32")
FORMAT_COLORS = {"bf16": "#9467bd", "fp16": "#d62728", "tf32": "#ff7f0e", "3xtf32": "#2ca02c", "3xtf32 tc": "#8c564b",
                 "3xtf32 tc, fp32 adds": "#17becf", "fp32": "#1f77b4"}


def format_errors(sizes=(16, 64, 256, 1024, 4096), scales=(1e-6, 1e-3, 1, 1e3, 1e6), m=64, k_scale=256,
                  trials=2, seed=0):
    """Relative errors ||C - C64|| / ||C64|| of C = A @ B (A: m x K, B: K x m, N(0, 1) entries) in each
    format: {"size": {fmt: [error for K in sizes]}, "scale": {fmt: [error with entries times s, K = k_scale]}}.
    An overflow (inf) is reported as inf."""
    rng = np.random.default_rng(seed)
    out = {"sizes": list(sizes), "scales": list(scales), "size": {f: [] for f in FORMATS},
           "scale": {f: [] for f in FORMATS}}

    def err(A, B, fmt):
        ref = A.astype(np.float64) @ B.astype(np.float64)
        with np.errstate(all="ignore"):
            got = tensor_product(A, B, fmt).astype(np.float64)
            if not np.all(np.isfinite(got)):
                return np.inf
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    for K in sizes:
        pairs = [(rng.standard_normal((m, K)).astype(np.float32), rng.standard_normal((K, m)).astype(np.float32))
                 for _ in range(trials)]
        for f in FORMATS:
            out["size"][f].append(float(np.mean([err(A, B, f) for A, B in pairs])))
    A, B = rng.standard_normal((m, k_scale)).astype(np.float32), rng.standard_normal((k_scale, m)).astype(np.float32)
    for s in scales:
        As, Bs = (A * np.float32(s)).astype(np.float32), (B * np.float32(s)).astype(np.float32)
        for f in FORMATS:
            out["scale"][f].append(err(As, Bs, f))
    return out


def plot_format_errors(errors, axes=None):
    """Left: error against the inner dimension K; right: against the size of the entries (fp16's range)."""
    if axes is None:
        fig, axes = subplots(1, 2, width=11, height=3.8)
    fig = axes[0].figure
    label = {"bf16": "bf16 (8 significand bits)", "fp16": "fp16 (11 bits)", "tf32": "1xTF32 (11 bits, fp32's range)",
             "3xtf32": "3xTF32 (big + small: about 21), fp32-style sums",
             "3xtf32 tc": "3xTF32, all of K in a truncating tensor-core sum",
             "3xtf32 tc, fp32 adds": "3xTF32, tensor-core sums of 64, added in fp32",
             "fp32": "fp32 FMA units (24; NumPy float32)"}
    for key, ax, xs, xlabel in (("size", axes[0], errors["sizes"], "inner dimension K (m = 64)"),
                                ("scale", axes[1], errors["scales"], "entries scaled by (K = 256)")):
        top = max(e for f in FORMATS for e in errors[key][f] if np.isfinite(e)) * 30
        for f in FORMATS:
            ys = np.array(errors[key][f], float)
            shown = np.where(np.isfinite(ys), ys, top)
            ax.plot(xs, shown, "o-", color=FORMAT_COLORS[f], label=label[f], ms=4)
            bad = ~np.isfinite(ys)
            if bad.any():
                ax.plot(np.array(xs)[bad], shown[bad], "x", color=FORMAT_COLORS[f], ms=10, mew=2,
                        label=f"{f}: overflow (inf)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("relative error vs float64")
        ax.grid(True, alpha=0.3)
    handles = [h for h in axes[1].get_legend_handles_labels()[0] if "overflow" in h.get_label()]
    if handles:
        axes[1].legend(handles=handles, fontsize=7, loc="center right")
    axes[0].legend(fontsize=7)
    axes[0].set_title("C = A B: rounding the inputs sets the error", fontsize=9)
    axes[1].set_title("Tiny or huge entries: fp16 loses them, tf32 keeps fp32's range", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------- kernel
def plot_double_buffer(n_tiles=4, ax=None):
    """Two shared-memory stages: tile j + 1 travels (cp.async) while the warps compute on tile j."""
    fig, ax = own_axes(ax, width=8, height=2.2)
    for j in range(n_tiles):
        ax.add_patch(plt.Rectangle((j, 1.1), 0.95, 0.7, facecolor="#aec7e8" if j % 2 == 0 else "#ffbb78",
                                   edgecolor="black", lw=0.5))
        ax.text(j + 0.47, 1.45, f"copy K,V tile {j}\n-> stage {j % 2}", ha="center", va="center", fontsize=7)
        ax.add_patch(plt.Rectangle((j + 1, 0.1), 0.95, 0.7, facecolor="#1f77b4" if j % 2 == 0 else "#ff7f0e",
                                   edgecolor="black", lw=0.5))
        ax.text(j + 1.47, 0.45, f"compute tile {j}\n(stage {j % 2})", ha="center", va="center", fontsize=7,
                color="white")
    ax.text(-0.1, 1.45, "cp.async", ha="right", va="center", fontsize=8)
    ax.text(-0.1, 0.45, "mma + softmax", ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.3, n_tiles + 1.1)
    ax.set_ylim(0, 2.1)
    ax.axis("off")
    ax.set_title("Double buffering: the copy of the next tile overlaps the work on this one", fontsize=9)
    return fig


def _read(path):
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = int(v) if k in ("N", "d", "causal") else float(v) if k not in ("impl", "dtype", "gpu",
                                                                                     "instruction", "operands",
                                                                                     "date") else v
            except ValueError:
                pass
    return rows


def mma_ceiling_file() -> Path:
    """The ceiling file the lessons read: flashlab/data/mma_ceiling.csv, else the older h100_mma_ceiling.csv."""
    return MMA_CSV if MMA_CSV.exists() else H100_MMA_CSV


def mma_ceiling_rows(path=None) -> list:
    """The rows of a ceiling file, each with its "operands" ("random" or CONSTANT_OPERANDS: a file without
    that column was measured on constant operands) and "date" ("" where the file has none)."""
    rows = _read(path or mma_ceiling_file())
    for r in rows:
        r["operands"] = r.get("operands") or CONSTANT_OPERANDS
        r["date"] = r.get("date") or ""
    return rows


def load_mma_ceiling(path=None, operands=None) -> dict:
    """{instruction: TFLOP/s} of one benchmarks/timing/mma_ceiling.py run ({} without the file), for one kind of
    operands: "random" where the file has them (else what it has), or CONSTANT_OPERANDS. The keys of
    CEILING_META say where it comes from: "gpu", "operands", "date", and the median "sm_clock_mhz" and
    "power_w" of the fp16 m16n8k16 measurement ("" where not recorded)."""
    rows = mma_ceiling_rows(path)
    kinds = [r["operands"] for r in rows]
    operands = operands or ("random" if "random" in kinds else kinds[0] if kinds else None)
    sel = [r for r in rows if r["operands"] == operands]
    out = {r["instruction"]: r["tflops"] for r in sel}
    if sel:
        fp16 = next((r for r in sel if r["instruction"] == "fp16 m16n8k16"), sel[0])
        out.update(gpu=sel[0]["gpu"], operands=operands, date=sel[0]["date"],
                   sm_clock_mhz=fp16.get("sm_clock_mhz", ""), power_w=fp16.get("power_w", ""))
    return out


def load_tensor_results(path=None) -> list:
    """Rows of flashlab/data/h100_tensor.csv (N, d, causal, dtype, impl, ms, tflops, torch_tflops,
    ratio) with numbers converted; [] without the file."""
    return _read(path or TENSOR_CSV)


# the mma instruction each kernel precision is made of (names as benchmarks/timing/mma_ceiling.py writes them)
CEILING_OF = {"flashlab tensor f16": "fp16 m16n8k16", "flashlab tensor bf16": "bf16 m16n8k16",
              "flashlab tensor tf32": "tf32 m16n8k8", "flashlab tensor 3xtf32": "3xTF32 (3 tf32 mma per product)"}
IMPL_COLORS = {"flashlab tensor f16": "#d62728", "flashlab tensor bf16": "#9467bd", "flashlab tensor tf32": "#ff7f0e",
               "flashlab tensor 3xtf32": "#2ca02c", "flashlab register": "#1f77b4"}


def _no_data(ax, what):
    ax.text(0.5, 0.5, f"no {what}: run it from a clone of the repository\n(benchmarks/results/h100/)",
            ha="center", va="center", transform=ax.transAxes, fontsize=9)
    ax.axis("off")


def plot_mma_ceiling(ceiling: dict, fp32_peak=None, fp16_datasheet=None, ax=None):
    """Bars: what one SM-full of mma.sync chains reaches from Numba (measured), next to the FP32 units'
    datasheet peak and the datasheet's dense FP16 tensor-core peak."""
    fig, ax = own_axes(ax, width=7, height=3.0)
    names = [k for k in ceiling if k not in CEILING_META]
    if not names:
        _no_data(ax, "mma ceiling data")
        return fig
    bars = [(n, ceiling[n], "#2ca02c") for n in names]
    if fp32_peak:
        bars.append(("FP32 units (FFMA), datasheet", fp32_peak / 1e12, "#1f77b4"))
    if fp16_datasheet:
        bars.append(("dense FP16 tensor cores, datasheet", fp16_datasheet / 1e12, "#7f7f7f"))
    bars.sort(key=lambda b: b[1])
    y = np.arange(len(bars))
    ax.barh(y, [b[1] for b in bars], color=[b[2] for b in bars])
    for yi, (_, v, _) in zip(y, bars):
        ax.text(v, yi, f" {v:.0f}", va="center", fontsize=8)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=8)
    ax.set_xlabel("TFLOP/s")
    ax.set_xlim(0, max(b[1] for b in bars) * 1.15)
    ax.set_title(f"mma.sync from a Numba kernel (green: measured on {ceiling.get('gpu', '?')}, "
                 f"{ceiling.get('operands', '?')} operands)", fontsize=9)
    return fig


def plot_tensor_speed(rows, d=64, causal=0, ax=None):
    """TFLOP/s against N of the tensor kernel in each precision and of the register kernel (solid), and of
    torch SDPA in the same dtype (dashed: float16, bfloat16 and float32)."""
    fig, ax = own_axes(ax, width=6.5, height=4)
    sel = [r for r in rows if r["d"] == d and r["causal"] == causal]
    if not sel:
        _no_data(ax, f"tensor benchmark at d = {d}")
        return fig
    for impl in IMPL_COLORS:
        pts = sorted((r["N"], r["tflops"]) for r in sel if r["impl"] == impl)
        if pts:
            ax.plot(*zip(*pts), "o-", color=IMPL_COLORS[impl], label=impl.replace("flashlab ", ""))
    sdpa = {}
    for r in sel:
        sdpa.setdefault(r["dtype"], {})[r["N"]] = r["torch_tflops"]
    for dtype, style in (("float16", "#d62728"), ("bfloat16", "#9467bd"), ("float32", "#2ca02c")):
        if dtype in sdpa:
            pts = sorted(sdpa[dtype].items())
            ax.plot(*zip(*pts), "s--", color=style, alpha=0.6, ms=4, label=f"torch SDPA {dtype}")
    ax.set_xscale("log", base=2)
    ns = sorted({r["N"] for r in sel})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("N (B = 1, H = 16)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"Forward, d = {d}" + (", causal" if causal else ""), fontsize=9)
    return fig


def ceiling_shares(rows, ceiling, N=None, d=64, causal=0) -> dict:
    """{impl: TFLOP/s of the tensor kernel / the ceiling of the mma it is made of} at (N, d), N = the
    largest benchmarked by default."""
    sel = [r for r in rows if r["d"] == d and r["causal"] == causal and r["impl"] in CEILING_OF]
    if not sel or not ceiling:
        return {}
    N = N or max(r["N"] for r in sel)
    return {r["impl"]: r["tflops"] / ceiling[CEILING_OF[r["impl"]]] for r in sel
            if r["N"] == N and CEILING_OF[r["impl"]] in ceiling}


def plot_ceiling_shares(rows, ceiling, ds=(64, 128), ax=None):
    """Bars: the tensor kernel's share of its mma ceiling (largest N, not causal), per precision and d."""
    fig, ax = own_axes(ax, width=6, height=3)
    if not rows or not ceiling:
        _no_data(ax, "tensor benchmark or mma ceiling data")
        return fig
    impls = list(CEILING_OF)
    w = 0.8 / len(ds)
    for j, d in enumerate(ds):
        share = ceiling_shares(rows, ceiling, d=d)
        xs = np.arange(len(impls)) + (j - (len(ds) - 1) / 2) * w
        vals = [share.get(i, np.nan) for i in impls]
        ax.bar(xs, vals, w * 0.9, label=f"d = {d}", color=("#4c72b0", "#dd8452", "#55a868")[j % 3])
        for x, v in zip(xs, vals):
            if np.isfinite(v):
                ax.text(x, v, f"{v:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(impls)), [i.replace("flashlab tensor ", "") for i in impls])
    ax.set_ylabel("kernel TFLOP/s / mma ceiling")
    ax.set_ylim(0, 1.05)
    ax.axhline(1, color="#999999", lw=0.6)
    ax.legend(fontsize=8)
    N = max(r["N"] for r in rows)
    ax.set_title(f"Share of the mma.sync ceiling (N = {N}, not causal)", fontsize=9)
    return fig


def mma_roofs(ceiling: dict, bandwidth=None, names=("fp16 m16n8k16", "3xTF32 (3 tf32 mma per product)")):
    """flashlab.roofline.Machine roofs from the measured mma ceilings (for plot_kernel_roofline)."""
    from ..roofline import PUBLISHED, Machine

    bw = bandwidth or PUBLISHED["H100"].bandwidth
    return [Machine(f"mma.sync {n.split(' (')[0]} from Numba (measured)", ceiling[n] * 1e12, bw,
                    "benchmarks/timing/mma_ceiling.py") for n in names if n in ceiling]


def tensor_roofline_points(rows, N=4096, d=64, causal=0,
                           impls=("flashlab tensor f16", "flashlab tensor 3xtf32")) -> dict:
    """{label: (FLOPs per HBM byte, FLOP/s)} of the tensor kernel's measured runs at (N, d) for a roofline:
    the intensity of a FA2 forward with the kernel's default block_q (kernels/tensor.choose_tile) and the
    inputs' element size (2 bytes for 16-bit, 4 for float32)."""
    from ..kernels.tensor import choose_tile
    from .gpu import kernel_intensity

    points = {}
    for r in rows:
        if (r["N"], r["d"], r["causal"]) != (N, d, causal) or r["impl"] not in impls:
            continue
        precision = r["impl"].split()[-1]
        block_q = choose_tile(d, precision).block_q
        size = 4 if r["dtype"] == "float32" else 2
        points[r["impl"]] = (kernel_intensity(N, d, block_q, bytes_per_element=size, causal=bool(causal)),
                             r["tflops"] * 1e12)
    return points


BACKWARD_JSON = DATA / "tensor_backward.json"


def load_backward_results(path=None) -> dict | None:
    """flashlab/data/tensor_backward.json (benchmarks/check_tensor_backward_gpu.sh bench): the tensor backward against torch
    SDPA's backward in the same dtype and run; None without the file."""
    import json

    path = Path(path or BACKWARD_JSON)
    return json.loads(path.read_text()) if path.exists() else None


def plot_backward_speed(data: dict, n: int = 4096, ax=None):
    """Bars: the tensor backward's speed as a share of SDPA's backward, per dtype and d, causal or not, at N=n."""
    ax = ax or plt.subplots(figsize=(9, 3.8))[1]
    rows = sorted((r for r in data["rows"] if r["n"] == n), key=lambda r: (r["d"], r["causal"], r["dtype"]))
    dtypes = sorted({r["dtype"] for r in rows}, key=["float16", "bfloat16", "float32"].index)
    groups = sorted({(r["d"], r["causal"]) for r in rows})
    width = 0.8 / len(dtypes)
    for i, dt in enumerate(dtypes):
        shares = {(r["d"], r["causal"]): r["vs_sdpa"] for r in rows if r["dtype"] == dt}
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [100 * shares.get(g, np.nan) for g in groups], width, label=dt + (" (3xTF32)" if dt == "float32"
                                                                                   else ""))
    ax.axhline(100, color="k", lw=0.8, ls="--")
    ax.set_xticks([g + width * (len(dtypes) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"d={d}" + (" causal" if c else "") for d, c in groups])
    ax.set_ylabel("% of torch SDPA's backward")
    ax.set_title(f"tensor-core backward, B1 H16 N{n}, {data['gpu']}")
    ax.legend(fontsize=8)
    return ax


# ------------------------------------------------------------------------------------------ mix
# SASS opcodes by what they do for the kernel (anything else counts as "other")
OPCODE_GROUPS = {
    "tensor cores (HMMA)": ("HMMA",),
    "softmax arithmetic": ("FMNMX", "FMUL", "FADD", "FFMA", "MUFU", "F2FP", "SHFL", "FSETP", "VOTE"),
    "shared-memory loads, copies and their barriers": ("LDSM", "LDS", "LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR"),
    "integer: addresses, indices, compares": ("IMAD", "IADD3", "LEA", "MOV", "SHF", "SEL", "ISETP", "LOP3", "IABS",
                                               "VIADD", "UMOV", "ULEA", "UIADD3", "UIMAD", "USHF", "S2UR", "CS2R"),
}


def load_sass_mix(path=None) -> dict | None:
    """flashlab/data/h100_sass_mix.json: the tensor forward's loop body, {label: {opcode: count}} under
    "loop_body", with the GPU and kernel it was measured on; None without the file."""
    import json

    path = Path(path or SASS_MIX_JSON)
    return json.loads(path.read_text()) if path.exists() else None


def instruction_groups(counts: dict) -> dict:
    """{group: instructions} of one loop body's {opcode: count}, in OPCODE_GROUPS's order, then "other"."""
    out = {name: 0 for name in OPCODE_GROUPS}
    out["other"] = 0
    for op, n in counts.items():
        group = next((name for name, ops in OPCODE_GROUPS.items() if op in ops), "other")
        out[group] += int(n)
    return out


def plot_instruction_mix(data: dict, ax=None):
    """Stacked bars: the instructions of one loop iteration (one warp, one key tile) by group, one bar per build,
    named by data["labels"]."""
    fig, ax = own_axes(ax, width=8, height=2.8)
    if not data:
        _no_data(ax, "instruction counts")
        return ax
    labels = list(data["loop_body"])
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#7f7f7f", "#c7c7c7"]
    left = np.zeros(len(labels))
    for (name, color) in zip(list(OPCODE_GROUPS) + ["other"], colors):
        widths = np.array([instruction_groups(data["loop_body"][lb])[name] for lb in labels], float)
        ax.barh([data.get("labels", {}).get(lb, lb) for lb in labels], widths, left=left, color=color, label=name)
        for y, (x0, w) in enumerate(zip(left, widths)):
            if w >= 30:
                ax.text(x0 + w / 2, y, f"{int(w)}", ha="center", va="center", fontsize=8,
                        color=text_color_on(plt.matplotlib.colors.to_rgba(color)))
        left += widths
    for y, total in enumerate(left):
        ax.text(total + 8, y, f"{int(total)} in all", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.18)
    ax.set_xlabel("SASS instructions per warp and key tile (the loop body, averaged over tiles)")
    ax.set_title(f"{data['kernel']}\n{data['gpu']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=3, frameon=False)
    return ax


# ------------------------------------------------------------------------------------------ rescale
def max_growth(S, rows: int = 16, block_k: int = 64, threshold: float = 0.0) -> np.ndarray:
    """grew[i, j]: does m-tile i (rows i*rows .. i*rows + rows - 1 of the scores S, (Nq, Nk)) rescale O at key tile
    j? Tile 0 always does (the max starts at -inf). With threshold = 0 a row rescales whenever its running max
    grows (the tensor forward's warp vote); with threshold > 0 it keeps the max it last rescaled with until a
    tile's max exceeds that by more than `threshold` (in S's units), as FlashAttention-4's conditional rescaling
    does (8 in log2 units for 16-bit inputs). Nq must be a multiple of rows."""
    S = np.asarray(S)
    n_q, n_k = S.shape
    if n_q % rows:
        raise ValueError(f"S has {n_q} rows; expected a multiple of rows={rows}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0; got {threshold}")
    n_tiles = -(-n_k // block_k)
    padded = np.full((n_q, n_tiles * block_k), -np.inf, dtype=np.result_type(S.dtype, np.float32))
    padded[:, :n_k] = S
    tile_max = padded.reshape(n_q, n_tiles, block_k).max(axis=2)
    grew = np.zeros((n_q, n_tiles), dtype=bool)
    grew[:, 0] = True
    kept = tile_max[:, 0].copy()  # the max O, l and P are scaled with
    for j in range(1, n_tiles):
        grew[:, j] = tile_max[:, j] - kept > threshold
        kept = np.where(grew[:, j], np.maximum(kept, tile_max[:, j]), kept)
    return grew.reshape(n_q // rows, rows, n_tiles).any(axis=1)


def stale_max_output(S, V, block_k: int = 64, threshold: float = 0.0):
    """(O, largest P) of an online softmax over key tiles of block_k that rescales a row only when a tile's max
    exceeds the max it uses by more than `threshold` (max_growth's rule, row by row). O = P V / l with P, l and
    the division all taken against the same (possibly stale) max, so O is exact; P can reach exp(threshold)."""
    S, V = np.asarray(S, np.float64), np.asarray(V, np.float64)
    n_q, n_k = S.shape
    m = np.full(n_q, -np.inf)
    acc, l, p_max = np.zeros((n_q, V.shape[1])), np.zeros(n_q), 0.0
    for j0 in range(0, n_k, block_k):
        s = S[:, j0:j0 + block_k]
        tile = s.max(axis=1)
        grow = ~np.isfinite(m) | (tile - m > threshold)
        new_m = np.where(grow, np.maximum(m, tile), m)
        alpha = np.where(np.isfinite(m), np.exp(m - new_m), 0.0)
        p = np.exp(s - new_m[:, None])
        p_max = max(p_max, p.max())
        acc = acc * alpha[:, None] + p @ V[j0:j0 + block_k]
        l = l * alpha + p.sum(axis=1)
        m = new_m
    return acc / l[:, None], p_max


def plot_max_growth(curves: dict, rows: int = 16, ax=None):
    """Share of m-tiles that rescale O at each key tile, one line per {label: grew} of max_growth, and the
    share for independent random scores: 1 - (1 - 1/(j+1))^rows (each row's max is in tile j with odds
    1/(j+1))."""
    fig, ax = own_axes(ax, width=7, height=3)
    n_tiles = 0
    for label, grew in curves.items():  # (the dashed line below is for threshold 0)
        ax.plot(np.arange(grew.shape[1]), grew.mean(axis=0), label=f"{label}: {grew.mean():.0%} of all", lw=1.5)
        n_tiles = max(n_tiles, grew.shape[1])
    j = np.arange(n_tiles)
    ax.plot(j, 1 - (1 - 1 / (j + 1)) ** rows, "k--", lw=1, label=f"1 - (1 - 1/(j+1))^{rows}: independent scores")
    ax.set_xlabel("key tile j")
    ax.set_ylabel("m-tiles that rescale O")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    return ax
