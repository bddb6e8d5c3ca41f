"""Lesson 10: checkers of its kernel exercises."""
from __future__ import annotations

import numpy as np

from .core import exercise

LESSON = "10_tuning"

def shared_bytes(d, block_q, block_k, tc):
    """Shared memory of flashlab's register kernel, as lesson 10's exercise states it (a test checks that
    it equals flashlab.kernels.register.Tile.shared_bytes)."""
    return 4 * (d * (block_q + 4) + max(d * (block_k + 4), block_k * (block_q + 4)) + block_k * (d + 8)
                + tc * (block_q + 4))


def registers_estimate(d, block_q, block_k, tr, tc):
    """Floats a thread keeps in registers: O micro-tile, S micro-tile, m, l and the two operand vectors,
    plus 24 for addresses and loop counters (the model of lesson 10's exercise)."""
    rm, rn, rd = block_q // tr, block_k // tc, d // tc
    return rm * rd + rm * rn + 3 * rm + rn + rd + 24


def tile_fits_reference(d, block_q, block_k, tr, tc, shared_limit=48 * 1024, max_regs=255):
    if block_q % tr or block_k % tc or d % tc:
        return False
    if tr * tc > 1024:
        return False
    if shared_bytes(d, block_q, block_k, tc) > shared_limit:
        return False
    return registers_estimate(d, block_q, block_k, tr, tc) <= max_regs


def _why_not(d, bq, bk, tr, tc, shared_limit, max_regs):
    if bq % tr or bk % tc or d % tc:
        return "the threads do not divide the tile evenly (tr | block_q, tc | block_k and tc | d)"
    if tr * tc > 1024:
        return f"{tr * tc} threads per block; at most 1024"
    sb = shared_bytes(d, bq, bk, tc)
    if sb > shared_limit:
        return f"it needs {sb} bytes of shared memory; the limit is {shared_limit}"
    regs = registers_estimate(d, bq, bk, tr, tc)
    if regs > max_regs:
        return f"it needs about {regs} registers per thread; the limit is {max_regs}"
    return f"it fits: {sb} bytes of shared memory (limit {shared_limit}), about {regs} registers (limit {max_regs})"


@exercise("tile_fits", lesson=LESSON,
          hint="Check, in order: the threads divide the tile (tr | block_q, tc | block_k, tc | d); tr * tc <= "
               "1024; shared bytes <= shared_limit (<=, not <); the register estimate <= max_regs.")
def check_tile_fits(t, fn):
    cases = [("the Tile() dataclass default, d = 64", 64, 64, 32, 16, 8, 48 * 1024, 255),
             ("d = 128 and a big tile: too much shared memory", 128, 64, 64, 16, 8, 48 * 1024, 255),
             ("exactly at the shared-memory limit", 64, 64, 32, 16, 8, shared_bytes(64, 64, 32, 8), 255),
             ("one byte short", 64, 64, 32, 16, 8, shared_bytes(64, 64, 32, 8) - 1, 255),
             ("too many registers per thread", 128, 32, 32, 2, 4, 48 * 1024, 255),
             ("tc does not divide d", 20, 32, 32, 8, 8, 48 * 1024, 255),
             ("tr does not divide block_q", 64, 48, 32, 32, 8, 48 * 1024, 255),
             ("more than 1024 threads", 16, 64, 64, 64, 32, 48 * 1024, 255),
             ("a tight register budget", 64, 64, 32, 16, 8, 48 * 1024, 64)]
    for _ in range(25):
        d = int(t.rng.choice([16, 32, 64, 128]))
        cases.append(("random tile", d, int(2 ** t.rng.integers(3, 8)), int(2 ** t.rng.integers(3, 8)),
                      int(2 ** t.rng.integers(1, 6)), int(2 ** t.rng.integers(1, 5)), 48 * 1024,
                      int(t.rng.choice([64, 128, 255]))))
    for label, d, bq, bk, tr, tc, limit, regs in cases:
        t.case(label, d=d, block_q=bq, block_k=bk, tr=tr, tc=tc, shared_limit=limit, max_regs=regs)
        out = t.call(d, bq, bk, tr, tc, shared_limit=limit, max_regs=regs)
        if not isinstance(out, (bool, np.bool_)):
            raise t.fail(f"return True or False; got {type(out).__name__} {out!r:.40}")
        want = tile_fits_reference(d, bq, bk, tr, tc, limit, regs)
        if bool(out) != want:
            raise t.fail(f"you said {bool(out)}; the answer is {want}: {_why_not(d, bq, bk, tr, tc, limit, regs)}")


class _FakeGPU:
    """A clock and a workload for the benchmarking exercise: call k takes durations[k] seconds."""

    def __init__(self, durations):
        self.durations, self.now, self.calls = list(durations), 0.0, 0

    def clock(self):
        return self.now

    def work(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


@exercise("median_time", lesson=LESSON,
          hint="Call fn() `warmup` times without timing it, then `reps` times, each between two clock() "
               "readings; return the median of those reps durations (statistics.median or np.median).")
def check_median_time(t, fn):
    for label, warmup, reps, first in [("the example", 3, 20, 2.0), ("one warm-up call", 1, 5, 30.0),
                                       ("no warm-up asked", 0, 7, 1e-3), ("an even number of reps", 2, 10, 5.0),
                                       ("random", int(t.rng.integers(1, 5)), int(t.rng.integers(5, 40)), 10.0)]:
        base = 1e-3 * (1 + 0.1 * t.rng.random(warmup + reps))
        spikes = t.rng.random(warmup + reps) < 0.15
        base[spikes] *= 20  # a busy machine: some samples are far too slow
        durations = np.concatenate([[first], base[1:]]) if warmup else base
        gpu = _FakeGPU(durations)
        t.case(label, "Only the reps after the warm-up are timed; the first call pays for compilation."
               if warmup else None, warmup=warmup, reps=reps, first_call_s=float(durations[0]))
        out = t.call(gpu.work, gpu.clock, warmup=warmup, reps=reps)
        if gpu.calls != warmup + reps:
            raise t.fail(f"fn() was called {gpu.calls} times; expected warmup + reps = {warmup + reps}")
        t.scalar(out, float(np.median(durations[warmup:])), "the median time", tol=1e-9)


def predicted_tflops_reference(ffma, issued, issue_busy_pct, sms, clock_ghz):
    return sms * 4 * 32 * 2 * clock_ghz * 1e9 * (issue_busy_pct / 100) * (ffma / issued) / 1e12


_TFLOPS_SLIPS = [(0.5, "each FFMA is 2 FLOPs (a multiply and an add) per thread"),
                 (100.0, "issue_busy_pct is a percentage: divide it by 100"),
                 (0.25, "each SM has 4 schedulers, each issuing one instruction per cycle"),
                 (1e3, "the answer is in TFLOP/s (1e12 FLOP/s); clock_ghz is in GHz (1e9 cycles/s)"),
                 (1e-3, "the answer is in TFLOP/s (1e12 FLOP/s); clock_ghz is in GHz (1e9 cycles/s)")]


@exercise("predicted_tflops", lesson=LESSON,
          hint="peak FLOP/s = sms * 4 schedulers * 32 threads * 2 FLOPs * clock_ghz * 1e9; multiply by "
               "issue_busy_pct / 100 and by ffma / issued, then divide by 1e12.")
def check_predicted_tflops(t, fn):
    cases = [("the H100 at its FP32 peak", 1e9, 1e9, 100.0, 132, 1.98),
             ("flashlab's register kernel on an H100", 1.0758e9, 1.8687e9, 75.63, 132, 1.98),
             ("the textbook kernel on an H100", 1.0821e9, 3.1721e9, 49.16, 132, 1.98),
             ("a T4 (40 SMs, 1.59 GHz), half busy", 3e8, 5e8, 50.0, 40, 1.59)]
    for _ in range(4):
        issued = float(t.rng.uniform(1e8, 1e10))
        cases.append(("random profile", float(issued * t.rng.uniform(0.1, 1.0)), issued,
                      float(t.rng.uniform(5, 100)), int(t.rng.integers(10, 200)), float(t.rng.uniform(0.8, 2.5))))
    for label, ffma, issued, busy, sms, ghz in cases:
        t.case(label, ffma=ffma, issued=issued, issue_busy_pct=busy, sms=sms, clock_ghz=ghz)
        out = t.call(ffma, issued, busy, sms, ghz)
        want = predicted_tflops_reference(ffma, issued, busy, sms, ghz)
        if isinstance(out, (int, float, np.integer, np.floating)) and not isinstance(out, (bool, np.bool_)) \
                and want and np.isfinite(float(out)):
            for ratio, why in _TFLOPS_SLIPS:
                if abs(float(out) / want - ratio) < 1e-6 * ratio:
                    raise t.fail(f"you returned {float(out):.4g}, {ratio:g} times the answer {want:.4g}: {why}")
        t.scalar(out, want, "the predicted TFLOP/s", tol=1e-9)
