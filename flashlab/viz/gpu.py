"""Figures for the GPU lessons (07-10): thread maps, reductions, occupancy, register tiles, tile sweeps,
rooflines and the comparison with PyTorch.

lesson 07  plot_thread_map, plot_reduction_tree, plot_launch_cost
lesson 08  plot_shared_kernel_map, plot_occupancy_bars
lesson 09  plot_micro_tiles, plot_reads_per_fma
lesson 10  load_tile_sweep, plot_tile_sweep, tile_explorer, kernel_intensity, plot_kernel_roofline,
           load_forward_results, plot_vs_torch, load_issue_profile, issue_summary, plot_issue_profile

Recorded data: flashlab/data/tile_sweep.csv (benchmarks/timing/bench_kernels.py's sweep),
flashlab/data/issue_profile.csv (benchmarks/profiling/profile_issue_slots.py, Nsight Compute) and
flashlab/data/forward.csv (a copy of benchmarks/results/forward.csv); RECORDED keeps the project's H100 run.
"""
from __future__ import annotations

import csv
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from ._base import explore, own_axes, subplots, text_color_on

ROOT = Path(__file__).resolve().parent.parent.parent
SWEEP_CSV = Path(__file__).resolve().parent.parent / "data" / "tile_sweep.csv"
ISSUE_CSV = Path(__file__).resolve().parent.parent / "data" / "issue_profile.csv"
FORWARD_CSV = Path(__file__).resolve().parent.parent / "data" / "forward.csv"  # of benchmarks/results/

#: Forward TFLOP/s measured on an H100 (NVIDIA H100 80GB HBM3, torch 2.11, numba-cuda 0.30.4), B=1, H=16,
#: float32 unless noted; CUDA-event medians of 20 runs (benchmarks/results/h100/forward.csv; a test keeps
#: them equal). Used when no benchmark CSV is present (a pip-installed flashlab, as in Colab).
RECORDED = [
    {"N": 4096, "d": 64, "impl": "torch SDPA fp32", "tflops": 32.33},
    {"N": 4096, "d": 64, "impl": "torch manual fp32", "tflops": 20.26},
    {"N": 4096, "d": 64, "impl": "torch SDPA fp16", "tflops": 373.7},
    {"N": 4096, "d": 64, "impl": "flashlab shared fp32", "tflops": 9.41},
    {"N": 4096, "d": 64, "impl": "flashlab register fp32", "tflops": 27.07},
    {"N": 1024, "d": 64, "impl": "torch SDPA fp32", "tflops": 25.04},
    {"N": 1024, "d": 64, "impl": "flashlab shared fp32", "tflops": 5.96},
    {"N": 1024, "d": 64, "impl": "flashlab register fp32", "tflops": 10.81},
]
RECORDED_SOURCE = "an H100 run (benchmarks/results/h100), CUDA-event medians"

_BLOCK_COLORS = plt.get_cmap("tab10").colors


# ------------------------------------------------------------------------------------------ lesson 07
def plot_thread_map(n, threads_per_block, ax=None):
    """Which thread of which block handles element i: i = blockIdx.x * blockDim.x + threadIdx.x.

    Threads of the last block past the end of the array are drawn hatched: they must do nothing.
    """
    blocks = -(-n // threads_per_block)
    total = blocks * threads_per_block
    fig, ax = own_axes(ax, width=min(0.32 * total + 1.5, 13), height=1.9)
    for i in range(total):
        b, t = divmod(i, threads_per_block)
        idle = i >= n
        ax.add_patch(plt.Rectangle((i, 0), 1, 1, facecolor="white" if idle else _BLOCK_COLORS[b % 10],
                                   alpha=1 if idle else 0.55, edgecolor="black", lw=0.6, hatch="///" if idle else None))
        if total <= 48:
            ax.text(i + 0.5, 0.5, str(t), ha="center", va="center", fontsize=7)
            if not idle:
                ax.text(i + 0.5, -0.35, str(i), ha="center", va="center", fontsize=6, color="#555555")
    for b in range(blocks):
        ax.text((b + 0.5) * threads_per_block, 1.3, f"block {b}", ha="center", fontsize=8)
    ax.set_xlim(-0.5, total + 0.5)
    ax.set_ylim(-0.8, 1.7)
    ax.axis("off")
    ax.set_title(f"n = {n} elements, {threads_per_block} threads per block: {blocks} blocks "
                 f"(numbers in cells: threadIdx.x; below: i; hatched: i >= n, idle)", fontsize=9)
    return fig


def plot_reduction_tree(values=(3, 1, 4, 1, 5, 9, 2, 6), ax=None):
    """A block's tree reduction in shared memory: at each step threads t < s add buf[t + s] into buf[t],
    and a barrier (dashed line) separates the steps."""
    buf = np.array(values, dtype=float)
    n = len(buf)
    steps = int(np.log2(n))
    fig, ax = own_axes(ax, width=min(0.9 * n + 1.5, 11), height=0.9 * (steps + 1) + 0.6)
    levels = [buf.copy()]
    s = n // 2
    while s > 0:
        buf[:s] += buf[s:2 * s]
        levels.append(buf.copy())
        s //= 2
    for lvl, vals in enumerate(levels):
        y = -lvl * 1.0
        active = n if lvl == 0 else n >> lvl
        for t in range(n):
            live = t < active
            ax.add_patch(plt.Rectangle((t, y), 0.9, 0.55, facecolor="#a6cee3" if live else "#eeeeee",
                                       edgecolor="black", lw=0.6))
            ax.text(t + 0.45, y + 0.27, f"{vals[t]:g}" if live else "", ha="center", va="center", fontsize=8)
        if lvl < len(levels) - 1:
            s = n >> (lvl + 1)
            for t in range(s):
                for src in (t, t + s):
                    ax.annotate("", (t + 0.45, y - 0.45), (src + 0.45, y), arrowprops=dict(arrowstyle="->", lw=0.6,
                                                                                          color="#555555"))
            ax.axhline(y - 0.2, color="#d62728", ls="--", lw=0.8)
            ax.text(n + 0.1, y - 0.17, "cuda.syncthreads()", va="bottom", fontsize=7, color="#d62728")
        ax.text(-0.3, y + 0.27, "load" if lvl == 0 else f"s = {n >> lvl}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.6, n + 2.8)
    ax.set_ylim(-len(levels) + 0.3, 0.9)
    ax.axis("off")
    ax.set_title(f"Tree sum of {n} values: {steps} steps, a barrier after each", fontsize=9)
    return fig


def plot_launch_cost(threads, seconds, ax=None, label="CUDA simulator"):
    """Measured time of one launch against the number of threads, with a straight-line fit."""
    fig, ax = own_axes(ax, width=5, height=3.2)
    threads, seconds = np.asarray(threads, float), np.asarray(seconds, float)
    ax.plot(threads, seconds * 1e3, "o", label=label)
    if len(threads) > 1:
        slope, icept = np.polyfit(threads, seconds, 1)
        xs = np.linspace(0, threads.max(), 50)
        ax.plot(xs, (icept + slope * xs) * 1e3, "-", color="#999999",
                label=f"{slope * 1e3:.2f} ms per thread + {icept * 1e3:.1f} ms")
    ax.set_xlabel("threads launched")
    ax.set_ylabel("ms per launch")
    ax.set_title("One launch of a tiny kernel")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# ------------------------------------------------------------------------------------------ lesson 08
def plot_shared_kernel_map(nq, nk, block_q, block_k, current_tile=1, causal=False, ax=None):
    """The textbook kernel's work: S (queries x keys), one thread block per band of block_q query rows
    (one thread per row), key tiles of block_k columns visited left to right. The tile in shared memory
    right now is outlined; under causal masking, the tiles a block skips are grey."""
    fig, ax = own_axes(ax, width=5.6, height=4.6)
    tq, tk = -(-nq // block_q), -(-nk // block_k)
    for i in range(tq):
        for j in range(tk):
            r0, c0 = i * block_q, j * block_k
            skip = causal and c0 > min(r0 + block_q, nq) - 1
            ax.add_patch(plt.Rectangle((c0, r0), min(block_k, nk - c0), min(block_q, nq - r0),
                                       facecolor="#dddddd" if skip else _BLOCK_COLORS[i % 10],
                                       alpha=1 if skip else 0.25 + 0.5 * (j <= current_tile), edgecolor="white"))
    for r in range(nq):  # one thread per row
        ax.plot([0, nk], [r + 0.5, r + 0.5], color="black", lw=0.25, alpha=0.4)
    c0 = current_tile * block_k
    if c0 < nk:
        ax.add_patch(plt.Rectangle((c0, 0), min(block_k, nk - c0), nq, fill=False, edgecolor="#d62728", lw=2))
        ax.text(c0 + min(block_k, nk - c0) / 2, -0.8, "K, V tile\nin shared memory", ha="center", va="bottom",
                fontsize=8, color="#d62728")
    for i in range(tq):
        ax.text(-0.5, i * block_q + min(block_q, nq - i * block_q) / 2, f"block {i}", ha="right", va="center",
                fontsize=8)
    ax.set_xlim(-0.2 * nk - 2, nk + 0.5)
    ax.set_ylim(nq + 0.5, -0.25 * nq - 1)
    ax.set_xlabel("keys")
    ax.set_ylabel("queries (one thread per row)")
    ax.set_title(f"{tq} blocks of {block_q} threads; key tiles of {block_k}" + (", causal" if causal else ""),
                 fontsize=9)
    ax.set_aspect("equal")
    return fig


def plot_occupancy_bars(infos: dict, ax=None):
    """Theoretical occupancy of kernel configurations {label: flashlab.kernels.kernel_info(...)}."""
    fig, ax = own_axes(ax, width=6.5, height=0.55 * len(infos) + 1.2)
    names = list(infos)
    occ = [infos[n]["occupancy"] for n in names]
    y = np.arange(len(names))[::-1]
    ax.barh(y, occ, color="#4c72b0")
    for yi, n in zip(y, names):
        info = infos[n]
        regs = info.get("registers_per_thread")
        text = (f" {info['occupancy']:.0%}: {info['blocks_per_sm']} blocks/SM of {info['threads_per_block']} threads, "
                f"limited by {info['limited_by']}" + (f" ({regs} regs)" if regs else ""))
        ax.text(info["occupancy"], yi, text, va="center", fontsize=8)
    ax.set_yticks(y, names)
    ax.set_xlim(0, 2.0)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_xlabel("theoretical occupancy (resident warps / maximum)")
    ax.set_title("How many warps each SM can keep in flight", fontsize=9)
    return fig


# ------------------------------------------------------------------------------------------ lesson 09
def plot_micro_tiles(block_q, block_k, tr, tc, ax=None):
    """An S tile of block_q x block_k split among tr x tc threads: thread (ty, tx) owns the micro-tile of
    rows ty*RM ... and keys tx*RN ... (the layout of the lesson's exercise)."""
    rm, rn = block_q // tr, block_k // tc
    fig, ax = own_axes(ax, width=min(0.32 * block_k + 2, 9), height=min(0.32 * block_q + 1.2, 7))
    cmap = plt.get_cmap("tab20")
    for ty in range(tr):
        for tx in range(tc):
            t = ty * tc + tx
            ax.add_patch(plt.Rectangle((tx * rn, ty * rm), rn, rm, facecolor=cmap(t % 20), alpha=0.7,
                                       edgecolor="black", lw=0.6))
            ax.text(tx * rn + rn / 2, ty * rm + rm / 2, str(t), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, block_k)
    ax.set_ylim(block_q, 0)
    ax.set_xlabel(f"keys (block_k = {block_k})")
    ax.set_ylabel(f"query rows (block_q = {block_q})")
    ax.set_title(f"{tr} x {tc} threads, each a {rm} x {rn} micro-tile of S", fontsize=9)
    ax.set_aspect("equal")
    return fig


def plot_reads_per_fma(max_r=8, ax=None):
    """Shared-memory reads per multiply-add: one per FMA for the textbook kernel (its row of Q sits in
    registers, K and V come from shared memory), (RM + RN) / (RM * RN) with an RM x RN micro-tile."""
    fig, ax = own_axes(ax, width=5.5, height=3.4)
    r = np.arange(1, max_r + 1)
    ax.plot(r, np.ones_like(r, dtype=float), "s-", color="#d62728", label="textbook: one thread per row")
    ax.plot(r, 2 * r / r**2, "o-", color="#2ca02c", label="register tiling, r x r micro-tile")
    ax.set_xlabel("micro-tile side r (rows = keys = r)")
    ax.set_ylabel("shared reads per FMA")
    ax.set_ylim(0, 2.1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Fewer reads per multiply-add: the point of register tiling", fontsize=9)
    return fig


# ------------------------------------------------------------------------------------------ lesson 10
def _num(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in str(v) else f


def load_tile_sweep(path=None) -> list:
    """Rows of the recorded tile sweep (dicts with numbers converted), or [] when the file is missing."""
    path = Path(path) if path else SWEEP_CSV
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(f)]


METRICS = {"tflops": "TFLOP/s", "registers": "registers / thread", "occupancy": "occupancy",
           "shared_bytes": "shared bytes / block", "local_bytes": "spill bytes / thread"}


def _best_per_cell(rows, d):
    """{(block_q, block_k): the fastest row of that tile shape at head dim d}."""
    best = {}
    for r in rows:
        if r.get("d") != d or not isinstance(r.get("tflops"), (int, float)) or np.isnan(r["tflops"]):
            continue
        key = (r["block_q"], r["block_k"])
        if key not in best or r["tflops"] > best[key]["tflops"]:
            best[key] = r
    return best


def plot_tile_sweep(rows, d=64, metric="tflops", ax=None):
    """Heatmap over (block_q, block_k) of one metric of the fastest thread layout of each tile shape."""
    fig, ax = own_axes(ax, width=5.6, height=4.2)
    best = _best_per_cell(rows, d)
    if not best:
        ax.text(0.5, 0.5, f"no sweep data for d = {d}", ha="center", va="center", transform=ax.transAxes)
        ax.axis("off")
        return fig
    bqs = sorted({k[0] for k in best})
    bks = sorted({k[1] for k in best})
    grid = np.full((len(bqs), len(bks)), np.nan)
    for (bq, bk), r in best.items():
        v = r.get(metric)
        grid[bqs.index(bq), bks.index(bk)] = float(v) if isinstance(v, (int, float)) else np.nan
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    fmt = "{:.0%}" if metric == "occupancy" else "{:.1f}" if metric == "tflops" else "{:.0f}"
    top = max(best.values(), key=lambda r: r["tflops"])
    for (bq, bk), r in best.items():
        i, j = bqs.index(bq), bks.index(bk)
        if np.isfinite(grid[i, j]):
            star = "★ " if r is top else ""
            ax.text(j, i, f"{star}{fmt.format(grid[i, j])}\n{r['tr']}x{r['tc']} thr", ha="center", va="center",
                    fontsize=7, color=text_color_on(im.cmap(im.norm(grid[i, j]))))
    ax.set_xticks(range(len(bks)), bks)
    ax.set_yticks(range(len(bqs)), bqs)
    ax.set_xlabel("block_k")
    ax.set_ylabel("block_q")
    gpu = rows[0].get("gpu", "?") if rows else "?"
    ax.set_title(f"{METRICS.get(metric, metric)}, d = {d} ({gpu}, N = {top.get('N', '?')})", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return fig


def tile_explorer(rows=None, interactive=None):
    """Sliders for d and the metric over the tile sweep (recorded data unless rows are given)."""
    rows = load_tile_sweep() if rows is None else rows
    ds = sorted({r["d"] for r in rows}) or [64]
    metrics = [m for m in METRICS if rows and m in rows[0]] or ["tflops"]

    def draw(ax=None, d=ds[0], metric="tflops"):
        return plot_tile_sweep(rows, d, metric, ax=ax)

    return explore(draw, {"d": (ds, ds[0]), "metric": (metrics, metrics[0])},
                   {"metric": [m for m in ("tflops", "registers", "occupancy") if m in metrics], "d": ds},
                   title="Tile sweep of the register kernel" if rows else None, interactive=interactive)


def kernel_intensity(n, d, block_q, bytes_per_element=4, causal=False):
    """FLOPs per HBM byte of a FA2-style forward for one head: Q read and O written once, K and V read once
    per query block (ceil(N / block_q) times), lse written; FLOPs 4 N^2 d (halved when causal)."""
    tr = -(-n // block_q)
    kv_reads = 2 * n * d * (tr + 1) / 2 if causal else 2 * n * d * tr
    nbytes = bytes_per_element * (2 * n * d + kv_reads) + 4 * n
    flops = 4.0 * n * n * d / (2 if causal else 1)
    return flops / nbytes


def plot_kernel_roofline(points, machine=None, ax=None, roofs=()):
    """Kernels {label: (intensity FLOP/byte, achieved FLOP/s)} under a machine's FP32 roofline; `roofs`:
    more flashlab.roofline.Machine roofs drawn with it (the measured mma.sync ceilings, lesson 15)."""
    from ..roofline import PUBLISHED, PUBLISHED_FP32, Machine
    from .memory import plot_roofline

    if machine is None:
        machine = Machine("H100 SXM, FP32 CUDA cores", PUBLISHED_FP32["H100"], PUBLISHED["H100"].bandwidth)
    fig = plot_roofline([machine, *roofs, PUBLISHED["H100"]], points=points, ax=ax, intensities=(1 / 4, 4096))
    fig.axes[0].set_title("Attention forward kernels on the roofline", fontsize=10)
    return fig


def load_forward_results(path=None):
    """(rows, source): flashlab/data/forward.csv (package data: a copy of benchmarks/results/forward.csv), or
    RECORDED if `path` names no file."""
    path = Path(path) if path else FORWARD_CSV
    if path.exists():
        with open(path, newline="") as f:
            rows = [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]
        return rows, str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return list(RECORDED), RECORDED_SOURCE


def plot_vs_torch(rows, N=4096, d=64, ax=None, source=""):
    """Bars of forward TFLOP/s at one (N, d): flashlab's kernels next to PyTorch's."""
    fig, ax = own_axes(ax, width=6.5, height=3.2)
    sel = [r for r in rows if r.get("N") == N and r.get("d") == d and isinstance(r.get("tflops"), (int, float))
           and np.isfinite(r["tflops"])]
    sel.sort(key=lambda r: r["tflops"])
    y = np.arange(len(sel))
    colors = ["#2ca02c" if "flashlab" in r["impl"] else "#7f7f7f" for r in sel]
    ax.barh(y, [r["tflops"] for r in sel], color=colors)
    for yi, r in zip(y, sel):
        ax.text(r["tflops"], yi, f" {r['tflops']:.1f}", va="center", fontsize=8)
    ax.set_yticks(y, [r["impl"] for r in sel])
    ax.set_xscale("log")
    ax.set_xlabel("TFLOP/s (log scale)")
    ax.set_title(f"Forward, B=1, H=16, N={N}, d={d}" + (f"\n{source}" if source else ""), fontsize=9)
    return fig


def load_issue_profile(path=None) -> dict:
    """{variant: {key: value, "gpu": name, "N": .., "d": ..}} from benchmarks/profiling/profile_issue_slots.py's CSV
    (flashlab/data/issue_profile.csv by default); {} when the file is missing."""
    path = Path(path) if path else ISSUE_CSV
    if not path.exists():
        return {}
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rec = out.setdefault(r["variant"], {"gpu": r["gpu"], "N": int(r["N"]), "d": int(r["d"])})
            rec[r["key"]] = float(r["value"])
    return out


def issue_summary(rec: dict) -> dict:
    """The numbers behind "fraction of FP32 peak = issue slots busy x FFMA share" for one profiled kernel.

    issue_busy: fraction of cycles a scheduler issued an instruction; ffma_share: FFMA among the issued
    (warp) instructions; per_ffma: instructions issued per FFMA; predicted_peak_fraction: their product,
    the FFMAs a scheduler completes per cycle, where 1.0 is the FP32 peak; stalls: ncu's reasons a warp
    was not issued, in warps per issued instruction, largest first.
    """
    ffma = rec["kind:FFMA"]
    busy = rec["issue_active_pct"] / 100
    share = ffma / rec["inst"]
    return {"issue_busy": busy, "ffma_share": share, "per_ffma": rec["inst"] / ffma,
            "predicted_peak_fraction": busy * share, "tflops": rec["tflops"],
            "warps_per_scheduler": rec["warps_per_scheduler"],
            "stalls": dict(sorted(((k[6:], v) for k, v in rec.items()  # "selected" is 1 by definition
                                   if k.startswith("stall_") and k != "stall_selected"), key=lambda kv: -kv[1]))}


_KIND_COLORS = {  # the kinds benchmarks/profiling/profile_issue_slots.py writes
    "FFMA": "#2ca02c", "FADD/FMUL": "#98df8a", "IMAD (index math)": "#ff7f0e",
                "ALU: integer/compare/max": "#ffbb78", "shared memory": "#1f77b4", "global memory": "#aec7e8",
                "MUFU: exp2/convert": "#9467bd", "uniform/branch/barrier": "#8c564b", "other (moves etc.)": "#c7c7c7"}


def plot_issue_profile(profile: dict, peak_tflops=None, ax=None):
    """Left: instructions issued per FFMA, by kind, for each profiled kernel. Right: issue slots busy and
    FFMA share, whose product predicts the fraction of the FP32 peak (with `peak_tflops`, the measured
    TFLOP/s / peak is drawn beside it)."""
    if not profile:
        raise ValueError("profile is empty: pass load_issue_profile()'s result after running "
                         "benchmarks/profiling/profile_issue_slots.py (it needs Nsight Compute, ncu)")
    names = [n for n in ("shared", "register") if n in profile] + \
        [n for n in profile if n not in ("shared", "register")]
    if ax is None:
        fig, (left, right) = subplots(1, 2, width=12, height=0.9 * len(names) + 2.6,
                                      gridspec_kw={"width_ratios": [1.5, 1]})
    else:
        fig, left, right = ax[0].figure, ax[0], ax[1]
    y = np.arange(len(names))[::-1]
    for yi, n in zip(y, names):
        rec, start = profile[n], 0.0
        for kind in (k[5:] for k in rec if k.startswith("kind:")):  # in the order the profiler wrote them
            w = rec["kind:" + kind] / rec["kind:FFMA"]
            left.barh(yi, w, left=start, color=_KIND_COLORS.get(kind, "#7f7f7f"), edgecolor="white", lw=0.5,
                      label=kind if yi == y[0] else None)
            start += w
        left.text(start, yi, f" {start:.2f}", va="center", fontsize=8)
    left.set_yticks(y, [f"{n}\n{profile[n]['tflops']:.1f} TFLOP/s" for n in names])
    left.set_xlabel("warp instructions issued per FFMA")
    left.set_xlim(0, 1.2 * max(profile[n]["inst"] / profile[n]["kind:FFMA"] for n in names))
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3)
    left.set_title("What the schedulers issue (FFMA is the useful work)", fontsize=9)

    h = 0.25
    for yi, n in zip(y, names):
        s = issue_summary(profile[n])
        bars = [("issue slots busy", s["issue_busy"], "#7f7f7f"), ("FFMA share", s["ffma_share"], "#2ca02c"),
                ("busy x share", s["predicted_peak_fraction"], "#1f77b4")]
        if peak_tflops:
            bars.append(("measured / peak", s["tflops"] / peak_tflops, "#d62728"))
        for i, (label, value, color) in enumerate(bars):
            yy = yi + h * (len(bars) / 2 - i - 0.5) * 0.8
            right.barh(yy, value, height=h * 0.75, color=color, label=label if yi == y[0] else None)
            right.text(value, yy, f" {value:.0%}", va="center", fontsize=7)
    right.set_yticks(y, names)
    right.set_xlim(0, 1.15)
    right.set_xlabel("fraction")
    right.legend(fontsize=7, loc="lower right")
    gpu = next(iter(profile.values()))["gpu"]
    right.set_title(f"Fraction of the FP32 peak ({gpu})", fontsize=9)
    fig.tight_layout()
    return fig
