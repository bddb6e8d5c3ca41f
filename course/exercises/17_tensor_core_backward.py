# %% [markdown]
# # Exercises 17: the tensor-core backward
#
# Goes with lesson [17 the tensor-core backward](../notebooks/17_tensor_core_backward.ipynb):
#
# 1. where each value of the backward's dS fragment sits in the warp's dSᵀ;
# 2. the bytes of shared memory one block of the backward needs.

# %%
import numpy as np

import flashlab

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Where dS comes from (the backward)
#
# In the tensor backward (lesson 17, section 1) each warp ends a tile holding dSᵀ for its 16 keys and 16 queries
# as the C fragments of two m16n8 n-tiles: n-tile 0 has queries 0-7, n-tile 1 queries 8-15, rows = keys.
# dQ += dS K needs dS as the A fragment of an `mma.m16n8k16`: rows = queries, columns = keys.
#
# Write `ds_source(lane, i)`: for element `i` (0-7, PTX order, as in lesson 15's exercise 1) of `lane`'s A fragment of
# dS, return `(n_tile, source_lane, c)`: which n-tile of dSᵀ, which lane, and which of its C values
# (c0..c3) holds that value. This map is what the shared-memory round trip and `ldmatrix.trans` carry out.
# Then count how many of the 256 values stay in their own lane.

# %%
def ds_source(lane, i):
    """(n_tile, source_lane, c): where element i of `lane`'s A fragment of dS sits in the C fragments of dS^T."""
    ### BEGIN SOLUTION
    g, t = lane // 4, lane % 4
    query, key = g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)  # the A element is dS[query, key] ...
    col = query % 8  # ... = dS^T[key, query]: row `key`, column query % 8 of n-tile query // 8
    return query // 8, 4 * (key % 8) + col // 2, col % 2 + 2 * (key // 8)
    ### END SOLUTION


# %%
stay = sum(ds_source(L, i)[1] == L for L in range(32) for i in range(8))
print(f"{stay} of 256 values are already in the right lane")

# %%
flashlab.check("ds_source", ds_source)

# %% [markdown]
# ## 2. Will the tile fit? The backward's shared memory
#
# A block of the tensor backward (lesson 17, section 1) owns `block_k` keys and loops over the query tiles. Work
# out what it must hold in shared memory, from what the kernel does, and count it in 32-bit words:
#
# - what every warp reads on every query tile and the block keeps for the whole loop: the key-side operands of
#   the five products. V is among them only with `v_shared`; otherwise each warp holds V's fragments in
#   registers;
# - what arrives anew with each query tile, in `stages` buffers (two: the next tile is copied while this one is
#   used): the query-side operands of the products, and the per-row float32 statistics that recompute P and dS
#   (lesson 06);
# - the one product result that must change lanes before it is used again: lesson 17 section 1 sends it through
#   shared memory, one row per key.
#
# Every row of a tile takes d values (or `block_q`, for the result), two to a word in 16-bit precisions and one
# in float32, plus lesson 16's 4 words of padding; the statistics are unpadded. dQ needs no room here: it goes
# to global memory with atomics.
#
# Write `backward_tile_bytes(d, block_q, block_k, stages, v_shared, wide)`, the bytes a block needs (`wide`:
# float32 inputs). Then see which of the default tiles fit in 48 KB of static shared memory and which need
# the opt-in of lesson 7.

# %%
def backward_tile_bytes(d, block_q, block_k, stages, v_shared, wide):
    """Bytes of shared memory one block of the tensor backward needs."""
    ### BEGIN SOLUTION
    row = (d if wide else d // 2) + 4  # words in a padded row of K, V, Q or dO
    ds_row = (block_q if wide else block_q // 2) + 4  # a padded row of dS^T
    words = ((2 if v_shared else 1) * block_k * row + 2 * stages * block_q * row + block_k * ds_row
             + 2 * stages * block_q)
    return 4 * words
    ### END SOLUTION


# %%
# The default tiles (warps, block_q, stages, v_shared) per kind of input and d; a warp owns 16 keys
from flashlab.kernels.tensor_backward import DEFAULT_TILES

for kind, wide in (("16-bit", False), ("float32", True)):
    for d in (64, 128):
        warps, block_q, stages, v_shared = DEFAULT_TILES[kind][d]
        nbytes = backward_tile_bytes(d, block_q, 16 * warps, stages, v_shared, wide)
        print(f"{kind:8s} d={d:3d} tile {block_q}x{16 * warps}: {nbytes / 1024:6.1f} KB, "
              f"{'fits 48 KB' if nbytes <= 48 * 1024 else 'needs the opt-in'}")

# %%
flashlab.check("backward_tile_bytes", backward_tile_bytes)

# %% [markdown]
# ## 3. Think about it
#
# - With exercise 2: an H100 SM has 228 KB of shared memory. How many blocks of each default tile fit on one
#   SM by shared memory alone? The registers allow 8 warps an SM for the 16-bit tiles; which of the two limits
#   binds? Keeping V in shared memory frees the registers that held V's fragments (in float32, one for every
#   two of V's dimensions): what does it cost instead?
