"""Every kernel of the suite before and after a change, in one process on one GPU: speed and bits.

    git archive OLD_REV flashlab | tar -x -C /tmp/old           # the old package, anywhere
    python benchmarks/timing/ab_kernels.py /tmp/old out.csv      # this checkout against it
    python benchmarks/timing/ab_kernels.py /tmp/old out.csv --runs forward --resume --deadline 500
    python benchmarks/timing/ab_kernels.py /tmp/old out.csv --runs wgmma --n 4096,16384 --d 64,128   # Hopper
    python benchmarks/timing/ab_kernels.py --summary out.csv

The old package is imported under another name (flashlab_old; its imports are relative), so both versions run in
the same process, on the same inputs and the same GPU state. For each shape of benchmarks/timing/suite.py (B, H,
N, d, causal) and each of its runs (direction, variant, dtype), both versions are called through the public
entry points (torch tensors: the prepared path), then timed in rounds that alternate which goes first: the median
of `reps` CUDA-event samples per round, and the median of the rounds. A row also says whether the outputs are the
same bits (both backwards add dQ with atomics in whatever order blocks finish: its dQ is compared within
a tolerance instead, and marked).

The summary prints, per run, the largest slowdown (new / old - 1) and the geometric mean, and the shapes more
than 2% slower.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "timing"))

from suite import SUITE_BH, SUITE_D, SUITE_N, SUITE_RUNS  # noqa: E402

# Hopper's FlashAttention-3 kernels (compute capability 9.0 only): not in the suite's default runs; --runs wgmma
WGMMA_RUNS = tuple((direction, "wgmma", dtype) for direction in ("forward", "backward")
                   for dtype in ("float16", "bfloat16"))
COLUMNS = ("direction", "variant", "dtype", "B", "H", "N", "d", "causal", "old_ms", "new_ms", "ratio", "rounds",
           "same_bits", "note")


def load_old(old_dir: Path):
    """The package under old_dir/flashlab, imported as flashlab_old."""
    tmp = Path(tempfile.mkdtemp(prefix="flashlab_old_"))
    shutil.copytree(old_dir / "flashlab", tmp / "flashlab_old")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("flashlab_old.kernels")


def calls(K, direction, variant, q, k, v, do, causal):
    """(function to time, outputs to compare) through package K's entry points."""
    if direction == "forward":
        fn = lambda: K.flash_attention(q, k, v, causal=causal, variant=variant)  # noqa: E731
        return fn, fn
    o, lse = K.flash_attention(q, k, v, causal=causal, variant=variant)
    fn = lambda: K.flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant=variant)  # noqa: E731
    return fn, fn


def median_ms(torch, fn, reps):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def same(torch, a, b, atomics_dq):
    """'yes' when every output is the same bits; 'dq~' when only a backward's dQ differs, by at most one unit in the
    last place of its dtype (float32 for float32) relative to its largest entry: both backwards add dQ with atomics,
    in whatever order blocks finish, so two runs of the same code differ there."""
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    note = "yes"
    for i, (x, y) in enumerate(zip(a, b)):
        if torch.equal(x, y):
            continue
        ulp = max(1e-5, torch.finfo(y.dtype).eps) if y.is_floating_point() else 0.0
        if atomics_dq and i == 0 and float((x.float() - y.float()).abs().max()) <= ulp * float(y.float().abs().max()):
            note = "dq~"
            continue
        return "NO"
    return note


def run(old_dir: Path, out: Path, runs, reps: int, rounds: int, resume: bool, deadline: float | None, ns, ds, bhs):
    import torch

    import flashlab.kernels as new
    from flashlab.kernels import plan as new_plan

    old = load_old(old_dir)
    old_plan = importlib.import_module("flashlab_old.kernels.plan")
    new_plan.AUTO_SPLIT = old_plan.AUTO_SPLIT = True  # the suite measures the planner's own choices
    rows = []
    if resume and out.exists():
        rows = list(csv.DictReader(out.open()))
    done = {tuple(r[c] for c in COLUMNS[:8]) for r in rows}
    start = time.perf_counter()
    print(torch.cuda.get_device_name(), "old:", old.__file__, "new:", new.__file__, flush=True)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    shapes = [(B, H, N, d, c) for B, H in bhs for d in ds for N in ns for c in (False, True)]
    for direction, variant, dtype in runs:
        for B, H, N, d, causal in shapes:
            key = (direction, variant, dtype, str(B), str(H), str(N), str(d), str(causal))
            if key in done:
                continue
            if deadline is not None and time.perf_counter() - start > deadline:
                print(f"deadline reached before {key}: rerun with --resume", flush=True)
                return rows
            g = torch.Generator(device="cuda").manual_seed(N * 131 + d)
            q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dtypes[dtype], generator=g) for _ in range(4))
            fn_old, out_old = calls(old, direction, variant, q, k, v, do, causal)
            fn_new, out_new = calls(new, direction, variant, q, k, v, do, causal)
            bits = same(torch, out_old(), out_new(), direction == "backward")
            for fn in (fn_old, fn_new):
                for _ in range(3):
                    fn()
            t_old, t_new = [], []
            for r in range(rounds):
                order = ((t_old, fn_old), (t_new, fn_new)) if r % 2 == 0 else ((t_new, fn_new), (t_old, fn_old))
                for times, fn in order:
                    times.append(median_ms(torch, fn, reps))
            a, b = statistics.median(t_old), statistics.median(t_new)
            row = dict(zip(COLUMNS, key + (f"{a:.4f}", f"{b:.4f}", f"{b / a:.4f}", rounds, bits, "")))
            rows.append(row)
            print(" ".join(str(row[c]) for c in COLUMNS), flush=True)
            with out.open("w", newline="") as f:
                w = csv.DictWriter(f, COLUMNS)
                w.writeheader()
                w.writerows(rows)
    return rows


def summary(rows, limit=1.02):
    groups = {}
    for r in rows:
        groups.setdefault((r["direction"], r["variant"], r["dtype"]), []).append(r)
    print("| direction | variant | dtype | shapes | worst new/old | at | geometric mean | over 2% | outputs same bits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    slow = []
    for (direction, variant, dtype), rs in groups.items():
        ratios = [float(r["ratio"]) for r in rs]
        worst = max(rs, key=lambda r: float(r["ratio"]))
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        over = [r for r in rs if float(r["ratio"]) > limit]
        slow += over
        same_bits = sum(r["same_bits"] in ("yes", "dq~") for r in rs)
        at = f"B{worst['B']} H{worst['H']} N{worst['N']} d{worst['d']}{' causal' if worst['causal'] == 'True' else ''}"
        print(f"| {direction} | {variant} | {dtype} | {len(rs)} | {float(worst['ratio']):.3f} | {at} | {gm:.3f} | "
              f"{len(over)} | {same_bits}/{len(rs)} |")
    for r in slow:
        print("over 2%:", " ".join(str(r[c]) for c in COLUMNS))
    return slow


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", nargs="?", type=Path, help="a directory holding the old flashlab/ package")
    ap.add_argument("out", nargs="?", type=Path, default=Path("ab_kernels.csv"))
    ap.add_argument("--runs", default="", help="comma-separated filters on 'direction variant dtype' (substrings)")
    ap.add_argument("--n", default="", help="comma-separated sequence lengths (default: the suite's)")
    ap.add_argument("--d", default="", help="comma-separated head dims (default: the suite's)")
    ap.add_argument("--bh", default="", help="comma-separated BxH pairs such as 1x16,4x16 (default: the suite's)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--deadline", type=float, default=None, help="start no new shape after this many seconds")
    ap.add_argument("--summary", type=Path, default=None, help="print the summary of a CSV and exit")
    a = ap.parse_args()
    if a.summary:
        summary(list(csv.DictReader(a.summary.open())))
        return
    runs = [r for r in SUITE_RUNS + WGMMA_RUNS if (not a.runs and r in SUITE_RUNS)
            or (a.runs and any(f in " ".join(r) for f in a.runs.split(",")))]
    ns = tuple(int(x) for x in a.n.split(",")) if a.n else SUITE_N
    ds = tuple(int(x) for x in a.d.split(",")) if a.d else SUITE_D
    bhs = tuple(tuple(int(y) for y in x.split("x")) for x in a.bh.split(",")) if a.bh else SUITE_BH
    rows = run(a.old, a.out, runs, a.reps, a.rounds, a.resume, a.deadline, ns, ds, bhs)
    summary(rows)


if __name__ == "__main__":
    main()
