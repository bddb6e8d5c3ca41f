"""`flashlab.doctor()`: what runs where. It prints the backend flashlab.device chose, the GPU, the versions
involved and a smoke kernel's result, which dtypes run on tensor cores and whether calls with torch tensors take
the fast launch path, and names the fix for the breakages seen in practice. It never raises: it is the first cell
of every notebook.

It sits above the kernels: it asks them (lazily, so that a broken numba-cuda is reported, not raised) what this
GPU runs.
"""
from __future__ import annotations

import os
import sys
import warnings

from . import device
from .device import SIMULATE_GPU, arrange_simulator, backend, device_limits, has_gpu, simulated_gpu

def _fix_for(exc: BaseException) -> str:
    """The known fix for an error message, or ''."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if "unsupported_ptx_version" in low or ("ptx" in low and "version" in low and "unsupported" in low):
        return ("the PTX numba-cuda generates is newer than your driver understands. Fix: install a "
                "numba-cuda / cuda-bindings built for your driver's CUDA version (e.g. pip install "
                "'numba-cuda[cu12]' for a CUDA 12 driver) or upgrade the NVIDIA driver.")
    if "row_stack" in low or ("module 'numpy' has no attribute" in low):
        return "numpy is too new for the installed numba. Fix: pip install 'numpy<2.5', then restart the kernel."
    if "nvvm" in low and ("not found" in low or "cannot be found" in low or "could not" in low):
        return ("libNVVM (part of the CUDA toolkit) was not found. Fix: pip install 'numba-cuda[cu12]' "
                "or 'numba-cuda[cu13]' matching your driver.")
    if isinstance(exc, ImportError) or "no module named" in low:
        return "numba-cuda is missing. Fix: pip install numba-cuda, then restart the Python kernel."
    return ""


cuda = None  # numba.cuda once chosen: kernels must see it as a global for the simulator to swap it


def _twice(out):
    i = cuda.threadIdx.x
    if i < out.shape[0]:
        out[i] = 2 * i


def _smoke(cuda_module) -> str:
    """Launch one block that writes 2*i into 32 elements and check every one."""
    import numpy as np

    global cuda
    cuda = cuda_module
    d_out = cuda.to_device(np.full(32, -1, np.int32))  # poisoned: unwritten elements show up
    with warnings.catch_warnings():  # Numba warns that one block under-uses the GPU: true, and not news
        warnings.simplefilter("ignore")
        cuda.jit(_twice)[1, 32](d_out)
    got = d_out.copy_to_host()
    want = 2 * np.arange(32, dtype=np.int32)
    if not np.array_equal(got, want):
        raise RuntimeError(f"smoke kernel wrote wrong values: {got[:8]}... expected {want[:8]}...")
    return "ok (1 block x 32 threads, every element checked)"


def _tensor_core_dtypes(cc) -> str:
    """Which input dtypes the tensor-core kernels (variant="tensor") take on a GPU of compute capability cc."""
    from .kernels.tensor import resolve_precision

    if cc is None:
        return "float16, bfloat16, float32 (3xTF32): the simulator runs every instruction"
    names = {"f16": "mma.m16n8k16", "k8": "two mma.m16n8k8 per k16 step", "bf16": "mma.m16n8k16",
             "3xtf32": "3xTF32, variant='tensor'"}
    runs, refused = [], []
    for dtype in ("float16", "bfloat16", "float32"):
        try:
            runs.append(f"{dtype} ({names[resolve_precision(dtype, None, cc)]})")
        except ValueError:
            refused.append(dtype)
    return ", ".join(runs) + (f"; not {' or '.join(refused)} (cc {cc[0]}.{cc[1]} < 8.0)" if refused else "")


def _host_costs() -> dict:
    """{"prepared": (lo, hi), "general": (lo, hi), "gpu": name}: host µs per forward call with torch tensors, from
    the recorded run (flashlab/data/host.csv)."""
    import csv
    from pathlib import Path

    path = Path(__file__).resolve().parent / "data" / "host.csv"
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["call"].startswith("forward") and "torch tensors" in r["call"]]
    prepared = [float(r["host_us"]) for r in rows if "(default)" in r["call"]]
    general = [float(r["host_us"]) for r in rows if r["call"].endswith("general path")]
    return {"prepared": (min(prepared), max(prepared)), "general": (min(general), max(general)), "gpu": rows[0]["gpu"]}


def _fast_launch() -> str:
    """Whether calls with torch tensors take the prepared fast path (kernels/prepared.py), and what that costs."""
    if not has_gpu():
        return "not used: in the simulator every call takes the general path"
    from .kernels import prepared

    try:
        cost = _host_costs()
        measured = (f"{cost['prepared'][0]:.0f}-{cost['prepared'][1]:.0f} µs of host time per forward call, against "
                    f"{cost['general'][0]:.0f}-{cost['general'][1]:.0f} µs the general way (measured with an "
                    f"{cost['gpu']}, flashlab/data/host.csv)")
    except (OSError, KeyError, ValueError) as exc:
        measured = f"host time not known ({type(exc).__name__})"
    general = measured.split(", against ")[-1]
    state = prepared.state()
    if state == "on":
        return f"on: repeated calls with torch tensors cost about {measured}"
    if state == "direct":
        return (f"on through FLASHLAB_FAST_LAUNCH=direct (cuLaunchKernel alone; numba-cuda "
                f"{_version('numba-cuda')}): in the default setup, repeated calls with torch tensors cost about "
                f"{measured}")
    why = {"off": "FLASHLAB_FAST_LAUNCH=0",
           "no-core-launch": f"numba-cuda {_version('numba-cuda')} lacks cuda.core's launch, the fallback it uses; "
                             "FLASHLAB_FAST_LAUNCH=direct tries the direct launch alone, not yet run on a GPU with "
                             "this release",
           "no-bindings": "FLASHLAB_FAST_LAUNCH=direct needs cuda.bindings, which does not import"}.get(
        state, f"numba-cuda {_version('numba-cuda')} lacks the launch internals it uses")
    return f"off ({why}): every call takes the general path, about {general}"


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "not installed"


def doctor(file=None) -> dict:
    """Print the backend, GPU, versions and a smoke-kernel result, with the fix for known breakages.

    Returns the same facts as a dict (handy in tests). Never raises.
    """
    out = file or sys.stdout
    facts, fixes = {}, []

    def say(key, value):
        facts[key] = value
        try:
            print(f"  {key:<16} {value}", file=out)
        except OSError:  # a closed pipe must not make the doctor fail
            pass

    try:
        print("flashlab doctor", file=out)
    except OSError:
        pass
    try:
        say("backend", backend())
    except Exception as exc:  # pragma: no cover - _choose only fails on a broken numba
        say("backend", f"error: {exc}")
        fixes.append(_fix_for(exc))
    say("python", sys.version.split()[0])
    for dist in ("numpy", "numba", "numba-cuda", "cuda-bindings"):
        say(dist, _version(dist))
    drv = device._driver_version()
    say("driver (CUDA)", f"{drv[0]}.{drv[1]}" if drv else "no CUDA driver found")
    try:
        cuda = device.get_cuda()
        if has_gpu():
            lim = device_limits()
            say("gpu", f"{lim['name']} (compute capability {lim['cc'][0]}.{lim['cc'][1]}, {lim['sms']} SMs)")
            say("shared/block", f"{lim['shared_per_block'] // 1024} KB static, {lim['shared_optin'] // 1024} KB "
                                "with the dynamic opt-in")
            try:
                rt = cuda.runtime.get_version()
                say("CUDA toolkit", f"{rt[0]}.{rt[1]} (numba-cuda's NVRTC)")
            except Exception as exc:
                say("CUDA toolkit", f"unknown ({type(exc).__name__}: {exc})")
        else:
            say("gpu", "none: kernels run in Numba's CUDA simulator (correct, but ~0.1 ms per thread: many orders of magnitude slower than a GPU)")
            say("simulator", arrange_simulator())
            if device._SIM.get("builtin"):
                say("simulator API", device._SIM["builtin"])
            if simulated_gpu():
                say("simulating", f"{device_limits()['name']} ({SIMULATE_GPU}): its compute capability and limits")
        say("tensor cores", _tensor_core_dtypes(device_limits()["cc"]))
        say("fast launch", _fast_launch())
        say("smoke kernel", _smoke(cuda))
    except Exception as exc:
        say("smoke kernel", f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        fixes.append(_fix_for(exc) or "unrecognised error; please report it with this output.")
    if backend() == "gpu" and _version("numba-cuda") == "not installed":
        fixes.append(_fix_for(ImportError("numba-cuda")))
    for fix in filter(None, fixes):
        say("FIX", fix)
    facts["fixes"] = [f for f in fixes if f]
    facts["ok"] = not facts["fixes"]
    return facts
