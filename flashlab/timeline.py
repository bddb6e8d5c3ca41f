"""When does overlapping loads, matmuls and softmax pay off? A small discrete-event model of FA3's schedule.

One thread block (CTA) of FlashAttention-3 (arXiv 2407.08608, section 3) streams K/V blocks past two
query tiles. Three units do the work, one job at a time each:

    tma     the Tensor Memory Accelerator copies K_j, V_j from HBM into shared memory
    tensor  the tensor cores: S = Q K_j^T ("QK") and O += P V_j ("PV")
    exp     the special-function units that compute softmax's exponentials ("softmax")

`fa3_schedule` builds the jobs and their dependencies for one choice of the paper's three ideas and
runs a greedy list scheduler: whenever a unit is free it starts the ready job that comes first in
program order. Durations are in arbitrary units; only their ratios matter.

    warp_specialized  a producer warp loads ahead into `stages` buffers; without it, the consumers load
                      block j themselves after finishing block j-1 (nothing hides the load)
    pingpong          two consumer warpgroups, each with its own Q tile, take turns on the tensor cores,
                      so one's softmax runs under the other's matmuls. Without it the two run the same
                      instruction stream side by side, sharing every unit: together they behave like one
                      warpgroup doing twice the work per step, which is how they are modelled
    intra_overlap     within a warpgroup, issue QK of block j right after the softmax of block j-1 and
                      ahead of PV of block j-1, so softmax j runs while the tensor cores do PV j-1 (the
                      paper's 2-stage pipelining, section 3.2; PV j itself must wait for softmax j)
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

UNITS = ("tma", "tensor", "exp")
UNIT_LABELS = {"tma": "TMA (loads)", "tensor": "tensor cores", "exp": "exp units (softmax)"}

#: FA3 paper figures for context (H100 SXM5, FP16 forward, head dim 128, sequence length ~8K).
#: Section 3.1 (pingpong scheduling): about 570 -> 620 TFLOP/s. Section 4.2, Table 2 (ablation):
#: the full method 661 TFLOP/s; without GEMM-softmax pipelining 582; without warp specialisation 570.
PAPER_TFLOPS = {"FA3 (all)": 661, "no GEMM-softmax pipelining": 582, "no warp specialisation": 570,
                "before pingpong": 570, "with pingpong": 620}
#: H100 SXM5: 989 TFLOP/s of FP16 matmul vs 3.9 TFLOP/s of special functions (paper, section 3.1). At
#: d = 128 a score needs 4d = 512 matmul FLOPs and one exp, so exp time / matmul time = 989 / (3.9 * 512).
H100_EXP_RATIO_D128 = 989 / (3.9 * 512)

#: The configurations compared in the lesson, from nothing overlapped to all three ideas.
CONFIGS = {
    "nothing overlapped": dict(warp_specialized=False, pingpong=False, intra_overlap=False),
    "warp specialisation": dict(warp_specialized=True, pingpong=False, intra_overlap=False),
    "+ intra-warpgroup overlap": dict(warp_specialized=True, pingpong=False, intra_overlap=True),
    "+ pingpong": dict(warp_specialized=True, pingpong=True, intra_overlap=False),
    "+ both (FA3)": dict(warp_specialized=True, pingpong=True, intra_overlap=True),
}


@dataclass
class Job:
    name: str
    unit: str
    dur: float
    wg: str  # which warpgroup it belongs to ("producer" for loads)
    kind: str  # load, QK, softmax, PV
    block: int
    deps: list = field(default_factory=list)
    order: tuple = ()  # program order: smaller starts first when two jobs want one unit
    start: float = float("nan")
    end: float = float("nan")


@dataclass
class Timeline:
    jobs: list
    makespan: float

    def busy(self, unit):
        return sum(j.dur for j in self.jobs if j.unit == unit)

    def utilisation(self, unit):
        return self.busy(unit) / self.makespan if self.makespan else 0.0


def _check_time(value, name, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0 \
            or (positive and value == 0) or value == float("inf"):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a finite {kind} number; got {value!r}")
    return float(value)


def run_jobs(jobs):
    """Greedy non-preemptive list scheduling: at every event, each free unit takes the ready job with the
    smallest `order`. Fills in start/end and returns a Timeline."""
    by_name = {j.name: j for j in jobs}
    waiting = {j.name: len(j.deps) for j in jobs}
    users = {j.name: [] for j in jobs}
    for j in jobs:
        for d in j.deps:
            users[d].append(j.name)
    ready = [j for j in jobs if not j.deps]
    free = {u: True for u in {j.unit for j in jobs}}
    running, now = [], 0.0  # heap of (end, name)
    while ready or running:
        ready.sort(key=lambda j: j.order)
        for j in list(ready):
            if free[j.unit]:
                free[j.unit] = False
                j.start, j.end = now, now + j.dur
                heapq.heappush(running, (j.end, j.order, j.name))
                ready.remove(j)
        if not running:
            raise RuntimeError("deadlock: jobs wait on each other")  # a bug in the job graph
        now, _, name = heapq.heappop(running)
        done = [name]
        while running and running[0][0] == now:  # finish everything that ends at this instant
            done.append(heapq.heappop(running)[2])
        for name in done:
            free[by_name[name].unit] = True
            for u in users[name]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready.append(by_name[u])
    return Timeline(jobs, max((j.end for j in jobs), default=0.0))


def fa3_jobs(n_blocks, *, t_load, t_gemm, t_softmax, warp_specialized=True, pingpong=True,
             intra_overlap=True, stages=2):
    """The jobs of one CTA: two Q tiles against n_blocks K/V blocks. t_gemm is one matmul (QK or PV) of
    one Q tile against one K/V block; t_softmax the softmax of that tile; t_load loading K_j and V_j."""
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"n_blocks must be a positive integer; got {n_blocks!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer (buffers for K/V blocks); got {stages!r}")
    t_load, t_softmax = _check_time(t_load, "t_load"), _check_time(t_softmax, "t_softmax")
    t_gemm = _check_time(t_gemm, "t_gemm", positive=True)
    # Without pingpong the two warpgroups move in lockstep, sharing each unit: one "WG1+2" with 2x work.
    wgs, work = (["WG1", "WG2"], 1) if pingpong else (["WG1+2"], 2)
    jobs = []

    def add(name, unit, dur, wg, kind, j, deps, order):
        jobs.append(Job(name, unit, dur, wg, kind, j, [d for d in deps if d], order))

    for j in range(n_blocks):
        # K_j and V_j have their own buffers, as in FA3: K_j's slot frees once every QK_j is done, V_j's
        # once every PV_j is; so K can run ahead of V.
        for x, user in (("K", "QK"), ("V", "PV")):
            if warp_specialized:  # the producer issues K0, V0, K1, V1, ... as fast as buffers free up
                before = f"loadK{j}" if x == "V" else (f"loadV{j - 1}" if j else None)
                freed = [f"{w} {user}{j - stages}" for w in wgs] if j >= stages else []
                deps = [before] + freed
            else:  # loaded by the consumers themselves, after they finish the previous block
                deps = [f"{w} PV{j - 1}" for w in wgs] if j else []
                deps += [f"loadK{j}"] if x == "V" else []
            add(f"load{x}{j}", "tma", t_load / 2, "producer", "load", j, deps, (j, 0, x))
        for i, w in enumerate(wgs):
            prev_sm = f"{w} softmax{j - 1}" if j else None
            prev_pv = f"{w} PV{j - 1}" if j else None
            # In order: QK_j waits for PV_{j-1}. Overlapped: QK_j is issued right after softmax_{j-1},
            # ahead of PV_{j-1}, so softmax_j can run while the tensor cores do PV_{j-1}.
            qk_after = prev_sm if intra_overlap else prev_pv
            # Without a producer the consumers wait for K_j and V_j together, then compute.
            loaded = [f"loadK{j}"] if warp_specialized else [f"loadK{j}", f"loadV{j}"]
            add(f"{w} QK{j}", "tensor", work * t_gemm, w, "QK", j, loaded + [qk_after], (j, 1, i))
            add(f"{w} softmax{j}", "exp", work * t_softmax, w, "softmax", j, [f"{w} QK{j}", prev_sm], (j, 2, i))
            pv_order = (j + 1, 1, i, 1) if intra_overlap else (j, 3, i)
            add(f"{w} PV{j}", "tensor", work * t_gemm, w, "PV", j, [f"{w} softmax{j}", prev_pv, f"loadV{j}"], pv_order)
    return jobs


def fa3_schedule(n_blocks=4, *, t_load=1.0, t_gemm=1.0, t_softmax=1.0, warp_specialized=True, pingpong=True,
                 intra_overlap=True, stages=2):
    """Simulate one CTA (see the module docstring) and return its Timeline."""
    return run_jobs(fa3_jobs(n_blocks, t_load=t_load, t_gemm=t_gemm, t_softmax=t_softmax,
                             warp_specialized=warp_specialized, pingpong=pingpong,
                             intra_overlap=intra_overlap, stages=stages))


def speedup_curve(ratios, *, n_blocks=16, t_load=0.5, configs=None):
    """Speed-up of each configuration over "nothing overlapped", as the softmax/matmul cost ratio varies.

    ratio = t_softmax / (2 t_gemm): softmax time over the time of the two matmuls of one block.
    t_load is also relative to the two matmuls. Returns {config name: [speed-up per ratio]}.
    """
    configs = CONFIGS if configs is None else configs
    out = {name: [] for name in configs}
    for r in ratios:
        r = _check_time(float(r), "ratio")
        def makespan(kw):
            return fa3_schedule(n_blocks, t_load=2 * t_load, t_gemm=1.0, t_softmax=2 * r, **kw).makespan

        base = makespan(CONFIGS["nothing overlapped"])
        for name, kw in configs.items():
            out[name].append(base / makespan(kw))
    return out


_COLORS = {"load": "#9e9e9e", "QK": "#4c72b0", "softmax": "#dd8452", "PV": "#55a868"}


def plot_timeline(tl, ax=None, title=None):
    """Gantt chart: one row per unit, one bar per job ("sm" = softmax); WG2's jobs are hatched."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(10, 2.2))[1]
    rows = {u: i for i, u in enumerate(reversed(UNITS))}
    for j in tl.jobs:
        y = rows[j.unit]
        ax.barh(y, j.dur, left=j.start, height=0.7, color=_COLORS[j.kind], edgecolor="black", linewidth=0.5,
                hatch="//" if j.wg == "WG2" else None)
        label = j.name.split()[-1].replace("load", "").replace("softmax", "sm")
        if j.dur >= 0.45:
            ax.text(j.start + j.dur / 2, y, label, ha="center", va="center", fontsize=6 if j.dur < 1 else 7)
    ax.set_yticks(list(rows.values()), [UNIT_LABELS[u] for u in rows])
    ax.set_xlim(0, tl.makespan * 1.01)
    ax.set_xlabel("time (units of one matmul)")
    ax.set_title(title or f"makespan {tl.makespan:.1f}")
    return ax


def plot_speedup_curve(ratios, curves, ax=None, mark=H100_EXP_RATIO_D128):
    """Speed-up over "nothing overlapped" against the softmax/matmul ratio, with the H100 d=128 estimate."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for name, ys in curves.items():
        ax.plot(ratios, ys, label=name, marker=".")
    if mark is not None:
        ax.axvline(mark, color="gray", ls="--", lw=1)
        ax.text(mark, ax.get_ylim()[1], " H100, d=128\n (exp only)", va="top", fontsize=8, color="gray")
    ax.set_xlabel("softmax time / time of the two matmuls")
    ax.set_ylabel("speed-up over nothing overlapped")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax
