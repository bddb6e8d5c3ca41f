"""The shape suite and the host-overhead measurement of benchmarks/timing/bench_kernels.py.

    python benchmarks/timing/bench_kernels.py --suite                      # everything below, ~15 min on an H100
    python benchmarks/timing/bench_kernels.py --suite --ds 128 --append    # a part of it, added to suite.csv
    python benchmarks/timing/bench_kernels.py --parts host                 # host time of one call, tiny inputs

Suite: B*H in {16 (B1 H16), 64 (B4 H16)}, N in {1024, 2048, 4096, 8192, 16384}, d in {32, 64, 128}, causal
and not, forward and backward; flashlab's register variant in float32 against torch SDPA in float32, and the
tensor-core variant (forward and backward) in float16 against SDPA in float16 and in float32 (3xTF32) against
SDPA float32, all in the same run. flashlab is called through its public API with torch tensors (flash_attention,
flash_attention_backward: host overhead included, as a user would see it). Timing: CUDA events, 2 warm-up
calls, median of --reps (default 20). FLOPs: forward 4*B*H*N^2*d (halved under causal), backward 2.5x that;
SDPA's backward = time(forward + backward) - time(forward). Every timed forward is also compared with SDPA in
float32: suite.csv's last column, max_abs_err, and a count in suite.md.

Writes to --out (default benchmarks/results/): suite.csv (flashlab.bench.SUITE_COLUMNS), suite.png (ratio
against N, one panel per d and direction), suite.md (minimum and geometric mean of the ratio per variant and
per d: docs/performance.md quotes it), suite_env.json (GPU, driver, versions), and suite_alternatives.csv: where the
plan splits the keys, orders causal blocks heaviest-first, or could use register.D128_REDESIGN, the same
shape timed the other way, to tune kernels/plan.py's thresholds on measurements.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from flashlab.bench import SUITE_COLUMNS, attention_flops, suite_summary, tflops, time_cuda, write_csv

SUITE_BH = ((1, 16), (4, 16))
SUITE_N = (1024, 2048, 4096, 8192, 16384)
SUITE_D = (32, 64, 128)
# (direction, flashlab variant, dtype): the torch baseline is SDPA in the same dtype
SUITE_RUNS = (("forward", "register", "float32"), ("forward", "tensor", "float16"), ("forward", "tensor", "float32"),
              ("backward", "register", "float32"), ("backward", "tensor", "float16"), ("backward", "tensor", "float32"))


def _median_ms(fn, reps):
    try:
        return time_cuda(fn, warmup=2, reps=reps)["median_ms"]
    except Exception as exc:  # e.g. out of memory
        import torch

        torch.cuda.empty_cache()
        print(f"    failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
        return float("nan")


def _inputs(B, H, N, d, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, N, d, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(4)]


def _torch_ms(direction, q, k, v, do, causal, reps):
    import torch.nn.functional as F

    if direction == "forward":
        return _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), reps)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fwd = _median_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal), reps)
    both = _median_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).backward(do), reps)
    return both - fwd


def _flashlab_fn(direction, variant, q, k, v, do, causal, plan=None):
    from flashlab.kernels import flash_attention, flash_attention_backward

    if direction == "forward":
        return lambda: flash_attention(q, k, v, causal=causal, variant=variant, plan=plan)
    o, lse = flash_attention(q, k, v, causal=causal, variant=variant)
    return lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant=variant)  # no alternatives


# A timed forward that is also wrong is worth nothing: each is compared with SDPA in float32 (max |error|),
# and flagged when the error passes this bound (inputs are N(0, 1), so |O| <= about 4).
CHECK_BOUND = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def _forward_error(fn, ref):
    got = fn()
    got = got[0] if isinstance(got, tuple) else got
    return float((got.float() - ref).abs().max())


def _reference(q, k, v, causal):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), is_causal=causal)


def _plan(direction, variant, dtype, B, H, N, d, causal, **kw):
    from flashlab.kernels.plan import plan

    return plan((B, H, N, N, d), variant=variant, direction=direction, causal=causal, dtype=dtype, **kw)


def _alternatives(direction, variant, dtype, B, H, N, d, causal, planned):
    """{name: plan} to time next to the planned launch."""
    from flashlab.kernels.register import D128_REDESIGN

    alts = {}
    if direction != "forward":
        return alts
    if planned.splits > 1:
        alts["no split"] = _plan(direction, variant, dtype, B, H, N, d, causal, splits=1)
    if planned.heavy_first:
        alts["per-head order"] = replace(planned, heavy_first=False)
    if variant == "register" and d == 128:
        alts["d128 redesign"] = _plan(direction, variant, dtype, B, H, N, d, causal, tile=D128_REDESIGN)
    return alts


def run_suite(out: Path, reps=20, bhs=SUITE_BH, ns=SUITE_N, ds=SUITE_D, runs=SUITE_RUNS, append=False,
              alternatives=True, resume=False, deadline_s=None):
    """Time every shape; `resume` keeps suite.csv's rows and skips shapes it already has (implies append);
    `deadline_s` starts no new shape after that many seconds (a run that must fit in a time limit)."""
    import torch
    from tqdm.auto import tqdm

    from flashlab.kernels import plan as planner

    planner.AUTO_SPLIT = True  # the suite measures the planner's own choices, split-KV included

    rows, alt_rows = [], []
    csv_path, alt_path = out / "suite.csv", out / "suite_alternatives.csv"
    if append or resume:
        rows, alt_rows = _read(csv_path), _read(alt_path)
    have = {_shape_key(r) for r in rows} if resume else set()
    shapes = [(B, H, N, d, causal) for B, H in bhs for d in ds for N in ns for causal in (False, True)]
    start = time.perf_counter()
    for B, H, N, d, causal in tqdm(shapes, desc="suite shapes"):
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            print(f"deadline of {deadline_s} s reached: stopping before B{B} H{H} N{N} d{d} causal={int(causal)}; "
                  "rerun with --resume", flush=True)
            break
        for dtype in sorted({r[2] for r in runs}):
            want = [(dr, va, dtype, B, H, N, d, int(causal)) for dr, va, dt in runs if dt == dtype]
            if all(tuple(map(str, w)) in have for w in want):
                continue
            q, k, v, do = _inputs(B, H, N, d, dtype)
            torch_ms = {}  # SDPA in this dtype, once per direction
            ref = _reference(q, k, v, causal)  # what every forward of this shape is checked against
            for direction, variant, dt in runs:
                if dt != dtype:
                    continue
                flops = attention_flops(B, H, N, N, d, causal=causal, backward=direction == "backward")
                planned = _plan(direction, variant, dtype, B, H, N, d, causal)
                fn = _flashlab_fn(direction, variant, q, k, v, do, causal)
                err = _forward_error(fn, ref) if direction == "forward" else float("nan")
                ms = _median_ms(fn, reps)
                if direction not in torch_ms:
                    torch_ms[direction] = _torch_ms(direction, q, k, v, do, causal, reps)
                ms_t = torch_ms[direction]
                row = {"direction": direction, "variant": variant, "dtype": dtype, "B": B, "H": H, "N": N, "d": d,
                       "causal": int(causal), "flashlab_tflops": round(tflops(flops, ms), 3),
                       "torch_tflops": round(tflops(flops, ms_t), 3), "ratio": round(ms_t / ms, 4),
                       "plan": planned.summary(), "max_abs_err": f"{err:.2e}"}
                rows = [r for r in rows if _shape_key(r) != _shape_key(row)] + [row]
                print(f"  {direction:8s} {variant:8s} {dtype:8s} B{B} H{H} N{N:5d} d{d:3d} causal={int(causal)} "
                      f"{row['flashlab_tflops']:7.2f} vs {row['torch_tflops']:7.2f} TFLOP/s: {row['ratio']:.2f}  "
                      f"[{row['plan']}]" + (f" err {err:.1e}" if err == err else "")
                      + ("  WRONG" if err > CHECK_BOUND[dtype] else ""), flush=True)
                if alternatives:
                    for name, alt in _alternatives(direction, variant, dtype, B, H, N, d, causal, planned).items():
                        ms_a = _median_ms(_flashlab_fn(direction, variant, q, k, v, do, causal, plan=alt), reps)
                        alt_rows = [r for r in alt_rows if _shape_key(r) + (r["alternative"],) !=
                                    _shape_key(row) + (name,)]
                        alt_rows.append({**{c: row[c] for c in SUITE_COLUMNS[:8]}, "alternative": name,
                                         "planned_tflops": row["flashlab_tflops"],
                                         "alternative_tflops": round(tflops(flops, ms_a), 3),
                                         "planned_over_alternative": round(ms_a / ms, 4), "plan": row["plan"],
                                         "alternative_plan": alt.summary()})
                        print(f"      {name:16s} {tflops(flops, ms_a):7.2f} TFLOP/s (planned/alternative "
                              f"{ms_a / ms:.2f})", flush=True)
                write_csv(csv_path, rows)  # saved as it goes: a run cut short keeps what it measured
                write_csv(alt_path, alt_rows)
            del q, k, v, do, ref
            torch.cuda.empty_cache()
    return rows


def _shape_key(r):
    return tuple(str(r[c]) for c in SUITE_COLUMNS[:8])


def _read(path):
    import csv

    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        return [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _num(v):
    try:
        x = float(v)
    except ValueError:
        return v
    return int(x) if x.is_integer() and "." not in v else x


def summary_text(rows, env=None) -> str:
    lines = []
    if env:
        lines += [f"{env.get('gpu', '?')}, driver {env.get('nvidia_driver', '?')}, torch {env.get('torch', '?')}, "
                  f"numba-cuda {env.get('numba_cuda', '?')}", ""]
    lines += ["| direction | variant | dtype | d | shapes | min ratio | at | geometric mean | below 50% |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = {"forward": 0, "backward": 1}
    for s in sorted(suite_summary(rows), key=lambda s: (order.get(s["direction"], 2), s["variant"], s["dtype"],
                                                        s["d"] != "all d", int(s["d"][2:]) if s["d"] != "all d" else 0)):
        lines.append(f"| {s['direction']} | {s['variant']} | {s['dtype']} | {s['d']} | {s['shapes']} | "
                     f"{s['min_ratio']:.0%} | {s['min_at']} | {s['geomean_ratio']:.0%} | {s['below_half']} |")
    errors = [(r, float(r.get("max_abs_err", "nan"))) for r in rows]
    checked = [r for r, err in errors if not math.isnan(err)]
    wrong = [r for r, err in errors if err > CHECK_BOUND[r["dtype"]]]
    if checked:
        lines += ["", f"Forward outputs compared with SDPA in float32: {len(checked)} checked, {len(wrong)} over the "
                      f"bound {CHECK_BOUND}" + "".join(f"\n- over: {_shape_key(r)} {r['max_abs_err']}" for r in wrong)]
    return "\n".join(lines)


COLORS = {("register", "float32"): "tab:blue", ("tensor", "float32"): "tab:green",
          ("tensor", "float16"): "tab:orange", ("tensor", "bfloat16"): "tab:red"}


def plot_suite(rows, path, env=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = [dr for dr in ("forward", "backward") if any(r["direction"] == dr for r in rows)]
    ds = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(len(directions), len(ds), figsize=(4.6 * len(ds), 3.4 * len(directions)),
                             squeeze=False, sharey=True)
    for i, direction in enumerate(directions):
        for j, d in enumerate(ds):
            ax = axes[i][j]
            sel = [r for r in rows if r["direction"] == direction and r["d"] == d]
            for key in sorted({(r["variant"], r["dtype"], r["B"], r["H"], r["causal"]) for r in sel}):
                pts = sorted((r["N"], r["ratio"]) for r in sel
                             if (r["variant"], r["dtype"], r["B"], r["H"], r["causal"]) == key)
                variant, dtype, B, H, causal = key
                ax.plot(*zip(*pts), marker="o" if B == 1 else "s", ls="--" if causal else "-",
                        color=COLORS.get((variant, dtype), "0.3"), alpha=1.0 if B == 1 else 0.6,
                        label=f"{variant} {dtype} B{B}H{H}" + (" causal" if causal else ""))
            ax.axhline(1.0, color="0.5", lw=0.8)
            ax.axhline(0.5, color="0.7", lw=0.8, ls=":")
            ax.set(xscale="log", xlabel="N", title=f"{direction}, d = {d}")
            ax.set_xticks(SUITE_N, [str(n) for n in SUITE_N])
            ax.grid(True, alpha=0.3)
        axes[i][0].set_ylabel("flashlab / torch SDPA (same dtype)")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if env:
        fig.suptitle(f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, numba-cuda {env.get('numba_cuda', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def host_overhead(reps=2000):
    """Host time (µs) of one call on tiny inputs (B1 H1 N16 d64 float32): the CPU time before it returns,
    averaged over `reps` calls (synchronised every 200 so the launch queue never fills)."""
    import torch
    import torch.nn.functional as F

    from flashlab.device import get_cuda
    from flashlab.kernels import flash_attention, flash_attention_backward, prepared

    cuda = get_cuda()
    q, k, v, do = (torch.randn(1, 1, 16, 64, device="cuda") for _ in range(4))
    o, lse = flash_attention(q, k, v)
    qd, kd, vd, od, lsed, dod = (cuda.as_cuda_array(x) for x in (q, k, v, o, lse, do))

    def per_call(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for start in range(0, reps, 200):
            t = time.perf_counter()
            for _ in range(min(200, reps - start)):
                fn()
            total += time.perf_counter() - t
            torch.cuda.synchronize()
        return total / reps * 1e6

    cases = {"forward, torch tensors in": lambda: flash_attention(q, k, v),
             "forward, torch tensors in, causal": lambda: flash_attention(q, k, v, causal=True),
             "forward tensor variant, torch tensors in": lambda: flash_attention(q, k, v, variant="tensor"),
             "backward, torch tensors in": lambda: flash_attention_backward(q, k, v, o, lse, do),
             "forward, numba device arrays in": lambda: flash_attention(qd, kd, vd),
             "backward, numba device arrays in": lambda: flash_attention_backward(qd, kd, vd, od, lsed, dod)}
    ways = (("prepared call, cuLaunchKernel (default)", {}),
            ("prepared call, cuda.core launch", {"FLASHLAB_DIRECT_LAUNCH": "0"}),
            ("general path", {"FLASHLAB_FAST_LAUNCH": "0"}))
    if prepared.launch_mode() == "direct":  # started with FLASHLAB_FAST_LAUNCH=direct: cuLaunchKernel alone
        ways = ((f"prepared call, cuLaunchKernel (FLASHLAB_FAST_LAUNCH=direct, {prepared.state()})", {}),
                ("general path", {"FLASHLAB_FAST_LAUNCH": "0"}))
    rows = []
    for name, fn in cases.items():
        for way, env in ways if "torch tensors" in name else (("general path", {}),):
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            prepared._CALLS.clear()  # prepared calls remember how they launch
            try:
                rows.append({"call": f"{name}: {way}", "host_us": round(per_call(fn), 2)})
            finally:
                for key, value in saved.items():
                    if value is None:
                        del os.environ[key]
                    else:
                        os.environ[key] = value
    rows.append({"call": "torch SDPA forward (for scale)",
                 "host_us": round(per_call(lambda: F.scaled_dot_product_attention(q, k, v)), 2)})
    for r in rows:
        print(f"  host {r['call']:80s} {r['host_us']:8.2f} µs", flush=True)
    return rows


def main_suite(args, env):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:  # keep the GPU machine's environment, not this one's
        env = json.loads((out / "suite_env.json").read_text())
    else:
        (out / "suite_env.json").write_text(json.dumps(env, indent=1) + "\n")
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    bhs = tuple(b for b in SUITE_BH if b[0] * b[1] in ints(args.bh))
    runs = tuple(r for r in SUITE_RUNS if r[0] in args.directions.split(",")
                 and (args.dtypes is None or r[2] in args.dtypes.split(",")))
    if not args.replot:
        run_suite(out, reps=args.reps, bhs=bhs, ns=ints(args.ns), ds=ints(args.ds), runs=runs, append=args.append,
                  alternatives=not args.no_alternatives, resume=args.resume, deadline_s=args.deadline)
    rows = _read(out / "suite.csv")
    if rows:
        plot_suite(rows, out / "suite.png", env)
        text = summary_text(rows, env)
        (out / "suite.md").write_text(text + "\n")
        print(text)
    return 0


def add_arguments(ap):
    ap.add_argument("--suite", action="store_true", help="run the shape suite instead of --parts")
    ap.add_argument("--bh", default="16,64", help="suite: B*H values (16 = B1 H16, 64 = B4 H16)")
    ap.add_argument("--ns", default=",".join(map(str, SUITE_N)), help="suite: sequence lengths")
    ap.add_argument("--ds", default=",".join(map(str, SUITE_D)), help="suite: head dims")
    ap.add_argument("--directions", default="forward,backward", help="suite: forward, backward or both")
    ap.add_argument("--dtypes", default=None, help="suite: only these runs' dtypes (float32, float16)")
    ap.add_argument("--append", action="store_true", help="suite: add to (and replace rows of) the existing suite.csv")
    ap.add_argument("--resume", action="store_true", help="suite: keep suite.csv and time only the shapes it lacks")
    ap.add_argument("--deadline", type=float, default=None, help="suite: start no new shape after this many seconds")
    ap.add_argument("--replot", action="store_true", help="suite: only redraw suite.png and suite.md from suite.csv")
    ap.add_argument("--no-alternatives", action="store_true", help="suite: skip suite_alternatives.csv")

