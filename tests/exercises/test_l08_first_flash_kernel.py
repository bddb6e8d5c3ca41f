"""Lesson 08's exercises (the first flash kernel, bank conflicts): each checker accepts the solution, grades the
blank "not implemented", and rejects plausible wrong solutions.

The kernel's wrong solutions are the solution's source with one edit a learner could make (no causal tile
skipping, a running sum not rescaled, a causal mask off by one, ...), run in the CUDA simulator. The
bank-conflict checker's verdicts name the slip.
"""
import numpy as np

import flashlab.grading as grading
from exercise_harness import Lesson

LESSON = Lesson("08_first_flash_kernel")
mutant = LESSON.mutant
LESSON.source_exercise("flash_shared_kernel", "build_flash_shared")

# (what the learner got wrong, [(old, new), ...], needs the simulator's race check)
for _label, _edits, _sim_only in [
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
]:
    LESSON.edit_mutant("flash_shared_kernel", _label, _edits, sim_only=_sim_only)


# -- bank_conflict_degree ----------------------------------------------------------------------------
def _int(x):
    return int(x)


for _label, _fn, _words in [  # (what the learner got wrong, function, words the verdict's message must contain)
    ("counts threads per bank (forgets the broadcast)",
     lambda w: _int(np.bincount(w % 32, minlength=32).max()), "broadcast"),
    ("bank = word // 32", lambda w: _int(np.bincount(np.unique(w) // 32).max()), "w % 32"),
    ("treats word indices as byte addresses",
     lambda w: _int(np.bincount(np.unique(4 * w) % 32, minlength=32).max()), "4-byte words"),
    ("returns the extra passes", lambda w: _int(np.bincount(np.unique(w) % 32, minlength=32).max() - 1),
     "extra passes"),
    ("counts the banks used", lambda w: _int(np.unique(w % 32).size), "busiest bank"),
    ("words / 32, rounded up", lambda w: _int(-(-np.unique(w).size // 32)), "fall into banks"),
]:
    mutant("bank_conflict_degree", message=_words, label=_label)(_fn)


globals().update(LESSON.standard_tests())


def test_a_crashing_function_is_a_verdict_not_a_crash():
    def broken(*args):
        return 1 // 0

    r = grading.check("bank_conflict_degree", broken, seed=0, quiet=True)
    assert r.status == "failed" and "ZeroDivisionError" in r.message
