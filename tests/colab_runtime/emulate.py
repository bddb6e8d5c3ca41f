"""Google Colab's runtime, emulated on this machine: used by tests/test_colab.py, and by hand.

In Colab, the notebooks' setup cell installs flashlab with `pip install --no-deps` into a runtime whose packages
Colab chose. To check the course there without Colab, this

1. builds flashlab's wheel from the working tree;
2. makes a fresh virtual environment with Colab's versions of the packages flashlab uses (versions.toml, the
   one place they are written), for the GPU image (with numba-cuda) or the CPU image (without);
3. runs the setup cell's code as Colab would: `google.colab` imported, from a working folder outside the
   repository that holds an uploaded copy of the course (the wheel), so the cell installs it with --no-deps;
   In the GPU image it then checks that the prepared launch path's kernel arguments are the ones that image's
   numba-cuda builds (tests/marshal_check.py, run there: no GPU needed);
4. runs notebooks there in the fast mode, copied to that folder (run_notebooks.py, in the new environment),
   and lists what went wrong: a cell that raised, a figure or explorer that drew nothing, data read from
   outside the installed package, a notebook that ran longer than NOTEBOOK_LIMIT_S.

Where it differs from Colab: there is no GPU, so kernels run in the CUDA simulator (numba-cuda's in the GPU image,
numba's built-in one in the CPU image); the Python is the one running this (versions.toml names Colab's), because
torch must import and the only torch that installs here quickly is the running environment's, which is linked
into the new environment rather than installed again; nbclient, nbformat and ipykernel, which run the
notebooks, are whatever pip picks beside the pinned packages.

    python tests/colab_runtime/emulate.py --image cpu                 # every lesson and exercise notebook
    python tests/colab_runtime/emulate.py --image cpu 09 10 15 16     # the lessons (and exercises) 09, 10, 15, 16
    python tests/colab_runtime/emulate.py --image gpu --work /tmp/colab-gpu   # keep the environment there
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VERSIONS = HERE / "versions.toml"
RUNNER = HERE / "run_notebooks.py"
RUNNER_PACKAGES = ["nbformat", "nbclient", "ipykernel"]  # to run notebooks, not part of what is emulated
LINKED = ["torch"]  # taken from the running environment, with what they need that the new one lacks
NOTEBOOK_LIMIT_S = 600  # a guard against hangs; tests/test_notebooks.py holds the fast mode to its time limit
# A cell draws when its source calls one of these; it must then show an image, or a widget holding one. A cell
# that asks has_gpu() draws on a GPU only (timings, live runs) and is not held to it here, where there is none.
DRAWS = ("plt.", "plot_", "_explorer(", "explore(", "show_", "draw_")
GPU_ONLY = "has_gpu()"


def versions() -> dict:
    """versions.toml: {"python": "3.12", "images": {"gpu": [...], "cpu": [...]}}, checked."""
    data = tomllib.loads(VERSIONS.read_text())
    images = {name: image["packages"] for name, image in data.get("images", {}).items()}
    if set(images) != {"gpu", "cpu"}:
        raise ValueError(f"{VERSIONS}: expected [images.gpu] and [images.cpu], found {sorted(images)}")
    for name, packages in images.items():
        pinned = {p.split("==")[0] for p in packages if "==" in p}
        missing = {"numpy", "numba", "ipywidgets", "matplotlib"} - pinned
        if missing:
            raise ValueError(f"{VERSIONS}: image {name} must pin {sorted(missing)}")
    if "numba-cuda" not in {p.split("==")[0] for p in images["gpu"]} or any(
            p.startswith("numba-cuda") for p in images["cpu"]):
        raise ValueError(f"{VERSIONS}: the gpu image has numba-cuda, the cpu image does not")
    return {"python": str(data["python"]), "images": images}


def _run(cmd, **kw):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    return done.stdout


def build_wheel(dest: Path) -> Path:
    """flashlab's wheel, built from a copy of the working tree's pyproject.toml, README.md and flashlab/."""
    src = dest / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "flashlab", src / "flashlab",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "--wheel-dir", dest, src])
    wheels = sorted(dest.glob("flashlab-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one flashlab wheel in {dest}, found {wheels}")
    return wheels[0]


def _requirements(dist: str, have: set, seen: set) -> None:
    """dist and everything it needs (not extras) that the new environment does not have, into seen."""
    key = dist.lower().replace("_", "-")
    if key in seen or key in have:
        return
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:  # not in the running environment either: nothing to link
        return
    seen.add(key)
    for req in requires:
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        for stop in "<>=!~[ (":
            name = name.split(stop)[0]
        _requirements(name, have, seen)


def link_packages(env_python: Path, dists=LINKED) -> list:
    """Make `dists` of the running environment importable in the new one: their files (and those of what they
    need that the new environment lacks) linked into one folder, which a .pth file puts after the new
    environment's own site-packages, so the pinned packages win. Returns the distributions linked."""
    site = Path(_run([env_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    have = set(json.loads(_run([env_python, "-c", "import json, importlib.metadata as m; print(json.dumps("
                                "[d.metadata['Name'].lower().replace('_', '-') for d in m.distributions()]))"])))
    wanted = set()
    for dist in dists:
        _requirements(dist, have, wanted)
    folder = site.parent / "linked-from-test-environment"
    folder.mkdir(exist_ok=True)
    for key in sorted(wanted):
        dist = importlib.metadata.distribution(key)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            target = Path(dist.locate_file(top))
            if target.exists() and not (folder / top).exists() and not top.endswith(".pth"):
                (folder / top).symlink_to(target)
    (site / "zz-linked-from-test-environment.pth").write_text(f"{folder}\n")
    return sorted(wanted)


def make_env(image: str, where: Path) -> Path:
    """A fresh virtual environment with the image's packages; returns its Python."""
    packages = versions()["images"][image]
    shutil.rmtree(where, ignore_errors=True)
    _run([sys.executable, "-m", "venv", where])
    python = where / "bin" / "python"
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages, *RUNNER_PACKAGES])
    link_packages(python)
    return python


def switch_image(env_python: Path, image: str) -> None:
    """Turn an environment made for one image into the other: the GPU image is the CPU image plus numba-cuda."""
    packages = versions()["images"][image]
    if image == "cpu":
        _run([env_python, "-m", "pip", "uninstall", "--quiet", "--yes", "numba-cuda"])
    _run([env_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages])


def installed(env_python: Path, dist: str) -> str | None:
    """The version of `dist` in the environment, or None."""
    out = subprocess.run([str(env_python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def run_setup_cell(env_python: Path, content: Path, wheel: Path) -> str:
    """The setup cell's code, run as in Colab from `content` holding an uploaded copy (the wheel). Returns its
    output; raises if it failed or if flashlab did not end up installed from that copy."""
    sys.path.insert(0, str(ROOT))
    try:
        from flashlab.build import setup_code
    finally:
        sys.path.remove(str(ROOT))
    content.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel, content / wheel.name)
    script = ("import sys, types\n"
              "sys.modules['google.colab'] = types.ModuleType('google.colab')  # what the cell looks for\n"
              + setup_code() +
              "\nimport flashlab, os\nprint('installed at', os.path.dirname(flashlab.__file__))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM")}
    done = subprocess.run([str(env_python), "-c", script], cwd=content, capture_output=True, text=True, env=env)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"the setup cell failed in the emulated Colab:\n{out[-4000:]}")
    where = out.rsplit("installed at", 1)[-1].strip()
    if not where.startswith(str(env_python.parent.parent)):
        raise RuntimeError(f"flashlab was imported from {where}, not from the emulated environment")
    return out


MARSHAL_CHECK = ROOT / "tests" / "marshal_check.py"


def check_marshal(env_python: Path, content: Path) -> str:
    """tests/marshal_check.py in the environment, from `content` (flashlab as installed there): flashlab's kernel
    argument lists against its numba-cuda's. Returns the output; raises if the check failed or did not run on the
    installed flashlab."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM")}
    done = subprocess.run([str(env_python), str(MARSHAL_CHECK)], cwd=content, capture_output=True, text=True,
                          env=env, timeout=300)
    out = done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not last.startswith("ok: "):
        raise RuntimeError(f"{MARSHAL_CHECK.name} failed in the emulated Colab ({done.returncode}):\n{out[-4000:]}")
    if str(env_python.parent.parent) not in last.rsplit("flashlab's", 1)[-1]:
        raise RuntimeError(f"{MARSHAL_CHECK.name} checked a flashlab from outside the emulated environment: {last}")
    return out


def select(prefixes=()) -> list:
    """The lesson and exercise notebooks whose names start with one of `prefixes` (all without)."""
    paths = [p for folder in ("notebooks", "exercises") for p in sorted((ROOT / folder).glob("*.ipynb"))]
    return [p for p in paths if not prefixes or p.name.startswith(tuple(prefixes))]


def run_notebooks(env_python: Path, notebooks, content: Path, workers: int = 1) -> dict:
    """Copy the notebooks under content/ (keeping their folders) and run them there, `workers` runner processes
    at once, each one notebook at a time. {relative path: result}, in the order given.

    Processes, not threads: two nbclient clients in one process were seen to stall for a whole cell timeout
    (300 s) after a notebook's last cell, now and then, with the kernel idle."""
    copies = []
    for path in notebooks:
        rel = path.relative_to(ROOT)
        (content / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, content / rel)
        copies.append(str(rel))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM", "JUPYTER_PATH")}
    env["JUPYTER_DATA_DIR"] = str(content / ".jupyter-data")  # no kernel spec of this machine's: the env's own
    shares = [copies[i::workers] for i in range(max(1, workers))]
    runs = []
    for i, share in enumerate(s for s in shares if s):
        out = content / f"results-{i}.json"
        runs.append((out, subprocess.Popen([str(env_python), str(RUNNER), str(out), *share], cwd=content, env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    results = {}
    for out, proc in runs:
        log = proc.communicate()[0]
        if proc.returncode != 0:
            raise RuntimeError(f"{RUNNER.name} failed ({proc.returncode}):\n{log[-3000:]}")
        results.update(json.loads(out.read_text()))
    return {name: results[name] for name in copies}


def problems(results: dict, env_prefix: Path, wheel: Path) -> list:
    """What went wrong, one line each: raised cells, figures not drawn, data read from outside the package."""
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    bad = []
    for name, r in results.items():
        exercise = name.startswith("exercises/")
        if r["crash"]:
            bad.append(f"{name}: {r['crash']}")
        if r["seconds"] > NOTEBOOK_LIMIT_S:
            bad.append(f"{name}: took {r['seconds']:.0f} s (limit {NOTEBOOK_LIMIT_S} s)")
        if r.get("kernel_prefix") and Path(r["kernel_prefix"]).resolve() != env_prefix.resolve():
            bad.append(f"{name}: ran in {r['kernel_prefix']}, not in the emulated environment {env_prefix}")
        for cell in r["cells"]:
            where = f"{name}, cell {cell['index']}"
            errors = [e for e in cell["errors"] if not (exercise and e[0] == "NotImplementedError")]
            if errors:
                bad.append(f"{where} raised {errors[0][0]}: {errors[0][1][:300]}")
                continue
            if cell["verdicts"] and exercise and not all("not implemented" in v for v in cell["verdicts"]):
                bad.append(f"{where}: a blank exercise's check said {cell['verdicts']}")
            code = "\n".join(line.split("#")[0] for line in cell["source"].splitlines())
            if any(d in code for d in DRAWS) and GPU_ONLY not in code and not cell["errors"]:
                if cell["images"] == 0 and not any(cell["widgets"]):
                    bad.append(f"{where} draws ({cell['source'].splitlines()[0][:80]}...) but showed no figure")
                if any(n == 0 for n in cell["widgets"]):
                    bad.append(f"{where}: an explorer showed its controls but drew nothing")
        for path in r["opened"]:
            p = Path(path)  # as opened: the linked torch resolves into the test environment, which may be in ROOT
            if not p.is_absolute() or p.is_relative_to(ROOT):
                bad.append(f"{name} read {path}, a file of the repository, not of the installed package")
            elif "flashlab" in p.parts and p.resolve().is_relative_to(env_prefix.resolve()):
                rel = "/".join(p.parts[p.parts.index("flashlab"):])
                if rel not in in_wheel:
                    bad.append(f"{name} read {rel}, which is not in the wheel {wheel.name}")
    return bad


def emulate(image: str, prefixes=(), work: Path | None = None, workers: int = 1, log=print) -> dict:
    """Steps 1-4 for one image. Returns {"setup": output, "results": ..., "problems": [...], "seconds": {...}}."""
    work = Path(work) if work else Path(tempfile.mkdtemp(prefix=f"colab-{image}-"))
    if work.resolve().is_relative_to(ROOT):
        raise ValueError(f"the working folder must lie outside the repository; got {work}")
    want = versions()["python"]
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    log(f"[{image}] Python {have}" + ("" if have == want else f" (Colab's is {want}: see emulate.py)"))
    seconds, t = {}, time.monotonic()
    wheel = build_wheel(work / "wheel")
    python = make_env(image, work / "env")
    seconds["wheel and environment"] = time.monotonic() - t
    t = time.monotonic()
    setup = run_setup_cell(python, work / "content", wheel)
    seconds["setup cell"] = time.monotonic() - t
    log(f"[{image}] setup cell:\n" + "\n".join("    " + line for line in setup.strip().splitlines()))
    if image == "gpu":
        t = time.monotonic()
        log(f"[{image}] " + check_marshal(python, work / "content").strip().splitlines()[-1])
        seconds["kernel arguments"] = time.monotonic() - t
    t = time.monotonic()
    results = run_notebooks(python, select(prefixes), work / "content", workers)
    seconds["notebooks"] = time.monotonic() - t
    for name, r in results.items():
        log(f"[{image}]   {name:40s} {r['seconds']:6.1f} s")
    return {"setup": setup, "results": results, "problems": problems(results, work / "env", wheel),
            "seconds": seconds, "work": work}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefixes", nargs="*", help="notebook name prefixes, e.g. 09 10 (default: all)")
    ap.add_argument("--image", choices=("gpu", "cpu"), required=True)
    ap.add_argument("--work", type=Path, help="working folder outside the repository (default: a new temporary one)")
    ap.add_argument("--workers", type=int, default=2, help="notebooks run at once (default 2)")
    args = ap.parse_args(argv)
    out = emulate(args.image, args.prefixes, args.work, args.workers)
    print(f"[{args.image}] " + ", ".join(f"{k} {v:.0f} s" for k, v in out["seconds"].items()) + f"; in {out['work']}")
    for line in out["problems"]:
        print("PROBLEM:", line)
    print(f"[{args.image}] {len(out['results'])} notebooks, {len(out['problems'])} problems")
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
