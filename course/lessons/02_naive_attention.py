# %% [markdown]
# # 02 · Naive attention and its memory traffic
#
# **After this lesson you can**
# - write attention as three steps, $S = QK^\top/\sqrt d$, $P = \mathrm{softmax}(S)$, $O = PV$;
# - count the bytes each step reads from and writes to HBM, and check your count against an
#   instrumented run;
# - explain why the $N\times N$ matrices $S$ and $P$ dominate both the traffic and the memory, and watch
#   that memory grow as $N^2$.

# %%
import numpy as np
from tqdm.auto import tqdm

import flashlab
from flashlab import HBMModel, formula_traffic, naive_attention, reference_attention, relative_error, roofline, viz

rng = np.random.default_rng(0)
N, d = flashlab.size(1024, 256), 64
q, k, v = (rng.standard_normal((N, d)).astype(np.float32) for _ in range(3))

# %% [markdown]
# ## Where the bytes go
#
# `flashlab.naive_attention` runs the textbook algorithm as three separate kernels would: each step reads
# its inputs from HBM and writes its output back. Give it an `HBMModel` and it reports every read and
# write (in float32, 4 bytes per element):

# %%
io = HBMModel()
o = naive_attention(q, k, v, io=io)
print(io)
print("error against the float64 reference:", relative_error(o, reference_attention(q, k, v)[0]))
viz.plot_naive_traffic(io);

# %% [markdown]
# $Q$, $K$, $V$ and $O$ are $N\times d$ each; $S$ and $P$ are $N\times N$, and each crosses the
# HBM boundary twice (written by one step, read by the next). Step by step, in elements:
#
# | step | reads | writes |
# | --- | --- | --- |
# | 1. $S = QK^\top/\sqrt d$ | $Q, K$: $2Nd$ | $S$: $N^2$ |
# | 2. $P = \mathrm{softmax}(S)$ | $S$: $N^2$ | $P$: $N^2$ |
# | 3. $O = PV$ | $P, V$: $N^2 + Nd$ | $O$: $Nd$ |
#
# In total $4Nd + 4N^2$ elements: $\Theta(Nd + N^2)$, as in FlashAttention (arXiv 2205.14135,
# Theorem 2). With $N$ much larger than $d$ the $4N^2$ term wins. The closed form in
# `flashlab.formula_traffic` agrees with the instrumented run:

# %%
t = formula_traffic("naive", N, N, d)
print("formula:      ", t["read"] + t["write"], "elements")
print("instrumented: ", io.elements_read + io.elements_written, "elements")
print(f"share of S and P: {4 * N * N / (io.elements_read + io.elements_written):.1%}")

# %% [markdown]
# ## What that costs on a GPU
#
# Lesson 01 gave the rule: a step needs at least bytes / bandwidth and FLOPs / peak seconds. For one
# head at N = 4096, d = 64 in float16 on an A100, every one of the three steps waits on memory, and the
# softmax, which does almost no arithmetic, takes the longest:

# %%
kernels = roofline.example_kernels(n=4096, d=64, bytes_per_element=2)
viz.plot_step_times(roofline.PUBLISHED["A100"], {s: kernels[s] for s in ("S = QKᵀ", "softmax", "O = PV")});

# %% [markdown]
# ## Memory grows as $N^2$
#
# Traffic is one cost; room is another. $S$ and $P$ must exist in memory at the same time (step 2
# reads one and writes the other). We measure the peak memory NumPy allocates while `naive_attention`
# runs (with Python's `tracemalloc`) and compare it with $2N^2$ float32 elements:

# %%
ns = flashlab.size([256, 512, 1024, 2048], [64, 128, 256])
peaks = []
for n in tqdm(ns, desc="naive attention"):
    qn, kn, vn = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
    peaks.append(viz.peak_memory(naive_attention, qn, kn, vn)[1])
for n, p in zip(ns, peaks):
    print(f"N = {n:5d}: peak {p / 1e6:8.2f} MB, 2N² float32 = {2 * n * n * 4 / 1e6:8.2f} MB")

viz.plot_memory_vs_n(2 ** np.arange(6, 17), d, measured={"measured peak (naive_attention)": (ns, peaks)}, bytes_per_element=4);

# %% [markdown]
# Everything here is float32, 4 bytes per element, as in the runs. Once $N$ is a few hundred, the measured
# peaks climb parallel to the $2N^2$ line, a small factor above it: NumPy also holds a temporary of the
# same size (the exponentials before they are normalised) and float32 copies of the inputs.
# Extrapolate to a long sequence:

# %%
n_long = 65536
for dtype, nbytes in (("float32", 4), ("float16", 2)):
    print(f"N = {n_long:,}: S and P take 2 · N² · {nbytes} bytes = {2 * n_long**2 * nbytes / 1e9:.0f} GB of {dtype}, one head")

# %% [markdown]
# Even in float16, half the bytes of float32, that is 17 GB for one head, and a model has many heads and a
# batch. The inputs themselves are tiny in comparison.
#
# FlashAttention never stores $S$ or $P$. It keeps one row maximum and one row sum per query instead
# (the green line), which lesson 03 builds, and lesson 04 shows how that also cuts the traffic.
#
# **Exercises:** [02_naive_attention](../exercises/02_naive_attention.ipynb): write the three steps
# yourself, count their HBM bytes, and find the peak memory they hold for a batch of heads.
