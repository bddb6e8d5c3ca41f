"""Where one small tensor-backward call spends its time, old package against this one (GPU):

    git archive OLD_REV flashlab | tar -x -C /tmp/old
    python benchmarks/profiling/backward_call_split.py /tmp/old [--shape 1,16,1024,32] [--dtype float16]

For each version: the wall time per call (calls back to back, synchronised every 20, median of rounds), the GPU
time of each kernel the call launches (torch.profiler's CUDA activity, which records Numba's launches too), and
their sum. A wall time above the kernels' sum is host time the GPU waits for; equal wall and kernel times mean the
call is GPU-bound, and a difference between versions is then the kernels'.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "timing"))


def wall_us(torch, fn, calls=20, rounds=15):
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def kernel_us(torch, fn, calls=50):
    """{kernel name: mean GPU µs per call} from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev:
            out[e.key[-24:]] = out.get(e.key[-24:], 0.0) + dev / calls  # the mangled name ends in the kernel's
    return out


def main():
    import torch

    from ab_kernels import load_old

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="a directory holding the old flashlab/ package")
    ap.add_argument("--shape", default="1,16,1024,32", help="B,H,N,d (default: %(default)s)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    B, H, N, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    import flashlab.kernels as new

    versions = {"old": load_old(args.old), "new": new}
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(4))
    print(f"GPU: {torch.cuda.get_device_name()}, backward tensor {args.dtype} B{B} H{H} N{N} d{d} "
          f"causal={args.causal}")
    fns = {}
    for name, K in versions.items():
        o, lse = K.flash_attention(q, k, v, causal=args.causal, variant="tensor")
        fns[name] = (lambda K=K, o=o, lse=lse: K.flash_attention_backward(q, k, v, o, lse, do, causal=args.causal,
                                                                         variant="tensor"))
        fns[name]()
    for name in ("old", "new", "old", "new"):  # twice, alternating, so drift shows
        wall = wall_us(torch, fns[name])
        kernels = kernel_us(torch, fns[name])
        total = sum(kernels.values())
        parts = ", ".join(f"{k} {t:.1f}" for k, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"{name}: wall {wall:6.1f} µs per call, kernels {total:6.1f} µs ({parts})")


if __name__ == "__main__":
    main()
