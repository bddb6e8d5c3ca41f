"""NumPy FA2 forward vs naive NumPy attention on the CPU: time and peak extra memory.

    python benchmarks/timing/bench_numpy.py [--n 4096] [--d 64] [--repeats 5] [--out benchmarks/results/numpy_cpu.md]

One head, float32. Time is the median of `repeats` runs after one warm-up. Peak extra memory is what
tracemalloc sees NumPy allocate during one call (inputs excluded). Writes a markdown table with the machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np

import flashlab as fl


def measure(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((args.n, args.d)).astype(np.float32) for _ in range(3))

    runs = {"naive (S and P materialised)": lambda: fl.naive_attention(q, k, v)}
    default = fl.default_block_sizes(args.d)
    for bq, bk in [default, (256, 256), (512, 1024)]:
        label = f"FA2 block_q={bq}, block_k={bk}" + (" (default)" if (bq, bk) == default else "")
        runs[label] = lambda bq=bq, bk=bk: fl.flash_attention_v2(q, k, v, block_q=bq, block_k=bk)

    rows = []
    for label, fn in runs.items():
        t, peak = measure(fn, args.repeats)
        rows.append((label, t, peak))
        print(f"{label:40s} {t * 1e3:9.1f} ms   peak extra {peak / 2**20:8.2f} MiB", flush=True)

    naive_t, naive_peak = rows[0][1], rows[0][2]
    lines = [
        f"NumPy attention forward on the CPU: N = {args.n}, d = {args.d}, one head, float32, "
        f"median of {args.repeats} after a warm-up.",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, NumPy {np.__version__}.",
        "",
        "| implementation | time (ms) | vs naive | peak extra memory (MiB) | naive / this |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, t, peak in rows:
        lines.append(f"| {label} | {t * 1e3:.1f} | {t / naive_t:.2f}x | {peak / 2**20:.2f} | {naive_peak / peak:.1f}x |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# NumPy FA2 vs naive attention (CPU)\n\nCommand: `python benchmarks/timing/bench_numpy.py --out {args.out}`\n\n{table}\n")


if __name__ == "__main__":
    main()
