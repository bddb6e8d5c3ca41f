"""The GQA-decoding bar: paged decoding with H = 32 query heads on H_kv = 4 K/V heads (GQA 8:1), one query
per sequence, 32k cached keys, against multi-head decoding with 4 heads (the same K/V bytes) and torch SDPA with
enable_gqa, in the same run (GPU). Both variants of kernels.paged_decoding: "tensor" (the default for float16:
mma tiles, the group's heads as rows) and "register" (FP32 units):

    python benchmarks/timing/bench_paged.py [--n 32768] [--batch 4] [--page 256] [--json out.json] [--sweep 16 64 ...]

Two clocks. "call ms": CUDA events around whole calls (median of 20), host work included. Calls with torch tensors
take the prepared path (kernels/prepared.py) after the first: by default they check the block table and lengths on
the GPU and wait for the answer (one synchronisation); "unchecked" calls pass check_tables=False and never wait.
"GPU us": the kernels' own durations per call from the profiler (CUPTI),
for paged.prepare's run() (the split and merge kernels on prepared buffers) and for torch SDPA; the bar compares
these, since the traffic model is about the GPU's work. --sweep adds the tensor kernels at other split counts.

The traffic model: each K/V head's pages are read once by the packed block, so the bytes moved are those of
H_kv heads whatever H is; "GB/s" is those bytes over the GPU time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def gpu_us(fn, reps: int = 20) -> float:
    """Microseconds of GPU kernel time per call of fn, summed over its kernels (torch.profiler, CUPTI)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--json")
    ap.add_argument("--sweep", type=int, nargs="*", default=[], help="also time the tensor kernels at these splits")
    args = ap.parse_args(argv)
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_decoding, paged, paged_decoding

    B, N, d, P = args.batch, args.n, args.d, args.page
    dt = torch.float16
    rows = []
    print(f"{'':48s} {'call ms':>8s} {'GPU us':>8s} {'GB/s':>6s}")
    for H, H_kv in ((32, 4), (4, 4), (32, 32)):
        pages = B * N // P
        kc, vc = (torch.randn(pages, P, H_kv, d, device="cuda", dtype=dt) for _ in range(2))
        table = torch.randperm(pages, device="cuda").reshape(B, N // P).int()
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        q = torch.randn(B, H, 1, d, device="cuda", dtype=dt)
        k, v = (torch.randn(B, H_kv, N, d, device="cuda", dtype=dt) for _ in range(2))
        kv_bytes = 2 * B * N * H_kv * d * 2
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=H != H_kv)  # noqa: E731
        runs = {f"paged {v_} call": (lambda v_=v_: paged_decoding(q, kc, vc, table, lens, variant=v_), False)
                for v_ in ("tensor", "register")}
        runs["paged tensor call, unchecked"] = (
            lambda: paged_decoding(q, kc, vc, table, lens, variant="tensor", check_tables=False), False)
        for splits in (None,) + tuple(args.sweep):
            runs[f"paged tensor kernels, splits={splits or 'default'}"] = (
                paged.prepare(q, kc, vc, table, lens, num_splits=splits)[0], True)
        if H == H_kv:
            runs["flash_decoding call (contiguous K/V)"] = (lambda: flash_decoding(q, k, v), False)
        runs["torch SDPA (contiguous K/V)"] = (sdpa, True)
        for name, (fn, profiled) in runs.items():
            ms = time_cuda(fn)["median_ms"]
            us = gpu_us(fn) if profiled else None
            rows.append(dict(impl=name, H=H, H_kv=H_kv, call_ms=ms, gpu_us=us,
                             gb_s=kv_bytes / us / 1e3 if us else None))
            print(f"H={H:2d} H_kv={H_kv:2d} {name:40s} {ms:8.3f} " + (f"{us:8.1f} {kv_bytes / us / 1e3:6.0f}" if us else ""))
    pick = lambda impl, H: next(r for r in rows if r["impl"] == impl and r["H"] == H and r["H_kv"] == 4)  # noqa: E731
    kernels = "paged tensor kernels, splits=default"
    ratio = pick(kernels, 32)["gpu_us"] / pick(kernels, 4)["gpu_us"]
    calls = {v_: pick(f"paged {v_} call", 32)["call_ms"] / pick(f"paged {v_} call", 4)["call_ms"]
             for v_ in ("tensor", "register")}
    print(f"GQA 32:4 / MHA 4 heads, tensor kernels' GPU time: {ratio:.2f} (bar: at most 1.3)")
    print("the same ratio for whole calls: " + ", ".join(f"{v_} {r:.2f}" for v_, r in calls.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   B=B, N=N, d=d, page=P, rows=rows, gqa_over_mha_gpu=ratio,
                                                   gqa_over_mha_calls=calls), indent=1))


if __name__ == "__main__":
    main()
