"""Timing GPU work honestly (lesson 10, benchmarks/bench_kernels.py).

- CUDA events around the work, not host clocks: launches are asynchronous.
- Warm-up calls first, so compilation (Numba compiles on the first launch) and module loading are not timed.
- The median of at least 20 samples, not the mean: one hiccup on a shared machine cannot move it.

FLOP counts follow the FlashAttention papers: forward 4*B*H*Nq*Nk*d (two matrix products of 2*Nq*Nk*d),
halved under causal masking; backward 2.5x the forward (five matrix products instead of two).
"""
from __future__ import annotations

import statistics


def attention_flops(B: int, H: int, n_q: int, n_k: int, d: int, *, causal: bool = False,
                    backward: bool = False) -> float:
    """FLOPs of attention counted as the papers do (softmax and masking not counted)."""
    flops = 4.0 * B * H * n_q * n_k * d
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s from a FLOP count and a time in milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def _events():
    """(make_event, elapsed_ms, synchronize) from numba.cuda, which shares the default stream with torch."""
    from .device import get_cuda, has_gpu

    if not has_gpu():
        raise RuntimeError("GPU timing needs a CUDA GPU; in the simulator, time with time.perf_counter instead "
                           "(the simulator costs ~0.1 ms per thread)")
    cuda = get_cuda()
    return (lambda: cuda.event(timing=True)), cuda.event_elapsed_time, cuda.synchronize


def time_cuda(fn, *, warmup: int = 3, reps: int = 20) -> dict:
    """Time fn() on the GPU: `warmup` untimed calls, then `reps` samples each between two CUDA events.

    Returns {"median_ms", "min_ms", "max_ms", "samples_ms"}. fn must enqueue its work on the default
    stream (numba kernels and torch ops do, unless a stream is set).
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1; got {reps}")
    event, elapsed, sync = _events()
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        start, end = event(), event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(elapsed(start, end))
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "samples_ms": samples}


def peak_memory_mib(fn) -> float:
    """Peak device memory allocated through torch while fn() runs (MiB), above what was allocated before.

    Counts what torch's allocator hands out: pass torch tensors to flashlab's kernels so their outputs are
    torch allocations too.
    """
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
