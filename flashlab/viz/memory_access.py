"""Lessons 07-08: one warp's accesses, drawn from the model in flashlab.memory_access.

    plot_sectors(addresses, nbytes)     global memory: the 128-byte lines a warp touches, their four
                                        32-byte sectors, and which lane reads which bytes
    plot_banks(words)                   shared memory as rows of 32 banks: which lane asks for which word,
                                        and the banks asked for several different words (conflicts)
    plot_access_grid(cases, kind)       several of either, side by side
    access_explorer()                   sliders: lanes per row, start offset, row length d, shared layout
                                        and row padding; the sectors and banks of the resulting accesses
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .. import memory_access as ma
from ._base import explore, own_axes, subplots

_LANES = plt.get_cmap("viridis")
_CONFLICT = "#d62728"


def _lane_color(lane):
    return _LANES(lane / (ma.WARP - 1))


def plot_sectors(addresses, nbytes=4, ax=None, title=None, max_lines=8):
    """The 128-byte lines one warp request touches (one row each), split in four 32-byte sectors; a
    lane's bytes are a coloured bar (colour = lane number), fetched sectors are shaded."""
    a = np.asarray(addresses, dtype=np.int64)
    cost = ma.coalescing(a, nbytes)
    secs = ma.sectors_touched(a, nbytes)
    lines = np.unique(secs // 4)
    shown = lines[:max_lines]
    fig, ax = own_axes(ax, width=4.2, height=0.42 * len(shown) + 1.3)
    for r, line in enumerate(shown):
        for s in range(4):
            hit = line * 4 + s in secs
            ax.add_patch(plt.Rectangle((s * ma.SECTOR, r), ma.SECTOR, 0.8, facecolor="#fde8c8" if hit else "white",
                                       edgecolor="#555555" if hit else "#cccccc", lw=0.8))
        for lane, addr in enumerate(a):
            if addr // ma.LINE == line:
                ax.add_patch(plt.Rectangle((addr % ma.LINE, r + 0.12 + 0.56 * (lane % 2) * 0.5), nbytes, 0.28,
                                           facecolor=_lane_color(lane), edgecolor="none"))
    if len(lines) > len(shown):
        ax.text(64, len(shown) + 0.35, f"... {len(lines) - len(shown)} more lines like these", ha="center",
                fontsize=7, va="center")
    ax.set_xlim(0, ma.LINE)
    ax.set_ylim(len(shown) + 0.8 * (len(lines) > len(shown)), -0.15)
    ax.set_xticks(range(0, ma.LINE + 1, ma.SECTOR))
    ax.set_yticks([r + 0.4 for r in range(len(shown))], [f"line {int(line)}" for line in shown], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("byte within a 128-byte line (boxes: 32-byte sectors)", fontsize=7)
    head = f"{title}\n" if title else ""
    ax.set_title(f"{head}{cost['sectors']} sectors: {cost['bytes_fetched']} B fetched for {cost['bytes_used']} B "
                 f"used ({cost['efficiency']:.0%})", fontsize=8)
    return fig


def plot_banks(words, ax=None, title=None, max_rows=40, labels=True):
    """Shared memory drawn as rows of 32 words, one column per bank: each lane's word is marked with
    its lane number (labels=False: colour only); banks asked for several different words (a conflict)
    are outlined in red, with the number of words."""
    w = np.asarray(words, dtype=np.int64)
    degree = ma.bank_conflict_degree(w)
    rows = np.unique(w // ma.BANKS)
    if rows[-1] - rows[0] < max_rows:  # draw the rows between as well, so the layout reads as memory
        rows = np.arange(rows[0], rows[-1] + 1)
    rows = rows[:max_rows]
    fig, ax = own_axes(ax, width=6.4, height=0.22 * len(rows) + 1.5)
    per_bank = np.array([len(b) for b in ma.bank_table(w)])
    image = np.ones((len(rows), ma.BANKS, 4))  # one pixel per word: white, or the colour of its first lane
    for r, row in enumerate(rows):
        for b in range(ma.BANKS):
            lanes = np.flatnonzero(w == row * ma.BANKS + b)
            if lanes.size:
                image[r, b] = _lane_color(lanes[0])
                if labels:
                    ax.text(b + 0.5, r + 0.5, str(lanes[0]) if lanes.size == 1 else f"{lanes.size}x", ha="center",
                            va="center", fontsize=5, color="white" if lanes[0] < 20 else "black")
    ax.imshow(image, extent=(0, ma.BANKS, len(rows), 0), aspect="auto", interpolation="nearest")
    ax.vlines(np.arange(ma.BANKS + 1), 0, len(rows), color="#dddddd", lw=0.4)  # cell borders: two collections
    ax.hlines(np.arange(len(rows) + 1), 0, ma.BANKS, color="#dddddd", lw=0.4)
    for b in range(ma.BANKS):
        if per_bank[b] > 1:
            ax.add_patch(plt.Rectangle((b, 0), 1, len(rows), fill=False, edgecolor=_CONFLICT, lw=1.2))
            if labels:
                ax.text(b + 0.5, -0.3, str(per_bank[b]), ha="center", va="bottom", fontsize=6, color=_CONFLICT)
    ax.set_xlim(0, ma.BANKS)
    ax.set_ylim(len(rows), -1.2)
    ax.set_xticks([0, 8, 16, 24, 31], [0, 8, 16, 24, 31], fontsize=7)
    step = max(1, len(rows) // 8)
    ax.set_yticks([r + 0.5 for r in range(0, len(rows), step)], [str(int(rows[r])) for r in range(0, len(rows), step)],
                  fontsize=6)
    ax.set_xlabel("bank (= word index mod 32)", fontsize=7)
    ax.set_ylabel("row (= word // 32)", fontsize=7)
    verdict = "conflict-free: 1 pass" if degree == 1 else f"{degree}-way conflict: {degree} passes"
    ax.set_title((f"{title}\n" if title else "") + verdict, fontsize=8, color=_CONFLICT if degree > 1 else "black")
    return fig


def plot_access_grid(cases: dict, kind="sectors", ncols=3, **kw):
    """A grid of plot_sectors ({label: (addresses, nbytes)}) or plot_banks ({label: words}) panels."""
    if kind not in ("sectors", "banks"):
        raise ValueError(f"kind must be 'sectors' or 'banks'; got {kind!r}")
    n = len(cases)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    height = (2.6 if kind == "sectors" else 3.4) * nrows
    fig, axes = subplots(nrows, ncols, width=min(4.4 * ncols, 13), height=height, squeeze=False)
    for a, (label, case) in zip(axes.ravel(), cases.items()):
        if kind == "sectors":
            addresses, nbytes = case
            plot_sectors(addresses, nbytes, ax=a, title=label, **kw)
        else:
            plot_banks(case, ax=a, title=label, **kw)
    for a in axes.ravel()[n:]:
        a.axis("off")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------ explorer
TILE_ROWS = 32  # rows of the tile (keys) a transposed shared row holds, before padding


def warp_tile_copy(lanes_per_row, offset, d, layout, pad):
    """A warp copying part of a float32 (rows x d) matrix into shared memory: byte addresses it reads and
    the words it writes. Lane l reads row l // lanes_per_row, column offset + l % lanes_per_row; the
    tile is stored row-major (rows of d + pad words) or transposed (row x holds column x of TILE_ROWS
    tile rows, TILE_ROWS + pad words per row, as lesson 09's kernel stores K)."""
    if layout not in ("row-major", "transposed"):
        raise ValueError(f"layout must be 'row-major' or 'transposed'; got {layout!r}")
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or pad < 0:
        raise ValueError(f"pad must be a non-negative integer (words added to each shared row); got {pad!r}")
    rows, cols = ma.tile_access(lanes_per_row, d, offset)
    addresses = (rows * d + cols) * 4
    words = rows * (d + pad) + cols if layout == "row-major" else cols * (TILE_ROWS + pad) + rows
    return addresses, words


def _draw_access(ax=None, lanes_per_row=8, offset=0, d=64, layout="transposed", pad=0):
    try:
        addresses, words = warp_tile_copy(lanes_per_row, offset, d, layout, pad)
    except ValueError as exc:
        fig, ax = own_axes(ax, width=6, height=2)
        ax.axis("off")
        ax.text(0.5, 0.5, f"not possible:\n{exc}", ha="center", va="center", fontsize=8, wrap=True)
        return fig
    what = (f"{ma.WARP // lanes_per_row} rows x {lanes_per_row} lanes, d = {d}, offset {offset}; "
            f"{layout} in shared memory, pad {pad}")
    if ax is None:
        fig, (a1, a2) = subplots(1, 2, width=12, height=5.2, gridspec_kw={"width_ratios": [1, 1.5]})
        plot_sectors(addresses, 4, ax=a1, title="read from HBM (global memory)")
        plot_banks(words, ax=a2, title=f"write to shared memory ({layout})")
        fig.suptitle(f"One warp copies a float32 tile: {what}", fontsize=10)
        fig.tight_layout()
        return fig
    ax.axis("off")  # a small panel of the static grid: both views, numbers in the titles only
    a1 = ax.inset_axes([0.0, 0.0, 0.34, 0.8])
    a2 = ax.inset_axes([0.42, 0.0, 0.58, 0.8])
    plot_sectors(addresses, 4, ax=a1, max_lines=6)
    plot_banks(words, ax=a2, labels=False)
    cost, degree = ma.coalescing(addresses, 4), ma.bank_conflict_degree(words)
    a1.set_title(f"HBM: {cost['sectors']} sectors", fontsize=7)
    a2.set_title("banks: conflict-free" if degree == 1 else f"banks: {degree}-way conflict", fontsize=7,
                 color=_CONFLICT if degree > 1 else "black")
    for a in (a1, a2):
        a.set_xlabel("")
        a.set_ylabel("")
        a.set_yticks([])
        a.tick_params(axis="x", labelsize=6)
    ax.set_title(f"{lanes_per_row} lane{'s' if lanes_per_row > 1 else ''} per row, pad {pad}", fontsize=8, pad=14)
    return ax.figure


def access_explorer(interactive=None):
    """Sliders for how a warp copies a tile from HBM to shared memory: the sectors it reads (coalescing)
    and the banks it writes (conflicts). Static fallback: 3 patterns x padding 0 and 4, transposed."""
    controls = {"lanes_per_row": ((1, 2, 4, 8, 16, 32), 8), "offset": ((0, 1, 2, 4, 8), 0),
                "d": ((16, 32, 64, 128), 64), "layout": (("row-major", "transposed"), "transposed"),
                "pad": ((0, 1, 2, 4, 8), 0)}
    return explore(_draw_access, controls, {"pad": [0, 4], "lanes_per_row": [32, 8, 1]},
                   title="A warp copies a float32 tile (d = 64) into a transposed shared tile: "
                         "HBM sectors (left of each panel) and shared-memory banks (right)",
                   interactive=interactive)
