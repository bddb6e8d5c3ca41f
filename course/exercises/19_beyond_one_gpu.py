# %% [markdown]
# # Exercises 19: ring attention
#
# Goes with lesson [19 beyond one GPU](../notebooks/19_beyond_one_gpu.ipynb). Four pieces of ring attention:
# merging what one rank computes at each step of the ring, the zigzag layout's index map, the bytes a rank
# sends, and the sequence length at which a link keeps up with the GPU. No processes are needed: the checker
# plays every rank itself (`flashlab.ring.simulate`) and compares with the exact float64 attention and with
# counts made by hand.

# %%
import numpy as np

import flashlab
from flashlab.hardware import LINKS
from flashlab.ring import simulate

# %% [markdown]
# ## 1. Merging one rank's partial results, in ring order
#
# At step t of the ring, a rank holds the K/V shard of rank (rank − t) mod W and computes attention of its
# queries against those keys alone: a normalised output `o_t` and, per query row, the log-sum-exp
# `lse_t = m_t + log l_t` of its scores. A row that sees none of the shard's keys (a causal mask) gets the
# empty state, `o_t = 0` and `lse_t = -inf`.
#
# `o_parts` has shape (W, ..., n, dv) and `lse_parts` (W, ..., n): the W states in ring order. Merge them into
# the rank's final `(o, lse)`. Each state is lesson 03's (m, l) with m = lse_t and l = 1, and o_t rides along:
#
#     m = max over t of lse_t                  w_t = exp(lse_t - m)
#     o = sum_t w_t o_t / sum_t w_t            lse = m + log(sum_t w_t)
#
# Merge one step at a time, as the rank does while the next shard travels, or all at once: both are right.
# Scores can be large, so never take exp of an lse itself. Compute in float64 for float64 inputs, else float32.

# %%
def ring_merge(o_parts, lse_parts):
    """(o, lse) of a rank from its W partial results in ring order."""
    ### BEGIN SOLUTION
    ct = np.float64 if o_parts.dtype == np.float64 else np.float32
    o, lse = o_parts[0].astype(ct), lse_parts[0].astype(ct)
    for o_t, lse_t in zip(o_parts[1:], lse_parts[1:]):
        m = np.maximum(lse, lse_t)
        m_safe = np.where(np.isinf(m), 0, m)  # both empty: no -inf - (-inf)
        w_a, w_b = np.exp(lse - m_safe), np.exp(lse_t - m_safe)
        l = w_a + w_b
        l_safe = np.where(l > 0, l, 1)
        o = (w_a[..., None] * o + w_b[..., None] * o_t) / l_safe[..., None]
        lse = np.where(l > 0, m_safe + np.log(l_safe), -np.inf)
    return o, lse
    ### END SOLUTION


# %%
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))  # 2 heads, N = 16, d = 8
parts = simulate.rank_partials(q, k, v, rank=1, world_size=4, layout="zigzag", causal=True)
o, lse = ring_merge(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
ref_o, _ = flashlab.reference_attention(q, k, v, causal=True)
print("rank 1 holds tokens", flashlab.ring.shard_indices(16, 1, 4), "; error:",
      flashlab.relative_error(o, ref_o[:, flashlab.ring.shard_indices(16, 1, 4)]))

# %%
flashlab.check("ring_merge", ring_merge)

# %% [markdown]
# ## 2. The zigzag index map
#
# With W ranks, the zigzag layout cuts the N tokens into 2W chunks of N / (2W) tokens, numbered 0 to 2W − 1,
# and gives rank r chunks r and 2W − 1 − r. Return the positions (in the full sequence) of the tokens rank
# `rank` holds, in increasing order, as a NumPy array of integers. N is a multiple of 2W.

# %%
def zigzag_indices(N, rank, world_size):
    """Positions of the tokens rank `rank` holds in the zigzag layout, in increasing order."""
    ### BEGIN SOLUTION
    c = N // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return np.concatenate([np.arange(first * c, (first + 1) * c), np.arange(second * c, (second + 1) * c)])
    ### END SOLUTION


# %%
print(zigzag_indices(16, 0, 4), zigzag_indices(16, 3, 4))  # [0 1 14 15] [6 7 8 9]

# %%
flashlab.check("zigzag_indices", zigzag_indices)

# %% [markdown]
# ## 3. The bytes a rank sends
#
# A sequence of N tokens is split over W ranks (N/W tokens each); K and V each have `kv_heads` heads of
# dimension d, for `batch` sequences, and `itemsize` bytes per number. Return the bytes one rank sends
# `(forward, backward)`:
#
# - in the forward, its K/V shard goes on to the next rank at every step but the last;
# - in the backward, K and V travel the same way again, and with them a buffer of dK and dV (as many numbers
#   as K and V, `grad_itemsize` bytes each: float32, so that adding the ranks' shares loses nothing), which is
#   sent at every step, the last send bringing it home.
#
# One rank alone sends nothing.

# %%
def ring_bytes(N, world_size, batch, kv_heads, d, itemsize, grad_itemsize):
    """(bytes sent in a forward, bytes sent in a backward) by one rank."""
    ### BEGIN SOLUTION
    shard = 2 * batch * kv_heads * (N // world_size) * d  # numbers in K and V of one shard
    forward = (world_size - 1) * shard * itemsize
    backward = forward + (world_size * shard * grad_itemsize if world_size > 1 else 0)
    return forward, backward
    ### END SOLUTION


# %%
fwd, bwd = ring_bytes(N=131072, world_size=8, batch=1, kv_heads=8, d=128, itemsize=2, grad_itemsize=4)
print(f"forward {fwd / 2**20:.0f} MiB, backward {bwd / 2**20:.0f} MiB per rank")

# %%
flashlab.check("ring_bytes", ring_bytes)

# %% [markdown]
# ## 4. When does the link keep up?
#
# At each step a rank computes attention of its c = N/W queries against c keys: Q Kᵀ and P V, 2 c² d FLOPs
# each per head, H heads, at `peak_flops` FLOP/s. Under a causal mask with the zigzag layout it computes half
# of that at every step. Meanwhile it sends one K/V shard (c tokens, `kv_heads` heads, d numbers each, for K
# and for V, `itemsize` bytes per number) at `bandwidth` bytes/s. Return the total sequence length N at which
# the compute of a step takes exactly as long as its transfer (a real number: the model's crossover, not
# rounded). The head dimension d is not an argument: find out why.

# %%
def hiding_length(world_size, heads, kv_heads, itemsize, peak_flops, bandwidth, causal):
    """The total N at which a ring step's compute and transfer take the same time."""
    ### BEGIN SOLUTION
    work = 0.5 if causal else 1.0
    tokens = itemsize * peak_flops * kv_heads / (2 * bandwidth * heads * work)  # 4 c^2 d H w / F = 2 c d Hkv b / BW
    return world_size * tokens
    ### END SOLUTION


# %%
for name, link in LINKS.items():
    n = hiding_length(8, 32, 8, 2, 989e12, link.bandwidth, causal=True)
    print(f"{name:15s} {link.bandwidth / 1e9:5.0f} GB/s: N >= {n:9,.0f} on 8 GPUs ({n / 8:7,.0f} per GPU)")

# %%
flashlab.check("hiding_length", hiding_length)

# %% [markdown]
# ## 5. Think about it
#
# - Exercise 4 at the H100's peak, with 8 K/V heads for 32 query heads, gives a crossover of about a thousand
#   tokens per GPU on NVLink. A kernel that reaches half the peak needs how many? Is a slow kernel easier or
#   harder to hide transfers under?
# - Grouped-query attention with 8 K/V heads for 32 query heads: what does it do to the crossover, and why?
# - From exercise 3: the backward sends more than twice the bytes of the forward. Which part could travel in
#   bfloat16 instead of float32, and what would adding W bf16 partial gradients cost in accuracy?
# - In exercise 1 the order of the merges does not change the answer (up to rounding). Which property of the
#   merge makes that true, and why does the ring rely on it?
