# %% [markdown]
# # 19 · Beyond one GPU: ring attention
#
# **After this lesson you can**
# - say why a long enough sequence outgrows one GPU, in memory and in time;
# - split one sequence over W devices and compute exact attention with **ring attention**: each device keeps
#   its queries, the K/V shards travel around a ring, and the partial results merge with lesson 03's rule;
# - run it on `torch.distributed` (here: W CPU processes joined by gloo; on GPUs the same code uses NCCL) and
#   check it against float64 attention;
# - say when the transfers hide under the compute, and find the sequence length where a link (NVLink, PCIe,
#   InfiniBand) keeps up with a GPU;
# - balance a causal mask over the devices with the zigzag layout;
# - say what PyTorch's `context_parallel` and the ring-flash-attention library add.
#
# Sources: Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
# (arXiv 2310.01889), for the ring; Brandon et al., "Striped Attention: Faster Ring Attention for Causal
# Transformers" (arXiv 2311.09431), for balancing the causal mask; the zigzag layout of the ring-flash-attention
# library (github.com/zhuzilin/ring-flash-attention) and PyTorch's `torch.distributed.tensor.experimental`
# for what real systems do. The code is our own: `flashlab.ring`.
#
# This lesson needs PyTorch (as lesson 13 does) but no GPU.

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import ring, size
from flashlab.hardware import LINKS
from flashlab.ring import model, simulate
from flashlab.viz import ring as ring_viz

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Why one GPU is not enough
#
# FlashAttention (lessons 04–06) made attention's memory linear in the sequence length N: no N × N matrix is
# ever stored. But linear is not constant. Training keeps, for every token and every layer, some activations
# for the backward, and attention's arithmetic still grows like N². Take a model the shape of Llama 2 7B
# (32 layers, width 4096, 32 heads of 128) on one 80 GB H100 and look at both, as a model
# (`flashlab.ring.model`; its docstrings give the sources of every factor):

# %%
n = np.logspace(3, 7, 200)
shape = model.LLAMA_7B
per_token = 2 * shape["width"] * shape["layers"] + 34 * shape["width"]  # bytes per token, recomputing activations
weights = 16 * shape["params"]  # weights, gradients and Adam's states in mixed precision, on one GPU
attention_s = shape["layers"] * model.step_flops(n, shape["d"], shape["heads"], 0.5) / model.H100_ATTENTION_FLOPS

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
ax = axes[0]
ax.plot(n, (weights + per_token * n) / 1e9, label="weights + optimizer + activations")
ax.axhline(model.H100_MEMORY / 1e9, color="black", ls=":", label="one H100: 80 GB")
ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="GB", title="memory for one sequence")
ax.legend(fontsize=8)
ax = axes[1]
ax.plot(n, attention_s * 3.5, label="attention, forward + backward")  # the backward does 2.5x the forward's work
ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="seconds",
       title="attention time per training step (causal, 32 layers)")
ax.axhline(1, color="gray", lw=0.5)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"in this model the weights and optimizer alone take {weights / 1e9:.0f} GB: one GPU cannot even start; "
      f"8 GPUs sharing them could hold {model.tokens_per_gpu(8, **shape):,.0f} tokens each")

# %% [markdown]
# The left panel is why people shard the *model* over GPUs; the right one is why they must shard the
# *sequence* too: at a million tokens, attention alone takes many minutes per step on one GPU, and the activations
# of the sequence do not fit. Splitting the sequence over W GPUs divides both: each holds N/W tokens, and the
# N² work is spread over W devices. The catch: attention mixes every token with every other one, so the
# devices must exchange something. Ring attention exchanges K and V, in a way that can hide under the compute.
#
# ## 2. The ring: online softmax across devices
#
# Give each of W ranks (processes, one per GPU) one shard of the queries and one of the keys and values. The
# queries never move. The K/V shards travel: at step t, rank r holds the K/V shard of rank (r − t) mod W,
# computes attention of its queries against those keys alone, and passes the shard on to rank r + 1 while it
# receives the next from rank r − 1. After W steps every rank has met every key:

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
ring_viz.plot_ring_steps(4, "contiguous", causal=False, ax=axes[0])
ring_viz.plot_score_owners(16, 4, "contiguous", causal=False, ax=axes[1])
axes[1].set_title("who computes S[i, j] (colour: the query's rank;\nlighter: a later step)", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# Each step gives a rank a partial result for its queries over one shard of keys, as one chunk did in split-KV
# decoding (lesson 14). Here it comes as flashlab's FA2 returns it (and as the Flash-Decoding post writes it): a
# normalised output o_t = O_t / l_t and a log-sum-exp lse_t = m_t + log l_t per row. The merge is lesson 03's,
# with O carried along. Reading (o_t, lse_t) as the state (m = lse_t, l = 1):
#
# $$m = \max(\mathrm{lse}_a, \mathrm{lse}_b), \quad w_a = e^{\mathrm{lse}_a - m}, \quad w_b = e^{\mathrm{lse}_b - m}, \quad
#   o = \frac{w_a o_a + w_b o_b}{w_a + w_b}, \quad \mathrm{lse} = m + \log(w_a + w_b).$$
#
# A rank merges each step's result into its running (o, lse) as it arrives, as FA2 merges each key block
# (lesson 05): online softmax, with a device per block. Nothing is approximate. `flashlab.ring.simulate` plays
# every rank in one NumPy process:

# %%
q, k, v = (rng.standard_normal((2, 64, 16)) for _ in range(3))  # 2 heads, N = 64, d = 16
parts = simulate.rank_partials(q, k, v, rank=1, world_size=4, layout="contiguous")
print("rank 1, step by step: the lse of its first query row over each shard:",
      np.round([lse[0, 0] for _, lse in parts], 3))
o, lse = simulate.ring_numpy(q, k, v, world_size=4, layout="contiguous")
ref_o, ref_lse = flashlab.reference_attention(q, k, v)
print(f"ring over 4 simulated ranks vs float64 attention: o {flashlab.relative_error(o, ref_o):.1e}, "
      f"lse {flashlab.relative_error(lse, ref_lse):.1e}")

# %% [markdown]
# ### On torch.distributed
#
# `flashlab.ring.ring_attention(q, k, v, causal=..., layout=...)` is the same algorithm on real processes.
# Every rank calls it with its own shards (`flashlab.ring.shard`); at each step it posts the transfer of the
# next shard (`torch.distributed.isend` to rank r + 1, `irecv` from rank r − 1) *before* computing on the
# current one, so the two overlap, then waits for the transfer. The send and the receive start together, as
# one batch (`batch_isend_irecv`): NCCL may hold a lone send until its receive is posted, and a ring in which
# every rank sends first would then wait forever. Its local blocks run on flashlab's FA2: the
# NumPy code for CPU tensors, the Numba kernels for CUDA tensors, both returning (o, lse).
#
# The backward runs the same ring. Each rank keeps its q, o, lse and dO; K and V travel as before, and with
# them a buffer of dK and dV for that shard, to which every rank adds its share (the FA2 backward of lesson 06
# on its block, with the merged lse, so P is recomputed exactly). After the last step one more transfer brings
# each dK, dV buffer home. dQ never moves. It is all a `torch.autograd.Function`, so `o.backward()` works.
#
# `flashlab.ring.run_ranks` starts W processes on this machine, joins them with gloo and runs one function on
# each. Here: 4 ranks, each shards the same random inputs, runs the forward and backward, and rank 0 compares
# the gathered results with float64 attention on the full tensors (`flashlab.ring.processes.demo`; from a
# shell, `python -m flashlab.ring --world-size 4` does the same):

# %%
from flashlab.ring.processes import demo

N_DEMO = size(1024, 256)
out = ring.run_ranks(demo, 4, kwargs=dict(H=4, H_kv=2, N=N_DEMO, d=32, causal=True, layout="zigzag", steps=1),
                     timeout=300)
print(f"4 gloo processes, N = {N_DEMO}, 4 heads, 2 K/V heads (GQA), d = 32, causal, float32")
print("relative error vs float64 attention:", {name: f"{e:.1e}" for name, e in out[0]["errors"].items()})

# %% [markdown]
# A rank that raises would leave the others waiting for a shard that never comes; `run_ranks` stops them and
# reports the first rank's error instead, and `ring_attention` compares the shapes and arguments of all ranks
# (one small all-gather) before it starts, so a mismatch is an error that names every rank's shapes, not a
# hang.
#
# ## 3. When does communication hide under compute?
#
# At each step a rank with c = N/W tokens computes Q Kᵀ and P V for its queries against one shard of keys,
# while one shard travels. Draw both against c for an H100-class GPU (bf16, 32 heads, 8 K/V heads, a causal
# mask) and each link of `flashlab.hardware.LINKS`:

# %%
ring_viz.plot_crossover(d=128, heads=32, kv_heads=8, itemsize=2, flops=model.H100_PEAK, causal=True)
plt.show()
for name, link in LINKS.items():
    print(f"{name:15s} {link.bandwidth / 1e9:4.0f} GB/s per direction ({link.source})")

# %% [markdown]
# The compute grows like c², the transfer like c: whatever the link, a long enough shard hides the transfer.
# Per head, the compute is 2 c² d for Q Kᵀ plus 2 c² d for P V (half of that under a causal mask with the
# zigzag layout of section 4); the transfer is K and V, 2 c d numbers per K/V head. Setting the times equal:
#
# $$\frac{4 c^2 d H w}{F} = \frac{2 c d H_{kv} b}{B} \quad\Longrightarrow\quad c^* = \frac{b F}{2 B w} \cdot \frac{H_{kv}}{H},$$
#
# with F the GPU's FLOP/s, B the link's bytes/s per direction, b the bytes per number and w = 1/2 for causal.
# The head dimension cancels. GQA helps (fewer K/V heads to send), and so does a *slower* kernel (smaller F):
# the faster the GPU, the longer the shards it needs to hide a transfer. At the peak, the dots above are the
# crossovers: about a thousand tokens per GPU on NVLink, roughly ten times more over InfiniBand or PCIe.
#
# ## 4. Causal imbalance, and the zigzag layout
#
# With a causal mask, query i sees only keys j ≤ i. Give rank r the r-th contiguous piece of the sequence and
# rank 0 finds that every shard but its own lies in its future: it skips W − 1 steps, while the last rank
# computes at every step. The ring goes as fast as its busiest rank. The zigzag layout cuts the sequence into
# 2W chunks and gives rank r chunks r and 2W − 1 − r, one early and one late. Now every rank computes half a
# block at every step (left: contiguous; right: zigzag; the numbers are the share of a full block):

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
ring_viz.plot_ring_steps(4, "contiguous", causal=True, ax=axes[0])
ring_viz.plot_ring_steps(4, "zigzag", causal=True, ax=axes[1])
plt.tight_layout()
plt.show()
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
ring_viz.plot_score_owners(16, 4, "zigzag", causal=True, ax=axes[0])
ring_viz.plot_causal_work(8, ax=axes[1])
plt.tight_layout()
plt.show()
print("rank 1 of 4 holds, with N = 16:", ring.shard_indices(16, 1, 4, "zigzag"))

# %% [markdown]
# Inside a rank, the zigzag chunks stay in sequence order, so at step 0 (its own keys) the usual top-left
# causal mask on the shard is exact. At a later step a query chunk sees a key chunk either completely (the keys
# come earlier) or not at all: `flashlab.ring.block_plan` lists the calls, and no block is ever half-masked:

# %%
for t in range(4):
    print(f"rank 1, step {t} (keys of rank {(1 - t) % 4}):", ring.block_plan(1, (1 - t) % 4, 4, "zigzag", True),
          "   (query chunks, key chunks, masked)")

# %% [markdown]
# Striped attention (Brandon et al.) balances the mask another way: rank r holds tokens r, r + W, r + 2W, …,
# so every block is almost exactly half masked, with the causal diagonal inside it. When the keys come from a
# later rank, a query must not see the key of its own stripe position either: the diagonal moves down by one.
# ring-flash-attention's striped version computes those blocks with the first query row and the last key left
# out, which turns them back into an ordinary causal block. No block is ever skipped, and none is dense.
#
# ### Explore: the timeline of a ring
#
# Move the world size, the sequence length, the head dimension, the link, the layout and the mask. Each rank
# is a row: a bar is a step's compute, coloured by whose K/V it holds, and the thin grey bar under it is the
# transfer of the next shard. When the link is too slow, the compute bars stand apart: every step waits.

# %%
ring_viz.ring_explorer();

# %% [markdown]
# ## 5. Measured on a CPU
#
# The same `ring_attention`, on the CPU of the machine this course is tested on, with W gloo processes and one
# thread each, against flashlab's FA2 forward in one process on the whole sequence
# (`benchmarks/timing/bench_ring.py`; numbers in `flashlab/data/ring_cpu.json`, figure in
# `benchmarks/results/ring_cpu.png`). Each rank also records the CPU time of its compute at every step, besides
# the wall-clock time:

# %%
data = ring_viz.load_cpu_measurement()
ring_viz.plot_cpu_measurement(data)
plt.show()
print(f"measured {data['date']} on: {data['machine']}")
for row in data["rows"]:
    print(f"N = {row['N']:5d}, W = {row['W']}: ring forward {row['forward_ms']:6.1f} ms, one process "
          f"{row['single_forward_ms']:6.1f} ms; the busiest step: {max(row['compute_cpu_ms_per_step']):6.1f} ms "
          f"of CPU time")

# %% [markdown]
# Read it as a check of the machinery and of the model's shape, not of speed. The CPU time of a step's
# compute (dark blue, and the last column printed) falls with W nearly as (N/W)² says at the largest N: to
# about a quarter with two ranks and about a thirteenth with four, against a sixteenth in the model (at small N
# the fixed cost of each call weighs more). The wall-clock time does not fall: the machine has two cores, shared by
# the W ranks and, that day, by other jobs (the load average is in the title), so a rank waits for a core
# (light blue), and a rank whose neighbour ran late waits for its shard (orange). The transfers themselves are
# copies between processes through the operating system, not an NVLink. With a device per rank, the compute
# is what would remain. On several GPUs the same code runs with NCCL, next.
#
# ### On several GPUs
#
# `benchmarks/timing/bench_ring_gpus.py` runs the same `ring_attention` on the GPUs of one machine, one process
# per GPU joined by NCCL, for W = 1, 2, 4; each rank's blocks run flashlab's GPU kernels. It first checks the
# gathered output and gradients against float64 attention and against flashlab on one GPU, and measures the
# links (an all-gather, and the ring's own exchange of K/V shards). Then it times the ring at a fixed number of
# tokens per GPU and at a fixed total length, with CUDA events around every step, so that each step splits
# into compute and waiting for the next shard. The left panel puts the step times on section 3's model twice:
# with the rates the same run measured (one GPU's FLOP/s at the rank's length, the exchange's GB/s) and with
# the datasheet numbers of the explorer. The numbers, with the GPUs' name and the date, are in
# `ring_gpus.json` beside `ring_cpu.json` in the package's data folder, once such a run is recorded.

# %%
gpus = ring_viz.load_gpu_measurement()
if gpus is None:
    print(f"No multi-GPU run is recorded yet ({ring_viz.GPU_DATA.name} is absent).")
else:
    ring_viz.plot_gpu_measurement(gpus)
    plt.show()
    print("measured on", ring_viz.gpu_label(gpus))
    checks = [r for key, rows in gpus.items() if key.startswith("correctness_") for r in rows]
    print(f"correctness: {sum(r['pass'] for r in checks)} of {len(checks)} cases within twice the one-GPU error")
    for series in ("per_gpu", "total"):
        for row in ring_viz.gpu_rows(gpus, series):
            print(f"{row['tokens_per_rank']:6d} tokens per GPU, N = {row['N']:6d}, W = {row['W']}: step "
                  f"{row['step_ms']:.3f} ms (model {row.get('model_step_ms', float('nan')):.3f} ms), efficiency "
                  f"{row.get('efficiency_forward', float('nan')):.2f} forward, "
                  f"{row.get('efficiency_forward_backward', float('nan')):.2f} with the backward, waiting "
                  f"{100 * row['wait_fraction']:.0f}% of the forward")
    zigzag = [r for series in ("per_gpu", "total") for r in ring_viz.gpu_rows(gpus, series) if r["W"] > 1]
    print(f"\nwith W > 1: at most {100 * max(r['wait_fraction'] for r in zigzag):.0f}% of a forward waits for a "
          f"shard; a step takes {min(r['step_ms'] / r['model_step_ms'] for r in zigzag):.1f}-"
          f"{max(r['step_ms'] / r['model_step_ms'] for r in zigzag):.1f}x the model's compute")

# %% [markdown]
# What to look for. Where the measured points sit on the solid line, the model accounts for the ring: the
# compute of each step, and whatever of the transfer does not hide under it. Where they sit above it, the
# difference is what the model leaves out, such as the host's time to launch a step's kernels and merges,
# which does not shrink as the blocks do. At a fixed total N, each rank's block shrinks as W grows, and with
# it the share of the GPU a block can keep busy: the efficiency tells how much of W times one GPU's speed the
# ring keeps. At a fixed N per GPU the blocks keep their size, so the efficiency would hold if a step ran at one
# GPU's rate. In the recorded run the waiting stays at a few percent: the transfers hide, as the model says at
# these lengths. What is lost is on the compute side: a step gathers the rows that see the arriving keys (two
# chunks of N/(2W) rows that are not adjacent take a copy), runs one kernel call on that smaller block, and
# merges the result into a float32 running output, and all of that is slower per FLOP than one call on a whole
# sequence, the rate the model charges. Less copying and merging per step is the lever here, not the links.
# On the right,
# the causal mask at work: with the contiguous layout the ranks' compute differs (the first rank skips most
# blocks), with zigzag it should be about even; the spread in the legend is (max − min) / mean over ranks.
#
# ## 6. At the scale of a cluster (a model)
#
# Ring attention was made for sequences of millions of tokens on hundreds of GPUs. The model of
# `flashlab.ring.model.at_scale` takes 8 to 1024 GPUs of H100 class (FlashAttention-3's measured forward rate,
# `model.H100_ATTENTION_FLOPS`), eight per node on NVLink, nodes joined by InfiniBand with one port per GPU.
# A ring that leaves the node is as slow as its slowest hop, so every ring larger than 8 GPUs runs at
# InfiniBand's rate. Memory per GPU follows section 1's model, with the weights and optimizer sharded over the
# W GPUs.

# %%
ring_viz.plot_at_scale()
plt.show()
for n_total in (2**20, 2**23):
    for row in model.at_scale(n_total, (8, 64, 1024)):
        print(f"N = {n_total:>9,}, W = {row['W']:4d}: {row['tokens']:9,.0f} tokens per GPU "
              f"(memory allows {row['max_tokens']:7,.0f}), step {row['step_s'] * 1e3:8.3f} ms, {row['bound']}-bound")

# %% [markdown]
# Three things the model says, as a model (no cluster-scale measurement behind it; the GPU run of section 5
# covers one machine):
#
# - **The largest N per GPU** is set by memory, not by the ring: with activations recomputed, between about
#   170 and 200 thousand tokens fit on an 80 GB GPU for this model shape (the black line: more as more GPUs
#   share the weights). So a million tokens need a node of 8, and 1024 GPUs could hold about two hundred
#   million.
# - **The ring is compute-bound** as long as each GPU holds more than the crossover of section 3: a few
#   thousand tokens inside a node, about thirty thousand across InfiniBand for this shape. Below that, adding
#   GPUs makes each step faster only until the link sets the pace (right of the crossing on the left panel).
# - Between the two lines is the useful range: every GPU's memory holds its shard, and the transfers hide.
#
# ## 7. What real systems add
#
# - **PyTorch's `context_parallel`** (`torch.distributed.tensor.experimental`) shards the buffers of a model
#   along the sequence and replaces `scaled_dot_product_attention` inside it with a ring. It offers two
#   ways to move K and V, chosen with `set_rotate_method`: `"allgather"` (the default in the version installed
#   here) gathers every shard onto every rank with one all-gather after the first local block, which is simple
#   but holds all of K and V on every GPU; `"alltoall"` passes each rank's shard to the next one at every
#   step, as our ring does (written as an all-to-all collective in which each rank sends to one other). Its
#   load balancing is on by default: it reorders the sequence with a "head-tail" load balancer, which gives rank
#   r chunks r and 2W − 1 − r, the zigzag layout.
# - **ring-flash-attention** (zhuzilin) wraps the FlashAttention library's kernels: a plain ring, the zigzag
#   ring, a striped variant (Brandon et al.) and the all-gather scheme of the Llama 3 report, with variable-length
#   batches. Its README measures the zigzag ring on 8 GPUs closest to the ideal of one GPU's speed times eight,
#   ahead of the striped one and far ahead of the plain ring, and notes that NVLink is required to get there.
# - A model must also give every token the rotary position it has in the full sequence, whichever rank holds
#   it (ring-flash-attention's README reminds its users to adapt the offsets). `flashlab.ring` computes
#   attention only: no rotary embeddings, no variable-length batches, no dropout.
#
# ## Summary
#
# - Long sequences outgrow one GPU in memory (linear in N) and in time (quadratic): shard the sequence.
# - Ring attention keeps each rank's queries and passes K/V shards around a ring; each step's (o, lse) merges
#   with the rule of lesson 03. The backward passes dK/dV with K/V and brings them home. Exact, any W.
# - The transfer hides under the compute once a rank holds c* = b F H_kv / (2 B w H) tokens: about a thousand
#   at NVLink speed, ten times more across InfiniBand, for an H100 with GQA 32:8.
# - A causal mask starves the first ranks of a contiguous split; the zigzag layout gives every rank one early
#   and one late chunk and balances the work exactly.
#
# **Next:** merge a rank's partial results, write the zigzag map, count the bytes a rank sends and find where a
# link keeps up: [exercises/19_beyond_one_gpu.ipynb](../exercises/19_beyond_one_gpu.ipynb).
