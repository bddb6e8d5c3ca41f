"""Lesson 14's split explorer: how many chunks to split a KV cache into, for a KV length, a batch*heads and a
GPU. Model curves come from flashlab.decoding (split_waves, model_time_us, default_num_splits); measured
points from benchmarks/results/decoding.md when it is there, else the same numbers recorded below."""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import LogFormatter

from ..decoding import default_num_splits, model_time_us, split_waves
from ..roofline import PUBLISHED, SMS
from ._base import explore, own_axes

DECODING_MD = Path(__file__).resolve().parent.parent / "data" / "decoding.md"  # of benchmarks/results/
#: benchmarks/results/decoding.md (NVIDIA H200, 132 SMs, 2026-11-22), split-KV rows only:
#: (B, H, Nk, d, dtype, splits, µs). Used when the file is not there (an installed package, Colab).
RECORDED = [
    (1, 16, 1024, 128, "float16", 1, 1060.2), (1, 16, 1024, 128, "float16", 16, 876.5),
    (1, 16, 4096, 128, "float16", 1, 2246.1), (1, 16, 4096, 128, "float16", 17, 765.5),
    (1, 16, 16384, 128, "float16", 1, 11018.7), (1, 16, 16384, 128, "float16", 17, 1088.6),
    (1, 16, 65536, 128, "float16", 1, 43186.2), (1, 16, 65536, 128, "float16", 17, 3240.8),
    (8, 32, 1024, 128, "float16", 1, 1237.8), (8, 32, 1024, 128, "float16", 2, 895.0),
    (8, 32, 4096, 128, "float16", 1, 3382.0), (8, 32, 4096, 128, "float16", 2, 2020.2),
    (8, 32, 16384, 128, "float16", 1, 11790.0), (8, 32, 16384, 128, "float16", 2, 6562.9),
    (1, 32, 1024, 64, "float16", 1, 758.3), (1, 32, 1024, 64, "float16", 9, 649.7),
    (1, 32, 4096, 64, "float16", 1, 1499.4), (1, 32, 4096, 64, "float16", 9, 749.3),
    (1, 32, 16384, 64, "float16", 1, 6964.4), (1, 32, 16384, 64, "float16", 9, 1284.0),
    (1, 32, 65536, 64, "float16", 1, 25951.7), (1, 32, 65536, 64, "float16", 9, 3435.9),
    (1, 16, 1024, 128, "float32", 1, 931.8), (1, 16, 1024, 128, "float32", 16, 675.0),
    (1, 16, 4096, 128, "float32", 1, 3330.5), (1, 16, 4096, 128, "float32", 17, 763.8),
    (1, 16, 16384, 128, "float32", 1, 11429.0), (1, 16, 16384, 128, "float32", 17, 1241.8),
    (1, 16, 65536, 128, "float32", 1, 43652.3), (1, 16, 65536, 128, "float32", 17, 3306.6),
    (8, 32, 1024, 128, "float32", 1, 1067.8), (8, 32, 1024, 128, "float32", 2, 778.5),
    (8, 32, 4096, 128, "float32", 1, 3390.9), (8, 32, 4096, 128, "float32", 2, 2024.2),
    (8, 32, 16384, 128, "float32", 1, 11476.8), (8, 32, 16384, 128, "float32", 2, 6301.8),
    (1, 32, 1024, 64, "float32", 1, 580.2), (1, 32, 1024, 64, "float32", 9, 484.9),
    (1, 32, 4096, 64, "float32", 1, 2274.3), (1, 32, 4096, 64, "float32", 9, 858.5),
    (1, 32, 16384, 64, "float32", 1, 6991.6), (1, 32, 16384, 64, "float32", 9, 1413.7),
    (1, 32, 65536, 64, "float32", 1, 25544.7), (1, 32, 65536, 64, "float32", 9, 3277.2),
]
MEASURED_ON = "H200, 132 SMs"
MEASURED_SMS = 132

SEQS = (1024, 4096, 16384, 32768, 65536, 131072)
BATCH_HEADS = (1, 4, 8, 16, 32, 64, 128, 256)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SPLIT_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\w+)\s*\|"
                        r"\s*split-KV, (\d+) splits?\s*\|\s*([\d.]+)\s*\|")


def load_measured(path=None):
    """(rows, source): the split-KV rows of flashlab/data/decoding.md (package data: a copy of
    benchmarks/results/decoding.md) as (B, H, Nk, d, dtype, splits, µs), or RECORDED if `path` names no file."""
    path = Path(path) if path else DECODING_MD
    if not path.exists():
        return list(RECORDED), "recorded from benchmarks/results/decoding.md"
    rows = []
    for line in path.read_text().splitlines():
        hit = _SPLIT_ROW.match(line)
        if hit:
            B, H, nk, d, dtype, splits, us = hit.groups()
            rows.append((int(B), int(H), int(nk), int(d), dtype, int(splits), float(us)))
    return rows, "benchmarks/results/decoding.md"


def measured_speedups(rows, batch_heads, nk, d):
    """{dtype: (splits, time with 1 split / time with `splits`)} for the measured setting, if there is one."""
    out = {}
    for dtype in sorted({r[4] for r in rows}):
        sel = {r[5]: r[6] for r in rows if r[0] * r[1] == batch_heads and r[2] == nk and r[3] == d and r[4] == dtype}
        if 1 in sel and len(sel) > 1:
            s = max(sel)
            out[dtype] = (s, sel[1] / sel[s])
    return out


def _gpu(name):
    return SMS[name], PUBLISHED[name].bandwidth


def _log_axes(ax):
    """Log-log axes, the y labels plain numbers (1.1, 200, 3000) however narrow the range."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.grid(True, alpha=0.3)


def _split_range(nk, default):
    """Split counts drawn: 1 .. 256, or up to the default when it is larger, never more than Nk."""
    return np.arange(1, min(max(256, default), nk) + 1)


def plot_split_times(nk, batch_heads, gpu="H100", splits=None, d=128, blocks_per_sm=1, ax=None, compact=False):
    """Model time (µs) against the number of splits; ★ the library's default_num_splits, ● the model's best,
    and the chosen `splits` marked with its waves."""
    fig, ax = own_axes(ax, width=6, height=3.8)
    n_sm, bw = _gpu(gpu)
    default = default_num_splits(batch_heads, nk, n_sm=n_sm)
    s = _split_range(nk, default)
    t = model_time_us(batch_heads, nk, d, s, n_sm=n_sm, bandwidth=bw, blocks_per_sm=blocks_per_sm)
    ax.plot(s, t, color="#1f77b4", lw=1.5, label="model")
    best = int(s[np.argmin(t)])
    ax.plot([default], [t[default - 1]], "*", ms=14, color="black", zorder=5, label=f"default_num_splits: {default}")
    ax.plot([best], [t[best - 1]], "o", ms=8, mfc="none", mec="#d62728", mew=2, zorder=5, label=f"model's best: {best}")
    if splits is not None and splits <= s[-1]:
        _, waves = split_waves(batch_heads, splits, n_sm, blocks_per_sm)
        ax.axvline(splits, color="#ff7f0e", lw=1, ls="--", label=f"your splits: {splits} ({int(waves)} waves)")
    _log_axes(ax)
    ax.set_ylim(t.min() / 1.3, t.max() * 1.6)  # a flat curve stays flat-looking; room for the legend
    ax.set_xlabel("num_splits")
    ax.set_ylabel("model time (µs)")
    title = f"{gpu} ({n_sm} SMs), B·H = {batch_heads}, Nk = {nk}"
    ax.set_title(title if not compact else f"{gpu}, B·H = {batch_heads}: default {default}, best {best}",
                 fontsize=8 if compact else 10)
    ax.legend(fontsize=7 if compact else 8, loc="upper right")
    return fig


def plot_split_grid(batch_heads, splits, n_sm, blocks_per_sm=1, ax=None):
    """The split kernel's blocks placed on the GPU: one column per block slot (n_sm * blocks_per_sm), one row
    per wave; a filled cell runs a block, an empty one idles in that wave."""
    fig, ax = own_axes(ax, width=6, height=2.8)
    blocks, waves = (int(x) for x in split_waves(batch_heads, splits, n_sm, blocks_per_sm))
    slots = n_sm * blocks_per_sm
    busy = (np.arange(waves * slots) < blocks).reshape(waves, slots).astype(float)
    ax.imshow(busy, aspect="auto", cmap="Blues", vmin=0, vmax=1.3, interpolation="nearest")
    ax.set_xlabel(f"block slot ({n_sm} SMs × {blocks_per_sm} per SM)")
    ax.set_ylabel("wave")
    ax.set_yticks(range(waves) if waves <= 12 else [0, waves - 1])
    ax.set_yticklabels([str(w + 1) for w in (range(waves) if waves <= 12 else [0, waves - 1])])
    idle = 1 - blocks / (waves * slots)
    ax.set_title(f"{batch_heads}·{splits} = {blocks} blocks in {waves} wave{'s' * (waves > 1)}: "
                 f"{idle:.0%} of slot time idle", fontsize=10)
    return fig


def _draw_split(ax=None, Nk=16384, batch_heads=16, gpu="H100", splits=16, blocks_per_sm=1, d=128, measured=None):
    if ax is not None:
        return plot_split_times(Nk, batch_heads, gpu, splits, d, blocks_per_sm, ax=ax, compact=True)
    n_sm, bw = _gpu(gpu)
    splits = min(splits, Nk)
    fig = plt.figure(figsize=(13, 7.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.4, 1])
    times, speed, slots = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    plot_split_times(Nk, batch_heads, gpu, splits, d, blocks_per_sm, ax=times)
    # Speed-up over one split: the model's curve and, where the setting was measured, the benchmark's points.
    s = _split_range(Nk, default_num_splits(batch_heads, Nk, n_sm=n_sm))
    t = model_time_us(batch_heads, Nk, d, s, n_sm=n_sm, bandwidth=bw, blocks_per_sm=blocks_per_sm)
    speed.plot(s, t[0] / t, color="#1f77b4", label="model")
    rows, source = measured if measured is not None else load_measured()
    points = measured_speedups(rows, batch_heads, Nk, d) if n_sm == MEASURED_SMS else {}
    for (dtype, (ms, ratio)), marker in zip(points.items(), "sD"):
        speed.plot([ms], [ratio], marker, ms=9, mfc="none", mew=2, color="black",
                   label=f"measured, {dtype} ({MEASURED_ON})")
    if not points:
        speed.text(0.5, 0.04, f"no measurement for this setting (measured on an {MEASURED_ON}:\n"
                              "B·H 16, 32, 256; Nk 1024 to 65536; see the lesson)", transform=speed.transAxes,
                   ha="center", va="bottom", fontsize=8, bbox=dict(boxstyle="round", fc="white", alpha=0.85))
    _log_axes(speed)
    speed.set_xlabel("num_splits")
    speed.set_ylabel("speed-up over 1 split")
    speed.set_title(f"Model vs measurement (d = {d}; measured: {source})", fontsize=9)
    speed.legend(fontsize=8, loc="upper left")
    plot_split_grid(batch_heads, splits, n_sm, blocks_per_sm, ax=slots)
    fig.tight_layout()
    return fig


def split_explorer(interactive=None):
    """Lesson 14: sliders for the KV length, batch*heads, the GPU (its SM count and bandwidth), the number of
    splits, the blocks each SM runs at once and the head dimension d. Shows lesson 14's model time for every
    split count (★ the library's choice), the speed-up over one split against the benchmark where it was
    measured, and the grid's waves. Static fallback: the model curves for two GPUs (rows) and three B·H
    (columns), Nk = 16384."""
    measured = load_measured()

    def draw(ax=None, **params):
        return _draw_split(ax=ax, measured=measured, **params)

    controls = {"Nk": (SEQS, 16384), "batch_heads": (BATCH_HEADS, 16), "gpu": (tuple(SMS), "H100"),
                "splits": (SPLITS, 16), "blocks_per_sm": ((1, 2, 4), 1), "d": ((64, 128), 128)}
    return explore(draw, controls, {"gpu": ("H100", "T4"), "batch_heads": (4, 16, 128)}, interactive=interactive,
                   title="Split-KV model time vs num_splits (Nk = 16384, d = 128): ★ default, ○ model's best")
