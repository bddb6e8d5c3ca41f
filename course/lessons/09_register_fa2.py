# %% [markdown]
# # 09 · Register-resident FlashAttention-2: local arrays, unrolling, register tiling
#
# **After this lesson you can**
# - keep a thread's slice of O, m and l in registers with `cuda.local.array`, and say when the compiler
#   instead puts such an array in (slow) local memory;
# - read the register and spill counts of a compiled kernel, and what they cost;
# - split a tile of S and of O among threads in micro-tiles, and count the shared-memory reads it saves;
# - run flashlab's register kernel and compare its resources with the textbook kernel's.

# %%
import numpy as np
from numba import float32

import flashlab
from flashlab import device, reference_attention, relative_error
from flashlab.kernels import flash_attention, kernel_info
from flashlab.kernels.register import Tile
from flashlab.viz import gpu as gviz

cuda = device.get_cuda()
ON_GPU = device.has_gpu()
rng = np.random.default_rng(0)

# %% [markdown]
# ## Registers are not memory
#
# A thread's registers are the fastest storage on the GPU, and there are many (64K 32-bit registers per
# SM), but they have no addresses: an instruction names a register, it cannot compute which one to use.
# So `acc = cuda.local.array(8, float32)` can live in registers only if every `acc[j]` has a `j` the
# compiler knows, which in practice means loops of constant length that it unrolls. An index known only at
# run time forces the array into **local memory**: per-thread memory that lives in DRAM behind the
# caches (CUDA C++ Programming Guide, "Device Memory Accesses", local memory). The same happens when a
# thread needs more than its 255 registers: the excess **spills**.
#
# Two versions of the same little kernel (`flashlab/kernels/demo.py`): each thread keeps `R = 16` running
# sums of `x * w`. The first loops over `range(R)` with `R` a constant; the second over `range(r)` with `r`
# an argument (equal to R).

# %%
from flashlab.kernels import demo

print(demo.kernel_source(demo.sums_unrolled))
print(demo.kernel_source(demo.sums_dynamic))

# %%
R = demo.R
n_steps, threads = device.kernel_size(4096, 8), device.kernel_size(65536, 32)  # small in the simulator
x, w = cuda.to_device(rng.standard_normal(n_steps).astype(np.float32)), cuda.to_device(np.ones(R, np.float32))
outs = {name: cuda.device_array((threads, R), np.float32) for name in ("unrolled", "dynamic")}
demo.sums_unrolled[threads // 32, 32](x, w, outs["unrolled"])
demo.sums_dynamic[threads // 32, 32](x, w, outs["dynamic"], R)
print("same results:", np.allclose(outs["unrolled"].copy_to_host(), outs["dynamic"].copy_to_host()))

if ON_GPU:
    cost = demo.local_memory_cost(n_steps=n_steps, threads=threads)
    print(f"measured on this GPU ({n_steps} steps, {threads} threads):")
else:
    facts = flashlab.bench.load_lesson_facts()
    cost = facts["local_memory"]
    print("In the simulator both are plain Python: registers, local memory and their cost only exist in code\n"
          f"compiled for a GPU. Recorded on {facts['gpu']} ({cost['n_steps']} steps, {cost['threads']} threads;\n"
          f"flashlab/data/lesson_facts.json, source: {facts['source']}):")
for name in ("unrolled", "dynamic"):
    c = cost[name]
    print(f"  sums_{name:9s} registers {c['registers']:3d}, local memory {c['local_bytes']:3d} B/thread, {c['ms']:.3f} ms")
print(f"  the dynamic one takes {cost['dynamic']['ms'] / cost['unrolled']['ms']:.1f}x as long")

# %% [markdown]
# On a GPU, `sums_unrolled` reports 0 bytes of local memory and `sums_dynamic` room for its 16 floats
# (64 bytes): every `acc[j] +=` of the second one becomes a load and a store to memory instead of one
# register instruction, and the time shows it. Note which count gives the problem away: the local-memory
# count, not the register count (an array moved to memory frees registers, so that count can even drop).
# numba-cuda exposes these counts for each compiled kernel (`get_regs_per_thread()`,
# `get_local_mem_per_thread()`), and `flashlab.kernels.kernel_info` reads them for the attention
# kernels. The rule for the rest of this lesson: **local arrays of constant size, indexed only by
# counters of constant-length loops.**
#
# ## Register tiling
#
# Lesson 08's kernel made one shared-memory read per multiply-add. Give each thread a small rectangle of
# S instead: with an `RM x RN` micro-tile, a thread loads `RM` values of Q and `RN` values of K for one
# `x` into registers, then does `RM · RN` multiply-adds with them. The same for `O += P V` with an
# `RM x RD` micro-tile of O. Here a 32 x 16 tile of S computed by 8 x 4 threads, each a 4 x 4 micro-tile:

# %%
gviz.plot_micro_tiles(block_q=32, block_k=16, tr=8, tc=4);

# %% [markdown]
# Reads per multiply-add fall from 1 to `(RM + RN) / (RM · RN)`: half with 4 x 4, a quarter with 8 x 8.
# Larger micro-tiles need more registers per thread (the `RM · RN` scores and `RM · RD` outputs), so
# the size is a trade against occupancy, which lesson 10 measures.

# %%
gviz.plot_reads_per_fma();

# %% [markdown]
# ## The register kernel
#
# flashlab's `variant="register"` (`flashlab/kernels/register.py`) runs FA2's forward algorithm with this
# register tiling on plain FP32 units:
#
# - a block of `tr x tc` threads owns `block_q` query rows; thread `(ty, tx)` owns `RM` rows, `RN` keys of
#   each S tile and `RD = d / tc` columns of O;
# - O, m and l are local arrays of constant size, indexed only by unrolled loops: registers, no spills;
# - S is computed from `RM + RN` shared reads per step, the row maximum and row sum are combined across
#   the `tc` threads of a row through a small shared buffer (no warp shuffles: Numba's simulator has none,
#   and this kernel runs there unchanged), and P goes back to shared memory (over the K tile) for the `P V`
#   product;
# - K and V tiles are copied from global memory one element per thread: 8 consecutive threads read 8
#   adjacent elements of one row (one 32-byte sector in float32), so one load instruction of a warp reads
#   pieces of 4 rows; O is divided by l once, at the end (FA2, arXiv 2307.08691, Section 3.1).
#
# This is not how the real FlashAttention-2 kernel splits the work. There, each warp owns whole rows of
# the S tile (the block's query rows are split across its warps, arXiv 2307.08691, Section 3.3) and
# computes them with tensor-core instructions. Their results stay in the warp's registers, which the CUDA
# code rearranges into the operand of the next tensor-core product, `P V`: P never goes through shared
# memory, and a row's maximum and sum are combined inside the warp with shuffles. numba-cuda has no
# tensor-core API and its simulator no shuffles, so this kernel, written in plain Numba, splits each row over
# `tc` threads and passes P through shared memory instead, one of the costs lesson 10 measures. Lesson 15
# writes the real layout, reaching `mma`, shuffles and votes through PTX (with flashlab's own emulation of
# each for the simulator).
#
# It gives the same answers as the textbook kernel:

# %%
B, H, d = 1, 2, device.kernel_size(64, 16)
nq, nk = device.kernel_size(1000, 19), device.kernel_size(1000, 24)
q, k, v = (rng.standard_normal((B, H, n, d)).astype(np.float32) for n in (nq, nk, nk))
tile = None if ON_GPU else Tile(16, 8, 4, 4)  # a tiny tile keeps the simulated launch short
for causal in (False, True):
    o, lse = flash_attention(q, k, v, causal=causal, variant="register", tile=tile)
    o_ref, lse_ref = reference_attention(q, k, v, causal=causal)
    print(f"causal={causal!s:5}: O error {relative_error(o, o_ref):.1e}, lse error {relative_error(lse, lse_ref):.1e}")

# %% [markdown]
# ## What it costs the GPU
#
# `kernel_info` reports, for the configuration a call would use, registers and spill bytes per thread
# (from the compiler: GPU only), shared memory per block and theoretical occupancy:

# %%
for variant in ("shared", "register"):
    info = kernel_info(64, variant=variant)
    keep = ("block_q", "block_k", "threads_per_block", "micro_tile", "registers_per_thread",
            "local_bytes_per_thread", "shared_bytes_per_block", "occupancy", "limited_by")
    print(variant, {key: info[key] for key in keep if key in info})

sweep = gviz.load_tile_sweep()
if not ON_GPU and sweep:
    print(f"\nrecorded on {sweep[0]['gpu']} (flashlab/data/tile_sweep.csv), d = 64:")
    for row in [r for r in sweep if r["d"] == 64][:6]:
        print(f"  block_q={row['block_q']:3d} block_k={row['block_k']:3d} threads={row['tr']}x{row['tc']}: "
              f"{row['registers']} registers, {row['local_bytes']} B spilled, {row['tflops']} TFLOP/s")

# %% [markdown]
# `local_bytes_per_thread == 0` is the check that O, m and l really stayed in registers; a change that
# makes an index dynamic (or a micro-tile too large) shows up there first, and in the run time right after.
# The simulator cannot show any of this: it has no compiler and no registers, which is why the recorded
# sweep above (when present) comes from a GPU run.
#
# **Exercises:** [09_register_fa2](../exercises/09_register_fa2.ipynb): a register-tiled micro-tile of S
# (the checker counts your shared-memory reads), the row max and sum shared by the threads of a row, and
# which local arrays stay in registers.
