"""What each of the library's options costs on tensor cores, forward and backward, against the plain kernel and
torch SDPA in the same run (GPU; float16; CUDA events, median of 20):

    python benchmarks/timing/bench_options.py [--n 4096] [--d 64] [--heads 16] [--window 1024] [--json out.json]

Rows (B = 1): plain, causal, a causal window (--window, 0), ALiBi (one slope per head), softcap 30, dropout 0.1,
and all of them at once (causal, window, ALiBi, softcap, dropout). Columns:
  flashlab fwd       kernels.flash_attention(..., variant="tensor")
  flashlab fwd+bwd   that, then kernels.flash_attention_backward(..., variant="tensor") on its o and lse
  SDPA fwd / fwd+bwd torch's scaled_dot_product_attention, then .backward: is_causal for causal, an explicit
                     boolean mask for the window and a float bias for ALiBi (SDPA has neither argument, so it
                     leaves its flash path for the memory-efficient one); softcap has no SDPA equivalent (empty)
The window and causal rows skip the key tiles outside the band, so they do less work than plain; the ratio
columns say what each option costs on top of the work it keeps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_attention, flash_attention_backward

    N, d, H, W = args.n, args.d, args.heads, args.window
    q, k, v, do = (torch.randn(1, H, N, d, device="cuda", dtype=torch.float16) for _ in range(4))
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H)  # the ALiBi paper's slopes
    pos = torch.arange(N, device="cuda")
    dist = (pos[:, None] - pos[None, :]).abs()
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - W)
    alibi = (-slopes.to("cuda")[:, None, None] * dist).to(torch.float16)[None]  # (1, H, N, N)
    window = dict(causal=True, window_size=(W, 0))
    cases = {  # name: (flashlab options, SDPA keywords or None)
        "plain": (dict(), dict()),
        "causal": (dict(causal=True), dict(is_causal=True)),
        f"window ({W}, 0)": (window, dict(attn_mask=band)),
        "alibi": (dict(alibi_slopes=slopes.numpy()), dict(attn_mask=alibi)),
        "softcap 30": (dict(softcap=30.0), None),
        "dropout 0.1": (dict(dropout_p=0.1, seed=1), dict(dropout_p=0.1)),
        "all": (dict(window, alibi_slopes=slopes.numpy(), softcap=30.0, dropout_p=0.1, seed=1), None),
    }
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def flashlab_both(opts):
        o, lse = flash_attention(q, k, v, variant="tensor", **opts)
        return flash_attention_backward(q, k, v, o, lse, do, variant="tensor", **opts)

    def sdpa_both(kw):
        sdpa(qg, kg, vg, **kw).backward(do)

    rows = {}
    print(f"{'option':18s} {'fwd ms':>8s} {'fwd+bwd':>8s} {'SDPA fwd':>9s} {'SDPA f+b':>9s}  fwd/plain  f+b/plain",
          flush=True)
    for name, (opts, kw) in cases.items():
        row = {"fwd": time_cuda(lambda: flash_attention(q, k, v, variant="tensor", **opts))["median_ms"],
               "fwd+bwd": time_cuda(lambda: flashlab_both(opts))["median_ms"]}
        if kw is not None:
            row["sdpa fwd"] = time_cuda(lambda: sdpa(q, k, v, **kw))["median_ms"]
            row["sdpa fwd+bwd"] = time_cuda(lambda: sdpa_both(kw))["median_ms"]
        rows[name] = row
        plain = rows["plain"]
        fmt = lambda x: f"{x:9.3f}" if x is not None else f"{'-':>9s}"  # noqa: E731
        print(f"{name:18s} {row['fwd']:8.3f} {row['fwd+bwd']:8.3f} {fmt(row.get('sdpa fwd'))} "
              f"{fmt(row.get('sdpa fwd+bwd'))}  {row['fwd'] / plain['fwd']:9.2f}  "
              f"{row['fwd+bwd'] / plain['fwd+bwd']:9.2f}", flush=True)
    print(f"B=1 H={H} N={N} d={d} float16, variant='tensor', {torch.cuda.get_device_name()}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, N=N,
                                                   d=d, H=H, window=W, dtype="float16", ms=rows), indent=1))


if __name__ == "__main__":
    main()
