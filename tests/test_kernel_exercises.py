"""Lessons 07-10: each checker accepts the solution and rejects plausible wrong kernels ("mutants").

Solutions come from course/exercises/ (the code the solution notebooks hold). A mutant is the solution's
source with one edit a learner could make: a missing cuda.syncthreads(), an unguarded tail, a running sum
not rescaled, a causal mask off by one, register tiling skipped, ... Kernels run in the CUDA simulator on
the checkers' small shapes (also on a GPU, where the race check is not available and is skipped).
"""
import linecache
from pathlib import Path

import numpy as np
import pytest

from flashlab.build import parse_cells, strip_solutions
from flashlab.device import has_gpu
from flashlab.grading import EXERCISES, check

SOURCES = Path(__file__).resolve().parent.parent / "course" / "exercises"
SIM = not has_gpu()


def load(stem, keep=True, edits=()):
    """Run an exercise source's definition cells (not the example or check cells), with text edits."""
    ns = {}
    for kind, src in parse_cells((SOURCES / f"{stem}.py").read_text()):
        if kind != "code" or "check(" in src or "print(" in src:
            continue
        src = strip_solutions(src, keep)
        for old, new in edits:
            src = src.replace(old, new)
        name = f"<{stem}-{abs(hash(src))}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # so inspect.getsource works
        exec(compile(src, name, "exec"), ns)
    return ns


KERNEL_EXERCISES = {  # exercise -> (source stem, function name)
    "block_sums": ("07_gpu_numba", "block_sums"),
    "transpose_tiled": ("07_gpu_numba", "transpose_tiled"),
    "flash_shared_kernel": ("08_first_flash_kernel", "build_flash_shared"),
    "scores_microtile": ("09_register_fa2", "build_scores_kernel"),
    "in_registers": ("09_register_fa2", "in_registers"),
    "tile_fits": ("10_tuning", "tile_fits"),
    "median_time": ("10_tuning", "median_time"),
    "predicted_tflops": ("10_tuning", "predicted_tflops"),
}

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
    "flash_shared_kernel": [
        ("no causal tile skipping", [("k_end = min(n_k, q0 + block_q)", "k_end = n_k")], True),
        ("tile skipping one tile too early", [("k_end = min(n_k, q0 + block_q)", "k_end = min(n_k, q0 + block_q - block_k)")],
         False),
        ("tile walk not capped at n_k", [("k_end = min(n_k, q0 + block_q)", "k_end = q0 + block_q")], True),
        ("K re-read from shared memory for each row",
         [("                for x in range(d):\n                    kx = Ks[c, x]  # one shared read, a multiply-add for each row\n"
           "                    for r in range(2):\n                        s[r] += q_rows[r, x] * kx",
           "                for r in range(2):\n                    for x in range(d):\n"
           "                        s[r] += q_rows[r, x] * Ks[c, x]")], True),
        ("V re-read from shared memory for each row",
         [("                for x in range(d):\n                    vx = Vs[c, x]\n                    for r in range(2):\n"
           "                        acc[r, x] = acc[r, x] * alpha[r] + p[r] * vx",
           "                for r in range(2):\n                    for x in range(d):\n"
           "                        acc[r, x] = acc[r, x] * alpha[r] + p[r] * Vs[c, x]")], True),
        ("second row masked with the first row's index", [("key <= q0 + t + r * HALF", "key <= q0 + t")], False),
        ("rows taken as 2t and 2t + 1 in the mask", [("key <= q0 + t + r * HALF", "key <= q0 + 2 * t + r")], False),
        ("padded keys of the tail tile not masked", [("if key < n_k and (not causal", "if (not causal")], False),
        ("running sum not rescaled", [("l[r] = l[r] * alpha[r] + p[r]", "l[r] = l[r] + p[r]")], False),
        ("a masked key keeps the previous key's alpha", [("                    alpha[r] = 1.0\n", "")], False),
        ("no barrier between loading the tile and using it",
         [("            cuda.syncthreads()  # the whole tile is in shared memory\n", "")], True),
    ],
    "scores_microtile": [
        ("no register reuse: operands re-read from shared memory for every FMA",
         [("                    acc[i, j] += a[i] * b[j]", "                    acc[i, j] += Qs[ty * RM + i, x] * Ks[tx * RN + j, x]")],
         True),
        ("no barrier after loading the tiles",
         [("        cuda.syncthreads()\n\n        acc = ", "\n        acc = ")], True),
        ("tail write not guarded", [("                if r < s.shape[0] and c < s.shape[1]:\n                    s[r, c]",
                                     "                if True:\n                    s[r, c]")], False),
        ("keys indexed with the row layout", [("b[j] = Ks[tx * RN + j, x]", "b[j] = Ks[tx * RM + j, x]")], False),
        ("scale forgotten", [("s[r, c] = acc[i, j] * scale", "s[r, c] = acc[i, j]")], False),
    ],
    "in_registers": [
        ("a run-time trip count keeps registers", [('"B": False', '"B": True')], False),
        ("a thread-dependent index keeps registers", [('"C": False', '"C": True')], False),
        ("300 floats fit", [('"E": False', '"E": True')], False),
    ],
    "tile_fits": [
        ("strict < at the shared limit", [("if 4 * floats > shared_limit:", "if 4 * floats >= shared_limit:")], False),
        ("register budget ignored", [("return rm * rd + rm * rn + 3 * rm + rn + rd + 24 <= max_regs", "return True")], False),
        ("no padding of the rows", [("floats = d * (block_q + 4) + max(d * (block_k + 4), block_k * (block_q + 4)) + "
                                     "block_k * (d + 8) + tc * (block_q + 4)",
                                     "floats = d * block_q + max(d * block_k, block_k * block_q) + block_k * d + tc * block_q")],
         False),
        ("divisibility of d not checked", [("block_k % tc or d % tc", "block_k % tc")], False),
    ],
    "median_time": [
        ("the mean", [("return statistics.median(samples)", "return statistics.mean(samples)")], False),
        ("warm-up timed too", [("    for _ in range(warmup):\n        fn()\n", "    reps = reps + warmup\n")], False),
        ("no warm-up", [("    for _ in range(warmup):\n        fn()\n", "")], False),
        ("the minimum", [("return statistics.median(samples)", "return min(samples)")], False),
    ],
    "predicted_tflops": [
        ("FLOPs per FFMA forgotten", [("sms * 4 * 32 * 2 * clock_ghz", "sms * 4 * 32 * clock_ghz")], False),
        ("percentage used as a fraction", [("(issue_busy_pct / 100)", "issue_busy_pct")], False),
        ("one scheduler per SM", [("sms * 4 * 32 * 2", "sms * 32 * 2")], False),
        ("share of non-FFMA instructions", [("(ffma / issued)", "(1 - ffma / issued)")], False),
        ("busy fraction left out", [("* (issue_busy_pct / 100) ", "")], False),
    ],
}


def test_every_exercise_of_lessons_07_to_10_is_covered():
    from test_new_exercises_a import NEW_EXERCISES  # exercises added later keep their mutants there

    mine = {name for name, ex in EXERCISES.items() if ex.lesson[:2] in {"07", "08", "09", "10"}} - set(NEW_EXERCISES)
    elsewhere = {"sectors_per_request", "bank_conflict_degree",  # tests/test_memory_access_exercises.py
                 "waves_and_split"}  # tests/test_plan.py
    assert mine - elsewhere == set(KERNEL_EXERCISES)
    assert all(len(MUTANTS[name]) >= 3 for name in mine - elsewhere)


@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_solution_passes(name):
    stem, fn = KERNEL_EXERCISES[name]
    for seed in (1, 2):
        result = check(name, load(stem)[fn], seed=seed, quiet=True)
        assert result.passed, str(result)
        assert result.seconds < 30, f"{name} took {result.seconds:.1f} s to grade"


@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_blank_is_not_implemented(name):
    stem, fn = KERNEL_EXERCISES[name]
    result = check(name, load(stem, keep=False)[fn], seed=1, quiet=True)
    assert result.status == "not implemented", str(result)


@pytest.mark.parametrize("name,label,edits,sim_only",
                         [(n, lab, e, r) for n, ms in MUTANTS.items() for lab, e, r in ms],
                         ids=[f"{n}: {lab}" for n, ms in MUTANTS.items() for lab, _, _ in ms])
def test_mutant_is_rejected(name, label, edits, sim_only):
    if sim_only and not SIM:
        pytest.skip("found by the simulator's race and bounds checks; on a GPU a race or an out-of-bounds "
                    "read whose value is never stored can give the right answer by chance")
    stem, fn = KERNEL_EXERCISES[name]
    source = strip_solutions((SOURCES / f"{stem}.py").read_text(), True)
    for old, _ in edits:
        assert old in source, f"mutant {label!r}: the solution no longer contains {old!r}"
    result = check(name, load(stem, edits=edits)[fn], seed=1, quiet=True)
    assert result.status == "failed", f"{name}: mutant {label!r} passed"
    assert result.seconds < 30


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


def test_tile_fits_model_matches_the_kernel():
    from flashlab.grading.l10_tuning import shared_bytes
    from flashlab.kernels.register import Tile

    for d, bq, bk, tr, tc in [(64, 64, 32, 16, 8), (128, 32, 16, 8, 8), (16, 16, 64, 4, 8), (32, 128, 16, 32, 4)]:
        assert shared_bytes(d, bq, bk, tc) == Tile(bq, bk, tr, tc).shared_bytes(d)
