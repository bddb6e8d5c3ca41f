"""The coalescing (07) and bank-conflict (08) checkers accept the solutions, call the blanks "not implemented",
and reject plausible wrong solutions ("mutants") with a message that names the slip."""
import numpy as np
import pytest

import flashlab.grading as grading
from conftest import load_exercise

NAMES = ("sectors_per_request", "bank_conflict_degree")
SEEDS = (1, 2, 3)


def _int(x):
    return int(x)


MUTANTS = {  # name -> [(what the learner got wrong, function, words the verdict must contain)]
    "sectors_per_request": [
        ("one sector per thread", lambda a, n: len(a), "one sector per thread"),
        ("distinct addresses", lambda a, n: _int(np.unique(a).size), "distinct addresses"),
        ("128-byte lines", lambda a, n: _int(np.unique(a // 128).size), "128-byte lines"),
        ("every sector between the lowest and highest address",
         lambda a, n: _int((a.max() + n - 1) // 32 - a.min() // 32 + 1), "lowest address to the highest"),
        ("multiplies byte addresses by nbytes", lambda a, n: _int(np.unique(a * n // 32).size), "byte addresses"),
        ("returns the sectors, not their number", lambda a, n: np.unique(a // 32), "as an int"),
        ("returns a float", lambda a, n: float(np.unique(a // 32).size), "as an int"),
    ],
    "bank_conflict_degree": [
        ("counts threads per bank (forgets the broadcast)",
         lambda w: _int(np.bincount(w % 32, minlength=32).max()), "broadcast"),
        ("bank = word // 32", lambda w: _int(np.bincount(np.unique(w) // 32).max()), "w % 32"),
        ("treats word indices as byte addresses",
         lambda w: _int(np.bincount(np.unique(4 * w) % 32, minlength=32).max()), "4-byte words"),
        ("returns the extra passes", lambda w: _int(np.bincount(np.unique(w) % 32, minlength=32).max() - 1),
         "extra passes"),
        ("counts the banks used", lambda w: _int(np.unique(w % 32).size), "busiest bank"),
        ("words / 32, rounded up", lambda w: _int(-(-np.unique(w).size // 32)), "fall into banks"),
    ],
}


def _solution(name, keep=True):
    return load_exercise(grading.EXERCISES[name].lesson, keep=keep)[name]


@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name):
    for seed in SEEDS:
        r = grading.check(name, _solution(name), seed=seed, quiet=True)
        assert r.passed, str(r)


@pytest.mark.parametrize("name", NAMES)
def test_blank_is_not_implemented(name):
    r = grading.check(name, _solution(name, keep=False), seed=1, quiet=True)
    assert r.status == "not implemented", str(r)


def test_every_exercise_has_three_mutants_and_a_hint():
    assert set(MUTANTS) == set(NAMES) and all(len(m) >= 3 for m in MUTANTS.values())
    assert all(grading.EXERCISES[n].hint for n in NAMES)


@pytest.mark.parametrize("name, i", [(n, i) for n, ms in MUTANTS.items() for i in range(len(ms))])
def test_mutants_fail_and_the_verdict_names_the_slip(name, i):
    label, fn, words = MUTANTS[name][i]
    for seed in SEEDS:
        r = grading.check(name, fn, seed=seed, quiet=True)
        assert r.status == "failed", f"mutant '{label}' of {name} passed with seed {seed}"
        assert words in r.message, f"mutant '{label}': the verdict does not say what is wrong:\n{r}"


def test_a_crashing_function_is_a_verdict_not_a_crash():
    def broken(*args):
        return 1 // 0

    for name in NAMES:
        r = grading.check(name, broken, seed=0, quiet=True)
        assert r.status == "failed" and "ZeroDivisionError" in r.message
