"""Checkers of lessons 11 and 12 accept the solutions and reject plausible wrong ones ("mutants")."""

import numpy as np
import pytest

import flashlab.grading as grading
from flashlab.fp8 import hadamard, round_e4m3
from conftest import load_exercise

NAMES = ("fp8_block_quantize", "fp8_incoherent", "tt_causal_pairing", "tt_pipeline_time")
MINE = {n: grading.EXERCISES[n] for n in NAMES}  # registered when flashlab.grading imports l11_fa3_ideas and l12_other_hardware

SEEDS = (1, 2, 3)




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


MUTANTS = {
    "fp8_block_quantize": [
        lambda x, b: _blocks(x, b, _amax, np.round),  # integer rounding, not the e4m3 grid
        lambda x, b: _blocks(x, b, lambda r: np.abs(r).max() or 1.0),  # maps amax to 1, not 448: underflows
        lambda x, b: _blocks(x, b, lambda r: np.abs(r).max() / 448),  # all-zero block: 0/0 = NaN
        lambda x, b: _blocks(x, b, lambda r: np.abs(x).max() / 448),  # one scale for the whole tensor
        lambda x, b: (lambda c, s: (c, s[: x.shape[0] // b]))(*_blocks(x, b, _amax)),  # drops the ragged block's scale
        lambda x, b: _blocks(x, b, lambda r: np.abs(r).max() / 240 or 1.0),  # 240 (e4m3fnuz's max): codes too small
        lambda x, b: (lambda c, s: (c * np.repeat(s, b)[: x.shape[0], None], s))(*_blocks(x, b, _amax)),  # returns codes * scale
    ],
    "fp8_incoherent": [
        lambda q, k, s: (q @ (s[:, None] * hadamard(q.shape[1])), k),  # rotates q only
        lambda q, k, s: (q @ (s[:, None] * hadamard(q.shape[1]) * np.sqrt(q.shape[1])),
                         k @ (s[:, None] * hadamard(q.shape[1]) * np.sqrt(q.shape[1]))),  # unscaled Hadamard
        lambda q, k, s: (q @ hadamard(q.shape[1]), k @ hadamard(q.shape[1])),  # forgets the random signs
        lambda q, k, s: (q @ (s[:, None] * hadamard(q.shape[1])), k @ (s[:, None] * hadamard(q.shape[1])).T),  # M^T on k
        lambda q, k, s: (q @ (hadamard(q.shape[1]) * s[None, :]), k @ (hadamard(q.shape[1]) * s[None, :])),  # signs after mixing
    ],
    "tt_causal_pairing": [
        lambda n, p: [list(range(c * n // p, (c + 1) * n // p)) for c in range(p)],  # consecutive chunks
        lambda n, p: [list(range(c, n, p)) for c in range(p)],  # round robin: close, but not equal
        lambda n, p: [[i for m in range(n // (2 * p)) for i in (2 * (c + m * p), 2 * (c + m * p) + 1)] for c in range(p)],  # neighbours
        lambda n, p: [[i for m in range(n // (2 * p)) for i in (c + m * p, n - (c + m * p))] for c in range(p)],  # off by one
    ],
    "tt_pipeline_time": [
        lambda tr, tc, tw, n, depth: n * (tr + tc + tw) if depth == 1 else tr + tc + tw + (n - 1) * max(tr, tc, tw),  # one slot: nothing overlaps
        lambda tr, tc, tw, n, depth: tr + tc + tw + (n - 1) * max(tr, tc, tw),  # ignores the depth
        lambda tr, tc, tw, n, depth: n * (tr + tc) if depth == 1 else tr + tc + (n - 1) * max(tr, tc),  # forgets the writer
        lambda tr, tc, tw, n, depth: (tr + tc + tw + (n - 1) * (tc + max(tr, tw)) if depth == 1
                                      else tr + tc + tw + (n - 1) * max(tr, tc)),  # writer never the slowest
        lambda tr, tc, tw, n, depth: (tr + tc + tw + (n - 1) * (tc + max(tr, tw)) if depth != 2
                                      else tr + tc + tw + (n - 1) * max(tr, tc, tw)),  # a third slot treated as one
    ],
}


@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name):
    fn = load_exercise(MINE[name].lesson)[name]
    for seed in SEEDS:
        r = grading.check(name, fn, seed=seed, quiet=True)
        assert r.passed, str(r)


@pytest.mark.parametrize("name", NAMES)
def test_blank_is_not_implemented(name):
    r = grading.check(name, load_exercise(MINE[name].lesson, keep=False)[name], seed=1, quiet=True)
    assert r.status == "not implemented", str(r)


def test_every_exercise_has_three_mutants():
    assert set(MUTANTS) == set(NAMES) and all(len(m) >= 3 for m in MUTANTS.values())


@pytest.mark.parametrize("name, i", [(n, i) for n, ms in MUTANTS.items() for i in range(len(ms))])
def test_mutants_fail(name, i):
    for seed in SEEDS:
        r = grading.check(name, MUTANTS[name][i], seed=seed, quiet=True)
        assert not r.passed, f"mutant {i} of {name} passed with seed {seed}"
