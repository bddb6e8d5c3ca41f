"""The varlen bar: a packed batch of mixed lengths in one launch, against looping over the sequences and
against padding to the longest, in the same run (GPU; CUDA events, median of 20):

    python benchmarks/timing/bench_varlen.py [--seqs 64] [--min 128] [--max 4096] [--d 64] [--heads 16] [--causal]
                                      [--variant tensor|register] [--json out.json]

--json adds this configuration's row to a list in that file.

Lengths are drawn log-uniformly between --min and --max (seed 0), the same for queries and keys; float16.
Every flashlab row runs the same kernel variant (--variant, default tensor). Rows, each a forward of the whole
batch:
  flashlab varlen            kernels.flash_attention_varlen: one launch over the packed (total, H, d) arrays
  ..., kernel only           the same launch prepared once (kernels.varlen.prepare): the host's checks, plan and
                             block table left out
  flashlab loop              kernels.flash_attention on each sequence in turn, (1, H, n_b, d) views
  flashlab padded            kernels.flash_attention on (B, H, max, d): the padding's cost (its rows and keys
                             are computed as if real; a correct padded run would also mask the padding keys)
  torch SDPA padded + mask   scaled_dot_product_attention on the padded batch with a boolean key-padding mask
                             (the nearest torch path; varlen itself is not in torch's SDPA)
  torch SDPA loop            scaled_dot_product_attention on each sequence in turn: what looping costs torch
Bars: varlen at least 2x faster than the loop and at least as fast as padding.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min", type=int, default=128)
    ap.add_argument("--max", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variant", choices=("tensor", "register"), default="tensor")
    ap.add_argument("--json")
    ap.add_argument("--tiles", action="store_true", help="also time the varlen kernel alone with other tiles")
    args = ap.parse_args(argv)
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_attention, flash_attention_varlen
    from flashlab.kernels.varlen import prepare

    rng = np.random.default_rng(0)
    lens = np.exp(rng.uniform(np.log(args.min), np.log(args.max), args.seqs)).astype(int)
    lens[0] = args.max  # the longest length is in the batch, so padding pads to --max
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    H, d, total, B, N = args.heads, args.d, int(lens.sum()), args.seqs, int(lens.max())
    q, k, v = (torch.randn(total, H, d, device="cuda", dtype=torch.float16) for _ in range(3))
    views = [tuple(x[cu[b]:cu[b + 1]].permute(1, 0, 2).unsqueeze(0).contiguous() for x in (q, k, v))
             for b in range(B)]  # contiguous copies made once, outside the timing
    qp, kp, vp = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
    keep = (torch.arange(N)[None, :] < torch.as_tensor(lens)[:, None]).to("cuda")[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal, variant = args.causal, args.variant
    runs = {
        "flashlab varlen": lambda: flash_attention_varlen(q, k, v, cu, cu, causal=causal, variant=variant),
        "flashlab varlen, kernel only": prepare(q, k, v, cu, cu, causal=causal, variant=variant)[0],
        "flashlab loop": lambda: [flash_attention(*x, causal=causal, variant=variant) for x in views],
        "flashlab padded": lambda: flash_attention(qp, kp, vp, causal=causal, variant=variant),
        "torch SDPA padded + mask": lambda: sdpa(qp, kp, vp, attn_mask=keep if not causal else
                                                 keep & torch.ones(N, N, dtype=torch.bool, device="cuda").tril()),
        "torch SDPA loop": lambda: [sdpa(*x, is_causal=causal) for x in views],
    }
    if args.tiles:  # (block_q, block_k) overrides: one m-tile per warp when block_q is given
        for bq, bk in ((None, 32), (128, 32), (64, 64), (128, 64), (64, 32)):
            runs[f"kernel only, block_q={bq} block_k={bk}"] = prepare(q, k, v, cu, cu, causal=causal, variant=variant,
                                                                       block_q=bq, block_k=bk)[0]
    flops = 4 * H * d * float(np.sum(lens.astype(float) ** 2)) * (0.5 if causal else 1.0)  # the useful work
    rows = {}
    for name, fn in runs.items():
        rows[name] = time_cuda(fn)["median_ms"]
        print(f"{name:28s} {rows[name]:9.3f} ms {flops / rows[name] / 1e9:7.1f} useful TFLOP/s", flush=True)
    loop = rows["flashlab loop"] / rows["flashlab varlen"]
    pad = rows["flashlab padded"] / rows["flashlab varlen"]
    print(f"{B} sequences, {lens.min()}..{lens.max()} tokens ({total} in all), d={d}, H={H}, causal={causal}, "
          f"variant={variant}, {torch.cuda.get_device_name()}")
    print(f"loop / varlen: {loop:.2f} (bar: at least 2); padded / varlen: {pad:.2f} (bar: at least 1)")
    if args.json:  # one entry per configuration: a run with the same one replaces its entry
        run = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, lens=lens.tolist(), d=d, H=H,
                   causal=causal, variant=variant, ms=rows, loop_over_varlen=loop, padded_over_varlen=pad)
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        same = lambda r: all(r.get(x) == run[x] for x in ("gpu", "lens", "d", "H", "causal", "variant"))  # noqa
        path.write_text(json.dumps([r for r in old if not same(r)] + [run], indent=1))

if __name__ == "__main__":
    main()
