"""Lesson 10's waves explorer: how a grid of thread blocks fills a GPU, and what split-KV and the causal block
order change. Every number comes from flashlab.kernels.plan, the planner the kernels launch with (its model:
each block holds one of SMs x blocks-per-SM slots for a time proportional to its work). Measured points come
from benchmarks/results/suite.csv (`python benchmarks/timing/bench_kernels.py --suite`) when that file exists."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ._base import explore, own_axes, subplots

ROOT = Path(__file__).resolve().parent.parent.parent
SUITE_CSV = Path(__file__).resolve().parent.parent / "data" / "suite.csv"  # of benchmarks/results/
HOST_CSV = SUITE_CSV.parent / "host.csv"  # the same, for the host-time table
GPUS = ("H100", "A100", "T4")
BATCH_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
DS = (32, 64, 128)
BEFORE = "one block per query block, per-head order"  # how the kernels launched before the planner


def load_suite(path=None):
    """(rows, source) of the shape suite (flashlab/data/suite.csv, package data: a copy of
    benchmarks/results/suite.csv), numbers parsed; ([], None) if `path` names no file."""
    path = Path(path) if path else SUITE_CSV
    if not path.exists():
        return [], None
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            for key in ("B", "H", "N", "d", "causal"):
                r[key] = int(r[key])
            for key in ("flashlab_tflops", "torch_tflops", "ratio"):
                r[key] = float(r[key])
            rows.append(r)
    return rows, str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def suite_points(rows, batch_heads, d, causal, direction="forward", variant="register", dtype="float32"):
    """[(N, ratio)] of the suite rows of one setting, sorted by N."""
    return sorted((r["N"], r["ratio"]) for r in rows if r["B"] * r["H"] == batch_heads and r["d"] == d
                  and bool(r["causal"]) == bool(causal) and r["direction"] == direction
                  and r["variant"] == variant and r["dtype"] == dtype)


def make_plan(batch_heads, N, d, gpu, causal, direction="forward"):
    from ..kernels.plan import DEVICES, plan

    return plan((1, batch_heads, N, N, d), causal=causal, device=DEVICES[gpu], direction=direction)


def sm_load(p, splits=None, heavy_first=None, bins=160):
    """(image, makespan): image[sm, t] = the fraction of SM sm's slots that hold a block during time bin t, for
    plan p (or p launched with other splits / order). Slot i sits on SM i % SMs: the first SMs-many blocks go
    to different SMs, as GPUs spread a grid's first blocks."""
    from ..kernels.plan import schedule

    works = p.works(splits, heavy_first)
    slot, start, end = schedule(works, p.slots)
    makespan = float(end.max()) if len(end) and end.max() > 0 else 1.0
    img = np.zeros((p.device.sms, bins))
    scale = bins / makespan
    for s, a, b, w in zip(slot, start, end, works):
        if w > 0:
            img[s % p.device.sms, int(a * scale):max(int(a * scale) + 1, int(round(b * scale)))] += 1
    return img / p.blocks_per_sm, makespan


def plot_timeline(p, splits=None, heavy_first=None, ax=None, title=None):
    """The SMs (rows) over time (columns), each cell shaded by the fraction of the SM's slots holding a block:
    white = idle. By default plan p itself; splits / heavy_first show it launched another way."""
    fig, ax = own_axes(ax, width=5.2, height=3.2)
    img, makespan = sm_load(p, splits, heavy_first)
    im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap="Blues", vmin=0, vmax=1,
                   extent=(0, makespan, p.device.sms, 0))
    stats = p.predict(splits, heavy_first)
    ax.set_xlabel("time (key tiles of one block)" if p.direction == "forward" else "time (query blocks)")
    ax.set_ylabel(f"SM (each holds {p.blocks_per_sm} blocks)")
    ax.set_title(title or f"{stats['blocks']} blocks, {stats['waves']:.2f} waves: "
                 f"efficiency {stats['efficiency']:.0%}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02, label="slots busy")
    return fig


def efficiency_curves(batch_heads, d, gpu, causal, seqs=SEQS):
    """{label: [predicted efficiency at each N]}: the plan, and the kernels' launch before the planner."""
    out = {"plan": [], BEFORE: []}
    for n in seqs:
        p = make_plan(batch_heads, n, d, gpu, causal)
        out["plan"].append(p.efficiency)
        out[BEFORE].append(p.predict(splits=1, heavy_first=False)["efficiency"])
    return out


def plot_efficiency(batch_heads, d, gpu, causal, suite=None, ax=None, seqs=SEQS):
    """Predicted efficiency against N (both launches), and the suite's measured flashlab / SDPA ratios for
    the same B*H, d and causal when `suite` rows are given and the GPU is the one they were measured on."""
    fig, ax = own_axes(ax, width=4.6, height=3.2)
    curves = efficiency_curves(batch_heads, d, gpu, causal, seqs)
    ax.plot(seqs, curves[BEFORE], "o--", color="#7f7f7f", label=BEFORE)
    ax.plot(seqs, curves["plan"], "o-", color="#2ca02c", label="the plan (split-KV, order)")
    rows, source = suite or ([], None)
    pts = suite_points(rows, batch_heads, d, causal) if rows and gpu == "H100" else []
    if pts:
        ax.plot(*zip(*pts), "s", color="#d62728", label=f"measured: flashlab / SDPA fp32 ({source})")
    ax.set(xscale="log", ylim=(0, 1.08), xlabel="N", ylabel="predicted efficiency",
           title=f"{gpu}, B·H = {batch_heads}, d = {d}" + (", causal" if causal else ""))
    ax.set_xticks(seqs, [str(n) for n in seqs], fontsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    return fig


def _draw(ax=None, batch_heads=16, N=1024, d=64, gpu="H100", causal=False, suite=None):
    p = make_plan(batch_heads, N, d, gpu, causal)
    if ax is not None:  # one panel of the static grid: the efficiency curves, the plan at N in the title
        plot_efficiency(batch_heads, d, gpu, causal, suite=suite, ax=ax)
        ax.set_title(f"B·H {batch_heads}, d {d}{', causal' if causal else ''}: at N={N} {p.splits} chunk(s), "
                     f"{p.waves:.2f} waves, {p.efficiency:.0%}", fontsize=8)
        return ax.figure
    fig, axes = subplots(1, 3, width=15.5, height=3.6)
    before = p.predict(splits=1, heavy_first=False)
    plot_timeline(p, splits=1, heavy_first=False, ax=axes[0],
                  title=f"before: {before['blocks']} blocks, {before['waves']:.2f} waves, {before['efficiency']:.0%}")
    split = f"{p.splits} chunks of {p.chunk} keys" if p.splits > 1 else "no split"
    order = ", heaviest first" if p.heavy_first else ""
    plot_timeline(p, ax=axes[1], title=f"plan: {split}{order}; {p.busy_blocks} blocks with work, "
                                       f"{p.waves:.2f} waves, {p.efficiency:.0%}")
    plot_efficiency(batch_heads, d, gpu, causal, suite=suite, ax=axes[2])
    fig.suptitle(f"{p.device.label}: {p.blocks_per_sm} blocks per SM (limited by {p.limited_by}), occupancy "
                 f"{p.occupancy:.0%}; tile {p.block_q} x {p.block_k}, {p.threads} threads", fontsize=10)
    fig.tight_layout()
    return fig


def wave_explorer(interactive=None, suite_path=None):
    """Sliders for B·H, N, d, the GPU and causal. Shows the GPU's slots over time before the planner and with
    its plan (grid, waves, occupancy, split count, predicted efficiency), and the predicted efficiency against
    N with the suite's measured points when benchmarks/results/suite.csv exists. Static fallback: the
    efficiency curves on an H100 for d = 64 and 128 (rows), causal or not (columns), B·H = 16."""
    suite = load_suite(suite_path)

    def draw(ax=None, **params):
        return _draw(ax=ax, suite=suite, **params)

    controls = {"batch_heads": (BATCH_HEADS, 16), "N": (SEQS, 1024), "d": (DS, 64), "gpu": (GPUS, "H100"),
                "causal": ((False, True), False)}
    return explore(draw, controls, {"d": (64, 128), "causal": (False, True)}, interactive=interactive,
                   title="Predicted efficiency of the launch (H100, B·H = 16): before the planner and with it")


__all__ = ["load_suite", "suite_points", "make_plan", "plot_timeline", "efficiency_curves", "plot_efficiency",
           "wave_explorer", "SUITE_CSV"]
