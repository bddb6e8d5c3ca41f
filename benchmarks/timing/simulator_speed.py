"""How fast the slowest simulator tests run with Numba's own simulator threads and with flashlab's arrangement
(flashlab.device.arrange_simulator: no busy-polling block loop, a short GIL switch interval while a kernel runs).

Each mode runs the same pytest selection in a fresh interpreter; modes alternate within each round, so a load
that comes and goes on a shared machine falls on all of them. Prints wall seconds per round, the median, and
the spread ((max - min) / median) per mode.

    python benchmarks/timing/simulator_speed.py                        # numba vs flashlab, 3 rounds, the default tests
    python benchmarks/timing/simulator_speed.py --rounds 5 --modes numba flashlab flashlab:1e-4 flashlab:5e-3
    python benchmarks/timing/simulator_speed.py --modes checkout=/tmp/flashlab-before flashlab
    python benchmarks/timing/simulator_speed.py --tests "tests/test_tensor_backward.py::test_simulated_tensor_backward"

A mode is `numba` (FLASHLAB_SIM_THREADS=numba: the simulator as Numba ships it), `flashlab` (the default
arrangement), `flashlab:SECONDS` (the arrangement with another switch interval while a kernel runs: what
the value of device.SIM_SWITCH_INTERVAL was chosen from), or `checkout=DIR` (the same tests in another checkout
of the repository, e.g. a clone at the commit before the arrangement: `numba` keeps flashlab's other changes).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The slowest simulator tests of the warp-level (tensor-core) kernels and exercises, the block-level kernel
# exercises (cuda.syncthreads() and racecheck, no warp instruction) for comparison, and FORWARD_CHECK: the
# tensor forward at its default tile (4 warps, 128 threads a block), ragged and causal shapes, fp16 and fp32.
FORWARD_CHECK = "forward_check"
DEFAULT_TESTS = {
    "tensor forward, default tile": FORWARD_CHECK,
    "tensor forward tests (12)": ["tests/test_tensor_kernel.py::test_tensor_kernel_matches_float64"],
    "tensor backward tests (11)": ["tests/test_tensor_backward.py::test_simulated_tensor_backward"],
    "lessons 15-17 exercises (warp)": ["tests/exercises/test_l15_tensor_cores.py", "tests/exercises/test_l16_tensor_core_forward.py",
                                       "tests/exercises/test_l17_tensor_core_backward.py"],
    "lessons 07-10 exercises": [f"tests/exercises/test_l{name}.py" for name in (
        "07_gpu_numba", "08_first_flash_kernel", "09_register_fa2", "10_tuning")],
}


def forward_check():
    """flash_attention(variant="tensor") at its default tile on ragged and causal shapes, in float16 and float32,
    each checked against float64 attention."""
    import numpy as np

    import flashlab as fl
    from flashlab.kernels import flash_attention

    rng = np.random.default_rng(0)
    for dtype, tol in ((np.float16, 1e-2), (np.float32, 1e-5)):
        for nq, nk, causal in ((70, 45, True), (33, 70, False)):
            q, k, v = (rng.standard_normal((1, 1, n, 32)).astype(dtype) for n in (nq, nk, nk))
            o, _ = flash_attention(q, k, v, causal=causal, variant="tensor")
            ref, _ = fl.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
            err = fl.relative_error(o, ref)
            assert err < tol, f"{np.dtype(dtype).name} {nq}x{nk} causal={causal}: error {err:.1e}"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()}-core CPU ({cpu}), Python {platform.python_version()}, numba {version('numba')}, "
            f"numba-cuda {version('numba-cuda')}")


def run(mode: str, tests) -> tuple[float, int]:
    """Wall seconds and exit status of one run of `tests` (pytest node ids, or FORWARD_CHECK) in `mode`."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("FLASHLAB_SIM_THREADS", None)
    root = ROOT
    if mode == "numba":
        env["FLASHLAB_SIM_THREADS"] = "numba"
    elif mode.startswith("checkout="):  # another checkout of the repository, as it is (e.g. the commit before)
        root = Path(mode[9:]).resolve()
    elif mode != "flashlab" and not mode.startswith("flashlab:"):
        raise SystemExit(f"unknown mode {mode!r}: use numba, flashlab, flashlab:SECONDS or checkout=DIR")
    code = "import sys, flashlab.device as d; "
    if mode.startswith("flashlab:"):
        code += f"d.SIM_SWITCH_INTERVAL = {float(mode[9:])!r}; "
    if tests == FORWARD_CHECK:
        code += f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import simulator_speed as s; s.forward_check()"
    else:
        args = ["-q", "-x", "-p", "no:cacheprovider", *tests]
        code += f"import pytest; sys.exit(pytest.main({args!r}))"
    start = time.perf_counter()
    # `python -c` puts the working directory first on sys.path: the checkout's flashlab is the one imported
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if res.returncode != 0:
        print(res.stdout[-2000:], res.stderr[-2000:], sep="\n", file=sys.stderr)
    return took, res.returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["numba", "flashlab"])
    ap.add_argument("--tests", nargs="+", help="pytest node ids (default: the slowest simulator tests)")
    ap.add_argument("--only", nargs="+", help="run the default groups whose name contains one of these words")
    a = ap.parse_args(argv)
    groups = {"selected tests": a.tests} if a.tests else DEFAULT_TESTS
    if a.only:
        groups = {k: v for k, v in groups.items() if any(o in k for o in a.only)}
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}, no GPU (Numba's CUDA simulator)")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, tests in groups.items():
        times = {m: [] for m in a.modes}
        for r in range(a.rounds):
            for m in (a.modes if r % 2 == 0 else a.modes[::-1]):  # alternate the order too
                took, rc = run(m, tests)
                times[m].append(took)
                print(f"{name:<30} round {r + 1}  {m:<16} {took:8.1f} s" + ("" if rc == 0 else f"  (exit {rc})"),
                      flush=True)
        base = statistics.median(times[a.modes[0]])
        for m, t in times.items():
            med = statistics.median(t)
            print(f"{name:<30} {m:<16} median {med:8.1f} s  min {min(t):7.1f}  max {max(t):7.1f}  "
                  f"spread {(max(t) - min(t)) / med:5.0%}  {base / med:5.1f}x vs {a.modes[0]}", flush=True)


if __name__ == "__main__":
    main()
