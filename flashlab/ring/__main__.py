"""python -m flashlab.ring --world-size 4: ring attention on W CPU processes (gloo), checked and timed.

Prints the error of the gathered output and gradients against float64 attention on the full tensors, and
the median time of a forward and a backward. Under torchrun (which sets RANK and WORLD_SIZE) every process
runs one rank itself: `torchrun --nproc-per-node 4 -m flashlab.ring` (add `--device cuda` on GPUs: NCCL).
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashlab.ring", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--seq-len", type=int, default=1024, help="the length N of the whole sequence")
    p.add_argument("--head-dim", type=int, default=64, help="the head dimension d")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default: --heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--steps", type=int, default=3, help="timed repetitions (after one untimed)")
    p.add_argument("--dtype", default="float32", choices=("float16", "bfloat16", "float32", "float64"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    kw = dict(B=a.batch, H=a.heads, H_kv=a.kv_heads or a.heads, N=a.seq_len, d=a.head_dim, causal=not a.no_causal,
              layout=a.layout, steps=a.steps, dtype=a.dtype, device=a.device)
    from .processes import demo, run_ranks

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        import torch.distributed as dist

        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
        try:
            out = demo(rank, world_size, **kw)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            _report(out, kw)
        return 0
    backend = "nccl" if a.device == "cuda" else "gloo"
    print(f"spawning {a.world_size} processes ({backend}) ...", flush=True)
    outs = run_ranks(demo, a.world_size, kwargs=kw, backend=backend, timeout=a.timeout)
    _report(outs[0], kw, slowest=outs)
    return 0


def _report(out, kw, slowest=None):
    w, n = out["world_size"], kw["N"]
    runs = slowest or [out]
    fwd, bwd = max(r["forward_s"] for r in runs), max(r["backward_s"] for r in runs)
    print(f"ring attention: W = {w}, N = {n} ({n // w} tokens per rank), B = {kw['B']}, H = {kw['H']}, "
          f"H_kv = {kw['H_kv']}, d = {kw['d']}, {kw['dtype']}, {kw['layout']}, causal={kw['causal']}")
    print("relative error vs float64 attention on the full tensors: "
          + ", ".join(f"{k} {v:.1e}" for k, v in out["errors"].items()))
    print(f"time: forward {fwd * 1e3:.1f} ms ({fwd / w * 1e3:.1f} ms per ring step), backward {bwd * 1e3:.1f} ms "
          f"(slowest rank, median of {kw['steps']})")


if __name__ == "__main__":
    sys.exit(main())
