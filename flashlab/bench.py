"""Timing GPU work honestly (lesson 10, benchmarks/timing/bench_kernels.py).

- CUDA events around the work, not host clocks: launches are asynchronous.
- Warm-up calls first, so compilation (Numba compiles on the first launch) and module loading are not timed.
- The median of at least 20 samples, not the mean: one hiccup on a shared machine cannot move it.

FLOP counts follow the FlashAttention papers: forward 4*B*H*Nq*Nk*d (two matrix products of 2*Nq*Nk*d),
halved under causal masking; backward 2.5x the forward (five matrix products instead of two).

load_lesson_facts() reads the numbers lessons 07, 09 and 14 quote when there is no GPU
(flashlab/data/lesson_facts.json, written by benchmarks/generators/lesson_facts.py).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

FACTS_JSON = Path(__file__).resolve().parent / "data" / "lesson_facts.json"
#: The layout of lesson_facts.json: section -> its keys (values are numbers, strings or null).
FACTS_SCHEMA = {
    "launch": ("kernel", "reps", "loop", "numba_event_us", "numba_host_us", "numba_torch_arg_host_us",
               "torch_op", "torch_event_us", "torch_host_us"),
    "local_memory": ("n_steps", "threads", "R", "unrolled", "dynamic"),
}
FACTS_KERNEL_KEYS = ("registers", "local_bytes", "ms")  # of local_memory["unrolled"] and ["dynamic"]
FACTS_TOP = ("source", "gpu", "date", "versions", "launch", "local_memory")


def attention_flops(B: int, H: int, n_q: int, n_k: int, d: int, *, causal: bool = False,
                    backward: bool = False) -> float:
    """FLOPs of attention counted as the papers do (softmax and masking not counted)."""
    flops = 4.0 * B * H * n_q * n_k * d
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s from a FLOP count and a time in milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def _events():
    """(make_event, elapsed_ms, synchronize) from numba.cuda, which shares the default stream with torch."""
    from .device import get_cuda, has_gpu

    if not has_gpu():
        raise RuntimeError("GPU timing needs a CUDA GPU; in the simulator, time with time.perf_counter instead "
                           "(the simulator costs ~0.1 ms per thread)")
    cuda = get_cuda()
    return (lambda: cuda.event(timing=True)), cuda.event_elapsed_time, cuda.synchronize


def time_cuda(fn, *, warmup: int = 3, reps: int = 20) -> dict:
    """Time fn() on the GPU: `warmup` untimed calls, then `reps` samples each between two CUDA events.

    Returns {"median_ms", "min_ms", "max_ms", "samples_ms"}. fn must enqueue its work on the default
    stream (numba kernels and torch ops do, unless a stream is set).
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1; got {reps}")
    event, elapsed, sync = _events()
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        start, end = event(), event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(elapsed(start, end))
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "samples_ms": samples}


def write_csv(path, rows) -> None:
    """Write a list of dicts (one per row, same keys) as a CSV file with a header; nothing when rows is empty."""
    import csv
    from pathlib import Path

    if rows:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def peak_memory_mib(fn) -> float:
    """Peak device memory allocated through torch while fn() runs (MiB), above what was allocated before.

    Counts what torch's allocator hands out: pass torch tensors to flashlab's kernels so their outputs are
    torch allocations too.
    """
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def check_lesson_facts(facts: dict) -> dict:
    """Raise ValueError naming what is missing or extra when `facts` does not have lesson_facts.json's layout."""
    if not isinstance(facts, dict):
        raise ValueError(f"lesson facts must be a JSON object; got {type(facts).__name__}")
    problems = []
    if set(facts) != set(FACTS_TOP):
        problems.append(f"top-level keys {sorted(facts)}, expected {sorted(FACTS_TOP)}")
    for section, keys in FACTS_SCHEMA.items():
        got = facts.get(section)
        if not isinstance(got, dict) or set(got) != set(keys):
            problems.append(f"{section!r} has keys {sorted(got) if isinstance(got, dict) else got!r}, "
                            f"expected {sorted(keys)}")
    for name in ("unrolled", "dynamic"):
        got = (facts.get("local_memory") or {}).get(name)
        if not isinstance(got, dict) or set(got) != set(FACTS_KERNEL_KEYS):
            problems.append(f"local_memory[{name!r}] must have keys {list(FACTS_KERNEL_KEYS)}; got {got!r}")
    if problems:
        raise ValueError("lesson facts do not match the layout benchmarks/generators/lesson_facts.py writes: " + "; ".join(problems))
    return facts


def load_lesson_facts(path=None) -> dict:
    """The recorded launch and local-memory measurements (see benchmarks/generators/lesson_facts.py), checked."""
    path = Path(path) if path else FACTS_JSON
    with open(path) as f:
        return check_lesson_facts(json.load(f))


#: The columns of benchmarks/results/suite.csv (`python benchmarks/timing/bench_kernels.py --suite`: every shape).
SUITE_COLUMNS = ("direction", "variant", "dtype", "B", "H", "N", "d", "causal", "flashlab_tflops", "torch_tflops",
                 "ratio", "plan")


def geometric_mean(values) -> float:
    """exp(mean(log x)) of positive finite values; nan when there are none."""
    import math

    logs = [math.log(v) for v in values if isinstance(v, (int, float)) and v > 0 and math.isfinite(v)]
    return math.exp(sum(logs) / len(logs)) if logs else float("nan")


def suite_summary(rows) -> list:
    """Per (direction, variant, dtype), and per d within each: shapes, minimum ratio (and where), geometric mean
    and how many shapes are below 50%: what the suite prints and docs/performance.md quotes."""
    groups = {}
    for r in rows:
        for key in ((r["direction"], r["variant"], r["dtype"], "all d"), (r["direction"], r["variant"], r["dtype"],
                                                                          f"d={r['d']}")):
            groups.setdefault(key, []).append(r)
    out = []
    for (direction, variant, dtype, which), rs in groups.items():
        ok = [r for r in rs if isinstance(r["ratio"], (int, float)) and r["ratio"] == r["ratio"]]
        worst = min(ok, key=lambda r: r["ratio"]) if ok else None
        out.append({"direction": direction, "variant": variant, "dtype": dtype, "d": which, "shapes": len(rs),
                    "min_ratio": worst["ratio"] if worst else float("nan"),
                    "min_at": (f"B{worst['B']} H{worst['H']} N{worst['N']} d{worst['d']}"
                               + (" causal" if int(worst["causal"]) else "")) if worst else "",
                    "geomean_ratio": geometric_mean(r["ratio"] for r in ok),
                    "below_half": sum(r["ratio"] < 0.5 for r in ok)})
    return out
