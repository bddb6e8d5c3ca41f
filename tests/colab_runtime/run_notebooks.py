"""Run notebooks in this Python's Jupyter kernel, in the fast mode, and write what each cell showed as JSON.

Run by emulate.py with the emulated Colab environment's Python; it needs only nbformat and nbclient. Each
notebook runs in a fresh kernel from the folder it lies in, with two cells added after its setup cell:

- explorers use ipywidgets even in the fast mode (there they normally draw a static grid), so that every
  explorer is built and drawn with the environment's ipywidgets;
- every file the notebook's Python opens is recorded (an audit hook), so that data read from outside the
  installed package shows up.

    python run_notebooks.py OUT.json NOTEBOOK ...

OUT.json: {notebook: {"seconds", "crash", "opened": [data files], "kernel_prefix": the kernel's sys.prefix,
"cells": [{"index", "seconds", "source", "errors": [[ename, evalue]], "images", "widgets": [images drawn inside
each explorer (interact) widget], "verdicts": [text of flashlab.check's verdicts]}]}}
"""
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

LIMIT_S = 300  # per cell: a hang fails; a slow cell on a busy machine does not
STARTUP_S = 180  # for a kernel to start, on a busy machine
DATA_SUFFIXES = (".csv", ".json", ".md", ".txt", ".npz", ".npy", ".png")

PROBE = """\
import sys as _sys
_flashlab_opened = set()
def _flashlab_audit(event, args, _seen=_flashlab_opened):
    if event == "open" and isinstance(args[0], str) and args[0].endswith(%r):
        _seen.add(args[0])
_sys.addaudithook(_flashlab_audit)
import flashlab.viz._base as _vb  # explorers: sliders in this kernel even in the fast mode
_vb.use_widgets = lambda interactive=None: _vb.widgets_available() and (interactive is None or bool(interactive))
""" % (DATA_SUFFIXES,)

REPORT = """\
import json as _json
with open(%r, "w") as _f:
    _json.dump({"opened": sorted(_flashlab_opened), "prefix": _sys.prefix}, _f)
"""


def _text(output):
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return f"{output.ename}: {output.evalue}"
    return output.get("data", {}).get("text/plain", "")


def _widget_images(state, model_id, seen=None):
    """Images drawn inside a widget: the outputs of the Output widgets among its descendants."""
    seen = seen if seen is not None else set()
    if model_id in seen or model_id not in state:
        return 0
    seen.add(model_id)
    model = state[model_id].get("state", {})
    count = sum("image/png" in o.get("data", {}) for o in model.get("outputs", []))
    for child in model.get("children", []):
        if isinstance(child, str) and child.startswith("IPY_MODEL_"):
            count += _widget_images(state, child[len("IPY_MODEL_"):], seen)
    return count


def _seconds(cell):
    """How long a cell ran (nbclient's timestamps), or None."""
    from datetime import datetime

    timing = cell.metadata.get("execution", {})
    try:
        began, ended = (datetime.fromisoformat(timing[k].replace("Z", "+00:00"))
                        for k in ("iopub.execute_input", "shell.execute_reply"))
    except (KeyError, ValueError):
        return None
    return (ended - began).total_seconds()


def run(path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(2, nbformat.v4.new_code_cell(PROBE))
    fd, log = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    nb.cells.append(nbformat.v4.new_code_cell(REPORT % log))
    # The kernel talks over Unix sockets, not TCP: ports picked at random collide now and then when several
    # kernels start at once (here and in the other tests), and a kernel then never answers, or a cell waits out
    # its whole timeout.
    sockets = tempfile.mkdtemp(prefix="kernel-")
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "k"))
    client = NotebookClient(nb, km=km, timeout=LIMIT_S, startup_timeout=STARTUP_S, allow_errors=True,
                            resources={"metadata": {"path": str(Path(path).parent)}})
    start, crash = time.monotonic(), None
    try:
        client.execute()
    except Exception as exc:  # a cell past the limit, a dead kernel
        crash = f"{type(exc).__name__}: {str(exc)[:500]}"
    seconds = time.monotonic() - start
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    cells, extra_seconds = [], {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if i == 2 or i == len(nb.cells) - 1:  # the added cells: their time only, to see where a run waited
            extra_seconds[("probe" if i == 2 else "report")] = _seconds(cell)
            continue
        index = i if i < 2 else i - 1  # the index in the notebook as stored
        views = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for o in cell.outputs
                 if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        # explorers: ipywidgets' interact (a box of class widget-interact), not tqdm's progress bars
        views = [m for m in views if "widget-interact" in state.get(m, {}).get("state", {}).get("_dom_classes", [])]
        cells.append({
            "index": index,
            "seconds": _seconds(cell),
            "source": cell.source,
            "errors": [[o.ename, o.evalue] for o in cell.outputs if o.output_type == "error"],
            "images": sum("image/png" in o.get("data", {}) for o in cell.outputs),
            "widgets": [_widget_images(state, m) for m in views],
            "verdicts": [_text(o) for o in cell.outputs if o.output_type == "display_data"
                         and "flashlab.check(" in cell.source],
        })
    try:
        report = json.loads(Path(log).read_text() or "{}")
    except ValueError:
        report = {}
    os.unlink(log)
    shutil.rmtree(sockets, ignore_errors=True)
    return {"seconds": seconds, "crash": crash, "cells": cells, "opened": report.get("opened", []),
            "kernel_prefix": report.get("prefix"), "added_cells_seconds": extra_seconds}


def main(argv):
    out, rest = Path(argv[0]), argv[1:]
    os.environ["FLASHLAB_FAST"] = "1"
    results = {path: run(path) for path in rest}  # one at a time: emulate.py runs several of these at once
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
