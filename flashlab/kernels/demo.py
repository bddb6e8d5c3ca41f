"""Small demonstration kernels that lessons 07, 09, 15 and 17 run, and benchmarks/generators/lesson_facts.py measures.

    empty                      a kernel that does nothing: its launch cost is all there is (lesson 07)
    sums_unrolled, sums_dynamic  R running sums per thread, indexed by a constant or a run-time loop (lesson 09)
    host_time_us(fn, reps)     host wall time per call over back-to-back calls
    launch_cost()              time per launch of `empty`: CUDA events around one launch, host clock over many
    torch_launch_cost()        the same for one small kernel launched by torch (C++), and `empty` given a tensor
    local_memory_cost()        registers, local memory and time of the two sums kernels (GPU only)
    kernel_source(kernel)      the Python source of a kernel, for printing in a lesson
    ldmatrix_both              one warp reads 32 rows of shared memory with ldmatrix.x4 and ldmatrix.x4.trans
                               (lessons 15 and 17)

The lesson and the script call the same functions, so the numbers a lesson quotes without a GPU
(flashlab/data/lesson_facts.json, read by flashlab.bench.load_lesson_facts) are measured the way the
lesson measures them on one.
"""
from __future__ import annotations

import inspect
import time

import numpy as np
from numba import float32

from ..device import get_cuda
from . import mma

cuda = get_cuda()  # a module global, so the simulator can swap in its fake module

R = 16  # running sums per thread in the sums kernels: a compile-time constant


@cuda.jit
def empty(x):
    pass


@cuda.jit
def sums_unrolled(x, w, out):
    i = cuda.grid(1)
    acc = cuda.local.array(R, float32)
    for j in range(R):
        acc[j] = 0.0
    for step in range(x.shape[0]):
        for j in range(R):  # constant trip count: unrolled, acc[j] -> registers
            acc[j] += x[step] * w[j]
    if i < out.shape[0]:
        for j in range(R):
            out[i, j] = acc[j]


@cuda.jit
def sums_dynamic(x, w, out, r):
    i = cuda.grid(1)
    acc = cuda.local.array(R, float32)
    for j in range(r):
        acc[j] = 0.0
    for step in range(x.shape[0]):
        for j in range(r):  # trip count known at run time only: acc[j] -> local memory
            acc[j] += x[step] * w[j]
    if i < out.shape[0]:
        for j in range(r):
            out[i, j] = acc[j]


@cuda.jit
def ldmatrix_both(rows, plain, trans):
    """32 rows of 16 bytes (rows: (32, 4) uint32) into shared memory, then read back by one warp with
    ldmatrix.x4 and with ldmatrix.x4.trans: plain and trans get each lane's 4 registers."""
    sh = cuda.shared.array(128, np.uint32)  # 32 rows of 8 halves = 4 words
    lane = cuda.threadIdx.x
    for w in range(4):
        sh[lane * 4 + w] = rows[lane, w]
    cuda.syncthreads()
    start = np.intp(lane * 4)  # lane 8m + r points at row r of matrix m
    p = mma.ldmatrix_x4(sh, start)
    q = mma.ldmatrix_x4_trans(sh, start)
    for i in range(4):
        plain[lane, i] = p[i]
        trans[lane, i] = q[i]


def kernel_source(kernel) -> str:
    """The source of a @cuda.jit kernel (numba keeps the Python function as py_func; the simulator as fn)."""
    fn = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None) or kernel
    return inspect.getsource(fn)


def host_time_us(fn, reps):
    """Host wall time per call of fn over `reps` back-to-back calls, synchronised at both ends (µs)."""
    fn()
    cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def launch_cost(reps: int = 200, loop: int = 2000) -> dict:
    """Cost of launching `empty[1, 32]` with a device-array argument, on a GPU. Returns µs:

    event_us   CUDA events recorded around one launch, median of `reps`: the GPU sits idle from the first
               event until the kernel arrives, so this includes everything the host does for the launch;
    host_us    host wall time per launch over `loop` back-to-back launches (then one synchronize).
    """
    from ..bench import time_cuda

    dummy = cuda.device_array(1, np.float32)
    launch = lambda: empty[1, 32](dummy)  # noqa: E731
    event_us = time_cuda(launch, warmup=5, reps=reps)["median_ms"] * 1e3
    return {"event_us": event_us, "host_us": host_time_us(launch, loop)}


def torch_launch_cost(reps: int = 200, loop: int = 2000) -> dict:
    """For comparison with launch_cost (GPU and torch needed). Returns µs:

    torch_event_us, torch_host_us   the two timings of torch's Tensor.zero_ on a 1-element CUDA tensor: one
                                    small kernel launched from C++ through torch's dispatcher;
    numba_torch_arg_host_us         host time per launch of `empty` given that torch tensor instead of a
                                    numba device array (numba converts the tensor on every call).
    """
    import torch  # optional: only torch tensors come here

    from ..bench import time_cuda

    t = torch.zeros(1, device="cuda")
    zero = lambda: t.zero_()  # noqa: E731
    with_tensor = lambda: empty[1, 32](t)  # noqa: E731
    return {"torch_event_us": time_cuda(zero, warmup=5, reps=reps)["median_ms"] * 1e3,
            "torch_host_us": host_time_us(zero, loop),
            "numba_torch_arg_host_us": host_time_us(with_tensor, loop)}


def local_memory_cost(n_steps: int = 4096, threads: int = 65536, reps: int = 20) -> dict:
    """Registers, local memory (bytes per thread) and median time (ms) of sums_unrolled and sums_dynamic,
    both launched as threads // 32 blocks of 32 threads over n_steps values of x. GPU only."""
    from ..bench import time_cuda

    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal(n_steps).astype(np.float32))
    w = cuda.to_device(np.ones(R, np.float32))
    out = {}
    for name, kernel, extra in (("unrolled", sums_unrolled, ()), ("dynamic", sums_dynamic, (R,))):
        res = cuda.device_array((threads, R), np.float32)
        args = (x, w, res) + extra
        launch = lambda: kernel[threads // 32, 32](*args)  # noqa: E731
        ms = time_cuda(launch, warmup=2, reps=reps)["median_ms"]  # the first call compiles
        compiled = kernel.overloads[kernel.signatures[0]]
        out[name] = {"registers": int(compiled.regs_per_thread), "local_bytes": int(compiled.local_mem_per_thread),
                     "ms": ms}
    return out
