# %% [markdown]
# # 10 · Tuning and benchmarking: tile sizes, the roofline, PyTorch
#
# **After this lesson you can**
# - time a GPU kernel honestly: CUDA events, warm-up, median;
# - sweep the tile shape of the register kernel and read the result (speed, registers, occupancy);
# - place flashlab's kernels and PyTorch's on a roofline and say which limit each one meets;
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
# overall). Switch the metric: the fastest tile is rarely the one with the highest occupancy. (In the
# recorded sweep no tile spills, `local_bytes` = 0 everywhere; a spilling tile would lose, as lesson 09
# measured.) (Without widgets, or in the fast mode,
# a grid of the main metrics.)

# %%
gviz.tile_explorer(rows);

# %% [markdown]
# ## On the roofline
#
# Lesson 08 computed the intensity of a FA2 forward from its HBM traffic: about `block_q / 2` FLOPs per
# byte in float32, above the H100's FP32 ridge point. So both flashlab kernels are, by the roofline,
# *compute*-bound: the ceiling that matters is the FP32 rate, and how close a kernel gets to it is
# decided inside the SM (lessons 08 and 09). PyTorch's SDPA in float32 uses tensor cores (3xTF32),
# a different and higher roof; in float16 it is higher still.

# %%
results, source = gviz.load_forward_results()
at = {r["impl"]: r["tflops"] for r in results if r.get("N") == N and r.get("d") == d}
points = {}
for impl, block_q in (("flashlab shared fp32", 64), ("flashlab register fp32", 128), ("torch SDPA fp32", 64)):
    if impl in at and np.isfinite(at[impl]):
        points[impl] = (gviz.kernel_intensity(N, d, block_q), at[impl] * 1e12)
if "torch SDPA fp16" in at:
    points["torch SDPA fp16"] = (gviz.kernel_intensity(N, d, 128, bytes_per_element=2), at["torch SDPA fp16"] * 1e12)
print("from", source)
gviz.plot_kernel_roofline(points);

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
# - flashlab's kernels run on the FP32 units; SDPA in float32 uses tensor cores in 3xTF32 (on the H100),
#   so "half of SDPA fp32" is the realistic goal for plain FP32 code, and float16 on tensor cores is in
#   another league (numba-cuda has no tensor-core API).
# - On a T4 (Colab), SDPA in float32 runs on plain FP32 units: there the comparison is like for like.
# - Always measure the baseline in the same run as your kernel, and quote ratios: on a shared machine
#   absolute numbers move from run to run.
#
# **Exercises:** [10_tuning](../exercises/10_tuning.ipynb): decide whether a tile fits the shared-memory
# and register budgets, and write a timing function that a compile or a hiccup cannot fool.
