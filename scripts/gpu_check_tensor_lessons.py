"""The tensor-core lessons (15-17) on a real GPU: their tests, then the lessons and solution notebooks at full size.

    python scripts/gpu_check_tensor_lessons.py [--out docs/gpu-tensor-lessons.log]

Without a GPU the same tests and notebooks run in CI on the CUDA simulator; on a GPU they check what the
simulator cannot: the real mma.sync, ldmatrix(.trans) and cp.async against the lesson's figures
(tests/test_viz_tensor.py), the s_tile exercise's solution and mutants graded on the hardware
(tests/exercises/test_l16_tensor_core_forward.py), the tensor kernels at the lessons' GPU sizes, and lesson 16's timing cell
against torch SDPA. Prints every cell error and the lines of output that carry results; writes the log to
--out. Run it on an sm_80+ GPU (H100) and, if possible, on a T4 (sm_75: float16 through two m16n8k8).
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEMS = ["15_tensor_cores", "16_tensor_core_forward", "17_tensor_core_backward"]
NOTEBOOKS = [f"{folder}/{stem}.ipynb" for stem in STEMS for folder in ("notebooks", "solutions")]
KEEP = ("TFLOP/s", "error", "passed", "failed", "difference", "running on", "lane 5", "==")


def run_notebook(path, log):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / path, as_version=4)
    env_fast = os.environ.pop("FLASHLAB_FAST", None)  # full size
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str((ROOT / path).parent)}})
    start = time.monotonic()
    try:
        client.execute()
    finally:
        if env_fast is not None:
            os.environ["FLASHLAB_FAST"] = env_fast
    log(f"## {path}: {time.monotonic() - start:.0f} s")
    errors = 0
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                errors += 1
                log(f"cell {i}: ERROR {out.ename}: {out.evalue[:500]}")
            elif out.output_type == "stream":
                for line in out.text.splitlines():
                    if any(k in line for k in KEEP):
                        log(f"cell {i}: {line}")
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpu-tensor-lessons.log"))
    args = ap.parse_args()
    lines = []

    def log(text):
        print(text, flush=True)
        lines.append(text)

    sys.path.insert(0, str(ROOT))
    import flashlab

    if not flashlab.device.has_gpu():
        sys.exit("no CUDA GPU here: CI already runs these on the simulator")
    log(f"## GPU: {flashlab.device.device_limits()['name']} (cc {flashlab.device.device_limits()['cc']})")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_viz_tensor.py",
                          *[f"tests/exercises/test_l{stem}.py" for stem in STEMS], "tests/test_tensor_kernel.py"],
                         cwd=ROOT, capture_output=True, text=True)
    log("## pytest: " + " | ".join(res.stdout.strip().splitlines()[-3:]))
    errors = sum(run_notebook(p, log) for p in NOTEBOOKS)
    log(f"## notebook cell errors: {errors}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    sys.exit(1 if errors or res.returncode else 0)


if __name__ == "__main__":
    main()
