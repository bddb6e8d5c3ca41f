"""variant="tensor": FlashAttention-2 forward on tensor cores, from pure-Python Numba (lesson 15).

One thread block owns block_q = 16 * m_tiles * warps query rows of one (batch, head); each warp owns m_tiles
m-tiles of 16 of them (2 for 16-bit inputs by default, so that each K and V fragment read from shared memory
feeds two mma) and works alone on its rows, as in the FA2 paper (Section 3.3: no communication between warps
for S and P).
For each tile of block_k keys:

    1. the block copies the K and V tiles to shared memory (row-major, rows padded by 16 bytes) with
       cp.async, one tile ahead: tile j+1 travels from global memory while tile j is being used (two
       shared-memory stages; the sm_75 build, which has no cp.async, copies through registers);
    2. each warp computes its 16 x block_k piece of S = Q K^T with mma.sync: Q's fragments sit in registers
       for the whole loop, K's come from shared memory (ldmatrix for 16-bit types);
    3. the online softmax runs on S's C fragments in fp32: a lane holds 2 rows (g and g+8) of each 8-key
       n-tile, so a row's max and sum need the 4 lanes of a quad (two shfl_xor); O is rescaled only if some
       row of the m-tile got a larger max (a warp vote: otherwise every factor is 1);
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

Launch options, chosen by kernels/plan.py as for the register kernel (see kernels/register.py): split (each
block takes one chunk of keys and writes a float32 partial output; the merge kernel of kernels/split_kv.py
combines them) and heavy_first (grid (g, query blocks, sections x splits): sections of g heads, heaviest first).
Three more builds: extras (the library's window, alignment, ALiBi, softcap and dropout, as in the
register kernel), page (K/V read through a paged cache's block table, for kernels/paged.py's decoding)
and varlen (one launch over sequences packed along one axis, as the register kernel's varlen build:
kernels/varlen.py). Every build takes the dropout seed as its last argument (a runtime int64: a new seed
needs no new compile); builds without dropout ignore it.

Where FlashAttention-2 itself goes further: 128-key tiles at d = 64 and two m-tiles per warp at every head
dimension (it takes 16-bit inputs only), up to 227 KB of shared memory per block (this forward uses 48 KB of
static shared memory), and CUDA C++ compiled ahead of time; on Hopper, FA3 replaces mma.sync with wgmma and
cp.async with TMA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import config, float32, uint32, uint64

from ..device import get_cuda
from ..dropout import device_functions
from . import mma
from .common import FASTMATH, LN2, LOG2E, NEG, U
from .options import Extras, block_functions, score_functions
from .split_kv import grid, merge_split, split_chunk

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs

PRECISIONS = {"float16": ("f16", "k8"), "bfloat16": ("bf16",), "float32": ("3xtf32", "tf32")}


@dataclass(frozen=True)
class TensorTile:
    """A tensor-kernel configuration: block_q = 16 * m_tiles * warps query rows, block_k keys per K/V tile.
    m_tiles: 16-row m-tiles per warp (16-bit precisions): with 2, each K and V fragment read from shared memory
    feeds two mma instead of one, as in FlashAttention-2's kernels."""

    warps: int = 4
    block_k: int = 64
    m_tiles: int = 1

    @property
    def block_q(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_words(self, d: int, precision: str) -> int:
        """32-bit words of shared memory: K and V tiles, rows of d (fp32) or d/2 (16-bit pairs) words,
        padded by 4 words so that 8 rows read together fall in 32 different banks; two copies (stages) when
        the next tile is copied asynchronously while this one is used."""
        return stages(precision) * 2 * self.block_k * (row_words(d, precision) + 4)

    def check(self, d: int, precision: str, shared_limit: int = 48 * 1024):
        for name in ("warps", "block_k", "m_tiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.m_tiles > 1 and precision in ("3xtf32", "tf32"):
            raise ValueError(f"m_tiles={self.m_tiles}: the float32 precisions keep one m-tile per warp (registers)")
        if self.block_k % 16:
            raise ValueError(f"block_k must be a multiple of 16 for the tensor kernel; got {self.block_k}")
        if self.threads > 1024:
            raise ValueError(f"{self.warps} warps is {self.threads} threads per block; at most 1024 (32 warps)")
        need = 4 * self.shared_words(d, precision)
        if need > shared_limit:
            raise ValueError(f"tile {self} needs {need} bytes of shared memory at d={d} ({precision}); "
                             f"the limit per block is {shared_limit} bytes: use a smaller block_k")
        return self


def stages(precision: str) -> int:
    """Copies of the K/V tiles in shared memory: 2 when cp.async (sm_80+) fills the next while this one is
    used; 1 for the sm_75 build ("k8"), which copies through registers between two barriers."""
    return 1 if precision == "k8" else 2


def row_words(d: int, precision: str) -> int:
    return d if precision in ("3xtf32", "tf32") else d // 2


def options_weight(window: bool, softcap: bool, alibi: bool, dropout: bool):
    """What the library's options cost the forward in registers, for choose_tile: False (none), "light" or
    "heavy". From ptxas for sm_90 at d = 64 with two m-tiles and block_k 64: a window (or the alignment), softcap
    or dropout alone, and a window with softcap, compile without spills; ALiBi, and dropout with any other
    option, spill."""
    if not (window or softcap or alibi or dropout):
        return False
    return "heavy" if alibi or (dropout and (window or softcap)) else "light"


def library_weight(options: dict):
    """options_weight of the library's options as a call gives them (window_size, align, alibi_slopes, softcap,
    dropout_p; other keys ignored), before their checks, which name bad values: anything that does not read as a
    plain value here counts as heavy, the safe tile."""
    try:
        window = tuple(options["window_size"]) != (-1, -1) or options["align"] != "top_left"
        return options_weight(window, bool(options["softcap"]), options["alibi_slopes"] is not None,
                              bool(options["dropout_p"]))
    except (TypeError, ValueError):
        return "heavy"


def choose_tile(d: int, precision: str, block_q=None, block_k=None, causal: bool = False, extras=False,
                varlen: bool = False) -> TensorTile:
    """Default tiles, from benchmarks/experiments/tensor_experiments.py on an H100 and ptxas's spill counts for sm_90.

    float16 / bfloat16: two m-tiles per warp, so each K / V fragment read feeds two mma: 4 warps and block_k 64
    up to d = 64 (128 rows; block_k 32 when the build's options are "heavy", see options_weight, whose per-score
    work would spill at 64; True counts as heavy); at d = 128, 8 warps and block_k 32 (256 rows) for the plain
    non-causal build, and one m-tile of 4 warps where the bigger tile spills (causal, any option, varlen). float32 and the sm_75 build: one
    m-tile per warp, 8 warps (128 rows) up to d = 64 and 4 (64 rows) at d = 128; block_k 32, or 16 where 32 does
    not fit in 48 KB. A given block_q means one m-tile per warp: block_q / 16 warps."""
    if block_q is not None and (block_q % 16 or block_q < 16):
        raise ValueError(f"block_q must be a positive multiple of 16 for the tensor kernel (16 rows per warp); "
                         f"got {block_q}")
    if block_q is None and precision in ("f16", "bf16"):
        if d <= 64:
            heavy = extras is True or extras == "heavy"
            return TensorTile(4, block_k or (32 if heavy else 64), m_tiles=2).check(d, precision)
        if not (causal or extras or varlen):
            return TensorTile(8, block_k or 32, m_tiles=2).check(d, precision)
    warps = block_q // 16 if block_q else (8 if d <= 64 else 4)
    if block_k is None:
        fits = [bk for bk in (32, 16) if 4 * TensorTile(warps, bk).shared_words(d, precision) <= 48 * 1024]
        block_k = fits[0] if fits else 16
    return TensorTile(warps=warps, block_k=block_k).check(d, precision)


@lru_cache(maxsize=None)
def build(d: int, tile: TensorTile, causal: bool, precision: str, split: bool = False, heavy_first: bool = False,
          gqa: bool = False, page: int = 0, extras=None, varlen: bool = False):
    """Compile-time specialised forward kernel for (d, tile, causal, precision). 16-bit precisions take Q,
    K, V and O as uint32 arrays (B, H, N, d/2) of packed pairs; fp32 ones as float32 (B, H, N, d).
    split: o and lse are float32 partial outputs viewed as (B, H * splits, Nq, d) and (B, H * splits, Nq).
    page > 0: a paged KV cache of `page` keys per page (kernels/paged.py): k and v are the caches as
    (num_pages * page, H, d or d/2), and n_k is an int32 array (B, 1 + max_pages) holding cache_seqlens[b]
    then block_table[b]; key j of sequence b is row block_table[b, j // page] * page + j % page.
    extras: the library's window, alignment, ALiBi, softcap and dropout (kernels/register.py's Extras), compiled
    in as in the register kernel: key tiles outside the band of the block's rows are skipped, the others are
    transformed and masked on S's C fragments; None builds the plain kernel, unchanged. Dropout alone keeps the
    plain kernel's masking (edge tiles only) and multiplies P by the mask of flashlab.dropout after the row sum,
    keyed by (seed, b, query head h, row, key) as the register kernel: the seed is the last argument.
    varlen: q, k, v, o are packed (total, H, d or d/2), lse is (H, total_q); n_q is the (n_blocks, 2) table of
    (sequence, first row) and n_k the int32 (2, B + 1) cu_seqlens of queries and keys; grid (n_blocks, H)."""
    WIDE = precision in ("3xtf32", "tf32")
    SPLIT = precision == "3xtf32"
    BF16 = precision == "bf16"
    NW, BK, MT = tile.warps, tile.block_k, tile.m_tiles
    BQ = 16 * MT * NW
    WROWS = 16 * MT  # rows per warp: m-tile mt holds rows 16 mt .. 16 mt + 15 of them
    W = d if WIDE else d // 2  # 32-bit words per row of Q, K, V, O
    RS = W + 4  # padded shared row stride, in words
    KSTEPS = d // 8 if WIDE else d // 16  # k-steps of S = Q K^T (k = 8 for tf32, 16 for 16-bit)
    NTK = BK // 8  # n-tiles of S (8 keys each)
    NTD = d // 8  # n-tiles of O (8 dims each)
    PSTEPS = BK // 8 if WIDE else BK // 16  # k-steps of O += P V
    NG = min(4 if d <= 64 else 2, NTD)  # 3xTF32: n-tiles of O whose tile sums are built together (fewer at d=128: registers)
    QREGS = 4 * KSTEPS
    # local arrays need compile-time sizes: rows, P's A fragments, Q fragments, S and O n-tiles of all m-tiles
    ROWS2, PAW, QALL, SROWS, OROWS = 2 * MT, 4 * MT, MT * QREGS, MT * NTK, MT * NTD
    NT = 32 * NW  # threads
    ASYNC = stages(precision) == 2
    LAG = 1 if ASYNC else 0  # tile j's copies are issued one iteration before tile j is used
    STAGE = 2 * BK * RS  # words of one stage: K tile, then V tile
    SH = stages(precision) * STAGE
    VO = BK * RS  # V's offset in a stage
    CPR = W // 4  # 16-byte chunks per row (async copies)
    CHUNKS = BK * CPR
    CHUNK_ITERS, CHUNKS_EVEN = -(-CHUNKS // NT), CHUNKS % NT == 0
    # the block's copies move down the tile by RSTEP rows per iteration, each thread keeping its column chunk:
    # source offsets then grow by a constant (a paged cache finds each row through the block table instead)
    LINEAR = ASYNC and NT % CPR == 0 and page == 0
    RSTEP = NT // CPR
    LOADS, LOADS_EVEN = -(-(BK * W) // NT), (BK * W) % NT == 0  # words per thread (copies through registers)
    UW, URS, UBK, UBQ = U(W), U(RS), U(BK), U(BQ)  # unsigned: no negative-index checks
    CAUSAL = causal
    SPLIT_KV, HEAVY, GQA = bool(split), bool(heavy_first), bool(gqa)
    PAGED, UPAGE = page > 0, U(max(page, 1))
    VARLEN = bool(varlen)
    if VARLEN and (SPLIT_KV or HEAVY or PAGED):
        raise ValueError("the varlen build orders its blocks itself and does not split the keys or page them")

    ex = extras or Extras()
    EXTRA = ex._replace(dropout_p=0.0) != Extras()  # window, alignment, ALiBi or softcap: S is transformed, masked
    DROP = ex.dropout_p > 0
    if DROP and PAGED:
        raise ValueError(f"dropout_p={ex.dropout_p} with page={page}: the paged build packs (query head, row) pairs "
                         "as rows, so it has no dropout; use page=0")
    d_start, d_mix, d_keep = device_functions(ex.dropout_p)
    capped, outside = score_functions(ex, causal)
    query_block, key_range = block_functions(ex, causal, EXTRA, BQ, BK, HEAVY, SPLIT_KV)
    I = np.int64
    RIGHT = I(ex.right_bound(causal))  # the furthest key to the right a row may see, as in register.py
    ALIBI, PER_B = ex.slopes is not None, bool(ex.per_batch)
    CAP_LOG2 = float32(ex.softcap * LOG2E)
    SLOPES = tuple(float(x) * LOG2E for x in (ex.slopes or (0.0,)))
    INF = float32(math.inf)
    # a row can see no key of its chunk (or, with a window, none at all): keep its p = 0 and its output finite
    GUARD = (SPLIT_KV and (CAUSAL or PAGED)) or EXTRA or VARLEN  # varlen: a sequence may have no keys
    HALF_NEG = float32(0.5 * NEG)
    ALIGN = None if config.ENABLE_CUDASIM else 16
    DT = float32 if WIDE else uint32
    # the 16-bit m16n8k16 step (two m16n8k8 on sm_75) and the fp32 -> 16-bit pair packing
    mma16 = {"f16": mma.mma_f16_m16n8k16, "bf16": mma.mma_bf16_m16n8k16, "k8": mma.mma_f16_m16n8k8x2}.get(precision)
    pack = mma.pack_bf16x2 if BF16 else mma.pack_f16x2

    @cuda.jit(fastmath=FASTMATH)
    def flash_fwd_tensor(q, k, v, o, lse, n_q, n_k, n_heads, scale_log2, seed):
        sh = cuda.shared.array(SH, DT, alignment=ALIGN)
        tid = U(cuda.threadIdx.x)
        warp, lane = tid // U(32), tid % U(32)
        g, t = lane // U(4), lane % U(4)  # quad (row group) and lane within the quad
        q0, bh, kpart, n_parts = query_block(q.shape[0], n_heads)
        b, h = bh // U(n_heads), bh % U(n_heads)
        if VARLEN:  # block x: (sequence b, first row q0) from the table; its rows and keys from cu_seqlens
            b, h = U(n_q[cuda.blockIdx.x, 0]), U(cuda.blockIdx.y)
            q0, cq, ck = U(n_q[cuda.blockIdx.x, 1]), U(n_k[0, b]), U(n_k[1, b])
        w0 = q0 + warp * U(WROWS)  # this warp's first row
        hk = h
        if GQA:  # query head h reads K/V head h // (H / H_kv); a build of its own, so MHA's code is unchanged
            hk = h * U(k.shape[1]) // U(n_heads)
        if VARLEN:  # views of sequence b's rows, so the tile loop is the same code
            nq, nk = U(n_k[0, b + U(1)]) - cq, U(n_k[1, b + U(1)]) - ck
            qh, kh, vh = q[cq:cq + nq, h], k[ck:ck + nk, hk], v[ck:ck + nk, hk]
        elif PAGED:  # sequence b's own length; its keys are rows of the cache found through the block table
            nq, nk = U(n_q), U(n_k[b, 0])
            qh, kh, vh = q[b, h], k[:, h], v[:, h]
        else:
            nq, nk = U(n_q), U(n_k)
            qh, kh, vh = q[b, h], k[b, hk], v[b, hk]

        # Q fragments, kept in registers: in m-tile mt, rows w0+16mt+g and w0+16mt+g+8 (zeros past Nq).
        # A lane's row (mt, r) is w0 + g + 16 mt + 8 r; arrays below index it as 2 mt + r, m-tile mt's
        # n-tiles as mt * NTK + n (S) and mt * NTD + n (O).
        qf = cuda.local.array(QALL, DT)
        for mt in range(MT):
            for ks in range(KSTEPS):
                for j in range(4):  # a0: (g, c)  a1: (g+8, c)  a2: (g, c+4)  a3: (g+8, c+4), c = word t
                    row = w0 + g + U(16 * mt + 8 * (j % 2))
                    col = U(8 * ks) + t + U(4 * (j // 2))
                    qf[mt * QREGS + 4 * ks + j] = qh[row, col] if row < nq else DT(0)

        m = cuda.local.array(ROWS2, float32)  # running max of each row, raw score units
        l = cuda.local.array(ROWS2, float32)  # this lane's share of the running sums
        acc = cuda.local.array((OROWS, 4), float32)  # O, unnormalised, as C fragments
        s = cuda.local.array((SROWS, 4), float32)  # S, then P, as C fragments
        s2 = cuda.local.array((NTK if SPLIT else 1, 4), float32)  # 3xTF32: S's correction terms, then P's small part
        alpha = cuda.local.array(ROWS2, float32)  # this tile's rescale of each row
        part = cuda.local.array((NG, 4), float32)  # 3xTF32: a tile's P V for NG n-tiles of O
        pa = cuda.local.array(PAW, uint32)  # 16-bit: one k-step's A fragments of P, per m-tile
        for r in range(2 * MT):
            m[r] = NEG
            l[r] = 0.0
        for n in range(MT * NTD):
            for j in range(4):
                acc[n, j] = 0.0
        zrow = cuda.local.array(ROWS2, uint64)  # dropout: the hash state of each row
        if DROP:  # keyed by (seed, batch, query head, row, col) as flashlab.dropout: (seed, b, h) once per block
            zh = d_start(seed, b, h)
            for r in range(2 * MT):
                zrow[r] = d_mix(zh, w0 + g + U(8 * r))

        k_begin, k_end, off = key_range(q0, kpart, n_parts, nq, nk)  # the chunk, cut to causal or the band
        capr, slope = float32(0.0), float32(0.0)
        if EXTRA:
            # S stays in raw units (scale is applied in exp2): softcap and slopes are divided by the scale
            capr = CAP_LOG2 / scale_log2
            if ALIBI:
                slope = float32(SLOPES[b * U(n_heads) + h if PER_B else h]) / scale_log2
        n_tiles = (k_end + UBK - U(1)) // UBK
        if SPLIT_KV or EXTRA:
            n_tiles = (k_end - k_begin + UBK - U(1)) // UBK if k_end > k_begin else U(0)
        # LINEAR copies: this thread's first row and column chunk in a tile, K's and V's row strides in words, and
        # where its chunks sit in a tile (32 bits: block_k rows of a stride below 2^22 words, see _launch.py)
        copy_row, copy_col = tid // U(CPR), (tid % U(CPR)) * U(4)
        kstride, vstride = U(kh.strides[0]) // U(4), U(vh.strides[0]) // U(4)
        k_in, v_in = uint32(copy_row * kstride + copy_col), uint32(copy_row * vstride + copy_col)
        k_step, v_step = uint32(U(RSTEP) * kstride), uint32(U(RSTEP) * vstride)
        kbuf = cuda.local.array(LOADS, DT)  # the synchronous copy's words in flight (ASYNC: unused)
        vbuf = cuda.local.array(LOADS, DT)
        for j in range(n_tiles + U(LAG)):
            cuda.syncthreads()  # everyone is done with the stage this copy overwrites
            if j < n_tiles:  # copy K/V tile j to stage j % 2; rows past Nk become zeros (0 * garbage = NaN)
                kc, st = k_begin + j * UBK, (j % U(2)) * U(STAGE) if ASYNC else U(0)
                if LINEAR:  # this thread copies chunk copy_col of rows copy_row, copy_row + RSTEP, ...
                    kbase, vbase = kc * kstride, kc * vstride  # the tile's first element, once per tile
                    for it in range(CHUNK_ITERS):
                        row = copy_row + U(it * RSTEP)
                        if CHUNKS_EVEN or row < UBK:
                            ok = kc + row < nk
                            nbytes = 16 if ok else 0
                            dst = st + row * URS + copy_col
                            # 32-bit offsets in the tile (rows past Nk read the tile's first row, with 0 bytes)
                            kat = uint32(k_in + uint32(it) * k_step) if ok else uint32(copy_col)
                            vat = uint32(v_in + uint32(it) * v_step) if ok else uint32(copy_col)
                            mma.cp_async16_flat(sh, dst, kh, kbase, kat, nbytes)
                            mma.cp_async16_flat(sh, dst + U(VO), vh, vbase, vat, nbytes)
                elif ASYNC:  # 16 bytes per copy; consecutive threads take consecutive chunks of a row
                    for it in range(CHUNK_ITERS):
                        e = U(it * NT) + tid
                        if CHUNKS_EVEN or e < U(CHUNKS):
                            row, col = e // U(CPR), (e % U(CPR)) * U(4)
                            ok = kc + row < nk
                            src = kc + row if ok else U(0)
                            if PAGED and ok:  # key src lives in page block_table[b, src // page]
                                src = U(n_k[b, U(1) + src // UPAGE]) * UPAGE + src % UPAGE
                            nbytes = 16 if ok else 0
                            mma.cp_async16(sh, st + row * URS + col, kh, src, col, nbytes)
                            mma.cp_async16(sh, st + U(VO) + row * URS + col, vh, src, col, nbytes)
                else:  # all loads first, then all stores: the loads are in flight together
                    for it in range(LOADS):
                        e = min(U(it * NT) + tid, U(BK * W - 1))
                        src = min(kc + e // UW, nk - U(1))
                        if PAGED:
                            src = U(n_k[b, U(1) + src // UPAGE]) * UPAGE + src % UPAGE
                        kbuf[it], vbuf[it] = kh[src, e % UW], vh[src, e % UW]
                    for it in range(LOADS):
                        e = U(it * NT) + tid
                        if LOADS_EVEN or e < U(BK * W):
                            row, col = e // UW, e % UW
                            ok = kc + row < nk
                            sh[row * URS + col] = kbuf[it] if ok else DT(0)
                            sh[U(VO) + row * URS + col] = vbuf[it] if ok else DT(0)
            if ASYNC:
                mma.cp_async_commit()
                if j == U(0):
                    continue
                mma.cp_async_wait(1)  # this thread's copies of tile j - 1 have landed ...
            cuda.syncthreads()  # ... and everyone's
            k0 = k_begin + (j - U(LAG)) * UBK
            KO = ((j - U(LAG)) % U(2)) * U(STAGE) if ASYNC else U(0)  # the stage tile j - LAG is in
            if CAUSAL and not EXTRA and k0 > w0 + U(WROWS - 1):
                continue  # every key of this tile is after all rows of this warp (warp-uniform)

            # S = Q K^T for this warp's 16 rows and the tile's BK keys.
            for n in range(MT * NTK):
                for j in range(4):
                    s[n, j] = 0.0
                    if SPLIT:  # (MT = 1)
                        s2[n, j] = 0.0
            for ks in range(KSTEPS):
                if WIDE:
                    a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
                    if SPLIT:
                        a0b, a1b, a2b, a3b = mma.round_tf32(a0), mma.round_tf32(a1), mma.round_tf32(a2), \
                            mma.round_tf32(a3)
                        a0s, a1s = mma.round_tf32(a0 - a0b), mma.round_tf32(a1 - a1b)
                        a2s, a3s = mma.round_tf32(a2 - a2b), mma.round_tf32(a3 - a3b)
                    for n in range(NTK):  # B fragment: b0 = K[key n*8+g][dim 8ks+t], b1 = ... dim + 4
                        base = KO + U(n * 8) * URS + g * URS + U(8 * ks) + t
                        b0, b1 = sh[base], sh[base + U(4)]
                        c0, c1, c2, c3 = s[n, 0], s[n, 1], s[n, 2], s[n, 3]
                        if SPLIT:  # big*big in s; the two correction products in s2 (two independent chains)
                            b0b, b1b = mma.round_tf32(b0), mma.round_tf32(b1)
                            b0s, b1s = mma.round_tf32(b0 - b0b), mma.round_tf32(b1 - b1b)
                            e0, e1, e2, e3 = s2[n, 0], s2[n, 1], s2[n, 2], s2[n, 3]
                            e0, e1, e2, e3 = mma.mma_tf32_m16n8k8(a0s, a1s, a2s, a3s, b0b, b1b, e0, e1, e2, e3)
                            e0, e1, e2, e3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0s, b1s, e0, e1, e2, e3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0b, b1b, c0, c1, c2, c3)
                            s2[n, 0], s2[n, 1], s2[n, 2], s2[n, 3] = e0, e1, e2, e3
                        else:
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                        s[n, 0], s[n, 1], s[n, 2], s[n, 3] = c0, c1, c2, c3
                else:
                    for n2 in range(NTK // 2):  # ldmatrix: two n-tiles' B fragments (b0, b1) at once
                        # lane 8i + r gives row r of matrix i: key n2*16 + (i//2)*8 + r, words 8ks + (i%2)*4
                        key = U(n2 * 16) + (lane // U(16)) * U(8) + lane % U(8)
                        word = U(8 * ks) + ((lane // U(8)) % U(2)) * U(4)
                        b00, b01, b10, b11 = mma.ldmatrix_x4(sh, KO + key * URS + word)
                        for mt in range(MT):  # each fragment read feeds every m-tile of the warp
                            qi = mt * QREGS + 4 * ks
                            for half in range(2):
                                n = mt * NTK + 2 * n2 + half
                                b0, b1 = (b00, b01) if half == 0 else (b10, b11)
                                s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma16(
                                    qf[qi], qf[qi + 1], qf[qi + 2], qf[qi + 3], b0, b1,
                                    s[n, 0], s[n, 1], s[n, 2], s[n, 3])

            # Mask keys past Nk and, under causal, keys after the row (only tiles at an edge need it).
            if not EXTRA and (k0 + UBK > nk or (CAUSAL and k0 + UBK > w0 + U(1))):
                for mt in range(MT):
                    for n in range(NTK):
                        for j in range(4):
                            row = w0 + g + U(16 * mt + 8 * (j // 2))
                            col = k0 + U(n * 8) + U(2) * t + U(j % 2)
                            if col >= nk or (CAUSAL and col > row):
                                s[mt * NTK + n, j] = NEG

            if SPLIT:
                for n in range(NTK):
                    for j in range(4):
                        s[n, j] += s2[n, j]
            if EXTRA:  # softcap, ALiBi, then the aligned causal/window mask, on every tile (after 3xTF32's sum)
                for mt in range(MT):
                    for n in range(NTK):
                        for j in range(4):
                            pos = I(w0 + g + U(16 * mt + 8 * (j // 2))) + off
                            col = I(k0 + U(n * 8) + U(2) * t + U(j % 2))
                            val, _ = capped(s[mt * NTK + n, j], pos, col, capr, slope)
                            s[mt * NTK + n, j] = NEG if outside(pos, col, I(nk), RIGHT) else val

            # Online softmax on the C fragments: in each m-tile, rows g (j = 0, 1) and g + 8 (j = 2, 3).
            for mt in range(MT):
                grew = False  # did the max of one of this lane's two rows grow?
                for r in range(2):
                    rr, n0 = 2 * mt + r, mt * NTK
                    mx = s[n0, 2 * r]
                    for n in range(NTK):
                        mx = max(mx, max(s[n0 + n, 2 * r], s[n0 + n, 2 * r + 1]))
                    mx = max(mx, mma.shfl_xor(mx, 1))  # the row's 4 lanes (t = 0..3) agree on its max
                    mx = max(mx, mma.shfl_xor(mx, 2))
                    m_new = max(m[rr], mx)
                    grew |= m_new > m[rr]
                    alpha[rr] = math.exp2((m[rr] - m_new) * scale_log2)
                    m[rr] = m_new
                    offset = m_new * scale_log2
                    if GUARD and m_new < HALF_NEG:
                        # every key so far is masked. With offset = m_new * scale, the fused multiply-add below
                        # leaves NEG * scale's rounding error (up to ~1e22 at d = 64), so p would be 1 or inf
                        # (and inf * 0 = NaN): offset 0 makes every p exp2(NEG * scale) = 0.
                        offset = float32(0.0)
                    row_sum = float32(0.0)
                    for n in range(NTK):
                        for c in range(2):
                            p = math.exp2(s[n0 + n, 2 * r + c] * scale_log2 - offset)
                            row_sum += p
                            if DROP:  # after the row sum: l and lse are dropout-free, only P V sees the mask
                                # key k0 + 8n + 2t + c in 32 bits: the hash reads only those, and 64-bit keys
                                # spilled (28 bytes at 3xTF32 d = 128 with a window)
                                p *= d_keep(zrow[rr], uint32(k0) + uint32(8 * n + c) + uint32(2) * uint32(t))
                            s[n0 + n, 2 * r + c] = p
                    l[rr] = l[rr] * alpha[rr] + row_sum  # the quad's partial sums are added once, at the end
                # O's rows of the m-tile are rescaled only if some row's max grew: otherwise every alpha is
                # exp2(0) = 1, and the warp skips the multiplies together (one vote, no divergence)
                if not SPLIT and mma.vote_any(grew):
                    for n in range(mt * NTD, (mt + 1) * NTD):
                        for r in range(2):
                            acc[n, 2 * r] *= alpha[2 * mt + r]
                            acc[n, 2 * r + 1] *= alpha[2 * mt + r]

            # O += P V, with P straight from registers. For tf32, k-step kk is n-tile kk of S with its keys
            # renumbered (column t <- key 2t, column t+4 <- key 2t+1), and V's rows renumbered the same way.
            if SPLIT:
                # 3xTF32: P = big + small. A tensor-core accumulator does not round like fp32 adds, and over
                # thousands of keys its error grows to ~3e-5; so each tile's P V is summed on tensor cores from
                # zero, and added to O with an fp32 FMA (O = alpha * O + tile).
                for kk in range(PSTEPS):
                    for j in range(4):
                        pb = mma.round_tf32(s[kk, j])
                        s2[kk, j] = mma.round_tf32(s[kk, j] - pb)
                        s[kk, j] = pb
                for n0 in range(0, NTD, NG):  # NG n-tiles at a time: NG independent chains, 4 NG registers
                    for nn in range(NG):
                        for j in range(4):
                            part[nn, j] = 0.0
                    for kk in range(PSTEPS):  # b0 = V[key 8kk+2t][dim 8n+g], b1 = V[key 8kk+2t+1][same dim]
                        for nn in range(NG):
                            base = KO + U(VO) + (U(8 * kk) + U(2) * t) * URS + U(8 * (n0 + nn)) + g
                            b0, b1 = sh[base], sh[base + URS]
                            b0b, b1b = mma.round_tf32(b0), mma.round_tf32(b1)
                            b0s, b1s = mma.round_tf32(b0 - b0b), mma.round_tf32(b1 - b1b)
                            c0, c1, c2, c3 = part[nn, 0], part[nn, 1], part[nn, 2], part[nn, 3]
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(s2[kk, 0], s2[kk, 2], s2[kk, 1], s2[kk, 3],
                                                                  b0b, b1b, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3],
                                                                  b0s, b1s, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3],
                                                                  b0b, b1b, c0, c1, c2, c3)
                            part[nn, 0], part[nn, 1], part[nn, 2], part[nn, 3] = c0, c1, c2, c3
                    for nn in range(NG):
                        for j in range(4):
                            acc[n0 + nn, j] = acc[n0 + nn, j] * alpha[j // 2] + part[nn, j]
            for kk in range(0 if SPLIT else PSTEPS):
                if WIDE:  # 1xTF32
                    a0, a1, a2, a3 = s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3]
                    for n in range(NTD):
                        base = KO + U(VO) + (U(8 * kk) + U(2) * t) * URS + U(8 * n) + g
                        c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, sh[base], sh[base + URS],
                                                              acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
                        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = c0, c1, c2, c3
                else:  # k-step kk = n-tiles 2kk and 2kk+1 of S, packed to 16 bits: the A fragment
                    for mt in range(MT):
                        n = mt * NTK + 2 * kk
                        pa[4 * mt] = pack(s[n, 0], s[n, 1])
                        pa[4 * mt + 1] = pack(s[n, 2], s[n, 3])
                        pa[4 * mt + 2] = pack(s[n + 1, 0], s[n + 1, 1])
                        pa[4 * mt + 3] = pack(s[n + 1, 2], s[n + 1, 3])
                    for n2 in range(NTD // 2):  # ldmatrix.trans: V's B fragments of two 8-dim n-tiles
                        # lane 8i + r: row r of matrix i = key 16kk + (i%2)*8 + r, words of dims 16n2 + (i//2)*8
                        key = U(16 * kk) + ((lane // U(8)) % U(2)) * U(8) + lane % U(8)
                        word = U(8 * n2) + (lane // U(16)) * U(4)
                        b00, b01, b10, b11 = mma.ldmatrix_x4_trans(sh, KO + U(VO) + key * URS + word)
                        for mt in range(MT):
                            a0, a1, a2, a3 = pa[4 * mt], pa[4 * mt + 1], pa[4 * mt + 2], pa[4 * mt + 3]
                            for half in range(2):
                                n = mt * NTD + 2 * n2 + half
                                b0, b1 = (b00, b01) if half == 0 else (b10, b11)
                                acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma16(
                                    a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])

        # Add up each row's sum over its quad, normalise once, write O and lse.
        if VARLEN:
            oh, lh = o[cq:cq + nq, h], lse[h, cq:cq + nq]
        else:
            oh_ = h * n_parts + kpart if SPLIT_KV else h  # split: (B, H * splits, ...) views of the partial outputs
            oh, lh = o[b, oh_], lse[b, oh_]
        for rr in range(2 * MT):  # row rr of this lane: m-tile rr // 2, half r = rr % 2
            r = rr % 2
            total = l[rr]
            total += mma.shfl_xor(total, 1)
            total += mma.shfl_xor(total, 2)
            row = w0 + g + U(8 * rr)
            if row < nq:
                inv = float32(0.0)  # GUARD: the row sees no key of this chunk (total = 0)
                row_lse = float32(NEG)
                if (EXTRA or VARLEN) and not SPLIT_KV:
                    row_lse = INF  # no key at all: the FA library's o = 0, lse = +inf
                if not GUARD or total > float32(0.0):
                    inv = float32(1.0) / total
                    row_lse = (m[rr] * scale_log2 + math.log2(total)) * LN2
                for n in range(NTD):
                    x0, x1 = acc[(rr // 2) * NTD + n, 2 * r] * inv, acc[(rr // 2) * NTD + n, 2 * r + 1] * inv
                    if WIDE or SPLIT_KV:  # float32 outputs (split: the partial outputs are float32)
                        oh[row, U(8 * n) + U(2) * t] = x0
                        oh[row, U(8 * n) + U(2) * t + U(1)] = x1
                    else:
                        oh[row, U(4 * n) + t] = pack(x0, x1)
                if t == U(0):
                    lh[row] = row_lse

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


def launch(q, k, v, o, lse, n_heads, scale, causal, tile: TensorTile, precision: str, *, splits: int = 1,
           heavy_first: bool = False, section=None, alloc=None, extras=None, seed=0):
    """Launch on device arrays: (B, H, N, d/2) uint32 pairs for 16-bit precisions, float32 otherwise.
    splits > 1 (float16 and float32 only): split-KV, o's pairs are written by the merge kernel as float16;
    heavy_first: see split_kv.grid. seed: the dropout seed (used when extras has dropout_p > 0)."""
    B, H, Nq, w = q.shape
    d = w if precision in ("3xtf32", "tf32") else 2 * w
    splits = split_chunk(k.shape[2], splits, tile.block_k)[1]
    split = splits > 1
    if split and precision == "bf16":
        raise ValueError("split-KV writes its merged output as float16 or float32; bfloat16 runs with splits=1")
    kernel = build(d, tile, causal, precision, split=split, heavy_first=heavy_first, gqa=k.shape[1] != H,
                   extras=extras)
    g = grid(B, H, Nq, tile.block_q, splits, heavy_first, section)
    scale_log2 = np.float32(scale * LOG2E)
    if not split:
        kernel[g, tile.threads](q, k, v, o, lse, Nq, k.shape[2], n_heads, scale_log2, seed)
        return kernel
    out = o if precision in ("3xtf32", "tf32") else o.view(np.float16)  # the merge writes values, not pairs
    merge_split(lambda o_part, lse_part: kernel[g, tile.threads](q, k, v, o_part, lse_part, Nq, k.shape[2], n_heads,
                                                                 scale_log2, seed), out, lse, splits, alloc)
    return kernel
