# %% [markdown]
# # 07 · GPU programming with Numba: grids, blocks, threads, shared memory
#
# **After this lesson you can**
# - write a Numba CUDA kernel, pick its grid and block sizes, and guard the threads past the end of the data;
# - share data between the threads of a block through shared memory, with `cuda.syncthreads()` in the
#   right places, and recognise the races you get without it;
# - say what the CUDA simulator is good for (running and debugging the same code without a GPU) and what it
#   cannot do (warp shuffles, speed, registers);
# - explain why a kernel launch costs tens of microseconds, and what that means for FlashAttention.
#
# Lessons 03–06 ran the FlashAttention algorithm in NumPy. From here on it runs as GPU kernels written in
# Python with Numba (`numba-cuda`), on a GPU when there is one and in Numba's CUDA simulator otherwise.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from numba import float32

import flashlab
from flashlab import device
from flashlab.grading.simcheck import racecheck
from flashlab.viz import gpu as gviz

cuda = device.get_cuda()  # numba.cuda, after flashlab picked the GPU or the simulator
ON_GPU = device.has_gpu()
print("backend:", device.backend())

# %% [markdown]
# ## Grids, blocks, threads
#
# A kernel is one function run by many threads at once. The threads come in **blocks** (up to 1024
# threads each, run together on one streaming multiprocessor, SM), and the blocks form a **grid**. Inside
# the kernel, `cuda.threadIdx.x` says which thread of its block this is, `cuda.blockIdx.x` which block,
# and `cuda.blockDim.x` how many threads a block has (CUDA C++ Programming Guide, "Thread Hierarchy").
# With one element per thread, thread `threadIdx.x` of block `blockIdx.x` handles element
# `i = blockIdx.x * blockDim.x + threadIdx.x`:

# %%
gviz.plot_thread_map(n=21, threads_per_block=8);

# %% [markdown]
# The grid is a whole number of blocks, so when `n` is not a multiple of the block size the last block
# has threads with nothing to do. Every kernel needs that guard, `if i < n`. Here is the smallest useful
# kernel, `out = x + y`, launched as `kernel[blocks, threads_per_block](arguments)`:

# %%
@cuda.jit
def add(x, y, out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[0]:  # the last block's extra threads do nothing
        out[i] = x[i] + y[i]


n, tpb = device.kernel_size(1_000_000, 100), 32  # the simulator costs ~0.1 ms per thread
x, y = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
x_d, y_d = cuda.to_device(x), cuda.to_device(y)  # copy to GPU memory once
out_d = cuda.device_array(n, np.float32)
blocks = (n + tpb - 1) // tpb  # ceil(n / tpb)
add[blocks, tpb](x_d, y_d, out_d)
print(f"{blocks} blocks of {tpb} threads; correct:", np.array_equal(out_d.copy_to_host(), x + y))

# %% [markdown]
# `cuda.to_device` copies an array to the GPU and `copy_to_host` brings it back. Passing NumPy arrays
# straight to a kernel also works, but then Numba copies every argument both ways on every launch.
#
# ## Shared memory and barriers
#
# Threads of one block can talk through **shared memory**: on-chip SRAM, a few dozen KB per block
# (48 KB is all a numba-cuda kernel can ask for), far faster than HBM but slower than registers. It is
# the SRAM of the FlashAttention papers: where tiles of K and V live while a block works on them.
#
# When one thread reads what another wrote, the write must happen first. `cuda.syncthreads()` is a
# barrier: no thread of the block passes it until all have reached it. The classic use is a sum over a
# block, as a tree: each step halves the number of active threads, and each step reads what the previous
# one wrote, so a barrier separates the steps:

# %%
gviz.plot_reduction_tree();

# %% [markdown]
# A smaller example of the same rule: each block reverses its chunk of `x`. Thread `t` writes element
# `t` and reads element `TPB - 1 - t`, written by another thread.

# %%
TPB = 16


def make_reverse(barrier):
    @cuda.jit
    def reverse_chunks(x, out):
        buf = cuda.shared.array(TPB, float32)
        t = cuda.threadIdx.x
        i = cuda.blockIdx.x * TPB + t
        buf[t] = x[i]
        if barrier:
            cuda.syncthreads()  # wait until every thread of the block has written its element
        out[i] = buf[TPB - 1 - t]

    return reverse_chunks


x = np.arange(2 * TPB, dtype=np.float32)
for barrier in (True, False):
    out = np.zeros_like(x)
    with racecheck() as log:
        make_reverse(barrier)[2, TPB](x, out)
    print(f"barrier={barrier}: first chunk {out[:TPB]}")
    print("   ", "\n    ".join(log.summary().splitlines()[:2]) if log.active else "(race check: simulator only)")

# %% [markdown]
# Without the barrier, a thread may read its partner's element before the partner wrote it. On a GPU the
# result depends on timing (the 32 threads of a warp often, but since Volta not always, execute together,
# so it may *look* right for blocks of up to 32 threads and break later); in the simulator threads run one after another, so the mistake is
# almost always visible. flashlab's `racecheck()` (used by the exercise checker) watches every shared
# array in the simulator and names the thread and element of each race; on a GPU the tool for the same
# job is `compute-sanitizer --tool racecheck`.
#
# ## The simulator and its limits
#
# Without a GPU, `NUMBA_ENABLE_CUDASIM=1` makes `numba.cuda` a simulator written in Python: each CUDA
# thread of a block becomes an operating-system thread, `cuda.syncthreads()` a barrier between them, and
# blocks run one after another. The same kernel source runs, so everything in lessons 07–10 runs on a
# laptop, and you can `print` or set a breakpoint inside a kernel. But
#
# - it is slow: from a tenth of a millisecond to a millisecond per thread per launch, depending on the
#   kernel, so keep simulated launches to a few blocks of at most a few dozen threads;
# - warp-level functions (`cuda.shfl_down_sync` and the votes) do not exist there, which is why flashlab's
#   kernels reduce through shared memory instead;
# - registers, spills, occupancy and timing are properties of the compiled code on a real GPU: the
#   simulator has none of them (lesson 09 shows them from a GPU run).

# %%
print("warp shuffles available:", hasattr(cuda, "shfl_down_sync"))


@cuda.jit
def touch(out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[0]:
        out[i] = i


counts = flashlab.size([32, 128, 512, 2048], [8, 16, 32, 64])
seconds = []
for threads in counts:
    buf = cuda.device_array(threads, np.float32)
    touch[max(1, threads // 32), min(threads, 32)](buf)  # first launch compiles (on a GPU): not timed
    start = time.perf_counter()
    touch[max(1, threads // 32), min(threads, 32)](buf)
    cuda.synchronize()
    seconds.append(time.perf_counter() - start)
gviz.plot_launch_cost(counts, seconds, label="GPU" if ON_GPU else "CUDA simulator");

# %% [markdown]
# On the simulator the cost grows with every thread; on a GPU it is flat: thousands of threads cost the
# same as one, because what you pay for is the launch itself.
#
# ## Launch overhead
#
# Starting a kernel is not free: Python checks and packs the arguments, the driver queues the launch, and
# the GPU starts the blocks. Timed with CUDA events (lesson 10 explains why not with `time.perf_counter`):

# %%
@cuda.jit
def empty(x):
    pass


if ON_GPU:
    from flashlab.bench import time_cuda

    dummy = cuda.device_array(1, np.float32)
    t = time_cuda(lambda: empty[1, 32](dummy), warmup=5, reps=200)
    print(f"one launch of an empty kernel: {t['median_ms'] * 1e3:.1f} µs (median of 200)")
else:
    print("no GPU: on the project's H100, one launch with device-array arguments costs about 26 µs")

# %% [markdown]
# About 26 µs per launch on the project's H100 (more when torch tensors are passed directly: convert once
# with `cuda.as_cuda_array`). In 26 µs that GPU can do about 1.7 GFLOP of FP32 arithmetic, more than the
# whole forward pass of attention for one head at N = 1024 (4·N²·d = 0.27 GFLOP at d = 64). So kernels
# must be few and big: one launch that does all of attention (every batch, head and query block as one
# grid), not one per head or per tile. That is what FlashAttention's single fused kernel is, and what
# lesson 08 starts to build.
#
# **Exercises:** [07_gpu_numba](../exercises/07_gpu_numba.ipynb): a block sum in shared memory, and a tiled
# transpose whose reads and writes are both coalesced.
