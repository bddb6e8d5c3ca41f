"""Benchmark flashlab's Numba-CUDA kernels against PyTorch on this machine's GPU. One command:

    python benchmarks/timing/bench_kernels.py            # full run (~5 min on an H100)
    python benchmarks/timing/bench_kernels.py --quick    # N <= 4096, d = 64, small sweep (~1 min)

Measures, all in the same run (CUDA events, median of >= 20 after warm-up, compilation excluded):
  forward  TFLOP/s at B=1, H=16, N in {1024, 4096, 16384}, d in {64, 128}, float32: flashlab "shared" and
           "register" vs torch SDPA (float32 and float16) and manual attention (matmul, softmax, matmul)
  tensor   the tensor-core variant in float16, bfloat16 and float32 (3xTF32 and 1xTF32), causal and not,
           against torch SDPA in the same dtype (lessons 10 and 15 read the H100's tensor.csv as
           flashlab/data/h100_tensor.csv: copy a new H100 result there)
  backward flashlab.kernels.flash_attention_backward (when present) vs torch SDPA's backward
  memory   peak device memory of forward (+ backward) as N grows: linear means no N x N buffer
  sweep    tile shapes (block_q, block_k, threads) of the register kernel -> flashlab/data/tile_sweep.csv
  host     the host time of one call on tiny inputs, torch tensors and numba device arrays in -> host.csv
Writes forward.csv, tensor.csv, backward.csv, memory.csv, env.json, summary.md and forward.png to --out
(default benchmarks/results/) and prints the tables.

    python benchmarks/timing/bench_kernels.py --suite    # the shape suite: see benchmarks/timing/suite.py
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "timing"))

import flashlab  # noqa: E402  (chooses the backend before numba.cuda is imported)
from flashlab.bench import attention_flops, peak_memory_mib, tflops, time_cuda, write_csv  # noqa: E402

import suite  # noqa: E402  (benchmarks/timing/suite.py: the shape suite and the host overhead)


def environment() -> dict:
    import torch
    from importlib.metadata import version

    from flashlab.device import _driver_version, device_limits, get_cuda

    cuda = get_cuda()
    lim = device_limits()
    drv = _driver_version()
    return {"gpu": lim["name"], "compute_capability": ".".join(map(str, lim["cc"])), "sms": lim["sms"],
            "driver_cuda": f"{drv[0]}.{drv[1]}" if drv else "?",
            "nvidia_driver": _nvidia_smi_driver(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "numba": version("numba"), "numba_cuda": version("numba-cuda"), "numpy": np.__version__,
            "python": platform.python_version(), "nvrtc": ".".join(map(str, cuda.runtime.get_version()))}


def _nvidia_smi_driver() -> str:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "?"


def qkv(B, H, n, d, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def flashlab_forward(variant, q, k, v, tile=None):
    """A closure launching the kernel on pre-converted arrays: times the kernel, not Python argument checks."""
    from flashlab.device import get_cuda
    from flashlab.kernels import plan, register, shared

    cuda = get_cuda()
    qd, kd, vd = (cuda.as_cuda_array(x) for x in (q, k, v))
    B, H, n, d = q.shape
    o = cuda.device_array((B, H, n, d), np.float32 if q.dtype.itemsize == 4 else np.float16)
    lse = cuda.device_array((B, H, n), np.float32)
    config = tile or plan.resolve_config(variant, d)
    scale = 1 / math.sqrt(d)
    if variant == "register":
        return lambda: register.launch(qd, kd, vd, o, lse, H, scale, False, config)
    return lambda: shared.launch(qd, kd, vd, o, lse, H, scale, False, *config)


def flashlab_tensor(q, k, v, precision, causal):
    """A closure launching the tensor-core kernel on pre-converted arrays (torch tensors in, no copies)."""
    from flashlab.kernels import forward

    return forward.prepare(q, k, v, causal=causal, precision=precision)[0]


TENSOR_PRECISIONS = {"float16": ["f16"], "bfloat16": ["bf16"], "float32": ["3xtf32", "tf32"]}


def bench_tensor(sizes, ds, reps, causals=(False, True)):
    """The tensor-core variant against torch SDPA in the same dtype (and the register kernel in fp32)."""
    import torch
    import torch.nn.functional as F

    rows = []
    for d in ds:
        for n in sizes:
            for causal in causals:
                flops = attention_flops(1, 16, n, n, d, causal=causal)
                base = qkv(1, 16, n, d, torch.float32, seed=4)
                for dtype, precisions in TENSOR_PRECISIONS.items():
                    q, k, v = (x.to(getattr(torch, dtype)) for x in base)
                    ms_t, tf_t = measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flops, reps)
                    impls = {f"flashlab tensor {p}": flashlab_tensor(q, k, v, p, causal) for p in precisions}
                    if dtype == "float32" and not causal:
                        impls["flashlab register"] = flashlab_forward("register", q, k, v)
                    for name, fn in impls.items():
                        ms, tf = measure(fn, flops, reps)
                        rows.append({"N": n, "d": d, "causal": int(causal), "dtype": dtype, "impl": name,
                                     "ms": round(ms, 4), "tflops": round(tf, 2), "torch_tflops": round(tf_t, 2),
                                     "ratio": round(tf / tf_t, 3)})
                        print(f"  tensor N={n:6d} d={d:3d} causal={int(causal)} {dtype:8s} {name:26s} {ms:8.3f} ms "
                              f"{tf:7.2f} TFLOP/s  (SDPA {tf_t:7.2f}: {tf / tf_t:5.2f}x)", flush=True)
                    del q, k, v, impls
                del base
                torch.cuda.empty_cache()
    return rows


def torch_ops(q, k, v):
    import torch
    import torch.nn.functional as F

    def manual():
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        return torch.softmax(s, dim=-1) @ v

    return {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v), "manual": manual}


def measure(fn, flops, reps):
    try:
        t = time_cuda(fn, warmup=2, reps=reps)
        return t["median_ms"], tflops(flops, t["median_ms"])
    except Exception as exc:  # e.g. out of memory for the manual N x N matrices
        import torch

        torch.cuda.empty_cache()
        print(f"    failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
        return float("nan"), float("nan")


def bench_forward(sizes, ds, reps):
    import torch

    rows = []
    for d in ds:
        for n in sizes:
            q, k, v = qkv(1, 16, n, d, torch.float32)
            flops = attention_flops(1, 16, n, n, d)
            impls = {"flashlab register fp32": flashlab_forward("register", q, k, v),
                     "flashlab shared fp32": flashlab_forward("shared", q, k, v),
                     "torch SDPA fp32": torch_ops(q, k, v)["sdpa"]}
            if 4 * 16 * n * n * 2 < 0.5 * torch.cuda.mem_get_info()[0]:
                impls["torch manual fp32"] = torch_ops(q, k, v)["manual"]
            h = [x.half() for x in (q, k, v)]
            impls["torch SDPA fp16"] = torch_ops(*h)["sdpa"]
            for name, fn in impls.items():
                ms, tf = measure(fn, flops, reps)
                rows.append({"N": n, "d": d, "impl": name, "ms": round(ms, 4), "tflops": round(tf, 2)})
                print(f"  fwd N={n:6d} d={d:3d} {name:24s} {ms:9.3f} ms {tf:7.2f} TFLOP/s", flush=True)
            del q, k, v, h, impls
            torch.cuda.empty_cache()
    return rows


def bench_backward(sizes, ds, reps):
    import torch
    import torch.nn.functional as F

    from flashlab.kernels import flash_attention, flash_attention_backward

    rows = []
    for d in ds:
        for n in sizes:
            q, k, v = qkv(1, 16, n, d, torch.float32, seed=1)
            do = torch.randn_like(q)
            flops = attention_flops(1, 16, n, n, d, backward=True)
            try:
                o, lse = flash_attention(q, k, v)
                ms, tf = measure(lambda: flash_attention_backward(q, k, v, o, lse, do), flops, reps)
            except NotImplementedError as exc:
                print(f"  backward: {exc}")
                return rows
            rows.append({"N": n, "d": d, "impl": "flashlab fp32", "ms": round(ms, 4), "tflops": round(tf, 2)})
            print(f"  bwd N={n:6d} d={d:3d} {'flashlab fp32':24s} {ms:9.3f} ms {tf:7.2f} TFLOP/s", flush=True)
            for dt, name in ((torch.float32, "torch SDPA fp32"), (torch.float16, "torch SDPA fp16")):
                qq, kk, vv = (x.to(dt).requires_grad_() for x in (q, k, v))
                g = do.to(dt)
                fwd = lambda: F.scaled_dot_product_attention(qq, kk, vv)  # noqa: E731
                both = lambda: F.scaled_dot_product_attention(qq, kk, vv).backward(g)  # noqa: E731
                t_f, _ = measure(fwd, 1, reps)
                t_b, _ = measure(both, 1, reps)
                ms = t_b - t_f  # SDPA's backward alone: (forward + backward) - forward
                rows.append({"N": n, "d": d, "impl": name, "ms": round(ms, 4), "tflops": round(tflops(flops, ms), 2)})
                print(f"  bwd N={n:6d} d={d:3d} {name:24s} {ms:9.3f} ms {tflops(flops, ms):7.2f} TFLOP/s", flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    return rows


def bench_memory(sizes, d=64):
    import torch
    import torch.nn.functional as F

    from flashlab.kernels import flash_attention, flash_attention_backward

    rows = []
    for n in sizes:
        q, k, v = qkv(1, 16, n, d, torch.float32, seed=2)
        do = torch.randn_like(q)
        row = {"N": n, "d": d, "inputs_mib": round(4 * q.numel() * 4 / 2**20, 1)}  # q, k, v, do
        row["flashlab_fwd_mib"] = round(peak_memory_mib(lambda: flash_attention(q, k, v)), 1)

        def fwd_bwd():
            o, lse = flash_attention(q, k, v)
            flash_attention_backward(q, k, v, o, lse, do)

        try:
            row["flashlab_fwd_bwd_mib"] = round(peak_memory_mib(fwd_bwd), 1)
        except NotImplementedError:
            row["flashlab_fwd_bwd_mib"] = float("nan")
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        row["sdpa_fwd_bwd_mib"] = round(peak_memory_mib(
            lambda: F.scaled_dot_product_attention(qq, kk, vv).backward(do)), 1)
        rows.append(row)
        print("  mem " + "  ".join(f"{key}={val}" for key, val in row.items()), flush=True)
        del q, k, v, do, qq, kk, vv
        torch.cuda.empty_cache()
    return rows


SWEEP_TILES = {  # (block_q, block_k, tr, tc[, prefetch]); the ones that do not fit 48 KB are skipped
    64: [(128, 16, 32, 4), (128, 16, 32, 4, True), (64, 16, 16, 4), (64, 32, 16, 8), (64, 32, 16, 8, True),
         (64, 16, 16, 8), (64, 32, 8, 8), (32, 32, 8, 8), (32, 32, 4, 8), (16, 32, 4, 8)],
    128: [(32, 16, 8, 16), (16, 16, 4, 16), (64, 8, 16, 8), (32, 16, 8, 8), (32, 8, 8, 8), (32, 16, 16, 8)],
}


def sweep(ds, reps, n=4096, quick=False):
    import torch

    from flashlab.device import device_limits
    from flashlab.kernels import kernel_info
    from flashlab.kernels.register import Tile

    limit, rows = device_limits()["shared_per_block"], []
    for d in ds:
        q, k, v = qkv(1, 16, n, d, torch.float32, seed=3)
        flops = attention_flops(1, 16, n, n, d)
        tiles = SWEEP_TILES[d][:4] if quick else SWEEP_TILES[d]
        for bq, bk, tr, tc, *pf in tiles:
            tile = Tile(bq, bk, tr, tc, bool(pf))
            try:
                tile.check(d, limit)
            except ValueError:
                continue
            ms, tf = measure(flashlab_forward("register", q, k, v, tile=tile), flops, reps)
            info = kernel_info(d, tile=tile)
            row = {"gpu": info.get("device", "?"), "N": n, "d": d, "block_q": bq, "block_k": bk, "tr": tr, "tc": tc,
                   "prefetch": tile.prefetch, "threads": tile.threads, **{f"micro_{key}": val for key, val in info["micro_tile"].items()},
                   "registers": info["registers_per_thread"], "local_bytes": info["local_bytes_per_thread"],
                   "shared_bytes": info["shared_bytes_per_block"], "occupancy": round(info["occupancy"], 3),
                   "limited_by": info["limited_by"], "ms": round(ms, 4), "tflops": round(tf, 2)}
            rows.append(row)
            print(f"  sweep d={d:3d} bq={bq:3d} bk={bk:3d} threads={tr}x{tc} pf={int(tile.prefetch)} regs={row['registers']} "
                  f"spill={row['local_bytes']} smem={row['shared_bytes']} occ={row['occupancy']} -> "
                  f"{ms:8.3f} ms {tf:6.2f} TFLOP/s", flush=True)
    return rows


def plot(rows, env, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(1, len(ds), figsize=(6 * len(ds), 4), squeeze=False)
    for ax, d in zip(axes[0], ds):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["N"], r["tflops"]) for r in rows if r["d"] == d and r["impl"] == impl]
            ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="N (B=1, H=16)", ylabel="TFLOP/s", title=f"forward, d={d}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{env['gpu']} (driver {env['nvidia_driver']}), torch {env['torch']}, numba-cuda {env['numba_cuda']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(env, fwd, bwd, mem, sweep_rows, cmd, ten=()) -> str:
    lines = [f"Command: `{cmd}`", "", "| " + " | ".join(env) + " |", "|" + " --- |" * len(env),
             "| " + " | ".join(map(str, env.values())) + " |", ""]

    def table(rows, title):
        if not rows:
            return
        lines.extend([f"### {title}", "", "| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])])
        lines.extend("| " + " | ".join(map(str, r.values())) + " |" for r in rows)
        lines.append("")

    table(fwd, "Forward (B=1, H=16, float32 unless named; TFLOP/s = 4*B*H*N^2*d / time)")
    table(list(ten), "Tensor cores (B=1, H=16; ratio = flashlab / torch SDPA in the same dtype, same run)")
    table(bwd, "Backward (TFLOP/s = 2.5x forward FLOPs / time; SDPA: (fwd+bwd) - fwd)")
    table(mem, "Peak device memory above inputs, MiB (H=16, d=64)")
    table(sweep_rows, "Register-kernel tile sweep (N=4096, B=1, H=16, float32)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N <= 4096, d = 64, a short sweep")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the results")
    ap.add_argument("--parts", default="forward,tensor,backward,memory,sweep", help="comma-separated subset")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (>= 20)")
    ap.add_argument("--sweep-csv", default=str(ROOT / "flashlab" / "data" / "tile_sweep.csv"))
    suite.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.suite and args.replot:  # redraws from suite.csv: no GPU needed
        return suite.main_suite(args, {})
    if not flashlab.device.has_gpu():
        print("No CUDA GPU found: this benchmark needs one (flashlab.doctor() says why).")
        flashlab.doctor()
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    env = environment()
    print(json.dumps(env), flush=True)
    if args.suite:
        return suite.main_suite(args, env)
    if "host" in parts:
        write_csv(out / "host.csv", [{**r, "gpu": env["gpu"]} for r in suite.host_overhead()])
        parts.discard("host")
        if not parts:
            return 0
    sizes = [1024, 4096] if args.quick else [1024, 4096, 16384]
    ds = [64] if args.quick else [64, 128]
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    fwd = bench_forward(sizes, ds, args.reps) if "forward" in parts else []
    write_csv(out / "forward.csv", fwd)  # each part is saved as soon as it is done
    if fwd:
        plot(fwd, env, out / "forward.png")
    ten = bench_tensor(sizes, ds, args.reps) if "tensor" in parts else []
    write_csv(out / "tensor.csv", ten)
    mem = bench_memory([1024, 2048, 4096, 8192] + ([] if args.quick else [16384])) if "memory" in parts else []
    write_csv(out / "memory.csv", mem)
    bwd = bench_backward(sizes, ds, args.reps) if "backward" in parts else []
    write_csv(out / "backward.csv", bwd)
    sw = sweep(ds, args.reps, quick=args.quick) if "sweep" in parts else []
    if sw:
        Path(args.sweep_csv).parent.mkdir(parents=True, exist_ok=True)
        write_csv(Path(args.sweep_csv), sw)
    cmd = "python benchmarks/timing/bench_kernels.py" + (" --quick" if args.quick else "")
    md = markdown(env, fwd, bwd, mem, sw, cmd, ten)
    (out / "summary.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
