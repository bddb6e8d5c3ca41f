"""Figures for the memory hierarchy, rooflines and the memory naive attention needs (lessons 01, 02, 06), and
lesson 01's roofline explorer."""
from __future__ import annotations

import tracemalloc

import numpy as np

from ._base import COLORS, explore, human_bytes, own_axes, subplots

# The A100 SXM 80GB, the GPU of lesson 01's roofline (flashlab.roofline.PUBLISHED["A100"]). SRAM: the
# FlashAttention paper (arXiv 2205.14135, Section 2.1): 192 KB on each of 108 SMs, about 20 MB, at an
# estimated 19 TB/s. HBM: 80 GB at 2,039 GB/s (A100 datasheet). CPU DRAM: the paper's Figure 1.
# (The paper's Figure 1 shows the 40 GB model, whose HBM runs at 1.5 TB/s.)
HIERARCHY = [  # (level, capacity in bytes, bandwidth in bytes/s)
    ("GPU SRAM\n(all SMs)", 20e6, 19e12),
    ("GPU HBM", 80e9, 2039e9),
    ("CPU DRAM", 1e12, 12.8e9),
]


def plot_memory_hierarchy(ax=None):
    """Capacity against bandwidth for SRAM, HBM and CPU DRAM of an A100 SXM 80GB (see HIERARCHY for sources)."""
    fig, axes = (ax.figure, ax) if ax is not None else subplots(1, 2, width=9, height=2.8)
    if ax is not None:  # one panel given: draw bandwidth only
        axes = [None, ax]
    names = [h[0] for h in HIERARCHY]
    y = np.arange(len(HIERARCHY))[::-1]
    if axes[0] is not None:
        axes[0].barh(y, [h[1] for h in HIERARCHY], color="#bbbbbb")
        axes[0].set_xscale("log")
        axes[0].set_yticks(y, names)
        axes[0].set_xlabel("capacity (bytes)")
        axes[0].set_title("bigger ...")
        for yi, h in zip(y, HIERARCHY):
            axes[0].text(h[1], yi, " " + human_bytes(h[1]), va="center", fontsize=8)
        axes[0].set_xlim(1e6, 1e15)
    axes[1].barh(y, [h[2] for h in HIERARCHY], color=COLORS["memory"])
    axes[1].set_xscale("log")
    axes[1].set_yticks(y, names)
    axes[1].set_xlabel("bandwidth (bytes/s)")
    axes[1].set_title("... or faster")
    for yi, h in zip(y, HIERARCHY):
        axes[1].text(h[2], yi, " " + human_bytes(h[2]) + "/s", va="center", fontsize=8)
    axes[1].set_xlim(1e9, 1e15)
    if ax is None:
        fig.suptitle("Memory of an A100 SXM 80GB and its host CPU", fontsize=10)
    fig.tight_layout()
    return fig


def plot_roofline(machines, kernels=None, points=None, ax=None, intensities=(1 / 16, 4096)):
    """Rooflines of `machines` (flashlab.roofline.Machine) on log-log axes.

    kernels: {name: intensity} drawn as labelled vertical lines.
    points: {name: (intensity, achieved FLOP/s)} drawn as markers (for example measured kernels).
    """
    fig, ax = own_axes(ax, width=7.5, height=4.6)
    x = np.logspace(np.log10(intensities[0]), np.log10(intensities[1]), 200)
    styles = ["-", "--", "-.", ":"]
    for i, mach in enumerate(machines):
        (line,) = ax.plot(x, mach.attainable(x), styles[i % 4] if not mach.measured else "-",
                          lw=2.5 if mach.measured else 1.6, label=mach.name)
        ax.plot([mach.ridge], [mach.peak_flops], "o", color=line.get_color(), ms=4)
    groups = []  # kernels of (nearly) equal intensity share one line and one label
    for name, inten in sorted((kernels or {}).items(), key=lambda kv: kv[1]):
        if groups and inten < groups[-1][1] * 1.2:
            groups[-1][0].append(name)
        else:
            groups.append(([name], inten))
    for names, inten in groups:
        ax.axvline(inten, color="#999999", lw=0.8, ls=":")
        ax.text(inten, 1.5e8, " " + ", ".join(names), rotation=90, va="bottom", ha="right",
                fontsize=8, color="#555555")
    placed = []  # (log intensity, log FLOP/s) of labelled points: a label near another goes one line lower
    for name, (inten, achieved) in (points or {}).items():
        ax.plot([inten], [achieved], "*", ms=11, color="black", zorder=5)
        here = (np.log10(inten), np.log10(achieved))
        near = sum(abs(here[0] - x) < 0.3 and abs(here[1] - y) < 0.3 for x, y in placed)
        placed.append(here)
        ax.annotate(name, (inten, achieved), textcoords="offset points", xytext=(6, -10 - 10 * near), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title("Roofline: min(peak FLOP/s, bandwidth × intensity)")
    ax.set_ylim(1e8, 3e15)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def plot_naive_traffic(io, ax=None):
    """Bytes each tensor moves in one instrumented run (an HBMModel after naive_attention or another algorithm)."""
    fig, ax = own_axes(ax, width=6, height=3.2)
    s = io.summary()
    names = list(dict.fromkeys(list(s["reads"]) + list(s["writes"])))
    bpe = io.bytes_per_element
    r = np.array([s["reads"].get(n, 0) * bpe for n in names], dtype=float)
    w = np.array([s["writes"].get(n, 0) * bpe for n in names], dtype=float)
    x = np.arange(len(names))
    ax.bar(x, r, label="read from HBM", color="#4c72b0")
    ax.bar(x, w, bottom=r, label="written to HBM", color="#dd8452")
    ax.set_xticks(x, names)
    ax.set_ylabel("bytes")
    for xi, total in zip(x, r + w):
        ax.text(xi, total, human_bytes(total), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, (r + w).max() * 1.18)
    ax.set_title(f"HBM traffic per tensor ({s['algorithm']}): total {human_bytes(io.hbm_bytes)}")
    ax.legend(fontsize=8)
    return fig


def peak_memory(fn, *args, **kwargs):
    """(result, peak bytes NumPy allocated while fn ran), measured with tracemalloc."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        out = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


DTYPE_NAMES = {2: "float16", 4: "float32", 8: "float64"}  # bytes per element -> the dtype a plot names


def plot_memory_vs_n(ns, d, measured=None, bytes_per_element=4, ax=None):
    """Extra memory beyond Q, K, V, O: naive attention's S and P (2 N^2) against FlashAttention's m and l (2 N),
    every array in the dtype of `bytes_per_element` (named on the axis and in the title).

    measured: {label: (ns, bytes)} measured peaks (for example from `peak_memory`) drawn as markers.
    """
    fig, ax = own_axes(ax, width=6, height=3.6)
    ns = np.asarray(ns, dtype=float)
    e = bytes_per_element
    dtype = DTYPE_NAMES.get(e, f"{e}-byte elements")
    ax.plot(ns, 2 * ns**2 * e, color=COLORS["naive"], label="naive: S and P, 2N² elements")
    ax.plot(ns, 4 * ns * d * e, color="#555555", ls="--", label=f"Q, K, V, O themselves: 4Nd (d = {d})")
    ax.plot(ns, 2 * ns * e, color=COLORS["fa2"], label="FlashAttention: m and l (or lse), ≤ 2N")
    markers = iter("osD^")
    for label, (mn, mb) in (measured or {}).items():
        ax.plot(mn, mb, next(markers), ms=6, mfc="none", color="black", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(f"bytes (one head, {dtype})")
    ax.set_title(f"Memory beyond the inputs and output, in {dtype}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_step_times(machine, kernels, ax=None):
    """For each kernel {name: (flops, bytes)}: the time its memory traffic and its arithmetic need on `machine`."""
    fig, ax = own_axes(ax, width=6.5, height=3.2)
    names = list(kernels)
    t_mem = np.array([kernels[n][1] / machine.bandwidth for n in names]) * 1e6
    t_cmp = np.array([kernels[n][0] / machine.peak_flops for n in names]) * 1e6
    y = np.arange(len(names))[::-1]
    ax.barh(y + 0.18, t_mem, 0.36, color=COLORS["memory"], label="moving bytes")
    ax.barh(y - 0.18, t_cmp, 0.36, color=COLORS["compute"], label="arithmetic")
    ax.set_yticks(y, names)
    ax.set_xlabel("microseconds (lower bound)")
    ax.set_title(f"Which limit binds on {machine.name.split(' (')[0]}?")
    for yi, tm, tc in zip(y, t_mem, t_cmp):
        ax.text(max(tm, tc), yi, "  memory-bound" if tm > tc else "  compute-bound", va="center", fontsize=8)
    ax.set_xlim(0, max(t_mem.max(), t_cmp.max()) * 1.45)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def plot_saved_for_backward(ns, d, bytes_per_element=2, ax=None):
    """What the forward keeps for the backward, per head: P (N^2, standard) against lse (N, FlashAttention).
    P and O in the dtype of `bytes_per_element`; lse in float32, as FlashAttention keeps it."""
    fig, ax = own_axes(ax, width=6, height=3.6)
    ns = np.asarray(ns, dtype=float)
    e = bytes_per_element
    dtype = DTYPE_NAMES.get(e, f"{e}-byte elements")
    ax.plot(ns, ns**2 * e, color=COLORS["naive"], label=f"standard: keep P (N² × {dtype})")
    ax.plot(ns, ns * d * e, color="#555555", ls="--", label=f"both: keep O (N·d × {dtype}, d = {d})")
    ax.plot(ns, ns * 4, color=COLORS["fa2"], label="FlashAttention: keep lse (N × float32)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("bytes kept per head")
    ax.set_title(f"Saved for the backward pass (P and O in {dtype})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# --- explorer -----------------------------------------------------------------------------------------

INTENSITIES = tuple(2.0**k for k in range(-3, 13))  # 1/8 .. 4096 FLOP/byte: a log-scale slider
SEQS = (512, 1024, 2048, 4096, 8192, 16384)


def roofline_machines(measured=()):
    """{label: Machine} for the roofline explorer: each published GPU with its FP16 tensor-core peak and its
    FP32 CUDA-core peak (same bandwidth), then any measured machines (roofline.measure_cpu/measure_gpu)."""
    from ..roofline import PUBLISHED, PUBLISHED_FP32, Machine

    out = {}
    for key, m in PUBLISHED.items():
        out[f"{key} FP16"] = m
        out[f"{key} FP32"] = Machine(f"{m.name.split(' (')[0]} (FP32 CUDA cores)", PUBLISHED_FP32[key],
                                     m.bandwidth, m.source)
    for m in measured:
        if m is not None:
            out[m.name] = m
    return out


def roofline_point(machine, intensity):
    """(attainable FLOP/s, "memory" or "compute"): where a kernel of this intensity sits on the roofline."""
    bound = "memory" if intensity < machine.ridge else "compute"
    return float(machine.attainable(intensity)), bound


ATTENTION_STEPS = ("S = QKᵀ", "softmax", "O = PV")  # naive attention's three kernels in example_kernels


def _draw_roofline_panel(ax, machine, intensity, steps, compact=False):
    x = np.logspace(-3, 13, 200, base=2)
    ax.plot(x, machine.attainable(x), color="black", lw=2)
    ax.plot([machine.ridge], [machine.peak_flops], "o", color="black", ms=4)
    ax.axvline(machine.ridge, color="#999999", lw=0.8, ls=":")
    groups = []  # the attention steps, on the roof at their own intensity; near-equal ones share a label
    for name, inten in sorted(((n, f / b) for n, (f, b) in steps.items()), key=lambda t: t[1]):
        if groups and inten < groups[-1][1] * 1.2:
            groups[-1][0].append(name)
        else:
            groups.append(([name], inten))
    for names, inten in groups:
        ax.plot([inten], [machine.attainable(inten)], "s", ms=5, color=COLORS["naive"], zorder=4)
        ax.annotate(", ".join(names), (inten, machine.attainable(inten)), textcoords="offset points",
                    xytext=(4, -11), fontsize=7, color=COLORS["naive"])
    rate, bound = roofline_point(machine, intensity)
    color = COLORS["memory"] if bound == "memory" else COLORS["compute"]
    ax.plot([intensity], [rate], "*", ms=15, color=color, mec="black", zorder=5, label="your kernel")
    ax.plot([intensity, intensity], [1e8, rate], color=color, lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(1e9, 3e15)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    name = machine.name.split(" (")[0] + "".join(f" {p}" for p in ("FP16", "FP32") if p in machine.name)
    sep = "\n" if compact else ", "
    ax.set_title(f"{name}, I = {intensity:g}: {rate / 1e12:.3g} TFLOP/s{sep}"
                 f"{bound}-bound ({100 * rate / machine.peak_flops:.2g}% of peak)", fontsize=8 if compact else 9)
    return rate, bound


def roofline_explorer(measured=(), interactive=None):
    """Lesson 01: slide a kernel's arithmetic intensity along a machine's roofline; naive attention's steps
    (QKᵀ, softmax, PV from roofline.example_kernels(N, d)) sit on the same roof. The full view adds each
    step's memory and arithmetic time (plot_step_times). Static fallback: rows H100 FP16 / T4 FP32,
    columns I = 1, 32, 512.

    measured: extra Machines (for example roofline.measure_cpu()) offered beside the published ones.
    """
    from ..roofline import example_kernels

    machines = roofline_machines(measured)

    def draw(ax=None, machine="H100 FP16", intensity=4.0, N=4096, d=64, bytes_per_element=2):
        m = machines[machine]
        steps = {k: v for k, v in example_kernels(N, d, bytes_per_element).items() if k in ATTENTION_STEPS}
        if ax is not None:
            _draw_roofline_panel(ax, m, intensity, steps, compact=True)
            return ax.figure
        fig, (left, right) = subplots(1, 2, width=12, height=4.2, gridspec_kw={"width_ratios": [1.3, 1]})
        _draw_roofline_panel(left, m, intensity, steps)
        left.text(0.02, 0.97, f"ridge: {m.ridge:.3g} FLOP/byte\nsquares: attention steps, N = {N}, d = {d}, "
                              f"{bytes_per_element}-byte elements", transform=left.transAxes, va="top", fontsize=8)
        plot_step_times(m, steps, ax=right)
        fig.tight_layout()
        return fig

    controls = {"machine": (list(machines), "H100 FP16"), "intensity": (INTENSITIES, 4.0), "N": (SEQS, 4096),
                "d": ((32, 64, 128, 256), 64), "bytes_per_element": ((2, 4), 2)}
    return explore(draw, controls, {"machine": ("H100 FP16", "T4 FP32"), "intensity": (1.0, 32.0, 512.0)},
                   interactive=interactive, title="The same kernel on two rooflines (★; squares: attention steps)")
