# %% [markdown]
# # Exercises 20: FlashAttention-3 on Hopper
#
# Goes with lesson [20 FlashAttention-3](../notebooks/20_flashattention3.ipynb). Six pieces of the wgmma kernels
# (`flashlab/kernels/wgmma.py`, `wgmma_backward.py`): the descriptor that tells wgmma where a tile's k16 step is,
# the mbarrier parities of the K/V ring, where TMA puts a value of a tile loaded as two swizzled boxes, the order of
# a consumer's steps under pingpong and intra-warpgroup overlap, where the backward's products find their
# operands, and what dQ's reduction costs. Each checker compares with the model the kernels are tested against
# (`flashlab.fragments`, `flashlab.pipeline`). No GPU is needed.

# %%
import flashlab
from flashlab import pipeline

# %% [markdown]
# ## 1. A tile's descriptor
#
# The kernel keeps 16-bit tiles of d = 128 columns in shared memory as TMA left them: two boxes of 64 columns
# (128 bytes a row, the 128-byte swizzle's span), box 1 stored after all `rows` rows of box 0. wgmma finds one
# k16 step of an operand through a 64-bit descriptor:
#
# | bits | field |
# | --- | --- |
# | 0–13 | start address >> 4 |
# | 16–29 | leading-dimension byte offset (LBO) >> 4 |
# | 32–45 | stride-dimension byte offset (SBO) >> 4 |
# | 62–63 | swizzle mode: 1 = 128 bytes (2 = 64, 3 = 32, 0 = none) |
#
# With the 128-byte swizzle the hardware walks 8 rows of 128 bytes at a time, so SBO (the step from one group of
# 8 rows to the next) is 8 × 128 = 1024 bytes in both cases below.
#
# - **K-major** (Q as A, K as B of S = Q Kᵀ): the tile's rows are M (or N), its columns K. A k16 step is 16
#   columns: 32 bytes further along the rows, in box k0 // 64. LBO is not used with this swizzle: put 16.
# - **MN-major** (V as B of O = P V, stored row-major: rows are keys, the K dimension): a k16 step is 16 rows
#   further down. Along N (d), wgmma needs the next 64 columns: that is LBO, the distance between the boxes.
#
# Return the descriptor (an int) of step `k0` (a multiple of 16) of a tile of `rows` rows whose first byte is at
# shared address `address` (a multiple of 1024), for `major` "K" or "MN".

# %%
def wgmma_descriptor(address, rows, major, k0):
    """The 64-bit matrix descriptor of k16 step k0 of a (rows x 128) 16-bit tile at `address`."""
    ### BEGIN SOLUTION
    if major == "K":
        start, lbo, sbo = address + (k0 // 64) * rows * 128 + (k0 % 64) * 2, 16, 1024
    else:
        start, lbo, sbo = address + k0 * 128, rows * 128, 1024
    return (start >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | 1 << 62
    ### END SOLUTION


# %%
print(hex(wgmma_descriptor(1024, 128, "K", 80)))  # Q's step 5: box 1, 32 bytes in: 0x4000004000010442
print(hex(wgmma_descriptor(1024, 128, "MN", 16)))  # V's step 1: 16 rows down

# %%
flashlab.check("wgmma_descriptor", wgmma_descriptor)

# %% [markdown]
# ## 2. The ring's parities
#
# The producer copies K/V tile j into slot `j % stages` of the ring. Each slot has a *full* barrier (the copy's
# bytes arrived) and an *empty* one (the consumers are done with the slot). An mbarrier counts phases; the first
# to complete has parity 0, then 1, 0, ... and `try_wait.parity(p)` returns once the phase of parity p has
# completed. Return `(slot, full_parity, empty_parity)` for tile j: the slot, the parity a consumer waits for on
# its full barrier, and the parity the producer waits for on its empty barrier before copying tile j, or `None`
# where there is nothing to wait for.

# %%
def ring_parities(j, stages):
    """(slot, full_parity, empty_parity or None) of K/V tile j in a ring of `stages` slots."""
    ### BEGIN SOLUTION
    fill = j // stages
    return j % stages, fill % 2, None if fill == 0 else (fill - 1) % 2
    ### END SOLUTION


# %%
print([ring_parities(j, 2) for j in range(6)])  # [(0, 0, None), (1, 0, None), (0, 1, 0), (1, 1, 0), (0, 0, 1), ...]

# %%
flashlab.check("ring_parities", ring_parities)

# %% [markdown]
# ## 3. Where TMA puts a value
#
# Two TMA loads fill a (rows × 128) tile of 16-bit values: box 0 holds columns 0–63, box 1 columns 64–127, each
# stored row after row, 128 bytes a row, and box 1 after all of box 0. Inside a box the 128-byte swizzle moves
# 16-byte chunk c of row r to chunk c ^ (r % 8) of the same row; the bytes inside a chunk stay in order. Return
# the byte offset of value (r, c) from the tile's start.

# %%
def box_offset(r, c, rows):
    """Byte offset of value (r, c) of a (rows x 128) 16-bit tile loaded as two 128-byte-swizzled TMA boxes."""
    ### BEGIN SOLUTION
    box, col = divmod(c, 64)
    chunk, inside = divmod(2 * col, 16)
    return box * rows * 128 + r * 128 + (chunk ^ (r % 8)) * 16 + inside
    ### END SOLUTION


# %%
print(box_offset(0, 0, 128), box_offset(1, 0, 128), box_offset(1, 64, 128))  # 0 144 16528

# %%
flashlab.check("box_offset", box_offset)

# %% [markdown]
# ## 4. A consumer's iteration
#
# In iteration j a consumer warpgroup issues S_j = Q K_jᵀ and the previous tile's O += P_{j−1} V_{j−1}, runs the
# softmax of S_j while P V is still on the tensor cores, and takes turns with the other consumers (pingpong).
# These are its steps, in no particular order:

# %%
for step, what in pipeline.STEPS.items():
    print(f"{step:>13}: {what}")

# %% [markdown]
# Return the steps in an order that is correct (nothing read before it has landed or been computed, no register
# changed while a wgmma in flight reads it) and fast (the softmax overlaps P V, the turn is not held while waiting,
# K's half of the slot is released as soon as S is done). wgmma groups complete in the order they were committed,
# and `wgmma_wait(1)` returns when all but the newest group have.

# %%
def consumer_iteration():
    """The names of pipeline.STEPS in the order one steady-state iteration runs them."""
    ### BEGIN SOLUTION
    return ["wait K", "wait V", "my turn", "fence", "issue S", "issue PV", "your turn", "wait S", "release K",
            "softmax", "wait PV", "release V", "rescale+pack"]
    ### END SOLUTION


# %%
flashlab.check("consumer_iteration", consumer_iteration)

# %% [markdown]
# ## 5. The backward's operands
#
# The backward (lesson section 8) runs five products per query tile on wgmma. For each, say where wgmma finds A
# and B ("shared" memory or "registers"; B is always in shared memory) and which way each is read: "K"-major when
# the dimension the product sums over runs along the operand's stored rows, "MN"-major when it runs down them.
# K, V, Q and dO are stored as TMA left them: one row per key or query, d along the row. An accumulator can feed
# the next product as A straight from registers only if its rows are that product's rows.

# %%
def backward_operands():
    """{product: (A's place, A's major, B's place, B's major)} for the five products of the wgmma backward."""
    ### BEGIN SOLUTION
    return {"S^T = K Q^T": ("shared", "K", "shared", "K"),
            "dP^T = V dO^T": ("shared", "K", "shared", "K"),
            "dV += P^T dO": ("registers", "K", "shared", "MN"),
            "dK += dS^T Q": ("registers", "K", "shared", "MN"),
            "dQ += dS K": ("shared", "MN", "shared", "MN")}
    ### END SOLUTION


# %%
flashlab.check("backward_operands", backward_operands)

# %% [markdown]
# ## 6. What dQ's reduction costs
#
# A block owns `block_k` keys, so it holds only its share of each query row's dQ. The wgmma backward adds that
# share to a float32 accumulator in global memory with atomics. The alternative is a second pass: a kernel over
# query blocks of `block_q` rows that recomputes dS and forms dQ itself, re-reading every K and V tile. Return
# `(atomic_bytes, second_pass_bytes)` for n_q queries, n_k keys and head size d, without a causal mask: the bytes
# of float32 adds that reach memory, and the bytes of K and V (`itemsize` each) the second pass reads.

# %%
def dq_traffic(n_q, n_k, d, block_q, block_k, itemsize):
    """(bytes of dQ's float32 atomic adds, bytes of K and V a second pass re-reads)."""
    ### BEGIN SOLUTION
    atomics = -(-n_k // block_k) * n_q * d * 4
    second_pass = -(-n_q // block_q) * n_k * d * 2 * itemsize
    return atomics, second_pass
    ### END SOLUTION


# %%
a, s = dq_traffic(16384, 16384, 128, 64, 64, 2)
print(f"N = 16384, d = 128: atomics {a / 2**30:.1f} GiB, a second pass {s / 2**30:.1f} GiB")

# %%
flashlab.check("dq_traffic", dq_traffic)
