"""Backward kernel vs torch SDPA's backward on a CUDA GPU: TFLOP/s and peak device memory.

    python benchmarks/timing/bench_backward.py                   # B=1, H=16, N in 1024 4096 16384, d in 64 128
    python benchmarks/timing/bench_backward.py --sweep           # first time tile shapes at N=4096, use the best
    python benchmarks/timing/bench_backward.py --check           # small correctness run (for compute-sanitizer)
    python benchmarks/timing/bench_backward.py --tensor --causal --csv benchmarks/results/tensor_backward.csv
                                                          # variant="tensor" in float16, bfloat16 and 3xTF32
    python benchmarks/timing/bench_backward.py --tensor --tiles  # time the tensor backward's tiles at N=4096
    python benchmarks/timing/bench_backward.py --tensor --check  # small correctness run of every tensor build

FLOPs: 2.5 x 4*B*H*Nq*Nk*d (halved when causal): the five matrix products of the backward. Times: CUDA
events around one call, median of `repeats` after warm-up, so compilation is never timed; flashlab and
torch run in the same process on the same inputs. torch's time is autograd's backward alone (the graph
kept with retain_graph). Peak memory: the most device memory torch's allocator held during the call,
above what the inputs already use (flashlab's outputs and scratch come from torch's allocator too).
`run_backward_bench()` returns the rows, for benchmarks/timing/bench_kernels.py or a notebook.
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


# ------------------------------------------------------------------------------ variant="tensor"
TENSOR_DTYPES = ("float16", "bfloat16", "float32")
# (block_q, block_k); (None, None) is the default tile. Tiles past 48 KB of shared memory run where the GPU's
# opt-in allows (the tensor backward's shared memory is dynamic).
TENSOR_TILES = [(None, None), (16, 64), (32, 64), (64, 64), (16, 32), (32, 32), (64, 32), (16, 128), (32, 128),
                (64, 128)]


def bench_tensor(q, k, v, do, causal, repeats, block_q=None, block_k=None, precision=None, tile=None):
    """variant="tensor" on torch CUDA tensors (o, lse from flashlab's tensor forward): ms, TFLOP/s, MiB.
    tile: a tensor_backward.BackwardTile to time as if it were the default (stages and v_shared included)."""
    if tile is not None:
        return _as_default_tile(tile, q, lambda: bench_tensor(q, k, v, do, causal, repeats, precision=precision))
    from flashlab.kernels import flash_attention, flash_attention_backward
    from flashlab.kernels.plan import plan

    B, H, N, d = q.shape
    o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
    call = lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant="tensor",
                                            precision=precision, block_q=block_q, block_k=block_k)
    ms = cuda_time_ms(call, repeats)
    dtype = str(q.dtype).replace("torch.", "")
    p = plan((B, H, N, N, d), variant="tensor", direction="backward", causal=causal, dtype=dtype,
             block_q=block_q, block_k=block_k, precision=precision)
    return dict(impl="flashlab tensor", dtype=dtype, n=N, d=d, causal=causal, ms=ms,
                tflops=backward_flops(B, H, N, N, d, causal) / ms / 1e9, peak_mib=peak_mib(call),
                config=f"{p.config.block_q}x{p.config.block_k} {p.config.stages}st"
                       f"{' vsh' if p.config.v_shared else ''} {p.precision}",
                regs=p.registers, local_bytes=p.spill_bytes, smem_bytes=p.shared_bytes)


def run_tensor_bench(ns=(1024, 4096, 16384), ds=(64, 128), batch=1, heads=16, causal=(False, True), repeats=20,
                     dtypes=TENSOR_DTYPES, progress=print):
    """flashlab's tensor backward against torch SDPA's backward in the same dtype, same inputs, same run
    (float32: also the register kernel). Rows carry vs_sdpa = flashlab's TFLOP/s over SDPA's."""
    torch = _torch()
    rows = []
    for d in ds:
        for n in ns:
            for c in causal:
                for dt in dtypes:
                    q, k, v, do = _inputs(batch, heads, n, d, getattr(torch, dt))
                    ours = bench_tensor(q, k, v, do, c, repeats)
                    base = bench_sdpa(q, k, v, do, c, repeats)
                    ours["vs_sdpa"] = ours["tflops"] / base["tflops"]
                    new = [ours, base]
                    if dt == "float32":
                        reg = bench_one(q, k, v, do, c, repeats)
                        reg["impl"], reg["vs_sdpa"] = "flashlab register", reg["tflops"] / base["tflops"]
                        new.append(reg)
                    for r in new:
                        progress(_fmt(r))
                    rows += new
                    del q, k, v, do
                    torch.cuda.empty_cache()
    return rows


def _tile_limits(dtype: str):
    """(precision, shared bytes a block may use) of this GPU's tensor backward for dtype."""
    from flashlab.kernels.plan import current_device
    from flashlab.kernels.tensor import resolve_precision

    dev = current_device()
    return resolve_precision(dtype, None, dev.cc), dev.dynamic_shared_per_block


def _as_default_tile(tile, q, run):
    """run() with tile as the tensor backward's default for q's dtype and d (prepared calls forgotten before and
    after, since their keys do not name the tile)."""
    from flashlab.kernels import plan, prepared, tensor_backward as tb

    kind = "float32" if q.dtype == _torch().float32 else "16-bit"
    d, saved = q.shape[-1], dict(tb.DEFAULT_TILES[kind])
    tb.DEFAULT_TILES[kind][d] = (tile.warps, tile.block_q, tile.stages, tile.v_shared)
    forget = lambda: (prepared._CALLS.clear(), plan._cached_plan.cache_clear(), plan._plan.cache_clear())  # noqa: E731
    forget()
    try:
        return run()
    finally:
        tb.DEFAULT_TILES[kind].clear()
        tb.DEFAULT_TILES[kind].update(saved)
        forget()


def parse_tile(text):
    """'default' -> (None, None); 'BQxBK' -> (block_q, block_k), the first tile of that shape that fits;
    'BQxBKv' / 'BQxBKs1' / 'BQxBKvs1': a BackwardTile with V in shared memory and / or one stage."""
    import re

    if text == "default":
        return None, None
    m = re.fullmatch(r"(\d+)x(\d+)(v?)(?:s([12]))?", text)
    if not m:
        raise SystemExit(f"--tile {text!r}: expected 'default', BQxBK, BQxBKv, BQxBKs1 or BQxBKvs1")
    bq, bk = int(m[1]), int(m[2])
    if not m[3] and not m[4]:
        return bq, bk
    from flashlab.kernels.tensor_backward import BackwardTile

    return BackwardTile(bk // 16, bq, int(m[4] or 2), bool(m[3]))


def tensor_tiles(ds=(64, 128), n=4096, heads=16, dtypes=("float16", "float32"), repeats=10, progress=print,
                 tiles=TENSOR_TILES):
    """Time every tile of tiles ((block_q, block_k) pairs) that fits, non-causal; returns rows in tile order."""
    torch = _torch()
    rows = []
    for d in ds:
        for dt in dtypes:
            q, k, v, do = _inputs(1, heads, n, d, getattr(torch, dt))
            for t in tiles:
                full = not isinstance(t, tuple)
                try:
                    if full:
                        r = bench_tensor(q, k, v, do, False, repeats, tile=t.check(d, *_tile_limits(dt)))
                    else:
                        r = bench_tensor(q, k, v, do, False, repeats, block_q=t[0], block_k=t[1])
                except ValueError as exc:
                    progress(f"skip d={d} {dt} {t}: {str(exc)[:90]}")
                    continue
                rows.append(r)
                progress(_fmt(r))
    return rows


def dq_run_to_run(n=4096, d=64, heads=16, runs=5, dtypes=TENSOR_DTYPES):
    """How much dQ (float32 atomics) changes between identical calls, and whether dK, dV do (they should not):
    {dtype: {"dq_max_rel": max |dq_i - dq_0| / max |dq_0|, "dq_differs": bool, "dk_dv_identical": bool}}."""
    from flashlab.kernels import flash_attention, flash_attention_backward

    torch = _torch()
    out = {}
    for dt in dtypes:
        q, k, v, do = _inputs(1, heads, n, d, getattr(torch, dt))
        o, lse = flash_attention(q, k, v, causal=True, variant="tensor")
        grads = [flash_attention_backward(q, k, v, o, lse, do, causal=True, variant="tensor") for _ in range(runs)]
        ref = grads[0][0].float()
        diff = max(float((g[0].float() - ref).abs().max()) for g in grads[1:])
        out[dt] = {"dq_max_rel": diff / float(ref.abs().max()), "dq_differs": diff > 0,
                   "dk_dv_identical": all(torch.equal(g[1], grads[0][1]) and torch.equal(g[2], grads[0][2])
                                          for g in grads[1:])}
    return out


def check_tensor(ds=(16, 32, 64, 128), progress=print):
    """Every tensor-backward build once on small ragged inputs, against float64 (for compute-sanitizer)."""
    from flashlab.kernels import flash_attention, flash_attention_backward

    torch = _torch()
    rng = np.random.default_rng(0)
    tol = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5}
    for d in ds:
        for dt in TENSOR_DTYPES:
            for causal in (False, True):
                nq, nk = 77, 45 if causal else 83
                x = [torch.tensor(rng.standard_normal((1, 2, m, d)), device="cuda", dtype=getattr(torch, dt))
                     for m in (nq, nk, nk, nq)]
                o, lse = flash_attention(*x[:3], causal=causal, variant="tensor")
                f64 = [t.double().cpu().numpy() for t in x]
                o64, lse64 = fl.reference_attention(*f64[:3], causal=causal)
                want = fl.flash_attention_v2_backward(*f64[:3], o64, lse64, f64[3], causal=causal)
                got = flash_attention_backward(*x[:3], o, lse, x[3], causal=causal, variant="tensor")
                torch.cuda.synchronize()
                errs = [fl.relative_error(g.double().cpu().numpy(), w) for g, w in zip(got, want)]
                ok = max(errs) < tol[dt]
                progress(f"check tensor d={d} {dt} causal={causal}: {' '.join(f'{e:.1e}' for e in errs)} "
                         f"{'ok' if ok else 'FAIL'}")
                if not ok:
                    raise SystemExit(1)


def _fmt(r):
    extra = f" ({r['vs_sdpa_fp32']:.0%} of SDPA fp32)" if "vs_sdpa_fp32" in r else \
        f" ({r['vs_sdpa']:.0%} of SDPA {r['dtype']})" if "vs_sdpa" in r else ""
    res = f" regs {r['regs']} local {r['local_bytes']}B smem {r['smem_bytes']}B" if r["regs"] is not None else ""
    return (f"{r['impl']:<11} {r['dtype']:<8} N={r['n']:<6} d={r['d']:<4} causal={str(r['causal']):<5} "
            f"{r['config']:<18} {r['ms']:9.3f} ms {r['tflops']:7.2f} TFLOP/s peak {r['peak_mib']:8.1f} MiB"
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
    ap.add_argument("--tensor", action="store_true", help='variant="tensor" in float16, bfloat16 and float32')
    ap.add_argument("--dtypes", nargs="+", default=list(TENSOR_DTYPES), help="with --tensor")
    ap.add_argument("--tiles", action="store_true", help="with --tensor: time the tiles at N=4096")
    ap.add_argument("--tile", nargs="+", metavar="BQxBK", help="with --tiles: only these (default: TENSOR_TILES; "
                                                                  "'default' is the default tile)")
    ap.add_argument("--json", help="with --tensor: write the bars and dQ's run-to-run difference here")
    args = ap.parse_args(argv)
    if args.check:
        return check_tensor(args.d if args.d != [64, 128] else (16, 32, 64, 128)) if args.tensor else check(args.d)
    torch = _torch()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.tensor:
        return _tensor_main(args, torch)
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


def _tensor_main(args, torch):
    import json

    if args.tiles:
        tiles = TENSOR_TILES if not args.tile else [parse_tile(t) for t in args.tile]
        rows = tensor_tiles(args.d, heads=args.heads, dtypes=args.dtypes, repeats=args.repeats, tiles=tiles)
    else:
        rows = run_tensor_bench(args.n, args.d, heads=args.heads, causal=(False, True) if args.causal else (False,),
                                repeats=args.repeats, dtypes=args.dtypes)
    print("\n" + "\n".join(_fmt(r) for r in rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted({key for r in rows for key in r}))
            w.writeheader()
            w.writerows(rows)
    if args.json:
        ours = [r for r in rows if r["impl"] == "flashlab tensor"]
        summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": args.heads,
                   "repeats": args.repeats, "rows": [{k: r[k] for k in ("dtype", "n", "d", "causal", "ms", "tflops",
                                                                         "vs_sdpa", "config", "regs", "local_bytes",
                                                                         "smem_bytes")} for r in ours],
                   "sdpa": [{k: r[k] for k in ("dtype", "n", "d", "causal", "tflops")} for r in rows
                            if r["impl"] == "torch SDPA"],
                   "dq_run_to_run": dq_run_to_run(heads=args.heads)}
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
