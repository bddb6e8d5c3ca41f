"""flashlab.check and `python -m flashlab grade`: verdicts, messages, time limits, the command line."""
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

import flashlab
from flashlab.grading import EXERCISES, check, exercise
from flashlab.grading.notebook import strip_magics

ROOT = Path(__file__).resolve().parents[2]


def good_softmax(x):
    w = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    e = np.exp(w - w.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def test_check_is_reachable_from_the_package():
    assert flashlab.check is check
    assert check("safe_softmax", good_softmax, quiet=True).passed


def test_passing_verdict_is_printed_outside_jupyter(capsys):
    result = check("safe_softmax", good_softmax)
    out = capsys.readouterr().out
    assert "safe_softmax: passed" in out and result.cases_passed > 5
    assert "passed" in result._repr_html_() and json.dumps(result.to_dict())


def test_not_implemented_is_a_verdict_not_a_crash():
    def blank(x):
        # YOUR CODE HERE
        raise NotImplementedError()

    result = check("safe_softmax", blank, quiet=True)
    assert result.status == "not implemented" and "NotImplementedError" in result.message


@pytest.mark.parametrize("wrong, words", [
    (lambda x: good_softmax(x)[..., :-1], "has shape"),
    (lambda x: good_softmax(x).astype(np.float64), "dtype"),
    (lambda x: good_softmax(x) * np.nan, "contains NaN"),
    (lambda x: good_softmax(x).tolist(), "should be a NumPy array"),
    (lambda x: good_softmax(x) * 1.01, "is wrong"),
])
def test_wrong_outputs_are_named(wrong, words):
    result = check("safe_softmax", wrong, quiet=True)
    assert result.status == "failed" and words in result.message, str(result)
    assert result.case and result.hint and result.seed is not None


def test_wrong_answer_reports_error_against_tolerance_and_can_be_repeated_with_its_seed():
    def off(x):
        return (good_softmax(x) * 1.001).astype(x.dtype)

    first = check("safe_softmax", off, quiet=True)
    assert first.error > first.tolerance == 1e-10
    assert "relative error" in str(first) and f"seed={first.seed}" in str(first)
    again = check("safe_softmax", off, seed=first.seed, quiet=True)
    assert (again.case, again.error) == (first.case, first.error)


def test_mutating_an_input_is_reported():
    def in_place(x):
        x -= x.max(axis=-1, keepdims=True)
        return good_softmax(x)

    result = check("safe_softmax", in_place, quiet=True)
    assert "changed its input" in result.message


def test_learner_exception_shows_the_learners_line_not_the_grader():
    def broken(x):
        scores = x.astype(np.float64)
        return scores @ np.ones(3)  # a shape error inside the learner's code

    result = check("safe_softmax", broken, quiet=True)
    assert result.status == "failed"
    assert "ValueError" in result.message and "return scores @ np.ones(3)" in result.message
    assert "in broken" in result.message and "grading" not in result.message


def test_time_limit_stops_an_endless_loop():
    @exercise("_endless", hint="-", lesson="-", time_limit=0.3)
    def _(t, fn):
        t.case("forever")
        t.call()

    def spin():
        while True:
            pass

    try:
        start = time.monotonic()
        result = check("_endless", spin, quiet=True)
        assert time.monotonic() - start < 5
        assert result.status == "failed" and "time limit of 0.3 s" in result.message
    finally:
        del EXERCISES["_endless"]


def test_a_new_exercise_is_one_registered_checker():
    @exercise("_double", hint="twice", lesson="-")
    def _(t, fn):
        for n in (3, 4):
            x = t.normal((n,))
            t.case("vector", n=n)
            t.compare(t.call(x), 2 * x, dtype=x.dtype)

    try:
        assert check("_double", lambda x: 2 * x, quiet=True).passed
        wrong = check("_double", lambda x: x + x + 1, quiet=True)
        assert wrong.status == "failed" and wrong.hint == "twice" and "vector" in wrong.case
    finally:
        del EXERCISES["_double"]


def test_unknown_exercise_and_non_function():
    with pytest.raises(ValueError, match="did you mean safe_softmax"):
        check("safe_sotfmax", good_softmax)
    assert "expected your function" in check("safe_softmax", "not a function", quiet=True).message


def test_tiled_diagnosis_names_block_and_quantity():
    def drops_tail(Q, K, V, block_q, block_k):  # FA1 that forgets the last partial key block
        n = K.shape[0] // block_k * block_k
        return flashlab.flash_attention_v1(Q, K[:n] if n else K, V[:n] if n else V, block_q=block_q, block_k=block_k)

    result = check("fa1_forward", drops_tail, seed=0, quiet=True)
    text = "\n".join(result.details)
    assert "first query block with wrong rows" in text and "partial block" in text, str(result)

    def lse_is_m(Q, K, V, block_q, block_k):
        O, lse = flashlab.flash_attention_v1(Q, K, V, block_q=block_q, block_k=block_k)
        S = Q.astype(np.float64) @ K.T.astype(np.float64) / np.sqrt(Q.shape[1])
        return O, S.max(axis=-1)

    result = check("fa1_forward", lse_is_m, seed=0, quiet=True)
    assert "O is right but lse is not" in result.details[0] and "row max m alone" in result.hint


def test_strip_magics_keeps_blocks_valid():
    src = "import sys\nif False:\n    %pip install x\n!ls\nx = 1"
    code = strip_magics(src)
    compile(code, "cell", "exec")
    assert "%" not in code and "!" not in code and strip_magics("%%time\nx = 1") == ""


def _grade(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "flashlab", "grade", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_cli_solutions_pass_and_blank_exercises_are_not_implemented(tmp_path):
    ok = _grade(ROOT / "solutions", "--json", tmp_path / "s.json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["passed"] == data["total"] >= 15

    blank = _grade(ROOT / "exercises")
    assert blank.returncode == 1
    assert blank.stdout.count("not implemented") >= 15 and "progress: 0/" in blank.stdout


def _notebook(path, *cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_cli_grades_a_folder_of_submissions(tmp_path):
    good = "def delta(O, dO):\n    return (O * dO).sum(-1)"
    _notebook(tmp_path / "ada" / "06_backward.ipynb", "%matplotlib inline\nimport flashlab", good,
              "flashlab.check('delta', delta)")
    _notebook(tmp_path / "bob" / "06_backward.ipynb", "import flashlab",
              "def delta(O, dO):\n    return (O * dO).sum(0)", "flashlab.check('delta', delta)")
    _notebook(tmp_path / "cy" / "06_backward.ipynb", "import flashlab", "def delta(O, dO) return 1",
              "flashlab.check('delta', delta)")
    _notebook(tmp_path / "dee" / "06_backward.ipynb", "import flashlab\nwhile True: pass",
              "flashlab.check('delta', delta)")
    res = _grade(tmp_path, "--timeout", "4", "--json", tmp_path / "out.json")
    assert res.returncode == 1
    rows = {Path(r["notebook"]).parent.name: r for r in json.loads((tmp_path / "out.json").read_text())["exercises"]}
    assert rows["ada"]["status"] == "passed"
    assert rows["bob"]["status"] == "failed" and "has shape" in rows["bob"]["why"]
    assert rows["cy"]["status"] == "failed" and "SyntaxError" in rows["cy"]["why"]
    assert rows["dee"]["status"] == "failed" and "time limit" in rows["dee"]["why"]
    assert "progress: 1/4" in res.stdout


def test_cli_reports_a_missing_path():
    res = _grade("no/such/folder")
    assert res.returncode == 2 and "no/such/folder" in res.stderr


def test_one_grading_module_per_lesson_named_like_the_lesson():
    """flashlab/grading holds the machinery plus one module per lesson, l<lesson stem>.py, and every
    exercise registered there names that module's lesson."""
    import pkgutil

    import flashlab.grading as grading

    lessons = {p.stem for p in (ROOT / "course" / "lessons").glob("[0-9][0-9]_*.py")}
    machinery = {"core", "attention", "cli", "notebook", "simcheck"}
    modules = {m.name for m in pkgutil.iter_modules(grading.__path__)} - machinery
    assert modules, "no lesson modules found"
    for name in modules:
        assert name.startswith("l") and name[1:] in lessons, f"grading/{name}.py is not named l<lesson stem>"
    for ex in EXERCISES.values():
        module = ex.run.__module__.rsplit(".", 1)[-1]
        assert module == "l" + ex.lesson, f"exercise {ex.name} (lesson {ex.lesson}) lives in {module}.py"


def test_quick_solutions_pass_on_many_seeds():
    """A checker's random inputs must never fail a right answer: every exercise whose check is quick runs its
    solution on 60 seeds (a degenerate draw, e.g. all signs +1, once made a solution fail 1 run in 16)."""
    import time

    from conftest import load_exercise
    from flashlab.grading import EXERCISES, check

    quick = 0
    for name, ex in EXERCISES.items():
        fn = load_exercise(ex.lesson).get(name)
        if fn is None:
            continue
        start = time.perf_counter()
        first = check(name, fn, seed=0, quiet=True)
        assert first.passed, str(first)
        if time.perf_counter() - start > 0.02:
            continue  # simulator-backed checks: covered by their own tests
        quick += 1
        for seed in range(1, 60):
            r = check(name, fn, seed=seed, quiet=True)
            assert r.passed, str(r)
    assert quick >= 20, f"only {quick} quick exercises found"
