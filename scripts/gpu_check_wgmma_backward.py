"""The wgmma backward (kernels/wgmma_backward.py) on a Hopper GPU: gradients against float64 beside torch's own
error, and a first timing against torch's SDPA backward and flashlab's mma.sync backward, in the same run.

    python scripts/gpu_check_wgmma_backward.py

Timing: CUDA events, the median of 10 after two warm-ups; the backward's TFLOP/s count 2.5x the forward's FLOPs
(4 B H N^2 d, causal: half). The wgmma backward runs through its general launch path (tensor maps made each call).
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def words(x):
    import torch

    from flashlab.device import get_cuda

    return get_cuda().as_cuda_array(x.view(torch.int32)).view(np.uint32)


def run_wgmma(q, k, v, o, lse, do, causal, tile=None):
    import torch

    from flashlab.kernels import wgmma_backward

    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    wgmma_backward.backward(words(q), words(k), words(v), words(o), lse, words(do), words(dq), words(dk), words(dv),
                            q.shape[-1] ** -0.5, causal, str(q.dtype).replace("torch.", ""),
                            tile or wgmma_backward.BackwardTile())
    return dq, dk, dv


def main():
    import torch
    import torch.nn.functional as Fn

    from flashlab.device import get_cuda
    from flashlab.kernels import flash_attention, flash_attention_backward, wgmma_backward
    from gpu_check_wgmma_forward import timed  # CUDA events, median of repeats after two warm-ups

    cuda = get_cuda()
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"), flush=True)
    for B, H, Nq, Nk, d, causal, dtype in [(1, 2, 300, 250, 64, True, "float16"), (2, 2, 500, 777, 128, False,
                                                                                    "bfloat16"),
                                           (1, 4, 1024, 1024, 128, True, "float16")]:
        dt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(Nq)
        q, do = (torch.randn(B, H, Nq, d, device="cuda", generator=g).to(dt) for _ in range(2))
        k, v = (torch.randn(B, H, Nk, d, device="cuda", generator=g).to(dt) for _ in range(2))
        o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
        got = run_wgmma(q, k, v, o, cuda.as_cuda_array(lse), do, causal)
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o64 = Fn.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        want = torch.autograd.grad(o64, (q64, k64, v64), do.double())
        qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
        ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        theirs = torch.autograd.grad(ot, (qt, kt, vt), do)
        line = []
        for name, a, b, c in zip(("dq", "dk", "dv"), got, want, theirs):
            e, et = ((x.double() - b).abs().max().item() for x in (a, c))
            line.append(f"{name} {e:.2e} (torch {et:.2e}, ratio {e / max(et, 1e-12):.2f})")
        print(f"B{B} H{H} Nq{Nq} Nk{Nk} d{d} {'causal' if causal else 'full'} {dtype}: " + "; ".join(line),
              flush=True)

    print("backward TFLOP/s, B 1, H 16, float16; wgmma: a one-warp producer; w p128: a producer warpgroup",
          flush=True)
    for N, d, causal in [(4096, 64, False), (4096, 64, True), (4096, 128, False), (4096, 128, True),
                         (16384, 64, False), (16384, 64, True), (16384, 128, False), (16384, 128, True)]:
        q, k, v, do = (torch.randn(1, 16, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
        o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
        lse_n = cuda.as_cuda_array(lse)
        flops = 2.5 * 4 * 16 * N * N * d / (2 if causal else 1)
        qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
        ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        runs = [("wgmma", wgmma_backward.BackwardTile())]
        if (N, d, causal) == (4096, 64, False):
            runs.append(("w p128", wgmma_backward.BackwardTile(producer=128)))
        t = {name: timed(lambda: run_wgmma(q, k, v, o, lse_n, do, causal, tile), 10) for name, tile in runs}
        t["tensor"] = timed(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant="tensor"),
                            10)
        t["sdpa"] = timed(lambda: torch.autograd.grad(ot, (qt, kt, vt), do, retain_graph=True), 10)
        best = min(x for name, x in t.items() if name.startswith("w"))
        print(f"N {N:5d} d {d:3d} {'causal' if causal else 'full':6s}  " + "  ".join(
            f"{name} {flops / x / 1e12:4.0f}" for name, x in t.items()) + f"  best/sdpa {t['sdpa'] / best:.2f}",
            flush=True)
    for key, kernel in sorted(wgmma_backward._BUILDS.items(), key=str):
        for compiled in kernel.overloads.values():
            print(f"build {key}: {compiled.regs_per_thread} registers, {compiled.local_mem_per_thread} local bytes")

if __name__ == "__main__":
    main()
