"""The sliding-window bar: window_size=(1024, 0) at N16384 against causal full attention at the same shape
(the window's work is about 1/8 of it), flashlab's register kernel and torch SDPA (an explicit boolean mask for the
window, is_causal for full) in the same run (GPU; CUDA events, median of 20):

    python benchmarks/timing/bench_window.py [--n 16384] [--d 64] [--heads 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_attention
    from flashlab.reference import attention_mask

    N, d, H, W = args.n, args.d, args.heads, args.window
    q, k, v = (torch.randn(1, H, N, d, device="cuda") for _ in range(3))
    mask = torch.from_numpy(attention_mask(N, N, causal=True, window_size=(W, 0))).cuda()
    f = torch.nn.functional.scaled_dot_product_attention
    runs = {
        "flashlab causal": lambda: flash_attention(q, k, v, causal=True, variant="register"),
        f"flashlab window ({W}, 0)": lambda: flash_attention(q, k, v, causal=True, window_size=(W, 0),
                                                            variant="register"),
        "torch SDPA causal": lambda: f(q, k, v, is_causal=True),
        f"torch SDPA window ({W}, 0), explicit mask": lambda: f(q, k, v, attn_mask=mask),
    }
    rows = {name: time_cuda(fn)["median_ms"] for name, fn in runs.items()}
    for name, ms in rows.items():
        print(f"{name:45s} {ms:9.3f} ms")
    share = rows[f"flashlab window ({W}, 0)"] / rows["flashlab causal"]
    print(f"window / causal (flashlab): {share:.1%} (bar: at most 20%; work ratio about {W / (N / 2):.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, N=N,
                                                   d=d, H=H, window=W, ms=rows, window_over_causal=share), indent=1))


if __name__ == "__main__":
    main()
