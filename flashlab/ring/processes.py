"""Running W ranks on one machine: spawned processes joined by gloo (CPU) or NCCL (GPUs).

    results = run_ranks(fn, 4, x, kwargs={"y": 1})   # fn(rank, world_size, x, y=1) on 4 processes

Each process initialises torch.distributed (a file in a fresh temporary folder is the meeting point, so no
port is needed), calls fn and sends its return value back. A rank that raises ends the run at once: the
other ranks are stopped (they may be waiting on a transfer from it that will never come) and run_ranks
raises a RankFailed that carries the rank and its traceback. A run past `timeout` seconds is stopped the
same way. `demo` is the worker of `python -m flashlab.ring` and of lesson 19's measurement.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback
from datetime import timedelta


class RankFailed(RuntimeError):
    """A rank raised (its traceback is in the message), or the ranks ran past their time."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


def _entry(rank, fn, world_size, folder, backend, threads, args, kwargs):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"file://{folder}/meeting", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args, **kwargs)
    except BaseException:  # note when and how this rank failed: the first to fail is the cause
        with open(os.path.join(folder, f"rank{rank}.error"), "wb") as f:
            pickle.dump((time.time(), traceback.format_exc()), f)
        raise
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.part"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(folder, f"rank{rank}.part"), os.path.join(folder, f"rank{rank}.pkl"))


#: Modules the fork server imports once, so that each rank starts in a fraction of a second instead of
#: importing torch again (seconds on a small machine).
PRELOAD = ["torch", "torch.distributed", "flashlab.ring.attention"]


def default_start_method() -> str:
    """"forkserver" where the platform has it (Linux, macOS): ranks fork from a server that has imported torch
    already and run no threads yet. Elsewhere "spawn"."""
    import multiprocessing

    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def run_ranks(fn, world_size, *args, kwargs=None, backend="gloo", timeout=60.0, threads=1, start_method=None):
    """[fn(rank, world_size, *args, **kwargs) for every rank], each rank a process with torch.distributed set up.

    fn must be importable (defined at the top of a module, not in a notebook cell). backend: "gloo" (CPU
    tensors) or "nccl" (one GPU per rank). threads: torch threads per rank. start_method: see
    default_start_method. Raises RankFailed naming the first
    rank that raised, with its traceback, or the ranks still running after `timeout` seconds.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    start_method = start_method or default_start_method()
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first run)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1; got {world_size}")
    folder = tempfile.mkdtemp(prefix="flashlab-ring-")
    try:
        context = mp.start_processes(_entry, args=(fn, world_size, folder, backend, threads, args, kwargs or {}),
                                     nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if context.join(timeout=0.2):
                    break
            except mp.ProcessRaisedException as exc:  # join() has stopped the other ranks already
                raise _first_failure(folder, world_size, exc.error_index, str(exc)) from None
            except mp.ProcessExitedException as exc:
                raise RankFailed(f"rank {exc.error_index} of {world_size} died ({exc})", exc.error_index) from None
            if time.monotonic() > deadline:
                running = [i for i, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    if p.is_alive():
                        p.terminate()
                for p in context.processes:
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                raise RankFailed(f"ranks {running} of {world_size} were still running after {timeout:g} s "
                                 "(waiting for a transfer that never came?) and were stopped")
        results = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _first_failure(folder, world_size, rank, message):
    """The rank that failed first: a rank that raised makes its neighbours fail too (a transfer breaks off),
    and those may be the ones torch reports."""
    failures = []
    for r in range(world_size):
        path = os.path.join(folder, f"rank{r}.error")
        try:
            with open(path, "rb") as f:
                when, text = pickle.load(f)
            failures.append((when, r, text))
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    if not failures:
        return RankFailed(f"rank {rank} of {world_size} raised:\n{message}", rank)
    failures.sort()
    when, first, text = failures[0]
    also = [r for _, r, _ in failures[1:]]
    after = f" (then rank{'s' if len(also) > 1 else ''} {', '.join(map(str, also))} failed too)" if also else ""
    return RankFailed(f"rank {first} of {world_size} raised{after}:\n{text}", first)


def demo(rank, world_size, B=1, H=4, H_kv=4, N=1024, d=64, causal=True, layout="zigzag", steps=3, seed=0,
         dtype="float32", device="cpu"):
    """One rank of the example: ring attention forward and backward on shards of the same random (B, H, N, d)
    inputs; the error of the gathered output and gradients against float64 attention on the full tensors
    (rank 0 computes it) and the median time of a forward and a backward. Returns a dict on every rank."""
    import torch
    import torch.distributed as dist

    from .attention import ring_attention
    from .layout import shard, unshard

    dev = torch.device(device if device == "cpu" else f"cuda:{rank % max(torch.cuda.device_count(), 1)}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, h, N, d, generator=g, dtype=torch.float64) for h in (H, H_kv, H_kv)]
    dout = torch.randn(B, H, N, d, generator=g, dtype=torch.float64)
    dt = getattr(torch, dtype)
    q, k, v = (shard(x, rank, world_size, layout).to(dev, dt).requires_grad_() for x in full)
    do = shard(dout, rank, world_size, layout).to(dev, dt)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    forward, backward = [], []
    for _ in range(steps + 1):  # the first round warms up (and compiles kernels on a GPU): not timed
        for x in (q, k, v):
            x.grad = None
        sync()
        t0 = time.perf_counter()
        o = ring_attention(q, k, v, causal=causal, layout=layout, check=False)
        sync()
        t1 = time.perf_counter()
        o.backward(do)
        sync()
        forward.append(t1 - t0)
        backward.append(time.perf_counter() - t1)
    out = {"rank": rank, "world_size": world_size, "N": N, "forward_s": sorted(forward[1:])[len(forward[1:]) // 2],
           "backward_s": sorted(backward[1:])[len(backward[1:]) // 2]}

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        return unshard([p.double().cpu() for p in parts], layout)

    got = [gather(x) for x in (o.detach(), q.grad, k.grad, v.grad)]
    if rank == 0:
        ref_in = [x.clone().requires_grad_() for x in full]
        ref = _attention64(*ref_in, causal=causal)
        ref.backward(dout)
        want = [ref.detach()] + [x.grad for x in ref_in]
        names = ("o", "dq", "dk", "dv")
        out["errors"] = {name: float((a - b).norm() / b.norm()) for name, a, b in zip(names, got, want)}
    return out


def _attention64(q, k, v, causal=False):
    """float64 attention with torch's autograd (GQA: each KV head serves H / H_kv query heads)."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    S = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[-2]
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(S, dim=-1) @ v


def measure(rank, world_size, N, H=4, d=64, causal=True, layout="zigzag", steps=3, seed=0):
    """One rank of benchmarks/timing/bench_ring.py: the best time of `steps` ring forwards and backwards on CPU
    float32 shards; per ring step of the best forward, the seconds of compute and of waiting for the next shard;
    and per ring step the least CPU time the compute took in any round (attention.TRACE). The first round warms
    up and is not counted."""
    import torch
    import torch.distributed as dist

    from . import attention
    from .layout import shard

    g = torch.Generator().manual_seed(seed)
    q, k, v = (shard(torch.randn(1, H, N, d, generator=g), rank, world_size, layout).requires_grad_()
               for _ in range(3))
    do = torch.randn_like(q)
    forward, backward, traces = [], [], []
    for i in range(steps + 1):
        attention.TRACE = []
        dist.barrier()
        t0 = time.perf_counter()
        o = attention.ring_attention(q, k, v, causal=causal, layout=layout, check=False)
        t1 = time.perf_counter()
        o.backward(do)
        t2 = time.perf_counter()
        dist.barrier()
        if i:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            traces.append(attention.TRACE)
    attention.TRACE = None

    best = forward.index(min(forward))  # the least disturbed round, on a machine shared with other work
    return {"rank": rank, "forward_s": forward[best], "backward_s": min(backward),
            "compute_s": [traces[best][t][1] for t in range(world_size)],
            "wait_s": [traces[best][t][2] for t in range(world_size)],
            "compute_cpu_s": [min(tr[t][3] for tr in traces) for t in range(world_size)]}
