"""Where the host time of one flashlab.torch attention call goes, on a GPU, at lesson 13's GPT shape (B 8, H 4,
N 1024, d 64, causal, bfloat16; q, k, v views of one linear output, as the GPT makes them):

    python benchmarks/profiling/torch_call_host.py [--calls 300]

1. Each layer of the call, from the public one down to the prepared kernel launch and the helpers a call runs,
   timed as the wall time of `--calls` calls in a row divided by their number (the GPU's queue absorbs the
   kernels, so the number is the host's time a call, unless the kernels take longer), beside torch's SDPA.
2. cProfile of the public forward and of forward + backward through autograd: the Python functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402,F401  (chooses the backend before numba.cuda is imported)


def per_call(fn, calls):
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as Fn

    import flashlab.torch as ft
    from flashlab.device import device_limits, has_gpu
    from flashlab.kernels import prepared, wgmma
    from flashlab.kernels.forward import PreparedWgmma, flash_attention

    B, H, N, d = 8, 4, 1024, 64
    x = torch.randn(B, N, 3 * H * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in x.split(H * d, dim=2))
    leaf = x.detach().requires_grad_()
    do = torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
    direct = PreparedWgmma(q, k, v, True, d ** -0.5, "bfloat16", wgmma.choose_tile(d, True))

    def autograd_step(fn):
        qs, ks, vs = (t.view(B, N, H, d).transpose(1, 2) for t in leaf.split(H * d, dim=2))
        torch.autograd.grad(fn(qs, ks, vs, is_causal=True), leaf, do)

    rows = [
        ("flashlab.torch sdpa, no grad", lambda: ft.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("torch sdpa, no grad", lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("flashlab.torch sdpa forward + backward", lambda: autograd_step(ft.scaled_dot_product_attention)),
        ("torch sdpa forward + backward", lambda: autograd_step(Fn.scaled_dot_product_attention)),
        ("kernels.flash_attention(variant='wgmma')", lambda: flash_attention(q, k, v, causal=True, variant="wgmma")),
        ("PreparedWgmma, called directly", lambda: direct(q, k, v)),
        ("device_limits()", device_limits),
        ("has_gpu()", has_gpu),
        ("flashlab.torch._cuda_variant(q)", lambda: ft._cuda_variant(q)),
        ("flashlab.torch._tma_readable(q)", lambda: ft._tma_readable(q)),
        ("wgmma.output_like(q)", lambda: wgmma.output_like(q)),
        ("wgmma.torch_map(q, 192)", lambda: wgmma.torch_map(q, 192)),
        ("prepared.current_stream(q)", lambda: prepared.current_stream(q)),
        ("torch.empty (B, H, N) float32", lambda: torch.empty((B, H, N), dtype=torch.float32, device="cuda")),
    ]
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"), f"B{B} H{H} N{N} d{d} causal bfloat16, GPT layout")
    for name, fn in rows:
        if "no grad" in name:
            with torch.no_grad():
                t = per_call(fn, args.calls)
        else:
            t = per_call(fn, args.calls)
        print(f"{name:45s} {t * 1e6:8.1f} us a call", flush=True)
    for name, fn in (("forward, no grad", lambda: ft.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     ("forward + backward", lambda: autograd_step(ft.scaled_dot_product_attention))):
        pr = cProfile.Profile()
        with torch.no_grad() if "no grad" in name else torch.enable_grad():
            pr.enable()
            for _ in range(200):
                fn()
            pr.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, 200 calls of flashlab.torch's {name}")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
