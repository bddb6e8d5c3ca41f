"""Decoding benchmark: one query (Nq = 1) against a long KV cache, on this machine's GPU. One command:

    python benchmarks/timing/bench_decoding.py --out benchmarks/results/decoding.md

Compares, in the same run (CUDA events, 3 warm-up calls so compilation is excluded, median of --reps >= 20):
  FA2 kernel      flashlab.kernels.flash_attention (variant "register"): parallel over query blocks, so
                  at Nq = 1 it has one thread block per (batch, head)
  split-KV, 1     flashlab.kernels.decoding.flash_decoding with num_splits=1 (same kernel, no key split)
  split-KV        the same with the default number of splits (decoding.default_num_splits for this GPU)
  torch SDPA      torch.nn.functional.scaled_dot_product_attention, when torch has CUDA (for scale)
Decoding reads all of K and V once and does little arithmetic per byte, so the table reports the time and
the bandwidth it reaches: bytes of K and V (2 * B * H * Nk * d * itemsize) divided by the time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402  (chooses the backend before numba.cuda is imported)
from flashlab.bench import time_cuda  # noqa: E402


def configs(quick: bool):
    lengths = (4096, 32768) if quick else (1024, 4096, 16384, 65536)
    shapes = ((1, 16, 128),) if quick else ((1, 16, 128), (8, 32, 128), (1, 32, 64))
    for dtype in (np.float16, np.float32):
        for B, H, d in shapes:
            for nk in lengths:
                if B * H * nk * d * 2 * np.dtype(dtype).itemsize <= 4 * 2**30:  # K + V at most 4 GiB
                    yield B, H, nk, d, dtype


def run(B, H, nk, d, dtype, reps, cuda, torch):
    from flashlab.decoding import default_num_splits
    from flashlab.device import device_limits
    from flashlab.kernels import flash_attention
    from flashlab.kernels.decoding import flash_decoding

    rng = np.random.default_rng(0)
    q, k, v = (cuda.to_device(rng.standard_normal((B, H, n, d), dtype=np.float32).astype(dtype)) for n in (1, nk, nk))
    splits = default_num_splits(B * H, nk, n_sm=device_limits()["sms"])
    impls = {"FA2 kernel": lambda: flash_attention(q, k, v),
             "split-KV, 1 split": lambda: flash_decoding(q, k, v, num_splits=1),
             f"split-KV, {splits} splits": lambda: flash_decoding(q, k, v, num_splits=splits)}
    if torch is not None:
        tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
        impls["torch SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
    # Correctness too: every implementation against the float64 reference, on the first (batch, head)s.
    sub = (slice(0, 1), slice(0, 4))
    ref, _ = flashlab.reference_attention(*(x.copy_to_host()[sub] for x in (q, k, v)))
    rows = []
    gbytes = 2 * B * H * nk * d * np.dtype(dtype).itemsize / 1e9
    for name, fn in impls.items():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out = out.cpu().numpy() if hasattr(out, "cpu") else out.copy_to_host()
        err = flashlab.relative_error(out[sub], ref)
        ms = time_cuda(fn, warmup=3, reps=reps)["median_ms"]
        rows.append((name, ms, gbytes / (ms * 1e-3), err))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two cache lengths, one shape")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, help="also write the table as markdown here")
    args = ap.parse_args(argv)
    if args.reps < 20:
        ap.error("--reps must be at least 20")
    from flashlab.device import device_limits, get_cuda, has_gpu

    if not has_gpu():
        sys.exit("bench_decoding.py needs a CUDA GPU (the simulator is ~1000x slower; timings would mean nothing)")
    cuda = get_cuda()
    try:
        import torch

        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    lim = device_limits()
    lines = [f"GPU: {lim['name']} ({lim['sms']} SMs). Nq = 1, no mask, CUDA-event medians of {args.reps} "
             "after 3 warm-up calls (compilation excluded). GB/s = bytes of K and V / time. err = relative error of o vs float64 (first 4 heads).", "",
             "| B | H | Nk | d | dtype | implementation | time (us) | GB/s | vs FA2 kernel | err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for B, H, nk, d, dtype in configs(args.quick):
        rows = run(B, H, nk, d, dtype, args.reps, cuda, torch)
        base = rows[0][1]
        for name, ms, gbs, err in rows:
            line = (f"| {B} | {H} | {nk} | {d} | {np.dtype(dtype).name} | {name} | {ms * 1e3:.1f} | {gbs:.0f} | "
                    f"{base / ms:.1f}x | {err:.1e} |")
            lines.append(line)
            print(line, flush=True)
        if args.out:  # after every shape, so a run cut short still leaves its rows
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
