"""variant="tensor" backward: FlashAttention-2's backward on tensor cores, from pure-Python Numba (lesson 17).

Three launches, as in kernels/register_backward.py (the FP32-unit version); none holds an Nq x Nk array:

1. `preprocess`: D_i = rowsum(dO_i * O_i) in fp32, and dQ's float32 accumulator set to zero.
2. the main kernel: one thread block per (key block, batch * K/V head); under GQA / MQA (H_kv < H heads of
   K and V) the block walks the query tiles of each of the H / H_kv query heads that read its K/V head, so
   dK_j and dV_j add up over them in registers. A block owns block_k = 16 * warps keys
   and warp w owns 16 of them, so dK_j and dV_j stay in registers as C fragments (rows = keys) for the
   whole loop. V's A fragments sit in registers too (or V_j in shared memory: v_shared); K_j is in shared
   memory (it is an operand twice). The block walks over the query tiles that can see its keys (causal: from
   the diagonal on), copying Q_i, dO_i, lse_i and D_i to shared memory (cp.async, one tile ahead). The shared
   memory is dynamic, so a tile may take more than 48 KB where the GPU allows (78 KB for 128 keys at d128,
   _launch.allow_dynamic_shared). For each tile
   a warp computes, for its 16 keys, the transposes of the forward's view:

       S^T  = K Q^T      A: K (ldmatrix)                  B: Q (ldmatrix)
       dP^T = V dO^T     A: V (registers)                 B: dO (ldmatrix)
       P^T  = exp(scale S^T - lse),  dS^T = P^T * (dP^T - D)      (fp32, on the C fragments; lse, D per column)
       dV  += P^T dO     A: P^T's C fragments, as is      B: dO (ldmatrix.trans)
       dK  += dS^T Q     A: dS^T's C fragments, as is     B: Q (ldmatrix.trans)

   As in the forward, two 8-column C fragments are one 16-column A fragment, so P^T and dS^T never leave
   registers for dV and dK. dQ_i += dS K is different: its rows are queries, and each warp holds dS^T for
   16 keys only. So the warps store dS^T to shared memory (C's columns 2t and 2t+1 are one 32-bit word),
   synchronise, and split dQ_i's tile between them; ldmatrix.trans reads dS^T back as dS's A fragments.
   Each warp adds its scale * dS K into the float32 accumulator with atomics, as FlashAttention-2 does.
3. `cast`: dQ's accumulator to q's dtype (16-bit inputs only).

The library's options (kernels/options.py: window, alignment, ALiBi, softcap, dropout) work as in the forward, on
the C fragments of S^T (rows = keys, columns = queries): their presence is compiled in (build(..., features=)),
their values are main's arguments (left, right, cap, slopes), so a new window or slope set compiles nothing. A key
block visits only the query tiles of options.query_band (causal and window, after alignment), and a warp whose 16
keys miss the tile's band (options.key_band) skips its products. P^T is recomputed from the scores as the forward
transformed them (softcap, then ALiBi, in raw score units), with masked entries *selected* to 0, never multiplied
by it: on the GPU exp2 of a masked score can be inf (a fused multiply-add keeps rounding error), and rows that see
no key come with lse = +inf. Softcap multiplies dS^T by its derivative 1 - tanh^2; ALiBi's bias is constant and
adds no gradient. Dropout regenerates the forward's mask Z (flashlab.dropout, keyed by (seed, batch, query head,
query, key)) on P^T's fragments: dV += (P^T o Z) dO and dS^T = P^T o (dP^T o Z - D). The seed is main's last
argument (int64) in every build, so a new seed compiles nothing.

The build derives its constants once (Traits) and binds main's steps once from the precision and the options
(16-bit or tf32 products, plain or per-entry masking, MHA or GQA tiles, cp.async or register copies): main reads
as the list of steps, each inlined by Numba (inline="always"), so no step costs a call. `launches` describes the
three launches once, for the general path (run_all) and the prepared one (prepared.PreparedLaunches).

Why atomics for dQ: a separate pass over the key blocks of each query block would recompute S^T and dP^T,
two more of the five products (+40% FLOPs), and read K and V again. The price is that dQ's float32 sums
run in whatever order blocks finish, so dQ changes in its last bits from run to run; dK and dV do not.

Precisions as in kernels/tensor.py: "f16" / "bf16" (m16n8k16, fp32 accumulation; P^T and dS^T are rounded to
16 bits for their products, as in FlashAttention-2), "k8" (float16 on sm_75: two m16n8k8 per step, copies
through registers), "3xtf32" (float32 inputs, each product as three tf32 mma on big + small halves; an A
fragment is split once for all the B fragments it meets) and "tf32" (one tf32 mma). tf32 reads 32-bit words from shared memory instead of ldmatrix; its C -> A reuse
renumbers the k index (column t <- row 2t, column t + 4 <- row 2t + 1) on both operands, as in the forward.

Where FlashAttention-2's own backward differs: its 8 warps share a 128-key block in two dimensions (4 x 2 over
dK and dV's keys and dims at d128), where each of ours owns 16 keys and all d dims, which takes more registers;
dQ's atomics are issued from a dedicated shared-memory tile; and it is CUDA C++ compiled ahead of time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, uint32

from ..device import get_cuda
from ..dropout import device_functions as dropout_functions
from . import mma
from ._launch import STATIC_SHARED, Arg, Launch, Launches
from .common import FASTMATH, LOG2E, I, U
from .options import Features, OptionArgs, argument_types, device_functions, plain_arguments
from .tensor import row_words, stages as async_stages

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs
I32 = np.int32  # rows and keys per entry

SHARED_LIMIT = STATIC_SHARED  # the default limit: what a block has without the opt-in


@dataclass(frozen=True)
class BackwardTile:
    """block_k = 16 * warps keys per block; block_q query rows per tile of the loop; stages: copies of the
    Q/dO tile in shared memory (2: the next tile is copied by cp.async while this one is used); v_shared: V_j
    in shared memory, read by ldmatrix per tile, instead of its A fragments held in registers (d/4 registers
    for 16-bit types, d/2 for float32: what tips d = 128 into spilling)."""

    warps: int = 4
    block_q: int = 32
    stages: int = 2
    v_shared: bool = False

    @property
    def block_k(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_words(self, d: int, precision: str) -> int:
        """32-bit words: K_j, the Q_i and dO_i stages (rows padded by 4 words), dS^T (block_k rows of block_q
        values, padded by 4 words), lse_i and D_i per stage."""
        rs = row_words(d, precision) + 4
        ds = self.block_q if precision in ("3xtf32", "tf32") else self.block_q // 2
        return ((2 if self.v_shared else 1) * self.block_k * rs + 2 * self.stages * self.block_q * rs
                + self.block_k * (ds + 4) + 2 * self.stages * self.block_q)

    def check(self, d: int, precision: str, limit: int = SHARED_LIMIT):
        """self, or a ValueError naming what is wrong. limit: shared bytes a block may use (the device's opt-in
        limit: the kernel's shared memory is dynamic)."""
        for name in ("warps", "block_q", "stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.block_q % 16:
            raise ValueError(f"block_q must be a multiple of 16 for the tensor backward; got {self.block_q}")
        if self.threads > 1024:
            raise ValueError(f"{self.warps} warps is {self.threads} threads per block; at most 1024 (32 warps)")
        if self.stages not in (1, 2) or (self.stages == 2 and async_stages(precision) == 1):
            raise ValueError(f"stages must be 1 or 2 (1 for precision 'k8', which has no cp.async); got {self.stages}")
        need = 4 * self.shared_words(d, precision)
        if need > limit:
            raise ValueError(f"tile {self} needs {need} bytes of shared memory at d={d} ({precision}); the limit "
                             f"per block is {limit} bytes: use a smaller block_q, fewer warps or stages=1")
        return self


# Default tiles (warps, block_q, stages, v_shared). d64 and d128 (16-bit and 3xTF32): the fastest of
# `benchmarks/timing/bench_backward.py --tensor --tiles` on an H100 (B1 H16 N4096;
# benchmarks/results/logs-tensor-backward/tiles*.txt). Since the
# shared memory became dynamic (past 48 KB with the opt-in), 128-key blocks of 8 warps win for 16-bit: 32x128
# (78 KB) ran 1.37x the old 48 KB tile (16x64) at d128, 64x128 (73 KB) 1.10x 32x128 at d64. 3xTF32 keeps V in
# shared memory and takes two stages: 32x64 (78 KB) 1.16x the old 16x64 at d64, 16x64 (104 KB) 1.34x the old
# 16x32 at d128 (docs/runs/tensor-backward.md, "More than 48 KB of shared memory"). Where a device's opt-in
# limit is smaller, choose_tile falls back to the first tile that fits.
# d16 / d32 and "k8" (sm_75): `ptxas -v` for sm_80 and sm_90, the largest tiles that compile without spilling
# (flashlab/data/kernel_resources.csv).
DEFAULT_TILES = {
    "16-bit": {16: (4, 64, 2, False), 32: (4, 64, 2, False), 64: (8, 64, 2, False), 128: (8, 32, 2, False)},
    "k8": {16: (4, 64, 1, False), 32: (4, 64, 1, False), 64: (4, 32, 1, False), 128: (2, 16, 1, False)},
    "float32": {16: (4, 64, 2, False), 32: (4, 32, 2, False), 64: (4, 32, 2, True), 128: (4, 16, 2, True)},
}


def choose_tile(d: int, precision: str, block_q=None, block_k=None, limit: int = SHARED_LIMIT) -> BackwardTile:
    """DEFAULT_TILES for (precision, d) where it fits in limit bytes of shared memory (the device's, with the
    opt-in: plan passes it); otherwise, or with block_q / block_k given, the first of 4, 2, 1 warps (or
    block_k / 16), two stages, then V in shared memory, that fits."""
    if block_k is not None and (block_k % 16 or block_k < 16):
        raise ValueError(f"block_k must be a positive multiple of 16 for the tensor backward (16 keys per warp); "
                         f"got {block_k}")
    kind = "float32" if precision in ("3xtf32", "tf32") else "k8" if precision == "k8" else "16-bit"
    if block_q is None and block_k is None and d in DEFAULT_TILES[kind]:
        tile = BackwardTile(*DEFAULT_TILES[kind][d])
        if 4 * tile.shared_words(d, precision) <= limit:
            return tile.check(d, precision, limit)
    two = async_stages(precision) == 2
    for warps in ((block_k // 16,) if block_k else (4, 2, 1)):
        for bq in ((block_q,) if block_q else (32, 16, 64)):
            for st in ((2, 1) if two else (1,)):
                for v_shared in (False, True):
                    tile = BackwardTile(warps, bq, st, v_shared)
                    if 4 * tile.shared_words(d, precision) <= limit:
                        return tile.check(d, precision, limit)
    return BackwardTile(block_k // 16 if block_k else 1, block_q or 16, 1).check(d, precision, limit)  # raises


@dataclass(frozen=True)
class Traits:
    """The main kernel's constants for one (d, tile, precision), derived once; sizes in 32-bit words.
    The shared memory is one dynamic array (sized at launch: tile.shared_words), so that tiles may pass 48 KB where
    the device allows (_launch.allow_dynamic_shared). Its regions, each a multiple of 16 bytes (ldmatrix and
    cp.async need 16-byte-aligned rows), start at V_AT (V_j, v_shared only; K_j at 0), Q_AT and DO_AT (the Q_i and
    dO_i stages), DS_AT (dS^T), L_AT and D_AT (lse_i and D_i per stage), and end at END."""
    W: int  # words per row: d for 32-bit values (3xTF32, TF32), d / 2 for 16-bit pairs
    RS: int  # padded row stride of K, Q, dO in shared memory
    DRS: int  # row stride of dS^T (rows = keys)
    KSTEPS: int  # k-steps over d (S^T, dP^T)
    NTQ: int  # n-tiles of S^T, dP^T (8 queries each)
    NTD: int  # n-tiles of dK, dV, dQ (8 dims each)
    QSTEPS: int  # k-steps over queries (dV, dK)
    KSTEPS_K: int  # k-steps over keys (dQ)
    NG: int  # 3xTF32: n-tiles of dK / dV whose tile sums are built together
    NPAIR: int  # dQ's tile: pairs of n-tiles (by row groups of 16 queries)
    DQ_NP: int  # pairs of n-tiles per warp in the dQ phase: enough for every warp to get one unit, if possible
    DQ_UNITS: int  # units of dQ's tile (16 query rows x DQ_NP pairs), spread over the warps
    V_AT: int
    Q_AT: int
    DO_AT: int
    DS_AT: int
    L_AT: int
    D_AT: int
    END: int
    VREGS: int  # V's A fragments in registers (1: unused, v_shared)
    STAT_ROUNDS: int  # rounds of the block's threads over the tile's rows of lse and D
    CPR: int  # 16-byte chunks per row
    # Q/dO copies as in the forward (tensor.py, LINEAR): each thread keeps its column chunk and moves down the
    # tile QSTEP rows at a time, so its offsets in a tile are fixed 32-bit numbers
    LINEAR: bool
    QSTEP: int
    Q_EVEN: bool

    @classmethod
    def of(cls, d: int, tile: BackwardTile, precision: str) -> "Traits":
        wide, BQ, BK, NT = precision in ("3xtf32", "tf32"), tile.block_q, tile.block_k, tile.threads
        W = d if wide else d // 2
        RS, DRS = W + 4, (BQ if wide else BQ // 2) + 4
        KSTEPS, NTQ, NTD = d // 8 if wide else d // 16, BQ // 8, d // 8
        QG, NPAIR = BQ // 16, NTD // 2
        DQ_NP = 1
        while 2 * DQ_NP <= min(NPAIR, QG * NPAIR // tile.warps) and NPAIR % (2 * DQ_NP) == 0:
            DQ_NP *= 2
        V_AT = BK * RS
        Q_AT = V_AT + (BK * RS if tile.v_shared else 0)
        DO_AT = Q_AT + tile.stages * BQ * RS
        DS_AT = DO_AT + tile.stages * BQ * RS
        L_AT = DS_AT + BK * DRS
        D_AT = L_AT + tile.stages * BQ
        CPR = W // 4
        t = cls(W, RS, DRS, KSTEPS, NTQ, NTD, BQ // 8 if wide else BQ // 16, BK // 8 if wide else BK // 16,
                min(4, NTD), NPAIR, DQ_NP, QG * NPAIR // DQ_NP, V_AT, Q_AT, DO_AT, DS_AT, L_AT, D_AT,
                D_AT + tile.stages * BQ, 1 if tile.v_shared else 4 * KSTEPS, -(-BQ // NT), CPR,
                tile.stages == 2 and NT % CPR == 0, NT // CPR, BQ * CPR % NT == 0)
        assert t.END == tile.shared_words(d, precision)
        return t


@lru_cache(maxsize=None)
def build(d: int, tile: BackwardTile, causal: bool, precision: str, gqa: bool = False,
          features: Features = Features()):
    """(preprocess, main, cast) kernels for one (d, tile, causal, precision). 16-bit precisions take q, k, v,
    o, do, dk, dv as uint32 arrays (B, H, N, d/2) of packed pairs; fp32 ones as float32 (B, H, N, d).
    features: the library's options compiled in (options.Features): query tiles outside a key block's band are
    skipped, the others transformed and masked on the C fragments of S^T, as the forward did on S's. Their values
    are main's arguments left, right, cap, slopes (options.OptionArgs in log2 units: Extras.arguments(causal, B, H,
    log2=True)), which a plain build ignores (options.plain_arguments(causal)). main takes the dropout seed as its
    last argument (int64; ignored without dropout)."""
    T = Traits.of(d, tile, precision)
    WIDE, TF32X3, BF16 = precision in ("3xtf32", "tf32"), precision == "3xtf32", precision == "bf16"
    NW, BQ, NST, VSH, GQA, CAUSAL = tile.warps, tile.block_q, tile.stages, bool(tile.v_shared), bool(gqa), causal
    BK, NT = tile.block_k, tile.threads
    W, KSTEPS, NTQ, NTD, QSTEPS, KSTEPS_K, NG = T.W, T.KSTEPS, T.NTQ, T.NTD, T.QSTEPS, T.KSTEPS_K, T.NG
    NPAIR, DQ_NP, DQ_UNITS, DQ_NT = T.NPAIR, T.DQ_NP, T.DQ_UNITS, 2 * T.DQ_NP
    V_AT, Q_AT, DO_AT, DS_AT, L_AT, D_AT, END = T.V_AT, T.Q_AT, T.DO_AT, T.DS_AT, T.L_AT, T.D_AT, T.END
    STAT_ROUNDS, CPR, LINEAR, QSTEP, Q_EVEN, VREGS = T.STAT_ROUNDS, T.CPR, T.LINEAR, T.QSTEP, T.Q_EVEN, T.VREGS
    Q_CHUNKS, K_CHUNKS = BQ * CPR, BK * CPR
    ASYNC = NST == 2
    LAG = 1 if ASYNC else 0  # copies run one tile ahead
    URS, UDRS, UBQ, UBK = U(T.RS), U(T.DRS), U(BQ), U(BK)
    DT = float32 if WIDE else uint32
    mma16 = {"f16": mma.mma_f16_m16n8k16, "bf16": mma.mma_bf16_m16n8k16, "k8": mma.mma_f16_m16n8k8x2}.get(precision)
    pack = mma.pack_bf16x2 if BF16 else mma.pack_f16x2
    unpack = mma.unpack_bf16x2 if BF16 else mma.unpack_f16x2
    # The library's options: their presence compiled in, their values main's arguments.
    OPTIONS, BOTTOM_RIGHT = features.any, bool(features.bottom_right)
    SOFTCAP, ALIBI, DROP = bool(features.softcap), bool(features.alibi), features.dropout
    PLAIN_RIGHT = I(0) if CAUSAL else I(-1)  # a plain build's band: causal's, compiled in
    opt = device_functions(features)
    z_start, z_mix, z_keep = dropout_functions(features.dropout_p)
    step = cuda.jit(device=True, inline="always", fastmath=FASTMATH)

    @cuda.jit(device=True, inline=True)
    def split(x):
        """3xTF32: x as big + small, both tf32; tf32: x itself (the mma reads its top 19 bits) and 0."""
        if not TF32X3:
            return x, float32(0.0)
        big = mma.round_tf32(x)
        return big, mma.round_tf32(x - big)

    @cuda.jit(device=True, inline=True)
    def mma_tf(a0, a1, a2, a3, s0, s1, s2, s3, b0, b1, c0, c1, c2, c3):
        """c + a @ b on tf32 tensor cores, A already split (a: big halves, s: small ones; split() once per
        fragment, since a warp's A fragment meets several B fragments): one mma, or (3xTF32) small*big +
        big*small + big*big."""
        if not TF32X3:
            return mma.mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        b0b, b1b = mma.round_tf32(b0), mma.round_tf32(b1)
        c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(s0, s1, s2, s3, b0b, b1b, c0, c1, c2, c3)
        c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, mma.round_tf32(b0 - b0b), mma.round_tf32(b1 - b1b),
                                              c0, c1, c2, c3)
        return mma.mma_tf32_m16n8k8(a0, a1, a2, a3, b0b, b1b, c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def p_ds(x, dpx, lse2, Di, i, key, lo, hi, off, capr, slope, zq, scale_log2):
        """(P^T, dS^T) of one entry under the options (raw score x = S^T[key, i], dpx = dP^T[key, i]): the
        forward's softcap, ALiBi and band (the key's queries are [lo, hi): band_of), P = exp2(x' scale log2(e) -
        lse log2(e)) with a select (never a product) for masked entries, since exp2 may be inf there (lse = +inf
        rows: every entry is masked). Dropout: dV takes P Z and dS = P (dP Z - D); softcap: dS times its
        derivative 1 - tanh^2."""
        # 32-bit rows and keys per entry (64-bit ones spilled with ALiBi at d = 128: ptxas sm_90)
        x, th = opt.capped(x, I32(i) + I32(off), I32(key), capr, slope)
        dead = I32(i) < I32(lo) or I32(i) >= I32(hi)
        p = float32(0.0) if dead else math.exp2(x * scale_log2 - lse2)
        z = z_keep(zq, key) if DROP else float32(1.0)
        ds = p * (dpx * z - Di)
        if SOFTCAP:
            ds *= float32(1.0) - th * th
        return p * z, ds

    # ------------------------------------------------------------------ the steps of main, bound once
    @step
    def load_kv(Ks, Vs, kh, vh, k0, nk, tid):
        """K_j (and V_j if v_shared) to shared memory (zeros past Nk), in the first group of copies."""
        for it in range(-(-K_CHUNKS // NT)):
            e = U(it * NT) + tid
            if e < U(K_CHUNKS):
                row, col = e // U(CPR), (e % U(CPR)) * U(4)
                ok = k0 + row < nk
                if ASYNC:
                    mma.cp_async16(Ks, row * URS + col, kh, k0 + row if ok else U(0), col, 16 if ok else 0)
                    if VSH:
                        mma.cp_async16(Vs, row * URS + col, vh, k0 + row if ok else U(0), col, 16 if ok else 0)
                else:
                    for c in range(4):
                        Ks[row * URS + col + U(c)] = kh[k0 + row, col + U(c)] if ok else DT(0)
                        if VSH:
                            Vs[row * URS + col + U(c)] = vh[k0 + row, col + U(c)] if ok else DT(0)

    @step
    def load_v_fragments(vf, vh, kw, g, t, nk):
        """V's A fragments for this warp's 16 keys, kept in registers: rows kw+g and kw+g+8 (zeros past Nk)."""
        for ks in range(0 if VSH else KSTEPS):
            for j in range(4):  # a0: (g, word t)  a1: (g+8, t)  a2: (g, t+4)  a3: (g+8, t+4) of k-step ks
                row = kw + g + U(8 * (j % 2))
                vf[4 * ks + j] = vh[row, U(8 * ks) + t + U(4 * (j // 2))] if row < nk else DT(0)

    @step
    def zero(x, y, rows):
        for n in range(rows):
            for c in range(4):
                x[n, c] = 0.0
                y[n, c] = 0.0

    # grid (key blocks, B * H_kv): under GQA / MQA the block walks the query tiles of every query head that reads
    # its K/V head (group = H / H_kv of them), so dK_j and dV_j sum over them in registers. A build of its own
    # (gqa=True): the index arithmetic costs registers that MHA need not pay.
    if GQA:
        @step
        def place(k, n_heads):
            """(batch, K/V head, query heads per K/V head) of this block."""
            n_kv = U(k.shape[1])
            bh = U(cuda.blockIdx.y)
            return bh // n_kv, bh % n_kv, U(n_heads) // n_kv

        @step
        def tile_at(j, hk, group, n_tiles, q_first):
            """(query head, first row) of the block's tile j: head hk * group + j // n_tiles."""
            return hk * group + j // n_tiles, q_first + (j % n_tiles) * UBQ
    else:
        @step
        def place(k, n_heads):
            bh = U(cuda.blockIdx.y)
            return bh // U(n_heads), bh % U(n_heads), U(1)

        @step
        def tile_at(j, hk, group, n_tiles, q_first):
            return hk, q_first + j * UBQ

    @step
    def query_tiles(k0, nq, nk, left, right):
        """(off, first row, number of tiles): the tiles of block_q query rows that can see keys k0...k0 + BK - 1
        (options.query_band; causal: from the diagonal on); off: the alignment's shift, query i sits at key
        position i + off."""
        off = I(nk) - I(nq) if BOTTOM_RIGHT else I(0)
        lo, hi = opt.query_band(I(k0), I(min(k0 + UBK, nk)) - I(1), off, I(nq), left,
                                right if OPTIONS else PLAIN_RIGHT)
        q_first = U(lo) // UBQ * UBQ
        return off, q_first, (U(hi) - q_first + UBQ - U(1)) // UBQ if lo < hi else U(0)

    @step
    def copy_tile(q, do, lse, D, Qs, dOs, Ls, Ds, b, hq, qc, st, nq, tid, copy_row, copy_col, qstride, dostride,
                  q_in, do_in, q_step, do_step):
        """Tile (head hq, rows qc...) of Q, dO (zeros past Nq), lse * log2(e) and D to the stage at row st."""
        qh, doh, lh, dh = q[b, hq], do[b, hq], lse[b, hq], D[b, hq]
        qbase, dobase = qc * qstride, qc * dostride  # the tile's first element, once per tile
        for it in range(-(-Q_CHUNKS // NT) if LINEAR else 0):  # (LINEAR is a compile-time constant)
            row = copy_row + U(it * QSTEP)
            if Q_EVEN or row < UBQ:
                ok = qc + row < nq
                dst, nbytes = (st + row) * URS + copy_col, 16 if ok else 0
                qat = uint32(q_in + uint32(it) * q_step) if ok else uint32(copy_col)
                doat = uint32(do_in + uint32(it) * do_step) if ok else uint32(copy_col)
                mma.cp_async16_flat(Qs, dst, qh, qbase, qat, nbytes)
                mma.cp_async16_flat(dOs, dst, doh, dobase, doat, nbytes)
        for it in range(0 if LINEAR else -(-Q_CHUNKS // NT)):  # the general copy: sm_75, or odd row chunks
            e = U(it * NT) + tid
            if e < U(Q_CHUNKS):
                row, col = e // U(CPR), (e % U(CPR)) * U(4)
                ok = qc + row < nq
                dst = (st + row) * URS + col
                if ASYNC:
                    src, nbytes = qc + row if ok else U(0), 16 if ok else 0
                    mma.cp_async16(Qs, dst, qh, src, col, nbytes)
                    mma.cp_async16(dOs, dst, doh, src, col, nbytes)
                else:
                    for c in range(4):
                        Qs[dst + U(c)] = qh[qc + row, col + U(c)] if ok else DT(0)
                        dOs[dst + U(c)] = doh[qc + row, col + U(c)] if ok else DT(0)
        for rr in range(STAT_ROUNDS):  # more than one where block_q > 32 * warps (rows > threads)
            r = tid + U(rr * NT)
            if r < UBQ:
                ok = qc + r < nq
                Ls[st + r] = lh[qc + r] * float32(LOG2E) if ok else float32(0.0)
                Ds[st + r] = dh[qc + r] if ok else float32(0.0)

    if ASYNC:
        @step
        def landed(j):
            """True once tile j - 1's copies have landed (this thread's; the barrier after it: everyone's)."""
            mma.cp_async_commit()
            if j == U(0):
                return False
            mma.cp_async_wait(1)
            return True

        @step
        def drain():
            mma.cp_async_wait(0)  # no copy may still be in flight when the block ends (n_tiles = 0: K's)
    else:
        @step
        def landed(j):
            return True

        @step
        def drain():
            pass

    if OPTIONS:
        @step
        def warp_band(q0, kw, b, hc, nk, off, left, right, n_heads, slopes, scale_log2, seed):
            """(live, slope, dropout state): the warp's keys [kw, kw + 16) against the band of the tile's rows (P = 0
            outside), the (batch, query head)'s ALiBi slope in raw units, as the forward's, and the forward's
            dropout mask keyed by (seed, batch, query head, query, key)."""
            k_lo, k_hi = opt.key_band(I(q0) + off, I(q0) + I(UBQ) - I(1) + off, I(nk), left, right)
            live = I(kw) < k_hi and I(kw) + I(16) > k_lo
            slope = slopes[b * U(n_heads) + hc] / scale_log2 if ALIBI else float32(0.0)
            zh = z_start(seed, b, hc) if DROP else U(0)
            return live, slope, zh
    else:
        @step
        def warp_band(q0, kw, b, hc, nk, off, left, right, n_heads, slopes, scale_log2, seed):
            """Under causal masking, a warp whose 16 keys come after every query of the tile has P = 0."""
            return not CAUSAL or q0 + UBQ > kw, float32(0.0), U(0)

    if WIDE:
        @step
        def scores(s, dp, Ks, Vs, vf, Qs, dOs, st, kw, k0, lane, g, t):
            """S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the tile's BQ queries (tf32)."""
            QO = st * URS
            for ks in range(KSTEPS):
                kb = (kw - k0 + g) * URS + U(8 * ks) + t  # K's A fragment from shared memory
                a0, a1, a2, a3 = Ks[kb], Ks[kb + U(8) * URS], Ks[kb + U(4)], Ks[kb + U(8) * URS + U(4)]
                if VSH:
                    v0, v1, v2, v3 = Vs[kb], Vs[kb + U(8) * URS], Vs[kb + U(4)], Vs[kb + U(8) * URS + U(4)]
                else:
                    v0, v1, v2, v3 = vf[4 * ks], vf[4 * ks + 1], vf[4 * ks + 2], vf[4 * ks + 3]
                (a0, e0), (a1, e1), (a2, e2), (a3, e3) = split(a0), split(a1), split(a2), split(a3)
                (v0, w0), (v1, w1), (v2, w2), (v3, w3) = split(v0), split(v1), split(v2), split(v3)
                for n in range(NTQ):  # b0 = Q[query 8n+g][dim 8ks+t], b1 = ... dim + 4
                    base = QO + (U(8 * n) + g) * URS + U(8 * ks) + t
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma_tf(a0, a1, a2, a3, e0, e1, e2, e3, Qs[base],
                                                                Qs[base + U(4)], s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                    dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3] = mma_tf(v0, v1, v2, v3, w0, w1, w2, w3, dOs[base],
                                                                    dOs[base + U(4)], dp[n, 0], dp[n, 1], dp[n, 2],
                                                                    dp[n, 3])
    else:
        @step
        def scores(s, dp, Ks, Vs, vf, Qs, dOs, st, kw, k0, lane, g, t):
            """S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the tile's BQ queries (16-bit)."""
            for ks in range(KSTEPS):
                # K's A fragment: lane 8i + r gives row r of matrix i = key kw + (i%2)*8 + r, words 8ks + (i//2)*4
                key = kw - k0 + (lane // U(8)) % U(2) * U(8) + lane % U(8)
                a0, a1, a2, a3 = mma.ldmatrix_x4(Ks, key * URS + U(8 * ks) + lane // U(16) * U(4))
                if VSH:
                    v0, v1, v2, v3 = mma.ldmatrix_x4(Vs, key * URS + U(8 * ks) + lane // U(16) * U(4))
                else:
                    v0, v1, v2, v3 = vf[4 * ks], vf[4 * ks + 1], vf[4 * ks + 2], vf[4 * ks + 3]
                for n2 in range(NTQ // 2):  # B fragments of two n-tiles: query n2*16 + (i//2)*8 + r
                    row = st + U(n2 * 16) + lane // U(16) * U(8) + lane % U(8)
                    word = row * URS + U(8 * ks) + (lane // U(8)) % U(2) * U(4)
                    q00, q01, q10, q11 = mma.ldmatrix_x4(Qs, word)
                    o00, o01, o10, o11 = mma.ldmatrix_x4(dOs, word)
                    for half in range(2):
                        n = 2 * n2 + half
                        b0, b1 = (q00, q01) if half == 0 else (q10, q11)
                        s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma16(a0, a1, a2, a3, b0, b1,
                                                                   s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                        b0, b1 = (o00, o01) if half == 0 else (o10, o11)
                        dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3] = mma16(v0, v1, v2, v3, b0, b1, dp[n, 0],
                                                                       dp[n, 1], dp[n, 2], dp[n, 3])

    # P^T = exp(scale S^T - lse) and dS^T = P^T (dP^T - D): rows kw+g (c = 0, 1), kw+g+8 (c = 2, 3), columns
    # (queries) 8n + 2t + c % 2.
    if OPTIONS:
        @step
        def band_of(key, nq, nk, off, left, right):
            """[lo, hi): the queries that see the key (options.query_band of one key); none past Nk."""
            lo, hi = opt.query_band(I(key), I(key), off, I(nq), left, right)
            return lo, hi if key < nk else lo

        @step
        def probs(s, dp, Ls, Ds, st, q0, kw, g, t, nq, nk, off, left, right, capr, slope, zh, scale_log2):
            """Options: p_ds on every entry (the band, softcap, ALiBi, dropout). The band is computed once per
            key (this thread's two), as the range of queries that see it, rather than per entry: a smaller loop
            body, which the compiler still unrolls fully (registers, not local memory, for S^T and dP^T)."""
            lo0, hi0 = band_of(kw + g, nq, nk, off, left, right)
            lo1, hi1 = band_of(kw + g + U(8), nq, nk, off, left, right)
            for n in range(NTQ):
                for c in range(2):  # columns 8n + 2t + c: one query each, with keys kw+g and kw+g+8
                    col = U(8 * n) + U(2) * t + U(c)
                    zq = z_mix(zh, q0 + col) if DROP else U(0)  # the query's hash state, for both keys
                    s[n, c], dp[n, c] = p_ds(s[n, c], dp[n, c], Ls[st + col], Ds[st + col], q0 + col, kw + g,
                                             lo0, hi0, off, capr, slope, zq, scale_log2)
                    s[n, 2 + c], dp[n, 2 + c] = p_ds(s[n, 2 + c], dp[n, 2 + c], Ls[st + col], Ds[st + col], q0 + col,
                                                     kw + g + U(8), lo1, hi1, off, capr, slope, zq, scale_log2)

    else:
        @step
        def probs(s, dp, Ls, Ds, st, q0, kw, g, t, nq, nk, off, left, right, capr, slope, zh, scale_log2):
            """Masked on edge tiles only: queries past Nq and, under causal, keys after the query. Keys past Nk
            too: their S^T is 0, and exp(-lse) could overflow 16 bits (inf * 0 = NaN in dQ)."""
            edge = q0 + UBQ > nq or kw + U(16) > nk or (CAUSAL and q0 < kw + U(16))
            for n in range(NTQ):
                for c in range(4):
                    col = U(8 * n) + U(2) * t + U(c % 2)
                    p = math.exp2(s[n, c] * scale_log2 - Ls[st + col])
                    if edge:
                        key = kw + g + U(8 * (c // 2))
                        if q0 + col >= nq or key >= nk or (CAUSAL and key > q0 + col):
                            p = float32(0.0)
                    s[n, c] = p
                    dp[n, c] = p * (dp[n, c] - Ds[st + col])

    # dV += P^T dO and dK += dS^T Q: A straight from the C fragments (see the module docstring).
    if WIDE:
        @step
        def add_grads(s, dp, dK, dV, part, Qs, dOs, st, lane, g, t):
            QO = st * URS
            for which in range(2):
                for n0 in range(0, NTD, NG):
                    for nn in range(NG):
                        for c in range(4):
                            part[nn, c] = 0.0
                    for kk in range(QSTEPS):  # b0 = X[query 8kk+2t][dim 8n+g], b1 = X[query 8kk+2t+1][..]
                        if which == 0:
                            a0, a1, a2, a3 = s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3]
                        else:
                            a0, a1, a2, a3 = dp[kk, 0], dp[kk, 2], dp[kk, 1], dp[kk, 3]
                        (a0, e0), (a1, e1), (a2, e2), (a3, e3) = split(a0), split(a1), split(a2), split(a3)
                        for nn in range(NG):
                            base = QO + (U(8 * kk) + U(2) * t) * URS + U(8 * (n0 + nn)) + g
                            if which == 0:
                                b0, b1 = dOs[base], dOs[base + URS]
                            else:
                                b0, b1 = Qs[base], Qs[base + URS]
                            part[nn, 0], part[nn, 1], part[nn, 2], part[nn, 3] = mma_tf(
                                a0, a1, a2, a3, e0, e1, e2, e3, b0, b1, part[nn, 0], part[nn, 1], part[nn, 2],
                                part[nn, 3])
                    for nn in range(NG):  # fp32 adds: a tensor-core sum over many tiles drifts (tensor.py)
                        for c in range(4):
                            if which == 0:
                                dV[n0 + nn, c] += part[nn, c]
                            else:
                                dK[n0 + nn, c] += part[nn, c]
    else:
        @step
        def add_grads(s, dp, dK, dV, part, Qs, dOs, st, lane, g, t):
            for kk in range(QSTEPS):  # k-step kk = n-tiles 2kk and 2kk+1, packed to 16 bits
                p0, p1 = pack(s[2 * kk, 0], s[2 * kk, 1]), pack(s[2 * kk, 2], s[2 * kk, 3])
                p2, p3 = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1]), pack(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                d0, d1 = pack(dp[2 * kk, 0], dp[2 * kk, 1]), pack(dp[2 * kk, 2], dp[2 * kk, 3])
                d2, d3 = pack(dp[2 * kk + 1, 0], dp[2 * kk + 1, 1]), pack(dp[2 * kk + 1, 2], dp[2 * kk + 1, 3])
                for n2 in range(NTD // 2):  # ldmatrix.trans: B of two 8-dim n-tiles, rows = queries
                    row = st + U(16 * kk) + (lane // U(8)) % U(2) * U(8) + lane % U(8)
                    word = row * URS + U(8 * n2) + lane // U(16) * U(4)
                    o00, o01, o10, o11 = mma.ldmatrix_x4_trans(dOs, word)
                    q00, q01, q10, q11 = mma.ldmatrix_x4_trans(Qs, word)
                    for half in range(2):
                        n = 2 * n2 + half
                        b0, b1 = (o00, o01) if half == 0 else (o10, o11)
                        dV[n, 0], dV[n, 1], dV[n, 2], dV[n, 3] = mma16(p0, p1, p2, p3, b0, b1,
                                                                       dV[n, 0], dV[n, 1], dV[n, 2], dV[n, 3])
                        b0, b1 = (q00, q01) if half == 0 else (q10, q11)
                        dK[n, 0], dK[n, 1], dK[n, 2], dK[n, 3] = mma16(d0, d1, d2, d3, b0, b1,
                                                                       dK[n, 0], dK[n, 1], dK[n, 2], dK[n, 3])

    @step
    def store_ds(dSs, dp, warp, g, t):
        """dS^T to shared memory (zeros when the warp has none): the transpose dQ needs goes through here."""
        for n in range(NTQ):
            for r in range(2):
                row = (warp * U(16) + g + U(8 * r)) * UDRS
                if WIDE:
                    dSs[row + U(8 * n) + U(2) * t] = dp[n, 2 * r]
                    dSs[row + U(8 * n) + U(2) * t + U(1)] = dp[n, 2 * r + 1]
                else:
                    dSs[row + U(4 * n) + t] = pack(dp[n, 2 * r], dp[n, 2 * r + 1])

    if WIDE:
        @step
        def dq_products(dq, dSs, Ks, rg, np0, lane, g, t):
            """dS K for unit (row group rg, pairs from np0) over the block's keys (tf32)."""
            for kk in range(KSTEPS_K):  # a0 = dS[query g][key 2t] = dS^T[2t][g], renumbered as in dV's products
                ab = (U(8 * kk) + U(2) * t) * UDRS + rg * U(16) + g
                a0, a1, a2, a3 = dSs[ab], dSs[ab + U(8)], dSs[ab + UDRS], dSs[ab + UDRS + U(8)]
                (a0, e0), (a1, e1), (a2, e2), (a3, e3) = split(a0), split(a1), split(a2), split(a3)
                for n in range(2 * DQ_NP):  # b0 = K[key 8kk+2t][dim 8n+g], b1 = K[key 8kk+2t+1][..]
                    base = (U(8 * kk) + U(2) * t) * URS + (np0 * U(2) + U(n)) * U(8) + g
                    dq[n, 0], dq[n, 1], dq[n, 2], dq[n, 3] = mma_tf(a0, a1, a2, a3, e0, e1, e2, e3, Ks[base],
                                                                    Ks[base + URS], dq[n, 0], dq[n, 1], dq[n, 2],
                                                                    dq[n, 3])
    else:
        @step
        def dq_products(dq, dSs, Ks, rg, np0, lane, g, t):
            """dS K for unit (row group rg, pairs from np0) over the block's keys (16-bit)."""
            for kk in range(KSTEPS_K):
                # ldmatrix.trans of dS^T: lane 8i + r gives stored row (key) 16kk + (i//2)*8 + r, query words
                # rg*8 + (i%2)*4; transposed on the way, the four matrices are dS's A fragment a0..a3.
                key = U(16 * kk) + lane // U(16) * U(8) + lane % U(8)
                a0, a1, a2, a3 = mma.ldmatrix_x4_trans(dSs, key * UDRS + rg * U(8) + (lane // U(8)) % U(2) * U(4))
                krow = U(16 * kk) + (lane // U(8)) % U(2) * U(8) + lane % U(8)
                for n2 in range(DQ_NP):  # K's B fragments (k = keys) by ldmatrix.trans, like V in the forward
                    word = krow * URS + (np0 + U(n2)) * U(8) + lane // U(16) * U(4)
                    k00, k01, k10, k11 = mma.ldmatrix_x4_trans(Ks, word)
                    for half in range(2):
                        n = 2 * n2 + half
                        b0, b1 = (k00, k01) if half == 0 else (k10, k11)
                        dq[n, 0], dq[n, 1], dq[n, 2], dq[n, 3] = mma16(a0, a1, a2, a3, b0, b1,
                                                                       dq[n, 0], dq[n, 1], dq[n, 2], dq[n, 3])

    @step
    def add_dq(dq, dqh, dSs, Ks, q0, nq, scale, warp, lane, g, t):
        """dQ_i += scale * dS K: unit u = (16 query rows, DQ_NP pairs of n-tiles), spread over the warps; each
        warp adds its units into the float32 accumulator with atomics."""
        u = warp
        while u < U(DQ_UNITS):
            rg, np0 = u // U(NPAIR // DQ_NP), (u % U(NPAIR // DQ_NP)) * U(DQ_NP)
            for n in range(2 * DQ_NP):
                for c in range(4):
                    dq[n, c] = 0.0
            dq_products(dq, dSs, Ks, rg, np0, lane, g, t)
            for r in range(2):
                row = q0 + rg * U(16) + g + U(8 * r)
                if row < nq:
                    for n in range(2 * DQ_NP):
                        col = (np0 * U(2) + U(n)) * U(8) + U(2) * t
                        cuda.atomic.add(dqh, (row, col), dq[n, 2 * r] * scale)
                        cuda.atomic.add(dqh, (row, col + U(1)), dq[n, 2 * r + 1] * scale)
            u += U(NW)

    @step
    def store(dk, dv, dK, dV, b, hk, kw, g, t, nk, scale):
        """dK_j (times scale) and dV_j to HBM in the inputs' type; zero for keys no query sees."""
        for r in range(2):
            key = kw + g + U(8 * r)
            if key < nk:
                for n in range(NTD):
                    x0, x1 = dK[n, 2 * r] * scale, dK[n, 2 * r + 1] * scale
                    y0, y1 = dV[n, 2 * r], dV[n, 2 * r + 1]
                    if WIDE:
                        dk[b, hk, key, U(8 * n) + U(2) * t] = x0
                        dk[b, hk, key, U(8 * n) + U(2) * t + U(1)] = x1
                        dv[b, hk, key, U(8 * n) + U(2) * t] = y0
                        dv[b, hk, key, U(8 * n) + U(2) * t + U(1)] = y1
                    else:
                        dk[b, hk, key, U(4 * n) + t] = pack(x0, x1)
                        dv[b, hk, key, U(4 * n) + t] = pack(y0, y1)

    @cuda.jit
    def preprocess(o, do, D, dq_acc, n_heads):
        """D = rowsum(dO * O) in fp32 and dq_acc = 0. A warp per query row, so that neighbouring lanes read
        neighbouring words (one thread per row read with a stride of a whole row: 8x slower on an H100);
        PREPROCESS_ROWS rows per block of PREPROCESS_WARPS warps, grid (row blocks, B * H)."""
        bh = U(cuda.blockIdx.y)
        b, h = bh // U(n_heads), bh % U(n_heads)
        tid = U(cuda.threadIdx.x)
        warp, lane = tid // U(32), tid % U(32)
        for r in range(PREPROCESS_ROWS // PREPROCESS_WARPS):
            i = U(cuda.blockIdx.x) * U(PREPROCESS_ROWS) + U(r * PREPROCESS_WARPS) + warp
            if i < U(o.shape[2]):  # the same for the warp's 32 lanes, so all of them take part in the shuffles
                acc = float32(0.0)
                for w0 in range(0, W, 32):
                    w = U(w0) + lane
                    if w < U(W):
                        if WIDE:
                            acc += do[b, h, i, w] * o[b, h, i, w]
                        else:
                            x0, x1 = unpack(o[b, h, i, w])
                            y0, y1 = unpack(do[b, h, i, w])
                            acc += x0 * y0 + x1 * y1
                acc += mma.shfl_xor(acc, 16)
                acc += mma.shfl_xor(acc, 8)
                acc += mma.shfl_xor(acc, 4)
                acc += mma.shfl_xor(acc, 2)
                acc += mma.shfl_xor(acc, 1)
                for e0 in range(0, d, 32):
                    e = U(e0) + lane
                    if e < U(d):
                        dq_acc[b, h, i, e] = 0.0
                if lane == U(0):
                    D[b, h, i] = acc

    @cuda.jit(fastmath=FASTMATH)
    def main(q, k, v, do, lse, D, dq_acc, dk, dv, n_heads, scale, scale_log2, left, right, cap, slopes, seed):
        words = cuda.shared.array(0, DT)  # the dynamic shared memory; floats: the same bytes as float32
        floats = cuda.shared.array(0, float32)
        Ks, Vs, Qs, dOs = words[:V_AT], words[V_AT:Q_AT], words[Q_AT:DO_AT], words[DO_AT:DS_AT]  # Vs: v_shared only
        dSs = words[DS_AT:L_AT]  # dS^T, rows = the block's keys
        Ls, Ds = floats[L_AT:D_AT], floats[D_AT:END]  # lse * log2(e) and D of the tiles' queries
        tid = U(cuda.threadIdx.x)
        warp, lane = tid // U(32), tid % U(32)
        g, t = lane // U(4), lane % U(4)
        b, hk, group = place(k, n_heads)
        nq, nk = U(q.shape[2]), U(k.shape[2])
        k0 = U(cuda.blockIdx.x) * UBK
        kw = k0 + warp * U(16)  # this warp's first key
        kh, vh = k[b, hk], v[b, hk]
        vf = cuda.local.array(VREGS, DT)
        dK = cuda.local.array((NTD, 4), float32)
        dV = cuda.local.array((NTD, 4), float32)
        s = cuda.local.array((NTQ, 4), float32)  # S^T, then P^T
        dp = cuda.local.array((NTQ, 4), float32)  # dP^T, then dS^T
        part = cuda.local.array((NG, 4), float32)  # 3xTF32: one tile's sum for NG n-tiles of dK or dV
        dq = cuda.local.array((DQ_NT, 4), float32)

        load_kv(Ks, Vs, kh, vh, k0, nk, tid)
        load_v_fragments(vf, vh, kw, g, t, nk)
        zero(dK, dV, NTD)
        off, q_first, n_tiles = query_tiles(k0, nq, nk, left, right)
        capr = cap / scale_log2  # S^T stays in raw units, as in the forward
        copy_row, copy_col = tid // U(CPR), (tid % U(CPR)) * U(4)
        qstride, dostride = U(q.strides[2]) // U(4), U(do.strides[2]) // U(4)  # words between rows
        q_in, do_in = uint32(copy_row * qstride + copy_col), uint32(copy_row * dostride + copy_col)
        q_step, do_step = uint32(U(QSTEP) * qstride), uint32(U(QSTEP) * dostride)
        for j in range(group * n_tiles + U(LAG)):  # copy tile j while tile j - LAG is computed
            if j < group * n_tiles:
                hq, qc = tile_at(j, hk, group, n_tiles, q_first)
                copy_tile(q, do, lse, D, Qs, dOs, Ls, Ds, b, hq, qc, (j % U(NST)) * UBQ, nq, tid, copy_row,
                          copy_col, qstride, dostride, q_in, do_in, q_step, do_step)
            if not landed(j):
                continue
            cuda.syncthreads()  # everyone's copies have landed; everyone is done with dS^T of the tile before
            hc, q0 = tile_at(j - U(LAG), hk, group, n_tiles, q_first)
            st = ((j - U(LAG)) % U(NST)) * UBQ  # the stage (row offset) the tile is in
            live, slope, zh = warp_band(q0, kw, b, hc, nk, off, left, right, n_heads, slopes, scale_log2, seed)
            zero(s, dp, NTQ)
            if live:
                scores(s, dp, Ks, Vs, vf, Qs, dOs, st, kw, k0, lane, g, t)
                probs(s, dp, Ls, Ds, st, q0, kw, g, t, nq, nk, off, left, right, capr, slope, zh, scale_log2)
                add_grads(s, dp, dK, dV, part, Qs, dOs, st, lane, g, t)
            store_ds(dSs, dp, warp, g, t)
            cuda.syncthreads()
            add_dq(dq, dq_acc[b, hc], dSs, Ks, q0, nq, scale, warp, lane, g, t)
        drain()
        store(dk, dv, dK, dV, b, hk, kw, g, t, nk, scale)

    @cuda.jit
    def cast(src, dst):
        """dst[i] = the 16-bit pair (src[2i], src[2i+1]), over flat arrays: dQ's accumulator to q's dtype."""
        i = cuda.grid(1)
        if i < dst.shape[0]:
            dst[i] = pack(src[2 * i], src[2 * i + 1])

    return preprocess, main, cast


PREPROCESS_WARPS = 4  # warps per block of the preprocess kernel (a warp per query row at a time)
PREPROCESS_ROWS = 16  # query rows per block of the preprocess kernel


def launches(kernels, B: int, H: int, Nq: int, Nk: int, d: int, H_kv: int, scale: float, tile: BackwardTile,
             precision: str, args: OptionArgs):
    """The three launches of one call, described once (_launch.Launch) for the general and the prepared path.
    Arrays by name: q, k, v, o, do (uint32 pairs for 16-bit precisions, float32 for tf32 ones), lse, slopes
    (args.slopes: the description's host array), dk, dv, dq (q's type) and the temporaries D and (16-bit) dq_acc,
    dQ's float32 accumulator (dq itself for float32), name -> (shape, dtype). The seed goes to the second launch
    (seeded=1)."""
    preprocess, main, cast = kernels
    wide = precision in ("3xtf32", "tf32")
    acc = "dq" if wide else "dq_acc"
    temporaries = {"D": ((B, H, Nq), np.float32)}
    if not wide:
        temporaries["dq_acc"] = ((B, H, Nq, d), np.float32)
    out = [Launch(preprocess, (-(-Nq // PREPROCESS_ROWS), B * H), 32 * PREPROCESS_WARPS, ("o", "do", "D", acc, H)),
           Launch(main, (-(-Nk // tile.block_k), B * H_kv), tile.threads,  # key blocks x (batch, K/V head)
                  ("q", "k", "v", "do", "lse", "D", acc, "dk", "dv", H, np.float32(scale),
                   np.float32(scale * LOG2E), int(args.left), int(args.right), np.float32(args.cap), "slopes",
                   np.int64(0)), shared=4 * tile.shared_words(d, precision))]
    if not wide:  # dQ, accumulated in float32, to the inputs' 16-bit type
        n = B * H * Nq * d
        out.append(Launch(cast, (-(-(n // 2) // 256),), 256, (Arg(acc, (n,)), Arg("dq", (n // 2,)))))
    return Launches(out, temporaries, {"slopes": args.slopes}, seeded=1)


def signature(precision: str):
    """main's argument types for C-contiguous arrays (kernels/plan.py)."""
    from numba import int64, types

    a4 = types.Array(float32 if precision in ("3xtf32", "tf32") else types.uint32, 4, "C")
    f3, f4 = types.Array(float32, 3, "C"), types.Array(float32, 4, "C")
    # the heads, scale and scale * log2(e), the options' values, the dropout seed
    return (a4, a4, a4, a4, f3, f3, f4, a4, a4, int64, float32, float32) + argument_types() + (int64,)


def launch(q, k, v, o, lse, do, dq, dk, dv, dq_acc, D, n_heads, scale, causal, tile: BackwardTile, precision: str,
           *, extras=None, seed=0):
    """Launch the three kernels on device arrays (the general path, for tests and lesson 17): q, k, v, o, do, dq,
    dk, dv as (B, H, N, d/2) uint32 pairs (16-bit precisions) or float32 (B, H, N, d); lse, D float32 (B, H, Nq);
    dq_acc float32 (B, H, Nq, d), which is dq itself for float32. extras: options.Extras (or None); seed: the
    dropout seed."""
    B, H, Nq, w = q.shape
    d = w if precision in ("3xtf32", "tf32") else 2 * w
    features = extras.features() if extras is not None else Features()
    args = extras.arguments(causal, B, H, True) if extras is not None else plain_arguments(causal)
    kernels = build(d, tile, causal, precision, gqa=k.shape[1] != H, features=features)
    described = launches(kernels, B, H, Nq, k.shape[2], d, k.shape[1], scale, tile, precision, args)
    arrays = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv, D=D, dq_acc=dq_acc)
    described._replace(temporaries={}).run(arrays, seed=np.int64(seed))  # the caller gives D and dq_acc
    return kernels[1]
