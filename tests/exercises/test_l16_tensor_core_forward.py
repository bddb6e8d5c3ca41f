"""Lesson 16's exercises (the tensor-core forward: the S tile kernel, the forward's K/V copies): each checker passes
the solution, grades the blank "not implemented", and rejects kept wrong solutions for several seeds, naming the slip.
The checker's statement of the copies is checked against the kernel.
"""
import numpy as np
import pytest

from conftest import load_exercise
from exercise_harness import Lesson
from flashlab.device import has_gpu
from flashlab.grading import check

INNER_LOOP = ("softmax_step", "pack_p", "pv_kstep", "forward_warp")  # as in test_l16_inner_loop.py


class _OwnExercises(Lesson):
    """All of lesson 16's exercises but the inner loop's, which test_l16_inner_loop.py covers."""

    def exercises(self):
        return [name for name in super().exercises() if name not in INNER_LOOP]


LESSON = _OwnExercises("16_tensor_core_forward")
STEM = LESSON.stem
SOLUTIONS = load_exercise(STEM)
mutant, alternative = LESSON.mutant, LESSON.alternative
LESSON.source_exercise("s_tile", "s_tile", mutant_seeds=(1, 2))

# -- 1: the kernel (edits of the solution's source, run in the simulator) -------------------------
KERNEL_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain)
    ("a1 and a2 swapped (the +4 words before the +8 rows)",
     [("MMA16(q[g, w], q[g + 8, w], q[g, w + 4], q[g + 8, w + 4],",
       "MMA16(q[g, w], q[g, w + 4], q[g + 8, w], q[g + 8, w + 4],")], "A registers are in the wrong order"),
    ("accumulators restarted at every k-step",
     [("k[key, w], k[key, w + 4], c0, c1, c2, c3)",
       "k[key, w], k[key, w + 4], np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0))")],
     "k-step"),
    ("B read as the next word instead of 4 words on",
     [("k[key, w], k[key, w + 4], c0", "k[key, w], k[key, w + 1], c0")], "B registers"),
    ("C written to columns t, t + 1", [("col = 8 * n + 2 * t", "col = 8 * n + t")], "never written"),
    ("only the first n-tile", [("for n in range(k.shape[0] // 8):", "for n in range(1):")], "never written"),
]
for _label, _edits, _says in KERNEL_MUTANTS:
    LESSON.edit_mutant("s_tile", _label, _edits, _says)


# -- 6: the row padding ---------------------------------------------------------------------------
@mutant("row_padding", "multiple of 4 words")
def padding_in_single_words(W):
    """4-byte banks taken one by one: the first p (any integer) that puts 8 rows' starts in 8 different banks"""
    return next(p for p in range(33) if len({(r * (W + p)) % 32 for r in range(8)}) == 8)


@mutant("row_padding", "not in bytes")
def padding_in_bytes(W):
    """the right padding, in bytes"""
    return 4 * SOLUTIONS["row_padding"](W)


@mutant("row_padding", "when W / 4 is odd")
def padding_always_four(W):
    """the kernel's constant: 4 words, whatever W"""
    return 4


@mutant("row_padding", "not just two neighbouring rows")
def padding_two_rows(W):
    """only rows 0 and 1 kept apart"""
    return next(p for p in range(0, 33, 4) if (W + p) % 32 // 4 != 0)


@alternative("row_padding")
def padding_from_parity(W):
    """the rows' starts step by (W + p) / 4 bank groups: 8 distinct groups mod 8 exactly when that step is odd"""
    return 0 if (W // 4) % 2 else 4


# -- 7: the forward's K/V copies ----------------------------------------------------------------------
_plan = SOLUTIONS["copy_plan"]


@mutant("copy_plan", "padded by 4 words")
def plan_unpadded(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """shared rows W words apart instead of W + 4"""
    W = d if wide else d // 2
    return [((s // (W + 4)) * W + s % (W + 4), src, n) for s, src, n in _plan(tid, threads, d, block_k, k0, n_k,
                                                                              row_stride, wide)]


@mutant("copy_plan", "row_stride words apart")
def plan_contiguous_source(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """the source's rows taken as W words apart, whatever row_stride says"""
    return _plan(tid, threads, d, block_k, k0, n_k, d if wide else d // 2, wide)


@mutant("copy_plan", "consecutive 16-byte chunks of one row")
def plan_rows_first(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """consecutive threads on consecutive rows (column = tid // rows per step): uncoalesced"""
    W = d if wide else d // 2
    rows = threads // (W // 4)
    out, row, col = [], tid % rows, 4 * (tid // rows)
    while row < block_k:
        ok = k0 + row < n_k
        out.append((row * (W + 4) + col, (k0 + row) * row_stride + col if ok else k0 * row_stride + col,
                    16 if ok else 0))
        row += rows
    return out


@mutant("copy_plan", "0 bytes")
def plan_copies_past_the_end(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """rows past n_k read 16 bytes from past the end"""
    W = d if wide else d // 2
    return [(s, src if n else src + (s // (W + 4)) * row_stride, 16) for s, src, n in
            _plan(tid, threads, d, block_k, k0, n_k, row_stride, wide)]


def test_the_copy_checkers_plan_is_the_kernels(rng, monkeypatch):
    """The checker's copy_plan is what the tensor forward copies: every cp_async16_flat call of a simulated launch
    (two K/V tiles, the second past the keys) is a (shared word, source word, bytes) of the plan, K's at the
    tile's stage and V's block_k padded rows further on."""
    if has_gpu():
        pytest.skip("records the simulator's copies")
    from flashlab.grading.l16_tensor_core_forward import copy_plan
    from flashlab.kernels import flash_attention, mma, tensor

    d, block_k, n_k, tile = 16, 16, 20, tensor.TensorTile(1, 16)
    W = d // 2
    stage, vo = 2 * block_k * (W + 4), block_k * (W + 4)
    seen, copy = [], mma.cp_async16_flat

    def recording(dst, dst_index, src, base, offset, src_bytes):
        seen.append((int(dst_index), int(base) + int(offset), int(src_bytes)))
        return copy(dst, dst_index, src, base, offset, src_bytes)

    monkeypatch.setattr(mma, "cp_async16_flat", recording)
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float16) for n in (16, n_k, n_k))
    flash_attention(q, k, v, variant="tensor", block_q=16, block_k=block_k)
    want = []
    for j, k0 in enumerate(range(0, n_k, block_k)):
        for tid in range(tile.threads):
            for s, src, n in copy_plan(tid, tile.threads, d, block_k, k0, n_k, W, False):
                want += [((j % 2) * stage + s, src, n), ((j % 2) * stage + vo + s, src, n)]
    assert sorted(seen) == sorted(want)
    assert any(n == 0 for _, _, n in want) and any(n == 16 for _, _, n in want)


globals().update(LESSON.standard_tests())


@pytest.mark.skipif(has_gpu(), reason="the simulator's check; on a GPU a skipped warp instruction is undefined")
def test_s_tile_that_skips_the_mma_on_some_lanes_fails_with_a_message():
    edits = [("        for ks in range(q.shape[1] // 8):  # k-steps of 16 dims = 8 words\n",
              "        for ks in range(q.shape[1] // 8 if lane else 0):  # k-steps of 16 dims = 8 words\n")]
    result = check("s_tile", LESSON.with_edits("s_tile", edits), seed=1, quiet=True)
    assert result.status == "failed" and "all 32 lanes" in str(result), str(result)
