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
import math
import re
import sys
import threading

import numpy as np

from .core import exercise, tolerance

L07, L08, L09, L10 = "07_gpu_numba", "08_first_flash_kernel", "09_register_fa2", "10_tuning"

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


def _not_implemented(fn) -> bool:
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


def _kernel_of(t, fn, *args):
    """fn(*args) -> a kernel (the exercise's builder), failing clearly if it is not one."""
    kernel = t.call(*args, fn=fn)
    if not _is_kernel(kernel):
        raise t.fail(f"your builder should return the @cuda.jit kernel it defines; got {type(kernel).__name__}")
    return kernel


def _require_kernel(t, fn):
    if _not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    if not _is_kernel(fn):
        raise t.fail(f"pass the kernel itself (the function decorated with @cuda.jit); got {type(fn).__name__}")


def _threads_per_block(fn, name, default):
    py = getattr(fn, "py_func", None) or getattr(fn, "fn", None) or fn
    value = getattr(py, "__globals__", {}).get(name, default)
    return int(value) if isinstance(value, (int, np.integer)) else default


# ------------------------------------------------------------------------------------------ lesson 07
@exercise("block_sums", lesson=L07, time_limit=30,
          hint="Each thread loads one element (0 past the end of x) into a shared array of TPB floats, "
               "cuda.syncthreads(), then halve the number of active threads each step (buf[t] += buf[t + s] "
               "for t < s) with a cuda.syncthreads() after every step; thread 0 writes buf[0].")
def check_block_sums(t, fn):
    _require_kernel(t, fn)
    tpb = _threads_per_block(fn, "TPB", 32)
    specs = [("one block", tpb), ("four full blocks", 4 * tpb), ("a short last block", 2 * tpb + 5),
             ("fewer elements than threads", 3), ("one element", 1), ("random length", int(t.rng.integers(1, 5 * tpb)))]
    for label, n in specs:
        # Positive values: a sum that cancels to ~0 has an unbounded relative error even when computed right.
        x = (np.abs(t.normal(n, np.float64)) + 0.5).astype(np.float32)
        blocks = -(-n // tpb)
        t.case(label, "n need not be a multiple of TPB: threads past the end of x add 0." if n % tpb else None,
               n=n, TPB=tpb, grid=blocks)
        out = np.full(blocks, np.nan, np.float32)
        (got,) = launch(t, fn, blocks, tpb, [x, out], [1])
        ref = np.add.reduceat(x.astype(np.float64), np.arange(0, n, tpb))
        t.compare(got, ref, "out", dtype=np.float32)


@exercise("transpose_tiled", lesson=L07, time_limit=30,
          hint="Read a[r, c] with r = blockIdx.y*TILE + ty, c = blockIdx.x*TILE + tx into tile[ty, tx]; "
               "cuda.syncthreads(); write out[blockIdx.x*TILE + ty, blockIdx.y*TILE + tx] = tile[tx, ty]. "
               "Guard both the read and the write with the array bounds.")
def check_transpose_tiled(t, fn):
    _require_kernel(t, fn)
    tile = _threads_per_block(fn, "TILE", 8)
    specs = [("one tile", tile, tile), ("ragged edges", tile + 5, tile + 2), ("a wide matrix", 3, 2 * tile + 1),
             ("a tall matrix", 2 * tile + 1, 1),
             ("random shape", int(t.rng.integers(1, 2 * tile + 1)), int(t.rng.integers(1, 2 * tile + 1)))]
    for label, rows, cols in specs:
        a = t.normal((rows, cols), np.float32)
        grid = (-(-cols // tile), -(-rows // tile))
        t.case(label, "The matrix need not be a multiple of TILE: guard reads and writes." if rows % tile or cols % tile
               else None, a=(rows, cols), TILE=tile, grid=grid, block=(tile, tile))
        out = np.full((cols, rows), np.nan, np.float32)
        (got,) = launch(t, fn, grid, (tile, tile), [a, out], [1])
        t.compare(got, a.T, "out", dtype=np.float32)
        log = t.last_log
        if log.active and not any(arr.w_tid.max() >= 0 for arr in log.arrays if arr.block is not None):
            raise t.fail("right answer, but no shared tile: write a[r, c] into a TILE x TILE shared array and "
                         "write the transposed tile out, so that both the reads of a and the writes of out are "
                         "coalesced (consecutive threads, consecutive addresses)")


# ------------------------------------------------------------------------------------------ lesson 08
def _attention_case_specs(t):
    # label, d, block_q, block_k, Nq, Nk, causal, q scale, hint
    from .attention import CAUSAL, HUGE, NQ_NK, RAGGED

    return [
        ("one tile", 8, 8, 8, 8, 8, False, 1, None),
        ("ragged tails", 8, 8, 4, 13, 11, False, 1, RAGGED),
        ("more keys than queries", 16, 4, 8, 5, 29, False, 1, NQ_NK),
        ("causal", 8, 8, 4, 13, 13, True, 1, CAUSAL),
        ("causal, Nq > Nk", 8, 8, 4, 20, 7, True, 1, CAUSAL),
        ("block_k > block_q, causal", 8, 4, 8, 6, 17, True, 1, CAUSAL),
        ("huge logits (scores ~ 1e4)", 8, 8, 4, 9, 10, False, 100, HUGE),
    ]


@exercise("flash_shared_kernel", lesson=L08, time_limit=45,
          hint="For each key c of the tile that the row may see (k0 + c < n_k, and k0 + c <= row when causal): "
               "s = q_row . K[c]; m_new = max(m, s); alpha = exp(m - m_new); p = exp(s - m_new); "
               "l = l * alpha + p; acc = acc * alpha + p * V[c]; m = m_new.")
def check_flash_shared_kernel(t, fn):
    from .attention import check_forward

    if _not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    for label, d, bq, bk, nq, nk, causal, qs, hint in _attention_case_specs(t):
        Q, K, V = t.normal((nq, d), np.float32, qs), t.normal((nk, d), np.float32), t.normal((nk, d), np.float32)
        t.case(label, hint, Q=(nq, d), K=(nk, d), dtype="float32", causal=causal, block_q=bq, block_k=bk,
               grid=-(-nq // bq))
        kernel = _kernel_of(t, fn, d, bq, bk, causal)
        scale = np.float32(1 / math.sqrt(d))

        def run(Kp, Vp, kernel=kernel, Q=Q, bq=bq):
            O = np.full(Q.shape, np.nan, np.float32)
            lse = np.full(Q.shape[0], np.nan, np.float32)
            return tuple(launch(t, kernel, -(-Q.shape[0] // bq), bq, [Q, Kp, Vp, O, lse, scale], [3, 4]))

        check_forward(t, run(K, V), Q, K, V, causal, bq, bk, rerun=run)


# ------------------------------------------------------------------------------------------ lesson 09
@exercise("scores_microtile", lesson=L09, time_limit=45,
          hint="Per x: copy your RM values of Q (column x) and RN values of K into local arrays a and b, then "
               "do the RM x RN multiply-adds acc[i, j] += a[i] * b[j] from registers. That is RM + RN shared "
               "reads per x instead of 2 * RM * RN.")
def check_scores_microtile(t, fn):
    if _not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    # label, d, block_q, block_k, tr, tc, Nq, Nk
    specs = [("one tile, 2 x 2 per thread", 8, 8, 8, 4, 4, 8, 8),
             ("ragged tails", 8, 8, 8, 4, 4, 13, 11),
             ("4 x 4 per thread", 4, 16, 8, 4, 2, 20, 5),
             ("4 x 2 per thread, ragged", 16, 8, 8, 2, 4, 7, 15)]
    for label, d, bq, bk, tr, tc, nq, nk in specs:
        rm, rn = bq // tr, bk // tc
        Q, K = t.normal((nq, d), np.float32), t.normal((nk, d), np.float32)
        grid = (-(-nq // bq), -(-nk // bk))
        t.case(label, "The last tiles are partial: write only the elements inside S." if nq % bq or nk % bk else None,
               Q=(nq, d), K=(nk, d), block_q=bq, block_k=bk, tr=tr, tc=tc, micro_tile=(rm, rn), grid=grid)
        kernel = _kernel_of(t, fn, d, bq, bk, tr, tc)
        scale = np.float32(1 / math.sqrt(d))
        S = np.full((nq, nk), np.nan, np.float32)
        (got,) = launch(t, kernel, grid, tr * tc, [Q, K, S, scale], [2])
        ref = Q.astype(np.float64) @ K.astype(np.float64).T * float(scale)
        t.compare(got, ref, "S", dtype=np.float32)
        log = t.last_log
        if log.active:
            reads, want = log.max_reads_per_thread(), (rm + rn) * d
            if reads > want:
                raise t.fail(f"S is right, but a thread read shared memory {reads} times; with a {rm} x {rn} micro-tile "
                             f"register tiling needs (RM + RN) * d = {want} reads ({2 * rm * rn * d} without reuse)")


IN_REGISTERS = {  # snippet -> (stays in registers?, why)
    "A": (True, "the loop has a constant trip count, so it is unrolled and every index is a constant"),
    "B": (False, "n is a kernel argument: the loop cannot be unrolled, so acc[j] has a run-time index"),
    "C": (False, "t % 4 depends on threadIdx: an index known only at run time needs addressable (local) memory"),
    "D": (True, "R is a Python constant captured when the kernel is built: range(R) unrolls like range(4)"),
    "E": (False, "300 floats per thread exceed the 255 registers a thread can have: the rest spills"),
}


@exercise("in_registers", lesson=L09,
          hint="A local array stays in registers only when the compiler can resolve every index to a constant "
               "(loops of compile-time length, fully unrolled) and the array fits in the 255 registers a thread "
               "may use.")
def check_in_registers(t, fn):
    t.case("your answers")
    out = t.call(fn=fn)
    if not isinstance(out, dict):
        raise t.fail(f"return a dict like {{'A': True, 'B': False, ...}}; got {type(out).__name__}")
    missing = sorted(set(IN_REGISTERS) - set(out))
    if missing:
        raise t.fail(f"answer every snippet; missing {', '.join(missing)}")
    for key, (want, why) in IN_REGISTERS.items():
        if not isinstance(out[key], (bool, np.bool_)):
            raise t.fail(f"answer {key} with True or False; got {out[key]!r}")
        if bool(out[key]) != want:
            raise t.fail(f"snippet {key}: you said {bool(out[key])}", hint=f"snippet {key}: {why}.")


# ------------------------------------------------------------------------------------------ lesson 10
def shared_bytes(d, block_q, block_k, tc):
    """Shared memory of flashlab's register kernel, as lesson 10's exercise states it (a test checks that
    it equals flashlab.kernels.register.Tile.shared_bytes)."""
    return 4 * (d * (block_q + 4) + max(d * (block_k + 4), block_k * (block_q + 4)) + block_k * (d + 8)
                + tc * (block_q + 4))


def registers_estimate(d, block_q, block_k, tr, tc):
    """Floats a thread keeps in registers: O micro-tile, S micro-tile, m, l and the two operand vectors,
    plus 24 for addresses and loop counters (the model of lesson 10's exercise)."""
    rm, rn, rd = block_q // tr, block_k // tc, d // tc
    return rm * rd + rm * rn + 3 * rm + rn + rd + 24


def tile_fits_reference(d, block_q, block_k, tr, tc, shared_limit=48 * 1024, max_regs=255):
    if block_q % tr or block_k % tc or d % tc:
        return False
    if tr * tc > 1024:
        return False
    if shared_bytes(d, block_q, block_k, tc) > shared_limit:
        return False
    return registers_estimate(d, block_q, block_k, tr, tc) <= max_regs


def _why_not(d, bq, bk, tr, tc, shared_limit, max_regs):
    if bq % tr or bk % tc or d % tc:
        return "the threads do not divide the tile evenly (tr | block_q, tc | block_k and tc | d)"
    if tr * tc > 1024:
        return f"{tr * tc} threads per block; at most 1024"
    sb = shared_bytes(d, bq, bk, tc)
    if sb > shared_limit:
        return f"it needs {sb} bytes of shared memory; the limit is {shared_limit}"
    regs = registers_estimate(d, bq, bk, tr, tc)
    if regs > max_regs:
        return f"it needs about {regs} registers per thread; the limit is {max_regs}"
    return f"it fits: {sb} bytes of shared memory (limit {shared_limit}), about {regs} registers (limit {max_regs})"


@exercise("tile_fits", lesson=L10,
          hint="Check, in order: the threads divide the tile (tr | block_q, tc | block_k, tc | d); tr * tc <= "
               "1024; shared bytes <= shared_limit (<=, not <); the register estimate <= max_regs.")
def check_tile_fits(t, fn):
    cases = [("the Tile() dataclass default, d = 64", 64, 64, 32, 16, 8, 48 * 1024, 255),
             ("d = 128 and a big tile: too much shared memory", 128, 64, 64, 16, 8, 48 * 1024, 255),
             ("exactly at the shared-memory limit", 64, 64, 32, 16, 8, shared_bytes(64, 64, 32, 8), 255),
             ("one byte short", 64, 64, 32, 16, 8, shared_bytes(64, 64, 32, 8) - 1, 255),
             ("too many registers per thread", 128, 32, 32, 2, 4, 48 * 1024, 255),
             ("tc does not divide d", 20, 32, 32, 8, 8, 48 * 1024, 255),
             ("tr does not divide block_q", 64, 48, 32, 32, 8, 48 * 1024, 255),
             ("more than 1024 threads", 16, 64, 64, 64, 32, 48 * 1024, 255),
             ("a tight register budget", 64, 64, 32, 16, 8, 48 * 1024, 64)]
    for _ in range(25):
        d = int(t.rng.choice([16, 32, 64, 128]))
        cases.append(("random tile", d, int(2 ** t.rng.integers(3, 8)), int(2 ** t.rng.integers(3, 8)),
                      int(2 ** t.rng.integers(1, 6)), int(2 ** t.rng.integers(1, 5)), 48 * 1024,
                      int(t.rng.choice([64, 128, 255]))))
    for label, d, bq, bk, tr, tc, limit, regs in cases:
        t.case(label, d=d, block_q=bq, block_k=bk, tr=tr, tc=tc, shared_limit=limit, max_regs=regs)
        out = t.call(d, bq, bk, tr, tc, shared_limit=limit, max_regs=regs)
        if not isinstance(out, (bool, np.bool_)):
            raise t.fail(f"return True or False; got {type(out).__name__} {out!r:.40}")
        want = tile_fits_reference(d, bq, bk, tr, tc, limit, regs)
        if bool(out) != want:
            raise t.fail(f"you said {bool(out)}; the answer is {want}: {_why_not(d, bq, bk, tr, tc, limit, regs)}")


class _FakeGPU:
    """A clock and a workload for the benchmarking exercise: call k takes durations[k] seconds."""

    def __init__(self, durations):
        self.durations, self.now, self.calls = list(durations), 0.0, 0

    def clock(self):
        return self.now

    def work(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


@exercise("median_time", lesson=L10,
          hint="Call fn() `warmup` times without timing it, then `reps` times, each between two clock() "
               "readings; return the median of those reps durations (statistics.median or np.median).")
def check_median_time(t, fn):
    for label, warmup, reps, first in [("the example", 3, 20, 2.0), ("one warm-up call", 1, 5, 30.0),
                                       ("no warm-up asked", 0, 7, 1e-3), ("an even number of reps", 2, 10, 5.0),
                                       ("random", int(t.rng.integers(1, 5)), int(t.rng.integers(5, 40)), 10.0)]:
        base = 1e-3 * (1 + 0.1 * t.rng.random(warmup + reps))
        spikes = t.rng.random(warmup + reps) < 0.15
        base[spikes] *= 20  # a busy machine: some samples are far too slow
        durations = np.concatenate([[first], base[1:]]) if warmup else base
        gpu = _FakeGPU(durations)
        t.case(label, "Only the reps after the warm-up are timed; the first call pays for compilation."
               if warmup else None, warmup=warmup, reps=reps, first_call_s=float(durations[0]))
        out = t.call(gpu.work, gpu.clock, warmup=warmup, reps=reps)
        if gpu.calls != warmup + reps:
            raise t.fail(f"fn() was called {gpu.calls} times; expected warmup + reps = {warmup + reps}")
        t.scalar(out, float(np.median(durations[warmup:])), "the median time", tol=1e-9)


def predicted_tflops_reference(ffma, issued, issue_busy_pct, sms, clock_ghz):
    return sms * 4 * 32 * 2 * clock_ghz * 1e9 * (issue_busy_pct / 100) * (ffma / issued) / 1e12


_TFLOPS_SLIPS = [(0.5, "each FFMA is 2 FLOPs (a multiply and an add) per thread"),
                 (100.0, "issue_busy_pct is a percentage: divide it by 100"),
                 (0.25, "each SM has 4 schedulers, each issuing one instruction per cycle"),
                 (1e3, "the answer is in TFLOP/s (1e12 FLOP/s); clock_ghz is in GHz (1e9 cycles/s)"),
                 (1e-3, "the answer is in TFLOP/s (1e12 FLOP/s); clock_ghz is in GHz (1e9 cycles/s)")]


@exercise("predicted_tflops", lesson=L10,
          hint="peak FLOP/s = sms * 4 schedulers * 32 threads * 2 FLOPs * clock_ghz * 1e9; multiply by "
               "issue_busy_pct / 100 and by ffma / issued, then divide by 1e12.")
def check_predicted_tflops(t, fn):
    cases = [("the H100 at its FP32 peak", 1e9, 1e9, 100.0, 132, 1.98),
             ("flashlab's register kernel on an H100", 1.0758e9, 1.8687e9, 75.63, 132, 1.98),
             ("the textbook kernel on an H100", 1.0821e9, 3.1721e9, 49.16, 132, 1.98),
             ("a T4 (40 SMs, 1.59 GHz), half busy", 3e8, 5e8, 50.0, 40, 1.59)]
    for _ in range(4):
        issued = float(t.rng.uniform(1e8, 1e10))
        cases.append(("random profile", float(issued * t.rng.uniform(0.1, 1.0)), issued,
                      float(t.rng.uniform(5, 100)), int(t.rng.integers(10, 200)), float(t.rng.uniform(0.8, 2.5))))
    for label, ffma, issued, busy, sms, ghz in cases:
        t.case(label, ffma=ffma, issued=issued, issue_busy_pct=busy, sms=sms, clock_ghz=ghz)
        out = t.call(ffma, issued, busy, sms, ghz)
        want = predicted_tflops_reference(ffma, issued, busy, sms, ghz)
        if isinstance(out, (int, float, np.integer, np.floating)) and not isinstance(out, (bool, np.bool_)) \
                and want and np.isfinite(float(out)):
            for ratio, why in _TFLOPS_SLIPS:
                if abs(float(out) / want - ratio) < 1e-6 * ratio:
                    raise t.fail(f"you returned {float(out):.4g}, {ratio:g} times the answer {want:.4g}: {why}")
        t.scalar(out, want, "the predicted TFLOP/s", tol=1e-9)
