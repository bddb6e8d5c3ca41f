"""Every relative link in the course resolves from the folder JupyterLab serves.

`make lab` (and the README's conda command) start JupyterLab at the repository root, so a lesson's link
`../exercises/04_tiling_fa1.ipynb` opens the exercise. These tests check that the documented commands
serve that root, then follow every relative link (markdown links and images, reference definitions,
HTML href/src) in the markdown cells of notebooks/, exercises/, solutions/, in README.md and docs/**/*.md. Anchors
(#...) must name a heading of the target. External links are not fetched, except that an "Open in Colab"
badge must point at a notebook that exists in this repository.
"""
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from flashlab.build import REF, REPO

ROOT = Path(__file__).resolve().parent.parent
DOCS = [p for folder in ("notebooks", "exercises", "solutions") for p in sorted((ROOT / folder).glob("*.ipynb"))]
DOCS += [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COLAB = f"https://colab.research.google.com/github/{REPO}/blob/{REF}/"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")  # [text](target "title")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)  # [name]: target
HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ID = re.compile(r"""<a\s[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)


def markdown_of(path: Path) -> str:
    """The markdown text of a notebook's markdown cells (or of a .md file)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def links_in(markdown: str) -> list:
    """Link targets in markdown, ignoring code blocks and code spans (`kernel[b, t](x)` is no link)."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return [m.group(1) for pattern in (INLINE, REFDEF, HTML) for m in pattern.finditer(text)]


def anchors_of(path: Path) -> set:
    """Heading anchors as JupyterLab (spaces to '-') and GitHub (lower case, no punctuation) make them."""
    text = FENCE.sub("", markdown_of(path))
    out = set(HTML_ID.findall(text))
    for title in HEADING.findall(text):
        out.add(title.replace(" ", "-"))
        out.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return out


def problems(path: Path, root: Path = ROOT) -> list:
    """'<file>: <link> -> <what is wrong>' for each link of `path` that does not resolve under `root`."""
    bad, root = [], root.resolve()
    for link in links_in(markdown_of(path)):
        if link.startswith(COLAB):  # the badge: the notebook it opens must exist here
            target, anchor = root / link[len(COLAB):], ""
        elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):  # http(s), mailto, data: not fetched
            continue
        elif link.startswith("/"):
            bad.append(f"{path.relative_to(root)}: {link} -> an absolute path; use a link relative to the file")
            continue
        else:
            rel, _, anchor = link.partition("#")
            target = (path.parent / unquote(rel)).resolve() if rel else path
        try:
            shown = target.resolve().relative_to(root)
        except ValueError:
            bad.append(f"{path.relative_to(root)}: {link} -> {target.resolve()} is outside the served root {root}")
            continue
        if not target.exists():
            bad.append(f"{path.relative_to(root)}: {link} -> missing {shown}")
        elif anchor and target.suffix in (".ipynb", ".md") and unquote(anchor) not in anchors_of(target):
            bad.append(f"{path.relative_to(root)}: {link} -> {shown} has no heading with anchor #{anchor}")
    return bad


# --- the served root ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def make_lab_args(tmp_path_factory):
    """The arguments `make lab` passes to jupyter, run with a stand-in jupyter that prints them."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path_factory.mktemp("venv")
    (venv / "bin").mkdir()
    fake = venv / "bin" / "jupyter"
    fake.write_text('#!/bin/sh\npwd\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    (venv / ".flashlab-installed").touch()  # newer than pyproject.toml: make skips the install
    run = subprocess.run(["make", "-s", "lab", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    cwd, *args = run.stdout.splitlines()
    return Path(cwd), args


def served_root(cwd: Path, args: list) -> Path:
    """The folder `jupyter lab ARGS` serves, as jupyter_server decides it: a folder given as argument wins,
    then --ServerApp.root_dir, then the folder of a notebook given as argument, then the working folder."""
    given = [cwd / a for a in args if not a.startswith("-") and a != "lab"]
    flags = [a.split("=", 1)[1] for a in args if a.startswith(("--ServerApp.root_dir=", "--notebook-dir="))]
    if any(p.is_dir() for p in given):
        return [p for p in given if p.is_dir()][0].resolve()
    if flags:
        return (cwd / flags[-1]).resolve()
    return given[0].resolve().parent if given else cwd.resolve()


def test_make_lab_serves_the_repository_root_and_opens_lesson_00(make_lab_args):
    cwd, args = make_lab_args
    assert args[0] == "lab"
    assert served_root(cwd, args) == ROOT, f"make lab serves {served_root(cwd, args)}, not the repository root"
    files = [a for a in args[1:] if not a.startswith("-")]
    assert files == ["notebooks/00_setup.ipynb"] and (cwd / files[0]).is_file()


def test_served_root_follows_jupyter():
    assert served_root(ROOT, ["lab", "notebooks/"]) == ROOT / "notebooks"  # the old `make lab`: a 404 on ../exercises
    assert served_root(ROOT, ["lab", "notebooks/00_setup.ipynb"]) == ROOT / "notebooks"
    assert served_root(ROOT, ["lab", "--ServerApp.root_dir=.", "notebooks/00_setup.ipynb"]) == ROOT
    assert served_root(ROOT / "notebooks", ["lab"]) == ROOT / "notebooks"


def test_make_lab_passes_allow_root_only_as_root(make_lab_args):
    import os

    _, args = make_lab_args
    assert ("--allow-root" in args) == (os.geteuid() == 0)  # jupyter refuses root without it


def test_readme_conda_command_serves_the_repository_root():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("jupyter lab")]
    assert lines, "README.md shows no `jupyter lab` command"
    for line in lines:
        args = shlex.split(line, comments=True)[1:]
        assert served_root(ROOT, args) == ROOT, f"{line!r} serves {served_root(ROOT, args)}"
        files = [a for a in args[1:] if not a.startswith("-")]
        assert files and all((ROOT / f).is_file() for f in files), line


# --- the links -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    bad = problems(path)
    assert not bad, "dead links (resolved from the repository root, which `make lab` serves):\n" + "\n".join(bad)


def test_lessons_link_to_their_exercises_and_back():
    lessons = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    for ex in (ROOT / "exercises").glob("*.ipynb"):
        assert f"../notebooks/{ex.stem}.ipynb" in links_in(markdown_of(ex)), f"{ex.name} does not link its lesson"
        if ex.stem in lessons:
            lesson = ROOT / "notebooks" / f"{ex.stem}.ipynb"
            assert f"../exercises/{ex.name}" in links_in(markdown_of(lesson)), f"lesson {ex.stem} does not link it"


def test_the_link_checker_finds_dead_links(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "01_x.ipynb").write_text(json.dumps(
        {"cells": [{"cell_type": "markdown", "source": ["# Part one\n", "<a id='here'></a>"]}]}))
    md = ("[ok](../exercises/01_x.ipynb) [ok anchor](../exercises/01_x.ipynb#Part-one) [html ok](../exercises/01_x.ipynb#here)"
          " [gone](../exercises/02_y.ipynb) ![img](fig.png) <img src=\"pic.svg\"> [web](https://example.org/x)"
          " [up](../../outside.ipynb) [bad anchor](../exercises/01_x.ipynb#part-two) [abs](/notebooks/a.ipynb)"
          " `kernel[1, 32](x)`\n\n```\n[fenced](nowhere.ipynb)\n```\n\n[ref]: missing.md\n")
    lesson = tmp_path / "notebooks" / "01_x.ipynb"
    lesson.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": md},
                                            {"cell_type": "code", "source": "[code](nope.ipynb)"}]}))
    found = problems(lesson, tmp_path)
    reported = sorted(m.split(": ", 1)[1].split(" -> ")[0] for m in found)
    assert reported == sorted(["../exercises/02_y.ipynb", "fig.png", "pic.svg", "../../outside.ipynb",
                               "../exercises/01_x.ipynb#part-two", "/notebooks/a.ipynb", "missing.md"]), found
    assert all(m.startswith("notebooks/01_x.ipynb: ") for m in found)
    assert "notebooks/01_x.ipynb: ../exercises/02_y.ipynb -> missing exercises/02_y.ipynb" in found
    assert any("outside the served root" in m for m in found) and any("no heading" in m for m in found)
