"""Lesson 07: what one SM holds, and how its warp schedulers hide latency.

    plot_sm(names)              one SM of each GPU (four partitions, registers, L1/shared memory), with L2
                                and device memory below; every number from flashlab.hardware.GPUS
    plot_latency_hiding(...)    one scheduler's issue slots with 1, 2, 4 ... warps (hardware.scheduler_timeline)
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..hardware import gpu, scheduler_timeline, size_text
from ._base import own_axes, subplots

_C = {"sm": "#f4f4f4", "sched": "#f4a261", "regs": "#76c7c0", "fp32": "#8ac926", "tensor": "#2a9d8f",
      "l1": "#8ecae6", "l2": "#219ebc", "mem": "#b0b0b0"}


def _box(ax, x, y, w, h, text, color, fontsize=7, **kw):
    ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=0.7, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _partition(ax, x, y, w, g, i):
    """One SM sub-partition (SMSP): its scheduler, its quarter of the registers and of the FP32 units."""
    _box(ax, x, y, w, 3.5, None, "white")
    ax.text(x + 0.1, y + 0.3, f"partition {i}", fontsize=6, va="center", color="#555555")
    _box(ax, x + 0.15, y + 0.55, w - 0.3, 0.6, "warp scheduler + dispatch:\n1 warp instruction / cycle",
         _C["sched"], fontsize=6)
    regs = g.per_partition(g.registers_per_sm)
    _box(ax, x + 0.15, y + 1.25, w - 0.3, 0.55, f"registers: {regs:,} x 32-bit ({size_text(4 * regs)})",
         _C["regs"], fontsize=6)
    units = g.per_partition(g.fp32_per_sm)
    per_row = 16
    cell = (w - 0.3 - 1.3) / per_row
    for k in range(units):  # one small square per FP32 unit
        r, c = divmod(k, per_row)
        ax.add_patch(plt.Rectangle((x + 0.15 + c * cell, y + 1.95 + r * 0.32), cell * 0.85, 0.27,
                                   facecolor=_C["fp32"], edgecolor="none"))
    ax.text(x + 0.15 + per_row * cell / 2, y + 2.75 + 0.1, f"{units} FP32 units", ha="center", fontsize=6)
    tc = g.per_partition(g.tensor_cores_per_sm)
    _box(ax, x + w - 1.1, y + 1.95, 0.95, 1.0, f"{tc} tensor\ncore{'s' if tc > 1 else ''}", _C["tensor"],
         fontsize=6)


def _draw_sm(ax, name):
    g = gpu(name)
    ax.set_xlim(0, 10)
    ax.set_ylim(15.2, -0.6)
    ax.axis("off")
    ax.set_title(f"{g.name} (compute capability {g.cc}): one of its {g.sms} SMs", fontsize=9)
    _box(ax, 0.1, 0.0, 9.8, 9.7, None, _C["sm"])
    ax.text(0.3, 0.35, "SM", fontsize=9, weight="bold", va="center")
    ax.text(9.7, 0.35, f"holds up to {g.max_warps_per_sm} warps ({g.max_warps_per_sm * g.warp_size} threads), "
                       f"{g.max_blocks_per_sm} blocks", fontsize=6.5, ha="right", va="center")
    for i in range(g.partitions_per_sm):
        r, c = divmod(i, 2)
        _partition(ax, 0.3 + c * 4.8, 0.7 + r * 3.65, 4.6, g, i)
    _box(ax, 0.3, 8.1, 9.4, 1.35,
         f"L1 data cache + shared memory: {size_text(g.l1_shared_per_sm)}\n"
         f"shared: up to {size_text(g.shared_per_sm)} per SM, {size_text(g.shared_per_block)} per block "
         f"({size_text(g.static_shared_per_block)} without opt-in)", _C["l1"], fontsize=6.5)
    ax.text(5.2, 10.25, f"x {g.sms} SMs", fontsize=8, weight="bold", va="center")
    ax.annotate("", xy=(5, 10.8), xytext=(5, 9.75), arrowprops={"arrowstyle": "<->", "lw": 0.8})
    _box(ax, 0.1, 10.8, 9.8, 1.2, f"L2 cache: {size_text(g.l2_bytes)}, shared by all SMs", _C["l2"], fontsize=7.5)
    ax.annotate("", xy=(5, 13.0), xytext=(5, 12.0), arrowprops={"arrowstyle": "<->", "lw": 0.8})
    ax.text(5.2, 12.5, f"{g.bandwidth / 1e12:.3g} TB/s" if g.bandwidth >= 1e12 else f"{g.bandwidth / 1e9:.0f} GB/s",
            fontsize=7.5, va="center")
    _box(ax, 0.1, 13.0, 9.8, 1.2, f"device memory: {g.memory} (\"HBM\" in the FlashAttention papers)", _C["mem"],
         fontsize=7.5)
    ax.text(5, 14.8, f"{g.schedulers} schedulers in all; FP32 peak {g.fp32_flops / 1e12:.3g} TFLOP/s", ha="center",
            fontsize=7)


def plot_sm(names=("H100", "T4"), ax=None):
    """One SM of each named GPU (flashlab.hardware.GPUS) with its partitions, registers, L1/shared
    memory, and the L2 and device memory that all SMs share. With `ax`, draws the first name only."""
    if isinstance(names, str):
        names = (names,)
    if ax is not None:
        _draw_sm(ax, names[0])
        return ax.figure
    fig, axes = subplots(1, len(names), width=6.4 * len(names), height=7.2, squeeze=False)
    for a, name in zip(axes[0], names):
        _draw_sm(a, name)
    fig.tight_layout()
    return fig


def plot_latency_hiding(warps=(1, 2, 4), latency=4, cycles=24, ax=None):
    """One scheduler's issue slots, cycle by cycle, for each number of resident warps: each warp runs a
    chain of dependent instructions, `latency` cycles apart (hardware.scheduler_timeline)."""
    fig, ax = own_axes(ax, width=min(0.32 * cycles + 2.5, 13), height=0.55 * len(warps) + 1.3)
    colors = plt.get_cmap("tab10").colors
    for row, n in enumerate(warps):
        issued = scheduler_timeline(n, latency, cycles)
        for c, w in enumerate(issued):
            ax.add_patch(plt.Rectangle((c, row), 0.92, 0.8, facecolor="white" if w is None else colors[w % 10],
                                       edgecolor="#999999", lw=0.5, hatch="///" if w is None else None))
            if w is not None and cycles <= 40:
                ax.text(c + 0.46, row + 0.4, str(w), ha="center", va="center", fontsize=6)
        busy = sum(w is not None for w in issued) / cycles
        ax.text(cycles + 0.3, row + 0.4, f"{busy:.0%} busy", va="center", fontsize=8)
    ax.set_yticks([r + 0.4 for r in range(len(warps))], [f"{n} warp{'s' if n > 1 else ''}" for n in warps])
    ax.set_xlim(0, cycles + 3.2)
    ax.set_ylim(len(warps), -0.2)
    ax.set_xlabel("cycle (number in a cell: the warp that issues; hatched: nothing ready, the slot is lost)")
    ax.set_title(f"One scheduler, dependent instructions {latency} cycles apart", fontsize=9)
    for s in ("top", "right"):
        ax.spines[s].set_visible(False)
    return fig
