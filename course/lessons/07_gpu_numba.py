# %% [markdown]
# # 07 · GPU programming with Numba: grids, blocks, threads, shared memory
#
# **After this lesson you can**
# - write a Numba CUDA kernel, pick its grid and block sizes, and guard the threads past the end of the data;
# - draw what is inside an SM, say what a warp and a warp scheduler are, and why an SM needs many resident
#   warps to hide the time an instruction waits for its operands;
# - count the 32-byte sectors a warp's load touches, and tell a coalesced access from a wasteful one;
# - share data between the threads of a block through shared memory, with `cuda.syncthreads()` in the
#   right places, and recognise the races you get without it;
# - say what the CUDA simulator is good for (running and debugging the same code without a GPU) and what it
#   cannot do (Numba's warp functions, speed, registers);
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
# ## Where the threads run: the streaming multiprocessor
#
# A GPU is a set of **streaming multiprocessors** (SMs) that share one L2 cache and the device memory. The
# hardware gives every block of a grid to one SM, where the block stays until all its threads are done; an
# SM runs several blocks at a time when it has room for them. Here is one SM of the H100 the course is
# measured on, and one of the T4 that Google Colab lends, drawn to the numbers in NVIDIA's documents:

# %%
from flashlab import hardware
from flashlab import memory_access as ma
from flashlab.viz import memory_access as maviz
from flashlab.viz import sm as smviz

smviz.plot_sm(("H100", "T4"));

# %% [markdown]
# An SM is four **partitions** (NVIDIA's profiler calls them SM sub-partitions, SMSPs). Each has its own
# **warp scheduler**, a quarter of the SM's registers and a quarter of its arithmetic units: FP32 units
# ("CUDA cores") for ordinary float arithmetic and tensor cores for small matrix products (lessons 08 to 10
# use the FP32 units; lesson 15 programs the tensor cores). **Registers** are
# the fastest storage there is: a thread's local variables live in them, and the 65,536 32-bit registers
# of an SM are shared out among all the threads resident on it, so the more registers a thread needs, the
# fewer threads fit (lessons 08 and 09 count them). What does not fit in a thread's registers is *spilled*
# to local memory, which lives in device memory: slow. **Shared memory** and the **L1 data cache** are one
# on-chip memory per SM: what a kernel asks for as shared memory is carved out of it and the rest caches
# loads. **L2** is shared by all SMs, and behind it is the device memory (HBM3 on the H100, GDDR6 on the
# T4; the FlashAttention papers call it HBM either way).
#
# The figure reads its numbers from one table in the package, `flashlab.hardware.GPUS`; so does this:

# %%
for g in hardware.GPUS.values():
    print(f"{g.name:9s} {g.sms:3d} SMs x {g.partitions_per_sm} partitions = {g.schedulers} schedulers | per SM: "
          f"{g.registers_per_sm:,} registers, {g.max_warps_per_sm} warps, {g.fp32_per_sm} FP32 units, "
          f"L1+shared {hardware.size_text(g.l1_shared_per_sm)} (shared <= {hardware.size_text(g.shared_per_sm)}) | "
          f"L2 {hardware.size_text(g.l2_bytes)} | {g.memory}, {g.bandwidth / 1e9:,.0f} GB/s")
if ON_GPU:
    lim = device.device_limits()
    print(f"this GPU: {lim['name']}, {lim['sms']} SMs, {lim['regs_per_sm']:,} registers and "
          f"{lim['shared_per_sm'] // 1024} KB of shared memory per SM")

# %% [markdown]
# Sources: CUDA C++ Programming Guide, "Compute Capabilities" (Table 27 and the sections on compute
# capability 7.x and 9.0: units, 4 warp schedulers and the L1/shared capacity per SM); the Hopper and Turing
# Tuning Guides ("Occupancy"; H100's 50 MB L2); the H100 and Turing architecture whitepapers, which draw
# each partition with its scheduler and a 16,384 x 32-bit register file; the H100 SXM and T4 datasheets
# (SM counts, memory, bandwidth). Shared memory per block above 48 KB needs dynamic shared memory and an
# opt-in (next section); most of the course's kernels stay within 48 KB.
#
# ## Warps, and how an SM hides waiting
#
# The SM does not schedule threads one by one. It cuts each block into **warps** of 32 consecutive threads
# (threads 0-31 of a block are warp 0, threads 32-63 warp 1, and so on; a thread's place in its warp is its
# **lane**, 0 to 31) and hands each warp to one of its four schedulers for good ("An SM statically
# distributes its warps among its schedulers", Programming Guide). Every cycle, each scheduler picks one of
# its warps that is ready and **issues** that warp's next instruction, for its 32 threads at once. An H100
# partition has 32 FP32 units, so a warp's FP32 instruction goes through in one cycle; a T4 partition has
# 16, and there it takes two (Turing Tuning Guide).
#
# A warp is not always ready. The workhorse of every matrix product is the fused multiply-add, FMA
# (`c = a * b + c` in one instruction, FFMA in FP32): its result can be used 4 cycles after it issues
# (Turing Tuning Guide, the same on Volta). A load from device memory takes hundreds of cycles (CUDA C++
# Best Practices Guide, "Memory Instructions"). A warp whose next instruction needs such a result waits,
# and the scheduler issues another warp's instruction instead, at no cost. This is how a GPU hides latency:
# it keeps many warps in flight and switches between them every cycle. One scheduler, each of its warps
# running a chain of FMAs that each need the previous one's result:

# %%
smviz.plot_latency_hiding(warps=(1, 2, 4), latency=4, cycles=24);

# %% [markdown]
# With 4 cycles between dependent FMAs a scheduler needs 4 warps to issue on every cycle, or fewer warps
# that each have several independent FMAs to issue in a row (instruction-level parallelism). The Turing
# Tuning Guide counts it per SM: 16 warps without instruction-level parallelism, or 4 warps with 4
# independent FMAs each. Waiting for memory takes many more. The warps an SM holds at once, its **resident**
# warps, are all its schedulers can choose from: at most 64 per SM on an H100 and 32 on a T4, fewer when
# the blocks need many registers or much shared memory (lesson 08's occupancy). What the block size alone
# allows, with the limits from the table:

# %%
for tpb in (32, 48, 128, 256, 1024):
    warps = -(-tpb // 32)  # a partial warp still takes a whole warp
    row = []
    for name in ("H100", "T4"):
        g = hardware.GPUS[name]
        blocks = min(g.max_blocks_per_sm, g.max_warps_per_sm // warps)
        row.append(f"{name}: {blocks:2d} blocks = {blocks * warps:2d} warps")
    print(f"{tpb:5d} threads per block = {warps:2d} warps ({32 * warps - tpb:2d} idle lanes) | " + " | ".join(row))

# %% [markdown]
# Block sizes are multiples of 32 for this reason: 48 threads take two warps, and 16 lanes of the second do
# nothing. A block of 32 threads is one warp, and an H100 SM holds at most 32 blocks, so such blocks leave
# half of its 64 warp slots empty.
#
# ## How a warp reads memory: coalescing
#
# When a warp loads from global memory, its 32 addresses go out as one request. Memory is moved in
# **sectors** of 32 aligned bytes, four to a 128-byte cache line, and a request costs as many sectors as
# the warp's bytes fall in: "the concurrent accesses of the threads of a warp will coalesce into a number of
# transactions equal to the number of 32-byte transactions necessary to service all of the threads of the
# warp" (CUDA C++ Best Practices Guide, "Coalesced Access to Global Memory", compute capability 6.0 and
# later). A sector comes whole even when one float of it is wanted. Six ways a warp can read float32
# data (a row per 128-byte line, a box per sector, a coloured bar per thread's bytes, colour = lane):

# %%
lane = np.arange(32)
patterns = {
    "consecutive floats": (4 * lane, 4),
    "shifted by one float": (4 * lane + 4, 4),
    "every other float": (8 * lane, 4),
    "one row per thread (d = 64)": (256 * lane, 4),
    "lesson 09's tile copy (d = 64)": (4 * (lane // 8 * 64 + lane % 8), 4),
    "16-byte loads, consecutive": (16 * lane, 16),
}
maviz.plot_access_grid(patterns, "sectors");

# %% [markdown]
# - **Consecutive floats**: 128 bytes in 4 sectors, nothing wasted. This is a *coalesced* access.
# - **Shifted by one float**: the same 128 bytes straddle 5 sectors. CUDA's allocations start on a
#   256-byte boundary (CUDA C++ Programming Guide, "Device Memory Accesses"), so this comes from offsets:
#   a row of a matrix whose length is not a multiple of 8 floats, say.
# - **Every other float**: 8 sectors for 128 useful bytes, half of what moves is wasted.
# - **One row per thread**: in a row-major K with d = 64 floats per row, thread i reading row i. Every
#   thread gets a sector of its own: 32 sectors, 1,024 bytes moved for 128 used. A tile copy where each
#   thread copies "its" row does this on every load.
# - **Lesson 09's tile copy**: runs of 8 threads read 8 adjacent floats (one sector) of a row, 4 rows per
#   warp. The warp touches 4 rows and still wastes nothing.
# - **16-byte loads**: a thread can load 2 or 4 adjacent floats with one instruction (an 8- or 16-byte
#   vector load, from an address that is a multiple of 8 or 16); 32 threads x 16 bytes = 512 bytes in 16
#   sectors, fully used.
#
# The same count for a warp reading a block of a row-major float32 matrix, with a given number of
# consecutive threads on each row:

# %%
for lanes_per_row in (32, 16, 8, 4, 2, 1):
    rows, cols = ma.tile_access(lanes_per_row, row_len=64)
    cost = ma.coalescing(4 * (rows * 64 + cols), nbytes=4)
    print(f"{lanes_per_row:2d} threads per row, {32 // lanes_per_row:2d} rows: {cost['sectors']:2d} sectors, "
          f"{cost['bytes_fetched']:4d} bytes fetched for {cost['bytes_used']}, efficiency {cost['efficiency']:4.0%}")

# %% [markdown]
# Eight threads per row is enough: they fill a sector. The model counts what one instruction asks for.
# Caches can soften a bad pattern, since a sector one warp fetched may still be in L1 or L2 when a
# neighbouring warp asks for it: the Best Practices Guide measured a misaligned copy on a V100 at about
# 9/10 of full speed, where the sector count predicts 4/5. Lesson 08 turns to shared memory, whose rule
# (banks) is different; the explorer at its end shows both.
#
# ## Shared memory and barriers
#
# Threads of one block can talk through **shared memory**: on-chip SRAM, far faster than HBM but slower
# than registers. It is the SRAM of the FlashAttention papers: where tiles of K and V live while a block
# works on them. How much one block may use depends on how it asks. Arrays of a size fixed at compile time
# (*static* shared memory) get at most 48 KB per block on every GPU; beyond that a kernel must use
# *dynamic* shared memory and opt in explicitly, and then an H100 gives one block up to 227 KB (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"; NVIDIA Hopper Tuning Guide).
# Real FlashAttention kernels use that room for bigger tiles and more pipeline stages. In numba-cuda,
# `cuda.shared.array(n, dtype)` with a constant n > 0 is static; with n = 0 it is dynamic, sized by the
# launch's fourth argument (`kernel[grid, block, stream, nbytes]`). numba-cuda (0.30) has no public call for the
# opt-in, but its driver wrapper has the one CUDA uses (`cuKernelSetAttribute` with
# `MAX_DYNAMIC_SHARED_SIZE_BYTES`): `flashlab.kernels._launch.allow_dynamic_shared` calls it, and
# `benchmarks/experiments/probe_dynamic_shared.py` shows an H100 refusing a 100 KB block without it and running it with
# it. Most of flashlab's kernels still size their tiles to fit 48 KB of static shared memory, which keeps
# them simple and lets the same code run on a T4; the tensor-core backward of lesson 17 is the one that
# needs more.
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
# - Numba's warp-level functions (`cuda.shfl_down_sync` and the votes) do not exist there, which is why the
#   kernels of lessons 08 to 10 reduce through shared memory instead; lesson 16 reaches warp shuffles, votes
#   and tensor cores through PTX, with flashlab's own emulation of each for the simulator;
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
    print("—: not measured here (no torch) or not in the recorded file yet (benchmarks/generators/lesson_facts.py)")
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
# **Exercises:** [07_gpu_numba](../exercises/07_gpu_numba.ipynb): a block sum in shared memory, a tiled
# transpose whose reads and writes are both coalesced, and a sector counter for a warp's request.
