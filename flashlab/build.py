"""Generate the course's notebooks from their one source.

    course/lessons/NN_name.py    ->  notebooks/NN_name.ipynb
    course/exercises/NN_name.py  ->  exercises/NN_name.ipynb (blanks) and solutions/NN_name.ipynb

Sources are plain Python in the "percent" format: `# %%` starts a code cell, `# %% [markdown]` a markdown
cell whose lines start with `# `. In exercise sources, code between `### BEGIN SOLUTION` and
`### END SOLUTION` is the answer: the solution keeps it (without the markers), the exercise replaces it
with `# YOUR CODE HERE` and `raise NotImplementedError()` at the same indentation.

Every notebook gets a generated first cell: an "Open in Colab" badge, and a setup cell that installs
flashlab (pinned to REF, no dependencies, so Colab's own numpy, numba and torch stay) when run in Colab, then
prints flashlab.doctor(). When that install fails (the address cannot be reached, or the tag does not exist
yet), the cell stops with what to do instead: open the published copy, or upload the course as a zip, which
it installs from first. The repository address and the release live here (REPO, REF) and nowhere else.

Run `python -m flashlab build` after editing anything under course/; `--check` fails if the generated
notebooks are out of date (a test runs it). `python -m flashlab build --release OWNER/NAME@TAG` sets REPO and
REF in this file and regenerates every badge and setup cell from them (before publishing a release).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = "flashlab-course/flashlab"  # GitHub owner/name: the one place the course's address is written
REF = "v0.1.0"  # the tag Colab installs

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def colab_badge(rel_path: str) -> str:
    url = f"https://colab.research.google.com/github/{REPO}/blob/{REF}/{rel_path}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def published_source(repo: str | None = None, ref: str | None = None) -> str:
    """What pip installs flashlab from in Colab: the course's repository at its release tag."""
    return f"git+https://github.com/{repo or REPO}@{ref or REF}"


def setup_code(source: str | None = None) -> str:
    """The setup cell. Plain Python (no magics), so it runs, and is tested, outside a notebook too.

    In Colab it installs flashlab without dependencies from an uploaded copy of the course when there is one
    (a zip of the repository or a wheel, named flashlab*), else from `source` (the published release). If pip
    fails, the cell raises one short error that says what to do; pip's own output stays out of sight."""
    source = source or published_source()
    home = f"https://github.com/{REPO}"
    return f"""\
# Setup. In Colab: install flashlab ({REF}; --no-deps keeps Colab's numpy, numba and torch). Elsewhere: nothing to do.
import sys
if "google.colab" in sys.modules:
    import glob, subprocess
    uploaded = sorted(glob.glob("flashlab*.zip") + glob.glob("flashlab*.whl"))  # a copy of the course you uploaded
    source = uploaded[-1] if uploaded else "{source}"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", source],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        last = (pip.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(
            f"flashlab could not be installed from {{source}} (pip: {{last}}). To go on, either open this "
            "notebook from the course's published copy, "
            "{home} (release {REF}), or upload the course: "
            "download the repository as a zip, upload the zip (its name starting with 'flashlab') in Colab's "
            "Files pane, the folder icon on the left, and run this cell again.") from None
import flashlab
flashlab.doctor();"""


def set_release(repo: str, ref: str, path: Path | None = None) -> None:
    """Write REPO and REF into this file (the one place they are set) and into this module."""
    global REPO, REF
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+", repo):
        raise ValueError(f"the repository must be GitHub's OWNER/NAME, e.g. flashlab-course/flashlab; got {repo!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_./-]*", ref):
        raise ValueError(f"the release must be a git tag or branch name, e.g. v0.1.0; got {ref!r}")
    path = path or Path(__file__)
    text = path.read_text()
    for name, value in (("REPO", repo), ("REF", ref)):
        text, n = re.subn(rf'^{name} = "[^"]*"', f'{name} = "{value}"', text, flags=re.M)
        if n != 1:
            raise RuntimeError(f"{path}: expected one line `{name} = \"...\"`, found {n}")
    path.write_text(text)
    REPO, REF = repo, ref


def parse_cells(text: str):
    """Split a percent-format source into [(kind, source)] with kind 'code' or 'markdown'."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            src = "\n".join(lines).strip("\n")
            if src:
                cells.append((kind, src))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        elif kind == "code":
            lines.append(line)
    flush()
    return cells


def strip_solutions(src: str, keep: bool) -> str:
    """Keep the solution (markers removed) or replace it with a blank that raises NotImplementedError."""
    out, inside = [], False
    for line in src.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError("nested ### BEGIN SOLUTION")
            inside = True
            if not keep:
                indent = line[: len(line) - len(line.lstrip())]
                out += [indent + "# YOUR CODE HERE", indent + "raise NotImplementedError()"]
        elif stripped == END:
            if not inside:
                raise ValueError("### END SOLUTION without BEGIN")
            inside = False
        elif keep or not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without END")
    return "\n".join(out)


def make_notebook(cells, rel_path: str) -> dict:
    def cell(kind, src):
        c = {"cell_type": kind, "metadata": {}, "source": src}
        if kind == "code":
            c.update(execution_count=None, outputs=[])
        return c

    body = [cell("markdown", colab_badge(rel_path)), cell("code", setup_code())] + [cell(k, s) for k, s in cells]
    return {
        "cells": body,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _dump(nb: dict) -> str:
    # Ids are derived from position so regenerating an unchanged source gives identical bytes.
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"cell-{i:03d}"
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def targets(root: Path = ROOT) -> dict:
    """{output path: notebook text} for every source under course/."""
    out = {}
    for src in sorted((root / "course" / "lessons").glob("*.py")):
        rel = f"notebooks/{src.stem}.ipynb"
        out[root / rel] = _dump(make_notebook(parse_cells(src.read_text()), rel))
    for src in sorted((root / "course" / "exercises").glob("*.py")):
        cells = parse_cells(src.read_text())
        for folder, keep in (("exercises", False), ("solutions", True)):
            rel = f"{folder}/{src.stem}.ipynb"
            done = [(k, strip_solutions(s, keep) if k == "code" else s) for k, s in cells]
            out[root / rel] = _dump(make_notebook(done, rel))
    return out


def stale(root: Path = ROOT) -> list:
    """Generated notebooks that differ from their source, or that no source generates any more."""
    want = targets(root)
    bad = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    for folder in ("notebooks", "exercises", "solutions"):
        bad += [p for p in sorted((root / folder).glob("*.ipynb")) if p not in want]
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--release" in argv:
        i = argv.index("--release")
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if value.count("@") != 1:
            print(f"--release takes OWNER/NAME@TAG, e.g. flashlab-course/flashlab@v0.1.0; got {value!r}",
                  file=sys.stderr)
            return 2
        try:
            set_release(*value.split("@"))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"badges and setup cells now point at github.com/{REPO}, release {REF}")
        argv = argv[:i] + argv[i + 2:]
    if "--check" in argv:
        bad = stale()
        for p in bad:
            print(f"out of date: {p.relative_to(ROOT)}")
        if bad:
            print("Run `python -m flashlab build` to regenerate the notebooks from course/.")
        return 1 if bad else 0
    want = targets()
    for folder in ("notebooks", "exercises", "solutions"):
        for p in (ROOT / folder).glob("*.ipynb"):
            if p not in want:
                p.unlink()
    for p, text in want.items():
        p.parent.mkdir(exist_ok=True)
        if not p.exists() or p.read_text() != text:
            p.write_text(text)
            print(f"wrote {p.relative_to(ROOT)}")
    return 0

