"""Where the tensor-core paged decoding's time goes: the split and merge kernels of paged.prepare, for MHA with
4 heads and GQA 32:4 (the same K/V bytes), under Nsight Compute (GPU):

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__grid_size python benchmarks/profiling/profile_paged.py [--n 32768] [--batch 4]

Each case runs once to compile, then once more (the launches to read in ncu's report are the last two per case).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--splits", type=int, default=None)
    args = ap.parse_args(argv)
    import torch

    from flashlab.kernels import paged

    B, N, d, P = args.batch, args.n, args.d, args.page
    for H, H_kv in ((4, 4), (32, 4)):
        pages = B * N // P
        kc, vc = (torch.randn(pages, P, H_kv, d, device="cuda", dtype=torch.float16) for _ in range(2))
        table = torch.randperm(pages, device="cuda").reshape(B, N // P).int()
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.float16)
        run = paged.prepare(q, kc, vc, table, lens, num_splits=args.splits)[0]
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        print(f"H={H} H_kv={H_kv}: done", flush=True)


if __name__ == "__main__":
    main()
