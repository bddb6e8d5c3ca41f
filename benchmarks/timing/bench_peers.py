"""flashlab's Hopper kernels beside torch's default SDPA and Triton's fused-attention tutorial, same run, float16.

    python benchmarks/timing/bench_peers.py --triton PATH/06-fused-attention.py [--csv out.csv]

Triton's tutorial is not part of flashlab and is never committed: pass the path of a local copy of
python/tutorials/06-fused-attention.py from the Triton repository (it must match the installed triton). Its
forward is autotuned on first use; to keep a run short, its autotuner here keeps the configurations with
BLOCK_M = 128 and 3 or 4 stages (the ones it picks on Hopper), so its numbers are, if anything, slightly low. Its
kernels hard-code float16 (and its backward needs N % 128 == 0), so this compares float16 only. Its backward is
causal only (it walks the diagonal and the blocks below it whatever `causal` says), so its backward is timed for
causal shapes alone.

Public calls, random normal inputs, H = 16 and B = 1 and 4 (B H = 16 and 64, the bars' batch sizes):
flashlab.kernels.flash_attention and flash_attention_backward with variant="wgmma", torch.nn.functional.scaled_dot_product_attention (default
backend) and its autograd backward, and the tutorial's `attention` and its autograd backward. Times:
flashlab.bench.time_cuda (CUDA events, median of 10 after warm-up). TFLOP/s: the forward counts 4 B H N^2 d
(causal: half), the backward 2.5 times that.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [(B, N, d, causal) for B in (1, 4) for N in (4096, 16384) for d in (64, 128) for causal in (False, True)]


def load_tutorial(path):
    spec = importlib.util.spec_from_file_location("triton_fused_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("_attn_fwd_tma", "_attn_fwd"):
        tuner = getattr(module, name, None)
        if tuner is not None and hasattr(tuner, "configs"):
            kept = [c for c in tuner.configs if c.kwargs.get("BLOCK_M") == 128 and c.num_stages in (3, 4)]
            tuner.configs = kept or tuner.configs
    return module


def main():
    import torch
    import torch.nn.functional as Fn

    from flashlab.bench import time_cuda, write_csv
    from flashlab.kernels import flash_attention, flash_attention_backward

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton", required=True, help="path of a local copy of Triton's 06-fused-attention.py")
    ap.add_argument("--csv", help="write the rows here")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    tutorial = load_tutorial(args.triton)
    device = torch.cuda.get_device_name()
    print(f"{device} {time.strftime('%Y-%m-%d')} torch {torch.__version__}; TFLOP/s, H 16, float16", flush=True)
    timed = lambda fn: time_cuda(fn, warmup=2, reps=args.repeats)["median_ms"] / 1e3  # noqa: E731
    rows = []
    for B, N, d, causal in SHAPES:
        q, k, v, do = (torch.randn(B, 16, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
        scale = d ** -0.5
        flops = 4 * B * 16 * N * N * d / (2 if causal else 1)
        o, lse = flash_attention(q, k, v, causal=causal, variant="wgmma")
        qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
        ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        orr = tutorial.attention(qr, kr, vr, causal, scale)
        t = {"flashlab forward": timed(lambda: flash_attention(q, k, v, causal=causal, variant="wgmma")),
             "sdpa forward": timed(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)),
             "triton forward": timed(lambda: tutorial.attention(q, k, v, causal, scale)),
             "flashlab backward": timed(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal,
                                                                          variant="wgmma")),
             "sdpa backward": timed(lambda: torch.autograd.grad(ot, (qt, kt, vt), do, retain_graph=True))}
        if causal:
            t["triton backward"] = timed(lambda: torch.autograd.grad(orr, (qr, kr, vr), do, retain_graph=True))
        row = {"gpu": device, "date": time.strftime("%Y-%m-%d"), "B": B, "N": N, "d": d, "causal": causal,
               "triton_backward_tflops": ""}
        for name, seconds in t.items():
            row[name.replace(" ", "_") + "_tflops"] = round((2.5 if "backward" in name else 1) * flops / seconds / 1e12,
                                                            1)
        rows.append(row)
        print(f"B {B} N {N:5d} d {d:3d} {'causal' if causal else 'full':6s} " + "  ".join(
            f"{name} {row[name.replace(' ', '_') + '_tflops']:5.0f}" for name in t), flush=True)
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
