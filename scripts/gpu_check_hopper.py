"""Hopper's instructions on a real H100/H200: every intrinsic of flashlab/kernels/hopper.py against the NumPy model
of flashlab.fragments, then the throughput of a wgmma m64n128k16 loop.

    python scripts/gpu_check_hopper.py [--iters 4096] [--out docs/gpu-hopper.log]

The checks are tests/test_hopper_intrinsics.py, run here on the GPU (in CI they run on the simulator, where the
emulation is exact; here wgmma is held to the model within a bound for its unspecified summation order, and
layouts, TMA's zero fill and swizzle, mbarrier phases, bulk copies, named barriers and setmaxnreg exactly).
Prints one line per test with its passed/failed count, the failures' messages, and the loop's TFLOP/s (CUDA
events, the median of --repeats timed launches after one warm-up) for 1 and 2 warpgroups a block.
"""
import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_hopper_intrinsics.py"


def run_tests(log):
    """Run the test file on the GPU; log a table of test function -> passed / failed / skipped."""
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", TEST],
                             cwd=ROOT, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:  # a barrier that never completes hangs a GPU kernel
        log("pytest: TIMED OUT after 1200 s (a kernel hung: an mbarrier, named barrier or setmaxnreg wait?)")
        return 1
    counts = defaultdict(lambda: defaultdict(int))
    failures = []
    for line in res.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED) \S*?::(\w+)(\[[^\]]*\])?(?: - (.*))?", line)
        if m:
            counts[m.group(2)][m.group(1)] += 1
            if m.group(1) in ("FAILED", "ERROR"):
                failures.append(f"  {m.group(2)}{m.group(3) or ''}: {(m.group(4) or '')[:300]}")
    log(f"{'test':70s} {'pass':>5s} {'fail':>5s} {'skip':>5s}")
    for name, c in counts.items():
        bad = c["FAILED"] + c["ERROR"]
        log(f"{name:70s} {c['PASSED']:5d} {bad:5d} {c['SKIPPED']:5d}  {'FAIL' if bad else 'ok'}")
    log("\n".join(failures) if failures else "no failures")
    log("pytest: " + (res.stdout.strip().splitlines() or ["(no output)"])[-1])
    if not counts:
        log(res.stdout[-3000:] + res.stderr[-3000:])
    return res.returncode


def build_loop():
    """The timed kernel: wgmma m64n128k16 (fp16 in, fp32 accumulators) from 128-byte swizzled shared tiles; each
    warpgroup keeps two accumulators (64 registers each) and issues 4 wgmma per commit group, one group in flight
    (wgmma on the same accumulators need no fence between them)."""
    from flashlab import fragments as F
    from flashlab.device import get_cuda
    from flashlab.kernels import hopper

    cuda = get_cuda()
    mma, align = hopper.wgmma_ss(128, "float16"), hopper.TILE_ALIGN  # alignment= must be a constant
    uint16, float32 = np.uint16, np.float32
    a_size, b_size = 64 * 64, 128 * 64  # A 64 x 64 and B^T 128 x 64: four k16 steps, one 128-byte box each
    steps = [(F.operand_descriptor(64, 64, "K", 16 * s)[0], F.operand_descriptor(128, 64, "K", 16 * s)[0])
             for s in range(4)]
    (a_0, b_0), (a_1, b_1), (a_2, b_2), (a_3, b_3) = steps

    @cuda.jit
    def loop(a_img, b_img, out, n_iters):
        t = cuda.threadIdx.x
        a_s = cuda.shared.array(a_size, uint16, alignment=align)
        b_s = cuda.shared.array(b_size, uint16, alignment=align)
        for e in range(t, b_size, cuda.blockDim.x):
            b_s[e] = b_img[e]
            if e < a_size:
                a_s[e] = a_img[e]
        hopper.fence_proxy_async()
        cuda.syncthreads()
        a0, b0 = hopper.smem_address(a_s, 0), hopper.smem_address(b_s, 0)
        da0 = hopper.make_descriptor(a0 + a_0, 16, 1024, 128)
        da1 = hopper.make_descriptor(a0 + a_1, 16, 1024, 128)
        da2 = hopper.make_descriptor(a0 + a_2, 16, 1024, 128)
        da3 = hopper.make_descriptor(a0 + a_3, 16, 1024, 128)
        db0 = hopper.make_descriptor(b0 + b_0, 16, 1024, 128)
        db1 = hopper.make_descriptor(b0 + b_1, 16, 1024, 128)
        db2 = hopper.make_descriptor(b0 + b_2, 16, 1024, 128)
        db3 = hopper.make_descriptor(b0 + b_3, 16, 1024, 128)
        x = cuda.local.array(64, float32)
        y = cuda.local.array(64, float32)
        for i in range(64):
            x[i] = 0.0
            y[i] = 0.0
        hopper.wgmma_fence()
        for _ in range(n_iters):
            mma(x, da0, db0, 1)
            mma(y, da1, db1, 1)
            mma(x, da2, db2, 1)
            mma(y, da3, db3, 1)
            hopper.wgmma_commit()
            hopper.wgmma_wait(1)
        hopper.wgmma_wait(0)
        s = float32(0.0)
        for i in range(64):
            s += x[i] + y[i]
        out[cuda.blockIdx.x * cuda.blockDim.x + t] = s
    return loop


def throughput(log, iters, repeats):
    """Log the loop's TFLOP/s for 1 and 2 warpgroups a block, 4 blocks an SM."""
    from flashlab import fragments as F
    from flashlab.device import device_limits, get_cuda

    cuda, loop = get_cuda(), build_loop()
    rng = np.random.default_rng(0)
    a = F.to_bits16(rng.standard_normal((64, 64)), "float16")
    b = F.to_bits16(rng.standard_normal((128, 64)), "float16")
    a_img = cuda.to_device(F.tma_image(a, 128))
    b_img = cuda.to_device(F.tma_image(b, 128))
    sms = device_limits()["sms"]
    for wgs in (1, 2):
        blocks = 4 * sms
        out = cuda.device_array(blocks * 128 * wgs, np.float32)
        loop[blocks, 128 * wgs](a_img, b_img, out, 2)  # compile and warm up
        cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = cuda.event(), cuda.event()
            start.record()
            loop[blocks, 128 * wgs](a_img, b_img, out, iters)
            end.record()
            end.synchronize()
            times.append(cuda.event_elapsed_time(start, end) / 1e3)
        flops = blocks * wgs * iters * 4 * 2 * 64 * 128 * 16
        t = float(np.median(times))
        log(f"wgmma m64n128k16 f16 loop, {wgs} warpgroup(s) a block, {blocks} blocks, {iters} x 4 wgmma each: "
            f"{flops / t / 1e12:.0f} TFLOP/s (median of {repeats}, {t * 1e3:.2f} ms)")
        ok = np.isfinite(out.copy_to_host()).all()
        log("  accumulators finite: " + ("yes" if ok else "NO"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpu-hopper.log"))
    args = ap.parse_args()
    lines = []

    def log(text):
        print(text, flush=True)
        lines.append(text)

    sys.path.insert(0, str(ROOT))
    import flashlab

    if not flashlab.device.has_gpu():
        sys.exit("no CUDA GPU here: CI runs these tests on the simulator")
    limits = flashlab.device.device_limits()
    log(f"## GPU: {limits['name']} (cc {limits['cc']})")
    if limits["cc"] < (9, 0):
        sys.exit("wgmma, TMA and setmaxnreg need a Hopper GPU (compute capability 9.0)")
    failed = run_tests(log)
    try:
        throughput(log, args.iters, args.repeats)
    except Exception as exc:  # report it beside the table rather than lose the table
        log(f"throughput loop failed: {type(exc).__name__}: {str(exc)[:1000]}")
        failed = 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
