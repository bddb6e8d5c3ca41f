"""Figures of how the tensor-core kernels cut their work (lessons 15, 16 and 18): the tile hierarchy of the
forward, which lane gives ldmatrix.x4 which row address, shared-memory padding against swizzling, and FA2's
varlen grid against a packed list of the blocks that have work.

Each figure draws numbers a small model computes (`bank_groups`, `ldmatrix_x4_rows`, `varlen_blocks`), and the
tests check those models, so the pictures cannot drift from the rules they show.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ._base import subplots

BANKS, BANK_BYTES, CHUNK_BYTES = 32, 4, 16  # 32 banks of 4 bytes; ldmatrix and cp.async move 16-byte chunks
PHASE_LANES = 8  # a warp's 16-byte access is served in 4 phases of 8 lanes (8 x 16 B = the 32 banks once)


# ------------------------------------------------------------------------------------------------ models
def bank_groups(row_bytes, rows=PHASE_LANES, pad_bytes=0, swizzle=False):
    """(rows, chunks per row) array: the group of 4 banks (0-7) holding each 16-byte chunk of a row-major tile
    whose rows are `row_bytes` long and stored `row_bytes + pad_bytes` apart; with `swizzle`, chunk c of row r is
    stored at chunk c ^ (r % 8) of its row (the XOR swizzle CUTLASS writes Swizzle<3, 4, 3> for 128-byte rows)."""
    chunks = row_bytes // CHUNK_BYTES
    out = np.zeros((rows, chunks), np.int64)
    for r in range(rows):
        for c in range(chunks):
            place = c ^ (r % 8) if swizzle else c
            out[r, c] = ((r * (row_bytes + pad_bytes) + place * CHUNK_BYTES) // BANK_BYTES) % BANKS // 4
    return out


def conflict_degree(groups_of_a_phase) -> int:
    """Passes a phase of 8 chunk reads needs: the most chunks that fall in one bank group."""
    return int(np.bincount(np.asarray(groups_of_a_phase).ravel(), minlength=8).max())


def ldmatrix_x4_rows(row0=0, col0=0, row_stride=None):
    """(32, 3) int: for each lane, (matrix, row, column) of the 16-byte row it points at when ldmatrix.x4 loads
    a 16 x 16 tile of 16-bit values as an A operand: lanes 8i to 8i + 7 give the rows of matrix i (PTX ISA,
    "Warp-level matrix load instruction: ldmatrix"), and the A fragment's registers a0 a1 / a2 a3 / a4 a5 / a6 a7
    are rows 0-7 | rows 8-15 of columns 0-7, then the same rows of columns 8-15."""
    out = np.zeros((32, 3), np.int64)
    for lane in range(32):
        matrix, r = lane // 8, lane % 8
        out[lane] = (matrix, row0 + r + 8 * (matrix % 2), col0 + 8 * (matrix // 2))
    return out


def varlen_blocks(seqlens_q, block_q):
    """FA2's varlen grid, per head: (blocks launched, blocks with rows). FA2 launches
    ceil(max_seqlen_q / block_q) blocks for every sequence; a block past its sequence's end returns at once."""
    seqlens_q = [int(n) for n in seqlens_q]
    per_seq = math.ceil(max(seqlens_q) / block_q) if seqlens_q and max(seqlens_q) > 0 else 0
    working = sum(math.ceil(n / block_q) for n in seqlens_q)
    return per_seq * len(seqlens_q), working


# ----------------------------------------------------------------------------------------------- figures
def plot_tile_hierarchy(block_q=128, block_k=64, warps=4, m_tiles=2, d=64, ax=None):
    """One thread block's S = Q Kᵀ tile of block_q x block_k: the warps' bands of query rows, each warp's 16-row
    m-tiles, the 8-key n-tiles, and one mma (16 x 8, summed over d / 16 k-steps) outlined."""
    if ax is None:
        fig, ax = subplots(1, 1, width=8.5, height=5.6)
    fig = ax.figure
    rows_per_warp = block_q // warps
    cmap = plt.get_cmap("tab10")
    for w in range(warps):
        ax.add_patch(Rectangle((0, w * rows_per_warp), block_k, rows_per_warp, facecolor=cmap(w), alpha=0.18,
                               edgecolor=cmap(w), lw=2))
        ax.text(block_k + 1, (w + 0.5) * rows_per_warp, f"warp {w}: rows {w * rows_per_warp}-"
                f"{(w + 1) * rows_per_warp - 1}\n{m_tiles} m-tile(s) of 16", va="center", fontsize=8)
        for mt in range(1, rows_per_warp // 16):
            y = w * rows_per_warp + 16 * mt
            ax.plot([0, block_k], [y, y], color=cmap(w), lw=0.8, ls="--")
    for n in range(1, block_k // 8):
        ax.plot([8 * n, 8 * n], [0, block_q], color="grey", lw=0.4)
    ax.add_patch(Rectangle((8, 16), 8, 16, facecolor="none", edgecolor="black", lw=2.5))
    ax.annotate(f"one mma.m16n8k16 tile: 16 rows x 8 keys,\nsummed over {d // 16} k-steps of 16 dims",
                xy=(16, 24), xytext=(block_k * 0.45, block_q * 0.12), fontsize=8,
                arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(0, block_k + 26)
    ax.set_ylim(block_q, 0)
    ax.set_xlabel(f"keys of the tile (block_k = {block_k}; grey lines: 8-key n-tiles)")
    ax.set_ylabel(f"query rows of the block (block_q = {block_q})")
    ax.set_title("A thread block's tile of S = QKᵀ: warps → m-tiles → n-tiles (× k-steps)", fontsize=10)
    return fig


def plot_ldmatrix_x4_addresses(ax=None):
    """Which lane gives which row address to ldmatrix.x4 for a 16 x 16 A operand: the tile's rows and column
    halves coloured by the matrix they belong to, each row labelled with the lane that points at it."""
    if ax is None:
        fig, ax = subplots(1, 1, width=6.5, height=5.6)
    fig = ax.figure
    cmap = plt.get_cmap("Set2")
    for lane, (matrix, row, col) in enumerate(ldmatrix_x4_rows()):
        ax.add_patch(Rectangle((col, row), 8, 1, facecolor=cmap(matrix), edgecolor="white", lw=1))
        ax.text(col + 4, row + 0.5, f"lane {lane}", ha="center", va="center", fontsize=7)
    for matrix in range(4):
        ax.text(8 * (matrix // 2) + 4, 8 * (matrix % 2) + 8.6 if matrix % 2 else 8 * (matrix % 2) - 0.4,
                f"matrix {matrix} → a{2 * matrix}, a{2 * matrix + 1}", ha="center", fontsize=8, weight="bold")
    ax.set_xlim(0, 16)
    ax.set_ylim(17.5, -1.5)
    ax.set_xticks([0, 8, 16])
    ax.set_xlabel("columns (16-bit values; 8 of them = one 16-byte row address)")
    ax.set_ylabel("rows of the 16 x 16 tile")
    ax.set_title("ldmatrix.x4: lanes 8i..8i+7 point at the 8 rows of matrix i", fontsize=10)
    return fig


def plot_swizzle_vs_padding(row_bytes=128, axes=None):
    """The first 8 rows of a tile with `row_bytes`-long rows, each 16-byte chunk coloured by its group of 4 banks:
    plain, padded by 16 bytes, and XOR-swizzled. The 8 rows one ldmatrix phase reads (column 0 in every row)
    need as many passes as the most chunks in one colour."""
    layouts = [("row-major", dict()), ("padded by 16 bytes", dict(pad_bytes=16)), ("XOR swizzle", dict(swizzle=True))]
    if axes is None:
        fig, axes = subplots(1, 3, width=13, height=3.8)
    fig = axes[0].figure
    cmap = plt.get_cmap("tab10")
    for ax, (name, kw) in zip(axes, layouts):
        groups = bank_groups(row_bytes, **kw)
        for r in range(groups.shape[0]):
            for c in range(groups.shape[1]):
                ax.add_patch(Rectangle((c, r), 1, 1, facecolor=cmap(groups[r, c]), alpha=1.0 if c == 0 else 0.35,
                                       edgecolor="black" if c == 0 else "white", lw=1.2 if c == 0 else 0.5))
                ax.text(c + 0.5, r + 0.5, str(groups[r, c]), ha="center", va="center", fontsize=7)
        passes = conflict_degree(groups[:, 0])
        extra = f", {kw['pad_bytes']} B per row more memory" if kw.get("pad_bytes") else ", no extra memory"
        ax.set_title(f"{name}: column 0 of 8 rows\nneeds {passes} pass{'es' if passes > 1 else ''}"
                     f"{extra if name != 'row-major' else ''}", fontsize=9)
        ax.set_xlim(0, groups.shape[1])
        ax.set_ylim(groups.shape[0], 0)
        ax.set_xlabel("16-byte chunk of the row (logical column)")
        ax.set_ylabel("row")
    fig.suptitle(f"Bank groups (0-7, 4 banks each) of {row_bytes}-byte rows", fontsize=10)
    fig.tight_layout()
    return fig


def plot_varlen_grid(seqlens_q, block_q=128, axes=None):
    """FA2's varlen grid for one head (left: a column of ceil(max_seqlen_q / block_q) blocks per sequence, the
    blocks past a sequence's end idle) beside a packed list of only the blocks with rows, longest sequences first
    (right: flashlab's own table, closer to FlashAttention-3's scheduler than to FA2)."""
    seqlens_q = [int(n) for n in seqlens_q]
    per_seq = math.ceil(max(seqlens_q) / block_q)
    launched, working = varlen_blocks(seqlens_q, block_q)
    if axes is None:
        fig, axes = subplots(1, 2, width=11, height=4.2)
    fig = axes[0].figure
    ax = axes[0]
    for b, n in enumerate(seqlens_q):
        for i in range(per_seq):
            busy = i * block_q < n
            ax.add_patch(Rectangle((b, i), 1, 1, facecolor="tab:blue" if busy else "white", edgecolor="grey",
                                   hatch=None if busy else "//", lw=0.5))
    ax.set_xlim(0, len(seqlens_q))
    ax.set_ylim(per_seq, 0)
    ax.set_xlabel("sequence (grid.y)")
    ax.set_ylabel(f"query block (grid.x), {block_q} rows each")
    ax.set_title(f"FA2: {launched} blocks launched, {launched - working} exit at once (hatched)", fontsize=9)
    ax = axes[1]
    order = sorted(range(len(seqlens_q)), key=lambda b: -seqlens_q[b])
    k = 0
    for b in order:
        for _ in range(math.ceil(seqlens_q[b] / block_q)):
            ax.add_patch(Rectangle((k, 0), 1, 1, facecolor=plt.get_cmap("tab20")(b % 20), edgecolor="white"))
            k += 1
    ax.set_xlim(0, max(k, 1))
    ax.set_ylim(1, 0)
    ax.set_yticks([])
    ax.set_xlabel("block of a packed list (colour: its sequence)")
    ax.set_title(f"flashlab's packed list: {working} blocks, every one with rows", fontsize=9)
    fig.tight_layout()
    return fig


def plot_warp_partition(block_q=64, block_k=64, warps=4, axes=None):
    """How a thread block's warps share one (Q block, K/V tile) step. Left, split-K (FlashAttention-1's kernels):
    every warp takes all query rows and a slice of the keys, so each holds a partial O, m and l per row that the
    warps must combine through shared memory. Right, split-Q (FlashAttention-2, section 3.3 of the paper): every
    warp takes a band of query rows and all the keys, so its rows' O, m and l are its own and no warp waits for
    another."""
    if axes is None:
        fig, axes = subplots(1, 2, width=11, height=4.2)
    fig = axes[0].figure
    cmap = plt.get_cmap("tab10")
    rows, keys = block_q // warps, block_k // warps
    for w in range(warps):
        axes[0].add_patch(Rectangle((w * keys, 0), keys, block_q, facecolor=cmap(w), alpha=0.35, edgecolor=cmap(w)))
        axes[0].text((w + 0.5) * keys, block_q / 2, f"warp {w}", ha="center", va="center", rotation=90, fontsize=8)
        axes[1].add_patch(Rectangle((0, w * rows), block_k, rows, facecolor=cmap(w), alpha=0.35, edgecolor=cmap(w)))
        axes[1].text(block_k / 2, (w + 0.5) * rows, f"warp {w}", ha="center", va="center", fontsize=8)
    titles = (f"split-K: {warps} partial O, m, l per row,\ncombined through shared memory after every tile",
              "split-Q (FA2): each row's O, m, l in one warp,\nno exchange between warps")
    for ax, title in zip(axes, titles):
        ax.set_xlim(0, block_k)
        ax.set_ylim(block_q, 0)
        ax.set_xlabel(f"keys of the tile ({block_k})")
        ax.set_ylabel(f"query rows of the block ({block_q})")
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
