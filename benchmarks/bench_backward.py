"""Backward kernel vs torch SDPA's backward on a CUDA GPU: TFLOP/s and peak device memory.

    python benchmarks/bench_backward.py                   # B=1, H=16, N in 1024 4096 16384, d in 64 128
    python benchmarks/bench_backward.py --sweep           # first time tile shapes at N=4096, use the best
    python benchmarks/bench_backward.py --check           # small correctness run (for compute-sanitizer)

FLOPs: 2.5 x 4*B*H*Nq*Nk*d (halved when causal): the five matrix products of the backward. Times: CUDA
events around one call, median of `repeats` after warm-up, so compilation is never timed; flashlab and
torch run in the same process on the same inputs. torch's time is autograd's backward alone (the graph
kept with retain_graph). Peak memory: the most device memory torch's allocator held during the call,
above what the inputs already use (flashlab's outputs and scratch come from torch's allocator too).
`run_backward_bench()` returns the rows, for benchmarks/bench_kernels.py or a notebook.
"""
from __future__ import annotations

import argparse
import csv
import statistics

import numpy as np

import flashlab as fl


def _torch():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_backward needs a CUDA GPU with torch (torch.cuda.is_available() is False)")
    return torch


def cuda_time_ms(fn, repeats=20, warmup=3):
    """Median milliseconds of fn() between CUDA events, after `warmup` untimed calls."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn):
    """MiB of device memory torch's allocator held at most during fn(), above what was held before."""
    torch = _torch()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def backward_flops(batch, heads, nq, nk, d, causal):
    return 2.5 * 4 * batch * heads * nq * nk * d / (2 if causal else 1)


def torch_forward(q, k, v, causal, chunk=1024):
    """o and lse (float32) in row chunks, so no Nq x Nk matrix of all heads exists at once."""
    torch = _torch()
    scale = q.shape[-1] ** -0.5
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i0 in range(0, q.shape[-2], chunk):
        s = (q[..., i0:i0 + chunk, :].float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(i0, i0 + s.shape[-2], device=q.device)[:, None]
            s.masked_fill_(torch.arange(k.shape[-2], device=q.device)[None, :] > rows, float("-inf"))
        lse[..., i0:i0 + chunk] = torch.logsumexp(s, -1)
        o[..., i0:i0 + chunk, :] = (torch.softmax(s, -1) @ v.float()).to(q.dtype)
    return o, lse


def _resources(dkdv):
    """(registers, local bytes) per thread of the compiled main kernel."""
    try:
        regs, local = dkdv.get_regs_per_thread(), dkdv.get_local_mem_per_thread()
        one = lambda x: next(iter(x.values())) if isinstance(x, dict) else x
        return one(regs), one(local)
    except Exception:  # pragma: no cover - simulator or an older numba-cuda
        return None, None


def bench_one(q, k, v, do, causal, repeats, config=None):
    """One flashlab backward measurement on torch CUDA tensors: dict with ms, TFLOP/s, MiB, resources."""
    from flashlab.kernels import backward as kb

    B, H, N, d = q.shape
    o, lse = torch_forward(q, k, v, causal)
    block_q, block_k, threads = config or kb.default_config(d)
    call = lambda: kb.flash_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q,
                                               block_k=block_k, threads=threads)
    ms = cuda_time_ms(call, repeats)
    regs, local = _resources(kb.make_kernels(d, block_q, block_k, threads)[1])
    return dict(impl="flashlab", dtype=str(q.dtype).replace("torch.", ""), n=N, d=d, causal=causal, ms=ms,
                tflops=backward_flops(B, H, N, N, d, causal) / ms / 1e9, peak_mib=peak_mib(call),
                config=f"{block_q}x{block_k}x{threads}", regs=regs, local_bytes=local,
                smem_bytes=kb.shared_bytes(d, block_q, block_k))


def bench_sdpa(q, k, v, do, causal, repeats):
    torch = _torch()
    B, H, N, d = q.shape
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    F = torch.nn.functional
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    call = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    ms = cuda_time_ms(call, repeats)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), do)

    return dict(impl="torch SDPA", dtype=str(q.dtype).replace("torch.", ""), n=N, d=d, causal=causal, ms=ms,
                tflops=backward_flops(B, H, N, N, d, causal) / ms / 1e9, peak_mib=peak_mib(fwd_bwd),
                config="fwd+bwd peak", regs=None, local_bytes=None, smem_bytes=None)


def _inputs(batch, heads, n, d, dtype, seed=0):
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4)]


def sweep(d, n=4096, heads=16, configs=None, repeats=10, progress=print):
    """Time tile shapes (block_q, block_k, threads) at one size; returns the rows, fastest first."""
    from flashlab.kernels import backward as kb

    torch = _torch()
    configs = configs or SWEEP[d]
    q, k, v, do = _inputs(1, heads, n, d, torch.float32)
    rows = []
    for cfg in configs:
        try:
            kb.check_config(d, *cfg)
        except ValueError as exc:
            progress(f"skip {cfg}: {exc}")
            continue
        rows.append(bench_one(q, k, v, do, False, repeats, cfg))
        progress(_fmt(rows[-1]))
    return sorted(rows, key=lambda r: r["ms"])


# Tile shapes (block_q, block_k, threads) the sweep tries; all fit 48 KB of shared memory.
SWEEP = {
    64: [(16, 64, 128), (16, 64, 256), (32, 32, 128), (32, 32, 64), (16, 32, 64), (8, 64, 64)],
    128: [(8, 32, 64), (8, 32, 128), (16, 16, 64), (8, 16, 32), (16, 16, 128)],
}


def run_backward_bench(ns=(1024, 4096, 16384), ds=(64, 128), batch=1, heads=16, causal=(False,), repeats=20,
                       configs=None, sdpa_fp16=True, progress=print):
    """flashlab's backward (float32) and torch SDPA's (float32, and float16 for scale) at every size.

    configs: {d: (block_q, block_k, threads)} to override the defaults. Returns a list of dict rows.
    """
    torch = _torch()
    rows = []
    for d in ds:
        for n in ns:
            for c in causal:
                q, k, v, do = _inputs(batch, heads, n, d, torch.float32)
                ours = bench_one(q, k, v, do, c, repeats, (configs or {}).get(d))
                base = bench_sdpa(q, k, v, do, c, repeats)
                ours["vs_sdpa_fp32"] = ours["tflops"] / base["tflops"]
                new = [ours, base]
                if sdpa_fp16:
                    new.append(bench_sdpa(*(x.half() for x in (q, k, v, do)), c, repeats))
                for r in new:
                    progress(_fmt(r))
                rows += new
                del q, k, v, do
                torch.cuda.empty_cache()
    return rows


def check(ds=(16, 32, 64, 128), progress=print):
    """A small, fully checked run of each kernel specialisation (what compute-sanitizer is pointed at)."""
    from flashlab.kernels import backward as kb
    from numba import cuda

    rng = np.random.default_rng(0)
    for d in ds:
        for dtype in (np.float32, np.float16):
            for causal in (False, True):
                nq, nk = 77, 45 if causal else 77
                q, do = (rng.standard_normal((1, 2, nq, d)).astype(dtype) for _ in range(2))
                k, v = (rng.standard_normal((1, 2, nk, d)).astype(dtype) for _ in range(2))
                f64 = [x.astype(np.float64) for x in (q, k, v, do)]
                o, lse = fl.reference_attention(*f64[:3], causal=causal)
                want = fl.flash_attention_v2_backward(*f64[:3], o, lse, f64[3], causal=causal)
                got = kb.flash_attention_backward(q, k, v, o.astype(dtype), lse.astype(np.float32), do,
                                                  causal=causal)
                cuda.synchronize()
                errs = [fl.relative_error(g, w) for g, w in zip(got, want)]
                ok = max(errs) < (1e-4 if dtype == np.float32 else 1e-2)
                progress(f"check d={d} {np.dtype(dtype).name} causal={causal}: "
                         f"{' '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'FAIL'}")
                if not ok:
                    raise SystemExit(1)


def _fmt(r):
    extra = f" ({r['vs_sdpa_fp32']:.0%} of SDPA fp32)" if "vs_sdpa_fp32" in r else ""
    res = f" regs {r['regs']} local {r['local_bytes']}B smem {r['smem_bytes']}B" if r["regs"] is not None else ""
    return (f"{r['impl']:<11} {r['dtype']:<8} N={r['n']:<6} d={r['d']:<4} causal={str(r['causal']):<5} "
            f"{r['config']:<13} {r['ms']:9.3f} ms {r['tflops']:7.2f} TFLOP/s peak {r['peak_mib']:8.1f} MiB"
            f"{extra}{res}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true", help="also measure causal attention")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time tile shapes at N=4096 first and use the fastest")
    ap.add_argument("--check", action="store_true", help="only the small correctness run")
    ap.add_argument("--csv", help="write the rows here")
    args = ap.parse_args(argv)
    if args.check:
        return check(args.d)
    torch = _torch()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    configs = {}
    if args.sweep:
        for d in args.d:
            best = sweep(d, heads=args.heads)[0]
            configs[d] = tuple(int(x) for x in best["config"].split("x"))
            print(f"fastest for d={d}: {best['config']}")
    rows = run_backward_bench(args.n, args.d, heads=args.heads, causal=(False, True) if args.causal else (False,),
                              repeats=args.repeats, configs=configs)
    print("\n" + "\n".join(_fmt(r) for r in rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted({key for r in rows for key in r}))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
