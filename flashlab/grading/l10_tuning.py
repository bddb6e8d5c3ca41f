"""Lesson 10: checkers of its kernel exercises."""
from __future__ import annotations

import math

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


# ------------------------------------------------------------------------------ waves and split-KV (4)
def _limits(threads, registers, shared_bytes, gpu, *, unit=256, granularity=4, reserved=True):
    """Blocks per SM allowed by each resource (the exercise's rules; the keyword arguments switch one off to
    name a learner's slip)."""
    warps = -(-threads // 32)
    max_warps = gpu["max_threads_per_sm"] // 32
    per_warp = -(-registers * 32 // unit) * unit
    reg_warps = gpu["regs_per_sm"] // per_warp // granularity * granularity
    extra = gpu["reserved_shared_per_block"] if reserved else 0
    return {"threads": max_warps // warps, "blocks": gpu["max_blocks_per_sm"], "registers": reg_warps // warps,
            "shared memory": gpu["shared_per_sm"] // (shared_bytes + extra)}


def _efficiency(waves):
    return waves / math.ceil(waves)


def _splits(N, blocks, slots, target=0.9, gain=0.05, below=2.0, min_chunk=256, max_splits=32):
    waves = blocks / slots
    if waves >= below:
        return 1
    options = {s: _efficiency(s * blocks / slots) for s in range(2, max_splits + 1) if N // s >= min_chunk}
    if not options:
        return 1
    good = [s for s, e in options.items() if e >= target]
    best = min(good) if good else max(options, key=lambda s: (options[s], -s))
    return best if options[best] >= _efficiency(waves) + gain else 1


def waves_and_split_reference(B, H, N, block_q, threads, registers, shared_bytes, gpu):
    """The answer of exercise 10.4 (tests check it agrees with flashlab.kernels.plan on non-causal grids)."""
    bps = min(_limits(threads, registers, shared_bytes, gpu).values())
    warps = -(-threads // 32)
    slots = gpu["sms"] * bps
    blocks = -(-N // block_q) * B * H
    waves = blocks / slots
    return {"blocks_per_sm": bps, "occupancy": bps * warps / (gpu["max_threads_per_sm"] // 32), "waves": waves,
            "efficiency": _efficiency(waves), "splits": _splits(N, blocks, slots)}


GPU_T4 = {"sms": 40, "max_threads_per_sm": 1024, "max_blocks_per_sm": 16, "regs_per_sm": 65536,
          "shared_per_sm": 64 * 1024, "reserved_shared_per_block": 0}
GPU_A100 = {"sms": 108, "max_threads_per_sm": 2048, "max_blocks_per_sm": 32, "regs_per_sm": 65536,
            "shared_per_sm": 164 * 1024, "reserved_shared_per_block": 1024}
GPU_H100 = {**GPU_A100, "sms": 132, "shared_per_sm": 228 * 1024}
WAVES_KEYS = ("blocks_per_sm", "occupancy", "waves", "efficiency", "splits")


def _waves_cases(rng):
    cases = [  # (label, B, H, N, block_q, threads, registers, shared_bytes, gpu)
        ("H100, B1 H16 N1024, the d = 64 register tile: far less than a wave", 1, 16, 1024, 128, 128, 128, 48960,
         GPU_H100),
        ("H100, B1 H16 N4096: almost one wave", 1, 16, 4096, 128, 128, 128, 48960, GPU_H100),
        ("H100, B4 H16 N4096: several waves", 4, 16, 4096, 128, 128, 128, 48960, GPU_H100),
        ("a wave and a tenth: a long tail", 1, 16, 4096, 64, 64, 96, 28224, GPU_H100),
        ("registers decide: 195 per thread, 64 threads (warps rounded down to a multiple of 4)", 1, 16, 2048, 64,
         64, 195, 20000, GPU_H100),
        ("registers per warp come in units of 256: 42 per thread", 2, 8, 2048, 64, 64, 42, 4096, GPU_A100),
        ("the driver's 1 KB per block decides", 1, 8, 4096, 64, 64, 32, 40 * 1024, GPU_A100),
        ("a T4: 40 SMs, 1024 threads per SM, no reserved shared memory", 1, 16, 1024, 64, 64, 96, 28224, GPU_T4),
        ("N not a multiple of block_q", 1, 3, 1000, 128, 128, 96, 30000, GPU_H100),
        ("short keys: no chunk of 256 keys to split into", 1, 2, 384, 64, 128, 64, 16384, GPU_H100),
    ]
    for _ in range(12):
        gpu = [GPU_T4, GPU_A100, GPU_H100][int(rng.integers(3))]
        threads = int(32 * rng.integers(1, 9))
        cases.append(("random", int(rng.integers(1, 5)), int(2 ** rng.integers(0, 6)), int(2 ** rng.integers(8, 15)),
                      int(2 ** rng.integers(4, 8)), threads, int(rng.integers(24, 256)),
                      int(rng.integers(1, 48)) * 1024, gpu))
    return cases


def _waves_slips(B, H, N, block_q, threads, registers, shared_bytes, gpu, want):
    """{key: [(value, why)]}: the answers of usual mistakes, for the checker's hints."""
    bps = want["blocks_per_sm"]
    slots = gpu["sms"] * bps
    blocks = -(-N // block_q) * B * H
    return {
        "blocks_per_sm": [
            (min(_limits(threads, registers, shared_bytes, gpu, unit=1).values()),
             "registers are handed out per warp in units of 256: round registers x 32 up to a multiple of 256"),
            (min(_limits(threads, registers, shared_bytes, gpu, granularity=1).values()),
             "the warps that the registers allow are rounded down to a multiple of 4 before dividing by the warps "
             "of a block"),
            (min(_limits(threads, registers, shared_bytes, gpu, reserved=False).values()),
             "every block also takes the driver's reserved shared memory (gpu['reserved_shared_per_block'])"),
            (min(v for k, v in _limits(threads, registers, shared_bytes, gpu).items() if k != "registers"),
             "registers limit the blocks too"),
        ],
        "occupancy": [(bps / gpu["max_blocks_per_sm"], "occupancy counts warps: resident warps / the SM's maximum "
                                                       "warps, not blocks / the block limit"),
                      (bps * threads / gpu["max_threads_per_sm"] * 100, "occupancy is a fraction, not a percentage")],
        "waves": [(math.ceil(blocks / slots), "waves is a fraction here (blocks / slots): do not round it up"),
                  (N / block_q * B * H / slots, "a partial query block is still a whole block: ceil(N / block_q)"),
                  (blocks / gpu["sms"], "a wave is SMs x blocks per SM slots, not one block per SM")],
        "efficiency": [(1 - want["efficiency"], "efficiency is the busy fraction: waves / ceil(waves)")],
        "splits": [(_splits(N, blocks, slots, below=1.0), "split whenever the grid fills fewer than 2 waves, not 1"),
                   (_splits(N, blocks, slots, min_chunk=1), "a chunk needs at least 256 keys: s <= N // 256"),
                   (_splits(N, blocks, slots, gain=0.0), "a split must beat no split by 0.05 (it costs a merge)"),
                   (_splits(N, blocks, slots, target=1.01), "take the fewest chunks that reach 0.9, not the best")],
    }


@exercise("waves_and_split", lesson=LESSON,
          hint="Blocks per SM is the smallest of four limits: warps (threads), the block limit, registers (per "
               "warp in units of 256; the warps they allow rounded down to a multiple of 4) and shared memory "
               "(plus the reserved bytes). Slots = SMs x blocks per SM; waves = ceil(N / block_q) x B x H / slots; "
               "efficiency = waves / ceil(waves). Split only below 2 waves, trying s = 2, 3, ... while N // s >= 256.")
def check_waves_and_split(t, fn):
    for label, B, H, N, bq, threads, regs, smem, gpu in _waves_cases(t.rng):
        t.case(label, B=B, H=H, N=N, block_q=bq, threads=threads, registers=regs, shared_bytes=smem,
               gpu={k: gpu[k] for k in ("sms", "max_threads_per_sm", "shared_per_sm")})
        out = t.call(B, H, N, bq, threads, regs, smem, dict(gpu))
        if not isinstance(out, dict):
            raise t.fail(f"return a dict with keys {', '.join(WAVES_KEYS)}; got {type(out).__name__} {out!r:.60}")
        missing = [k for k in WAVES_KEYS if k not in out]
        if missing:
            raise t.fail(f"the dict has no {', '.join(repr(k) for k in missing)}; it needs {', '.join(WAVES_KEYS)}")
        want = waves_and_split_reference(B, H, N, bq, threads, regs, smem, gpu)
        slips = _waves_slips(B, H, N, bq, threads, regs, smem, gpu, want)
        for key in ("blocks_per_sm", "splits"):
            got = out[key]
            if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
                raise t.fail(f"{key} should be an int; got {type(got).__name__} {got!r:.40}")
        if out["blocks_per_sm"] != want["blocks_per_sm"]:
            why = [w for v, w in slips["blocks_per_sm"] if v == out["blocks_per_sm"] and v != want["blocks_per_sm"]]
            limits = _limits(threads, regs, smem, gpu)
            raise t.fail(f"blocks_per_sm is {out['blocks_per_sm']}; expected {want['blocks_per_sm']} (the limits: "
                         + ", ".join(f"{k} {v}" for k, v in limits.items()) + ")", **({"hint": why[0]} if why else {}))
        for key in ("occupancy", "waves", "efficiency"):
            t.scalar(out[key], want[key], key, tol=1e-9, slips=slips[key])
        if out["splits"] != want["splits"]:
            why = [w for v, w in slips["splits"] if v == out["splits"]]
            raise t.fail(f"splits is {out['splits']}; expected {want['splits']} at {want['waves']:.3f} waves",
                         **({"hint": why[0]} if why else {}))
