"""Do the sector and bank counts of lessons 07-08 show in the time a GPU takes? Measure them.

    python benchmarks/timing/memory_access.py [--out benchmarks/results/memory_access.csv] [--quick]

1. Coalescing. Each warp reads a (32 / L) x L block of a row-major float32 matrix with d = 64 floats per row
   (L consecutive lanes per row, flashlab.memory_access.tile_access) and writes the 32 floats out
   coalesced, for L = 32, 16, 8, 4, 2, 1. Every row is read by one warp only and the matrix is larger than
   L2, so repeats do not hit in the cache. Reported: useful GB/s read, next to the model's sectors per
   request and efficiency.
2. Bank conflicts. Blocks of 4 warps store into a shared tile the way lesson 09's kernel stores K
   transposed (8 lanes along the dims, 4 along the keys; rows of 32 + pad words), then read it back,
   8 rows per barrier, many times. Reported: nanoseconds per warp-wide store + load, next to the model's
   passes, for pad = 0, 1, 2, 4, 8.

CUDA events, median of 20 after warm-up. Without a GPU it runs tiny sizes in the simulator, for correctness
only (--quick is implied). Writes a CSV (one row per setting) and prints it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402,F401  (chooses the backend before numba.cuda is imported)
from flashlab import memory_access as ma  # noqa: E402
from flashlab.bench import write_csv  # noqa: E402
from flashlab.device import get_cuda, has_gpu  # noqa: E402

cuda = get_cuda()
from numba import float32  # noqa: E402

D = 64  # floats per row of the matrix read in part 1
ROWS8 = 8  # shared rows a thread stores and loads between two barriers in part 2
BLOCKS_PER_SM = 8


@cuda.jit
def read_block(x, out, lanes_per_row):
    g = cuda.grid(1)
    rows_per_warp = 32 // lanes_per_row
    row = (g // 32) * rows_per_warp + (g % 32) // lanes_per_row
    if row < x.shape[0] and g < out.shape[0]:
        out[g] = x[row, g % lanes_per_row]


def make_bank_kernel(stride: int, iters: int):
    size = 8 * ROWS8 * stride  # rows x + 8j < 8 * ROWS8 of `stride` words; the keys c < 16 < stride

    @cuda.jit
    def bank_kernel(out):
        sh = cuda.shared.array(size, float32)
        t = cuda.threadIdx.x
        lane, warp = t % 32, t // 32
        x, c = lane % 8, 4 * warp + lane // 8  # the register kernel's copy: 8 lanes per key, 4 keys per warp
        nxt = (lane + 1) % 32  # read the word another lane wrote, so the compiler cannot keep it in a register
        x2, c2 = nxt % 8, 4 * warp + nxt // 8
        v = float32(t)
        for _ in range(iters):
            for j in range(ROWS8):
                sh[(x + 8 * j) * stride + c] = v + j
            cuda.syncthreads()
            for j in range(ROWS8):
                v += sh[(x2 + 8 * j) * stride + c2]
            cuda.syncthreads()
        out[cuda.blockIdx.x * cuda.blockDim.x + t] = v

    return bank_kernel


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_access.csv"))
    ap.add_argument("--quick", action="store_true", help="small sizes (always without a GPU)")
    a = ap.parse_args()
    gpu = has_gpu()
    quick = a.quick or not gpu
    if gpu:
        from flashlab.bench import time_cuda

        name = cuda.get_current_device().name
        name = name.decode() if isinstance(name, bytes) else str(name)
        sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    else:
        name, sms = "CUDA simulator", 1
    rows = []

    threads = 1 << (12 if not gpu else 20 if quick else 24)
    for lpr in (32, 16, 8, 4, 2, 1):
        x = cuda.device_array((threads // lpr, D), np.float32)  # contents do not matter for timing
        out = cuda.device_array(threads, np.float32)
        r, col = ma.tile_access(lpr, D)
        cost = ma.coalescing(4 * (r * D + col))
        launch = lambda: read_block[threads // 128, 128](x, out, lpr)  # noqa: E731
        if gpu:
            ms = time_cuda(launch, warmup=3, reps=20)["median_ms"]
            metric = f"{4 * threads / ms / 1e6:.1f}"  # useful GB/s
        else:
            xs = np.arange(64 * D, dtype=np.float32).reshape(64, D)
            x = cuda.to_device(xs)
            read_block[1, 32 * min(4, 64 // (32 // lpr))](x, out, lpr)
            got = out.copy_to_host()[:32]
            assert np.array_equal(got, xs[r, col]), f"read_block is wrong for lanes_per_row={lpr}"
            ms, metric = "", ""
        rows.append({"gpu": name, "experiment": "coalescing", "setting": f"{lpr} lanes per row",
                     "model": f"{cost['sectors']} sectors, {cost['efficiency']:.0%} used", "median_ms": ms,
                     "metric": metric, "unit": "useful GB/s read"})
        print(rows[-1], flush=True)

    iters = 4 if not gpu else 256 if quick else 4096
    blocks = sms * BLOCKS_PER_SM if gpu else 1
    out = cuda.device_array(blocks * 128, np.float32)
    for pad in (0, 1, 2, 4, 8):
        kernel = make_bank_kernel(32 + pad, iters)
        lane = np.arange(32)
        words = (lane % 8) * (32 + pad) + lane // 8
        launch = lambda: kernel[blocks, 128](out)  # noqa: E731
        if gpu:
            ms = time_cuda(launch, warmup=3, reps=20)["median_ms"]
            accesses = blocks * 4 * iters * ROWS8  # warp-wide stores, each with one load
            metric = f"{ms * 1e6 / accesses * sms:.3f}"  # ns per store + load, per SM
        else:
            launch()
            assert np.isfinite(out.copy_to_host()).all()
            ms, metric = "", ""
        rows.append({"gpu": name, "experiment": "bank conflicts", "setting": f"rows of 32 + {pad} words",
                     "model": f"{ma.bank_conflict_degree(words)} passes", "median_ms": ms, "metric": metric,
                     "unit": "ns per warp store + load, per SM"})
        print(rows[-1], flush=True)

    if gpu:
        write_csv(a.out, rows)
        print("wrote", a.out)
    else:
        print("simulator: kernels checked; no timings (run on a GPU to write", a.out + ")")


if __name__ == "__main__":
    main()
