# %% [markdown]
# # 08 · A first flash kernel, in shared memory, and why it is slow
#
# **After this lesson you can**
# - map FlashAttention-2 onto the GPU the textbook way: one thread block per block of query rows, one
#   thread per row, K and V tiles copied into shared memory;
# - run flashlab's kernel (`variant="shared"`) and check it against the float64 reference;
# - count the bytes it moves from HBM and show that they are *not* what makes it slow;
# - read its resource use (threads, shared memory, registers) and its theoretical occupancy, and explain
#   the gap to PyTorch with them.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import device, reference_attention, relative_error
from flashlab.kernels import flash_attention, kernel_info
from flashlab.viz import gpu as gviz

ON_GPU = device.has_gpu()
rng = np.random.default_rng(0)

# %% [markdown]
# ## The mapping
#
# FA2's outer loop runs over query blocks, which are independent (lesson 05): each becomes a thread block.
# Inside, the simplest split is one thread per query row. The block walks over the keys in tiles; for each
# tile its threads copy `block_k` rows of K and V into shared memory together, wait at a barrier, and then
# each thread runs the online softmax of lesson 03 over the tile for its own row. Colours are thread
# blocks; the outlined tile is the one in shared memory at this moment:

# %%
gviz.plot_shared_kernel_map(nq=32, nk=48, block_q=8, block_k=16, current_tile=1);

# %% [markdown]
# Per thread, in registers: its row of Q (scaled), its unnormalised row of O (d floats), the running max m
# and sum l. Per block, in shared memory: one tile of K and one of V, `2 · block_k · d` floats. In outline:
#
# ```
# for each key tile k0:                      # the whole block together
#     copy K[k0 : k0+block_k], V[...] -> shared (zeros past N);  syncthreads()
#     for each key c of the tile:            # each thread, its own row
#         if the key exists (and is not in the future, if causal):
#             s = q_row · K[c];  m_new = max(m, s);  alpha = exp(m - m_new);  p = exp(s - m_new)
#             l = alpha·l + p;   o_row = alpha·o_row + p·V[c];  m = m_new
#     syncthreads()                          # before the next tile overwrites this one
# O[row] = o_row / l;  lse[row] = m + log l
# ```
#
# (flashlab's kernel, `flashlab/kernels/shared.py`, works in base-2 exponentials and skips key tiles a
# causal block cannot see; otherwise it is this.) It is correct for any N, causal or not:

# %%
size = device.kernel_size  # GPU sizes on a GPU; small ones in the simulator (it runs threads in Python)
B, H, d = 1, 2, size(64, 16)
for nq, nk, causal in [(size(1000, 37), size(1000, 21), False), (size(777, 30), size(1000, 30), True)]:
    q, k, v = (rng.standard_normal((B, H, n, d)).astype(np.float32) for n in (nq, nk, nk))
    o, lse = flash_attention(q, k, v, causal=causal, variant="shared", block_q=size(64, 16), block_k=size(32, 8))
    o_ref, lse_ref = reference_attention(q, k, v, causal=causal)
    print(f"Nq={nq:4d} Nk={nk:4d} causal={causal!s:5}: O error {relative_error(o, o_ref):.1e}, "
          f"lse error {relative_error(lse, lse_ref):.1e}")

# %% [markdown]
# ## How fast?
#
# On a GPU we time it at the size of the course's benchmark (B = 1, H = 16, N = 4096, d = 64, float32)
# next to PyTorch's `scaled_dot_product_attention`, with CUDA events, after a warm-up that compiles the
# kernel (lesson 10 has the details). Without a GPU, the numbers recorded on the project's H100.

# %%
N_BENCH, D_BENCH = 4096, 64
flops = 4 * 16 * N_BENCH**2 * D_BENCH  # two matrix products of 2·N·N·d per head
speeds = {}
if ON_GPU:
    import torch
    import torch.nn.functional as F

    from flashlab.bench import time_cuda

    qt, kt, vt = (torch.randn(1, 16, N_BENCH, D_BENCH, device="cuda") for _ in range(3))
    for name, fn in {"flashlab shared": lambda: flash_attention(qt, kt, vt, variant="shared"),
                     "torch SDPA fp32": lambda: F.scaled_dot_product_attention(qt, kt, vt)}.items():
        speeds[name] = flops / (time_cuda(fn, warmup=2, reps=20)["median_ms"] * 1e-3) / 1e12
else:
    speeds = {"flashlab shared": 9.4, "torch SDPA fp32": 32.3}  # recorded on an H100 (benchmarks/results/h100/forward.csv)
for name, tf in speeds.items():
    print(f"{name:16s} {tf:6.1f} TFLOP/s")
print(f"the textbook kernel reaches {speeds['flashlab shared'] / speeds['torch SDPA fp32']:.0%} of SDPA")

# %% [markdown]
# Under a third of PyTorch. Where does the time go?
#
# ## Suspect 1: bytes from HBM
#
# Per head, the kernel reads Q once and writes O (and lse) once; it reads all of K and V once per query
# block, `T_r = ceil(N / block_q)` times. Everything else happens on chip. So, in bytes (float32),
# `4 · (2·N·d + 2·N·d·T_r) + 4·N`, against `4·N²·d` FLOPs:

# %%
for block_q in (32, 64, 128):
    tr = math.ceil(N_BENCH / block_q)
    hbm = 4 * (2 * N_BENCH * D_BENCH + 2 * N_BENCH * D_BENCH * tr) + 4 * N_BENCH
    intensity = 4 * N_BENCH**2 * D_BENCH / hbm
    print(f"block_q = {block_q:3d}: {hbm / 2**20:6.1f} MiB per head, {intensity:5.1f} FLOP/byte "
          f"(≈ block_q / 2)")
print("H100 ridge point for FP32: 67 TFLOP/s / 3.35 TB/s = 20 FLOP/byte")

# %% [markdown]
# With `block_q = 64` the kernel does about 32 FLOPs per byte it moves, above the FP32 ridge point of an
# H100: by the roofline of lesson 01 it could run at the full FP32 rate, 67 TFLOP/s. At 9.4 TFLOP/s it
# moves about 0.3 TB/s of the 3.35 available. HBM is not the problem; the chip is.
#
# ## Suspect 2: the work inside the SM
#
# Every multiply-add of the inner loops needs one float of K or V from shared memory, and each thread does
# all `2d` multiply-adds per key alone; the d of the dot product form a chain where each step waits for
# the previous one (and loads take tens of cycles to arrive). An SM hides such waits by
# switching to another warp that is ready, if it has one. How many warps can an SM hold? That is the
# **occupancy**, limited by whichever runs out first: threads, registers or shared memory per SM
# (CUDA C++ Best Practices Guide, "Occupancy").

# %%
infos = {f"shared, block_q={bq}": kernel_info(D_BENCH, variant="shared", block_q=bq, block_k=32)
         for bq in (32, 64, 128)}
infos["register (lesson 09)"] = kernel_info(D_BENCH, variant="register")
for name, info in infos.items():
    print(f"{name:22s} threads {info['threads_per_block']:4d}, shared {info['shared_bytes_per_block']:6d} B, "
          f"registers {info['registers_per_thread']}, spill {info['local_bytes_per_thread']} B")
if not ON_GPU:
    print("\n" + infos["register (lesson 09)"]["note"])
gviz.plot_occupancy_bars(infos);

# %% [markdown]
# On a GPU the registers column is filled in: each thread of the textbook kernel keeps its row of Q and
# of O, `2d = 128` floats at d = 64, plus addresses and counters, so it needs more than 128 of the 255
# registers a thread may have; the bars then say which resource caps the warps per SM on your GPU. In the
# simulator they count threads and shared memory only (with the limits of a T4).
#
# A profiler confirms the suspects and ranks them. Nsight Compute on an H100 (lesson 10 shows the
# profile; N = 4096, d = 64) finds the SM's schedulers idle half the time and most of the rest busy with
# work other than FMAs. Three things, then, make it slow, and none is HBM traffic:
#
# 1. **few warps and long waits**: each scheduler has about 2 warps to choose from, and often both are
#    waiting, for the next K/V tile from HBM or for the previous multiply-add of the dot product;
# 2. **bookkeeping per key**: the whole row of O is rescaled after every key (one extra multiply per
#    element), plus index arithmetic and loop control: about 2.9 instructions issued per useful FMA;
# 3. **a shared-memory read for every FMA**: the compiler fetches 4 adjacent floats per 16-byte load, so
#    this costs 0.28 load instructions per FMA, less than the other two, but it grows with every FMA.
#
# Lesson 09 fixes all three at once: several threads share a row, each thread computes a small tile of S
# and of O from values it loaded into registers once (one load feeds several FMAs, and the independent
# FMAs of a tile overlap), and the softmax bookkeeping happens once per tile instead of once per key.
#
# **Exercises:** [08_first_flash_kernel](../exercises/08_first_flash_kernel.ipynb): write a variant of
# this kernel with two query rows per thread (each shared read feeds both) that skips the key tiles a
# causal block cannot see.
