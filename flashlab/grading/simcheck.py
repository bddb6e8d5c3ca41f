"""Lessons 07-10: checkers for the kernel exercises, and `racecheck`, a shared-memory race detector for the
CUDA simulator.

Kernel exercises are graded by launching the learner's kernel on small shapes (a few blocks of <= 64
threads, so a check takes seconds in the simulator) and comparing with NumPy. In the simulator, every
launch also runs under `racecheck`, which watches each shared array and reports, with the thread and the
element, what compute-sanitizer's racecheck/initcheck would report on a GPU:

- a thread reads an element another thread wrote since the last `cuda.syncthreads()` both passed
  (missing barrier between loading a tile and using it),
- a thread overwrites an element another thread read in the same phase (missing barrier before the next
  tile is loaded over the one still in use),
- a thread reads an element no thread of its block has written (uninitialised shared memory: garbage,
  possibly NaN, on a GPU), and negative indices (which NumPy would silently wrap around).

Nothing here imports numba until a check runs: `import flashlab.grading` stays fast.
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import re
import sys
import threading

import numpy as np


RACE_HINT = ("Every thread must pass a cuda.syncthreads() between writing a shared element and another "
             "thread reading it, and between reading it and another thread overwriting it (the next tile).")


# ------------------------------------------------------------------------------------------ racecheck
class SharedAccessLog:
    """What racecheck found in one launch: problems (strings), reads/writes per thread, arrays seen."""

    def __init__(self, limit=5):
        self.problems, self.count, self.limit = [], 0, limit
        self.reads, self.writes = {}, {}  # (block, thread) -> number of shared-memory element accesses
        self.arrays = []
        self.lock = threading.Lock()

    def report(self, text):
        self.count += 1
        if len(self.problems) < self.limit:
            self.problems.append(text)

    def max_reads_per_thread(self) -> int:
        return max(self.reads.values(), default=0)

    def __bool__(self):
        return self.count > 0

    def summary(self) -> str:
        if not self.count:
            return "racecheck: no shared-memory hazards found"
        more = f" (and {self.count - len(self.problems)} more)" if self.count > len(self.problems) else ""
        return f"racecheck: {self.count} hazard(s){more}\n  " + "\n  ".join(self.problems)


class _Tracked:
    """A shared array that tells the log about every element read and written."""

    def __init__(self, array, name, log):
        self.a, self.name, self.log = array, name, log
        n = array.size
        self.block = None
        self.w_tid = np.full(n, -2, np.int64)  # -2: not written in this block
        self.w_epoch = np.zeros(n, np.int64)
        self.r_tid = np.full(n, -2, np.int64)  # -1: read by several threads in r_epoch
        self.r_epoch = np.full(n, -1, np.int64)

    shape = property(lambda self: self.a.shape)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    dtype = property(lambda self: self.a.dtype)

    def __len__(self):
        return len(self.a)

    def _where(self, idx):
        """Flat element indices of idx, refusing negative indices (out of bounds on a GPU)."""
        key = idx if isinstance(idx, tuple) else (idx,)
        if all(isinstance(i, (int, np.integer)) for i in key):
            if len(key) != self.a.ndim:
                return np.arange(self.a.size).reshape(self.a.shape)[idx].ravel()
            for i, n in zip(key, self.a.shape):
                if i < 0 or i >= n:
                    raise IndexError(f"index {tuple(int(i) for i in key)} is out of bounds for shared array "
                                     f"{self.name} of shape {self.a.shape}")
            return [int(np.ravel_multi_index(tuple(int(i) for i in key), self.a.shape))]
        return np.arange(self.a.size).reshape(self.a.shape)[idx].ravel()

    def _who(self):
        th = threading.current_thread()
        block = tuple(getattr(th, "blockIdx", (0, 0, 0)))
        return th, block, getattr(th, "thread_id", 0), getattr(th, "_flashlab_epoch", 0)

    def _enter_block(self, block):
        if block != self.block:  # blocks run one after the other; each starts with fresh shared memory
            self.block = block
            self.w_tid[:] = -2
            self.r_tid[:] = -2
            self.r_epoch[:] = -1

    def _element(self, flat):
        return f"{self.name}[{', '.join(map(str, np.unravel_index(flat, self.a.shape)))}]"

    def __getitem__(self, idx):
        flat = self._where(idx)
        th, block, tid, epoch = self._who()
        log = self.log
        with log.lock:
            self._enter_block(block)
            log.reads[(block, tid)] = log.reads.get((block, tid), 0) + len(flat)
            for f in flat:
                w = self.w_tid[f]
                if w == -2:
                    log.report(f"thread {_tname(th)} of block {_bname(block)} read {self._element(f)} before any "
                               f"thread of its block wrote it (uninitialised shared memory: garbage, maybe NaN, "
                               f"on a GPU)")
                elif w != tid and self.w_epoch[f] == epoch:
                    log.report(f"thread {_tname(th)} of block {_bname(block)} read {self._element(f)}, which thread "
                               f"{w} wrote with no cuda.syncthreads() in between (read-after-write race)")
                if self.r_epoch[f] == epoch and self.r_tid[f] != tid:
                    self.r_tid[f] = -1
                elif self.r_epoch[f] != epoch:
                    self.r_epoch[f], self.r_tid[f] = epoch, tid
        return self.a[idx]

    def __setitem__(self, idx, value):
        flat = self._where(idx)
        th, block, tid, epoch = self._who()
        log = self.log
        with log.lock:
            self._enter_block(block)
            log.writes[(block, tid)] = log.writes.get((block, tid), 0) + len(flat)
            for f in flat:
                r = self.r_tid[f]
                if self.r_epoch[f] == epoch and r != tid and r != -2:
                    who = "other threads" if r == -1 else f"thread {r}"
                    log.report(f"thread {_tname(th)} of block {_bname(block)} overwrote {self._element(f)} while "
                               f"{who} could still be reading it: no cuda.syncthreads() in between "
                               f"(write-after-read race)")
                elif self.w_tid[f] not in (-2, tid) and self.w_epoch[f] == epoch:
                    log.report(f"threads {self.w_tid[f]} and {_tname(th)} of block {_bname(block)} both wrote "
                               f"{self._element(f)} with no cuda.syncthreads() in between (write-after-write race)")
                self.w_tid[f], self.w_epoch[f] = tid, epoch
        self.a[idx] = value


def _tname(th):
    idx = tuple(getattr(th, "threadIdx", (0, 0, 0)))
    while len(idx) > 1 and idx[-1] == 0:
        idx = idx[:-1]
    return str(idx[0]) if len(idx) == 1 else str(idx)


def _bname(block):
    block = tuple(block)
    while len(block) > 1 and block[-1] == 0:
        block = block[:-1]
    return str(block[0]) if len(block) == 1 else str(block)


def _array_name(filename, lineno):
    line = linecache.getline(filename, lineno).strip()
    m = re.match(r"(\w+)\s*=", line)
    return m.group(1) if m else f"(shared array at line {lineno})"


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def racecheck(limit=5):
    """Track every shared array of the kernels launched inside the block (CUDA simulator only).

        with racecheck() as log:
            kernel[grid, block](...)
        print(log.summary())

    The log holds the first `limit` hazards, their count, and shared reads/writes per thread. On a GPU it
    does nothing (log.active is False): use `compute-sanitizer --tool racecheck python script.py` there.
    """
    from numba import config

    log = SharedAccessLog(limit)
    log.active = bool(config.ENABLE_CUDASIM)
    if not log.active:
        yield log
        return
    from ..device import get_cuda

    get_cuda()
    from numba.core import types
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    alloc_lock = threading.Lock()

    with _PATCH_LOCK:
        shared_cls, thread_cls = kernelapi.FakeCUDAShared, sim_kernel.BlockThread
        orig_array, orig_sync = shared_cls.array, thread_cls.syncthreads

        def array(self, shape, dtype, alignment=None):
            if shape == 0:  # dynamic shared memory: left as it is
                return orig_array(self, shape, dtype, alignment)
            frame = sys._getframe(1)
            key = (frame.f_code.co_filename, frame.f_lineno)
            with alloc_lock:  # the first threads of a block arrive together: one array for all of them
                res = self._allocations.get(key)
                if res is None:
                    if isinstance(dtype, types.Type):
                        dtype = numpy_support.as_dtype(dtype)
                    res = _Tracked(np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else
                                   np.zeros(shape, dtype), _array_name(*key), log)
                    log.arrays.append(res)
                    self._allocations[key] = res
            return res

        def syncthreads(self):
            orig_sync(self)
            self._flashlab_epoch = getattr(self, "_flashlab_epoch", 0) + 1

        shared_cls.array, thread_cls.syncthreads = array, syncthreads
        try:
            yield log
        finally:
            shared_cls.array, thread_cls.syncthreads = orig_array, orig_sync


# ---------------------------------------------------------------------------------- launching helpers
def _cuda():
    from ..device import get_cuda

    return get_cuda()


def _simulator() -> bool:
    from ..device import has_gpu

    return not has_gpu()


def _source(fn) -> str:
    py = getattr(fn, "py_func", None) or getattr(fn, "fn", None) or fn
    try:
        return inspect.getsource(py)
    except (OSError, TypeError):
        return ""


def not_implemented(fn) -> bool:
    """A blank left as generated (on a GPU a kernel's `raise` does not reach Python, so look at the source)."""
    src = "\n".join(line.split("#")[0] for line in _source(fn).splitlines())
    return "raise NotImplementedError" in src


def _is_kernel(obj) -> bool:
    return hasattr(obj, "py_func") or type(obj).__name__ in ("FakeCUDAKernel", "CUDADispatcher")


def launch(t, kernel, grid, block, host_args, outputs, what="your kernel"):
    """Copy host_args to the device, launch kernel[grid, block] (under racecheck in the simulator), fail on
    an exception or a hazard, and return the arrays at the indices `outputs` copied back to the host."""
    cuda = _cuda()
    dev = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in host_args]

    def run():
        kernel[grid, block](*dev)
        cuda.synchronize()

    with racecheck() as log:
        t.call(fn=run)
    if log:
        raise t.fail(f"{what} has a shared-memory hazard (found by the simulator's race check)",
                     details=log.problems + ([f"... {log.count - len(log.problems)} more"]
                                             if log.count > len(log.problems) else []),
                     hint=RACE_HINT)
    t.last_log = log
    return [dev[i].copy_to_host() for i in outputs]


def kernel_of(t, fn, *args):
    """fn(*args) -> a kernel (the exercise's builder), failing clearly if it is not one."""
    kernel = t.call(*args, fn=fn)
    if not _is_kernel(kernel):
        raise t.fail(f"your builder should return the @cuda.jit kernel it defines; got {type(kernel).__name__}")
    return kernel


def require_kernel(t, fn):
    if not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    if not _is_kernel(fn):
        raise t.fail(f"pass the kernel itself (the function decorated with @cuda.jit); got {type(fn).__name__}")


def threads_per_block(fn, name, default):
    py = getattr(fn, "py_func", None) or getattr(fn, "fn", None) or fn
    value = getattr(py, "__globals__", {}).get(name, default)
    return int(value) if isinstance(value, (int, np.integer)) else default


