"""Train lesson 13's GPT in bf16 on a GPU, once on torch's attention and once on flashlab's, and save both loss
curves and tokens/s (GPU; about a minute on an H100, most of it flashlab's kernels compiling).

    python benchmarks/generators/gpt_bf16.py                          # writes flashlab/data/gpt_bf16.json
    python benchmarks/generators/gpt_bf16.py --out /tmp/gpt_bf16.json --steps 100
    python benchmarks/generators/gpt_bf16.py --device cpu --steps 3 --tiny --out /tmp/smoke.json   # smoke test, float32
    python benchmarks/generators/gpt_bf16.py --gpu-bound --out benchmarks/results/h200/gpt_bf16_gpu_bound.json

flashlab.gpt.compare_attention trains three copies of one GPT (flashlab.gpt.BF16_SETUP: head dim 64, on
flashlab.gpt.copy_text) from the same initial weights, seed and batches: with
torch.nn.functional.scaled_dot_product_attention, with flashlab.torch.scaled_dot_product_attention, and with
torch's again (what two runs of one implementation drift apart, if anything). On CUDA the forward pass runs under
torch.autocast(device_type="cuda", dtype=torch.bfloat16), with float32 master weights and AdamW state; on the
CPU (a smoke test) in float32. tokens/s counts the steps after --warmup, in the same process for every run.

The file records the per-step losses, tokens/s and first-step seconds (compilation included) of each run, the GPU,
versions, model and training setup, and flashlab.gpt.BF16_LOSS_TOLERANCE. flashlab.gpt.check_bf16_run checks its
layout before it is written. The script exits with status 1 when flashlab's curve is further from torch's than
the tolerance (the file is written all the same). Commit the new file after a GPU run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402,F401  (chooses the backend before numba.cuda is imported)
from flashlab import gpt  # noqa: E402

#: A seconds-long setup for smoke tests (--tiny): head dim 64 still, so it also runs the GPU kernels.
TINY_SETUP = {"n_layer": 1, "n_head": 1, "n_embd": 64, "block_size": 64, "batch_size": 4, "steps": 20,
              "lr": 3e-3, "grad_clip": 1.0, "warmup": 1, "text_chars": 5000, "seed": 0}


def environment(device: str) -> dict:
    """The GPU's name and the versions that shape the numbers."""
    from importlib.metadata import version

    import numpy as np
    import torch

    versions = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "numba": version("numba"),
                "numba_cuda": version("numba-cuda"), "numpy": np.__version__, "python": platform.python_version()}
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "none (CPU)"
    return {"gpu": gpu, "versions": versions}


def run(device: str = "cuda", setup: dict | None = None, progress: bool = True) -> dict:
    """The comparison as gpt_bf16.json holds it: flashlab.gpt.compare_attention plus environment and tolerance."""
    import torch
    import torch.nn.functional as F

    from flashlab.torch import scaled_dot_product_attention as flash_sdpa

    on_cuda = device.startswith("cuda")
    if on_cuda and not (torch.cuda.is_available() and flashlab.device.has_gpu()):
        raise SystemExit("--device cuda needs a CUDA GPU for torch and numba-cuda; none found "
                         "(flashlab.doctor() says why). Use --device cpu for a smoke test.")
    if on_cuda and not torch.cuda.is_bf16_supported():
        raise SystemExit(f"{torch.cuda.get_device_name()} has no bfloat16 support; bf16 training needs sm_80 or newer")
    attentions = {"torch": F.scaled_dot_product_attention, "flashlab": flash_sdpa,
                  "torch_again": F.scaled_dot_product_attention}
    result = gpt.compare_attention(attentions, setup, device=device, progress=progress,
                                   autocast_dtype=torch.bfloat16 if on_cuda else None)
    today = datetime.date.today().isoformat()
    record = {"source": f"benchmarks/generators/gpt_bf16.py, {today}", "date": today, **environment(device), **result,
              "tolerance": {"max_smoothed_gap": gpt.BF16_LOSS_TOLERANCE, "window": gpt.BF16_LOSS_WINDOW}}
    return gpt.check_bf16_run(record)


def summary(record: dict) -> tuple[str, bool]:
    """A few lines for the terminal, and whether flashlab's curve is within the tolerance of torch's."""
    runs, tol = record["runs"], gpt.BF16_LOSS_TOLERANCE
    window = min(gpt.BF16_LOSS_WINDOW, record["training"]["steps"])
    lines = [f"{record['gpu']}, {record['dtype']}, config {record['config']}"]
    for name, r in runs.items():
        last = r["losses"][-window:]
        lines.append(f"{r['label']:>18}: loss {r['losses'][0]:.3f} -> {sum(last) / len(last):.3f}   "
                     f"{r['tokens_per_s']:>12,.0f} tokens/s   first step {r['first_step_s']:.2f} s")
    gaps = {name: gpt.loss_gap(r["losses"], runs["torch"]["losses"], window) for name, r in runs.items()
            if name != "torch"}
    for name, g in gaps.items():
        lines.append(f"max smoothed loss gap, {runs[name]['label']} vs torch SDPA: {g:.4f} nats (tolerance {tol})")
    ok = gaps["flashlab"] <= tol
    lines.append(f"flashlab/torch tokens/s: {runs['flashlab']['tokens_per_s'] / runs['torch']['tokens_per_s']:.2f}; "
                 f"loss curves {'match' if ok else 'DO NOT match'}")
    return "\n".join(lines), ok


def dumps(record: dict) -> str:
    """JSON with one line per list of numbers (a loss curve), so the file reads and diffs well."""
    text = json.dumps(record, indent=1)
    return re.sub(r"\[\s*([-\d.eE+,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (bf16 autocast, the measurement) or cpu (float32 "
                                                         "smoke test); default cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file to write (default on CUDA: {gpt.BF16_JSON}; on the CPU: none, print only)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long model and text, for smoke tests")
    parser.add_argument("--gpu-bound", action="store_true",
                        help="flashlab.gpt.BF16_GPU_BOUND_SETUP (N 4096, d 128) instead of lesson 13's; "
                             "written only with --out")
    parser.add_argument("--steps", type=int, help="training steps (default: the setup's)")
    parser.add_argument("--warmup", type=int, help="steps left out of tokens/s (default: the setup's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.tiny and args.gpu_bound:
        parser.error("--tiny and --gpu-bound choose different setups: give one")
    setup = dict(TINY_SETUP if args.tiny else gpt.BF16_GPU_BOUND_SETUP if args.gpu_bound else gpt.BF16_SETUP)
    if args.steps is not None:
        setup["steps"] = args.steps
    if args.warmup is not None:
        setup["warmup"] = args.warmup
    setup["warmup"] = min(setup["warmup"], setup["steps"] - 1)
    record = run(args.device, setup, progress=not args.no_progress)
    text, ok = summary(record)
    print(text)
    out = args.out or (gpt.BF16_JSON if args.device.startswith("cuda") and not args.gpu_bound else None)
    if out is not None:
        out.write_text(dumps(record))
        print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
