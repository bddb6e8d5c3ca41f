# %% [markdown]
# # Exercises 12: other hardware
#
# Goes with lesson [12 other hardware](../notebooks/12_other_hardware.ipynb). You will hand out causal
# Q chunks so that every core does the same work, and predict how long a reader/compute pipeline takes
# with one or two buffer slots.
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
# ## 2. How long does a reader/compute pipeline take?
#
# A reader loads `n_chunks` chunks (each `t_read`) into a circular buffer with `depth` slots; compute
# processes each (each `t_compute`) and frees its slot. Give the finishing time for `depth` 1 or 2.
# `tenstorrent.pipeline_time` simulates it, if you want to test your formula.

# %%
def tt_pipeline_time(t_read, t_compute, n_chunks, depth):
    """Time until compute has finished every chunk (depth is 1 or 2)."""
    ### BEGIN SOLUTION
    if depth == 1:
        return n_chunks * (t_read + t_compute)
    return t_read + t_compute + (n_chunks - 1) * max(t_read, t_compute)
    ### END SOLUTION


# %%
print(tt_pipeline_time(1.0, 2.0, 5, 1), tt_pipeline_time(1.0, 2.0, 5, 2))
print(tenstorrent.pipeline_time(1.0, 2.0, 5, 1), tenstorrent.pipeline_time(1.0, 2.0, 5, 2))

# %%
flashlab.check("tt_pipeline_time", tt_pipeline_time)
