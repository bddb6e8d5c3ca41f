"""Lesson 11's exercises (FP8 block quantization, incoherent processing, the FA3 loop's time): each checker
passes the solution, grades the blank "not implemented", and rejects plausible wrong solutions with a
message and a hint that names the usual slips. The loop-time checker's reference is checked against the
schedule worked out by hand."""
import numpy as np
import pytest

from exercise_harness import Lesson
from flashlab.fp8 import hadamard, round_e4m3

LESSON = Lesson("11_fa3_ideas")
mutant = LESSON.mutant


# -- fp8_block_quantize, fp8_incoherent --------------------------------------------------------------
def _blocks(x, block, scale_of, rounder=round_e4m3):
    n_blocks = -(-x.shape[0] // block)
    codes, scales = np.empty_like(x), np.empty(n_blocks)
    for b in range(n_blocks):
        rows = x[b * block:(b + 1) * block]
        scales[b] = scale_of(rows)
        codes[b * block:(b + 1) * block] = rounder(rows / scales[b])
    return codes, scales


def _amax(rows):
    a = np.abs(rows).max()
    return a / 448 if a > 0 else 1.0


for _fn in [
    lambda x, b: _blocks(x, b, _amax, np.round),  # integer rounding, not the e4m3 grid
    lambda x, b: _blocks(x, b, lambda r: np.abs(r).max() or 1.0),  # maps amax to 1, not 448: underflows
    lambda x, b: _blocks(x, b, lambda r: np.abs(r).max() / 448),  # all-zero block: 0/0 = NaN
    lambda x, b: _blocks(x, b, lambda r: np.abs(x).max() / 448),  # one scale for the whole tensor
    lambda x, b: (lambda c, s: (c, s[: x.shape[0] // b]))(*_blocks(x, b, _amax)),  # drops the ragged block's scale
    lambda x, b: _blocks(x, b, lambda r: np.abs(r).max() / 240 or 1.0),  # 240 (e4m3fnuz's max): codes too small
    lambda x, b: (lambda c, s: (c * np.repeat(s, b)[: x.shape[0], None], s))(*_blocks(x, b, _amax)),  # returns codes * scale
]:
    mutant("fp8_block_quantize")(_fn)

for _fn in [
    lambda q, k, s: (q @ (s[:, None] * hadamard(q.shape[1])), k),  # rotates q only
    lambda q, k, s: (q @ (s[:, None] * hadamard(q.shape[1]) * np.sqrt(q.shape[1])),
                     k @ (s[:, None] * hadamard(q.shape[1]) * np.sqrt(q.shape[1]))),  # unscaled Hadamard
    lambda q, k, s: (q @ hadamard(q.shape[1]), k @ hadamard(q.shape[1])),  # forgets the random signs
    lambda q, k, s: (q @ (s[:, None] * hadamard(q.shape[1])), k @ (s[:, None] * hadamard(q.shape[1])).T),  # M^T on k
    lambda q, k, s: (q @ (hadamard(q.shape[1]) * s[None, :]), k @ (hadamard(q.shape[1]) * s[None, :])),  # signs after mixing
]:
    mutant("fp8_incoherent")(_fn)


# -- fa3_loop_time -----------------------------------------------------------------------------------
@mutant("fa3_loop_time", hint="busiest unit")
def loop_busiest_unit(g, s, n, overlap):  # perfect overlap: only pingpong's second warpgroup gets there
    return n * max(2 * g, s) if overlap else n * (2 * g + s)


@mutant("fa3_loop_time", hint="Before the loop")
def loop_no_prologue(g, s, n, overlap):  # every block at the steady pace
    return n * (g + max(g, s)) if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_hides_whole_softmax(g, s, n, overlap):  # softmax under both GEMMs
    return 2 * g + s + (n - 1) * 2 * g if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_plain_two_stage(g, s, n, overlap):  # the two-stage pipeline of lesson 12, with the GEMMs as one stage
    return 2 * g + s + (n - 1) * max(2 * g, s) if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_forgets_last_pv(g, s, n, overlap):
    return g + s + (n - 1) * (g + max(g, s)) if overlap else n * (2 * g + s)


globals().update(LESSON.standard_tests())


def test_fa3_loop_time_reference_is_the_closed_form(rng=np.random.default_rng(0)):
    """The checker's reference comes from flashlab.timeline's scheduler; it must match the schedule worked out
    by hand: QK_0 and softmax_0 alone, then g + max(g, s) per block, then PV_{n-1} alone."""
    from flashlab.grading.l11_fa3_ideas import loop_time

    for _ in range(50):
        g, s = rng.uniform(0.1, 5, 2)
        n = int(rng.integers(1, 12))
        assert loop_time(g, s, n, True) == pytest.approx(2 * g + s + (n - 1) * (g + max(g, s)))
        assert loop_time(g, s, n, False) == pytest.approx(n * (2 * g + s))
