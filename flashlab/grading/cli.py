"""`python -m flashlab grade [PATH ...]`: grade exercise notebooks without opening Jupyter.

Each notebook runs in its own Python process with a time limit; every `flashlab.check(...)` in it reports
its verdict. Prints one row per exercise and a progress line; exits 1 unless every exercise passed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .core import RESULTS_ENV
from .notebook import exercises_in


def find_notebooks(paths) -> list:
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.suffix == ".ipynb" and p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"{p} is not a notebook or a folder")
    return found


def grade_notebook(path: Path, timeout: float) -> list:
    """[{notebook, exercise, status, why}] for every exercise the notebook checks."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "results.jsonl"
        log.touch()
        env = dict(os.environ, **{RESULTS_ENV: str(log), "MPLBACKEND": "Agg"})
        cmd = [sys.executable, "-m", "flashlab.grading.notebook", str(path.resolve())]
        try:
            proc = subprocess.run(cmd, cwd=path.parent, env=env, capture_output=True, text=True, timeout=timeout)
            trouble = f"the notebook's process ended with code {proc.returncode}: {proc.stderr.strip()[-300:]}" \
                if proc.returncode else None
        except subprocess.TimeoutExpired:
            trouble = f"the notebook ran past the time limit of {timeout:g} s"
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    results = {r["exercise"]: r for r in records if "exercise" in r}  # the last check of each exercise counts
    errors = [r for r in records if "cell" in r]
    rows = []
    for name in dict.fromkeys(exercises_in(path) + list(results)):
        r = results.get(name)
        if r is None:
            why = trouble or (f"its check never ran; first error, in cell {errors[0]['cell']}: {errors[0]['error']}"
                              if errors else "its check never ran")
            rows.append(dict(notebook=str(path), exercise=name, status="failed", why=why))
        else:
            why = "" if r["status"] == "passed" else r["message"] if r["status"] == "failed" else "still raises NotImplementedError"
            if r["status"] == "failed" and r.get("case"):
                why += f" [{r['case']}]"
            rows.append(dict(notebook=str(path), exercise=name, status=r["status"], why=why, result=r))
    if not rows:
        rows.append(dict(notebook=str(path), exercise="-", status="failed", why=trouble or "no flashlab.check(...) calls found"))
    return rows


def table(rows) -> str:
    width = max(12, *(len(Path(r["notebook"]).stem) for r in rows))
    ex_width = max(8, *(len(r["exercise"]) for r in rows))
    lines = [f"{'notebook':{width}}  {'exercise':{ex_width}}  {'verdict':15}  why", "-" * (width + ex_width + 30)]
    for r in rows:
        why = r["why"].splitlines()[0] if r["why"] else ""
        lines.append(f"{Path(r['notebook']).stem:{width}}  {r['exercise']:{ex_width}}  {r['status']:15}  {why[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab grade", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["exercises"], help="notebooks or folders (default: exercises/)")
    parser.add_argument("--json", metavar="FILE", help="also write the verdicts to FILE as JSON")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per notebook (default 300)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="notebooks graded at once")
    args = parser.parse_args(argv)
    try:
        notebooks = find_notebooks(args.paths)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not notebooks:
        print(f"error: no notebooks found in {', '.join(args.paths)}", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = [row for rows in pool.map(lambda p: grade_notebook(p, args.timeout), notebooks) for row in rows]
    print(table(rows))
    passed = sum(r["status"] == "passed" for r in rows)
    print(f"\nprogress: {passed}/{len(rows)} exercises passed ({100 * passed / len(rows):.0f}%), "
          f"{sum(r['status'] == 'not implemented' for r in rows)} not implemented, "
          f"{sum(r['status'] == 'failed' for r in rows)} failed, in {len(notebooks)} notebook(s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"passed": passed, "total": len(rows), "exercises": rows}, indent=1))
    return 0 if passed == len(rows) else 1
