"""Running one exercise's checks on a learner's function, and reporting the verdict.

An exercise is one checker function registered with `@exercise(name, hint=...)`. The checker receives a
`Checker` `t` and the learner's function and runs plain straight-line code:

    case = t.case("ragged tails", shape=(13, 8), dtype="float64")     # describe the next inputs
    out = t.call(x)                                                   # run the learner's function
    t.compare(out, ref)                                               # or: raise t.fail("...")

`t.call` fails the check with a clear message when the function raises (showing the learner's own line),
changes its inputs in place or runs past the exercise's time limit; a NotImplementedError means "not
implemented". `t.compare` fails on a wrong type, shape or dtype, on NaN/inf, and on a relative error
||out - ref|| / ||ref|| above the dtype's tolerance. The first failure ends the check.
"""
from __future__ import annotations

import html
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

import numpy as np

#: Relative error allowed for outputs of each dtype (against a float64 reference).
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2}

#: When set, every verdict is appended to this file as one JSON line (the command-line grader reads it).
RESULTS_ENV = "FLASHLAB_GRADE_RESULTS"

EXERCISES: dict = {}  # name -> Exercise, filled by the @exercise decorators of the lesson modules
RESULTS: list = []  # every Result of this process, in order


def tolerance(dtype) -> float:
    return TOLERANCE[np.dtype(dtype)]


@dataclass
class Exercise:
    name: str
    run: object  # checker(t, fn)
    hint: str  # points at the idea when nothing more specific is known
    lesson: str
    time_limit: float  # seconds for the whole check


def exercise(name, *, hint, lesson, time_limit=20.0):
    """Register `checker(t, fn)` as the checks of exercise `name`."""

    def register(checker):
        EXERCISES[name] = Exercise(name, checker, hint, lesson, float(time_limit))
        return checker

    return register


@dataclass
class Case:
    """What the learner needs to reproduce one set of inputs."""

    label: str
    info: dict
    hint: str = None

    def __str__(self):
        parts = [f"{k}={_short(v)}" for k, v in self.info.items()]
        return f"{self.label}: " + ", ".join(parts) if parts else self.label


def _short(v):
    if isinstance(v, np.dtype) or isinstance(v, type):
        return np.dtype(v).name
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


class Failed(Exception):
    """Ends a check: the learner's function gave a wrong answer. Create it with `t.fail(...)`."""

    def __init__(self, message, *, hint=None, error=None, tol=None, details=()):
        super().__init__(message)
        self.message, self.hint, self.error, self.tol, self.details = message, hint, error, tol, list(details)


class NotImplementedYet(Exception):
    pass


class _TimeUp(BaseException):  # a BaseException, so the learner's `except Exception:` cannot swallow it
    pass


@dataclass
class Result:
    exercise: str
    status: str  # "passed", "failed" or "not implemented"
    message: str = ""
    case: str = None
    error: float = None
    tolerance: float = None
    hint: str = None
    details: list = field(default_factory=list)
    cases_passed: int = 0
    seconds: float = 0.0
    seed: int = None
    function: str = "your_function"
    _shown_at: object = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def lines(self):
        """The verdict as (label, text) lines; the first has label None."""
        if self.status == "passed":
            return [(None, f"✓ {self.exercise}: passed all {self.cases_passed} cases ({self.seconds:.2f} s)")]
        if self.status == "not implemented":
            return [(None, f"… {self.exercise}: not implemented yet"), ("", self.message)]
        out = [(None, f"✗ {self.exercise}: failed"), ("why", self.message)]
        if self.case:
            out.append(("case", self.case))
        if self.error is not None:
            out.append(("error", f"relative error {self.error:.2e} > tolerance {self.tolerance:.0e}"))
        out += [("where", d) for d in self.details]
        if self.hint:
            out.append(("hint", self.hint))
        if self.seed is not None:
            out.append(("seed", f"same inputs again: flashlab.check({self.exercise!r}, {self.function}, seed={self.seed})"))
        return out

    def __str__(self):
        text = []
        for label, line in self.lines():
            if label is None:
                text.append(line)
            else:
                pad = f"{label}: " if label else ""
                text.append("  " + pad.ljust(7) + line.replace("\n", "\n" + " " * 9))
        return "\n".join(text)

    def __repr__(self):
        return f"<check {self.exercise}: {self.status}>"

    def _repr_html_(self):
        colour = {"passed": "#2e7d32", "failed": "#c62828"}.get(self.status, "#9e9e9e")
        rows = []
        for label, line in self.lines():
            if label is None:
                rows.append(f"<div style='font-weight:bold'>{html.escape(line)}</div>")
            else:
                lab = f"<b>{html.escape(label)}:</b> " if label else ""
                rows.append(f"<div style='white-space:pre-wrap;font-family:monospace'>{lab}{html.escape(line)}</div>")
        return f"<div style='border-left:6px solid {colour};padding:4px 10px;margin:4px 0'>{''.join(rows)}</div>"

    def _ipython_display_(self):
        # check() displays the verdict itself; when the same cell also echoes the returned value, stay quiet.
        ip = _ipython()
        if ip is not None and self._shown_at == ip.execution_count:
            self._shown_at = None
            return
        self._display()

    def _display(self):
        from IPython.display import display

        display({"text/plain": str(self), "text/html": self._repr_html_()}, raw=True)


def _ipython():
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    return shell if shell is not None and hasattr(shell, "kernel") else None


def show(result: Result):
    """Print the verdict (rendered as HTML in Jupyter) and record it."""
    RESULTS.append(result)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result.to_dict()) + "\n")
    ip = _ipython()
    if ip is not None:
        result._display()
        result._shown_at = ip.execution_count
    else:
        print(result)


# ------------------------------------------------------------------------------------------------
# The checker's toolbox
# ------------------------------------------------------------------------------------------------

class Checker:
    """Runs the learner's function `fn` on inputs a checker builds, and compares the outputs."""

    def __init__(self, ex: Exercise, fn, seed: int):
        self.exercise, self.fn, self.seed = ex, fn, seed
        self.rng = np.random.default_rng(seed)
        self.deadline = time.monotonic() + ex.time_limit
        self.cases = []

    @property
    def current(self) -> Case:
        return self.cases[-1] if self.cases else None

    def case(self, label, hint=None, **info) -> Case:
        """Start a new case; the verdict names the case that failed."""
        self.cases.append(Case(label, info, hint))
        return self.cases[-1]

    def normal(self, shape, dtype=np.float64, scale=1.0, shift=0.0) -> np.ndarray:
        """Fresh N(shift, scale^2) numbers (never all zeros) of the given dtype."""
        return (shift + scale * self.rng.standard_normal(shape)).astype(dtype)

    def fail(self, message, **kw) -> Failed:
        kw.setdefault("hint", self.current.hint if self.current else None)
        return Failed(message, **kw)

    # -- running the learner's code ---------------------------------------------------------------
    def call(self, *args, fn=None, **kwargs):
        """fn(*args, **kwargs), failing on an exception, in-place changes to array inputs or a timeout."""
        fn = fn or self.fn
        arrays = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + list(kwargs.items())
        copies = [(name, a, a.copy()) for name, a in arrays if isinstance(a, np.ndarray)]
        try:
            with _time_limit(self.deadline - time.monotonic()), warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                out = fn(*args, **kwargs)
        except _TimeUp:
            raise self.timeout() from None
        except NotImplementedError:
            raise NotImplementedYet() from None
        except Failed:
            raise
        except Exception as exc:
            raise self.fail(f"your function raised {learner_traceback(exc)}") from None
        if time.monotonic() > self.deadline:  # where no alarm can interrupt (not the main thread, Windows)
            raise self.timeout()
        for name, a, before in copies:
            if a.shape != before.shape or not np.array_equal(a, before, equal_nan=True):
                raise self.fail(f"your function changed its input ({name}, shape {before.shape}) in place. "
                                "Work on new arrays (e.g. x - m instead of x -= m) and leave the inputs as they were.")
        return out

    def timeout(self) -> Failed:
        return self.fail(f"ran past the time limit of {self.exercise.time_limit:g} s for this exercise "
                         "(an endless loop, or far more work than needed?)")

    # -- comparing --------------------------------------------------------------------------------
    def array(self, out, shape, dtype=None, name="the output", min_dtype=None) -> np.ndarray:
        """`out` as an ndarray of the right shape and dtype, else fail saying what is wrong.

        These failures carry a hint about the failure itself, never the hint of the case that was running.
        """
        if not isinstance(out, (np.ndarray, np.generic)):
            raise self.fail(f"{name} should be a NumPy array; got {type(out).__name__}",
                            hint="return NumPy arrays (np.asarray turns a list into one)")
        out = np.asarray(out)
        if out.shape != tuple(shape):
            raise self.fail(f"{name} has shape {out.shape}; expected {tuple(shape)}", hint=shape_hint(out.shape, shape))
        if dtype is not None and out.dtype != np.dtype(dtype):
            raise self.fail(f"{name} has dtype {out.dtype}; expected {np.dtype(dtype)} (the input's dtype)",
                            hint=dtype_hint(out.dtype, np.dtype(dtype)))
        if min_dtype is not None and not (out.dtype.kind == "f" and out.dtype.itemsize >= np.dtype(min_dtype).itemsize):
            raise self.fail(f"{name} has dtype {out.dtype}; expected a float dtype at least as precise as "
                            f"{np.dtype(min_dtype)}", hint=dtype_hint(out.dtype, np.dtype(min_dtype)))
        return out

    def compare(self, out, ref, name="the output", dtype=None, min_dtype=None, tol=None, explain=None,
                floor=0.0) -> float:
        """Check `out` against the float64 `ref`; returns the relative error.

        dtype: the dtype `out` must have (the input's); min_dtype: or any float dtype at least this precise.
        Entries where ref is +-inf must match exactly. explain(out) -> (details, hint) adds a diagnosis.
        floor: the error is ||out - ref|| / max(||ref||, floor). Where the answer can be near zero (a sum of
        terms that cancel), a right answer is rounding noise of the size of the terms, and so is the reference:
        the floor is that size (see `noise_floor`), so that noise is never judged relative to noise.
        """
        ref = np.asarray(ref, dtype=np.float64)
        out = self.array(out, ref.shape, dtype, name, min_dtype)
        o64 = out.astype(np.float64)
        finite = np.isfinite(ref)
        if np.isnan(o64).any():
            details, hint = self._explained(explain, out)
            if not hint and not (self.current and self.current.hint):  # a case about NaN hints better than NAN_HINT
                hint = NAN_HINT
            raise self.fail(f"{name} contains NaN ({int(np.isnan(o64).sum())} of {o64.size} entries)", details=details,
                            **({"hint": hint} if hint else {}))
        if not np.array_equal(o64[~finite], ref[~finite]):
            raise self.fail(f"{name} should be {ref[~finite][0]} where the answer is infinite (e.g. an empty row's max)")
        if np.isinf(o64[finite]).any():
            raise self.fail(f"{name} contains inf where the answer is finite (an overflow?)")
        tol = tol if tol is not None else tolerance(dtype or min_dtype or out.dtype)
        diff = float(np.linalg.norm(o64[finite] - ref[finite]))
        err = diff / max(float(np.linalg.norm(ref[finite])), floor) if diff else 0.0
        if err > tol:
            details, hint = self._explained(explain, out)
            raise self.fail(f"{name} is wrong", error=err, tol=tol, details=details,
                            **({"hint": hint} if hint else {}))
        return err

    def _explained(self, explain, out):
        if explain is None:
            return [], None
        details, hint = explain(out)
        return list(details), hint

    def which_slip(self, cases, slips, failing, out):
        """The diagnosis of the usual slip that best explains a wrong answer, or None.

        cases: argument tuples of every case; slips(*args) -> [(wrong answer, diagnosis), ...]; the
        learner's function returned `out` on cases[failing]. Of the slips that give `out` there, the one
        agreeing with the learner's function on the most other cases wins (several slips can coincide on
        one case).
        """
        matching = [i for i, (value, _) in enumerate(slips(*cases[failing])) if value == out]
        if len(matching) > 1:
            score = dict.fromkeys(matching, 0)
            for args in cases[:failing] + cases[failing + 1:]:
                try:
                    got = self.call(*[a.copy() if isinstance(a, np.ndarray) else a for a in args])
                except (Failed, NotImplementedYet):
                    continue
                for i in matching:
                    score[i] += bool(np.all(slips(*args)[i][0] == got))
            matching.sort(key=lambda i: -score[i])
        return slips(*cases[failing])[matching[0]][1] if matching else None

    def scalar(self, out, ref, name="the result", tol=1e-10, slips=()) -> float:
        """A real number within relative `tol` of `ref`.

        slips: (value, why) pairs, the answers of usual mistakes; a wrong answer equal to one of them gets
        its `why` as the hint.
        """
        if isinstance(out, (bool, np.bool_)) or not isinstance(out, (int, float, np.integer, np.floating)):
            raise self.fail(f"{name} should be a number; got {type(out).__name__} {out!r:.60}")
        if not np.isfinite(float(out)):
            raise self.fail(f"{name} is {out}; expected a finite number")
        err = abs(float(out) - ref) / max(abs(ref), 1e-300)
        if err > tol:
            why = [w for v, w in slips if abs(float(out) - v) <= tol * max(abs(v), 1e-300)]
            raise self.fail(f"{name} is {float(out):.6g}; expected {ref:.6g}", error=err, tol=tol,
                            **({"hint": why[0]} if why else {}))
        return err


NAN_HINT = ("NaN comes from inf - inf, 0 * inf or 0 / 0: a row whose scores are all -inf (masked), or exp() of "
            "a large number that overflowed before a subtraction.")


def fail_on_slip(t: "Checker", got, answers, slips):
    """Fail with the diagnosis of the first (keywords, why) slip whose answers(**keywords) are the learner's on
    every case; return when none is. `answers` replays the checker's own model with a slip switched on."""
    for slip, why in slips:
        if got == answers(**slip):
            raise t.fail(why)


def int_answers(t: "Checker", cases, what="a byte offset") -> list:
    """The learner's answer for each argument tuple of `cases`, each checked to be an int (as a Python int)."""
    got = []
    for args in cases:
        out = t.call(*args)
        if isinstance(out, bool) or not isinstance(out, (int, np.integer)):
            raise t.fail(f"return {what} as an int; for arguments {tuple(args)} you returned {out!r:.60}")
        got.append(int(out))
    return got


def judge_answers(t: "Checker", got, model, slips, mismatch):
    """Exact answers: return when got == model() (a list, one answer per case); else fail with the diagnosis of
    the first slip that model(**keywords) replays, or with mismatch(i, want) for the first wrong case i."""
    want = model()
    if got == want:
        return
    fail_on_slip(t, got, model, slips)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    raise t.fail(mismatch(i, want[i]))


def noise_floor(magnitude, dtype, tol, terms=1) -> float:
    """The `floor` for `Checker.compare` of an output whose rounding noise is about eps * ||magnitude||.

    magnitude: the same computation with every factor replaced by its absolute value (so no cancellation);
    dtype: the input dtype (float16 inputs are computed in float32); terms: how many roundings pile up.
    A right answer's noise then stays within tol of the floor, with a margin of 8.
    """
    eps = float(np.finfo(np.promote_types(dtype, np.float32)).eps)
    return 8 * eps * math.sqrt(terms) * float(np.linalg.norm(magnitude)) / tol


def shape_hint(got, want) -> str:
    got, want = tuple(got), tuple(want)
    if got == want[::-1] and len(want) == 2:
        return "the shape is transposed: check which operand of each product is transposed"
    if len(got) > len(want):
        return "an extra axis: a sum or max that should have removed an axis kept it (keepdims?), or broadcasting " \
               "made a matrix out of two vectors"
    if len(got) < len(want):
        return "an axis is missing: a sum or max ran over the whole array, or over the wrong axis"
    return "check which axis each sum, max or product runs over, and the shapes of the inputs you combine"


def dtype_hint(got, want) -> str:
    got, want = np.dtype(got), np.dtype(want)
    if got == np.float64 and want in (np.dtype(np.float32), np.dtype(np.float16)):
        return ("your result was promoted to float64. In NumPy 2, math on a float32 array with a NumPy float64 "
                "scalar gives float64: `Q @ K.T / np.sqrt(d)` is float64, because np.sqrt(d) is an np.float64. "
                "Use math.sqrt(d) (a Python float keeps float32), or cast the result: out.astype(Q.dtype).")
    if want == np.float16 and got == np.float32:
        return "compute in float32, then cast the result back to the input's dtype: out.astype(np.float16)"
    if got.kind != "f":
        return "return floating-point numbers (an integer array loses every fraction)"
    return f"cast the result to {want}: out.astype(...)"


class _time_limit:
    """Raise _TimeUp in the main thread after `seconds` (SIGALRM where the OS has it)."""

    def __init__(self, seconds):
        self.seconds = max(seconds, 1e-3)
        self.armed = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def __enter__(self):
        if self.armed:
            self.old = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def _ring(self, signum, frame):
        raise _TimeUp()

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False


_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY = tuple(os.path.dirname(os.path.abspath(p)) for p in (os.__file__, np.__file__, _HERE + "/.."))


def learner_traceback(exc: BaseException) -> str:
    """`ValueError: ...` plus the learner's own lines where it happened, without the grader's frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not os.path.abspath(f.filename).startswith(_HERE)]
    own = [f for f in frames if not _is_library(f.filename)]
    text = f"{type(exc).__name__}: {exc}"
    for f in (own or frames[-1:])[-3:]:
        where = f"in {f.name}" if f.name != "<module>" else "at top level"
        text += f"\n  {where}, line {f.lineno}: {(f.line or '').strip()}"
    return text


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return "site-packages" in path or "dist-packages" in path or path.startswith(_LIBRARY)


# ------------------------------------------------------------------------------------------------

def check(name: str, fn, *, seed: int = None, quiet: bool = False) -> Result:
    """Run exercise `name`'s checks on `fn` with fresh random inputs; show and return the verdict.

    seed: repeat a run exactly (the verdict of a failed check prints its seed). quiet: do not show it.
    """
    if name not in EXERCISES:
        import difflib

        close = difflib.get_close_matches(str(name), EXERCISES, n=3)
        raise ValueError(f"no exercise named {name!r}" + (f"; did you mean {' or '.join(close)}?" if close else
                                                              f"; known: {', '.join(sorted(EXERCISES))}"))
    ex = EXERCISES[name]
    seed = int(np.random.SeedSequence().entropy % 2**31) if seed is None else int(seed)
    t = Checker(ex, fn, seed)
    start = time.monotonic()
    result = Result(name, "passed", seed=seed)
    try:
        if not callable(fn):
            raise Failed(f"expected your function as the second argument; got {type(fn).__name__}")
        ex.run(t, fn)
        result.cases_passed = len(t.cases)
    except NotImplementedYet:
        result = Result(name, "not implemented",
                        "the function still raises NotImplementedError: replace the `raise NotImplementedError()` "
                        "under `# YOUR CODE HERE` with your code.")
    except Failed as f:
        result = Result(name, "failed", f.message, str(t.current) if t.current else None, f.error, f.tol,
                        f.hint or ex.hint, f.details, max(len(t.cases) - 1, 0), seed=seed)
    except Exception as exc:  # the checker could not digest the output: still a verdict, never a crash
        result = Result(name, "failed", f"could not check your function's output ({type(exc).__name__}: {exc}); "
                        "compare what it returns with its docstring", str(t.current) if t.current else None,
                        hint=ex.hint, cases_passed=max(len(t.cases) - 1, 0), seed=seed)
    result.seconds = time.monotonic() - start
    name_of_fn = getattr(fn, "__name__", "")
    result.function = name_of_fn if name_of_fn.isidentifier() else "your_function"
    if not quiet:
        show(result)
    return result
