"""Every notebook (lessons, exercises, solutions) runs top to bottom in a fresh kernel, in the fast mode.

Notebooks run two at a time (a thread pool of nbclient runs; the CI machine has 2 cores), or one at a time
beside the other tests under pytest-xdist, with FLASHLAB_FAST=1 on the CPU. Each must finish in under a minute. Lessons and solutions must not raise;
exercise notebooks may raise only NotImplementedError (their blanks), and their checks must say "not
implemented". Notebooks are stored without outputs, and the generated ones match their sources.
"""
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from flashlab.build import stale

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("notebooks", "exercises", "solutions")
NOTEBOOKS = [p for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.ipynb"))]
LIMIT_S = 60
# Under pytest-xdist (`make test`: one pytest worker per core, --dist loadfile) this file runs on one worker, one
# notebook at a time, so each still has a core to itself; run alone, two at a time.
WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def _id(path):
    return f"{path.parent.name}/{path.name}"


def test_generated_notebooks_are_up_to_date():
    bad = [str(p.relative_to(ROOT)) for p in stale()]
    assert not bad, f"out of date: {bad}; run `python -m flashlab build`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{_id(path)}: cells {dirty} have outputs; clear them (or regenerate with `python -m flashlab build`)"


def _execute(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=LIMIT_S, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.monotonic()
    try:
        client.execute(stderr=subprocess.DEVNULL)  # kernels' start-up warnings and shutdown noise
    except Exception as exc:  # a cell past the time limit, a dead kernel
        return nb, time.monotonic() - start, f"{type(exc).__name__}: {str(exc)[:500]}"
    return nb, time.monotonic() - start, None


@pytest.fixture(scope="module")
def executed():
    old = os.environ.get("FLASHLAB_FAST")
    os.environ["FLASHLAB_FAST"] = "1"
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            runs = dict(zip(NOTEBOOKS, pool.map(_execute, NOTEBOOKS)))
    finally:
        if old is None:
            del os.environ["FLASHLAB_FAST"]
        else:
            os.environ["FLASHLAB_FAST"] = old
    print("\nnotebook execution times (FLASHLAB_FAST=1):")
    for path, (_, seconds, _) in runs.items():
        print(f"  {_id(path):40s} {seconds:5.1f} s")
    return runs


def _text(output):
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return f"{output.ename}: {output.evalue}"
    return output.get("data", {}).get("text/plain", "")


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_runs(path, executed):
    nb, seconds, crash = executed[path]
    assert crash is None, f"{_id(path)}: {crash}"
    assert seconds < LIMIT_S, f"{_id(path)} took {seconds:.0f} s in the fast mode (limit {LIMIT_S} s)"
    blank = path.parent.name == "exercises"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        allowed = blank and all(o.ename == "NotImplementedError" for o in errors)
        assert not errors or allowed, f"{_id(path)}, cell {i}:\n{cell.source}\n-> {_text(errors[0])}"
        if "flashlab.check(" in cell.source and path.parent.name != "notebooks":
            verdicts = [_text(o) for o in cell.outputs if o.output_type == "display_data"]
            assert len(verdicts) == 1, f"{_id(path)}, cell {i}: expected one verdict, got {cell.outputs}"
            want = "not implemented" if blank else "passed"
            assert want in verdicts[0], f"{_id(path)}, cell {i}: {verdicts[0]}"
