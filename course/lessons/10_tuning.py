# %% [markdown]
# # 10 · Tuning and benchmarking: tile sizes, the roofline, PyTorch
#
# **After this lesson you can**
# - time a GPU kernel honestly: CUDA events, warm-up, median;
# - sweep the tile shape of the register kernel and read the result (speed, registers, occupancy);
# - place flashlab's kernels and PyTorch's on a roofline and say which limit each one meets;
# - read a profile of issue slots and explain how far a compute-bound kernel is from the FP32 peak;
# - compare flashlab with PyTorch from a benchmark run, and say what the comparison does and does not show.

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
# H100's SM with faster memory) by `benchmarks/bench_kernels.py` (`flashlab/data/tile_sweep.csv`).

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
# a different and higher roof; in float16 it is higher still. Lesson 15's tensor-core kernel is on the
# plot too (float16 and 3xTF32, `flashlab/data/h100_tensor.csv`), under the `mma.sync` ceilings a
# Numba kernel reaches (measured by `benchmarks/mma_ceiling.py`): the roofs that bound it.

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
print("from", source, "and benchmarks/results/h100/ (tensor kernel, mma ceilings)")
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
# Nsight Compute (`ncu`) measures both. `benchmarks/profile_issue.py` profiles one launch of each
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
# python benchmarks/bench_kernels.py        # forward, backward, memory and the tile sweep; CSVs + plot
# ```
#
# Its results: the run committed in `benchmarks/results/forward.csv` (an H200, the H100's SM with faster
# memory; see the README there), or, when that file is missing, the H100 numbers recorded in
# `benchmarks/results/h100/`:

# %%
gviz.plot_vs_torch(results, N=N, d=d, source=f"from {source}");

# %% [markdown]
# How to read it:
#
# - flashlab's kernels run on the FP32 units; SDPA in float32 uses tensor cores in 3xTF32 (on the H100).
#   Even so, in the committed runs (`benchmarks/results/README.md`) the register kernel reaches 82–84% of
#   SDPA fp32 at d = 64 from N = 4096 on (42% at N = 1024, where 16 heads of 8 query blocks make 128 thread
#   blocks for 132 SMs), but only 30–35% at d = 128, where 48 KB of shared memory keeps its tiles small
#   (lesson 07).
#   float16 on tensor cores is in another league (numba-cuda has no tensor-core API of its own; lesson 15
#   reaches the tensor cores through PTX).
# - On a T4 (Colab), SDPA in float32 runs on plain FP32 units: there the comparison is like for like.
# - Always measure the baseline in the same run as your kernel, and quote ratios: on a shared machine
#   absolute numbers move from run to run.
#
# **Exercises:** [10_tuning](../exercises/10_tuning.ipynb): decide whether a tile fits the shared-memory
# and register budgets, write a timing function that a compile or a hiccup cannot fool, and turn an
# issue-slot profile into the TFLOP/s it predicts.
