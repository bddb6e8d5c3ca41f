"""Tile experiments for the tensor-core forward (variant "tensor"), against torch SDPA in the same run.

    python benchmarks/tensor_experiments.py [--n 4096] [--out DIR]

B=1, H=16, non-causal, CUDA events, median of 20 after warm-up. For each d and precision it times the
tiles listed below (warps per block = block_q / 16, block_k), with each compiled kernel's registers and
shared memory, and writes tensor_experiments.csv. The defaults of kernels/tensor.py come from this table.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402  (chooses the backend first)
from flashlab.bench import attention_flops, tflops, time_cuda, write_csv  # noqa: E402

TILES = {  # (warps, block_k); those that do not fit 48 KB are skipped
    "f16": [(4, 64), (4, 32), (8, 64), (8, 32), (2, 64), (8, 16), (4, 16)],
    "3xtf32": [(4, 32), (4, 16), (8, 32), (8, 16), (2, 32), (2, 16)],
}
DTYPE = {"f16": "float16", "bf16": "bfloat16", "3xtf32": "float32", "tf32": "float32"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if not flashlab.device.has_gpu():
        print("needs a CUDA GPU")
        return 1
    import torch
    import torch.nn.functional as F

    from flashlab.kernels import tensor

    rows, n = [], args.n
    for d in map(int, args.ds.split(",")):
        flops = attention_flops(1, 16, n, n, d)
        base = [torch.randn(1, 16, n, d, device="cuda") for _ in range(3)]
        for precision, tiles in TILES.items():
            q, k, v = (x.to(getattr(torch, DTYPE[precision])) for x in base)
            sdpa = tflops(flops, time_cuda(lambda: F.scaled_dot_product_attention(q, k, v))["median_ms"])
            for warps, bk in tiles:
                tile = tensor.TensorTile(warps, bk)
                try:
                    tile.check(d, precision)
                except ValueError:
                    continue
                run = tensor.prepare(q, k, v, precision=precision, block_q=tile.block_q, block_k=bk)[0]
                tf = tflops(flops, time_cuda(run)["median_ms"])
                kern = tensor.build(d, tile, False, precision)
                regs, local = kern.get_regs_per_thread(), kern.get_local_mem_per_thread()
                regs = max(regs.values()) if isinstance(regs, dict) else regs
                local = max(local.values()) if isinstance(local, dict) else local
                row = {"N": n, "d": d, "precision": precision, "block_q": tile.block_q, "block_k": bk,
                       "registers": regs, "local_bytes": local, "shared_bytes": 4 * tile.shared_words(d, precision),
                       "tflops": round(tf, 2), "sdpa_tflops": round(sdpa, 2), "ratio": round(tf / sdpa, 3)}
                rows.append(row)
                print("  ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    write_csv(Path(args.out) / "tensor_experiments.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
