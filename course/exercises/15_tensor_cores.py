# %% [markdown]
# # Exercises 15: tensor cores from Python
#
# Goes with lesson [15 tensor cores from Python](../notebooks/15_tensor_cores.ipynb). Eight exercises, from
# the layout of one instruction to one step of the kernel and the backward's transpose:
#
# 1. the fragment map: which (row, column) each lane's element is;
# 2. a warp's `mma` in NumPy, from the lanes' packed 32-bit registers;
# 3. the tf32 split of a float32 number, on its bits;
# 4. a 3xTF32 matrix product from a tf32 tensor core, and its error;
# 5. S = QKᵀ for one warp's 16 rows as a Numba kernel on `mma.sync`, graded in the CUDA simulator;
# 6. where each value of the backward's dS fragment sits in the warp's dSᵀ;
# 7. the bytes of shared memory one block of the backward needs;
# 8. which 16-byte chunks of a K tile each thread of the forward copies, and from where.
#
# `flashlab.fragments` holds the library's versions of 1 to 3 (`fragment_map`, `warp_mma`, `split_tf32`):
# don't call them in your answers, the point is to build them yourself.

# %%
import numpy as np

import flashlab
from flashlab import device, fragments as F
from flashlab.kernels import mma

cuda = device.get_cuda()  # numba.cuda: the GPU, or the simulator when there is none
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. The fragment map
#
# Write `fragment_position(layout, operand, lane, i)`: the (row, column) of element `i` of `lane`'s
# fragment of `operand` ("A", "B" or "C"), for
#
# - `layout = "f16"`: `mma.m16n8k16` with float16/bfloat16 inputs. A is 16 x 16 (8 elements per lane),
#   B is 16 x 8 (4 per lane), C is 16 x 8 (4 per lane);
# - `layout = "tf32"`: `mma.m16n8k8` with tf32 inputs. A is 16 x 8 (4 per lane), B is 8 x 8 (2 per lane),
#   C is 16 x 8 (4 per lane).
#
# Elements are numbered in PTX's order (`a0`, `a1`, ... in the lesson's figures); for 16-bit operands
# elements 2r and 2r+1 share register r. Write each position as a formula in g = lane // 4 and t = lane % 4,
# and check it against the figures: `flashlab.viz.tensor.plot_fragments("f16", lane=5)` draws lane 5's.

# %%
def fragment_position(layout, operand, lane, i):
    """(row, col) of element i of this lane's fragment of operand "A", "B" or "C" (layout "f16" or "tf32")."""
    ### BEGIN SOLUTION
    g, t = lane // 4, lane % 4
    if operand == "C":  # c0, c1: row g; c2, c3: row g + 8; columns 2t, 2t + 1
        return g + 8 * (i // 2), 2 * t + i % 2
    if layout == "f16":
        if operand == "A":  # pairs along a row; then the +8 rows; then the +8 columns
            return g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)
        return 2 * t + i % 2 + 8 * (i // 2), g  # B: pairs down column g
    if operand == "A":  # tf32: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
        return g + 8 * (i % 2), t + 4 * (i // 2)
    return t + 4 * i, g  # B: b0 (t, g), b1 (t + 4, g)
    ### END SOLUTION


# %%
print([fragment_position("f16", "A", 13, i) for i in range(8)])  # lane 13 is g = 3, t = 1

# %%
flashlab.check("fragment_position", fragment_position)

# %% [markdown]
# ## 2. A warp's mma in NumPy
#
# The hardware never sees a matrix, only 32 lanes' registers. Write what one `mma.m16n8k16` with float16
# inputs and float32 accumulation computes, from those registers:
#
# - `a`: (32, 4) uint32, lane L's four A registers; each holds two float16 values, the lower-numbered
#   element (a0 in register 0, a2 in register 1, ...) in the low 16 bits;
# - `b`: (32, 2) uint32, the B registers, packed the same way;
# - `c`: (32, 4) float32, the accumulator fragments c0..c3.
#
# Return `d`, (32, 4) float32: each lane's D = A B + C fragment, laid out like C. Use your
# `fragment_position` (or `F.fragment_map`) for the layouts; `np.ndarray.view` turns 16-bit patterns into
# float16 values.

# %%
def warp_mma(a, b, c):
    """Each lane's fragment of D = A @ B + C, from the lanes' packed A and B registers and C fragments."""
    ### BEGIN SOLUTION
    def elements(regs):  # (32, r) uint32 -> (32, 2r) float values, element 2j in the low half of register j
        halves = np.stack([regs & 0xFFFF, regs >> 16], axis=-1).astype(np.uint16)
        return halves.view(np.float16).reshape(32, -1).astype(np.float64)

    def place(frags, operand, shape):
        m = np.zeros(shape)
        for lane in range(32):
            for i, value in enumerate(frags[lane]):
                m[fragment_position("f16", operand, lane, i)] = value
        return m

    A, B = place(elements(a), "A", (16, 16)), place(elements(b), "B", (16, 8))
    D = A @ B + place(c, "C", (16, 8))
    return np.array([[D[fragment_position("f16", "C", lane, i)] for i in range(4)] for lane in range(32)],
                    dtype=np.float32)
    ### END SOLUTION


# %%
A = rng.standard_normal((16, 16)).astype(np.float16)
B = rng.standard_normal((16, 8)).astype(np.float16)
C = np.zeros((16, 8), np.float32)
bits = lambda x: x.astype(np.float16).view(np.uint16).astype(np.uint32)  # noqa: E731
a_elems, b_elems = F.to_fragments(A, "m16n8k16", "A"), F.to_fragments(B, "m16n8k16", "B")
a = bits(a_elems[:, 0::2]) | (bits(a_elems[:, 1::2]) << 16)  # pack pairs: even element low, odd element high
b = bits(b_elems[:, 0::2]) | (bits(b_elems[:, 1::2]) << 16)
d = warp_mma(a, b, F.to_fragments(C, "m16n8k16", "C"))
print("lane 0's d:", d[0], " A @ B at (0, 0), (0, 1), (8, 0), (8, 1):",
      (A.astype(np.float32) @ B.astype(np.float32))[[0, 0, 8, 8], [0, 1, 0, 1]])

# %%
flashlab.check("warp_mma", warp_mma)

# %% [markdown]
# ## 3. Splitting float32 into tf32 parts
#
# A float32 has 23 stored mantissa bits, tf32 keeps the top 10, so a tf32 value is a float32 whose low 13
# bits are zero. `cvt.rna.tf32.f32` rounds to the **nearest** tf32 value, and a tie (low 13 bits exactly
# `0x1000`) goes **away from zero**. Write `split_tf32(x)` for a float32 array x, returning float32 arrays
# `(big, small)`:
#
# - `big`: x rounded to tf32 that way;
# - `small`: x - big, rounded to tf32 the same way (so the tensor core can use it too).
#
# Work on the bits: `x.view(np.uint32)` gives them, `.view(np.float32)` turns bits back into numbers.
# Rounding up may carry into the exponent (a mantissa of all ones becomes the next power of two): that is
# the right answer.

# %%
def split_tf32(x):
    """(big, small): x rounded to tf32 (nearest, ties away from zero), and the remainder rounded to tf32."""
    ### BEGIN SOLUTION
    def round_tf32(v):
        bits = np.asarray(v, np.float32).view(np.uint32)
        return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)

    big = round_tf32(x)
    return big, round_tf32(x - big)
    ### END SOLUTION


# %%
x = np.float32([1.0 + 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20, -3.14159265, 0.1])
big, small = split_tf32(x)
for xi, bi, si in zip(x, big, small):
    print(f"x = {xi:.9g}: big = {bi:.9g}, small = {si:.3g}, big + small - x = {float(bi) + float(si) - float(xi):.1e}")

# %%
flashlab.check("split_tf32", split_tf32)

# %% [markdown]
# ## 4. A 3xTF32 matrix product
#
# `mma(a, b, c)` below stands for a tf32 tensor core: it returns `a @ b + c` in float32, reading a and b as
# tf32 (any mantissa bits below tf32's are dropped) and multiplying exactly. Write `matmul_3xtf32(A, B, mma)`
# that computes the float32 product A @ B to about float32's accuracy with it: split both inputs with your
# `split_tf32` and let `mma` do the products that matter. Pass `mma` only tf32 values (the checker makes
# sure), and don't multiply outside it.

# %%
def tensor_core(a, b, c):
    """A tf32 mma: a @ b + c with a and b read as tf32 (low 13 mantissa bits dropped), exact products."""
    ta, tb = (F.truncate_tf32(np.asarray(m, np.float32)).astype(np.float64) for m in (a, b))
    return (ta @ tb + c).astype(np.float32)


def matmul_3xtf32(A, B, mma):
    """A @ B for float32 A (m, k) and B (k, n), from tf32 products on the tensor core `mma`."""
    ### BEGIN SOLUTION
    (Ab, As), (Bb, Bs) = split_tf32(A), split_tf32(B)
    C = np.zeros((A.shape[0], B.shape[1]), np.float32)
    C = mma(As, Bb, C)  # the small corrections first, then the big product
    C = mma(Ab, Bs, C)
    return mma(Ab, Bb, C)
    ### END SOLUTION


# %% [markdown]
# Now report the error, as the lesson's figure did: against float64, for one product with each method.
# Which is 1xTF32's error, which 3xTF32's, and how do they compare with float32 arithmetic (`A @ B` in
# NumPy float32)? How many tensor-core products did 3xTF32 cost?

# %%
A = rng.standard_normal((64, 1024)).astype(np.float32)
B = rng.standard_normal((1024, 64)).astype(np.float32)
exact = A.astype(np.float64) @ B.astype(np.float64)
zero = np.zeros((64, 64), np.float32)
one_pass = tensor_core(split_tf32(A)[0], split_tf32(B)[0], zero)
for name, C in (("1xTF32", one_pass), ("3xTF32", matmul_3xtf32(A, B, tensor_core)), ("float32", A @ B)):
    print(f"{name:8s} relative error {flashlab.relative_error(C, exact):.1e}")

# %%
flashlab.check("matmul_3xtf32", matmul_3xtf32)

# %% [markdown]
# ## 5. One kernel step: S = QKᵀ for one warp
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
# ## 6. Where dS comes from (the backward)
#
# In the tensor backward (lesson section 8) each warp ends a tile holding dSᵀ for its 16 keys and 16 queries
# as the C fragments of two m16n8 n-tiles: n-tile 0 has queries 0-7, n-tile 1 queries 8-15, rows = keys.
# dQ += dS K needs dS as the A fragment of an `mma.m16n8k16`: rows = queries, columns = keys.
#
# Write `ds_source(lane, i)`: for element `i` (0-7, PTX order, as in exercise 1) of `lane`'s A fragment of
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
# ## 7. Will the tile fit? The backward's shared memory
#
# A block of the tensor backward (lesson section 8) keeps five regions in shared memory, counted in 32-bit
# words. In 16-bit precisions two values share a word; in float32 (3xTF32) each value takes one:
#
# - K_j: `block_k` rows of d values. Every row is padded by 4 words (16 bytes), so that the 8 rows one
#   `ldmatrix` reads start in different banks;
# - V_j, the same, but only with `v_shared` (otherwise its fragments stay in registers);
# - Q_i and dO_i: `block_q` padded rows each, once per stage (2 stages: the next tile is copied while this one
#   is used);
# - dSᵀ: `block_k` rows (keys) of `block_q` values (queries), packed like the inputs, plus 4 words of padding;
# - lse_i and D_i: `block_q` float32 each, once per stage.
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
# ## 8. Which chunks does a thread copy?
#
# Step 2 of the lesson: the block copies each K tile (`block_k` rows) into shared memory with `cp.async`,
# 16 bytes (4 words) per copy. In words, a row of K is W = d/2 in 16 bits (d in float32), so it has W/4
# chunks; thread `tid` of `threads`:
#
# - starts at row `tid // (W/4)` and column word `4 * (tid % (W/4))`: consecutive threads take consecutive
#   chunks of one row, so a warp reads whole rows (coalesced);
# - then moves down `threads // (W/4)` rows per copy while the row is below `block_k`, keeping its column;
# - writes shared word `row * (W + 4) + column` (rows padded by 4 words, lesson 08's banks);
# - reads source word `(k0 + row) * row_stride + column`, counted from the first row of this head's K. In a
#   packed varlen batch (lesson 18) the rows of one head are `H_kv * W` words apart, not W;
# - past the keys (`k0 + row >= n_k`) copies 0 bytes: `cp.async` then writes 16 zero bytes, and its source
#   must still be a valid address: the same column of the tile's first row, k0, which always exists.
#
# Write `copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide)`: the list of
# `(shared word, source word, bytes)` of thread `tid`'s copies, in order. The kernel computes the tile's
# first element once (`k0 * row_stride`); a copy's distance from it is the same in every tile, so each
# source address costs one multiply-add: the instruction count the lesson's figure shows.

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
# ## 9. Think about it
#
# - In exercise 5 every lane reads its Q words again for every n-tile. How many 32-bit registers would it
#   take to keep a lane's Q fragments for all k-steps at d = 64, and d = 128? The tensor kernel keeps them
#   (step 1 of the lesson): what limits how large d can get?
# - Exercise 5 reads each B register straight from global memory, one word per lane. Which instruction does
#   the tensor kernel use instead, and how many words does one of them give each lane?
# - 3xTF32 costs three tensor-core products per product. At the measured mma ceilings of the lesson, is that
#   still faster than the FP32 units' peak on an H100? On a GPU where tf32 runs at the same rate as FP32
#   (some consumer cards), would 3xTF32 make sense?
# - In exercise 2, read every register's halves the wrong way round, for A *and* for B: D comes out right.
#   Why? (Which columns of A and which rows of B trade places?) And why does it go wrong for A alone?
# - In exercise 1, C's layout and the f16 A layout line up so that P can stay in registers. Does the same
#   hold between C and the f16 **B** layout? What would the kernel have to do to compute Oᵀ = Vᵀ Pᵀ instead?
# - The forward gives each warp two m-tiles of 16 rows for 16-bit inputs. At d = 64, count the `ldmatrix` and
#   the `mma` a warp issues for one key tile with one m-tile, then with two. Why does that ratio matter when
#   shared memory delivers fewer bytes per cycle than the tensor cores consume? And what does the second
#   m-tile cost in registers (Q's fragments, S, O)? Why does the float32 build keep one?
# - With exercise 7: an H100 SM has 228 KB of shared memory. How many blocks of each default tile fit on one
#   SM by shared memory alone? The registers allow 8 warps an SM for the 16-bit tiles; which of the two limits
#   binds? Keeping V in shared memory frees the registers that held V's fragments (in float32, one for every
#   two of V's dimensions): what does it cost instead?
# - With exercise 8: a thread's source word grows by the same amount from one copy to the next. In a paged
#   KV cache (lesson 18) the rows of one tile may sit in different pages. Which part of `copy_plan` stops
#   being a constant step, and what must the kernel read for every row instead (`kernels/tensor.py` keeps
#   the general copy for its paged build)?
