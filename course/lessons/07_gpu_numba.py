# %% [markdown]
# # 07 · GPU programming with Numba: grids, blocks, threads, shared memory
#
# **After this lesson you can**
# - write a Numba CUDA kernel, pick its grid and block sizes, and guard the threads past the end of the data;
# - share data between the threads of a block through shared memory, with `cuda.syncthreads()` in the
#   right places, and recognise the races you get without it;
# - say what the CUDA simulator is good for (running and debugging the same code without a GPU) and what it
#   cannot do (warp shuffles, speed, registers);
# - measure what a kernel launch costs from Numba, tell Numba's Python dispatch apart from the CUDA launch
#   itself, and say why FlashAttention is one kernel.
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
# Threads of one block can talk through **shared memory**: on-chip SRAM, far faster than HBM but slower
# than registers. It is the SRAM of the FlashAttention papers: where tiles of K and V live while a block
# works on them. How much one block may use depends on how it asks. Arrays of a size fixed at compile time
# (*static* shared memory) get at most 48 KB per block on every GPU; beyond that a kernel must use
# *dynamic* shared memory and opt in explicitly, and then an H100 gives one block up to 227 KB (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"; NVIDIA Hopper Tuning Guide).
# Real FlashAttention kernels use that room for bigger tiles and more pipeline stages. numba-cuda's
# `cuda.shared.array` is static and it has no public call for the opt-in (numba-cuda issue #94), so
# flashlab's kernels size their tiles to fit 48 KB, which also lets the same code run on a T4 and in the
# simulator.
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
# the GPU starts the blocks. Time a kernel that does nothing (`flashlab.kernels.demo.empty`, whose body is
# `pass`) two ways: CUDA events recorded just before and after one launch (lesson 10 explains events),
# and the host clock over many launches in a row. For comparison, the same two timings of one small
# kernel that PyTorch launches from C++ (`Tensor.zero_` on a one-element tensor):

# %%
from flashlab.kernels import demo
from flashlab.roofline import PUBLISHED_FP32

if ON_GPU:
    launch = demo.launch_cost()
    launch = {"numba_event_us": launch["event_us"], "numba_host_us": launch["host_us"]}
    try:
        launch.update(demo.torch_launch_cost())
    except ImportError:  # no torch: Numba's numbers only
        pass
    print("measured on this GPU:")
else:
    facts = flashlab.bench.load_lesson_facts()
    launch = facts["launch"]
    print(f"no GPU: recorded on {facts['gpu']} (flashlab/data/lesson_facts.json, source: {facts['source']})")


def us(key):
    return f"{launch[key]:8.1f} µs" if launch.get(key) is not None else "       —   "  # —: not recorded


print(f"{'':38s} {'CUDA events':>12s}  {'host, per launch':>16s}")
print(f"{'Numba, empty kernel, device array':38s} {us('numba_event_us'):>12s}  {us('numba_host_us'):>16s}")
print(f"{'Numba, empty kernel, torch tensor':38s} {'':>12s}  {us('numba_torch_arg_host_us'):>16s}")
print(f"{'PyTorch (C++), Tensor.zero_':38s} {us('torch_event_us'):>12s}  {us('torch_host_us'):>16s}")
if None in (launch.get(k) for k in ("numba_host_us", "numba_torch_arg_host_us", "torch_event_us", "torch_host_us")):
    print("—: not measured here (no torch) or not in the recorded file yet (benchmarks/lesson_facts.py)")
flop_per_launch = launch["numba_event_us"] * 1e-6 * PUBLISHED_FP32["H100"]
print(f"at its FP32 peak an H100 does {flop_per_launch / 1e9:.1f} GFLOP in one Numba launch; one head's "
      f"attention forward at N = 1024, d = 64 is {4 * 1024**2 * 64 / 1e9:.2f} GFLOP")

# %% [markdown]
# Between the two events the GPU is idle, waiting for the host: the event time is what the host spends
# on one launch plus the GPU's own start-up. Compare Numba's line with torch's: both end in the same CUDA
# driver call, so the difference is Numba's work in Python before it (finding the compiled kernel for these
# argument types, checking and packing the arguments). The GPU is not what is slow here. Passing torch
# tensors straight to a Numba kernel costs more again, since Numba converts them on every call: convert
# once with `cuda.as_cuda_array`.
#
# Why, then, is FlashAttention one kernel? Not mainly for the launches. Run as separate matmul, softmax and
# matmul kernels, attention writes S and then P, each N × N, to HBM and reads them back (lesson 02); one
# fused kernel keeps them on chip and never does. Launch cost is the second reason, and it matters when the
# work per launch is small, as the last line above shows: launch one kernel for all of attention (every
# batch, head and query block in one grid), not one per head or per tile. Lesson 08 starts to build it;
# lesson 14 meets a case where launches add up, decoding one token at a time.
#
# **Exercises:** [07_gpu_numba](../exercises/07_gpu_numba.ipynb): a block sum in shared memory, and a tiled
# transpose whose reads and writes are both coalesced.
