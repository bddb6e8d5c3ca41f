# %% [markdown]
# # 01 · The memory hierarchy and the roofline
#
# **After this lesson you can**
# - explain why a GPU can be idle while "doing" attention: bytes arrive slower than it can compute;
# - compute the arithmetic intensity (FLOPs per byte) of a kernel;
# - read a roofline, drawn here from this machine's own measured bandwidth and FLOP rate beside
#   published A100, H100 and T4 figures;
# - explain why softmax and other elementwise steps are memory-bound on every one of them.

# %%
import numpy as np
from tqdm.auto import tqdm

import flashlab
from flashlab import roofline, viz

# %% [markdown]
# ## Big and slow, or small and fast
#
# A GPU has a few tens of gigabytes of high-bandwidth memory (HBM) off the chip, and a few tens of
# megabytes of SRAM on it, split across its streaming multiprocessors (SMs). Here they are for the GPU
# this lesson uses throughout, the A100 SXM with 80 GB of HBM: SRAM figures from the FlashAttention paper
# (arXiv 2205.14135, Section 2.1), HBM from NVIDIA's A100 datasheet. (The paper's Figure 1 draws the
# 40 GB model, whose HBM is slower; the roofline below uses the 80 GB one too.)

# %%
viz.plot_memory_hierarchy();

# %% [markdown]
# From SRAM to HBM the room grows four-thousand-fold and the bandwidth drops almost tenfold. Arithmetic
# happens only on the chip, so every operand must first travel from HBM to SRAM (or registers), and every
# result back. FlashAttention is about making fewer of those trips.
#
# ## Two speed limits
#
# A kernel that performs $F$ floating-point operations and moves $B$ bytes to and from memory cannot
# finish faster than either limit allows:
#
# $$ t \;\ge\; \max\!\left(\frac{F}{\text{peak FLOP/s}},\; \frac{B}{\text{bandwidth}}\right). $$
#
# Which one binds depends only on the ratio $I = F / B$, the **arithmetic intensity** (FLOPs per byte).
# Dividing $F$ by the bound gives the best rate the kernel can reach,
# $\min(\text{peak},\ \text{bandwidth} \times I)$: a slope on the left (memory-bound) meeting a flat
# roof on the right (compute-bound) at the **ridge point** $I^* = \text{peak} / \text{bandwidth}$.
#
# A GPU has two kinds of arithmetic units, with very different peaks. **Tensor cores** are units inside
# each SM built for one operation: multiply two small matrices and add the product to a third,
# $D = A B + C$, on tiles of a fixed shape (16×16×16 for FP16, for example) that a group of 32 threads
# issues as one instruction, with inputs in low precision (FP16, BF16, TF32, ...) and sums usually kept in
# FP32 (CUDA C++ Programming Guide, "Warp Matrix Functions"; NVIDIA's A100 whitepaper). A GPU's headline
# FLOP/s are theirs. Everything else, `exp`, max, division and ordinary float arithmetic, runs on the
# plain FP32 cores (NVIDIA calls them CUDA cores), at a much lower peak: both are printed below.
#
# Let us measure both limits on the machine running this notebook: bandwidth by copying an array much
# larger than the CPU caches, and FLOP rate by a float32 matrix product.

# %%
machines = []
for measure in tqdm([roofline.measure_cpu, roofline.measure_gpu], desc="measuring"):
    m = measure()  # measure_gpu returns None without a CUDA GPU
    if m is not None:
        machines.append(m)
for m in machines:
    print(m)
print()
for name, m in roofline.PUBLISHED.items():
    print(m, f"(FP32 without tensor cores: {roofline.PUBLISHED_FP32[name] / 1e12:.1f} TFLOP/s)")

# %% [markdown]
# The published numbers are datasheet peaks (dense FP16 on tensor cores; sources in
# `flashlab.roofline.PUBLISHED`). They are ceilings, not promises: the best attention kernel on an H100,
# FlashAttention-3 in FP16, reaches 75% of that peak, and FlashAttention-2 about 35% (arXiv 2407.08608,
# abstract).
#
# Now two real kernels on this CPU, timed: `np.exp` over a large array (one read, one write per
# element, and we count one FLOP per element, generously low for `exp`) and a float32 matrix product.

# %%
n_elem = flashlab.size(1 << 24, 1 << 22)
x = np.random.default_rng(0).standard_normal(n_elem, dtype=np.float32)
y = np.empty_like(x)
n_mm = flashlab.size(1024, 384)
a = np.random.default_rng(1).standard_normal((n_mm, n_mm), dtype=np.float32)

points = {
    "np.exp (this CPU)": roofline.time_kernel(lambda: np.exp(x, out=y), n_elem, 2 * x.nbytes),
    "matmul (this CPU)": roofline.time_kernel(lambda: a @ a, 2 * n_mm**3, 3 * a.nbytes),
}
for name, (inten, rate) in points.items():
    print(f"{name:20s} intensity {inten:8.2f} FLOP/byte, achieved {rate / 1e9:8.1f} GFLOP/s")

# %% [markdown]
# ## The roofline
#
# Lines are the limits; stars are the two kernels we just timed; dotted verticals mark the intensity of
# the steps attention is made of (for one head with N = 4096, d = 64, in float16):

# %%
steps = roofline.example_kernels(n=4096, d=64, bytes_per_element=2)
intensities = {name: roofline.intensity(f, b) for name, (f, b) in steps.items()}
viz.plot_roofline(machines + list(roofline.PUBLISHED.values()), kernels=intensities, points=points);

# %% [markdown]
# Read it from left to right. `np.exp` sits far left, under the sloped part: it waits on memory, and
# no amount of extra arithmetic units would help it. The matmul sits right of the ridge: it can use the
# full arithmetic rate. The GPUs' ridges are far to the right, around 150–300 FLOPs per byte,
# because their arithmetic has grown much faster than their memory bandwidth.
#
# ## Why softmax is memory-bound
#
# Count for one row-wise softmax over an $N\times N$ matrix in float16: it reads and writes every
# element once ($2 \cdot 2N^2$ bytes) and does about five operations per element (max, subtract, exp,
# sum, divide), so $I \approx 5N^2 / 4N^2 = 1.25$ FLOP/byte, whatever $N$ is. An elementwise step
# (masking, dropout, scaling) is even lower. The A100's ridge is at about 153: softmax could use less
# than 1% of the chip's arithmetic. Here is every attention step on an A100:

# %%
a100 = roofline.PUBLISHED["A100"]
print(f"{'step':15s} {'FLOP/byte':>10s} {'memory µs':>10s} {'compute µs':>11s}  bound")
for name, (f, b) in steps.items():
    t_mem, t_cmp = b / a100.bandwidth * 1e6, f / a100.peak_flops * 1e6
    print(f"{name:15s} {f / b:10.1f} {t_mem:10.1f} {t_cmp:11.2f}  {'memory' if t_mem > t_cmp else 'compute'}")
f_sm, b_sm = steps["softmax"]
print(f"softmax on the A100's FP32 units instead: {f_sm / roofline.PUBLISHED_FP32['A100'] * 1e6:.1f} µs of "
      f"arithmetic against {b_sm / a100.bandwidth * 1e6:.1f} µs of memory traffic")

# %% [markdown]
# The last column has a surprise: with $d = 64$, even the two matrix products of attention are
# memory-bound, because writing or reading the $N\times N$ matrix dominates their bytes (their
# intensity is about $d$ FLOPs per byte in float16, below the ridge). Only a square matmul clears the
# ridge. Softmax runs on the ordinary FP32 units, not tensor cores, but even at their much lower rate
# (the last line) its arithmetic takes a small fraction of the time its memory traffic needs.
#
# So the time of standard attention is spent moving $S$ and $P$ through HBM, not multiplying.
# FlashAttention keeps them on chip (arXiv 2205.14135, Section 2 discusses exactly this).
#
# ## Explore: slide along the roofline
#
# Move the intensity and watch the star climb the slope until it reaches the roof at the ridge; then
# change the machine, N, d and the element size, and see where naive attention's three steps (squares)
# land. On the tensor-core (FP16) rooflines $QK^\top$ and $PV$ stay left of the H100's ridge for every
# N and d offered; on an FP32 roofline with 4-byte elements they cross it (on the H100 and T4 from
# d = 64). Softmax never does.

# %%
viz.roofline_explorer(measured=machines);

# %% [markdown]
# **Exercises:** [01_memory_hierarchy](../exercises/01_memory_hierarchy.ipynb): compute the
# intensity of a matmul and of softmax, and the attainable rate on a roofline.
