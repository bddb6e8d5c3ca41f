# %% [markdown]
# # 12 · Other hardware: FlashAttention on a Tenstorrent Wormhole
#
# FlashAttention's idea (tile the work, keep the tile's state on chip, never write the N×N matrix) is not
# tied to GPUs. Tenstorrent's tt-metal team ran FA2's algorithm on their Wormhole accelerator and wrote up
# what it took (tech report: tenstorrent/tt-metal, `tech_reports/FlashAttention/FlashAttention.md`). The
# chip is organised very differently from a GPU, and this lesson models it with a small discrete-event
# simulation (`flashlab.tenstorrent`).
#
# **After this lesson you will be able to**
# - describe the Wormhole's grid of Tensix cores and its reader / compute / writer programs joined by
#   circular buffers, and set it against the CUDA thread-block model of lessons 07–10;
# - predict how long a reader/compute pipeline takes with one or two buffer slots;
# - explain why causal attention needs load balancing on a fixed grid of cores, and balance it by pairing
#   a low and a high Q chunk on each core;
# - compare a model's speed-ups with measured ones and say what the model leaves out.
#
# The model's throughputs (matrix engine, softmax, per-core share of DRAM bandwidth) are rough
# assumptions written down in `tenstorrent.Wormhole`: treat its times as a sketch of where the time goes,
# not as predictions for a real chip.

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import tenstorrent as tt

hw = tt.Wormhole()
print(hw)

# %% [markdown]
# ## 1. One core: three programs and their buffers
#
# First, a picture of one core computing attention for a Q chunk of 128 rows against K/V chunks of 256
# keys (d = 128). Each row is one of the core's programs; each bar is a piece of work. Top: circular
# buffers with one slot. Bottom: with two ("double buffering").

# %%
small = dict(seq_len=2048, d=128, n_heads=16, batch=1, q_chunk=128, k_chunk=256)
one, two = (tt.flash_attention_grid(**small, double_buffer=db) for db in (False, True))
fig, axes = plt.subplots(2, 1, figsize=(11, 4), sharex=True)
tt.plot_core(one.busy_example, axes[0], until=400e3, title=f"1 slot per buffer: {one.makespan_ns / 1e3:.0f} µs in all")
tt.plot_core(two.busy_example, axes[1], until=400e3, title=f"2 slots per buffer: {two.makespan_ns / 1e3:.0f} µs in all")
plt.tight_layout()
plt.show()

# %% [markdown]
# What the picture shows:
#
# - A **Tensix core** has five small RISC-V processors and 1.5 MB of SRAM (L1). One data-movement
#   processor runs the **reader** (DRAM → L1), another the **writer** (L1 → DRAM), and three drive the
#   matrix and vector engines as the **compute** program. All three run at the same time.
# - They hand data over through **circular buffers** in L1: the reader *reserves* a free slot, fills it
#   and *pushes* it; compute *waits* for a filled slot, uses it and *pops* it, which frees the slot.
# - With one slot, the reader may not fetch $K_{j+1}$ until compute has popped $K_j$, so the reader keeps
#   stopping. With two slots it reads the next chunk while compute works on this one, and compute is
#   busy almost all the time. (Q, K and V have separate buffers, so even one slot overlaps a little: V
#   arrives while compute works on $QK^\top$.)
#
# ### The formula for one buffer
#
# A reader and a compute program passing $n$ chunks through one buffer: with one slot nothing overlaps;
# with two, the pipeline fills (one read), runs at the pace of the slower stage, and drains (one compute):
#
# $$ T_1 = n\,(t_r + t_c), \qquad T_2 = t_r + t_c + (n - 1)\max(t_r, t_c). $$
#
# Double buffering saves the most when $t_r \approx t_c$ (up to 2×), and little when one stage dominates.
# The same rule as FA3's overlap in lesson 11.

# %%
t_c, n = 1.0, 16
t_rs = np.linspace(0.05, 3, 60)
gain = [tt.pipeline_time(tr, t_c, n, 1) / tt.pipeline_time(tr, t_c, n, 2) for tr in t_rs]
plt.figure(figsize=(6, 3))
plt.plot(t_rs / t_c, gain)
plt.xlabel("read time / compute time per chunk")
plt.ylabel("speed-up from 2 slots")
plt.title(f"double buffering, {n} chunks (simulated)")
plt.grid(alpha=0.3)
plt.show()

# %% [markdown]
# On the whole chip the same trade-off appears through the Q chunk size: compute per K/V chunk grows with
# the Q chunk, the bytes read do not. (The per-core DRAM bandwidth in the model is the chip's 288 GB/s
# shared by 64 cores.)

# %%
rows = []
for qc in (64, 128, 256):
    a = tt.flash_attention_grid(4096, 128, 16, 1, q_chunk=qc, double_buffer=False)
    b = tt.flash_attention_grid(4096, 128, 16, 1, q_chunk=qc, double_buffer=True)
    rows.append((qc, a.makespan_ns / b.makespan_ns, a.utilisation, b.utilisation))
    print(f"q_chunk {qc:3d}: double buffering {rows[-1][1]:.2f}x faster; compute busy "
          f"{a.utilisation:.0%} -> {b.utilisation:.0%}")

# %% [markdown]
# With small Q chunks the reader is the bottleneck and a second slot cannot help; with Q chunks of 128 rows
# reading and computing are closest in cost and the second slot helps most; with 256, compute dominates
# and is already nearly always busy.
#
# ## 2. The grid: causal attention and load balancing
#
# A Wormhole has an 8×10 grid of Tensix cores on a network-on-chip; the model uses 8×8 of them. tt-metal
# splits the output over batch, heads and Q chunks, and gives each core its share **when the program
# starts**: a fixed grid of cores with a fixed plan.
#
# Under causal masking, Q chunk $i$ attends to K chunks $0..i$ only, so later chunks cost more. Below, each
# square is a core, coloured by how much of the run its compute engine is busy. Left: consecutive chunks
# per core. Right: each core gets pairs (chunk $i$, chunk $n-1-i$), which always see $n+1$ K chunks
# together.

# %%
big = dict(seq_len=flashlab.size(16384, 8192), d=128, n_heads=16, batch=1)
naive = tt.flash_attention_grid(**big, balanced=False)
balanced = tt.flash_attention_grid(**big, balanced=True)
fig, axes = plt.subplots(1, 2, figsize=(8.5, 4))
for ax, r, name in ((axes[0], naive, "consecutive chunks"), (axes[1], balanced, "low + high pairs")):
    im = tt.plot_grid_utilisation(r, ax, title=f"{name}\nmean busy {r.utilisation:.0%}, {r.makespan_ns / 1e6:.1f} ms")
fig.colorbar(im, ax=axes, label="fraction of the run the compute engine is busy")
plt.show()
print(f"load balancing: {naive.makespan_ns / balanced.makespan_ns:.2f}x faster (report: {tt.REPORT['causal_balancing']}x)")

# %% [markdown]
# With consecutive chunks, the cores holding the first chunks of a head finish early and wait for the
# cores holding the last ones; the run takes as long as the busiest core. Pairing makes every core's work
# equal. How much this buys depends on how many heads share each core (several heads per core even out
# by themselves):

# %%
seqs = flashlab.size([2048, 4096, 8192, 16384, 32768], [2048, 8192, 16384])
gains = []
for n_seq in seqs:
    kw = dict(seq_len=n_seq, d=128, n_heads=16, batch=max(1, 16384 // n_seq))
    gains.append(tt.flash_attention_grid(**kw, balanced=False).makespan_ns
                 / tt.flash_attention_grid(**kw, balanced=True).makespan_ns)
plt.figure(figsize=(6, 3))
plt.plot(seqs, gains, "o-", label="model")
plt.axhline(tt.REPORT["causal_balancing"], color="gray", ls="--", label="tech report: 1.6x")
plt.xscale("log", base=2)
plt.xlabel("sequence length (16 heads, batch = 16K tokens / length)")
plt.ylabel("speed-up from balancing")
plt.legend()
plt.show()

# %% [markdown]
# The report measured **1.6×** from this balancing; the model gives about 1.5–1.75× once each core holds
# chunks of a single head (long sequences), and nothing when a core holds whole heads.
#
# ## 3. Against the unfused baseline
#
# The report's baseline runs matmul → softmax → matmul as separate operations that write S and P to
# DRAM, and computes the full score matrix even under causal masking. FlashAttention on Wormhole was
# **20× faster on average, 9× to 44×** across head dims 64–256 and sequence lengths 512–16K (causal,
# 16K tokens per batch, hidden size 2048). The model, with the baseline's three operations each taking
# the larger of its compute time and its DRAM time at full bandwidth:

# %%
sweep = tt.report_sweep(seq_lens=flashlab.size((512, 1024, 2048, 4096, 8192, 16384), (512, 2048, 8192)))
ratios = np.array([r[4] for r in sweep])
for n_seq, d, fa_ns, base_ns, s in sweep:
    print(f"N {n_seq:5d} d {d:3d}: flash {fa_ns / 1e6:6.2f} ms, unfused {base_ns / 1e6:7.2f} ms, {s:4.1f}x")
print(f"model: {ratios.min():.1f}x to {ratios.max():.1f}x, mean {ratios.mean():.1f}x; report: 9x to 44x, mean 20x")

# %% [markdown]
# The model's speed-ups are several times smaller than the measured ones. The report credits its gains to
# two things (section 4): the intermediates stay in L1 instead of spilling to DRAM, and the fused kernel
# skips the work that causal masking hides, while the baseline computes the full score matrix. The model
# includes both, so they do not explain the gap by themselves. What the model gets wrong, the report does
# not say: it publishes no breakdown of the baseline's time. One suspect is the model's own optimism (its
# baseline streams S and P at the full 288 GB/s and computes at assumed peak rates), but that is a guess
# this lesson cannot check. A model earns its keep by explaining ratios (double buffering, balancing), not
# by matching absolute times.
#
# ## 4. Wormhole next to the CUDA model
#
# | | CUDA GPU (lessons 07–10) | Tenstorrent Wormhole |
# | --- | --- | --- |
# | unit of parallel work | a thread block, run on a streaming multiprocessor (SM) | a Tensix core in a 2D grid |
# | who loads, computes, stores | every thread does all three, unless the kernel specialises warps (FA3's producer/consumer) | separate programs on separate processors: reader, compute, writer |
# | hand-off between them | shared memory plus barriers (`cuda.syncthreads()`) | circular buffers: reserve / push / wait / pop |
# | compute granularity | FP32 units work per thread; tensor cores per warp (`mma.sync`, e.g. 16×8×16) or, on Hopper, per warpgroup of 4 warps (`wgmma`, up to 64×256×16) | 32×32 tiles on the matrix and vector engines |
# | assigning work | launch many more blocks than SMs; the hardware hands the next block to whichever SM is free | a static plan: each core's share is fixed when the program starts |
# | so causal imbalance | is evened out by the block scheduler, in part | must be balanced by the programmer (low + high chunk pairs) |
# | overlap of loads and compute | asynchronous copies, warp specialisation (lesson 11) | built in: reader and compute run concurrently; double-buffered CBs |
#
# The algorithm is the same FA2 as lesson 05: an outer loop over Q chunks (spread over workers), an inner
# loop over K/V chunks with an online softmax, one write of each output chunk. What changes is who moves
# the data and who decides which worker does what.
#
# ## Summary
#
# - A Tensix core runs reader, compute and writer programs concurrently, joined by circular buffers.
# - Two buffer slots let reading overlap computing: $T_2 = t_r + t_c + (n-1)\max(t_r, t_c)$ instead of
#   $n(t_r + t_c)$; the gain is largest when the two costs are equal.
# - On a fixed grid, causal attention needs balancing: pairing chunk $i$ with $n-1-i$ gives every core the
#   same work (model: ~1.5–1.75×; report: 1.6×).
# - Fusing keeps S and P in L1; the report measured 9–44× over its unfused baseline, several times what
#   this model predicts.
#
# **Next:** build the pairing yourself, time a reader/compute/writer pipeline, and count what one core
# reads from DRAM:
# [exercises/12_other_hardware.ipynb](../exercises/12_other_hardware.ipynb).
