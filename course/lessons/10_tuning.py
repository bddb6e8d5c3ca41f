# %% [markdown]
# # 10 · Tuning and benchmarking: tile sizes, the roofline, PyTorch
#
# **After this lesson you can**
# - time a GPU kernel honestly: CUDA events, warm-up, median;
# - sweep the tile shape of the register kernel and read the result (speed, registers, occupancy);
# - place flashlab's kernels and PyTorch's on a roofline and say which limit each one meets;
# - read a profile of issue slots and explain how far a compute-bound kernel is from the FP32 peak;
# - compare flashlab with PyTorch from a benchmark run, and say what the comparison does and does not show;
# - say how a grid of blocks fills the GPU in waves, what limits the blocks an SM holds, and when cutting the
#   keys into chunks (split-KV) or launching causal blocks heaviest first shortens the tail;
# - read a shape suite, and say why the host time of a Python call matters for short calls and how
#   flashlab keeps it small.

# %%
import math

import numpy as np

import flashlab
from flashlab import device
from flashlab.bench import attention_flops, tflops
from flashlab.viz import gpu as gviz

ON_GPU = device.has_gpu()
print("GPU:", device.device_limits()["name"])

# %% [markdown]
# ## Timing a kernel
#
# Three rules, all built into `flashlab.bench.time_cuda`:
#
# 1. **CUDA events, not the host clock.** A launch returns before the kernel has run; events recorded on
#    the GPU's stream before and after the work measure the GPU's time (CUDA C++ Best Practices Guide,
#    "Using CUDA GPU Timers").
# 2. **Warm up first.** Numba compiles a kernel on its first call (seconds); caches and clocks settle too.
# 3. **Median of many.** On a shared machine a few samples are slow for reasons that have nothing to do
#    with your kernel; the median ignores them, the mean does not.
#
# FLOPs are counted as the papers do: 4·B·H·N²·d for the forward (halved when causal).

# %%
B, H, N, d = 1, 16, 4096, 64
print(f"forward FLOPs at B={B} H={H} N={N} d={d}: {attention_flops(B, H, N, N, d) / 1e9:.1f} GFLOP")

# %% [markdown]
# ## Sweeping tile shapes
#
# The register kernel's configuration is `(block_q, block_k, tr, tc)`: tile size and thread layout. The
# best one depends on the GPU (registers, shared memory per SM, SM count) and on d, so we measure. On a GPU
# this cell times a few shapes live; otherwise it shows the sweep recorded on the project's H200 (the
# H100's SM with faster memory) by `benchmarks/timing/bench_kernels.py` (`flashlab/data/tile_sweep.csv`).

# %%
rows = gviz.load_tile_sweep()
if ON_GPU:
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import flash_attention, kernel_info
    from flashlab.kernels.register import Tile
    from tqdm.auto import tqdm

    limit = device.device_limits()["shared_per_block"]
    q, k, v = (torch.randn(B, H, N, d, device="cuda") for _ in range(3))
    candidates = [Tile(bq, bk, tr, tc) for bq, bk, tr, tc in
                  [(64, 32, 16, 8), (64, 32, 8, 8), (64, 64, 16, 8), (32, 32, 8, 8), (64, 16, 16, 4),
                   (128, 16, 32, 4), (32, 64, 8, 8), (128, 32, 32, 8)]]
    rows = []
    for tile in tqdm(candidates, desc="tiles"):
        try:
            tile.check(d, limit)
        except ValueError:
            continue
        ms = time_cuda(lambda: flash_attention(q, k, v, tile=tile), warmup=2, reps=20)["median_ms"]
        info = kernel_info(d, tile=tile)
        rows.append({"gpu": info["device"], "N": N, "d": d, "block_q": tile.block_q, "block_k": tile.block_k,
                     "tr": tile.tr, "tc": tile.tc, "registers": info["registers_per_thread"],
                     "local_bytes": info["local_bytes_per_thread"], "occupancy": info["occupancy"],
                     "shared_bytes": info["shared_bytes_per_block"],
                     "tflops": tflops(attention_flops(B, H, N, N, d), ms)})
print(f"{len(rows)} configurations" + ("" if ON_GPU else " (recorded)" if rows else
                                       ": no GPU and no recorded sweep in flashlab/data/tile_sweep.csv"))

# %% [markdown]
# Each cell is one tile shape, showing the best of the thread layouts tried for it (★ marks the fastest
# overall). Switch the metric and compare. In the recorded sweep, at d = 64 the fastest tile also has the
# highest occupancy (25%, shared with a slower tile); at d = 128 it does not (19%, against 31% for the tiles
# with the most resident warps). Occupancy is one input to speed, not a score to maximise. (No recorded tile
# spills, `local_bytes` = 0 everywhere; a spilling tile would lose, as lesson 09 measured.) (Without
# widgets, or in the fast mode, a grid of the main metrics.)

# %%
gviz.tile_explorer(rows);

# %% [markdown]
# ## On the roofline
#
# Lesson 08 computed the intensity of a FA2 forward from its HBM traffic: about `block_q / 2` FLOPs per
# byte in float32, above the H100's FP32 ridge point. So both flashlab kernels are, by the roofline,
# *compute*-bound: the ceiling that matters is the FP32 rate, and how close a kernel gets to it is
# decided inside the SM (lessons 08 and 09). PyTorch's SDPA in float32 uses tensor cores (3xTF32),
# a different and higher roof; in float16 it is higher still. Lesson 16's tensor-core kernel is on the
# plot too (float16 and 3xTF32, `flashlab/data/h100_tensor.csv`), under the `mma.sync` ceilings a
# Numba kernel reaches (measured by `benchmarks/timing/mma_ceiling.py`): the roofs that bound it. Its
# float16 point sits left of its roof's ridge by this traffic model; lesson 16 shows why memory still does
# not bound it.

# %%
results, source = gviz.load_forward_results()
at = {r["impl"]: r["tflops"] for r in results if r.get("N") == N and r.get("d") == d}
points = {}
for impl, block_q in (("flashlab shared fp32", 64), ("flashlab register fp32", 128), ("torch SDPA fp32", 64)):
    if impl in at and np.isfinite(at[impl]):
        points[impl] = (gviz.kernel_intensity(N, d, block_q), at[impl] * 1e12)
if "torch SDPA fp16" in at:
    points["torch SDPA fp16"] = (gviz.kernel_intensity(N, d, 128, bytes_per_element=2), at["torch SDPA fp16"] * 1e12)
from flashlab.viz import tensor as tviz

points.update(tviz.tensor_roofline_points(tviz.load_tensor_results(), N=N, d=d))
print("from", source, "and flashlab/data/h100_tensor.csv,", tviz.mma_ceiling_file().name, "(tensor kernel, mma ceilings)")
gviz.plot_kernel_roofline(points, roofs=tviz.mma_roofs(tviz.load_mma_ceiling()));

# %% [markdown]
# ## Inside the SM: where the issue slots go
#
# Compute-bound, then, but how far from the FP32 roof, and why? Each SM of an H100 has four schedulers,
# and each can issue one warp instruction per cycle. The FP32 peak is every scheduler issuing an FFMA (a
# fused multiply-add: 2 FLOPs for each of 32 threads) on every cycle. Anything else a scheduler issues,
# and every cycle it issues nothing, is lost. So, to a good approximation:
#
#     fraction of the FP32 peak  =  (fraction of cycles a scheduler issues)  x  (FFMA share of what it issues)
#
# Nsight Compute (`ncu`) measures both. `benchmarks/profiling/profile_issue_slots.py` profiles one launch of each
# kernel at B = 1, H = 16, N = 4096, d = 64 and saves the counts in `flashlab/data/issue_profile.csv`
# (recorded on an H100; run the script on a machine where `ncu` may read the GPU's counters to profile
# yours). Left: the instructions issued per FFMA, by kind. Right: the two factors, their product, and the
# measured speed as a fraction of the peak.

# %%
from flashlab.roofline import PUBLISHED_FP32

profile = gviz.load_issue_profile()
for name, rec in profile.items():
    s = gviz.issue_summary(rec)
    stalls = ", ".join(f"{k} {v:.2f}" for k, v in list(s["stalls"].items())[:3])
    print(f"{name:8s} {s['tflops']:5.1f} TFLOP/s: issues on {s['issue_busy']:.0%} of cycles, "
          f"{s['ffma_share']:.0%} of it FFMA -> {s['predicted_peak_fraction']:.0%} of peak "
          f"({s['warps_per_scheduler']:.1f} warps per scheduler; top waits: {stalls})")
if profile:
    gviz.plot_issue_profile(profile, peak_tflops=PUBLISHED_FP32["H100"] / 1e12);

# %% [markdown]
# How to read it:
#
# - **The textbook kernel** issues about 2.9 instructions per FFMA. It rescales its row of O after every
#   key, one FMUL per element (0.5 per FFMA); integer work on its indices and comparisons (ALU) costs
#   another 0.6, loop control 0.4.
#   And its schedulers sit idle half the time: with about 2 warps each, nobody is ready while a warp waits
#   for its next K/V tile from global memory (ncu's "long scoreboard" stall; mostly L2 hits at this size,
#   lesson 08) or for the previous FFMA of its dot product, a chain of d dependent multiply-adds ("wait").
# - **The register kernel** issues 1.7 instructions per FFMA and keeps the schedulers busy three cycles in
#   four; its most common "stall", not_selected, means a warp was ready but another got the slot: the
#   schedulers themselves are the limit. Its micro-tiles cut the shared-memory loads to 0.12 per FFMA,
#   and the softmax runs once per tile, not once per key. What is left is bookkeeping: index arithmetic
#   and loop control (about 0.45 per FFMA), copying tiles, and the row max and sum exchanged through
#   shared memory.
#
# The product of the two factors matches the measured speed to within two points of the peak, so this
# picture accounts for where the time goes. It also prices the next 1.5x: at the same issue rate the FFMA
# share would have to rise from 58% to about 86%, that is, four fifths of the 0.74 other instructions per
# FFMA would have to go. The cheap levers do not get there (`benchmarks/results/register_experiments.md`,
# H100): unrolling the product loops 8 deep instead of 4 needs *fewer* registers (124 against 128) and is
# still slower (22.5 against 27.5 TFLOP/s); 16 and 64 deep need more registers and are slower again; capping
# the registers makes the kernel spill and slows it down. Any kernel that tries must still fit O, S and the
# softmax state of its rows into registers. For scale: cuBLAS's FP32 matrix product (no TF32), with no
# softmax to do, reaches about 77% of the peak on an H100 (51.4 of 67 TFLOP/s, same file).

# %% [markdown]
# ## Against PyTorch
#
# The benchmark script measures everything in one run, on one GPU, with the same timing rules:
#
# ```bash
# python benchmarks/timing/bench_kernels.py        # forward, backward, memory and the tile sweep; CSVs + plot
# ```
#
# (The scripts are in the course's repository, not in the installed package: in Colab, `!git clone` the
# repository named in the setup cell at the top and run them from inside the clone, on a GPU runtime.)
#
# Its results: the run committed in `benchmarks/results/forward.csv` (an H200, the H100's SM with faster
# memory; see the README there), which ships with flashlab as `flashlab/data/forward.csv`:

# %%
gviz.plot_vs_torch(results, N=N, d=d, source=f"from {source}");

# %% [markdown]
# How to read it:
#
# - The kernels of lessons 08 and 09 run on the FP32 units; SDPA in float32 uses tensor cores in 3xTF32 (on
#   the H100).
#   Even so, in the committed runs (`benchmarks/results/README.md`) the register kernel reaches 82–84% of
#   SDPA fp32 at d = 64 from N = 4096 on (42% at N = 1024, where 16 heads of 8 query blocks make 128 thread
#   blocks for 132 SMs), but only 30–35% at d = 128, where the 48 KB of static shared memory it uses keeps its
#   tiles small (lesson 07: more needs dynamic shared memory and an opt-in, which lesson 17's backward uses).
#   float16 on tensor cores is in another league (numba-cuda has no tensor-core API of its own; lesson 15
#   reaches the tensor cores through PTX).
# - On a T4 (Colab), SDPA in float32 runs on plain FP32 units: there the comparison is like for like.
# - Always measure the baseline in the same run as your kernel, and quote ratios: on a shared machine
#   absolute numbers move from run to run.
#
# **Exercises:** [10_tuning](../exercises/10_tuning.ipynb): decide whether a tile fits the shared-memory
# and register budgets, write a timing function that a compile or a hiccup cannot fool, and turn an
# issue-slot profile into the TFLOP/s it predicts.

# %% [markdown]
# ## Waves, occupancy and tails
#
# Why is N = 1024 slow when N = 4096 is not? Look at where the blocks run. An SM holds several blocks at
# once, as many as its threads, registers and shared memory allow (lesson 09's occupancy); call each place
# a **slot**, so a GPU has SMs x blocks-per-SM slots. The grid's blocks take free slots as they come, so a
# grid runs in **waves** of that many blocks. `flashlab.kernels.plan` is the one place that decides how every
# kernel of the course is launched, and it plans for any GPU from its properties, so we can plan for an
# H100 here without one (registers come from `flashlab/data/kernel_resources.csv`, compiled for each GPU
# generation by `benchmarks/generators/kernel_resources.py`; on a GPU the planner asks the compiled kernel).

# %%
from flashlab.kernels.plan import H100, T4, plan
from flashlab.viz import waves as gwaves

p1024 = plan((1, 16, 1024, 1024, 64), device=H100)
print(p1024.explain())

# %% [markdown]
# The same grid drawn on the H100's SMs over time, before the planner (left) and as planned (right). Each
# row is an SM; a cell's shade is the share of the SM's slots that hold a block (white: idle).

# %%
import matplotlib.pyplot as plt  # noqa: E402

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
gwaves.plot_timeline(p1024, splits=1, heavy_first=False, ax=axes[0], title="one block per query block")
gwaves.plot_timeline(p1024, ax=axes[1], title=f"split-KV: {p1024.splits} chunks of {p1024.chunk} keys")
fig.tight_layout()

# %% [markdown]
# With G blocks of equal work on S slots:
#
#     waves = G / S          predicted efficiency = waves / ceil(waves)
#
# Below one wave, most slots never get a block; just above a whole number of waves, the last wave is
# mostly empty: the **tail**. The planner's model goes one step further and gives each block a time in
# proportion to its work (its key tiles), handing blocks to free slots in launch order, which is what GPUs
# do in practice (CUDA does not promise an order). It is a model: a lone block on an SM runs faster than
# one of four sharing it, and the model ignores that.
#
# **Split-KV.** When the grid is too small, cut the keys into chunks and give each (query block, chunk) its
# own block. Each block writes its chunk's output o_c and log-sum-exp lse_c in float32; a second kernel
# merges them with lesson 03's rule, the same merge lesson 14's decoding kernel runs: lse = log sum_c
# exp(lse_c), o = sum_c exp(lse_c - lse) o_c. The result is the same attention, up to rounding:

# %%
from flashlab import reference_attention, relative_error  # noqa: E402
from flashlab.kernels import flash_attention  # noqa: E402

rng = np.random.default_rng(0)
nq, nk = device.kernel_size(1000, 20), device.kernel_size(4000, 200)
q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for n in (nq, nk, nk))
ref_o, ref_lse = reference_attention(q, k, v, causal=True)
for splits in (1, 3):
    o, lse = flash_attention(q, k, v, causal=True, splits=splits)
    print(f"splits={splits}: relative error of o {relative_error(o, ref_o):.1e}, of lse {relative_error(lse, ref_lse):.1e}")

# %% [markdown]
# Splitting has a price: every chunk writes a partial output, and the merge reads them all back. So the
# planner splits only when the blocks with work fill fewer than `SPLIT_BELOW_WAVES` waves, takes the fewest
# chunks whose predicted efficiency reaches `SPLIT_TARGET`, keeps chunks of at least `MIN_CHUNK` keys, and
# splits only if that beats no split by `SPLIT_GAIN` (all in `flashlab/kernels/plan.py`):

# %%
from flashlab.kernels import plan as planner  # noqa: E402

print({name: getattr(planner, name) for name in ("SPLIT_BELOW_WAVES", "SPLIT_TARGET", "SPLIT_GAIN", "MIN_CHUNK")})
for shape in [(1, 16, 1024, 1024, 64), (1, 16, 2048, 2048, 64), (1, 16, 4096, 4096, 64), (4, 16, 1024, 1024, 64)]:
    p = plan(shape, device=H100)
    print(f"B={shape[0]} H={shape[1]} N={shape[2]}: {p.unsplit[0]:.2f} waves -> {p.splits} chunk(s), "
          f"predicted efficiency {p.unsplit[1]:.0%} -> {p.efficiency:.0%}")

# %% [markdown]
# **Causal tails.** Under causal masking query block i visits i + 1 key tiles: the last blocks of a head
# are the heaviest. Launched head by head, the heavy blocks of the last heads start late and finish long
# after everything else. Launching the heaviest blocks of all heads first leaves only light blocks for the
# end (the longest-processing-time-first rule of scheduling). The planner does that for causal grids, in
# sections of heads whose K and V fit in L2 together, so the blocks running at the same time still share
# their K and V through L2. Left: head by head; right: heaviest first.

# %%
pc = plan((4, 16, 16384, 16384, 64), device=H100, causal=True)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
gwaves.plot_timeline(pc, heavy_first=False, ax=axes[0], title="head by head")
gwaves.plot_timeline(pc, ax=axes[1], title=f"heaviest first, sections of {pc.section} heads")
fig.tight_layout()
print(pc.explain())

# %% [markdown]
# Move the sliders: B·H, N, d, the GPU and causal. Left, the launch before the planner; middle, the plan;
# right, the predicted efficiency against N, with the measured flashlab / SDPA ratios of the shape suite
# (`python benchmarks/timing/bench_kernels.py --suite` writes them to `suite.csv` among the benchmark results) once
# that file exists. On a T4 the blocks per SM and the waves change with its 40 SMs and 64 KB of shared memory
# per SM. (Without widgets, or in the fast mode: the efficiency curves for d = 64 and 128.)

# %%
gwaves.wave_explorer();

# %% [markdown]
# On a GPU, time one block per query block (`splits=1`) against the plan `flash_attention` makes on its
# own, split-KV included (the cell does nothing without one):

# %%
if ON_GPU:
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels.plan import current_device

    qt, kt, vt = (torch.randn(1, 16, 1024, 64, device="cuda") for _ in range(3))
    flops = attention_flops(1, 16, 1024, 1024, 64)
    print(plan((1, 16, 1024, 1024, 64), device=current_device()).summary())
    for splits in (1, None):  # None: the planner decides
        ms = time_cuda(lambda: flash_attention(qt, kt, vt, splits=splits), warmup=2, reps=20)["median_ms"]
        print(f"splits={splits or 'planned'}: {tflops(flops, ms):.1f} TFLOP/s")

# %% [markdown]
# **Where this differs from FlashAttention.** FlashAttention-2's code splits the keys in its forward the
# same way (`num_splits_heuristic` in `csrc/flash_attn/flash_api.cpp`): no split when the grid fills at
# least 0.8 of the GPU, counted as two 128-thread blocks per SM; otherwise the fewest splits whose
# efficiency waves / ceil(waves) reaches 0.85 times the best. The course's planner counts slots from the
# kernel's own registers and shared memory, and weighs causal blocks by their work. Its thresholds were
# checked on the H100's shape suite, which times each split next to no split
# (`benchmarks/results/h100/split_decision.csv`): the register kernel's splits won on 13 of the 15 shapes
# where it split, while the tensor-core kernel's lost on 15 of 17 (its blocks are few and short already, and
# writing fp32 partial results costs more than fuller waves give back), so the tensor-core kernel splits
# only when asked. For causal attention, FlashAttention-3
# (`hopper/tile_scheduler.hpp`, `DynamicPersistentTileScheduler`) runs a *persistent* kernel, one block per SM
# that takes tile after tile from a counter, longest tiles first, in sections of heads whose K and V fit in
# L2; its newer CuTe kernels order one-block-per-tile grids the same way (`SingleTileLPTScheduler` in
# `flash_attn/cute/tile_scheduler.py`). The course launches one block per tile and lets the GPU's own
# dispatcher hand them out.
#
# **Exercise:** [10_tuning](../exercises/10_tuning.ipynb), part 4: compute the blocks per SM, occupancy and
# waves of a plan and decide how many chunks to split the keys into.

# %% [markdown]
# ## Every shape, and the host's share
#
# One shape says little: the shape suite (`python benchmarks/timing/bench_kernels.py --suite`) times 60 of them,
# B·H 16 and 64, N from 1024 to 16384, d 32, 64 and 128, causal and not, through the same
# `flash_attention` call a user makes, against SDPA in the same run. Here is the register kernel's forward
# over SDPA for B·H = 16, from the committed results of an H100 run:

# %%
import csv  # noqa: E402

suite_rows, suite_source = gwaves.load_suite()  # flashlab/data/suite.csv
fig, ax = plt.subplots(figsize=(6.4, 3.4))
for d, color in zip(gwaves.DS, ("tab:blue", "tab:orange", "tab:green")):
    for causal in (False, True):
        pts = gwaves.suite_points(suite_rows, 16, d, causal)
        ax.plot(*zip(*pts), marker="o", color=color, ls="--" if causal else "-",
                label=f"d = {d}" + (", causal" if causal else ""))
ax.axhline(1.0, color="0.5", lw=0.8)
ax.set_xscale("log")
ax.set_xticks([1024, 2048, 4096, 8192, 16384], ["1024", "2048", "4096", "8192", "16384"])
ax.set(xlabel="N", ylabel="flashlab / SDPA, float32",
       title=f"register forward, B·H 16 ({suite_source})")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()

# %% [markdown]
# Two things stand out. At d = 128 the register kernel stays near a third of SDPA at every N: its tile holds
# 32 floats of O per thread and issues fewer FMAs per loaded value, a limit of the kernel, not of the launch.
# Lessons 15 to 17's tensor-core kernels are the way past it. And the short shapes are where the launch itself
# shows: at N = 1024 SDPA finishes a whole forward in well under a millisecond, so what the *host* spends
# before the kernel starts counts.
#
# The first version of `flash_attention` spent half a millisecond on the host per call with torch tensors:
# wrapping each tensor as a Numba array, checking shapes, planning, and Numba's dispatcher typing about 70
# kernel arguments (each array is a pointer, a size, its shape and its strides). Nothing of that changes
# between two calls with the same shapes, so the first call records it all (the plan, the compiled kernel,
# the argument list with blanks for the data pointers) and later calls only fill in the pointers, allocate
# the outputs and launch (`flashlab/kernels/prepared.py`). The host time of one call on tiny inputs, measured
# by `python benchmarks/timing/bench_kernels.py --parts host`:

# %%
with open(gwaves.HOST_CSV, newline="") as f:  # flashlab/data/host.csv
    host_rows = list(csv.DictReader(f))
print(f"{host_rows[0]['gpu']}, host time of one call:")
for r in host_rows:
    print(f"  {r['call']:78s} {float(r['host_us']):7.1f} µs")
sdpa_1024 = [r for r in suite_rows if (r["direction"], r["variant"], r["B"], r["N"], r["d"], r["causal"])
             == ("forward", "register", 1, 1024, 64, 0)]
ms = attention_flops(1, 16, 1024, 1024, 64) / (sdpa_1024[0]["torch_tflops"] * 1e12) * 1e3
print(f"for scale: SDPA's whole forward at B1 H16 N1024 d64 float32 takes {ms * 1e3:.0f} µs")

# %% [markdown]
# The prepared call still takes 1.6 to 2 times SDPA's host time: two output allocations and one driver
# call from Python already cost more than PyTorch's whole C++ dispatch. Real FlashAttention is a C++/CUDA
# extension, and its launch costs what SDPA's does. `FLASHLAB_FAST_LAUNCH=0` sends every call the general
# way, if you want to see the difference yourself.
#
# **In Colab** the prepared call is off for now: it uses numba-cuda internals that the numba-cuda Colab ships
# does not have, so every call takes the general path: the general rows above, measured on the H100
# machine's host (Colab's is another CPU). `flashlab.doctor()` says which path your calls take (`fast launch`)
# and what that costs per call.
#
# **On a T4**, Colab's GPU, the same planner picks other tiles and grids: it has 40 SMs, 64 KB of shared
# memory per SM and an FP32 peak an eighth of the H100's. What the planner does with the benchmark's shape there,
# and the most any FP32 kernel can reach (no T4 run is recorded):

# %%
from flashlab.kernels import plan as kplan  # noqa: E402
from flashlab.roofline import PUBLISHED_FP32  # noqa: E402

for gpu_name in ("T4", "H100"):
    bench_plan = kplan.plan((1, 16, 4096, 64), causal=False, dtype="float32", device=gpu_name)
    print("\n".join(bench_plan.explain().splitlines()[:3]))
    print(f"  FP32 peak {PUBLISHED_FP32[gpu_name] / 1e12:.1f} TFLOP/s: the register kernel's upper bound there\n")
