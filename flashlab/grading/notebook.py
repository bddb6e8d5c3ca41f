"""Run an exercise notebook's code without Jupyter: `python -m flashlab.grading.notebook NOTEBOOK`.

The command-line grader starts one such process per notebook (isolation, and a time limit it can
enforce by killing the process). Code cells run top to bottom in one namespace, like a kernel's; IPython
magics (`%pip ...`, `!ls`, `%%time` cells) are skipped, and so is the generated setup cell. A cell that
raises is reported and the next cells still run, so one broken exercise does not hide the others. Every
`flashlab.check(...)` the notebook makes records its verdict (see core.RESULTS_ENV); cell errors are
recorded in the same JSON-lines file.
"""
from __future__ import annotations

import json
import linecache
import os
import re
import sys

CHECK_CALL = re.compile(r"""flashlab\.check\(\s*["'](\w+)["']""")


def strip_magics(src: str) -> str:
    """The cell with IPython magics removed (a magic line becomes `pass`, keeping blocks valid)."""
    if src.lstrip().startswith("%%"):
        return ""
    lines = []
    for line in src.splitlines():
        stripped = line.lstrip()
        lines.append(line[: len(line) - len(stripped)] + "pass" if stripped.startswith(("%", "!")) else line)
    return "\n".join(lines)


def code_cells(path) -> list:
    """[(index, source)] of the notebook's code cells to run: magics stripped, generated setup cell left out."""
    from ..build import setup_code

    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    cells = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        if src.strip() != setup_code().strip():
            cells.append((i, strip_magics(src)))
    return cells


def exercises_in(path) -> list:
    """Names of the exercises a notebook checks, in order of appearance."""
    names = []
    for _, src in code_cells(path):
        names += [n for n in CHECK_CALL.findall(src) if n not in names]
    return names


def run(path) -> None:
    from .core import RESULTS_ENV, learner_traceback

    namespace = {"__name__": "__main__"}
    for index, src in code_cells(path):
        filename = f"<cell {index}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # tracebacks show the line
        try:
            exec(compile(src, filename, "exec"), namespace)
        except BaseException as exc:  # noqa: B902 - a learner's SystemExit must not stop the other cells
            if isinstance(exc, KeyboardInterrupt):
                raise
            if os.environ.get(RESULTS_ENV):
                with open(os.environ[RESULTS_ENV], "a") as f:
                    f.write(json.dumps({"cell": index, "error": learner_traceback(exc)}) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")  # plots must never open windows
    run(sys.argv[1])
