"""Ring attention on this machine's CPU: W processes joined by gloo against one process (lesson 19).

    python benchmarks/timing/bench_ring.py      # writes flashlab/data/ring_cpu.json, benchmarks/results/ring_cpu.png

For each total sequence length N and world size W = 1, 2, 4: the time of a ring forward and backward
(`flashlab.ring.ring_attention`, float32, causal, zigzag; every rank runs flashlab's NumPy FA2 on its blocks,
one thread per rank) and, per ring step, the seconds of compute and of waiting for the next K/V shard, and the
CPU seconds of the compute (with more processes than cores, wall-clock time also counts the turns a process
waits for a core; CPU time counts the work). Beside
it, in this process with one thread, flashlab's FA2 forward (`flashlab.torch.flash_attention`) on the full N:
the work the ring splits. Every time is the best of --steps rounds after one untimed round: on a machine
shared with other work, the least disturbed round is the closest to the code's own cost. The machine, its
load and the date are recorded with the numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process, here and in every rank

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashlab.ring import run_ranks  # noqa: E402
from flashlab.ring.processes import measure  # noqa: E402


def single(N, H, d, steps):
    import torch

    from flashlab.torch import flash_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, d, generator=g) for _ in range(3))
    times, cpu = [], []
    for i in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        flash_attention(q, k, v, causal=True)
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return min(times), min(cpu)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "flashlab" / "data" / "ring_cpu.json"))
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "results" / "ring_cpu.png"))
    a = p.parse_args(argv)
    rows = []
    load_before = os.getloadavg()
    for N in a.lengths:
        one, one_cpu = single(N, a.heads, a.d, a.steps)
        print(f"N = {N}: one process, flashlab FA2 forward {one * 1e3:.1f} ms", flush=True)
        for w in a.worlds:
            ranks = run_ranks(measure, w, N, kwargs=dict(H=a.heads, d=a.d, steps=a.steps), timeout=600)
            slow = max(ranks, key=lambda r: r["forward_s"])
            row = {"N": N, "W": w, "single_forward_ms": one * 1e3, "single_forward_cpu_ms": one_cpu * 1e3,
                   "forward_ms": slow["forward_s"] * 1e3, "backward_ms": max(r["backward_s"] for r in ranks) * 1e3,
                   "step_ms": slow["forward_s"] * 1e3 / w,
                   "compute_ms_per_step": [max(r["compute_s"][t] for r in ranks) * 1e3 for t in range(w)],
                   "wait_ms_per_step": [max(r["wait_s"][t] for r in ranks) * 1e3 for t in range(w)],
                   "compute_cpu_ms_per_step": [max(r["compute_cpu_s"][t] for r in ranks) * 1e3 for t in range(w)]}
            rows.append(row)
            print(f"  W = {w}: forward {row['forward_ms']:.1f} ms ({row['step_ms']:.1f} ms per ring step, "
                  f"{max(row['compute_cpu_ms_per_step']):.1f} ms of CPU time in the busiest), "
                  f"backward {row['backward_ms']:.1f} ms", flush=True)
    data = {"date": datetime.date.today().isoformat(),
            "machine": f"CPU, gloo, no GPU: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
                       f"shared with other jobs: load average {load_before[0]:.1f} before, "
                       f"{os.getloadavg()[0]:.1f} after",
            "setup": {"B": 1, "H": a.heads, "d": a.d, "dtype": "float32", "causal": True, "layout": "zigzag",
                      "threads_per_process": 1, "steps": a.steps},
            "command": "python benchmarks/timing/bench_ring.py " + " ".join(argv or sys.argv[1:]),
            "rows": rows}
    Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    print("wrote", a.out)
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        from flashlab.viz.ring import plot_cpu_measurement

        plot_cpu_measurement(data).savefig(a.png, dpi=100, bbox_inches="tight")
        print("wrote", a.png)


if __name__ == "__main__":
    main()
