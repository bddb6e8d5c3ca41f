"""Lesson 07's exercises (first kernels: block sums, a tiled transpose; coalescing): each checker accepts the
solution, grades the blank "not implemented", and rejects plausible wrong solutions.

A kernel's wrong solution is the solution's source with one edit a learner could make: a missing
cuda.syncthreads(), an unguarded tail, ... Kernels run in the CUDA simulator on the checkers' small shapes
(also on a GPU, where the race check is not available and the mutants only it finds are skipped). The
coalescing checker's verdicts name the slip.
"""
import numpy as np
import pytest

import flashlab.grading as grading
from exercise_harness import Lesson
from flashlab.device import has_gpu

LESSON = Lesson("07_gpu_numba")
mutant = LESSON.mutant
SIM = not has_gpu()
LESSON.source_exercise("block_sums", "block_sums")
LESSON.source_exercise("transpose_tiled", "transpose_tiled")

# exercise -> [(what the learner got wrong, [(old, new), ...], needs the simulator's race check)]
MUTANTS = {
    "block_sums": [
        ("no barrier after the load", [("    cuda.syncthreads()\n    s = TPB // 2", "    s = TPB // 2")], True),
        ("no barrier between tree steps", [("        cuda.syncthreads()\n        s //= 2", "        s //= 2")], True),
        ("tail not guarded", [("buf[t] = x[i] if i < x.shape[0] else 0.0", "buf[t] = x[i]")], False),
        ("last tree step skipped", [("while s > 0:", "while s > 1:")], False),
        ("every thread adds its partner, not only t < s", [("        if t < s:\n            buf[t] += buf[t + s]",
                                                            "        if t + s < TPB:\n            buf[t] += buf[t + s]")],
         True),
    ],
    "transpose_tiled": [
        ("no barrier", [("    cuda.syncthreads()\n    out_r", "    out_r")], True),
        ("reads the tile untransposed", [("out[out_r, out_c] = tile[tx, ty]", "out[out_r, out_c] = tile[ty, tx]")], False),
        ("read not guarded", [("    if r < a.shape[0] and c < a.shape[1]:\n        tile[ty, tx] = a[r, c]",
                               "    tile[ty, tx] = a[r, c]")], True),
        ("write guard with swapped bounds", [("if out_r < out.shape[0] and out_c < out.shape[1]:",
                                              "if out_r < out.shape[1] and out_c < out.shape[0]:")], False),
        ("no shared tile at all", [("        tile[ty, tx] = a[r, c]", "        out[c, r] = a[r, c]"),
                                   ("    if out_r < out.shape[0] and out_c < out.shape[1]:\n        out[out_r, out_c] = tile[tx, ty]",
                                    "    pass")], True),
    ],
}
for _name, _mutants in MUTANTS.items():
    for _label, _edits, _sim_only in _mutants:
        LESSON.edit_mutant(_name, _label, _edits, sim_only=_sim_only)


# -- sectors_per_request: coalescing -----------------------------------------------------------------
def _int(x):
    return int(x)


for _label, _fn, _words in [  # (what the learner got wrong, function, words the verdict's message must contain)
    ("one sector per thread", lambda a, n: len(a), "one sector per thread"),
    ("distinct addresses", lambda a, n: _int(np.unique(a).size), "distinct addresses"),
    ("128-byte lines", lambda a, n: _int(np.unique(a // 128).size), "128-byte lines"),
    ("every sector between the lowest and highest address",
     lambda a, n: _int((a.max() + n - 1) // 32 - a.min() // 32 + 1), "lowest address to the highest"),
    ("multiplies byte addresses by nbytes", lambda a, n: _int(np.unique(a * n // 32).size), "byte addresses"),
    ("returns the sectors, not their number", lambda a, n: np.unique(a // 32), "as an int"),
    ("returns a float", lambda a, n: float(np.unique(a // 32).size), "as an int"),
]:
    mutant("sectors_per_request", message=_words, label=_label)(_fn)


globals().update(LESSON.standard_tests())


def test_a_crashing_function_is_a_verdict_not_a_crash():
    def broken(*args):
        return 1 // 0

    r = grading.check("sectors_per_request", broken, seed=0, quiet=True)
    assert r.status == "failed" and "ZeroDivisionError" in r.message


def test_racecheck_names_the_race():
    from numba import float32

    from flashlab.grading.simcheck import racecheck
    from flashlab.device import get_cuda

    if not SIM:
        pytest.skip("simulator only")
    global cuda
    cuda = get_cuda()

    @cuda.jit
    def shift(x, out):
        buf = cuda.shared.array(8, float32)
        t = cuda.threadIdx.x
        buf[t] = x[t]
        out[t] = buf[(t + 1) % 8]  # no barrier

    with racecheck() as log:
        shift[1, 8](np.arange(8, dtype=np.float32), np.zeros(8, np.float32))
    assert log.count >= 1 and "buf[" in log.problems[0]
