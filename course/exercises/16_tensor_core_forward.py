# %% [markdown]
# # Exercises 16: the tensor-core forward
#
# Goes with lesson [16 the tensor-core forward](../notebooks/16_tensor_core_forward.ipynb). Pieces of the
# kernel, written by you:
#
# 1. S = QKᵀ for one warp's 16 rows as a Numba kernel on `mma.sync`, graded in the CUDA simulator;
# 2. the online softmax on C fragments: the quad's max with two shuffles, the rescale, l kept per lane;
# 3. two C n-tiles of P packed into one A fragment;
# 4. O += PV, with V's B fragments through `ldmatrix.trans`;
# 5. the forward of one warp, assembled from 1 to 4, against float64 attention;
# 6. the smallest padding of a shared-memory row that keeps `ldmatrix` free of bank conflicts;
# 7. the same without padding: the byte offset of a value in an XOR-swizzled tile;
# 8. which 16-byte chunks of a K tile each thread of the forward copies, and from where.
#
# Lesson 15's exercises give the fragment layouts these build on.

# %%
import numpy as np

import flashlab
from flashlab import device, fragments as F
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
# ## The rest of the step: the online softmax, P into registers, O += PV
#
# Exercise 1 gave one warp its 16 x n_keys scores as C fragments. The next four exercises finish that warp's inner
# loop, the core of the tensor-core forward (lesson 15's section 4, and steps 4 and 5 of this lesson), for float16
# inputs and `mma.m16n8k16`; the fourth assembles the pieces into a forward kernel of one warp per block and
# compares it with float64 attention. Each of the first three is a **device function** (`@cuda.jit(device=True)`),
# which the checker calls from a small kernel of one warp and compares, lane by lane, with a NumPy model of the
# fragments.
#
# As in the lesson's kernel, S stays in raw units (QKᵀ, unscaled) and the scale goes into the exponentials:
# p = exp2((s - m) * scale_log2) with scale_log2 = log2(e) / sqrt(d). Masked scores get `NEG`, a finite
# "-inf" (exp2 of it is 0). A lane is `g = lane // 4`, `t = lane % 4`; its C values c0, c1 are row g, c2, c3
# row g + 8, at columns 2t and 2t + 1 of each 8-column n-tile.

# %%
import math

from numba import float32

from flashlab.kernels.common import NEG  # a finite "-inf" for masked scores, as in the library's kernels

BLOCK_K = 32  # keys per tile: 4 n-tiles of S, 2 k-steps of P V

# %% [markdown]
# ## 2. The online softmax on C fragments
#
# Write `softmax_step(s, m, l, acc, k0, row0, n_keys, causal, scale_log2, lane)`, one tile of the online softmax
# for this lane's two rows, `row0 + g` (r = 0) and `row0 + g + 8` (r = 1):
#
# - `s`: (n-tiles, 4) float32, the tile's scores as C fragments: `s[n, 2r + c]` is row r's score of key
#   `k0 + 8n + 2t + c`. Turn it into P, in place;
# - `m`, `l`: (2,) float32, row r's running max (raw units) and this lane's **partial** running sum;
# - `acc`: (d/8, 4) float32, O's C fragments (unnormalised), to rescale.
#
# The steps, for each r:
#
# 1. hide the keys the row may not see, **before anything else**: key ≥ n_keys (the ragged last tile), and with
#    `causal`, key > row. They get `NEG`;
# 2. the row's max over the tile: your own values first, then the rest of the row, which sits in the 3 other
#    lanes of your quad: `mma.shfl_xor(x, mask)` returns lane `lane ^ mask`'s x, and every lane must call it;
# 3. m_new = max(m_old, that max); alpha = exp2((m_old - m_new) * scale_log2); p = exp2((s - m_new) * scale_log2);
# 4. l = alpha * l + the sum of **your own** p (no shuffle: the quad's partial sums are added once, after the last
#    tile, exercise 5), and O's values of row r times alpha.
#
# This lesson's step 4 figure (`flashlab.viz.tensor.plot_quad_reduction()`) draws the exchange. Which scores of a
# 32-key tile each lane of quad 0 holds:

# %%
for lane in range(4):
    keys = [8 * n + 2 * lane + c for n in range(BLOCK_K // 8) for c in range(2)]
    print(f"lane {lane} (g = 0, t = {lane}): rows 0 and 8, keys k0 + {keys}")


# %%
@cuda.jit(device=True)
def softmax_step(s, m, l, acc, k0, row0, n_keys, causal, scale_log2, lane):
    """One tile of the online softmax on this lane's C fragments: s becomes P, m and l move on, acc is rescaled."""
    ### BEGIN SOLUTION
    g, t = lane // 4, lane % 4
    for r in range(2):  # row g (c0, c1), then row g + 8 (c2, c3)
        row = row0 + g + 8 * r
        mx = float32(NEG)
        for n in range(s.shape[0]):
            for c in range(2):
                key = k0 + 8 * n + 2 * t + c
                if key >= n_keys or (causal and key > row):
                    s[n, 2 * r + c] = NEG
                mx = max(mx, s[n, 2 * r + c])
        mx = max(mx, mma.shfl_xor(mx, 1))  # the quad's 4 lanes hold the row's columns
        mx = max(mx, mma.shfl_xor(mx, 2))
        m_new = max(m[r], mx)
        alpha = math.exp2((m[r] - m_new) * scale_log2)
        m[r] = m_new
        row_sum = float32(0.0)
        for n in range(s.shape[0]):
            for c in range(2):
                p = math.exp2((s[n, 2 * r + c] - m_new) * scale_log2)
                s[n, 2 * r + c] = p
                row_sum += p
        l[r] = l[r] * alpha + row_sum  # this lane's share only
        for n in range(acc.shape[0]):
            acc[n, 2 * r] *= alpha
            acc[n, 2 * r + 1] *= alpha
    ### END SOLUTION


# %%
flashlab.check("softmax_step", softmax_step)

# %% [markdown]
# ## 3. P into A registers
#
# O += PV needs P as the A operand of `mma.m16n8k16`: per k-step of 16 keys, four 32-bit registers of float16
# pairs. Lesson 15's section 4 showed that the C fragments of n-tiles 2kk and 2kk + 1 hold exactly the values of
# k-step kk's A fragment (`flashlab.viz.tensor.plot_p_in_registers("f16")`): no value leaves its lane. Write
# `pack_p(s, kk)`, returning the registers `(a0, a1, a2, a3)` of k-step kk from P's C fragments `s`, packed with
# `mma.pack_f16x2(lo, hi)` (lo in the low 16 bits). Register r holds A elements 2r and 2r + 1 (lesson 15's
# exercise 1, PTX order). Lane 5's values, as (row, key within the k-step):

# %%
lane = 5
c_pos = F.fragment_map("m16n8k16", "C")[lane]
a_pos = F.fragment_map("m16n8k16", "A")[lane]
for n in range(2):
    print(f"n-tile {n} of the k-step, C:", "  ".join(f"c{i} {(int(r), int(c) + 8 * n)}" for i, (r, c) in
                                                 enumerate(c_pos)))
print("A wants:                 ", "  ".join(f"a{i} {(int(r), int(c))}" for i, (r, c) in enumerate(a_pos)))


# %%
@cuda.jit(device=True)
def pack_p(s, kk):
    """The A fragment (a0, a1, a2, a3) of P for k-step kk (keys 16kk..16kk+15): float16 pairs from s's C values."""
    ### BEGIN SOLUTION
    n = 2 * kk  # the k-step's 16 keys are n-tiles 2kk and 2kk + 1
    return (mma.pack_f16x2(s[n, 0], s[n, 1]), mma.pack_f16x2(s[n, 2], s[n, 3]),  # rows g, g + 8: keys 2t, 2t + 1
            mma.pack_f16x2(s[n + 1, 0], s[n + 1, 1]), mma.pack_f16x2(s[n + 1, 2], s[n + 1, 3]))  # keys + 8
    ### END SOLUTION


# %%
flashlab.check("pack_p", pack_p)

# %% [markdown]
# ## 4. O += PV through `ldmatrix.trans`
#
# Write `pv_kstep(a0, a1, a2, a3, acc, sh, base, rs, lane)`: O += P V for one k-step of 16 keys, with P's A
# fragment `a0..a3` (from `pack_p`), O's C fragments `acc` (d/8 n-tiles of 8 dims) and V's 16 rows in shared
# memory: row `key` (0-15) starts at word `base + key * rs` and holds d/2 words, dims 2w and 2w + 1 in word w.
#
# For O's n-tile n (dims 8n to 8n + 7) the B operand is V itself: lane (g, t) needs, in `b0`, keys 2t and 2t + 1
# of dim 8n + g, and in `b1` keys 2t + 8 and 2t + 9. Those are two different **rows** of V, so plain `ldmatrix`
# (one row's neighbours, right for K) is wrong here. `mma.ldmatrix_x4_trans(sh, word)` reads four 8 x 8 matrices
# of 16-bit values, lane 8i + j giving the word address of row j of matrix i, and transposes each on the way
# (lesson 15's section 3, `flashlab.viz.tensor.plot_ldmatrix()`): a matrix of rows key0..key0+7 and dims 8n..8n+7
# arrives as exactly a b register. So one call gives the B fragments of two n-tiles (16 dims); use `MMA16`
# (exercise 1) for the products, accumulating into `acc`. Every lane makes every call.


# %%
@cuda.jit(device=True)
def pv_kstep(a0, a1, a2, a3, acc, sh, base, rs, lane):
    """acc += P V for one k-step: P's A fragment a0..a3; V's 16 rows at words base + key * rs of shared sh."""
    ### BEGIN SOLUTION
    key = ((lane // 8) % 2) * 8 + lane % 8  # lane 8i + j: row j of matrix i; matrices 1 and 3 are keys 8-15
    for n2 in range(acc.shape[0] // 2):  # O's n-tiles 2n2 and 2n2 + 1: dims 16n2 .. 16n2 + 15
        word = 8 * n2 + (lane // 16) * 4  # matrices 2 and 3: the next 8 dims, 4 words on
        b00, b01, b10, b11 = mma.ldmatrix_x4_trans(sh, base + key * rs + word)
        n = 2 * n2
        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = MMA16(a0, a1, a2, a3, b00, b01,
                                                           acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
        n = 2 * n2 + 1
        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = MMA16(a0, a1, a2, a3, b10, b11,
                                                           acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
    ### END SOLUTION


# %%
flashlab.check("pv_kstep", pv_kstep)

# %% [markdown]
# ## 5. The forward of one warp
#
# Put it together. `build_forward(d)` (d = 16 or 32) returns a kernel launched with one warp per block,
# `forward[ceil(n_q / 16), 32](q, k, v, o, n_q, n_k, causal, scale_log2)`: block b owns query rows 16b to
# 16b + 15, `q`, `k`, `v` are float16 values seen as uint32 pairs (N, d/2), and `o` is float32 (n_q, d). The
# given code loads Q's A fragments once (exercise 1's registers, kept for the whole loop), copies each tile of
# BLOCK_K keys of K and V to shared memory (V's rows from word `VO`, rows `RS` words apart, zeros past n_k), and
# computes the tile's S with `scores` (exercise 1 with `ldmatrix`). Causal tiles past the warp's last row are
# skipped. Write
#
# - the rest of the loop body: your `softmax_step`, then for each of the tile's k-steps `pack_p` and `pv_kstep`;
# - the finish: each row's l is four partial sums, one per lane of the quad; add them (two `shfl_xor`, in every
#   lane: a shuffle inside an `if` that some lanes skip is undefined), divide, and write O's rows < n_q.


# %%
@cuda.jit(device=True)
def scores(s, qf, sh, lane, rs):
    """S = Q K^T for a tile as C fragments s (n-tiles, 4): Q's A fragments qf (4 words per k-step of 16 dims), K's
    rows at words key * rs of shared sh. ldmatrix_x4 gives two n-tiles' B fragments per k-step."""
    for n in range(s.shape[0]):
        for j in range(4):
            s[n, j] = 0.0
    for ks in range(qf.shape[0] // 4):
        for n2 in range(s.shape[0] // 2):
            key = 16 * n2 + (lane // 16) * 8 + lane % 8  # matrices 0, 1: keys 0-7 (dims 16ks.., +8); 2, 3: keys 8-15
            word = 8 * ks + ((lane // 8) % 2) * 4
            b00, b01, b10, b11 = mma.ldmatrix_x4(sh, key * rs + word)
            n = 2 * n2
            s[n, 0], s[n, 1], s[n, 2], s[n, 3] = MMA16(qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3],
                                                       b00, b01, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
            n = 2 * n2 + 1
            s[n, 0], s[n, 1], s[n, 2], s[n, 3] = MMA16(qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3],
                                                       b10, b11, s[n, 0], s[n, 1], s[n, 2], s[n, 3])


def build_forward(d):
    W, RS = d // 2, d // 2 + 4  # words in a row of Q, K, V; shared rows padded by 4 words (lesson step 2)
    NT, ND, KS = BLOCK_K // 8, d // 8, d // 16  # n-tiles of S, n-tiles of O, k-steps of S = Q K^T
    VO = BLOCK_K * RS  # V's tile starts here, after K's
    SH, QR = 2 * BLOCK_K * RS, 4 * KS  # array sizes as plain numbers: Numba's GPU compiler folds no arithmetic there

    @cuda.jit
    def forward(q, k, v, o, n_q, n_k, causal, scale_log2):
        sh = cuda.shared.array(SH, np.uint32)
        qf = cuda.local.array(QR, np.uint32)
        s = cuda.local.array((NT, 4), float32)
        acc = cuda.local.array((ND, 4), float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        row0 = 16 * cuda.blockIdx.x
        for ks in range(KS):  # a0: (g, w)  a1: (g + 8, w)  a2: (g, w + 4)  a3: (g + 8, w + 4), w = 8ks + t
            for j in range(4):
                row = row0 + g + 8 * (j % 2)
                qf[4 * ks + j] = q[row, 8 * ks + t + 4 * (j // 2)] if row < n_q else np.uint32(0)
        for r in range(2):
            m[r] = NEG
            l[r] = 0.0
        for n in range(ND):
            for j in range(4):
                acc[n, j] = 0.0
        k_end = min(n_k, row0 + 16) if causal else n_k
        for k0 in range(0, k_end, BLOCK_K):
            cuda.syncthreads()  # everyone is done with the previous tile
            for e in range(lane, BLOCK_K * W, 32):
                key, w = e // W, e % W
                inside = k0 + key < n_k
                sh[key * RS + w] = k[k0 + key, w] if inside else np.uint32(0)
                sh[VO + key * RS + w] = v[k0 + key, w] if inside else np.uint32(0)
            cuda.syncthreads()
            scores(s, qf, sh, lane, RS)
            ### BEGIN SOLUTION
            softmax_step(s, m, l, acc, k0, row0, n_k, causal, scale_log2, lane)
            for kk in range(BLOCK_K // 16):
                a0, a1, a2, a3 = pack_p(s, kk)
                pv_kstep(a0, a1, a2, a3, acc, sh, VO + 16 * kk * RS, RS, lane)
            ### END SOLUTION
        ### BEGIN SOLUTION
        for r in range(2):
            total = l[r]
            total += mma.shfl_xor(total, 1)  # the quad's 4 partial sums, once
            total += mma.shfl_xor(total, 2)
            row = row0 + g + 8 * r
            if row < n_q:
                for n in range(ND):
                    o[row, 8 * n + 2 * t] = acc[n, 2 * r] / total
                    o[row, 8 * n + 2 * t + 1] = acc[n, 2 * r + 1] / total
        ### END SOLUTION

    return forward


# %%
n_q, n_k, d = 20, 45, 32
Q, K, V = (rng.standard_normal((n, d)).astype(np.float16) for n in (n_q, n_k, n_k))
O = np.zeros((n_q, d), np.float32)
build_forward(d)[-(-n_q // 16), 32](Q.view(np.uint32), K.view(np.uint32), V.view(np.uint32), O, n_q, n_k, True,
                                     np.float32(math.log2(math.e) / math.sqrt(d)))
ref, _ = flashlab.reference_attention(*(x.astype(np.float64) for x in (Q, K, V)), causal=True)
print(f"n_q={n_q} n_k={n_k} d={d} causal: relative error {flashlab.relative_error(O, ref):.1e}")

# %%
flashlab.check("forward_warp", build_forward)


# %% [markdown]
# ## 6. How much padding?
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
# ## 7. Or swizzle
#
# Padding costs memory. FlashAttention-2's layouts (through CuTe) avoid the conflicts without it: rows stay
# `row_bytes` apart (a multiple of 128), and the 16-byte chunk c of row r is stored at chunk c ^ (r % 8) of its
# row, the bytes inside a chunk unchanged. This lesson's step 2 draws the three layouts.
#
# Write `swizzled_offset(row, col, row_bytes)`: the byte offset of value (row, col) (16-bit values) of such a
# tile. Then check with the cell below that the 8 rows one `ldmatrix` phase reads (column 0 of rows 0-7) fall in
# 8 different bank groups, and that each row still uses each of its chunks once.

# %%
def swizzled_offset(row, col, row_bytes):
    """Byte offset of 16-bit value (row, col) in a tile whose 16-byte chunks are XOR-swizzled by row % 8."""
    ### BEGIN SOLUTION
    chunk, inside = divmod(2 * col, 16)
    return row * row_bytes + 16 * (chunk ^ (row % 8)) + inside
    ### END SOLUTION


# %%
groups = [swizzled_offset(r, 0, 128) // 4 % 32 // 4 for r in range(8)]
print("bank groups of column 0, rows 0-7:", groups, "-> passes:", max(groups.count(x) for x in groups))
print("row 3 still holds each chunk once:", sorted(swizzled_offset(3, 8 * c, 128) - 3 * 128 for c in range(8)))

# %%
flashlab.check("swizzled_offset", swizzled_offset)

# %% [markdown]
# ## 8. Which chunks does a thread copy?
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
# ## 9. Think about it
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
# - With exercise 8: a thread's source word grows by the same amount from one copy to the next. In a paged
#   KV cache (lesson 18) the rows of one tile may sit in different pages. Which part of `copy_plan` stops
#   being a constant step, and what must the kernel read for every row instead (`kernels/tensor.py` keeps
#   the general copy for its paged build)?
