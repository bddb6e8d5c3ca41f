# %% [markdown]
# # Exercises 16: the tensor-core forward
#
# Goes with lesson [16 the tensor-core forward](../notebooks/16_tensor_core_forward.ipynb). Pieces of the
# kernel, written by you:
#
# 1. S = QKᵀ for one warp's 16 rows as a Numba kernel on `mma.sync`, graded in the CUDA simulator;
# 2. the smallest padding of a shared-memory row that keeps `ldmatrix` free of bank conflicts;
# 3. which 16-byte chunks of a K tile each thread of the forward copies, and from where.
#
# Lesson 15's exercises give the fragment layouts these build on.

# %%
import numpy as np

import flashlab
from flashlab import device
from flashlab.kernels import mma

cuda = device.get_cuda()  # numba.cuda: the GPU, or the simulator when there is none
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. One kernel step: S = QKᵀ for one warp
#
# The first product of the tensor kernel, without the rest: one warp (32 threads, launched `[1, 32]`)
# computes the 16 x n_keys scores of 16 query rows,
#
#     S = Q Kᵀ      Q: (16, d) float16,  K: (n_keys, d) float16,  S: (16, n_keys) float32,
#
# with d a multiple of 16 and n_keys a multiple of 8. Q and K arrive as the kernel sees 16-bit data:
# `q` is (16, d/2) uint32 and `k` is (n_keys, d/2) uint32, each word two neighbouring values of a row (the
# lower column in the low half), exactly the registers `mma` wants. So no packing is needed, only the
# right words in the right registers.
#
# For each 8-key n-tile, accumulate over the d/16 k-steps with
# `MMA16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)` (it returns the new c0..c3), then write the four results
# where C's layout puts them. For k-step `ks`, word `w` of a row holds columns 2w and 2w+1, so the k-step's
# 16 columns are words 8ks to 8ks+7. Use plain loads from global memory (no shared memory needed); every
# lane must call `MMA16` the same number of times. The checker launches your kernel in the simulator (or on
# your GPU) on fresh random inputs and compares S with NumPy.

# %%
MMA16 = mma.mma_f16_m16n8k16  # on an sm_75 GPU (Colab's T4): mma.mma_f16_m16n8k8x2, the same registers
if device.device_limits()["cc"] is not None and device.device_limits()["cc"] < (8, 0):
    MMA16 = mma.mma_f16_m16n8k8x2


@cuda.jit
def s_tile(q, k, s):
    ### BEGIN SOLUTION
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    for n in range(k.shape[0] // 8):  # 8-key n-tiles
        c0 = np.float32(0.0)
        c1 = np.float32(0.0)
        c2 = np.float32(0.0)
        c3 = np.float32(0.0)
        for ks in range(q.shape[1] // 8):  # k-steps of 16 dims = 8 words
            w = 8 * ks + t
            key = 8 * n + g
            c0, c1, c2, c3 = MMA16(q[g, w], q[g + 8, w], q[g, w + 4], q[g + 8, w + 4],
                                   k[key, w], k[key, w + 4], c0, c1, c2, c3)
        col = 8 * n + 2 * t
        s[g, col] = c0
        s[g, col + 1] = c1
        s[g + 8, col] = c2
        s[g + 8, col + 1] = c3
    ### END SOLUTION


# %%
Q = rng.standard_normal((16, 32)).astype(np.float16)
K = rng.standard_normal((16, 32)).astype(np.float16)
S = np.zeros((16, 16), np.float32)
s_tile[1, 32](Q.view(np.uint32), K.view(np.uint32), S)
print("largest difference from Q @ K.T:", np.abs(S - Q.astype(np.float64) @ K.astype(np.float64).T).max())

# %%
flashlab.check("s_tile", s_tile)

# %% [markdown]
# ## 2. How much padding?
#
# The kernel keeps K and V tiles in shared memory, one row per key, and reads them with `ldmatrix`: the 8 lanes
# of one phase of the instruction each read the first 16 bytes of one of 8 consecutive rows. Shared memory has
# 32 banks of 4 bytes, and a phase is served at once only if its 8 chunks of 16 bytes (4 banks each) fall in 8
# different groups of 4 banks (lesson 16, step 2). Rows are W words long (4-byte words) and stored
# `W + p` words apart; `p` words of padding must keep every row 16-byte aligned, because `cp.async` and
# `ldmatrix` move 16-byte chunks.
#
# Write `row_padding(W)`: the smallest padding `p`, in words, for which the 8 rows of a phase never share a bank
# group. Then print it for the row widths of the kernel's head dimensions in float16 and float32.

# %%
def row_padding(W):
    """The fewest 4-byte words of padding after each W-word row that make 8 consecutive rows' first 16 bytes fall
    in 8 different groups of 4 banks, keeping rows 16-byte aligned."""
    ### BEGIN SOLUTION
    for p in range(0, 33, 4):
        groups = {(r * (W + p)) % 32 // 4 for r in range(8)}
        if len(groups) == 8:
            return p
    ### END SOLUTION


# %%
for d in (16, 32, 64, 128):
    print(f"d = {d:3d}: float16 rows of {d // 2:3d} words need {row_padding(d // 2)}, float32 rows of {d:3d} words "
          f"need {row_padding(d)}")
print("a 12-word row (d = 24 in float16) needs", row_padding(12))

# %%
flashlab.check("row_padding", row_padding)

# %% [markdown]
# ## 3. Which chunks does a thread copy?
#
# Step 2 of the lesson: the block copies each K tile (`block_k` rows of W words) into shared memory with
# `cp.async`, 16 bytes (4 words, one *chunk*) per copy, with all `threads` threads of the block copying at once.
# Rows sit W + 4 words apart in shared memory (your padding at the kernel's head dimensions) and `row_stride`
# words apart in the source: in a packed varlen batch (lesson 18) the rows of one head are `H_kv * W` words
# apart, not W. Work out the order yourself from what the hardware wants:
#
# - **coalesced:** at each copy step, the 32 threads of a warp read 32 consecutive chunks of the tile, row by
#   row, thread 0 of the warp first, so that a warp's 512 bytes are one contiguous piece of memory where rows
#   are contiguous;
# - **cheap addresses:** from one copy to the next a thread moves down the same number of rows and keeps its
#   column (`threads` is a multiple of the chunks in a row), so each source address is the previous one plus a
#   constant;
# - **ragged tails:** past the keys (`k0 + row >= n_k`) a copy moves 0 bytes: `cp.async` then writes 16 zero bytes,
#   and its source must still be a valid address: the same column of the tile's first row, k0, which always
#   exists.
#
# Write `copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide)`: the list of
# `(shared word, source word, bytes)` of thread `tid`'s copies, in order. A row is W = d/2 words in 16 bits,
# d in float32 (`wide`); source words count from the first row of this head's K.

# %%
def copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """(shared word, source word, bytes) of each 16-byte copy thread tid makes of one K tile."""
    ### BEGIN SOLUTION
    W = d if wide else d // 2
    chunks = W // 4
    row, col = tid // chunks, 4 * (tid % chunks)
    out = []
    while row < block_k:
        ok = k0 + row < n_k
        out.append((row * (W + 4) + col, (k0 + row) * row_stride + col if ok else k0 * row_stride + col,
                    16 if ok else 0))
        row += threads // chunks
    return out
    ### END SOLUTION


# %%
# 128 threads, d = 64 in float16 (32 words, 8 chunks a row), the second tile of 64 keys, 100 keys in all
for tid in (0, 1, 8, 127):
    print(f"thread {tid:3d}:", copy_plan(tid, 128, 64, 64, 64, 100, 32, False))

# %%
flashlab.check("copy_plan", copy_plan)

# %% [markdown]
# ## 4. Think about it
#
# - In exercise 1 every lane reads its Q words again for every n-tile. How many 32-bit registers would it
#   take to keep a lane's Q fragments for all k-steps at d = 64, and d = 128? The tensor kernel keeps them
#   (step 1 of the lesson): what limits how large d can get?
# - Exercise 1 reads each B register straight from global memory, one word per lane. Which instruction does
#   the tensor kernel use instead, and how many words does one of them give each lane?
# - The forward gives each warp two m-tiles of 16 rows for 16-bit inputs. At d = 64, count the `ldmatrix` and
#   the `mma` a warp issues for one key tile with one m-tile, then with two. Why does that ratio matter when
#   shared memory delivers fewer bytes per cycle than the tensor cores consume? And what does the second
#   m-tile cost in registers (Q's fragments, S, O)? Why does the float32 build keep one?
# - With exercise 3: a thread's source word grows by the same amount from one copy to the next. In a paged
#   KV cache (lesson 18) the rows of one tile may sit in different pages. Which part of `copy_plan` stops
#   being a constant step, and what must the kernel read for every row instead (`kernels/tensor.py` keeps
#   the general copy for its paged build)?
