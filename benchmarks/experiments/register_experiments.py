"""Could the register kernel go faster by unrolling deeper or by trading registers for occupancy? Measure it.

    python benchmarks/experiments/register_experiments.py [--out benchmarks/results/register_experiments.md]

At B = 1, H = 16, N = 4096, d = 64, float32, the default tile, all in one run (CUDA events, median of 30
after warm-up): the register kernel with its product loops unrolled 4 (the default), 8, 16 and 64 deep, and
with the compiler capped at 112 and 96 registers per thread; next to it flashlab's shared kernel, torch SDPA
fp32 and cuBLAS's FP32 matrix product (8192^3, TF32 off) as the FP32 ceiling in practice. Each variant's
output is checked against SDPA in float64. Prints a Markdown table and writes it to --out.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "timing"))

import flashlab  # noqa: E402,F401  (chooses the backend before numba.cuda is imported)
from bench_kernels import environment, flashlab_forward, qkv  # noqa: E402
from flashlab.bench import attention_flops, tflops, time_cuda  # noqa: E402

VARIANTS = [("unroll 4 (default)", {}), ("unroll 8", {"unroll": 8}), ("unroll 16", {"unroll": 16}),
            ("unroll 64 (full)", {"unroll": 64}), ("at most 112 registers", {"max_registers": 112}),
            ("at most 96 registers", {"max_registers": 96})]


def main():
    import torch
    import torch.nn.functional as F

    from flashlab.device import get_cuda
    from flashlab.kernels import plan, register

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "register_experiments.md"))
    a = ap.parse_args()
    cuda = get_cuda()
    B, H, N, d = 1, 16, 4096, 64
    q, k, v = qkv(B, H, N, d, torch.float32)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    flops = attention_flops(B, H, N, N, d)
    qd, kd, vd = (cuda.as_cuda_array(x) for x in (q, k, v))
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda")
    od, lsed = cuda.as_cuda_array(o), cuda.as_cuda_array(lse)
    tile = plan.resolve_config("register", d)
    rows = []

    def record(name, fn, regs="", spill="", check=True):
        ms = time_cuda(fn, warmup=3, reps=30)["median_ms"]
        err = f"{(o.double() - ref).abs().max().item():.1e}" if check else ""
        rows.append((name, regs, spill, f"{ms:.3f}", f"{tflops(flops, ms):.2f}", err))
        print(" | ".join(map(str, rows[-1])), flush=True)

    record("torch SDPA fp32", lambda: F.scaled_dot_product_attention(q, k, v), check=False)
    record("flashlab shared", flashlab_forward("shared", q, k, v), check=False)
    for name, options in VARIANTS:
        launch = lambda: register.launch(qd, kd, vd, od, lsed, H, 1 / math.sqrt(d), False, tile, **options)
        launch()
        compiled = next(iter(register.build(d, tile, False, **options).overloads.values()))
        o.zero_()
        record(f"register, {name}", launch, compiled.regs_per_thread, compiled.local_mem_per_thread)

    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(8192, 8192, device="cuda")
    ms = time_cuda(lambda: x @ x, warmup=3, reps=20)["median_ms"]
    gemm = 2 * 8192**3 / ms / 1e9
    env = environment()
    lines = [f"# Register-kernel experiments ({env['gpu']}, driver {env['nvidia_driver']}, numba-cuda "
             f"{env['numba_cuda']}, torch {env['torch']})", "",
             f"`python benchmarks/experiments/register_experiments.py`: B = 1, H = 16, N = 4096, d = 64, float32, tile {tile}.",
             "CUDA-event medians of 30 after warm-up; max error against SDPA in float64.", "",
             "| kernel | registers/thread | spill bytes/thread | ms | TFLOP/s | max error |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    lines += ["", f"cuBLAS FP32 matrix product, 8192^3, TF32 off: {gemm:.1f} TFLOP/s."]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"cuBLAS sgemm 8192^3: {gemm:.1f} TFLOP/s\nsaved {a.out}")


if __name__ == "__main__":
    main()
