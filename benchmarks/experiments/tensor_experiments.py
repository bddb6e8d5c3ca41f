"""Tile experiments for the tensor-core forward (variant "tensor"), against torch SDPA in the same run.

    python benchmarks/experiments/tensor_experiments.py [--n 4096] [--out DIR]

B=1, H=16 (--causal: causal), CUDA events, median of 20 after warm-up. For each d and precision it times the
tiles listed below (warps, block_k, m-tiles per warp: block_q = 16 * m_tiles * warps), each launched alone on
arrays prepared once, with each compiled kernel's registers and shared memory, and writes tensor_experiments.csv
(tensor_experiments_causal.csv with --causal).
The defaults of kernels/tensor.py come from this table.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402  (chooses the backend first)
from flashlab.bench import attention_flops, tflops, time_cuda, write_csv  # noqa: E402

TILES = {  # (warps, block_k, m_tiles); those that do not fit 48 KB are skipped
    "f16": [(4, 64, 1), (4, 32, 1), (8, 64, 1), (8, 32, 1), (2, 64, 1), (8, 16, 1), (4, 16, 1),
            (4, 32, 2), (4, 64, 2), (8, 32, 2), (8, 64, 2), (2, 32, 2), (2, 64, 2), (4, 16, 2), (8, 16, 2)],
    "3xtf32": [(4, 32, 1), (4, 16, 1), (8, 32, 1), (8, 16, 1), (2, 32, 1), (2, 16, 1)],
}
DTYPE = {"f16": "float16", "bf16": "bfloat16", "3xtf32": "float32", "tf32": "float32"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--precisions", default=",".join(TILES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if not flashlab.device.has_gpu():
        print("needs a CUDA GPU")
        return 1
    import torch
    import torch.nn.functional as F

    from flashlab.kernels import tensor
    from flashlab.kernels._launch import empty_words, to_device_words

    rows, n = [], args.n
    for d in map(int, args.ds.split(",")):
        flops = attention_flops(1, 16, n, n, d)
        base = [torch.randn(1, 16, n, d, device="cuda") for _ in range(3)]
        if args.causal:
            flops /= 2
        for precision in args.precisions.split(","):
            q, k, v = (x.to(getattr(torch, DTYPE[precision])) for x in base)
            sdpa = tflops(flops, time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal))
                          ["median_ms"])
            words = [to_device_words(x, name)[0] for name, x in zip("qkv", (q, k, v))]
            _, o = empty_words(q.shape, DTYPE[precision], "torch", like=q)
            lse = empty_words(q.shape[:3], "float32", "torch", like=q)[1]
            for warps, bk, mt in TILES[precision]:
                try:
                    tile = tensor.TensorTile(warps, bk, mt).check(d, precision)
                except ValueError:
                    continue
                run = lambda: tensor.launch(*words, o, lse, 16, d ** -0.5, args.causal, tile, precision)  # noqa: E731
                kern = run()  # launch returns the kernel it compiled
                tf = tflops(flops, time_cuda(run)["median_ms"])
                regs, local = kern.get_regs_per_thread(), kern.get_local_mem_per_thread()
                regs = max(regs.values()) if isinstance(regs, dict) else regs
                local = max(local.values()) if isinstance(local, dict) else local
                row = {"N": n, "d": d, "causal": args.causal, "precision": precision, "warps": warps,
                       "m_tiles": mt, "block_q": tile.block_q, "block_k": bk,
                       "registers": regs, "local_bytes": local, "shared_bytes": 4 * tile.shared_words(d, precision),
                       "tflops": round(tf, 2), "sdpa_tflops": round(sdpa, 2), "ratio": round(tf / sdpa, 3)}
                rows.append(row)
                print("  ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    write_csv(Path(args.out) / f"tensor_experiments{'_causal' if args.causal else ''}.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
