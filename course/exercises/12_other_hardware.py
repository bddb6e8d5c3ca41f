# %% [markdown]
# # Exercises 12: other hardware
#
# Goes with lesson [12 other hardware](../notebooks/12_other_hardware.ipynb). You will hand out causal
# Q chunks so that every core does the same work, predict how long a core's reader, compute and writer
# programs take together, and count the data one core moves to and from DRAM.
#
# Write each function where it says `# YOUR CODE HERE`, run the small example, then the
# `flashlab.check(...)` cell.

# %%
import numpy as np

import flashlab
from flashlab import tenstorrent

# %% [markdown]
# ## 1. Pairing low and high Q chunks
#
# Under causal masking, Q chunk `i` (of `n`, with K chunks the same size) attends to K chunks `0..i`:
# `i + 1` of them. Give each of `n_cores` cores pairs of chunks `(i, n - 1 - i)`; every pair sees
# `n + 1` key chunks, so every core gets the same work. Assume `n` is a multiple of `2 * n_cores`.

# %%
def tt_causal_pairing(n_chunks, n_cores):
    """A list of n_cores lists: the Q chunk indices each core computes, in low/high pairs."""
    ### BEGIN SOLUTION
    pairs = [(i, n_chunks - 1 - i) for i in range(n_chunks // 2)]
    per_core = len(pairs) // n_cores
    return [[c for pair in pairs[k * per_core:(k + 1) * per_core] for c in pair] for k in range(n_cores)]
    ### END SOLUTION


# %%
parts = tt_causal_pairing(16, 8)
print(parts)
print([sum(i + 1 for i in core) for core in parts])  # the same for every core

# %%
flashlab.check("tt_causal_pairing", tt_causal_pairing)

# %% [markdown]
# ## 2. Three programs, one or two slots
#
# The lesson timed a reader and a compute program. A real core also runs a **writer**, with a circular
# buffer of its own between compute and writer. Each of `n_chunks` chunks goes through three programs,
# and both buffers have `depth` slots:
#
# | program | for each chunk, in order |
# | --- | --- |
# | reader | reserve a slot of buffer `in`; read the chunk (`t_read`); push it |
# | compute | wait for a filled slot of `in`; reserve a slot of `out`; compute (`t_compute`); pop `in`; push `out` |
# | writer | wait for a filled slot of `out`; write the result (`t_write`); pop `out` |
#
# A program waits whenever the slot it asks for is not there. Work out, on paper first, which steps can
# run at the same time with one slot per buffer, and which with two or more; then write the finishing
# time (when the writer has written the last chunk). Try `t_read=1, t_compute=2, t_write=0.5` with one
# slot and draw the first three chunks.

# %%
def tt_pipeline_time(t_read, t_compute, t_write, n_chunks, depth):
    """Time until the writer has written all n_chunks results; both buffers have `depth` (>= 1) slots."""
    ### BEGIN SOLUTION
    if depth == 1:  # reading chunk j+1 overlaps writing chunk j; compute overlaps nothing
        return t_read + t_compute + t_write + (n_chunks - 1) * (t_compute + max(t_read, t_write))
    return t_read + t_compute + t_write + (n_chunks - 1) * max(t_read, t_compute, t_write)
    ### END SOLUTION


# %% [markdown]
# `tenstorrent.pipeline_time(t_read, t_compute, n_chunks, depth, t_write=...)` simulates these three
# programs event by event: compare your formula with it, for one slot and for two.

# %%
for depth in (1, 2):
    print(f"depth {depth}: yours {tt_pipeline_time(1.0, 2.0, 0.5, 5, depth)}, "
          f"simulated {tenstorrent.pipeline_time(1.0, 2.0, 5, depth, t_write=0.5)}")

# %%
flashlab.check("tt_pipeline_time", tt_pipeline_time)

# %% [markdown]
# ## 3. What one core reads from DRAM
#
# A core owns some Q chunks of one head (`chunks`, indices of chunks of `q_chunk` rows); K and V are split
# into chunks of `k_chunk` rows, and the sequence has `seq_len` rows of `d` values. For each Q chunk it
# owns, the core's **reader** fetches the Q chunk, then K_j and V_j for every K chunk j that Q chunk needs;
# its **writer** writes the finished O chunk. Nothing stays in L1 from one Q chunk to the next.
#
# Under causal masking a Q chunk needs only the K chunks that hold at least one key it may see; a K chunk
# the mask cuts in the middle is still fetched whole. Careful: `q_chunk` and `k_chunk` may differ.
# Return `(values read, values written)`.

# %%
def tt_core_reads(chunks, seq_len, d, q_chunk, k_chunk, causal):
    """(values the core's reader fetches from DRAM, values its writer writes) for the Q chunks `chunks`."""
    ### BEGIN SOLUTION
    n_k = seq_len // k_chunk
    kv_chunks = 0
    for i in chunks:
        last_row = (i + 1) * q_chunk - 1
        kv_chunks += min(n_k, last_row // k_chunk + 1) if causal else n_k
    return len(chunks) * q_chunk * d + 2 * kv_chunks * k_chunk * d, len(chunks) * q_chunk * d
    ### END SOLUTION


# %% [markdown]
# With equal chunk sizes, the pairs of exercise 1 read the same amount on every core, as they compute the
# same amount; and a larger Q chunk reads each K/V chunk fewer times:

# %%
print([tt_core_reads(core, 4096, 128, 256, 256, True)[0] for core in ([0, 15], [1, 14], [7, 8])])
for q_chunk in (64, 128, 256, 512):
    n = 4096 // q_chunk
    print(f"q_chunk {q_chunk:3d}: one head reads {tt_core_reads(range(n), 4096, 128, q_chunk, 256, True)[0] / 1e6:.1f} M values")

# %%
flashlab.check("tt_core_reads", tt_core_reads)

# %% [markdown]
# ## 4. Think about it
#
# - In exercise 2, when does a second slot pay off the most, and why does a third one add nothing?
# - In exercise 3, Q is read once and K, V once per Q chunk. How do one head's reads scale with q_chunk,
#   and what limits how large q_chunk can get on a core with 1.5 MB of L1?
