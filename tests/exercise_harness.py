"""The standard tests of a lesson's exercises, generated from what the lesson's test file declares.

tests/exercises/test_l<lesson>.py mirrors flashlab/grading/l<lesson>.py. It makes a `Lesson` and declares,
for every exercise of the lesson:

- kept wrong solutions ("mutants"): mistakes a learner could make. The checker must reject each one on every
  seed of SEEDS, with a message and a hint, and where the mutant is declared with words, a verdict that
  contains them (`says`: anywhere in the printed verdict; `message`: in its "why" line; `hint`: in its hint);

      @mutant("roofline", says="at the ridge point itself")
      def roofline_memory_at_the_ridge(intensity, peak, bw): ...

- for exercises whose solution is source code run as is (the kernels of lessons 07-10 and 15, run in numba's
  CUDA simulator without a GPU), mutants made by editing the solution's source, `lesson.edit_mutant(...)`;
- correct alternatives: right answers written differently from the solution, each must pass on ten seeds.

It ends with `globals().update(LESSON.standard_tests())`, which adds the tests every lesson shares:
every exercise of the lesson is covered (three mutants at least, a hint, the alternatives the lesson asks
for), each solution passes on the seeds, each blank is "not implemented", each mutant is rejected (naming
its slip where it has words), each alternative passes. The lesson's own tests (a checker's model against
the library's instrumented runs, say) sit in its file beside the declarations.
"""
from __future__ import annotations

import linecache
from dataclasses import dataclass, field

import numpy as np
import pytest

from conftest import EXERCISE_SOURCES, load_exercise
from flashlab.build import parse_cells, strip_solutions
from flashlab.device import has_gpu
from flashlab.grading import EXERCISES, check

SEEDS = (1, 2, 3)  # every solution must pass them and every mutant fail them
ALTERNATIVE_SEEDS = range(10)
SOURCE_SEEDS = (1, 2)  # solutions run as source code: simulator kernels, a few seconds per seed
SIM_ONLY = ("found by the simulator's race and bounds checks; on a GPU a race or an out-of-bounds read whose value "
            "is never stored can give the right answer by chance")


# Shared by the attention exercises' kept wrong solutions and correct alternatives (lessons 02-06).
LOG2E = 1.4426950408889634


def _work(x):
    """The dtype an attention exercise computes in: float64 for float64 inputs, else float32."""
    return np.float64 if x.dtype == np.float64 else np.float32


def _causal(S, q0=0, k0=0, offset=0):
    """Scores S of rows q0.. and keys k0.. with the causal mask (moved by `offset` keys) applied as -inf."""
    r = np.arange(q0, q0 + S.shape[0])[:, None]
    c = np.arange(k0, k0 + S.shape[1])[None, :]
    return np.where(c <= r + offset, S, -np.inf)


def load_source(stem, keep=True, edits=()):
    """Run an exercise source's definition cells (not the example or check cells), with text edits."""
    ns = {}
    for kind, src in parse_cells((EXERCISE_SOURCES / f"{stem}.py").read_text()):
        if kind != "code" or "check(" in src or "print(" in src:
            continue
        src = strip_solutions(src, keep)
        for old, new in edits:
            src = src.replace(old, new)
        name = f"<{stem}-{abs(hash(src))}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # so inspect.getsource works
        exec(compile(src, name, "exec"), ns)
    return ns


def assert_rejected(name, fn, label, seeds, *, says=None, message=None, hint=None):
    """A kept wrong solution fails exercise `name` for every seed with a message and a hint, and the verdict
    contains `says` (anywhere), `message` (in its message) and `hint` (in its hint) where they are given."""
    for seed in seeds:
        result = check(name, fn, seed=seed, quiet=True)
        assert result.status == "failed", f"{name}: mutant {label!r} passed with seed {seed}:\n{result}"
        assert result.message and result.hint, f"{name}: mutant {label!r}, seed {seed}: no message or hint:\n{result}"
        for words, where, text in ((says, "verdict", str(result)), (message, "message", result.message),
                                   (hint, "hint", result.hint or "")):
            assert words is None or words in text, \
                f"{name}: mutant {label!r}, seed {seed}: the {where} lacks {words!r}:\n{result}"
    return result


@dataclass
class Mutant:
    """A wrong solution: a function, or edits [(old, new), ...] of the solution's source."""

    exercise: str
    label: str
    fn: object = None
    edits: list = field(default_factory=list)
    says: str = None  # words the printed verdict must contain
    message: str = None  # ... its message
    hint: str = None  # ... its hint
    sim_only: str = None  # why only the simulator can tell it apart (skipped on a GPU)


@dataclass
class SourceExercise:
    """An exercise whose solution is the source code run as is, `function` among what it defines."""

    function: str
    seeds: tuple = SOURCE_SEEDS  # the solution's
    mutant_seeds: tuple = (1,)
    seconds: float = 30  # a check of the solution or of a mutant must take less


class Lesson:
    """One lesson's exercises: kept wrong solutions and correct alternatives, and the tests they make."""

    def __init__(self, stem, *, min_alternatives=0):
        self.stem = stem
        self.min_alternatives = min_alternatives
        self.mutants = {}  # exercise -> [Mutant]
        self.alternatives = {}  # exercise -> [functions]
        self.sources = {}  # exercise -> SourceExercise, for those whose solution is run from source
        self._solutions = {}

    # -- declarations ----------------------------------------------------------------------------------
    def mutant(self, name, says=None, *, message=None, hint=None, label=None):
        """Decorator: `fn` is a wrong solution of exercise `name`; the verdict must contain the words given."""
        def register(fn):
            ms = self.mutants.setdefault(name, [])
            text = label or (fn.__doc__ or "").strip().partition("\n")[0] or getattr(fn, "__name__", "<lambda>")
            ms.append(Mutant(name, text if text != "<lambda>" else f"mutant {len(ms)}", fn, says=says,
                             message=message, hint=hint))
            return fn
        return register

    def alternative(self, name):
        """Decorator: `fn` is a correct answer to exercise `name`, written differently from the solution."""
        def register(fn):
            self.alternatives.setdefault(name, []).append(fn)
            return fn
        return register

    def source_exercise(self, name, function, **options):
        """Exercise `name`'s solution is the lesson's source run as is (load_source), `function` in it."""
        self.sources[name] = SourceExercise(function, **options)

    def edit_mutant(self, name, label, edits, says=None, *, sim_only=False):
        """A wrong solution of source exercise `name`: the solution's source with `edits` [(old, new), ...].
        sim_only: only the simulator's race and bounds checks find it (True, or the reason): skipped on a GPU."""
        reason = SIM_ONLY if sim_only is True else sim_only or None
        self.mutants.setdefault(name, []).append(Mutant(name, label, edits=list(edits), says=says, sim_only=reason))

    # -- loading ---------------------------------------------------------------------------------------
    def solution(self, name, keep=True):
        """The exercise's solution (keep=False: the blank a learner starts from)."""
        if (name, keep) not in self._solutions:
            if name in self.sources:
                fn = load_source(self.stem, keep)[self.sources[name].function]
            else:
                fn = load_exercise(self.stem, keep)[name]
            self._solutions[name, keep] = fn
        return self._solutions[name, keep]

    def with_edits(self, name, edits, label=""):
        """The solution of source exercise `name` with `edits`, after checking the solution still has each `old`."""
        source = strip_solutions((EXERCISE_SOURCES / f"{self.stem}.py").read_text(), True)
        for old, _ in edits:
            assert old in source, f"{name}: mutant {label!r}: the solution no longer contains {old!r}"
        return load_source(self.stem, edits=edits)[self.sources[name].function]

    # -- the tests -------------------------------------------------------------------------------------
    def exercises(self):
        return sorted(name for name, ex in EXERCISES.items() if ex.lesson == self.stem)

    def standard_tests(self):
        """The shared tests, as {test name: function}, for the lesson file's globals()."""
        lesson, names = self, self.exercises()
        seeded = [(n, s) for n in names for s in (self.sources[n].seeds if n in self.sources else SEEDS)]
        mutants = [m for n in sorted(self.mutants) for m in self.mutants[n]]
        by_function = [m for m in mutants if m.fn is not None]
        by_edits = [m for m in mutants if m.fn is None]
        alternatives = [(n, fn) for n in sorted(self.alternatives) for fn in self.alternatives[n]]

        def test_every_exercise_is_covered():
            assert names, f"no exercise is registered for lesson {lesson.stem}"
            assert set(lesson.mutants) == set(names), "exercises without kept wrong solutions, or unknown ones"
            assert all(len(lesson.mutants[n]) >= 3 for n in names), {n: len(lesson.mutants[n]) for n in names}
            assert all(EXERCISES[n].hint for n in names)
            assert set(lesson.alternatives) <= set(names) and set(lesson.sources) <= set(names)
            count = {n: len(lesson.alternatives.get(n, [])) for n in names}
            assert all(c >= lesson.min_alternatives for c in count.values()), count

        @pytest.mark.parametrize("name,seed", seeded)
        def test_solution_passes(name, seed):
            result = check(name, lesson.solution(name), seed=seed, quiet=True)
            assert result.passed, str(result)
            if name in lesson.sources:
                limit = lesson.sources[name].seconds
                assert result.seconds < limit, f"{name} took {result.seconds:.1f} s to grade"

        @pytest.mark.parametrize("name", names)
        def test_blank_is_not_implemented(name):
            result = check(name, lesson.solution(name, keep=False), seed=0, quiet=True)
            assert result.status == "not implemented", str(result)

        @pytest.mark.parametrize("mutant", by_function, ids=[f"{m.exercise}: {m.label}" for m in by_function])
        def test_mutant_is_rejected(mutant):
            assert_rejected(mutant.exercise, mutant.fn, mutant.label, SEEDS, says=mutant.says,
                            message=mutant.message, hint=mutant.hint)

        @pytest.mark.parametrize("mutant", by_edits, ids=[f"{m.exercise}: {m.label}" for m in by_edits])
        def test_edit_mutant_is_rejected(mutant):
            if mutant.sim_only and has_gpu():
                pytest.skip(mutant.sim_only)
            name, options = mutant.exercise, lesson.sources[mutant.exercise]
            fn = lesson.with_edits(name, mutant.edits, mutant.label)
            result = assert_rejected(name, fn, mutant.label, options.mutant_seeds, says=mutant.says)
            assert result.seconds < options.seconds, f"{name}: mutant {mutant.label!r} took {result.seconds:.1f} s"

        @pytest.mark.parametrize("name,fn", alternatives, ids=[f"{n}: {fn.__name__}" for n, fn in alternatives])
        def test_correct_alternative_passes(name, fn):
            for seed in ALTERNATIVE_SEEDS:
                result = check(name, fn, seed=seed, quiet=True)
                assert result.passed, f"{fn.__name__}, seed {seed}:\n{result}"

        tests = {"test_every_exercise_is_covered": test_every_exercise_is_covered,
                 "test_solution_passes": test_solution_passes,
                 "test_blank_is_not_implemented": test_blank_is_not_implemented}
        if by_function:
            tests["test_mutant_is_rejected"] = test_mutant_is_rejected
        if by_edits:
            tests["test_edit_mutant_is_rejected"] = test_edit_mutant_is_rejected
        if alternatives:
            tests["test_correct_alternative_passes"] = test_correct_alternative_passes
        return tests
