"""The tensor-core ceiling a pure-Python Numba kernel can reach: independent mma.sync chains in registers.

    python benchmarks/timing/mma_ceiling.py [--out benchmarks/results/h100]

Each warp keeps 8 independent accumulator tiles and issues mma after mma on them (no memory traffic, no
dependency stalls beyond the instruction's own latency), for each instruction flashlab.kernels.mma has.
TFLOP/s = 2*M*N*K per mma. Lesson 15 and the roofline place the attention kernel against these numbers.
Writes mma_ceiling.csv (instruction, TFLOP/s, the GPU) to --out. Lessons 10 and 15 read the H100's copy,
flashlab/data/h100_mma_ceiling.csv (package data, so Colab has it too): copy a new H100 result there.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402  (chooses the backend first)
from flashlab.bench import time_cuda, write_csv  # noqa: E402

CHAINS, ITERS = 8, 2048
REGS = 4 * CHAINS  # accumulator registers per lane (a local array size must be a plain constant)


def kernels():
    from flashlab.device import get_cuda
    from flashlab.kernels import mma

    cuda = get_cuda()

    def chain_kernel(kind):
        @cuda.jit
        def chain(out, iters, seed):
            x = np.uint32(seed) ^ np.uint32(cuda.threadIdx.x & 1)  # not a compile-time constant
            f = np.float32(seed) * np.float32(1e-3)
            c = cuda.local.array(REGS, np.float32)
            for j in range(REGS):
                c[j] = np.float32(0)
            for _ in range(iters):
                for j in range(CHAINS):  # constant trip count: unrolled, c stays in registers
                    c0, c1, c2, c3 = c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]
                    if kind == 0:  # `kind` is a compile-time constant: the other branches are dropped
                        r = mma.mma_f16_m16n8k16(x, x, x, x, x, x, c0, c1, c2, c3)
                    elif kind == 1:
                        r = mma.mma_bf16_m16n8k16(x, x, x, x, x, x, c0, c1, c2, c3)
                    elif kind == 2:
                        r = mma.mma_f16_m16n8k8(x, x, x, c0, c1, c2, c3)
                    else:
                        r = mma.mma_tf32_m16n8k8(f, f, f, f, f, f, c0, c1, c2, c3)
                    c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3] = r[0], r[1], r[2], r[3]
            s = np.float32(0)
            for j in range(REGS):
                s += c[j]
            if s == np.float32(12345.0):  # never true: keeps the work alive
                out[0] = s
        return chain

    return {"fp16 m16n8k16": (chain_kernel(0), 16), "bf16 m16n8k16": (chain_kernel(1), 16),
            "fp16 m16n8k8 (sm_75 shape)": (chain_kernel(2), 8), "tf32 m16n8k8": (chain_kernel(3), 8)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if not flashlab.device.has_gpu():
        print("needs a CUDA GPU")
        return 1
    from flashlab.device import device_limits, get_cuda

    cuda, lim = get_cuda(), device_limits()
    blocks, threads = lim["sms"] * 8, 128
    out = cuda.device_array(1, np.float32)
    rows = []
    for name, (kern, k) in kernels().items():
        t = time_cuda(lambda: kern[blocks, threads](out, ITERS, 1), warmup=2, reps=20)
        flops = blocks * threads // 32 * ITERS * CHAINS * 2 * 16 * 8 * k
        tf = flops / (t["median_ms"] * 1e-3) / 1e12
        rows.append({"instruction": name, "tflops": round(tf, 1), "gpu": lim["name"]})
        print(f"{name:28s} {tf:7.1f} TFLOP/s", flush=True)
    rows.append({"instruction": "3xTF32 (3 tf32 mma per product)", "tflops": round(rows[-1]["tflops"] / 3, 1),
                 "gpu": lim["name"]})
    write_csv(Path(args.out) / "mma_ceiling.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
