# %% [markdown]
# # 11 · FlashAttention-3 ideas: FP8 and overlap
#
# FlashAttention-2 reaches only about 35% of an H100's peak (FlashAttention-3 paper, arXiv 2407.08608,
# abstract). FlashAttention-3 (FA3) gets more from the same chip with two families of ideas, which this
# lesson reproduces in NumPy and in a small simulation:
#
# 1. **FP8.** Hopper's tensor cores run 8-bit floats at about twice the FP16 rate, but 8 bits hold little
#    precision. FA3 keeps the error down with **block quantisation** and **incoherent processing**.
# 2. **Overlap.** Loads, matrix products and the softmax's exponentials run on different units. FA3 keeps
#    them busy at once with **warp specialisation** (producer and consumer warps), **pingpong scheduling**
#    between two warpgroups and **overlap inside a warpgroup**.
#
# **After this lesson you will be able to**
# - round numbers to FP8 e4m3 by hand and say why a scale factor is needed;
# - explain why one outlier ruins a tensor's quantisation, and how a random rotation spreads it out
#   without changing $QK^\top$;
# - reproduce the accuracy study of the FA3 paper (Table 3) and say why its effect grows with sequence length;
# - read a schedule of loads, matmuls and softmax, and predict when overlapping them pays off.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

import flashlab
from flashlab import fp8, timeline

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. What numbers does FP8 have?
#
# First the picture: every non-negative value of the e4m3 format (4 exponent bits, 3 mantissa bits),
# and the relative error of rounding to it.

# %%
x = np.geomspace(2.0 ** -11, 600, 4000)
grid = np.unique(fp8.round_e4m3(np.geomspace(2.0 ** -10, 448, 20000)))
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.2))
a.plot(grid, np.zeros_like(grid), "|", ms=18)
a.set_xscale("log")
a.set_yticks([])
a.set_title(f"all {len(grid)} positive e4m3 values (log scale)")
a.axvline(fp8.E4M3_MIN_NORMAL, color="gray", ls="--")
a.text(fp8.E4M3_MIN_NORMAL, 0.02, " smallest normal 2^-6", fontsize=8)
with np.errstate(divide="ignore", invalid="ignore"):
    b.loglog(x, np.abs(fp8.round_e4m3(x) - x) / x)
b.axhline(2.0 ** -4, color="gray", ls="--")
b.text(1e-2, 2.0 ** -4 * 1.2, "half a step = 2^-4 of the value", fontsize=8)
b.set_xlabel("x")
b.set_title("relative error of round_e4m3(x)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Now the formula behind the picture. An e4m3 number with exponent bits $e \in 1..15$ and mantissa bits
# $m \in 0..7$ is $(1 + m/8)\cdot 2^{e-7}$; with $e = 0$ it is the subnormal $m/8 \cdot 2^{-6}$.
# So:
#
# - the largest value is $1.75 \cdot 2^{8} = 448$ (the bit pattern above it is reserved for NaN);
# - the smallest normal value is $2^{-6}$, and below it values are spaced $2^{-9}$ apart;
# - between $2^k$ and $2^{k+1}$ there are only 8 values, so rounding loses up to $2^{-4} \approx 6\%$.
#
# Rounding goes to the nearest value, ties to the one with an even mantissa. flashlab's conversion
# saturates: anything beyond 448, infinity included, becomes 448 (like the `satfinite` conversion mode of
# NVIDIA's FP8 instructions), so no NaN appears.

# %%
print(fp8.round_e4m3(np.array([1.0625, 1.1875, 17.0, 19.0, 500.0, np.inf, 2.0 ** -10, 0.3])))

# %% [markdown]
# Relative precision is the same everywhere in the normal range, but the range itself is narrow:
# $2^{-6}$ to 448. Attention inputs can be far larger or smaller, so every tensor is divided by a
# **scale** first: `scale = amax / 448` maps the largest magnitude to 448. Hopper's FP8 tensor-core
# instructions take no scale operands (PTX ISA, `wgmma.mma_async`): they multiply the 8-bit codes, and the
# kernel applies the scales afterwards in FP32. For attention that costs nothing extra: the scales of Q and
# K multiply every score, so FA3 folds them into the softmax scale, and the scale of V multiplies the
# output, so it is applied to O at the end (FA3's code takes one such "descale" per batch and head).
# Tensor cores that apply a scale to every small block of the inputs themselves arrived with Blackwell's
# microscaling (MX) formats (PTX ISA, `tcgen05.mma` with `.block_scale`).
#
# **Per-tensor** scaling uses one scale for all of Q. **Block** scaling uses one per tile, which FA3
# loads anyway. Why it matters: below, one block of tiny values shares a tensor with one huge outlier.

# %%
x = rng.standard_normal((1, 256, 16)) * 1e-3
x[0, 0, 0] = 1e3  # one outlier in the first block of 128 rows
for name, block in (("per-tensor", None), ("block of 128 rows", 128)):
    err = flashlab.relative_error(fp8.fake_quantize_e4m3(x, block)[0, 128:], x[0, 128:])
    print(f"{name:18s} error on the second block: {err:.3f}")

# %% [markdown]
# With one scale for everything, almost all of the second block's values fall below half of e4m3's
# smallest subnormal and round to zero: about 97% error. With its own scale, the block keeps e4m3's usual few percent.
#
# ## 2. Incoherent processing: spreading an outlier
#
# Real activations have **outlier features**: a few channels with values tens of times larger than the
# rest. Picture a query row with one such outlier, before and after multiplying by a random orthogonal
# matrix $M$:

# %%
d = 64
q_row = rng.standard_normal((1, d))
q_row[0, 9] = 40.0
rotated, _ = fp8.incoherent_transform(q_row, q_row, seed=1)
fig, ax = plt.subplots(1, 2, figsize=(11, 2.8), sharey=True)
ax[0].bar(range(d), q_row[0])
ax[0].set_title("a query row with one outlier feature")
ax[1].bar(range(d), rotated[0], color="C1")
ax[1].set_title("the same row times M = diag(random ±1) · Hadamard")
plt.tight_layout()
plt.show()
print(f"largest |value|: {np.abs(q_row).max():.1f} before, {np.abs(rotated).max():.1f} after; "
      f"length {np.linalg.norm(q_row):.2f} before, {np.linalg.norm(rotated):.2f} after")

# %% [markdown]
# The rotation keeps the row's length but spreads its energy over all 64 features. The formula: with
# $H$ the $d \times d$ Hadamard matrix scaled by $1/\sqrt d$ (entries $\pm 1/\sqrt d$, $H H^\top = I$) and
# $D$ a random diagonal of $\pm 1$, $M = D H$ is orthogonal, so
#
# $$ (QM)(KM)^\top = Q\,M M^\top K^\top = Q K^\top . $$
#
# The scores, and hence attention's output, do not change; only what gets quantised does. FA3 applies
# $M$ cheaply: multiplying by $H$ takes $O(d \log d)$ operations (a fast Walsh–Hadamard transform), and
# the paper notes it can be fused with the rotary embedding, which already rewrites Q and K.

# %%
q, k = rng.standard_normal((100, 128)), rng.standard_normal((90, 128))
q2, k2 = fp8.incoherent_transform(q, k, seed=3)
print("relative change of Q K^T:", flashlab.relative_error(q2 @ k2.T, q @ k.T))

# %% [markdown]
# ## 3. Reproducing the FA3 accuracy study
#
# The paper draws Q, K and V from $\mathcal N(0,1) + \mathcal N(0,100)\cdot\mathrm{Bernoulli}(0.001)$: one
# entry in a thousand gets an extra outlier of standard deviation 10. It measures the RMSE of the output
# against an FP64 reference (Table 3): per-tensor FP8 **2.4e-2**, FA3's block FP8 without incoherent
# processing **2.4e-2**, with it **9.1e-3**: about 2.6× better.
#
# `fp8.accuracy_study` rounds Q, K and V to e4m3 (Q and K rotated first, for the third method), then runs
# flashlab's NumPy FA2 forward, rounding each tile of P to e4m3 before $PV$ as FA3 does (it scales P by
# $2^8$ first, so that P's small values do not vanish). What it does not simulate is the tensor core's
# arithmetic: flashlab adds the products of the rounded values in float32, while Hopper's FP8
# accumulation keeps only about 14 bits (measured on an H800 by DeepSeek-V3, arXiv 2412.19437, section
# 3.3.2). So this reproduces the paper's comparison of quantisation schemes, not the exact error of FA3's
# kernel. We sweep the sequence length, for a reason explained below. (Fast mode runs shorter sequences.)

# %%
ns = flashlab.size([1024, 2048, 4096, 8192], [512, 1024, 2048])
start = time.perf_counter()
results = {n: fp8.accuracy_study(n=n, d=128, seed=0) for n in tqdm(ns, desc="accuracy study")}  # ~1 min at full size
print(f"{time.perf_counter() - start:.1f} s")
fig, ax = plt.subplots(figsize=(7, 3.8))
for i, method in enumerate(fp8.METHODS):
    ax.plot(ns, [results[n][method] for n in ns], "o-", color=f"C{i}", label=f"{method} (flashlab)")
    ax.axhline(fp8.PAPER_RMSE[method], color=f"C{i}", ls=":", lw=1.5)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequence length N (d = 128)")
ax.set_ylabel("RMSE vs float64")
ax.set_title("dotted: the paper's Table 3")
ax.legend(fontsize=8)
plt.show()
last = results[ns[-1]]
print(f"N = {ns[-1]}:", {m: f"{v:.1e}" for m, v in last.items()},
      f"-> incoherent processing cuts the error {last['block'] / last['block + incoherent']:.1f}x")

# %% [markdown]
# At N = 8192 (the full run) flashlab lands close to the paper: about 2e-2 for per-tensor and block FP8,
# under 1e-2 with incoherent processing, a 2.5× cut (the paper: 2.4e-2, 2.4e-2, 9.1e-3). The fast run's
# shorter sequences show a smaller gap. Two things to notice:
#
# - **Block scaling alone barely helps here.** e4m3 is a floating-point format: once a block is scaled
#   into range, every value gets the same *relative* precision, so a larger scale costs little. (Block
#   scaling matters when values would fall out of range, as in section 1.)
# - **The benefit of rotating grows with N.** A rounding error is relative to the value, so the scores that
#   suffer most are the huge ones: a query and a key whose outliers sit in the *same* feature produce a
#   score of about $10 \cdot 10/\sqrt{d}$, with an error a few percent of that, which shifts a dominant
#   softmax weight. Each query meets about $N d p^2$ such keys ($p = 0.001$), so longer sequences meet more
#   of them. After the rotation no feature holds a spike, and the error of those scores shrinks.
#
# ### Explore: block size and outliers
#
# The explorer reruns the same simulation (`fp8.error_vs_block`) on smaller inputs (d = 64, N up to
# 1024) so that each redraw takes a fraction of a second. Things to try: p = 0, where both curves lie on
# the dotted floor whatever the block size (nothing for the rotation to fix); the paper's outliers
# (std 10) at rising p; and std 100 at N = 256 and N = 1024, where a handful of huge outliers decide the
# error and one random draw can go either way: the study above used N = 8192 and d = 128 to meet many more
# of them.

# %%
flashlab.viz.fp8_explorer();

# %% [markdown]
# ## 4. Overlap: loads, matmuls and softmax at the same time
#
# Each step of the inner loop over K/V blocks does four things on three different units:
#
# | step | unit on Hopper |
# | --- | --- |
# | load $K_j$, $V_j$ into shared memory | TMA (an asynchronous copy engine) |
# | $S = Q K_j^\top$, then $O \mathrel{+}= P V_j$ | tensor cores (asynchronous WGMMA instructions) |
# | softmax of $S$: max, exp, sum | exp on the special-function units (max and sum on the FP32 units), much slower: 3.9 TFLOP/s of special functions against 989 for FP16 matmul |
#
# `flashlab.timeline` simulates one thread block of FA3: two query tiles (one per consumer warpgroup)
# stream over K/V blocks, each unit does one job at a time, and a job starts as soon as its inputs are
# ready and its unit is free. Here are its schedules for four K/V blocks, with the softmax costing as
# much as one matmul:

# %%
cfg = dict(t_load=1.0, t_gemm=1.0, t_softmax=1.0)
runs = {name: timeline.fa3_schedule(4, **cfg, **kw) for name, kw in timeline.CONFIGS.items()}
end = max(r.makespan for r in runs.values())
fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.0 * len(runs)))
for ax, (name, r) in zip(axes, runs.items()):
    timeline.plot_timeline(r, ax, title=f"{name}: {r.makespan:.1f} time units, tensor cores busy "
                                        f"{r.utilisation('tensor'):.0%}")
    ax.set_xlim(0, end)
plt.tight_layout()
plt.show()

# %% [markdown]
# Reading the charts from top to bottom ("sm" is softmax; warpgroup 2's jobs are hatched):
#
# - **Nothing overlapped:** each block is load → $QK^\top$ → softmax → $PV$, one after another. Without
#   pingpong the two warpgroups run the same instructions at the same moment and share each unit, so
#   they act like one warpgroup with twice the work.
# - **Warp specialisation:** a producer warp issues the loads ahead of time into two buffers, so loads
#   vanish from the critical path. Softmax still leaves the tensor cores idle.
# - **Intra-warpgroup overlap:** a two-stage pipeline inside each warpgroup. Softmax $j$ needs $S_j$, and
#   $PV_j$ needs softmax $j$'s output, so neither can start early; what can is the previous block's $PV$.
#   Right after softmax $j-1$ the warpgroup issues $QK_j^\top$ and then $PV_{j-1}$ to the tensor cores,
#   so softmax $j$ runs while the tensor cores do $PV_{j-1}$ (FA3 paper, section 3.2, Algorithm 2).
# - **Pingpong:** the two warpgroups take turns: one's softmax runs under the other's two matmuls.
#
# The rule behind the pictures: per K/V block, the unoverlapped time is the **sum**
# $t_\text{load} + t_{QK} + t_\text{softmax} + t_{PV}$, while perfect overlap needs only the busiest
# unit's time, about $\max(t_{QK} + t_{PV},\ t_\text{softmax})$ per warpgroup. So overlap pays the most
# when softmax and matmuls cost about the same, and little when either one dominates:

# %%
ratios = np.round(np.linspace(0, 2.5, flashlab.size(26, 11)), 3)
curves = timeline.speedup_curve(ratios, n_blocks=flashlab.size(24, 12))
timeline.plot_speedup_curve(ratios, curves)
plt.show()
print(f"H100 at d = 128: exp alone costs {timeline.H100_EXP_RATIO_D128:.2f} of the matmul time "
      "(989 / (3.9 * 4 * 128)); the rest of softmax (max, sums, rescaling) adds to it.")

# %% [markdown]
# What the model says, and what it leaves out:
#
# - At the H100's ratio for d = 128 (dashed line), hiding the softmax is worth a lot in this idealised model,
#   up to ~1.7×. The real kernel starts from a better place: even without the explicit schedule, the GPU's
#   warp schedulers interleave the two warpgroups partly. The paper measures smaller, real gains
#   (section 3.1 and Table 2, FP16 forward, d = 128, sequence length about 8K): pingpong scheduling took
#   the kernel from about **570 to 620 TFLOP/s**; the full FA3 kernel ran at **661**, against **582**
#   without the GEMM–softmax pipelining and **570** without warp specialisation.
# - In the model, pingpong alone already keeps the tensor cores busy, so intra-warpgroup overlap adds
#   nothing on top. On the real chip each trick hides only part of the softmax (register pressure,
#   barriers, the non-exp part of softmax), so the two gains add up partly.
# - With larger head dimension the matmuls grow ($\propto d$) while the exponentials do not, the ratio
#   falls, and there is less softmax left to hide.
#
# This is a simulation. Lesson 20 builds the real kernel on Hopper from Python (wgmma, TMA, a producer
# warpgroup, pingpong) and sets this model beside its measured timeline.
#
# ## Summary
#
# - e4m3 keeps about 6% relative precision over $[2^{-6}, 448]$; scales move each tensor or block into
#   that range.
# - A random Hadamard rotation leaves $QK^\top$ unchanged and spreads outlier features; on the paper's
#   outlier inputs it cuts FP8 attention's error about 2.5× at N = 8192 (paper: 2.6×).
# - Overlapping loads, matmuls and softmax turns a per-block sum of costs into a maximum; it pays the most
#   when the costs are balanced.
#
# **Next:** practise both in the exercises:
# [exercises/11_fa3_ideas.ipynb](../exercises/11_fa3_ideas.ipynb).
