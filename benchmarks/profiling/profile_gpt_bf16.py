"""Where lesson 13's bf16 GPT (flashlab.gpt.BF16_SETUP: B 8, H 4, N 1024, d 64, causal) spends a training step,
with torch's SDPA and with flashlab.torch's (GPU):

    python benchmarks/profiling/profile_gpt_bf16.py [--parts kernels,layer,train,profile,cprofile]

kernels   the attention alone at the GPT's shape and two longer ones, bfloat16, random data (CUDA events, median
          of 20 after two warm-ups, host time included): flashlab's wgmma and tensor backwards and torch's
          backward; flashlab.torch's forward and torch's;
layer     one layer's work, as the GPT calls it (q, k, v strided views of one linear's output, under autocast):
          linear, attention forward and backward, wall time per step over 50 steps after 20;
train     gpt.compare_attention over 80 steps (tokens/s after 30), torch, flashlab, and flashlab with the tensor
          backward at N 1024 (plan.WGMMA_BACKWARD_MIN_N raised to 4096), then torch again;
profile   torch.profiler over 5 training steps of each: the operators by CUDA time and by CPU self time
          (flashlab's Python shows as the self time of FlashAttentionFunction and its backward);
cprofile  cProfile over 50 of layer's steps with flashlab's attention: which Python functions the host time goes to.
split     a training step split into its phases (batch, forward, backward, clip, optimizer): the host's time in each,
          from perf_counter with no synchronisation, beside the step's wall time (a synchronised step): where the
          host's sum is the wall time, the step is host-bound and each phase's share says where. torch and
          flashlab alternate in rounds of 20 steps (5 rounds), the same model and batches; medians per phase.
          First, the operations of one step of each that wait for the GPU (torch.cuda.set_sync_debug_mode).
          With --gpu-bound, of flashlab.gpt.BF16_GPU_BOUND_SETUP's GPT (head dim 128, N 4096), whose step the GPU
          bounds; so does profile's.
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
sys.path.insert(0, str(ROOT / "scripts"))

import flashlab  # noqa: E402,F401  (chooses the backend before numba.cuda is imported)

PARTS = ("kernels", "layer", "train", "profile", "cprofile", "split")


def kernels():
    import torch
    import torch.nn.functional as Fn

    from flashlab.kernels import flash_attention, flash_attention_backward
    from flashlab.torch import scaled_dot_product_attention as flash_sdpa
    from gpu_check_wgmma_forward import timed  # flashlab.bench.time_cuda's median

    for B, H, N, causal in [(8, 4, 1024, True), (8, 4, 1024, False), (4, 8, 2048, True), (1, 16, 2048, True)]:
        q, k, v, do = (torch.randn(B, H, N, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
        qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
        ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        t = {name: timed(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant=name), 20)
             for name in ("wgmma", "tensor")}
        t["sdpa"] = timed(lambda: torch.autograd.grad(ot, (qt, kt, vt), do, retain_graph=True), 20)
        t["fwd_flash"] = timed(lambda: flash_sdpa(q, k, v, is_causal=causal), 20)
        t["fwd_sdpa"] = timed(lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal), 20)
        print(f"B{B} H{H} N{N} causal={causal}: " + "  ".join(f"{name} {x * 1e6:7.1f} us" for name, x in t.items()),
              flush=True)


def _layer_step():
    """One layer's linear and attention, forward and backward, as the GPT runs them: a function of the attention."""
    import torch

    B, N, C, H = 8, 1024, 256, 4
    lin = torch.nn.Linear(C, 3 * C).cuda()
    x = torch.randn(B, N, C, device="cuda")

    def step(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q, k, v = lin(x).split(C, dim=2)
            q, k, v = (t.view(B, N, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = fn(q, k, v, is_causal=True)
        y.float().sum().backward()

    return step


def layer():
    import torch
    import torch.nn.functional as Fn

    from flashlab.torch import scaled_dot_product_attention as flash_sdpa

    step = _layer_step()
    for name, fn in (("torch", Fn.scaled_dot_product_attention), ("flashlab", flash_sdpa)):
        for _ in range(20):
            step(fn)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            step(fn)
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - t) / 50 * 1e6:.0f} us a step (linear, attention fwd+bwd)", flush=True)


def train():
    import torch
    import torch.nn.functional as Fn

    from flashlab import gpt
    from flashlab.kernels import plan
    from flashlab.torch import scaled_dot_product_attention as flash_sdpa

    setup = dict(gpt.BF16_SETUP, steps=80, warmup=30)
    runs = gpt.compare_attention({"torch": Fn.scaled_dot_product_attention, "flashlab": flash_sdpa}, setup,
                                 device="cuda", progress=False, autocast_dtype=torch.bfloat16)["runs"]
    old = plan.WGMMA_BACKWARD_MIN_N
    plan.WGMMA_BACKWARD_MIN_N = 4096  # N 1024: the tensor backward
    try:
        runs.update(gpt.compare_attention({"flashlab_tensor_bwd": flash_sdpa,
                                           "torch_again": Fn.scaled_dot_product_attention}, setup, device="cuda",
                                          progress=False, autocast_dtype=torch.bfloat16)["runs"])
    finally:
        plan.WGMMA_BACKWARD_MIN_N = old
    for name, r in runs.items():
        print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s", flush=True)


def profile(gpu_bound=False):
    import torch
    import torch.nn.functional as Fn
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from flashlab import gpt
    from flashlab.torch import scaled_dot_product_attention as flash_sdpa

    cfg = gpt.BF16_GPU_BOUND_SETUP if gpu_bound else gpt.BF16_SETUP
    tok = gpt.CharTokenizer(gpt.TINY_TEXT)
    data = tok.encode(gpt.copy_text(cfg["text_chars"], 0))
    train = dict(batch_size=cfg["batch_size"], lr=cfg["lr"], progress=False, autocast_dtype=torch.bfloat16,
                 grad_clip=cfg["grad_clip"])
    for name, fn in (("torch", Fn.scaled_dot_product_attention), ("flashlab", flash_sdpa)):
        model = gpt.GPT(gpt.GPTConfig(tok.vocab_size, cfg["block_size"], cfg["n_layer"], cfg["n_head"],
                                      cfg["n_embd"])).cuda()
        model.use_attention(fn)
        gpt.train(model, data, 10, **train)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gpt.train(model, data, 5, **train)
            torch.cuda.synchronize()
        for key in ("cuda_time_total", "self_cpu_time_total"):
            print(f"== {name}: 5 steps, by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)


def cprofile():
    import torch

    from flashlab.torch import scaled_dot_product_attention as flash_sdpa

    step = _layer_step()
    for _ in range(20):
        step(flash_sdpa)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        step(flash_sdpa)
    torch.cuda.synchronize()
    pr.disable()
    stats = pstats.Stats(pr)
    stats.sort_stats("tottime").print_stats(28)
    stats.sort_stats("cumtime").print_stats("flashlab", 30)


def split(rounds=5, steps=20, gpu_bound=False):
    import statistics

    import torch
    import torch.nn.functional as Fn

    from flashlab import gpt
    from flashlab.torch import scaled_dot_product_attention as flash_sdpa

    cfg = gpt.BF16_GPU_BOUND_SETUP if gpu_bound else gpt.BF16_SETUP
    print(f"split: n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}, n_head {cfg['n_head']}, "
          f"N {cfg['block_size']}, batch {cfg['batch_size']}", flush=True)
    tok = gpt.CharTokenizer(gpt.TINY_TEXT)
    data = tok.encode(gpt.copy_text(cfg["text_chars"], 0))
    phases = ("batch", "forward", "backward", "clip", "optimizer")
    runs = {}
    for name, fn in (("torch", Fn.scaled_dot_product_attention), ("flashlab", flash_sdpa)):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.GPTConfig(tok.vocab_size, cfg["block_size"], cfg["n_layer"], cfg["n_head"],
                                      cfg["n_embd"])).cuda()
        model.use_attention(fn)
        runs[name] = dict(model=model, opt=torch.optim.AdamW(model.parameters(), lr=cfg["lr"]),
                          gen=torch.Generator().manual_seed(0), host={p: [] for p in phases}, wall=[])

    def step(r, record):
        t = [time.perf_counter()]
        x, y = gpt.get_batch(data, cfg["block_size"], cfg["batch_size"], r["gen"])
        x, y = x.cuda(), y.cuda()
        t.append(time.perf_counter())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = r["model"](x, y)
        t.append(time.perf_counter())
        r["opt"].zero_grad(set_to_none=True)
        loss.backward()
        t.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(r["model"].parameters(), cfg["grad_clip"])
        t.append(time.perf_counter())
        r["opt"].step()
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        if record:
            for p, a, b in zip(phases, t, t[1:]):
                r["host"][p].append(b - a)
            r["wall"].append(time.perf_counter() - t[0])

    import warnings

    for name, r in runs.items():  # compile and warm up; then the operations of a step that wait for the GPU
        for _ in range(10):
            step(r, False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(r, False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        print(f"{name}: {len(seen)} synchronising operations in a step (torch.cuda.set_sync_debug_mode)",
              *sorted({str(w.message).splitlines()[0] for w in seen}), sep="\n  ", flush=True)
    for _ in range(rounds):
        for r in runs.values():
            for _ in range(steps):
                step(r, True)
    tokens = cfg["batch_size"] * cfg["block_size"]
    print(f"a training step, ms (median of {rounds * steps} steps, rounds of {steps} alternating): host time of "
          "each phase, their sum, the synchronised step's wall time, tokens/s from it", flush=True)
    for name, r in runs.items():
        host = {p: statistics.median(v) * 1e3 for p, v in r["host"].items()}
        wall = statistics.median(r["wall"]) * 1e3
        print(f"{name:9s} " + "  ".join(f"{p} {v:6.2f}" for p, v in host.items()) +
              f"  | host {sum(host.values()):6.2f}  wall {wall:6.2f}  {tokens / wall * 1e3:10,.0f} tokens/s",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    ap.add_argument("--gpu-bound", action="store_true",
                    help="split and profile: flashlab.gpt.BF16_GPU_BOUND_SETUP's GPT instead of lesson 13's")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts takes {', '.join(PARTS)}; got {', '.join(unknown)}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("this profile needs a CUDA GPU")
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"), flush=True)
    for name in parts:
        if name in ("split", "profile"):
            globals()[name](gpu_bound=args.gpu_bound)
        else:
            globals()[name]()


if __name__ == "__main__":
    main()
