"""variant="tensor": FlashAttention-2 forward on tensor cores, from pure-Python Numba (lesson 15).

One thread block owns block_q = 16 * warps query rows of one (batch, head); each warp owns 16 of them and
works alone on its rows, as in the FA2 paper (Section 3.3: no communication between warps for S and P).
For each tile of block_k keys:

    1. the block copies the K and V tiles to shared memory (row-major, rows padded by 16 bytes);
    2. each warp computes its 16 x block_k piece of S = Q K^T with mma.sync: Q's fragments sit in registers
       for the whole loop, K's come from shared memory (ldmatrix for 16-bit types);
    3. the online softmax runs on S's C fragments in fp32: a lane holds 2 rows (g and g+8) of each 8-key
       n-tile, so a row's max and sum need the 4 lanes of a quad (two shfl_xor);
    4. P stays in registers: the C fragments of two 8-key n-tiles *are* the A fragment of a 16-key k-step
       of O += P V (after packing to 16 bits), so P never touches shared memory. V's B fragments come from
       shared memory through ldmatrix.trans, which transposes 8x8 blocks on the way.

Input types:
- float16 / bfloat16: mma.m16n8k16 (or two m16n8k8 on sm_75, precision "k8"), fp32 accumulation;
- float32, precision "3xtf32": each operand x = big + small with big, small tf32; a*b is computed as
  big*big + big*small + small*big (three tf32 mma), which keeps about fp32 accuracy;
- float32, precision "tf32": one tf32 mma per product (about 1e-3 relative error), for comparison.
For tf32 the K and V B fragments are single fp32 words (plain shared loads); the C fragment of S maps to
the A fragment of P V after renumbering the 8 keys of a k-step (key 2t -> column t, 2t+1 -> column t+4),
the same renumbering applied to V's rows.

Where FlashAttention-2 itself goes further: it copies tiles with cp.async (asynchronously, double
buffered), uses 128-row tiles with larger per-warp tiles, and on Hopper FA3 uses wgmma and TMA instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import config, float32, uint32

from ..device import get_cuda
from . import mma

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs

U = np.uint64
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG = -1.0e30  # a finite "-inf" for masked scores (fastmath assumes no infinities)
FASTMATH = {"contract", "afn", "arcp"}
PRECISIONS = {"float16": ("f16", "k8"), "bfloat16": ("bf16",), "float32": ("3xtf32", "tf32")}


@dataclass(frozen=True)
class TensorTile:
    """A tensor-kernel configuration: block_q = 16 * warps query rows, block_k keys per K/V tile."""

    warps: int = 4
    block_k: int = 64

    @property
    def block_q(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_words(self, d: int, wide: bool) -> int:
        """32-bit words of shared memory: K and V tiles, rows of d (fp32) or d/2 (16-bit pairs) words,
        padded by 4 words so that 8 rows read together fall in 32 different banks."""
        return 2 * self.block_k * ((d if wide else d // 2) + 4)

    def check(self, d: int, wide: bool, shared_limit: int = 48 * 1024):
        for name in ("warps", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.block_k % 16:
            raise ValueError(f"block_k must be a multiple of 16 for the tensor kernel; got {self.block_k}")
        if self.threads > 1024:
            raise ValueError(f"{self.warps} warps is {self.threads} threads per block; at most 1024 (32 warps)")
        if 4 * self.shared_words(d, wide) > shared_limit:
            raise ValueError(f"tile {self} needs {4 * self.shared_words(d, wide)} bytes of shared memory at d={d}; "
                             f"the limit per block is {shared_limit} bytes: use a smaller block_k")
        return self


def choose_tile(d: int, precision: str, block_q=None, block_k=None) -> TensorTile:
    """Default tiles: 4 warps (64 query rows); 64 keys per tile, 32 for fp32 at d = 128 (48 KB)."""
    wide = precision in ("3xtf32", "tf32")
    bk = block_k or (32 if wide and d >= 128 else 64)
    if block_q is not None and (block_q % 16 or block_q < 16):
        raise ValueError(f"block_q must be a positive multiple of 16 for the tensor kernel (16 rows per warp); "
                         f"got {block_q}")
    return TensorTile(warps=(block_q or 64) // 16, block_k=bk).check(d, wide)


@lru_cache(maxsize=None)
def build(d: int, tile: TensorTile, causal: bool, precision: str):
    """Compile-time specialised forward kernel for (d, tile, causal, precision). 16-bit precisions take Q,
    K, V and O as uint32 arrays (B, H, N, d/2) of packed pairs; fp32 ones as float32 (B, H, N, d)."""
    WIDE = precision in ("3xtf32", "tf32")
    SPLIT = precision == "3xtf32"
    BF16 = precision == "bf16"
    NW, BK = tile.warps, tile.block_k
    BQ = 16 * NW
    W = d if WIDE else d // 2  # 32-bit words per row of Q, K, V, O
    RS = W + 4  # padded shared row stride, in words
    KSTEPS = d // 8 if WIDE else d // 16  # k-steps of S = Q K^T (k = 8 for tf32, 16 for 16-bit)
    NTK = BK // 8  # n-tiles of S (8 keys each)
    NTD = d // 8  # n-tiles of O (8 dims each)
    PSTEPS = BK // 8 if WIDE else BK // 16  # k-steps of O += P V
    QREGS = 4 * KSTEPS
    TILE_WORDS = BK * W
    LOADS = -(-TILE_WORDS // (32 * NW))
    SH = 2 * BK * RS
    VO = BK * RS  # V's offset in the shared buffer
    UW, URS, UBK, UBQ = U(W), U(RS), U(BK), U(BQ)
    CAUSAL = causal
    ALIGN = None if config.ENABLE_CUDASIM else 16
    DT = float32 if WIDE else uint32
    # the 16-bit m16n8k16 step (two m16n8k8 on sm_75) and the fp32 -> 16-bit pair packing
    mma16 = {"f16": mma.mma_f16_m16n8k16, "bf16": mma.mma_bf16_m16n8k16, "k8": mma.mma_f16_m16n8k8x2}.get(precision)
    pack = mma.pack_bf16x2 if BF16 else mma.pack_f16x2

    @cuda.jit(fastmath=FASTMATH)
    def flash_fwd_tensor(q, k, v, o, lse, n_q, n_k, n_heads, scale_log2):
        sh = cuda.shared.array(SH, DT, alignment=ALIGN)
        tid = U(cuda.threadIdx.x)
        warp, lane = tid // U(32), tid % U(32)
        g, t = lane // U(4), lane % U(4)  # quad (row group) and lane within the quad
        nq, nk = U(n_q), U(n_k)
        q0 = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * UBQ  # last (heaviest, under causal) blocks first
        w0 = q0 + warp * U(16)  # this warp's first row
        bh = U(cuda.blockIdx.y)
        b, h = bh // U(n_heads), bh % U(n_heads)
        qh, kh, vh = q[b, h], k[b, h], v[b, h]

        # Q fragments, kept in registers: rows w0+g and w0+g+8 (zeros past Nq).
        qf = cuda.local.array(QREGS, DT)
        r_lo, r_hi = w0 + g, w0 + g + U(8)
        for ks in range(KSTEPS):
            for j in range(4):  # a0: (g, c)  a1: (g+8, c)  a2: (g, c+4)  a3: (g+8, c+4), c = word t
                row = r_hi if j % 2 else r_lo
                col = U(8 * ks) + t + U(4 * (j // 2))
                qf[4 * ks + j] = qh[row, col] if row < nq else DT(0)

        m = cuda.local.array(2, float32)  # running max of rows g and g+8, raw score units
        l = cuda.local.array(2, float32)  # this lane's share of the running sums
        acc = cuda.local.array((NTD, 4), float32)  # O, unnormalised, as C fragments
        s = cuda.local.array((NTK, 4), float32)  # S, then P, as C fragments
        for r in range(2):
            m[r] = NEG
            l[r] = 0.0
        for n in range(NTD):
            for j in range(4):
                acc[n, j] = 0.0

        k_end = nk
        if CAUSAL:
            k_end = min(nk, q0 + UBQ)  # key tiles after the block's last query are skipped
        for k0 in range(U(0), k_end, UBK):
            cuda.syncthreads()  # everyone is done with the previous tiles
            for it in range(LOADS):  # consecutive threads copy consecutive words of a row: coalesced
                e = U(it * 32 * NW) + tid
                if e < U(TILE_WORDS):
                    row, col = e // UW, e % UW
                    kval, vval = DT(0), DT(0)  # zeros past Nk: 0 * garbage could be NaN
                    if k0 + row < nk:
                        kval, vval = kh[k0 + row, col], vh[k0 + row, col]
                    sh[row * URS + col] = kval
                    sh[U(VO) + row * URS + col] = vval
            cuda.syncthreads()
            if CAUSAL and k0 > w0 + U(15):
                continue  # every key of this tile is after all 16 rows of this warp (warp-uniform)

            # S = Q K^T for this warp's 16 rows and the tile's BK keys.
            for n in range(NTK):
                for j in range(4):
                    s[n, j] = 0.0
            for ks in range(KSTEPS):
                if WIDE:
                    a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
                    if SPLIT:
                        a0b, a1b, a2b, a3b = mma.round_tf32(a0), mma.round_tf32(a1), mma.round_tf32(a2), \
                            mma.round_tf32(a3)
                        a0s, a1s = mma.round_tf32(a0 - a0b), mma.round_tf32(a1 - a1b)
                        a2s, a3s = mma.round_tf32(a2 - a2b), mma.round_tf32(a3 - a3b)
                    for n in range(NTK):  # B fragment: b0 = K[key n*8+g][dim 8ks+t], b1 = ... dim + 4
                        base = U(n * 8) * URS + g * URS + U(8 * ks) + t
                        b0, b1 = sh[base], sh[base + U(4)]
                        c0, c1, c2, c3 = s[n, 0], s[n, 1], s[n, 2], s[n, 3]
                        if SPLIT:
                            b0b, b1b = mma.round_tf32(b0), mma.round_tf32(b1)
                            b0s, b1s = mma.round_tf32(b0 - b0b), mma.round_tf32(b1 - b1b)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0s, a1s, a2s, a3s, b0b, b1b, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0s, b1s, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0b, b1b, c0, c1, c2, c3)
                        else:
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                        s[n, 0], s[n, 1], s[n, 2], s[n, 3] = c0, c1, c2, c3
                else:
                    for n2 in range(NTK // 2):  # ldmatrix: two n-tiles' B fragments (b0, b1) at once
                        # lane 8i + r gives row r of matrix i: key n2*16 + (i//2)*8 + r, words 8ks + (i%2)*4
                        key = U(n2 * 16) + (lane // U(16)) * U(8) + lane % U(8)
                        word = U(8 * ks) + ((lane // U(8)) % U(2)) * U(4)
                        b00, b01, b10, b11 = mma.ldmatrix_x4(sh, key * URS + word)
                        for half in range(2):
                            n = 2 * n2 + half
                            b0, b1 = (b00, b01) if half == 0 else (b10, b11)
                            s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma16(
                                qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3], b0, b1,
                                s[n, 0], s[n, 1], s[n, 2], s[n, 3])

            # Mask keys past Nk and, under causal, keys after the row (only tiles at an edge need it).
            if k0 + UBK > nk or (CAUSAL and k0 + UBK > w0 + U(1)):
                for n in range(NTK):
                    for j in range(4):
                        row = r_hi if j >= 2 else r_lo
                        col = k0 + U(n * 8) + U(2) * t + U(j % 2)
                        if col >= nk or (CAUSAL and col > row):
                            s[n, j] = NEG

            # Online softmax on the C fragments: rows g (j = 0, 1) and g + 8 (j = 2, 3).
            for r in range(2):
                mx = s[0, 2 * r]
                for n in range(NTK):
                    mx = max(mx, max(s[n, 2 * r], s[n, 2 * r + 1]))
                mx = max(mx, mma.shfl_xor(mx, 1))  # the row's 4 lanes (t = 0..3) agree on its max
                mx = max(mx, mma.shfl_xor(mx, 2))
                m_new = max(m[r], mx)
                alpha = math.exp2((m[r] - m_new) * scale_log2)
                m[r] = m_new
                offset = m_new * scale_log2
                row_sum = float32(0.0)
                for n in range(NTK):
                    for c in range(2):
                        p = math.exp2(s[n, 2 * r + c] * scale_log2 - offset)
                        s[n, 2 * r + c] = p
                        row_sum += p
                l[r] = l[r] * alpha + row_sum  # the quad's partial sums are added once, at the end
                for n in range(NTD):
                    acc[n, 2 * r] *= alpha
                    acc[n, 2 * r + 1] *= alpha

            # O += P V, with P straight from registers.
            for kk in range(PSTEPS):
                if WIDE:  # k-step = n-tile kk of S; columns renumbered: t <- key 2t, t+4 <- key 2t+1
                    a0, a1, a2, a3 = s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3]
                    if SPLIT:
                        a0b, a1b, a2b, a3b = mma.round_tf32(a0), mma.round_tf32(a1), mma.round_tf32(a2), \
                            mma.round_tf32(a3)
                        a0s, a1s = mma.round_tf32(a0 - a0b), mma.round_tf32(a1 - a1b)
                        a2s, a3s = mma.round_tf32(a2 - a2b), mma.round_tf32(a3 - a3b)
                    for n in range(NTD):  # b0 = V[key 8kk+2t][dim 8n+g], b1 = V[key 8kk+2t+1][same dim]
                        base = U(VO) + (U(8 * kk) + U(2) * t) * URS + U(8 * n) + g
                        b0, b1 = sh[base], sh[base + URS]
                        c0, c1, c2, c3 = acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3]
                        if SPLIT:
                            b0b, b1b = mma.round_tf32(b0), mma.round_tf32(b1)
                            b0s, b1s = mma.round_tf32(b0 - b0b), mma.round_tf32(b1 - b1b)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0s, a1s, a2s, a3s, b0b, b1b, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0s, b1s, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0b, b1b, c0, c1, c2, c3)
                        else:
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = c0, c1, c2, c3
                else:  # k-step kk = n-tiles 2kk and 2kk+1 of S, packed to 16 bits: the A fragment
                    a0 = pack(s[2 * kk, 0], s[2 * kk, 1])
                    a1 = pack(s[2 * kk, 2], s[2 * kk, 3])
                    a2 = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                    a3 = pack(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                    for n2 in range(NTD // 2):  # ldmatrix.trans: V's B fragments of two 8-dim n-tiles
                        # lane 8i + r: row r of matrix i = key 16kk + (i%2)*8 + r, words of dims 16n2 + (i//2)*8
                        key = U(16 * kk) + ((lane // U(8)) % U(2)) * U(8) + lane % U(8)
                        word = U(8 * n2) + (lane // U(16)) * U(4)
                        b00, b01, b10, b11 = mma.ldmatrix_x4_trans(sh, U(VO) + key * URS + word)
                        for half in range(2):
                            n = 2 * n2 + half
                            b0, b1 = (b00, b01) if half == 0 else (b10, b11)
                            acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma16(
                                a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])

        # Add up each row's sum over its quad, normalise once, write O and lse.
        oh, lh = o[b, h], lse[b, h]
        for r in range(2):
            total = l[r]
            total += mma.shfl_xor(total, 1)
            total += mma.shfl_xor(total, 2)
            row = r_hi if r else r_lo
            if row < nq:
                inv = float32(1.0) / total
                for n in range(NTD):
                    x0, x1 = acc[n, 2 * r] * inv, acc[n, 2 * r + 1] * inv
                    if WIDE:
                        oh[row, U(8 * n) + U(2) * t] = x0
                        oh[row, U(8 * n) + U(2) * t + U(1)] = x1
                    else:
                        oh[row, U(4 * n) + t] = pack(x0, x1)
                if t == U(0):
                    lh[row] = (m[r] * scale_log2 + math.log2(total)) * LN2

    return flash_fwd_tensor


def resolve_precision(dtype: str, precision, cc) -> str:
    """The kernel precision for inputs of `dtype` on a GPU of compute capability `cc` (None: simulator),
    with a clear error for what this GPU or dtype cannot do."""
    if dtype not in PRECISIONS:
        raise TypeError(f"q has dtype {dtype}; the tensor kernel takes float16, bfloat16 or float32")
    allowed = PRECISIONS[dtype]
    if precision is None:
        precision = "k8" if dtype == "float16" and cc is not None and cc < (8, 0) else allowed[0]
    if precision not in allowed:
        raise ValueError(f"precision={precision!r} does not apply to {dtype} inputs; for {dtype} use one of "
                         f"{', '.join(map(repr, (None,) + allowed))}")
    need = (7, 5) if precision == "k8" else (8, 0)
    if cc is not None and cc < need:
        why = {"bf16": "bfloat16 mma", "3xtf32": "tf32 mma", "tf32": "tf32 mma", "f16": "mma.m16n8k16"}[precision]
        hint = "use float16 inputs there" if precision != "f16" else "use precision='k8' (two m16n8k8)"
        raise ValueError(f"{dtype} with precision {precision!r} needs {why}, which needs compute capability "
                         f"{need[0]}.{need[1]}; this GPU has {cc[0]}.{cc[1]}: {hint}, or variant='register'")
    return precision


def forward(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None, precision=None):
    """flash_attention(..., variant="tensor"): check, pack 16-bit inputs as uint32 pairs (no copy), launch."""
    from ..device import device_limits
    from ._launch import check_kernel_inputs, to_device_words

    (q_d, kind, dtype), (k_d, _, k_dtype), (v_d, _, v_dtype) = (to_device_words(x, n) for x, n in
                                                                 ((q, "q"), (k, "k"), (v, "v")))
    if not dtype == k_dtype == v_dtype:
        raise TypeError(f"q, k and v must share one dtype; got q {dtype}, k {k_dtype}, v {v_dtype}")
    precision = resolve_precision(dtype, precision, device_limits()["cc"])
    B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale, words=dtype != "float32")
    tile = choose_tile(d, precision, block_q, block_k)
    from ._launch import empty_words, like_input

    o, o_words = empty_words((B, H, Nq, d), dtype, kind, like=q)
    lse = empty_words((B, H, Nq), "float32", kind, like=q)[0]
    launch(q_d, k_d, v_d, o_words, lse, H, scale, causal, tile, precision)
    return like_input(o, kind), like_input(lse, kind)


def launch(q, k, v, o, lse, n_heads, scale, causal, tile: TensorTile, precision: str):
    """Launch on device arrays: (B, H, N, d/2) uint32 pairs for 16-bit precisions, float32 otherwise."""
    B, H, Nq, w = q.shape
    d = w if precision in ("3xtf32", "tf32") else 2 * w
    kernel = build(d, tile, causal, precision)
    grid = ((Nq + tile.block_q - 1) // tile.block_q, B * H)
    kernel[grid, tile.threads](q, k, v, o, lse, Nq, k.shape[2], n_heads, np.float32(scale * LOG2E))
    return kernel
