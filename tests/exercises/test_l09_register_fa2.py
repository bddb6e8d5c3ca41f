"""Lesson 09's exercises (register tiling: the scores micro-tile, what stays in registers, row statistics
through shared memory): each checker accepts the solution, grades the blank "not implemented", and rejects
wrong solutions made by editing the solution's source, run in the CUDA simulator; the row-statistics
verdicts name the slip.
"""
from conftest import EXERCISE_SOURCES
from exercise_harness import Lesson

LESSON = Lesson("09_register_fa2")
LESSON.source_exercise("scores_microtile", "build_scores_kernel")
LESSON.source_exercise("in_registers", "in_registers")
LESSON.source_exercise("row_stats", "build_row_stats", mutant_seeds=(1, 2))

# exercise -> [(what the learner got wrong, [(old, new), ...], needs the simulator's race check)]
MUTANTS = {
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
}
for _name, _mutants in MUTANTS.items():
    for _label, _edits, _sim_only in _mutants:
        LESSON.edit_mutant(_name, _label, _edits, sim_only=_sim_only)


# -- row_stats: row statistics through shared memory -------------------------------------------------
def _solution_body(function):
    """The solution lines of `function` in the lesson 09 exercise source, as the solution notebook has them."""
    source = (EXERCISE_SOURCES / "09_register_fa2.py").read_text()
    body = source[source.index(f"def {function}("):]
    body = body[body.index("### BEGIN SOLUTION\n") + len("### BEGIN SOLUTION\n"):body.index("### END SOLUTION")]
    return body[:body.rindex("\n") + 1]


GLOBAL_ROWS = """        for i in range(RM):
            r = min(q0 + ty * RM + i, n_q - 1)
            mx = s[r, 0]
            for c in range(1, n_k):
                mx = max(mx, s[r, c])
            total = float32(0.0)
            for c in range(n_k):
                total += math.exp(s[r, c] - mx)
            m_row[i] = mx
            l_row[i] = total
"""
RACE_OR_SHARED = "found by the simulator's race check and shared-memory counts"
KERNEL_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain, needs the race check)
    ("no barrier after writing the partial maxima",
     [("        cuda.syncthreads()  # every partial max is in red\n", "")], "hazard", True),
    ("no barrier before the partial sums overwrite the maxima",
     [("        cuda.syncthreads()  # every thread has read the maxima: red may be reused\n", "")], "hazard", True),
    ("each thread keeps its own max",
     [("            for t2 in range(1, tc):\n                mx = max(mx, red[t2, ty * RM + i])\n", ""),
      ("mx = red[0, ty * RM + i]", "mx = red[tx, ty * RM + i]")], "combine the tc partial maxima", False),
    ("each thread keeps its own sum",
     [("            for t2 in range(tc):\n                total += red[t2, ty * RM + i]",
       "            total += red[tx, ty * RM + i]")], "partial sums", False),
    ("one slot per thread row, not per row of the tile",
     [("red[tx, ty * RM + i] = mx", "red[tx, ty] = mx"), ("red[0, ty * RM + i]", "red[0, ty]"),
      ("red[t2, ty * RM + i])", "red[t2, ty])")], "m is wrong", False),
    ("exponents not relative to the max",
     [("part += math.exp(sc[i, j] - m_row[i])", "part += math.exp(sc[i, j])")], "wrong", False),
    ("the whole row read from global memory, nothing shared", [(_solution_body("build_row_stats"), GLOBAL_ROWS)],
     "no thread wrote shared memory", True),
]
for _label, _edits, _says, _sim_only in KERNEL_MUTANTS:
    LESSON.edit_mutant("row_stats", _label, _edits, _says, sim_only=_sim_only and RACE_OR_SHARED)


globals().update(LESSON.standard_tests())
