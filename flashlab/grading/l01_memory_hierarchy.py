"""Lesson 01, memory hierarchy: arithmetic intensity and the roofline."""
from __future__ import annotations

from ..roofline import Machine
from .core import exercise

LESSON = "01_memory_hierarchy"


def _sizes(t, n, low=1, high=20000):
    return [int(v) for v in t.rng.integers(low, high, size=n)]


@exercise("matmul_intensity", lesson=LESSON,
          hint="Intensity = FLOPs / bytes moved. A matmul does one multiply and one add per (i, j, k); "
               "it reads both inputs once and writes the output once.")
def check_matmul_intensity(t, fn):
    cases = [("the example", 1024, 1024, 1024, 4), ("a thin product", 4096, 64, 4096, 2)]
    cases += [("random sizes", *_sizes(t, 3), int(t.rng.choice([2, 4, 8]))) for _ in range(6)]
    for label, M, N, K, b in cases:
        t.case(label, M=M, N=N, K=K, bytes_per_element=b)
        ref = 2 * M * N * K / (b * (M * K + K * N + M * N))
        t.scalar(t.call(M, N, K, b), ref, "the intensity")


@exercise("softmax_intensity", lesson=LESSON,
          hint="Count 5 FLOPs per element; every element is read once and written once. "
               "Does the answer depend on the number of rows or columns?")
def check_softmax_intensity(t, fn):
    cases = [("the example", 1024, 1024, 4), ("one long row", 1, 100000, 2)]
    cases += [("random sizes", *_sizes(t, 2), int(t.rng.choice([2, 4, 8]))) for _ in range(6)]
    for label, rows, cols, b in cases:
        t.case(label, rows=rows, cols=cols, bytes_per_element=b)
        t.scalar(t.call(rows, cols, b), 5 * rows * cols / (2 * rows * cols * b), "the intensity")


@exercise("roofline", lesson=LESSON,
          hint="A kernel is limited by whichever is slower: doing the FLOPs (peak_flops) or moving the bytes "
               "(bandwidth * intensity FLOP/s). The ridge point peak_flops / bandwidth separates the two regimes.")
def check_roofline(t, fn):
    machines = [Machine("A100", 312e12, 2039e9), Machine("T4", 65e12, 320e9)]
    machines += [Machine("random", float(10 ** t.rng.uniform(10, 15)), float(10 ** t.rng.uniform(9, 12)))
                 for _ in range(3)]
    cases = [(label, mach, mach.ridge * factor) for mach in machines
             for label, factor in [("memory-bound side", t.rng.uniform(0.01, 0.9)),
                                   ("compute-bound side", t.rng.uniform(1.1, 50))]]
    # Exactly at the ridge: whole numbers, so that intensity = peak / bandwidth and intensity * bandwidth = peak
    # hold exactly in floating point, however the comparison is written.
    for ridge, bandwidth in [(156, 2_000_000_000_000), (int(t.rng.integers(1, 1000)), int(t.rng.integers(1, 3000)) * 10**9)]:
        cases.append(("exactly at the ridge point", Machine("ridge", float(ridge * bandwidth), float(bandwidth)),
                      float(ridge)))
    for label, mach, intensity in cases:
        t.case(label, intensity=intensity, peak_flops=mach.peak_flops, bandwidth=mach.bandwidth)
        out = t.call(intensity, mach.peak_flops, mach.bandwidth)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (attainable FLOP/s, 'memory' or 'compute'); got {out!r:.80}")
        t.scalar(out[0], float(mach.attainable(intensity)), "the attainable FLOP/s")
        want = "memory" if intensity < mach.ridge else "compute"
        if out[1] != want:
            at_ridge = intensity == mach.ridge
            raise t.fail(f"the bound is {out[1]!r}; expected {want!r}",
                         hint="at the ridge point itself both limits are equal, and the docstring counts it as "
                              "compute-bound: memory-bound means intensity < peak_flops / bandwidth, strictly"
                         if at_ridge else None)
