"""Where flashlab's kernels run: a CUDA GPU through numba-cuda, or Numba's CUDA simulator.

The choice is made once, before `numba.cuda` is first imported, because Numba reads
NUMBA_ENABLE_CUDASIM only at that moment:

- NUMBA_ENABLE_CUDASIM=1 set by you: the simulator.
- otherwise a GPU found through the CUDA driver (libcuda, asked with ctypes so numba.cuda is not
  imported yet): the GPU.
- otherwise: the simulator (flashlab sets NUMBA_ENABLE_CUDASIM=1 for you).

`get_cuda()` returns the `numba.cuda` module after that choice; kernels import it through here.
flashlab/checkup.py, above the kernels, reports what was chosen (`flashlab.doctor()`).

In the simulator, flashlab also arranges the simulator's threads (`arrange_simulator`, once, when the
simulator is chosen). The simulator runs each CUDA thread of a block as a Python thread, and those threads
take turns holding the GIL. Numba's block loop busy-polls the threads for `cuda.syncthreads()` and never
blocks, so every thread that wants the GIL waits out the poller's switch interval (5 ms by default): a warp
instruction, where 32 lanes meet (kernels/mma.py), cost tens of milliseconds, and the same check took
very different times from one run to the next. flashlab replaces that loop with one that sleeps until the last
thread reaches the barrier (or a thread ends or fails), and runs each simulated launch with the GIL switch
interval at SIM_SWITCH_INTERVAL (5 ms, measured best), restoring the interpreter's value when the launch
returns or raises. Barriers, races, warp divergence and errors are reported as before. Measured before and
after in benchmarks/results/simulator_speed.md. FLASHLAB_SIM_THREADS=numba in the environment leaves Numba's
simulator as it is (to compare, or to rule flashlab out).

Without numba-cuda (Colab's CPU runtime), `numba.cuda` is numba's own older copy; flashlab gives its simulator
the one argument the kernels use that it lacks (`complete_builtin_simulator`). FLASHLAB_SIMULATE_GPU=T4 makes the
simulator report a T4's compute capability and limits, so the planner and the kernels take a T4's paths
(`simulated_gpu`; the GPUs' records are in flashlab/gpu_limits.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import warnings

from .gpu_limits import DEVICES

_state = {"backend": None, "problem": None}

FIX_RESTART = (
    "numba.cuda was imported before flashlab could choose a backend, and it found no usable GPU. "
    "Fix: restart the Python kernel and run `import flashlab` before anything imports numba.cuda, "
    "or set NUMBA_ENABLE_CUDASIM=1 in the environment before starting Python."
)


def _env_simulator() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")


def _driver_gpu_count() -> int:
    """Number of CUDA devices the driver reports, 0 when there is no driver or no GPU."""
    names = {"win32": ["nvcuda.dll"], "darwin": []}.get(sys.platform, ["libcuda.so.1", "libcuda.so"])
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        try:
            if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
        except (AttributeError, OSError):
            return 0
        return count.value
    return 0


def _driver_version():
    """(major, minor) of the installed CUDA driver, from libcuda, or None."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return v.value // 1000, (v.value % 1000) // 10
    except (OSError, AttributeError):
        pass
    return None


def _choose() -> str:
    """Decide the backend once; returns "gpu", "simulator" or "unavailable"."""
    if _state["backend"] is not None:
        return _state["backend"]
    if "numba.cuda" in sys.modules:  # too late to choose: report what the earlier import gave
        from numba import config

        if config.ENABLE_CUDASIM:
            backend = "simulator"
        elif sys.modules["numba.cuda"].is_available():
            backend = "gpu"
        else:
            backend, _state["problem"] = "unavailable", FIX_RESTART
            warnings.warn(FIX_RESTART, RuntimeWarning, stacklevel=3)
    elif _env_simulator():
        backend = "simulator"
    elif _driver_gpu_count() > 0:
        backend = "gpu"
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        try:
            from numba.core import config

            config.reload_config()
        except ImportError:  # no numba: get_cuda() will say how to install it
            pass
        backend = "simulator"
    _state["backend"] = backend
    return backend


def backend() -> str:
    """"gpu" (a real CUDA device), "simulator" (Numba's CUDA simulator) or "unavailable" (see doctor())."""
    return _choose()


def has_gpu() -> bool:
    """True when the kernels run on a real CUDA GPU."""
    return _choose() == "gpu"


def kernel_size(full, fast):
    """A size for a kernel launch in a lesson: `full` on a real GPU (unless FLASHLAB_FAST is set), `fast`
    in the CUDA simulator, which runs each thread in Python and would take hours at the GPU's sizes."""
    from .config import size

    return size(full, fast) if has_gpu() else fast


def in_simulator(fn, *args) -> None:
    """Run fn(*args) in a fresh Python on Numba's CUDA simulator and print what it printed: for code this GPU cannot
    run (lesson 20's Hopper kernels on Colab's T4), since one process cannot switch from its GPU to the simulator.
    fn's source is read with inspect (a function defined in a notebook cell too), so fn imports what it uses, and
    args are Python literals. Raises RuntimeError with the end of its error output if the run fails."""
    import inspect
    import subprocess
    import textwrap

    call = f"{fn.__name__}({', '.join(map(repr, args))})"
    code = textwrap.dedent(inspect.getsource(fn)) + "\n" + call + "\n"
    env = {k: v for k, v in os.environ.items() if k != SIMULATE_GPU}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"{call} failed in the simulator:\n{tail}")


def get_cuda():
    """The `numba.cuda` module, imported after the backend is chosen. Raises with the fix if unusable."""
    _choose()
    if _state["problem"]:
        raise RuntimeError(_state["problem"])
    try:
        from numba import cuda
    except ImportError as exc:
        raise ImportError(
            f"numba.cuda could not be imported ({exc}). Fix: pip install numba-cuda "
            "(and numba itself if missing), then restart the Python kernel."
        ) from exc
    if _state["backend"] == "simulator" and _SIM["arranged"] is None:
        complete_builtin_simulator()
        arrange_simulator()
    return cuda


def complete_builtin_simulator() -> str:
    """Give numba's built-in CUDA simulator what the kernels use from numba-cuda's. Returns what was done.

    Without numba-cuda, `numba.cuda` is the copy inside numba itself, whose simulator predates the `alignment=`
    argument of `cuda.shared.array` and `cuda.local.array`. The kernels pass alignment=None in the simulator
    (a NumPy array has no alignment to ask for), so flashlab puts in numba-cuda's versions of the two methods:
    the same arrays, alignment=None accepted, any other value refused. Nothing changes where numba-cuda is
    installed. (The shared array is keyed by the line that asks for it, as in Numba, so it cannot be a wrapper
    around Numba's: every array would then come from the wrapper's line, one array for all.)"""
    import inspect

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    def _dtype(dtype):
        return numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype

    def _no_alignment(alignment):
        if alignment is not None:
            raise RuntimeError(f"Array alignment is not supported in cudasim (got alignment={alignment!r})")

    def shared_array(self, shape, dtype, alignment=None):
        _no_alignment(alignment)
        dtype = _dtype(dtype)
        if shape == 0:  # dynamic shared memory: every such array views the launch's one buffer
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)  # one array per source line, as in Numba
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    def local_array(self, shape, dtype, alignment=None):
        _no_alignment(alignment)
        return np.empty(shape, _dtype(dtype))

    added = []
    for cls, array in ((kernelapi.FakeCUDAShared, shared_array), (kernelapi.FakeCUDALocal, local_array)):
        if "alignment" not in inspect.signature(cls.array).parameters:
            cls.array = array
            added.append(cls.__name__.removeprefix("FakeCUDA").lower())
    _SIM["builtin"] = (f"numba's built-in (numba-cuda not installed); flashlab gave cuda.{' and cuda.'.join(added)}"
                       ".array numba-cuda's alignment argument" if added else "")
    return _SIM["builtin"]


# ------------------------------------------------------------------------------------- simulator threads
# The GIL switch interval (seconds) while a simulated kernel runs: how long a thread that wants the GIL waits
# before it makes a busy holder let go. With Numba's polling loop a short one helped (it cut the poller's turns);
# with the block loop below, threads hand the GIL on when they wait, and forced switches only add work: 0.5 ms
# was slower than 5 ms, and 20 ms no faster (benchmarks/results/simulator_speed.md). So a launch runs at
# CPython's default of 5 ms even where the interpreter was set lower, and gets its value back.
SIM_SWITCH_INTERVAL = 5e-3

_SIM = {"arranged": None, "how": "not arranged (no simulated kernel yet)"}
_SIM_LOCK = threading.Lock()


@contextlib.contextmanager
def simulator_threads():
    """Run the body with the GIL switch interval of a simulated kernel, restoring the interpreter's value after.

    Every simulated launch runs inside this (an outer launch only: a device function or a nested call does not
    set it again). Kernels on a GPU do not need it."""
    with _SIM_LOCK:
        before = sys.getswitchinterval()
        depth = _SIM.setdefault("depth", 0)
        _SIM["depth"] = depth + 1
        if depth == 0:
            _SIM["restore"] = before
            sys.setswitchinterval(SIM_SWITCH_INTERVAL)
    try:
        yield
    finally:
        with _SIM_LOCK:
            _SIM["depth"] -= 1
            if _SIM["depth"] == 0:
                sys.setswitchinterval(_SIM.pop("restore"))


def arrange_simulator() -> str:
    """Make Numba's CUDA simulator, once per process, run a block's threads without a busy-polling loop and
    each launch under `simulator_threads()`. Returns (and doctor() shows) what was done; never raises."""
    with _SIM_LOCK:
        if _SIM["arranged"] is not None:
            return _SIM["how"]
        _SIM["arranged"] = False
        if os.environ.get("FLASHLAB_SIM_THREADS", "").strip().lower() == "numba":
            _SIM["how"] = ("Numba's own (FLASHLAB_SIM_THREADS=numba): a polling block loop, the interpreter's "
                           "switch interval")
            return _SIM["how"]
        try:
            from numba.cuda.simulator import kernel as sim
            _patch_simulator(sim)
        except Exception as exc:  # a numba-cuda whose simulator is built differently: run it as it is
            _SIM["how"] = f"Numba's own (flashlab could not arrange it: {type(exc).__name__}: {exc})"
            return _SIM["how"]
        _SIM["arranged"] = True
        _SIM["how"] = (f"flashlab's: a block's threads wake its loop only at a barrier, an end or an error; "
                       f"switch interval {SIM_SWITCH_INTERVAL * 1e3:g} ms while a kernel runs")
        return _SIM["how"]


def _patch_simulator(sim):
    """Replace the simulator's BlockThread.syncthreads and .run, and its BlockManager with a subclass, so that
    arrivals at cuda.syncthreads() are counted under one condition variable; wrap FakeCUDAKernel's launch in
    simulator_threads().

    Numba's BlockManager.run polls every thread's `syncthreads_blocked` in a loop that holds the GIL; here the
    thread that completes a barrier (the last to arrive, counting threads that have ended, as Numba does)
    wakes the block's loop, which releases them all. Errors abort the block's other threads as in Numba."""
    import numpy as np

    base_thread, base_manager, kernel_cls = sim.BlockThread, sim.BlockManager, sim.FakeCUDAKernel
    for owner, name in ((base_thread, "syncthreads"), (base_thread, "run"), (base_manager, "run"),
                        (kernel_cls, "__call__"), (sim, "_get_kernel_context")):
        if not callable(getattr(owner, name, None)):
            raise AttributeError(f"numba's simulator has no {getattr(owner, '__name__', owner)}.{name}")

    # BlockThread's methods are replaced in place, not in a subclass: numba 0.61's built-in simulator calls
    # super(BlockThread, self) through the module's name, which a subclass put under that name would loop on.
    numba_run = base_thread.run

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        block = self._manager
        with block.changed:
            self.syncthreads_blocked = True
            block.waiting += 1
            if block.waiting + block.finished == block.count:
                block.changed.notify()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run(self):
        try:
            numba_run(self)  # Numba's: runs the kernel, keeps its exception in self.exception
        finally:
            block = self._manager
            with block.changed:
                block.finished += 1
                if self.exception is not None or block.waiting + block.finished == block.count:
                    block.changed.notify()

    class BlockManager(base_manager):
        def run(self, grid_point, *args):
            self.changed = threading.Condition(threading.Lock())
            self.count, self.waiting, self.finished = int(np.prod(self._block_dim)), 0, 0

            def target():
                self._f(*args)

            threads = []
            for block_point in np.ndindex(*self._block_dim):
                t = sim.BlockThread(target, self, grid_point, block_point, self._debug)
                t.start()
                threads.append(t)
            with self.changed:
                while True:
                    failed = next((t for t in threads if t.exception), None)
                    if failed is not None:  # as Numba: stop the others, leave them unjoined for debugging
                        for t in threads:
                            t.abort, t.syncthreads_blocked = True, False
                            t.syncthreads_event.set()
                        raise failed.exception[0].with_traceback(failed.exception[1])
                    if self.finished == self.count:
                        break
                    if self.waiting and self.waiting + self.finished == self.count:  # the barrier is complete
                        self.waiting = 0
                        for t in threads:
                            if t.syncthreads_blocked:
                                t.syncthreads_blocked = False
                                t.syncthreads_event.set()
                        continue
                    self.changed.wait(1.0)  # a safety net: every change this loop waits for notifies it
            for t in threads:
                t.join()

    launch = kernel_cls.__call__

    def __call__(self, *args):
        if self._device or sim._get_kernel_context() is not None:  # a device function, or called inside a kernel
            return launch(self, *args)
        with simulator_threads():
            return launch(self, *args)

    base_thread.syncthreads, base_thread.run = syncthreads, run
    sim.BlockManager, kernel_cls.__call__ = BlockManager, __call__


_LIMITS = {}  # device id -> its limits


def _optin(dev) -> int:
    """Shared memory a block may use once its kernel opts in (the driver's attribute; 48 KB where it is missing)."""
    try:
        return int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    except Exception:  # an old driver or binding without the attribute
        return 48 * 1024


SIMULATE_GPU = "FLASHLAB_SIMULATE_GPU"


def simulated_gpu() -> str | None:
    """The GPU the simulator stands in for: FLASHLAB_SIMULATE_GPU=T4 (or A100, H100) in the environment, or None.

    With it, the simulator reports that GPU's compute capability and limits (kernels/devices.py), so the planner
    and the kernels take the paths they take there: on a T4 (cc 7.5) float16 runs two m16n8k8 per k16 step with
    no cp.async, and bfloat16 and tf32 have no tensor-core path. Ignored on a real GPU, which reports itself."""
    name = os.environ.get(SIMULATE_GPU, "").strip()
    if not name or has_gpu():
        return None
    if name not in DEVICES:
        raise ValueError(f"{SIMULATE_GPU}={name!r} names no GPU flashlab knows; use one of {sorted(DEVICES)}, "
                         "or leave it unset for the simulator's own stand-in")
    return name


def _current_device_id() -> int | None:
    """The ordinal of the device whose context is current, from one driver call (cuCtxGetDevice); None where
    cuda.bindings is missing or no context is current. numba's get_current_device() makes several driver calls:
    profiling lesson 13's GPT (benchmarks/profiling/profile_gpt_bf16.py, H200, 2026-11-29), 150 device_limits
    calls took 7.0 ms under cProfile, 5.0 of them in numba's context lookup, three calls a layer's step."""
    if _DRIVER.get("module") is None:
        try:
            from cuda.bindings import driver
        except ImportError:
            _DRIVER["module"] = False
            return None
        _DRIVER["module"] = driver
    driver = _DRIVER["module"]
    if driver is False:
        return None
    try:
        err, dev = driver.cuCtxGetDevice()
    except Exception:  # no driver library: numba's lookup says why
        return None
    return int(dev) if err == driver.CUresult.CUDA_SUCCESS else None


_DRIVER: dict = {}  # "module": cuda.bindings.driver, or False where it does not import


def device_limits() -> dict:
    """The limits tile shapes are chosen from. On the simulator: those of a T4-class GPU (48 KB/block), with no
    compute capability (every instruction runs), or those of simulated_gpu() with its compute capability."""
    if not has_gpu():
        name = simulated_gpu()
        if name:
            d = DEVICES[name]
            return {"name": f"CUDA simulator as a {d.name}", "cc": d.cc, "sms": d.sms,
                    "shared_per_block": d.shared_per_block, "shared_optin": d.dynamic_shared_per_block,
                    "shared_per_sm": d.shared_per_sm, "regs_per_sm": d.regs_per_sm, "regs_per_block": d.regs_per_sm,
                    "max_threads_per_sm": d.max_threads_per_sm, "max_blocks_per_sm": d.max_blocks_per_sm,
                    "warp": d.warp}
        return {"name": "CUDA simulator", "cc": None, "sms": 1, "shared_per_block": 48 * 1024,
                "shared_optin": 64 * 1024, "shared_per_sm": 64 * 1024, "regs_per_sm": 65536, "regs_per_block": 65536,
                "max_threads_per_sm": 1024, "max_blocks_per_sm": 16, "warp": 32}
    known = _LIMITS.get(_current_device_id())
    if known is not None:
        return dict(known)
    dev = get_cuda().get_current_device()
    if dev.id in _LIMITS:  # each attribute is a driver call: ask once per device, not on every launch
        return dict(_LIMITS[dev.id])
    cc = dev.compute_capability
    _LIMITS[dev.id] = {
        "name": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
        "cc": cc,
        "sms": dev.MULTIPROCESSOR_COUNT,
        # static shared memory: 48 KB a block at most. Past that a kernel needs dynamic shared memory and an
        # opt-in (kernels/_launch.allow_dynamic_shared), up to shared_optin (227 KB on an H100).
        "shared_per_block": min(dev.MAX_SHARED_MEMORY_PER_BLOCK, 48 * 1024),
        "shared_optin": _optin(dev),
        "shared_per_sm": dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        "regs_per_sm": dev.MAX_REGISTERS_PER_MULTIPROCESSOR,
        "regs_per_block": dev.MAX_REGISTERS_PER_BLOCK,
        "max_threads_per_sm": dev.MAX_THREADS_PER_MULTIPROCESSOR,
        "max_blocks_per_sm": getattr(dev, "MAX_BLOCKS_PER_MULTIPROCESSOR", 16),
        "warp": dev.WARP_SIZE,
    }
    return dict(_LIMITS[dev.id])
