"""Lesson 10's exercises (does a tile fit, timing, predicted TFLOP/s, waves and split-KV): each checker accepts
the solution, grades the blank "not implemented", and rejects wrong solutions made by editing the solution's
source. The checkers' models are the kernel's shared-memory count and the launch planner's choices."""
import pytest

from exercise_harness import Lesson

LESSON = Lesson("10_tuning")
LESSON.source_exercise("tile_fits", "tile_fits")
LESSON.source_exercise("median_time", "median_time")
LESSON.source_exercise("predicted_tflops", "predicted_tflops")
LESSON.source_exercise("waves_and_split", "waves_and_split")

# exercise -> [(what the learner got wrong, [(old, new), ...])]
MUTANTS = {
    "tile_fits": [
        ("strict < at the shared limit", [("if 4 * floats > shared_limit:", "if 4 * floats >= shared_limit:")]),
        ("register budget ignored", [("return rm * rd + rm * rn + 3 * rm + rn + rd + 24 <= max_regs", "return True")]),
        ("no padding of the rows", [("floats = d * (block_q + 4) + max(d * (block_k + 4), block_k * (block_q + 4)) + "
                                     "block_k * (d + 8) + tc * (block_q + 4)",
                                     "floats = d * block_q + max(d * block_k, block_k * block_q) + block_k * d + tc * block_q")]),
        ("divisibility of d not checked", [("block_k % tc or d % tc", "block_k % tc")]),
    ],
    "median_time": [
        ("the mean", [("return statistics.median(samples)", "return statistics.mean(samples)")]),
        ("warm-up timed too", [("    for _ in range(warmup):\n        fn()\n", "    reps = reps + warmup\n")]),
        ("no warm-up", [("    for _ in range(warmup):\n        fn()\n", "")]),
        ("the minimum", [("return statistics.median(samples)", "return min(samples)")]),
    ],
    "predicted_tflops": [
        ("FLOPs per FFMA forgotten", [("sms * 4 * 32 * 2 * clock_ghz", "sms * 4 * 32 * clock_ghz")]),
        ("percentage used as a fraction", [("(issue_busy_pct / 100)", "issue_busy_pct")]),
        ("one scheduler per SM", [("sms * 4 * 32 * 2", "sms * 32 * 2")]),
        ("share of non-FFMA instructions", [("(ffma / issued)", "(1 - ffma / issued)")]),
        ("busy fraction left out", [("* (issue_busy_pct / 100) ", "")]),
    ],
}
for _name, _mutants in MUTANTS.items():
    for _label, _edits in _mutants:
        LESSON.edit_mutant(_name, _label, _edits)


# -- waves_and_split ---------------------------------------------------------------------------------
WAVES_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain)
    ("no rounding of registers to 256 per warp",
     [("(-(-registers * 32 // 256) * 256)", "(registers * 32)")], None),
    ("warps not rounded down to a multiple of 4", [("// 4 * 4", "")], None),
    ("reserved shared memory forgotten", [('(shared_bytes + gpu["reserved_shared_per_block"])', "shared_bytes")],
     "reserved"),
    ("whole query blocks not counted", [("blocks = -(-N // block_q) * B * H", "blocks = N / block_q * B * H")], None),
    ("split below one wave only", [("if blocks / slots < 2:", "if blocks / slots < 1:")], "2 waves"),
    ("no minimum chunk", [("if N // s >= 256]", "]")], None),
    ("occupancy in blocks", [('"occupancy": blocks_per_sm * warps / max_warps',
                              '"occupancy": blocks_per_sm / gpu["max_blocks_per_sm"]')], None),
]
for _label, _edits, _says in WAVES_MUTANTS:
    LESSON.edit_mutant("waves_and_split", _label, _edits, _says)


globals().update(LESSON.standard_tests())


def test_tile_fits_model_matches_the_kernel():
    from flashlab.grading.l10_tuning import shared_bytes
    from flashlab.kernels.register import Tile

    for d, bq, bk, tr, tc in [(64, 64, 32, 16, 8), (128, 32, 16, 8, 8), (16, 16, 64, 4, 8), (32, 128, 16, 32, 4)]:
        assert shared_bytes(d, bq, bk, tc) == Tile(bq, bk, tr, tc).shared_bytes(d)


def test_the_waves_checkers_answer_is_the_planners():
    """On grids of equal blocks, the waves checker's reference gives the launch planner's blocks per SM, splits,
    waves, efficiency and occupancy."""
    from flashlab.grading.l10_tuning import GPU_H100, waves_and_split_reference
    from flashlab.kernels.plan import H100, plan

    for B, H, N, d in [(1, 16, 1024, 64), (1, 16, 2048, 64), (1, 16, 4096, 64), (4, 16, 1024, 32), (1, 8, 1024, 128),
                       (1, 4, 8192, 64), (2, 16, 2048, 128)]:
        p = plan((B, H, N, d), device=H100)
        want = waves_and_split_reference(B, H, N, p.block_q, p.threads, p.registers, p.shared_bytes, GPU_H100)
        assert (want["blocks_per_sm"], want["splits"]) == (p.blocks_per_sm, p.splits), (B, H, N, d)
        assert want["waves"] == pytest.approx(p.unsplit[0]) and want["efficiency"] == pytest.approx(p.unsplit[1])
        assert want["occupancy"] == pytest.approx(p.occupancy)
