# %% [markdown]
# # Exercises 07: first kernels
#
# Goes with lesson [07 GPU programming with Numba](../notebooks/07_gpu_numba.ipynb). Two kernels that use
# every idea of the lesson: a grid of blocks, a guard for the last, partial block, a shared array and
# `cuda.syncthreads()` between the threads that write it and the threads that read it.
#
# Without a GPU the kernels run in Numba's CUDA simulator, and `flashlab.check` also runs them under a
# race check: it reports a thread that reads a shared element another thread wrote with no barrier in
# between, overwrites one that others may still be reading, or reads one nobody wrote.

# %%
import numpy as np
from numba import float32

import flashlab
from flashlab.device import get_cuda

cuda = get_cuda()  # numba.cuda: the GPU, or the simulator when there is none

# %% [markdown]
# ## 1. Block sums: a reduction in shared memory
#
# Block `b` of `TPB` threads adds up the chunk `x[b*TPB : (b+1)*TPB]` and writes the total to `out[b]`;
# the grid has `ceil(n / TPB)` blocks, so the last chunk may be shorter (its missing elements count as 0).
#
# The usual pattern is a tree: every thread loads one element into a shared array `buf`, then for
# `s = TPB/2, TPB/4, ..., 1` the threads `t < s` do `buf[t] += buf[t + s]`. Each step reads what other
# threads wrote in the step before, so there is a `cuda.syncthreads()` after the load and after every step.
# Thread 0 writes the result.
#
# NumPy spec: `out = np.add.reduceat(x, np.arange(0, len(x), TPB))`.

# %%
TPB = 32  # threads per block: a constant, because a shared array's size must be known when compiling


@cuda.jit
def block_sums(x, out):
    ### BEGIN SOLUTION
    buf = cuda.shared.array(TPB, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * TPB + t
    buf[t] = x[i] if i < x.shape[0] else 0.0
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if t < s:
            buf[t] += buf[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = buf[0]
    ### END SOLUTION


# %%
x = np.arange(70, dtype=np.float32)
out = np.zeros(3, np.float32)
block_sums[3, TPB](x, out)  # NumPy arrays are copied to the device and back for you
print(out, "expected", np.add.reduceat(x, [0, 32, 64]))

# %%
flashlab.check("block_sums", block_sums)

# %% [markdown]
# ## 2. A tiled transpose
#
# A warp's memory accesses are **coalesced** when consecutive threads touch consecutive addresses: the
# hardware then serves all 32 threads with a few wide transactions instead of one per thread.
# `out = a.T` for a float32 matrix `a` of shape `(rows, cols)`. A direct `out[c, r] = a[r, c]` reads rows
# of `a` with consecutive threads (coalesced) but writes columns of `out` (every thread of a warp touches a
# different 32-byte segment). Going through shared memory fixes that: a block of `TILE x TILE` threads
#
# 1. reads a `TILE x TILE` tile of `a` with `tx` along the columns (coalesced) into `tile[ty, tx]`,
# 2. waits for the whole tile (`cuda.syncthreads()`),
# 3. writes the transposed tile, again with `tx` along the columns of `out`, reading `tile[tx, ty]`.
#
# The grid is `(ceil(cols / TILE), ceil(rows / TILE))`: `blockIdx.x` walks the columns of `a`, `blockIdx.y`
# its rows. Guard both the read and the write: the edge tiles are partial.

# %%
TILE = 8  # the block is TILE x TILE threads


@cuda.jit
def transpose_tiled(a, out):
    ### BEGIN SOLUTION
    tile = cuda.shared.array((TILE, TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if r < a.shape[0] and c < a.shape[1]:
        tile[ty, tx] = a[r, c]
    cuda.syncthreads()
    out_r, out_c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx  # out[out_r, out_c] = a[out_c, out_r]
    if out_r < out.shape[0] and out_c < out.shape[1]:
        out[out_r, out_c] = tile[tx, ty]
    ### END SOLUTION


# %%
a = np.arange(30, dtype=np.float32).reshape(5, 6)
out = np.zeros((6, 5), np.float32)
transpose_tiled[(1, 1), (TILE, TILE)](a, out)
print("matches a.T:", np.array_equal(out, a.T))

# %%
flashlab.check("transpose_tiled", transpose_tiled)

# %% [markdown]
# ## 3. Sectors per request
#
# No kernel this time: a model of what one warp's load costs. The hardware serves it in **sectors**: 32
# aligned bytes, sector `k` being bytes `32k` to `32k + 31`. Write `sectors_per_request(addresses, nbytes)`:
#
# - `addresses`: a NumPy integer array with the byte address each active thread of the warp reads (1 to
#   32 entries, in any order; several threads may read the same address);
# - `nbytes`: how many bytes each thread reads from its address: 1, 2, 4, 8 or 16 (a 16-byte vector load
#   brings 4 floats). Every address is a multiple of `nbytes`, as the hardware requires;
#
# and return, as an `int`, how many different sectors hold at least one byte that some thread reads.
#
# Before you run the cell after it, predict: a warp reading every third float of an array that starts at
# address 0; a warp whose 32 threads all read the float at address 1024; a warp of 16-byte loads, one per
# row of a row-major float32 matrix with 64 floats per row.

# %%
def sectors_per_request(addresses, nbytes):
    ### BEGIN SOLUTION
    addresses = np.asarray(addresses, dtype=np.int64)
    first = addresses // 32
    last = (addresses + nbytes - 1) // 32  # the same sector unless a thread's bytes straddle a boundary
    return int(np.unique(np.concatenate([first, last])).size)
    ### END SOLUTION


# %%
lane = np.arange(32)
print("every third float:  ", sectors_per_request(12 * lane, 4))
print("one float, 32 times:", sectors_per_request(np.full(32, 1024), 4))
print("16 bytes per row:   ", sectors_per_request(256 * lane, 16))

# %%
flashlab.check("sectors_per_request", sectors_per_request)
