"""Lesson 11's FP8 explorer: attention's error against block size and outliers, with and without incoherent
processing. Every number comes from flashlab.fp8's simulation (error_vs_block, the lesson's study code) on
small inputs, so a redraw takes a fraction of a second; results are cached per input setting."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import fp8
from ._base import explore, own_axes, subplots

BLOCKS = (16, 32, 64, 128, 256)
OUTLIER_P = (0.0, 1e-3, 3e-3, 1e-2, 3e-2)
OUTLIER_STD = (3.0, 10.0, 30.0, 100.0)
SEQS = (256, 512, 1024)
D = 64
COLORS = {False: "#1f77b4", True: "#ff7f0e"}
LABELS = {False: "block FP8", True: "block FP8 + incoherent"}


def sweep_blocks(n):
    """The block sizes drawn for sequence length n: BLOCKS below n, then n itself (= per-tensor scaling)."""
    return tuple(b for b in BLOCKS if b < n) + (n,)


@lru_cache(maxsize=64)
def block_errors(n, p, outlier_std, seed=0):
    """{incoherent: relative errors over sweep_blocks(n)} from fp8.error_vs_block, d = 64, cached."""
    return fp8.error_vs_block(sweep_blocks(n), n=n, d=D, seed=seed, outlier_std=outlier_std, p=p)


def plot_error_vs_block(n, p, outlier_std, block=None, incoherent=False, ax=None, compact=False):
    """Relative error of FP8 attention against block size, without and with incoherent processing; the
    chosen (block, incoherent) starred. The rightmost point, block = N, is per-tensor scaling."""
    fig, ax = own_axes(ax, width=6, height=3.8)
    blocks = sweep_blocks(n)
    errs = block_errors(n, p, outlier_std)
    for inc in (False, True):
        ax.plot(blocks, errs[inc], "o-", ms=4, color=COLORS[inc], label=LABELS[inc])
    clean = block_errors(n, 0.0, 0.0)[False]  # the same inputs without outliers: FP8's own floor
    ax.axhline(clean.mean(), color="#777777", ls=":", lw=1.2, label="no outliers (p = 0)")
    b = min(block or n, n)
    i = blocks.index(b)
    if block is not None:
        ax.plot([b], [errs[incoherent][i]], "*", ms=15, color=COLORS[incoherent], mec="black", zorder=5,
                label="your choice")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, max(errs[False].max(), errs[True].max()) * 1.15)  # from 0: the gap reads as a ratio
    ax.set_xticks(blocks, [str(b) for b in blocks[:-1]] + [f"{n}\n(tensor)"], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("rows per scale (block)")
    ax.set_ylabel("relative error of O")
    ax.grid(True, alpha=0.3)
    ratio = errs[False][i] / errs[True][i]
    if compact:
        ax.set_title(f"p = {p:g}, outlier std = {outlier_std:g}\nincoherent: error ÷ {ratio:.2g} at block {b}",
                     fontsize=8)
    else:
        ax.set_title(f"N = {n}, p = {p:g}, outlier std = {outlier_std:g}\nat block {b}, incoherent processing "
                     f"divides the error by {ratio:.2g}", fontsize=10)
    if not compact:
        ax.legend(fontsize=8)
    return fig


def _first_tile(n, p, outlier_std, block, incoherent, seed=0):
    """The first `block` rows of Q as fp8.fp8_attention quantises them (rotated first when incoherent)."""
    q, k = (fp8.outlier_inputs((1, n, D), seed + i, outlier_std=outlier_std, p=p) for i in range(2))
    if incoherent:
        q, k = fp8.incoherent_transform(q, k, seed=seed)
    return q[0, :min(block, n)]


def _draw_fp8(ax=None, N=512, p=1e-3, outlier_std=10.0, block=128, incoherent=False):
    if ax is not None:
        return plot_error_vs_block(N, p, outlier_std, block, incoherent, ax=ax, compact=True)
    fig, (left, right) = subplots(1, 2, width=12, height=4.2)
    plot_error_vs_block(N, p, outlier_std, block, incoherent, ax=left)
    tile = _first_tile(N, p, outlier_std, block, incoherent)
    im = right.imshow(np.abs(tile), aspect="auto", cmap="magma", vmin=0, interpolation="nearest")
    fig.colorbar(im, ax=right, shrink=0.85, label="|value|")
    err = np.linalg.norm(fp8.fake_quantize_e4m3(tile[None], tile.shape[0])[0] - tile) / np.linalg.norm(tile)
    right.set_xlabel("feature (d = 64)")
    right.set_ylabel("row")
    right.set_title(f"Q's first block{' after the rotation' if incoherent else ''}: amax {np.abs(tile).max():.3g}"
                    f", scale {np.abs(tile).max() / fp8.E4M3_MAX:.2g}\nits rounding error {err:.2%}", fontsize=10)
    fig.tight_layout()
    return fig


def fp8_explorer(N=512, interactive=None):
    """Lesson 11: sliders for the block size, the outliers' frequency p and size, N (starting at `N`) and
    incoherent processing. Left: relative error of FP8 attention against block size (fp8.error_vs_block,
    d = 64), dotted: the same inputs without outliers; right: the first block of Q that gets one scale.
    Static fallback at N: rows p = 0.001 / 0.01, columns outlier std 3, 10, 100."""
    if N not in SEQS:
        raise ValueError(f"N must be one of {SEQS}; got {N!r}")
    controls = {"N": (SEQS, N), "p": (OUTLIER_P, 1e-3), "outlier_std": (OUTLIER_STD, 10.0),
                "block": (BLOCKS, 128), "incoherent": ((False, True), False)}
    return explore(_draw_fp8, controls, {"p": (1e-3, 1e-2), "outlier_std": (3.0, 10.0, 100.0)},
                   interactive=interactive,
                   title=f"FP8 attention's error vs block size (N = {N}): blue block FP8, orange + incoherent, "
                         "dotted without outliers")
