"""Where the host time of one flashlab.torch attention call goes, on a GPU, at lesson 13's GPT shape (B 8, H 4,
N 1024, d 64, causal, bfloat16; q, k, v views of one linear output, as the GPT makes them):

    python benchmarks/profiling/torch_call_host.py [--calls 300]

1. Each layer of the call, from the public one down to the prepared kernel launch and the helpers a call runs,
   timed as the wall time of `--calls` calls in a row divided by their number (the GPU's queue absorbs the
   kernels, so the number is the host's time a call), and until the GPU has finished them (larger where the GPU
   is the bottleneck), beside torch's SDPA; and the operations of a forward + backward that wait for the GPU.
2. cProfile of the public forward and of forward + backward through autograd: the Python functions by own time.
3. torch.profiler over forward + backward steps of flashlab.torch, torch and an empty Python autograd Function (the
   floor of any custom Function): the operators by self CPU time.
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


def per_call(fn, calls, wall=False):
    """The host's time a call; with wall, also the time a call until the GPU has finished them all (larger than
    the host's where the GPU is the bottleneck)."""
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    return (host, (time.perf_counter() - t) / calls) if wall else host


def synchronising_calls(fn, calls=20):
    """The warnings torch.cuda.set_sync_debug_mode("warn") raises over `calls` calls: operations that wait for the
    GPU (a copy from pageable host memory, .item(), ...)."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in seen]


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

    class Empty(torch.autograd.Function):
        """A Python autograd Function that launches nothing: the floor of a custom Function's host time."""

        @staticmethod
        def forward(ctx, q, k, v, is_causal=False):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, do):
            return (*(torch.empty_like(t) for t in ctx.saved_tensors), None)

    def empty_function(q, k, v, is_causal=False):
        return Empty.apply(q, k, v, is_causal)

    def autograd_step(fn):
        qs, ks, vs = (t.view(B, N, H, d).transpose(1, 2) for t in leaf.split(H * d, dim=2))
        torch.autograd.grad(fn(qs, ks, vs, is_causal=True), leaf, do)

    o, lse = ft.flash_attention(q, k, v, causal=True)
    do_heads = do.transpose(1, 2).contiguous().transpose(1, 2)  # what a GPT's backward hands over: (B, N, H, d)
    grads = ft._backward(q, k, v, o, lse, do_heads, True, None)  # prepares and keeps the call
    kept_backward = ft._fast_call("backward", (q, k, v, o, lse, do_heads), True, None)
    print("gradients laid out like q:", all(g.stride() == torch.empty_like(t).stride() for g, t in zip(grads, (q, k, v))))
    rows = [
        ("flashlab.torch sdpa, no grad", lambda: ft.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("torch sdpa, no grad", lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("flashlab.torch sdpa forward + backward", lambda: autograd_step(ft.scaled_dot_product_attention)),
        ("torch sdpa forward + backward", lambda: autograd_step(Fn.scaled_dot_product_attention)),
        ("an empty Python autograd Function, fwd + bwd", lambda: autograd_step(empty_function)),
        ("kernels.flash_attention(variant='wgmma')", lambda: flash_attention(q, k, v, causal=True, variant="wgmma")),
        ("PreparedWgmma, called directly", lambda: direct(q, k, v)),
        ("flashlab.torch._backward, kept call", lambda: ft._backward(q, k, v, o, lse, do_heads, True, None)),
        ("PreparedWgmmaBackward, called directly", lambda: kept_backward(q, k, v, o, lse, do_heads)),
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
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
        with torch.no_grad() if "no grad" in name else torch.enable_grad():
            host, wall = per_call(fn, args.calls, wall=True)
        print(f"{name:45s} {host * 1e6:8.1f} us a call  (to the GPU's end {wall * 1e6:8.1f})", flush=True)
    # flashlab's own Python inside an autograd step: the forward's kept call and the whole backward, timed in place
    spent = {"forward": [], "backward": []}
    real_forward, real_backward = PreparedWgmma.__call__, ft._backward

    def timed(name, fn):
        def run(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent[name].append(time.perf_counter() - t)
            return out
        return run

    from flashlab.kernels import hopper

    real_encode, encodes = hopper._encode_tiled, []
    hopper._encode_tiled = lambda *a: encodes.append(1) or real_encode(*a)
    PreparedWgmma.__call__, ft._backward = timed("forward", real_forward), timed("backward", real_backward)
    try:
        total = per_call(lambda: autograd_step(ft.scaled_dot_product_attention), args.calls)
    finally:
        PreparedWgmma.__call__, ft._backward = real_forward, real_backward
        hopper._encode_tiled = real_encode
    inside = {name: sorted(v)[len(v) // 2] * 1e6 for name, v in spent.items()}
    print(f"inside an autograd step ({total * 1e6:.1f} us): the forward's kept call {inside['forward']:.1f} us, "
          f"flashlab.torch._backward {inside['backward']:.1f} us (medians); {len(encodes)} tensor maps encoded "
          f"in {args.calls + 5} steps", flush=True)
    import gc

    for name, fn in (("flashlab.torch", ft.scaled_dot_product_attention), ("torch", Fn.scaled_dot_product_attention),
                     ("an empty Function", empty_function)):
        gc.disable()
        try:
            t = per_call(lambda: autograd_step(fn), args.calls)
        finally:
            gc.enable()
        print(f"{name + ' fwd + bwd, garbage collector off':45s} {t * 1e6:8.1f} us a call", flush=True)
    for name, fn in (("flashlab.torch", ft.scaled_dot_product_attention), ("torch", Fn.scaled_dot_product_attention),
                     ("an empty Function", empty_function)):
        torch.autograd.set_multithreading_enabled(False)
        try:
            t = per_call(lambda: autograd_step(fn), args.calls)
        finally:
            torch.autograd.set_multithreading_enabled(True)
        print(f"{name + ' fwd + bwd, backward on the calling thread':45s} {t * 1e6:8.1f} us a call "
              "(torch.autograd.set_multithreading_enabled(False))", flush=True)
    for name, fn in (("flashlab.torch", ft.scaled_dot_product_attention), ("torch", Fn.scaled_dot_product_attention)):
        seen = synchronising_calls(lambda: autograd_step(fn))
        print(f"{name}: {len(seen)} synchronising operations in 20 forward + backward steps", *sorted(set(seen))[:5],
              sep="\n  ", flush=True)
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
    from torch.profiler import ProfilerActivity, profile
    for name, fn in (("flashlab.torch", ft.scaled_dot_product_attention), ("torch", Fn.scaled_dot_product_attention),
                     ("an empty Function", empty_function)):
        for _ in range(5):
            autograd_step(fn)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                autograd_step(fn)
        torch.cuda.synchronize()
        print(f"== torch.profiler, 50 forward + backward steps of {name}, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
