"""Lesson 19's figures: the ring step by step, the causal work per rank, compute against transfer, the
timeline explorer, the CPU and GPU measurements and the model at scale. The numbers come from flashlab.ring
(layout, model), flashlab/data/ring_cpu.json and flashlab/data/ring_gpus.json; this module only draws."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.ticker import NullFormatter

from ..hardware import LINKS
from ..ring import model
from ..ring.layout import causal_work, num_chunks, shard_indices
from ._base import explore, own_axes, subplots, text_color_on

DATA = Path(__file__).resolve().parent.parent / "data" / "ring_cpu.json"
GPU_DATA = Path(__file__).resolve().parent.parent / "data" / "ring_gpus.json"  # bench_ring_gpus.py writes it


def _rank_colors(world_size):
    return plt.cm.tab10(np.arange(world_size) % 10)


def plot_ring_steps(world_size=4, layout="zigzag", causal=True, ax=None):
    """W ranks (rows) by W steps (columns): which rank's K/V shard each rank holds at each step, coloured by
    that rank, with the share of a full block it computes under the mask (contiguous or zigzag)."""
    fig, ax = own_axes(ax, width=1.1 * world_size + 2.5, height=0.7 * world_size + 1.2)
    colors = _rank_colors(world_size)
    work = causal_work(world_size, layout, causal)
    for r in range(world_size):
        for t in range(world_size):
            s = (r - t) % world_size
            face = colors[s] if work[r, t] > 0 else (0.93, 0.93, 0.93, 1)
            ax.add_patch(Rectangle((t, world_size - 1 - r), 0.94, 0.9, color=face))
            ink = text_color_on(face)
            ax.text(t + 0.47, world_size - 1 - r + 0.58, f"K/V {s}", ha="center", va="center", fontsize=8, color=ink)
            share = "skip" if work[r, t] == 0 else f"{work[r, t]:.2g}"
            ax.text(t + 0.47, world_size - 1 - r + 0.25, share, ha="center", va="center", fontsize=7, color=ink)
    ax.set_xlim(-0.1, world_size)
    ax.set_ylim(-0.1, world_size)
    ax.set_xticks(np.arange(world_size) + 0.47, [f"step {t}" for t in range(world_size)], fontsize=8)
    ax.set_yticks(np.arange(world_size) + 0.45, [f"rank {r}" for r in reversed(range(world_size))], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    mask = "causal" if causal else "no mask"
    ax.set_title(f"{layout}, {mask}: the K/V shard each rank holds (each step, every shard moves one rank "
                 f"down)\nnumber: the share of a full block the rank computes", 
                 fontsize=9)
    return fig


def plot_score_owners(N=16, world_size=4, layout="zigzag", causal=True, ax=None):
    """The N x N score matrix, each entry coloured by the rank that computes it (its query's rank), shaded by
    the step at which it does; entries above the diagonal are masked."""
    fig, ax = own_axes(ax, width=4.2, height=4.0)
    owner = np.zeros(N, int)
    holder = np.zeros(N, int)
    for r in range(world_size):
        owner[shard_indices(N, r, world_size, layout)] = r
        holder[shard_indices(N, r, world_size, layout)] = r
    step = (owner[:, None] - holder[None, :]) % world_size
    colors = _rank_colors(world_size)
    img = colors[owner][:, None, :3] * np.ones((1, N, 1))
    img = img * (1 - 0.45 * step[..., None] / max(world_size - 1, 1)) + 0.45 * step[..., None] / max(world_size, 1)
    if causal:
        img[np.triu(np.ones((N, N), bool), 1)] = 0.95
    ax.imshow(np.clip(img, 0, 1), interpolation="nearest")
    c = N // num_chunks(world_size, layout)
    for x in range(c, N, c):
        ax.axhline(x - 0.5, color="white", lw=0.6)
        ax.axvline(x - 0.5, color="white", lw=0.6)
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(f"{layout}: who computes S[i, j]\n(colour: the query's rank; lighter: a later step)", fontsize=9)
    return fig


def plot_causal_work(world_size=8, ax=None):
    """Total causal work per rank, in full blocks, for the contiguous and zigzag layouts: the ring's time is set
    by the busiest rank."""
    fig, ax = own_axes(ax, width=5.5, height=3.2)
    x = np.arange(world_size)
    for i, layout in enumerate(("contiguous", "zigzag")):
        total = causal_work(world_size, layout).sum(axis=1)
        ax.bar(x + (i - 0.5) * 0.4, total, width=0.4, label=f"{layout} (busiest: {total.max():.1f})")
    ax.axhline(world_size / 2, color="black", lw=0.8, ls=":", label="perfect balance: W / 2")
    ax.set(xlabel="rank", ylabel="work (full N/W × N/W blocks)", xticks=x,
           title=f"causal attention on {world_size} ranks: work per rank")
    ax.legend(fontsize=8)
    return fig


def plot_crossover(d=128, heads=32, kv_heads=8, itemsize=2, flops=model.H100_PEAK, causal=True, ax=None):
    """Time of one ring step against tokens per rank: the compute (a parabola) and each link's transfer (a line);
    where they cross, the link keeps up."""
    fig, ax = own_axes(ax, width=6.5, height=3.8)
    c = np.logspace(2, 6, 200)
    work = 0.5 if causal else 1.0
    ax.plot(c, model.step_flops(c, d, heads, work) / flops, color="black", lw=2, label="compute at peak")
    for (name, link), color in zip(LINKS.items(), plt.cm.viridis(np.linspace(0, 0.85, len(LINKS)))):
        ax.plot(c, model.step_bytes(c, d, kv_heads, itemsize) / link.bandwidth, color=color,
                label=f"{name}: {link.bandwidth / 1e9:.0f} GB/s")
        cross = model.hiding_length(1, heads, kv_heads, itemsize, flops, link.bandwidth, causal)
        ax.plot([cross], [model.step_flops(cross, d, heads, work) / flops], "o", color=color)
        ax.annotate(f"{cross:,.0f}", (cross, model.step_flops(cross, d, heads, work) / flops), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank, c = N / W", ylabel="seconds per ring step",
           title=f"compute vs transfer per step ({heads} heads, {kv_heads} K/V heads, d = {d}, "
                 f"{'causal' if causal else 'no mask'})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


# ---------------------------------------------------------------------------------------------------------
# The explorer: a timeline of compute and transfers per rank
# ---------------------------------------------------------------------------------------------------------

BANDWIDTHS = {f"{name} ({link.bandwidth / 1e9:.0f} GB/s)": link.bandwidth
              for name, link in sorted(LINKS.items(), key=lambda kv: kv[1].bandwidth)}
WORLD_SIZES = (2, 4, 8, 16)
LENGTHS = (8192, 32768, 131072, 524288, 2097152)
HEAD_DIMS = (64, 128, 256)


def plot_timeline(world_size=4, N=131072, d=128, link="NVLink 4 (450 GB/s)", layout="zigzag", causal=True,
                  heads=32, kv_heads=8, ax=None, compact=False):
    """When each rank computes (bars coloured by the K/V shard's rank) and receives (thin grey bars below)."""
    fig, ax = own_axes(ax, width=11, height=0.5 * world_size + 1.8)
    bw = BANDWIDTHS[link] if isinstance(link, str) else float(link)
    tl = model.timeline(world_size, N, d, heads, kv_heads, 2, model.H100_ATTENTION_FLOPS, bw, layout, causal)
    colors = _rank_colors(world_size)
    unit, scale = ("ms", 1e3) if tl.total >= 1e-3 else ("µs", 1e6)
    for r in range(world_size):
        y = world_size - 1 - r
        for t in range(world_size):
            s = (r - t) % world_size
            if tl.end[r, t] > tl.start[r, t]:
                ax.barh(y + 0.12, (tl.end[r, t] - tl.start[r, t]) * scale, left=tl.start[r, t] * scale, height=0.5,
                        color=colors[s], edgecolor="white", lw=0.5)
            if t < world_size - 1:
                ax.barh(y - 0.28, tl.transfer * scale, left=(tl.arrived[r, t] - tl.transfer) * scale, height=0.16,
                        color="0.55")
    busy = tl.compute.sum(axis=1)
    idle = 1 - busy.mean() / tl.total if tl.total > 0 else 0.0
    ax.set_yticks(range(world_size), [f"rank {r}" for r in reversed(range(world_size))], fontsize=7)
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, tl.total * scale * 1.02)
    compute_step = model.step_flops(N / world_size, d, heads, 0.5 if causal else 1.0) / model.H100_ATTENTION_FLOPS
    bound = "compute-bound" if compute_step >= tl.transfer else "link-bound"
    title = (f"W = {world_size}, N = {N:,}, d = {d}, {link}, {layout}: {tl.total * scale:.3g} {unit}, "
             f"{idle:.0%} idle, {bound}")
    short = link.split(" (")[0] if isinstance(link, str) else f"{bw / 1e9:.0f} GB/s"
    ax.set_title(title if not compact else f"W = {world_size}, N = {N:,}, {short}: {bound}, {idle:.0%} idle",
                 fontsize=7 if compact else 9)
    if not compact:
        ax.text(1.0, -0.2 - 0.05 * (8 / world_size), "bars: compute, coloured by whose K/V; thin grey: a transfer",
                transform=ax.transAxes, ha="right", va="top", fontsize=7, color="0.3")
    return fig


def _draw_timeline(ax=None, world_size=4, N=131072, d=128, link="NVLink 4 (450 GB/s)", layout="zigzag",
                   causal=True):
    return plot_timeline(world_size, N, d, link, layout, causal, ax=ax, compact=ax is not None)


def ring_explorer(interactive=None):
    """Sliders for the world size, N, d and the link; the timeline of compute and transfers on every rank
    (H100-class compute as in flashlab.ring.model, 32 heads, 8 K/V heads, bf16). Without widgets: a grid."""
    links = list(BANDWIDTHS)
    controls = {"world_size": (WORLD_SIZES, 4), "N": (LENGTHS, 131072), "d": (HEAD_DIMS, 128),
                "link": (links, "NVLink 4 (450 GB/s)"), "layout": (("zigzag", "contiguous"), "zigzag"),
                "causal": ((False, True), True)}
    grid = {"N": (8192, 131072), "link": (links[0], links[-1])}
    return explore(_draw_timeline, controls, grid, interactive=interactive, ncols=2,
                   title="ring timelines (static view: move the sliders in a live notebook)")


# ---------------------------------------------------------------------------------------------------------
# Measured on this course's CPU, and the model at scale
# ---------------------------------------------------------------------------------------------------------

def load_cpu_measurement(path=None) -> dict:
    return json.loads(Path(path or DATA).read_text())


def plot_cpu_measurement(data=None, axes=None):
    """Left: the ring's forward against W, beside one process's FA2 forward on the whole N and that divided by W
    (what W ranks on W free cores would reach). Right: each ring step of the largest N, split into the CPU time
    of its compute, the rest of its compute's wall-clock time (turns waiting for a core) and the wait for the
    next shard."""
    data = data or load_cpu_measurement()
    if axes is None:
        fig, axes = subplots(1, 2, width=11, height=3.8)
    fig = axes[0].figure
    rows = data["rows"]
    lengths = sorted({r["N"] for r in rows})
    worlds = sorted({r["W"] for r in rows})
    colors = plt.cm.viridis(np.linspace(0, 0.8, len(lengths)))
    ax = axes[0]
    for n, color in zip(lengths, colors):
        sel = sorted((r for r in rows if r["N"] == n), key=lambda r: r["W"])
        ax.plot([r["W"] for r in sel], [r["forward_ms"] for r in sel], "o-", color=color, label=f"ring, N = {n}")
        one = sel[0]["single_forward_ms"]
        ax.plot(worlds, [one / w for w in worlds], ":", color=color, lw=1,
                label="one process / W" if n == lengths[-1] else None)
        ax.plot([worlds[0]], [one], "*", color=color, ms=10, label="one process" if n == lengths[-1] else None)
    ax.set(xscale="log", yscale="log", xlabel="world size W (processes)", ylabel="ms",
           title="the forward, whole sequence (wall clock)")
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=6, loc="lower left")
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    n = lengths[-1]
    sel = sorted((r for r in rows if r["N"] == n), key=lambda r: r["W"])
    labels, pos, x = [], [], 0.0
    for r in sel:
        cpus = r.get("compute_cpu_ms_per_step") or r["compute_ms_per_step"]
        for t, (c, w, cpu) in enumerate(zip(r["compute_ms_per_step"], r["wait_ms_per_step"], cpus)):
            first = not labels
            ax.bar(x, min(cpu, c), color="#1f77b4", label="compute: CPU time" if first else None)
            ax.bar(x, max(c - cpu, 0), bottom=min(cpu, c), color="#aec7e8",
                   label="compute: waiting for a core" if first else None)
            ax.bar(x, w, bottom=c, color="#ff7f0e", label="waiting for the next shard" if first else None)
            labels.append(f"W{r['W']}\nt{t}")
            pos.append(x)
            x += 1
        x += 0.5
    ax.set_xticks(pos, labels, fontsize=6)
    ax.set(ylabel="ms (slowest rank)", title=f"N = {n}: each ring step of the forward")
    ax.legend(fontsize=7)
    fig.suptitle(f"{data['machine']}; {data['date']}", fontsize=7)
    fig.tight_layout()
    return fig


def load_gpu_measurement(path=None):
    """The result of benchmarks/timing/bench_ring_gpus.py (a dict), or None where no run is recorded."""
    path = Path(path or GPU_DATA)
    return json.loads(path.read_text()) if path.exists() else None


def gpu_rows(data, series, layout="zigzag", causal=True):
    """The scaling rows of a multi-GPU run for one series ("total": a fixed total N; "per_gpu": a fixed N per
    GPU), layout and mask, by W."""
    return sorted((r for r in data.get("scaling") or [] if r["series"] == series and r["layout"] == layout
                   and r["causal"] == causal), key=lambda r: r["W"])


def gpu_label(data) -> str:
    """"4 x NVIDIA H200, 2026-11-28 19:30 UTC: B 1, H 16, d 64, bfloat16": the run a figure shows."""
    setup, dtypes = data.get("setup", {}), data.get("setup", {}).get("dtypes") or ["?"]
    return (f"{data.get('world_size')} x {data.get('gpu')}, {data.get('date')}: B {setup.get('B')}, "
            f"H {setup.get('heads')}, d {setup.get('d')}, {dtypes[0]}")


def plot_gpu_measurement(data=None, axes=None):
    """Three panels of a multi-GPU run (causal; a fixed number of tokens per GPU and a fixed total N).
    Left: the ring's time per step against W, measured (markers) and as lesson 19's model predicts it from the
    run's own rates (one GPU's FLOP/s, the ring exchange's GB/s: solid) and from the datasheet numbers
    (H100 attention rate, NVLink 4: dotted). Middle: efficiency, one GPU's time on the whole sequence over W
    times the ring's, forward and forward+backward. Right: at the largest W and the fixed total N, each rank's
    compute and its wait for shards over the forward's steps, zigzag beside contiguous."""
    data = data or load_gpu_measurement()
    if data is None:
        raise FileNotFoundError(f"no multi-GPU run is recorded: {GPU_DATA} is absent (write it with "
                                "benchmarks/timing/bench_ring_gpus.py on a machine with several GPUs)")
    if axes is None:
        fig, axes = subplots(1, 3, width=13, height=3.8)
    fig = axes[0].figure
    series = (("total", "fixed total N", "#1f77b4"), ("per_gpu", "fixed N per GPU", "#d62728"))
    ax = axes[0]
    for name, label, color in series:
        rows = gpu_rows(data, name)
        if not rows:
            continue
        ws = [r["W"] for r in rows]
        n = rows[-1]["N"] if name == "total" else rows[0]["tokens_per_rank"]
        what = f"N = {n:,}" if name == "total" else f"{n:,} per GPU"
        ax.plot(ws, [r["step_ms"] for r in rows], "o", color=color, ms=7, label=f"measured, {what}")
        model_ws = [r["W"] for r in rows if r.get("model_step_ms")]
        ax.plot(model_ws, [r["model_step_ms"] for r in rows if r.get("model_step_ms")], "-", color=color,
                label="model, this run's rates")
        ax.plot(ws, [r["model_step_ms_datasheet"] for r in rows], ":", color=color,
                label="model, datasheet rates")
    timed = bool(data.get("scaling"))  # a run stopped before its timings draws empty panels
    if timed:
        ax.set(xscale="log", yscale="log")
    ax.set(xlabel="GPUs (W)", ylabel="ms per ring step (forward)", title="time per ring step, causal zigzag")
    _gpu_ticks(ax, data)
    ax.legend(fontsize=6)
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    for name, label, color in series:
        rows = [r for r in gpu_rows(data, name) if "efficiency_forward" in r]
        ws = [r["W"] for r in rows]
        ax.plot(ws, [r["efficiency_forward"] for r in rows], "o-", color=color, label=f"{label}: forward")
        ax.plot(ws, [r["efficiency_forward_backward"] for r in rows], "s--", color=color, mfc="none",
                label=f"{label}: forward + backward")
    ax.axhline(1.0, color="0.5", lw=0.8)
    if timed:
        ax.set(xscale="log")
    ax.set(xlabel="GPUs (W)", ylabel="one GPU's time / (W x ring's time)", ylim=(0, 1.2),
           title="efficiency, causal zigzag")
    _gpu_ticks(ax, data)
    ax.legend(fontsize=6, loc="lower left")
    ax.grid(True, alpha=0.3)
    ax = axes[2]
    x, ticks, labels = 0.0, [], []
    for layout, color in (("zigzag", "#1f77b4"), ("contiguous", "#9467bd")):
        rows = gpu_rows(data, "total", layout)
        if not rows:
            continue
        r = rows[-1]
        spread = f"compute (spread {r['balance_compute']:.2f})"
        for rank, (c, w) in enumerate(zip(r["compute_ms_per_rank"], r["wait_ms_per_rank"])):
            ax.bar(x, c, color=color, label=f"{layout}: {spread}" if rank == 0 else None)
            ax.bar(x, w, bottom=c, color=color, alpha=0.35,
                   label=f"{layout}: waiting for shards" if rank == 0 else None)
            ticks.append(x)
            labels.append(f"r{rank}")
            x += 1
        x += 0.7
    ax.set_xticks(ticks, labels, fontsize=7)
    last = gpu_rows(data, "total")
    title = f"W = {last[-1]['W']}, N = {last[-1]['N']:,}: each rank's forward" if last else "each rank's forward"
    ax.set(ylabel="ms", title=title)
    ax.legend(fontsize=6)
    fig.suptitle(gpu_label(data), fontsize=8)
    fig.tight_layout()
    return fig


def _gpu_ticks(ax, data):
    worlds = data.get("worlds") or [1]
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_at_scale(lengths=(2**20, 2**23), gpus=(8, 16, 32, 64, 128, 256, 512, 1024), causal=True, axes=None):
    """The model at 8 to 1024 GPUs (flashlab.ring.model.at_scale): left, the compute and the transfer of one ring
    step for sequences of N tokens; right, the tokens per GPU that memory allows against the crossover."""
    if axes is None:
        fig, axes = subplots(1, 2, width=11, height=3.6)
    fig = axes[0].figure
    ax = axes[0]
    for n, color in zip(lengths, ("#1f77b4", "#d62728")):
        rows = model.at_scale(n, gpus, causal=causal)
        ws = [r["W"] for r in rows]
        ax.plot(ws, [r["compute_s"] * 1e3 for r in rows], "o-", color=color, label=f"N = {n:,}: compute")
        ax.plot(ws, [r["transfer_s"] * 1e3 for r in rows], "s--", color=color, mfc="none", label=f"N = {n:,}: transfer")
        over = [r for r in rows if not r["fits"]]
        ax.plot([r["W"] for r in over], [r["compute_s"] * 1e3 for r in over], "x", color="black", ms=9,
                label="does not fit in memory" if n == lengths[-1] else None)
    ax.axvspan(gpus[0] * 0.8, model.GPUS_PER_NODE * 1.4, color="0.9", zorder=0, label="one node: NVLink")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xscale="log", yscale="log", xlabel="GPUs (W)", ylabel="ms per ring step, one layer",
           title="one attention layer's ring step (Llama-2-7B shape, bf16)")
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    rows = model.at_scale(lengths[0], gpus, causal=causal)
    ax.plot([r["W"] for r in rows], [r["max_tokens"] for r in rows], "o-", color="black",
            label="most tokens per GPU (80 GB, model)")
    ax.plot([r["W"] for r in rows], [r["crossover_tokens"] for r in rows], "s--", color="#2ca02c",
            label="fewest tokens per GPU to hide transfers")
    ax.set(xscale="log", yscale="log", xlabel="GPUs (W)", ylabel="tokens per GPU",
           title="memory's ceiling and the link's floor")
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
