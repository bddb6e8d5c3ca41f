"""Execute lesson notebooks of a checkout in fast mode (FLASHLAB_FAST=1, Numba's CUDA simulator) and print the
seconds each took, as tests/test_notebooks.py runs them. The kernel imports the checkout's flashlab (PYTHONPATH),
so two clones can be compared, e.g. before and after a change to the simulator:

    python benchmarks/timing/notebook_speed.py /tmp/flashlab-before 09 15
    python benchmarks/timing/notebook_speed.py . 09 15
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit(__doc__)
    root = Path(argv[0]).resolve()
    os.environ.update(FLASHLAB_FAST="1", NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for prefix in argv[1:]:
        path = next((root / "notebooks").glob(f"{prefix}*.ipynb"))
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        NotebookClient(nb, timeout=1800, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        took = time.perf_counter() - start
        errors = sum(o.output_type == "error" for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
        print(f"{root.name:16s} {path.stem:28s} {took:6.1f} s  errors {errors}", flush=True)


if __name__ == "__main__":
    main()
