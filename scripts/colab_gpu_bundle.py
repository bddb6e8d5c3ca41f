"""Build the bundle that brings Colab's numba and numba-cuda to a GPU machine that has no network.

Colab's GPU runtime has numba, numba-cuda and numpy at the versions tests/colab_runtime/versions.toml pins for its
GPU image (numba 0.61.2, numba-cuda 0.22.2, numpy 2.1.3). To run flashlab's GPU tests under them on another GPU
machine (scripts/gpu_check_colab_fast_path.sh), this

1. downloads their wheels for CPython 3.12 on manylinux x86-64, with what they need (llvmlite, cuda-core < 1 for
   numba-cuda 0.22, packaging), pip resolving as it does for the emulated GPU image, but not cuda-bindings and
   cuda-pathfinder, which the GPU machine's image has (numba-cuda 0.22 takes its cuda-bindings 12 or 13);
2. unpacks them into one site folder, drops their tests, type stubs and bytecode, and strips the shared
   libraries' symbols (not those that auditwheel put in a `*.libs` folder: strip breaks those);
3. adds a sitecustomize.py that, with the folder first on PYTHONPATH, reads the folder's .pth files as a
   site-packages' are read (numba-cuda's makes `import numba.cuda` load numba-cuda's copy, not numba's own);
4. packs the folder as one tar.xz, OUT/site.tar.xz, beside OUT/bundle.json (versions and sizes).

OUT (default .colab-gpu/, which git ignores) then travels with the working tree to the GPU machine: carry it.

    python scripts/colab_gpu_bundle.py                       # build .colab-gpu/ (a few minutes: xz on the CPU)
    python scripts/colab_gpu_bundle.py --check python3.12    # and try it with a Python 3.12 that has cuda-bindings

--check unpacks the archive to a temporary folder and, with it first on PYTHONPATH, imports numba, numpy and
numba.cuda and runs a kernel in the CUDA simulator, then runs tests/marshal_check.py (flashlab's kernel arguments
against numba-cuda 0.22's, no GPU needed).
"""
from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ROOT / "tests" / "colab_runtime" / "versions.toml"
PINNED = ("numpy", "numba", "numba-cuda")  # what the bundle brings at Colab's versions
EXTRA = ("cuda-core<1",)  # numba-cuda 0.22 asks for cuda-core < 1.0; the GPU machine's image has a 1.x
FROM_THE_IMAGE = ("cuda-bindings", "cuda-pathfinder")  # not bundled: the GPU machine's image has them
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64")
LIMIT_MIB = 45  # the archive's budget: a device call carries 64 MiB in all, the working tree included

SITECUSTOMIZE = '''\
"""Written by scripts/colab_gpu_bundle.py. With this folder first on PYTHONPATH, Python runs this at startup: it
reads the folder's .pth files as a site-packages' are read (numba-cuda's makes `import numba.cuda` load
numba-cuda's copy rather than numba's own), then runs the sitecustomize this one hides, if there is one."""
import os as _os
import site as _site
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_site.addsitedir(_here)
for _d in list(_sys.path):
    _p = _os.path.join(_d, "sitecustomize.py")
    if _d and _os.path.abspath(_d) != _here and _os.path.isfile(_p):
        with open(_p) as _f:
            exec(compile(_f.read(), _p, "exec"), {"__name__": "sitecustomize", "__file__": _p})
        break
'''

CHECK = '''
import os, sys
import numpy, numba, llvmlite, numba_cuda
from numba import cuda
bundle = os.environ["BUNDLE"]
for m in (numpy, numba, llvmlite, numba_cuda):
    print(f"{m.__name__:12s} {m.__version__:10s} {os.path.dirname(m.__file__)}")
print(f"numba.cuda   {cuda.implementation:10s} {os.path.dirname(cuda.__file__)}")
assert all(m.__file__.startswith(bundle) for m in (numpy, numba, llvmlite, numba_cuda, cuda)), "not the bundle's"
assert cuda.implementation == "NVIDIA", "numba's built-in numba.cuda, not numba-cuda's"

@cuda.jit
def twice(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = 2 * i

a = numpy.zeros(40, numpy.float32)
twice[2, 32](a)
assert (a == 2 * numpy.arange(40)).all()

@numba.njit
def total(x):
    return x.sum()

assert total(numpy.arange(10.0)) == 45.0
print("simulator kernel and njit ok")
'''


def pins() -> dict:
    packages = tomllib.loads(VERSIONS.read_text())["images"]["gpu"]["packages"]
    found = dict(p.split("==") for p in packages if "==" in p)
    return {name: found[name] for name in PINNED}


def run(cmd, **kw):
    shown = [c if len(str(c)) < 200 else "..." for c in cmd]
    print("$", " ".join(map(str, shown[:12])) + (" ..." if len(cmd) > 12 else ""), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def download(dest: Path, versions: dict) -> list:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "-d", dest]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    run(cmd + [f"{name}=={v}" for name, v in versions.items()] + list(EXTRA))
    return sorted(dest.glob("*.whl"))


def dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0].replace("_", "-").lower()


def trim(site: Path) -> None:
    for path in sorted(site.rglob("*"), reverse=True):  # deepest first
        if path.is_dir() and path.name in ("tests", "__pycache__"):
            shutil.rmtree(path)
        elif path.is_file() and path.suffix == ".pyi":
            path.unlink()
    libs = [p for p in site.rglob("*.so*") if p.is_file() and not any(part.endswith(".libs") for part in p.parts)]
    for i in range(0, len(libs), 50):
        run(["strip", "--strip-unneeded", *libs[i:i + 50]])


def size_mib(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 2 ** 20
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2 ** 20


def build(out: Path, level: int) -> dict:
    versions = pins()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="colab-gpu-bundle-") as tmp:
        tmp = Path(tmp)
        wheels = download(tmp / "wheels", versions)
        kept = [w for w in wheels if dist_name(w) not in FROM_THE_IMAGE]
        site = tmp / "site"
        for wheel in kept:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        unpacked = size_mib(site)
        trim(site)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        info = {"pins": versions, "wheels": [w.name for w in kept], "not bundled": [w.name for w in wheels
                                                                                 if w not in kept],
                "wheels MiB": round(sum(size_mib(w) for w in kept), 1), "unpacked MiB": round(unpacked, 1),
                "trimmed MiB": round(size_mib(site), 1)}
        (site / "bundle.json").write_text(json.dumps(info, indent=1) + "\n")
        archive = out / "site.tar.xz"
        t = time.monotonic()
        with open(archive, "wb") as f:
            tar = subprocess.Popen(["tar", "-C", site, "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T0", f"-{level}"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait() != 0:
                raise RuntimeError("tar failed")
        info.update({"archive": archive.name, "archive MiB": round(size_mib(archive), 1),
                     "xz seconds": round(time.monotonic() - t)})
    (out / "bundle.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def check(out: Path, python: str) -> None:
    with tempfile.TemporaryDirectory(prefix="colab-gpu-site-") as site:
        run(["tar", "-C", site, "-xJf", out / "site.tar.xz"])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM")}
        run([python, "-c", CHECK], env={**env, "PYTHONPATH": site, "BUNDLE": site, "NUMBA_ENABLE_CUDASIM": "1"})
        run([python, ROOT / "tests" / "marshal_check.py"], env={**env, "PYTHONPATH": f"{site}:{ROOT}"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".colab-gpu", help="the bundle's folder (default .colab-gpu/)")
    ap.add_argument("--level", type=int, default=6, help="xz's compression level (default 6)")
    ap.add_argument("--check", metavar="PYTHON", help="try the bundle with this Python 3.12 (needs cuda-bindings)")
    ap.add_argument("--no-build", action="store_true", help="check the bundle already in --out")
    args = ap.parse_args(argv)
    if not args.no_build:
        info = build(args.out, args.level)
        print(json.dumps(info, indent=1))
        if info["archive MiB"] > LIMIT_MIB:
            print(f"the archive is {info['archive MiB']} MiB, over the {LIMIT_MIB} MiB budget")
            return 1
    if args.check:
        check(args.out, args.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
