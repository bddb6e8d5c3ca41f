"""Drive every interactive explorer in a real browser, as a learner would; not a test (it takes minutes).

It starts JupyterLab at the repository root (as `make lab` does) on a free localhost port with a token,
opens each notebook whose code calls an explorer in headless Chromium, runs all cells (full size: the
fast mode turns explorers into static grids, so FLASHLAB_FAST is unset), waits for the widgets, takes a
screenshot of each explorer, moves one control (a checkbox if it has one, else its first slider, one
step), waits for the redraw, takes a second screenshot, and checks that the picture changed and that no
cell or explorer printed an error. It writes a table to docs/browser-check.md and the screenshots to
out/browser-check/ (ignored by git). Exit status 1 if any explorer failed.

Explorers are found from the sources, so new ones are picked up: every function in flashlab/ that calls
`explore(...)` (or calls such a function) is an explorer, and a notebook calling one, or ipywidgets'
`interact`, is checked.

Needs Chromium and Playwright for Python; Playwright's own browser download is not used. On Debian:

    apt-get install -y chromium
    python -m pip install --target /tmp/pw playwright        # outside the project's environment
    PYTHONPATH=/tmp/pw:. .venv/bin/python scripts/browser_check.py [--notebooks notebooks/05_fa2.ipynb]
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
WIDGET = ".widget-interact"
ERROR_OUTPUT = '[data-mime-type="application/vnd.jupyter.error"], [data-mime-type="application/vnd.jupyter.stderr"]'


# --- which notebooks ---------------------------------------------------------------------------------

def explorer_names(package: Path = ROOT / "flashlab") -> set:
    """Functions in the package that show an explorer: they call explore(...) or another such function."""
    calls = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                calls[node.name] = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                                    for c in ast.walk(node) if isinstance(c, ast.Call)
                                    and isinstance(c.func, (ast.Name, ast.Attribute))}
    names = {"explore"}
    while True:
        more = {name for name, called in calls.items() if called & names} - names
        if not more:
            return names
        names |= more


def explorer_notebooks(folders=("notebooks", "solutions")) -> dict:
    """{notebook path: [explorer names it calls]} for every notebook whose code calls an explorer."""
    names = sorted(explorer_names() | {"interact"})
    call = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\s*\(")
    found = {}
    for folder in folders:
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            code = "\n".join(line.split("#")[0] for line in code.splitlines())  # not in comments
            hits = sorted(set(call.findall(code)) - {"explore"} or set(call.findall(code)))
            if hits:
                found[path] = hits
    return found


# --- the server -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(tmp: Path, python: str):
    """JupyterLab at the repository root, a token, no browser; fresh settings (every cell rendered) and
    workspaces, and the app exposed as window.jupyterapp so the script can run cells."""
    port, token = free_port(), secrets.token_hex(16)
    settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    news = tmp / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')  # offline; no pop-up
    env = {k: v for k, v in os.environ.items() if k != "FLASHLAB_FAST"}  # sliders, not the static grid
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [python, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.root_dir={ROOT}", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={tmp / 'settings'}",
           f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "jupyter.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        if server.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {server.returncode}; see {tmp / 'jupyter.log'}")
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return server, url, token
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"jupyter lab did not answer on {url} within 60 s; see {tmp / 'jupyter.log'}")


# --- in the browser ---------------------------------------------------------------------------------

KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!(k && w.sessionContext.isReady && k.status === 'idle'); }"""
RUN_ALL = """async (ms) => Promise.race([
  window.jupyterapp.commands.execute('notebook:run-all-cells'),
  new Promise((_, reject) => setTimeout(() => reject(new Error('cells still running after ' + ms / 1000 + ' s')), ms))])"""
CELL_ERRORS = """() => { const nb = window.jupyterapp.shell.currentWidget.content; const out = [];
  nb.widgets.forEach((c, i) => { if (c.model.type !== 'code') return;
    if (c.model.executionCount === null) out.push(`cell ${i} did not run`);
    for (const o of c.model.outputs.toJSON()) if (o.output_type === 'error') out.push(`cell ${i}: ${o.ename}: ${o.evalue}`); });
  return out; }"""
SHUTDOWN = "() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()"


def widget_errors(widget) -> list:
    """Tracebacks the explorer's callback printed into its own output (not part of any cell's outputs)."""
    errs = widget.locator(ERROR_OUTPUT)
    return [t.strip().splitlines()[-1][:200] for t in errs.all_inner_texts()
            if "Error" in t or "Traceback" in t]


def image_src(widget) -> str:
    imgs = widget.locator("img")
    return imgs.first.get_attribute("src") or "" if imgs.count() else ""


def _words(text: str) -> str:
    return " ".join(text.replace("\u200b", " ").split())  # ipywidgets pads labels with zero-width spaces


def move_control(widget) -> str:
    """Tick the first checkbox, or move the first slider one step; returns what was done."""
    box = widget.locator("input[type=checkbox]")
    if box.count():
        name = _words(widget.locator(".widget-checkbox").first.inner_text())
        before = box.first.is_checked()
        box.first.click()
        return f"checkbox {name}: {before} → {box.first.is_checked()}"
    slider = widget.locator(".widget-slider").first
    if not slider.count():
        return ""
    name = _words(slider.locator(".widget-label").inner_text())
    readout = slider.locator(".widget-readout")
    before = readout.inner_text().strip()
    handle = slider.locator(".noUi-handle, .ui-slider-handle").first  # ipywidgets 8 (noUiSlider), 7 (jQuery UI)
    at_end = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
    handle.focus()
    handle.press("ArrowLeft" if at_end else "ArrowRight")
    return f"slider {name}: {before} → {readout.inner_text().strip()}"


def pictures_differ(a: Path, b: Path) -> bool:
    import matplotlib.image as mpimg

    x, y = mpimg.imread(a), mpimg.imread(b)
    return x.shape != y.shape or bool((abs(x - y) > 1e-3).any())


def check_notebook(context, url, token, path: Path, out: Path, timeout_s: float, names=()) -> list:
    """One row per explorer in the notebook: {notebook, explorer, control, changed, errors, seconds}."""
    rel = path.relative_to(ROOT).as_posix()
    stem = f"{path.parent.name}-{path.stem}"
    start = time.monotonic()
    page = context.new_page()
    rows, errors = [], []
    try:
        page.goto(f"{url}/lab/tree/{rel}?token={token}&reset")
        page.wait_for_function(f"() => ({KERNEL_IDLE})() || !!document.querySelector('.jp-Dialog')",
                               timeout=timeout_s * 1000)
        if page.locator(".jp-Dialog").count():  # "Select Kernel", for a notebook without a kernelspec
            page.locator(".jp-Dialog .jp-mod-accept").click()
        page.wait_for_function(KERNEL_IDLE, timeout=timeout_s * 1000)
        try:
            page.evaluate(RUN_ALL, timeout_s * 1000)
        except Exception as exc:  # a cell past the limit
            errors.append(str(exc).splitlines()[0][:200])
        page.wait_for_function(KERNEL_IDLE, timeout=timeout_s * 1000)
        errors += page.evaluate(CELL_ERRORS)
        widgets = page.locator(WIDGET)
        try:
            widgets.first.locator("img").first.wait_for(timeout=30_000)
        except Exception:
            pass
        if not widgets.count():
            errors.append("no explorer widget appeared")
        for i in range(widgets.count()):
            t0 = time.monotonic()
            widget = widgets.nth(i)
            widget.scroll_into_view_if_needed()
            page.wait_for_timeout(500)  # let the layout settle
            before, after = out / f"{stem}-{i}-before.png", out / f"{stem}-{i}-after.png"
            widget.screenshot(path=str(before))
            src = image_src(widget)
            control = move_control(widget)
            try:  # the Output widget clears, then shows the new figure (or the callback's traceback)
                page.wait_for_function("([sel, i, old, err]) => { const w = document.querySelectorAll(sel)[i];"
                                       " const img = w.querySelector('img'); return [...w.querySelectorAll(err)]"
                                       ".some(e => /Error|Traceback/.test(e.textContent))"
                                       " || !!(img && img.complete && img.src !== old); }",
                                       arg=[WIDGET, i, src, ERROR_OUTPUT], timeout=60_000)
                page.wait_for_timeout(500)
            except Exception:
                errors.append(f"explorer {i}: no new figure within 60 s of moving the control")
            page.wait_for_function(KERNEL_IDLE, timeout=timeout_s * 1000)
            widget.screenshot(path=str(after))
            label = names[i] if len(names) == widgets.count() else f"#{i + 1}"
            rows.append(dict(notebook=rel, explorer=label, control=control or "no control found",
                             changed=pictures_differ(before, after), errors=widget_errors(widget),
                             seconds=time.monotonic() - t0))
        page.evaluate(SHUTDOWN)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        page.screenshot(path=str(out / f"{stem}-failure.png"))
    finally:
        page.close()
    if not rows:
        rows.append(dict(notebook=rel, explorer="-", control="-", changed=False, errors=[], seconds=0.0))
    rows[0]["errors"] = errors + rows[0]["errors"]  # cell errors are reported once, on the first explorer
    rows[0]["total"] = time.monotonic() - start
    return rows


# --- report ------------------------------------------------------------------------------------------

def versions(chromium: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = [subprocess.run([chromium, "--version"], capture_output=True, text=True).stdout.strip() or chromium]
    for pkg in ("jupyterlab", "ipywidgets", "playwright"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out) + f", Python {platform.python_version()}"


def summary(rows, found, chromium, elapsed) -> str:
    lines = ["# Browser check of the explorers", "",
             "Written by `scripts/browser_check.py` (JupyterLab at the repository root, headless Chromium driven by",
             "Playwright; every cell run at full size, one control moved per explorer, screenshots before and after).",
             "", f"Run {datetime.date.today().isoformat()} on {platform.system()} without a GPU: {versions(chromium)}.",
             f"Notebooks with explorers, found from the sources: {len(found)}; total {elapsed:.0f} s.", "",
             "| notebook | explorer | control moved | picture changed | errors | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        errs = "; ".join(e.replace("|", "\\|") for e in r["errors"]) or "none"
        secs = f"{r.get('total', r['seconds']):.0f}" if "total" in r else f"{r['seconds']:.0f}"
        lines.append(f"| {r['notebook']} | {r['explorer']} | {r['control']} | {'yes' if r['changed'] else 'NO'} "
                     f"| {errs} | {secs} |")
    lines += ["", "Seconds: for a notebook's first explorer, from opening the notebook (all cells run) to the second",
              "screenshot; for further explorers, moving the control and redrawing. Screenshots: `out/browser-check/`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notebooks", nargs="*", type=Path, help="notebooks to check (default: every one with an explorer)")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--python", default=sys.executable, help="the Python whose JupyterLab serves the notebooks")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "browser-check", help="folder for the screenshots")
    ap.add_argument("--summary", type=Path, default=ROOT / "docs" / "browser-check.md")
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed to run one notebook's cells")
    args = ap.parse_args(argv)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("Playwright is missing: python -m pip install --target /tmp/pw playwright, then PYTHONPATH=/tmp/pw",
              file=sys.stderr)
        return 2
    if not Path(args.chromium).exists():
        print(f"--chromium {args.chromium!r} does not exist; install Chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    found = explorer_notebooks()
    paths = [p.resolve() for p in args.notebooks] if args.notebooks else list(found)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"--notebooks: no such notebook {missing}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    start, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="browser-check-") as tmp:
        server, url, token = start_lab(Path(tmp), args.python)
        try:
            with sync_playwright() as pw:
                context = pw.chromium.launch_persistent_context(
                    str(Path(tmp) / "chromium-profile"), executable_path=args.chromium, headless=True,
                    args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
                for path in paths:
                    print(f"{path.relative_to(ROOT)}: explorers {found.get(path, '(none found in its code)')} ...", flush=True)
                    names = found.get(path, [])
                    for row in check_notebook(context, url, token, path, args.out, args.timeout, names):
                        rows.append(row)
                        print(f"  {row['control']}: changed {row['changed']}, errors {row['errors'] or 'none'}",
                              flush=True)
                context.close()
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    args.summary.write_text(summary(rows, found, args.chromium, time.monotonic() - start))
    print(f"wrote {args.summary}")
    return 0 if all(r["changed"] and not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
