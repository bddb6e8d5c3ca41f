"""The tensor-core ceiling a pure-Python Numba kernel can reach: independent mma.sync chains in registers.

    python benchmarks/timing/mma_ceiling.py                      # random operands and the constant ones, one run
    python benchmarks/timing/mma_ceiling.py --operands random    # random operands only
    python benchmarks/timing/mma_ceiling.py --out /tmp/ceiling.csv --seconds 0.5 --rounds 3

Each warp keeps 8 independent accumulator tiles and issues mma after mma on them (no memory traffic, no
dependency stalls beyond the instruction's own latency), for each instruction flashlab.kernels.mma has.
TFLOP/s = 2*M*N*K per mma. Lessons 10, 15 and 16 place the attention kernel against these numbers.

What the operands hold matters: a tensor core's power draw depends on how many bits toggle, and under a
power limit the clock drops, so an all-zero or 0/1-bit operand makes the ceiling look higher than any real
product reaches. The operands are therefore random (normal values, a different A and B for each of the
8 chains, so that consecutive mma see different bits), loaded from memory so that the compiler cannot fold
them. `--operands constant` gives every lane the same 0/1-bit words a kernel without input data has
(1 in even lanes, 0 in odd ones; 1e-3 for tf32), and `--operands both` (the default) measures both with the
same compiled kernels, alternating in every round, so that the difference between the two is not the
difference between two runs. Each measurement repeats launches for --seconds, and an nvidia-smi sampler
records the SM clock and the board power meanwhile (empty columns where nvidia-smi is missing).

Writes one row per (instruction, operands): the median TFLOP/s over the rounds, the lowest and highest
round, the median SM clock and power, the GPU's name and the date. The default --out is the package data
file the lessons read, flashlab/data/mma_ceiling.csv (flashlab.viz.tensor.load_mma_ceiling).
Run time: about 30-40 s on an H100 or H200 (4 kernels to compile, 2 rounds x 4 instructions x 2 operand sets
x 1 s).
"""
import argparse
import datetime
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flashlab  # noqa: E402  (chooses the backend first)
from flashlab.bench import write_csv  # noqa: E402

CHAINS, ITERS = 8, 4096
WORDS = 6  # operand registers per chain and lane: A (4) and B (2) of m16n8k16 or tf32 m16n8k8; m16n8k8 uses 3
# Local array sizes must be plain constants: Numba does not fold `CHAINS * WORDS` written inside the kernel.
REGS = 4 * CHAINS  # accumulator registers per lane
OPERAND_REGS = CHAINS * WORDS
DEFAULT_OUT = ROOT / "flashlab" / "data" / "mma_ceiling.csv"
# instruction: (mma kind, k, the operand format), names as flashlab.viz.tensor.CEILING_OF expects them
INSTRUCTIONS = {"fp16 m16n8k16": (0, 16, "float16"), "bf16 m16n8k16": (1, 16, "bfloat16"),
                "fp16 m16n8k8 (sm_75 shape)": (2, 8, "float16"), "tf32 m16n8k8": (3, 8, "tf32")}
THREE_TF32 = "3xTF32 (3 tf32 mma per product)"
CONSTANT = "constant 0/1 bits"


def operands(fmt: str, kind: str, rng) -> np.ndarray:
    """(32 lanes, CHAINS, WORDS) registers: uint32 words of two packed 16-bit values, or float32 for tf32.
    random: standard normal values, rounded to the format (bfloat16 by truncating a float32); constant: the
    0/1-bit words of a kernel without data (1 in even lanes, 0 in odd ones), 1e-3 for tf32."""
    shape = (32, CHAINS, WORDS)
    if kind == "constant":
        if fmt == "tf32":
            return np.full(shape, 1e-3, np.float32)
        return np.broadcast_to((np.arange(32) % 2 == 0).astype(np.uint32)[:, None, None], shape).copy()
    x = rng.standard_normal(shape + (2,)).astype(np.float32)
    if fmt == "tf32":
        return np.ascontiguousarray(x[..., 0])
    if fmt == "float16":
        halves = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        halves = x.view(np.uint32) >> 16
    return np.ascontiguousarray(halves[..., 0] | (halves[..., 1] << 16)).astype(np.uint32)


def kernels():
    from flashlab.device import get_cuda
    from flashlab.kernels import mma

    cuda = get_cuda()

    def chain_kernel(kind):
        word = np.float32 if kind == 3 else np.uint32  # tf32 operands are float32 values, the others packed pairs

        @cuda.jit
        def chain(ops, out, iters):
            lane = cuda.threadIdx.x % 32
            a = cuda.local.array(OPERAND_REGS, word)  # this lane's operands: registers (constant indices)
            for j in range(OPERAND_REGS):
                a[j] = ops[lane, j // WORDS, j % WORDS]
            c = cuda.local.array(REGS, np.float32)
            for j in range(REGS):
                c[j] = np.float32(0)
            for _ in range(iters):
                for j in range(CHAINS):  # constant trip count: unrolled, a and c stay in registers
                    o = WORDS * j
                    c0, c1, c2, c3 = c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]
                    a0, a1, a2, a3, a4, a5 = a[o], a[o + 1], a[o + 2], a[o + 3], a[o + 4], a[o + 5]
                    if kind == 0:  # `kind` is a compile-time constant: the other branches are dropped
                        r = mma.mma_f16_m16n8k16(a0, a1, a2, a3, a4, a5, c0, c1, c2, c3)
                    elif kind == 1:
                        r = mma.mma_bf16_m16n8k16(a0, a1, a2, a3, a4, a5, c0, c1, c2, c3)
                    elif kind == 2:
                        r = mma.mma_f16_m16n8k8(a0, a1, a2, c0, c1, c2, c3)
                    else:
                        r = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, a4, a5, c0, c1, c2, c3)
                    c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3] = r[0], r[1], r[2], r[3]
            s = np.float32(0)
            for j in range(REGS):
                s += c[j]
            if s == np.float32(12345.0):  # (almost) never true: keeps the work alive
                out[0] = s
        return chain

    return {name: chain_kernel(kind) for name, (kind, _, _) in INSTRUCTIONS.items()}


class Sampler:
    """nvidia-smi's SM clock (MHz) and board power (W) of one GPU, sampled every 50 ms in a background thread;
    window(t0, t1) gives the medians of the samples taken between two time.time() values. uuid: the GPU's
    ("GPU-..."); None keeps every GPU's samples, right where only one is visible."""

    def __init__(self, uuid=None):
        self.samples, self.proc, self.uuid = [], None, (uuid or "").lower() or None
        if shutil.which("nvidia-smi") is None:
            return
        cmd = ["nvidia-smi", "--query-gpu=uuid,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                uuid, clock, power = (x.strip() for x in line.split(","))
                if self.uuid is None or uuid.lower() == self.uuid:
                    self.samples.append((time.time(), float(clock), float(power)))
            except ValueError:
                continue

    def window(self, t0, t1):
        inside = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
        if not inside:
            return "", ""
        clocks, powers = zip(*inside)
        return round(float(np.median(clocks))), round(float(np.median(powers)), 1)

    def stop(self):
        if self.proc:
            self.proc.terminate()


def measure(kern, ops, out, blocks, threads, k, seconds, sync):
    """Launch back to back for about `seconds`; TFLOP/s and the wall-clock window of the timed launches."""
    kern[blocks, threads](ops, out, ITERS)
    sync()
    t = time.perf_counter()
    kern[blocks, threads](ops, out, ITERS)
    sync()
    once = time.perf_counter() - t
    reps = max(3, int(seconds / max(once, 1e-6)))
    wall0, t0 = time.time(), time.perf_counter()
    for _ in range(reps):
        kern[blocks, threads](ops, out, ITERS)
    sync()
    elapsed, wall1 = time.perf_counter() - t0, time.time()
    flops = reps * blocks * threads // 32 * ITERS * CHAINS * 2 * 16 * 8 * k
    return flops / elapsed / 1e12, (wall0, wall1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="CSV to write (default: %(default)s)")
    ap.add_argument("--operands", choices=("random", "constant", "both"), default="both")
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measurement (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every instruction (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not flashlab.device.has_gpu():
        print("needs a CUDA GPU")
        return 1
    from flashlab.device import device_limits, get_cuda

    cuda, lim = get_cuda(), device_limits()
    blocks, threads = lim["sms"] * 8, 128
    out = cuda.device_array(1, np.float32)
    kinds = ("random", "constant") if args.operands == "both" else (args.operands,)
    rng = np.random.default_rng(args.seed)
    data = {(name, kind): cuda.to_device(operands(fmt, kind, rng))
            for name, (_, _, fmt) in INSTRUCTIONS.items() for kind in kinds}
    dev = cuda.get_current_device()
    sampler = Sampler(getattr(dev, "uuid", None))
    results, kerns = {}, kernels()
    try:
        for name, kern in kerns.items():  # compile (and warm up) every kernel first
            kern[blocks, threads](data[name, kinds[0]], out, 1)
        cuda.synchronize()
        for rnd in range(args.rounds):
            for name, kern in kerns.items():
                for kind in kinds if rnd % 2 == 0 else kinds[::-1]:  # alternate which goes first
                    tf, window = measure(kern, data[name, kind], out, blocks, threads, INSTRUCTIONS[name][1],
                                         args.seconds, cuda.synchronize)
                    results.setdefault((name, kind), []).append((tf, window))
                    clock, power = sampler.window(*window)
                    print(f"round {rnd}  {name:28s} {kind:9s} {tf:7.1f} TFLOP/s  SM clock {clock} MHz, {power} W",
                          flush=True)
    finally:
        sampler.stop()
    date = datetime.date.today().isoformat()
    rows = []
    for (name, kind), runs in results.items():
        tfs = [tf for tf, _ in runs]
        clocks, powers = zip(*(sampler.window(*w) for _, w in runs))
        numeric = lambda xs: [x for x in xs if x != ""]  # noqa: E731
        rows.append({"instruction": name, "operands": "random" if kind == "random" else CONSTANT,
                     "tflops": round(float(np.median(tfs)), 1), "tflops_min": round(min(tfs), 1),
                     "tflops_max": round(max(tfs), 1),
                     "sm_clock_mhz": round(float(np.median(numeric(clocks)))) if numeric(clocks) else "",
                     "power_w": round(float(np.median(numeric(powers))), 1) if numeric(powers) else "",
                     "gpu": lim["name"], "date": date})
    for label in [r["operands"] for r in rows if r["instruction"] == "tf32 m16n8k8"]:  # three tf32 mma per product
        tf32 = next(r for r in rows if r["instruction"] == "tf32 m16n8k8" and r["operands"] == label)
        rows.append({**tf32, "instruction": THREE_TF32, "tflops": round(tf32["tflops"] / 3, 1),
                     "tflops_min": round(tf32["tflops_min"] / 3, 1), "tflops_max": round(tf32["tflops_max"] / 3, 1)})
    write_csv(Path(args.out), rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
