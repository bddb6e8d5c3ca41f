"""Issue 14's GQA-decoding bar: paged decoding with H = 32 query heads on H_kv = 4 K/V heads (GQA 8:1), one query
per sequence, 32k cached keys, against multi-head decoding with 4 heads (the same K/V bytes) and torch SDPA with
enable_gqa, in the same run (GPU; CUDA events, median of 20):

    python benchmarks/bench_paged.py [--n 32768] [--batch 4] [--page 256] [--json out.json]

The traffic model: each K/V head's pages are read once by the packed block, so the bytes moved are those of
H_kv heads; the flashlab rows print their effective bandwidth against the GPU's copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_decoding, paged_decoding

    B, N, d, P = args.batch, args.n, args.d, args.page
    dt = torch.float16
    rows = []
    for H, H_kv in ((32, 4), (4, 4), (32, 32)):
        pages = B * N // P
        kc, vc = (torch.randn(pages, P, H_kv, d, device="cuda", dtype=dt) for _ in range(2))
        table = torch.randperm(pages, device="cuda").reshape(B, N // P).int()
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        q = torch.randn(B, H, 1, d, device="cuda", dtype=dt)
        ms = time_cuda(lambda: paged_decoding(q, kc, vc, table, lens))["median_ms"]
        kv_bytes = 2 * B * N * H_kv * d * 2
        rows.append(dict(impl="flashlab paged", H=H, H_kv=H_kv, ms=ms, gb_s=kv_bytes / ms / 1e6))
        k, v = (torch.randn(B, H_kv, N, d, device="cuda", dtype=dt) for _ in range(2))
        if H == H_kv:
            ms = time_cuda(lambda: flash_decoding(q, k, v))["median_ms"]
            rows.append(dict(impl="flashlab flash_decoding (contiguous)", H=H, H_kv=H_kv, ms=ms, gb_s=kv_bytes / ms / 1e6))
        f = torch.nn.functional.scaled_dot_product_attention
        ms = time_cuda(lambda: f(q, k, v, enable_gqa=H != H_kv))["median_ms"]
        rows.append(dict(impl="torch SDPA (contiguous)", H=H, H_kv=H_kv, ms=ms, gb_s=kv_bytes / ms / 1e6))
        for r in rows[-3:]:
            if r["H"] == H:
                print(f"{r['impl']:40s} H={H:2d} H_kv={H_kv:2d} {r['ms']:8.3f} ms {r['gb_s']:7.0f} GB/s of K/V")
    gqa = next(r["ms"] for r in rows if r["impl"] == "flashlab paged" and r["H"] == 32 and r["H_kv"] == 4)
    mha4 = next(r["ms"] for r in rows if r["impl"] == "flashlab paged" and r["H"] == 4)
    print(f"GQA 32:4 / MHA 4 heads: {gqa / mha4:.2f} (bar: at most 1.3)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   B=B, N=N, d=d, page=P, rows=rows, gqa_over_mha=gqa / mha4), indent=1))


if __name__ == "__main__":
    main()
