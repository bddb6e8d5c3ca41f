"""variant="tensor": FlashAttention-2 forward on tensor cores, from pure-Python Numba (lesson 16).

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
Three more builds: features (the library's window, alignment, ALiBi, softcap and dropout, options.Features,
as in the register kernel), page (K/V read through a paged cache's block table, for kernels/paged.py's decoding)
and varlen (one launch over sequences packed along one axis, as the register kernel's varlen build:
kernels/varlen.py). Every build takes the same arguments: the options' values (left, right, cap, slopes), then
the dropout seed (a runtime int64: a new seed needs no new compile); builds without them ignore them.

The code, as it reads: `traits` derives a build's tile constants once; `steps` binds one device function per
step (where a block works, Q's fragments, the K/V copy, S = QK^T, the mask, the online softmax, O += PV, the
finish), choosing each precision's and option's variant at build time; the kernel body (`_kernel`) calls them
in order, inlined by Numba. `float16_source()` prints the float16 path alone (lesson 16), and `launches` describes
a call's launches once for the general path and the prepared one (kernels/prepared.py).

Where FlashAttention-2 itself goes further: 128-key tiles at d = 64, larger query blocks (two m-tiles per warp
at d <= 128; at d = 192 and 256 one, with 8 warps or 64-row blocks: `run_mha_fwd_hdim*`), 16-bit inputs only, up
to 227 KB of shared memory per block (this forward uses 48 KB of static shared memory), and CUDA C++ compiled
ahead of time; on Hopper, FA3 replaces mma.sync with wgmma and cp.async with TMA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numba import config, float32, uint32, uint64

from ..device import get_cuda
from ..dropout import device_functions as dropout_functions
from . import mma
from ._launch import Arg, Launch, Launches
from .common import FASTMATH, LN2, LOG2E, NEG, I, U
from .options import EMPTY_LSE, EMPTY_PARTIAL, PLAIN, Extras, Features, argument_types, device_functions
from .split_kv import build_merge, forward_functions, forward_launches, grid, split_chunk

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs
I32 = np.int32  # a tile's own columns

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


class Traits(NamedTuple):
    """The tile constants of one build, derived once from (d, tile, precision, paged). A lane's row (mt, r) is
    w0 + g + 16 mt + 8 r; the local arrays index it as 2 mt + r, and m-tile mt's n-tiles as mt * NTK + n (S) and
    mt * NTD + n (O). Local arrays need compile-time sizes, hence the products below."""
    WIDE: bool  # float32 inputs (tf32, 3xTF32): one value per 32-bit word; 16-bit inputs come as pairs
    TF32X3: bool  # 3xTF32: each fp32 operand as big + small tf32
    MT: int  # m-tiles of 16 rows per warp
    BK: int  # keys per K/V tile (block_k)
    BQ: int  # rows per block (block_q)
    NT: int  # threads per block
    WROWS: int  # rows per warp: m-tile mt holds rows 16 mt .. 16 mt + 15 of them
    W: int  # 32-bit words per row of Q, K, V, O
    RS: int  # padded shared row stride, in words
    KSTEPS: int  # k-steps of S = Q K^T (k = 8 for tf32, 16 for 16-bit)
    NTK: int  # n-tiles of S (8 keys each)
    NTD: int  # n-tiles of O (8 dims each)
    PSTEPS: int  # k-steps of O += P V
    NG: int  # 3xTF32: n-tiles of O whose tile sums are built together (fewer at d = 128: registers)
    QREGS: int  # Q's A-fragment words per m-tile
    ASYNC: bool  # cp.async with two stages (sm_80+); the sm_75 build copies through registers
    LAG: int  # tile j's copies are issued this many iterations before tile j is used
    STAGE: int  # words of one stage: K tile, then V tile
    SH: int  # words of shared memory
    VO: int  # V's offset in a stage
    CPR: int  # 16-byte chunks per row (async copies)
    CHUNK_ITERS: int  # chunks per thread
    CHUNKS_EVEN: bool  # the threads divide the chunks evenly
    LINEAR: bool  # copies walk down the tile by RSTEP rows, each thread keeping its column chunk
    RSTEP: int
    LOADS: int  # words per thread (copies through registers)
    LOADS_EVEN: bool


def traits(d: int, tile: TensorTile, precision: str, paged: bool) -> Traits:
    wide = precision in ("3xtf32", "tf32")
    mt, bk, nt = tile.m_tiles, tile.block_k, tile.threads
    w = d if wide else d // 2
    rs = w + 4
    ntd = d // 8
    asyn = stages(precision) == 2
    cpr = w // 4
    return Traits(
        WIDE=wide, TF32X3=precision == "3xtf32", MT=mt, BK=bk, BQ=tile.block_q, NT=nt, WROWS=16 * mt, W=w, RS=rs,
        KSTEPS=d // 8 if wide else d // 16, NTK=bk // 8, NTD=ntd, PSTEPS=bk // 8 if wide else bk // 16,
        NG=min(4 if d <= 64 else 2, ntd), QREGS=4 * (d // 8 if wide else d // 16), ASYNC=asyn, LAG=1 if asyn else 0,
        STAGE=2 * bk * rs, SH=stages(precision) * 2 * bk * rs, VO=bk * rs, CPR=cpr,
        CHUNK_ITERS=-(-(bk * cpr) // nt), CHUNKS_EVEN=(bk * cpr) % nt == 0,
        # source offsets then grow by a constant (a paged cache finds each row through the block table instead)
        LINEAR=asyn and nt % cpr == 0 and not paged, RSTEP=nt // cpr,
        LOADS=-(-(bk * w) // nt), LOADS_EVEN=(bk * w) % nt == 0)


def _step(fn):
    """A step of the kernel: inlined into it by Numba (no call), under the kernel's fastmath flags."""
    return cuda.jit(device=True, inline="always", fastmath=FASTMATH)(fn)


@_step
def _no_dropout(zrow, seed, b, h, w0, g):
    return


# ------------------------------------------------------------------------------------------- where a block works
def _place(T: Traits, gqa: bool, paged: bool, varlen: bool, query_block):
    """place(q, k, v, n_q, n_k, n_heads) -> (b, h, q0, part, n_parts, cq, nq, nk, Q, K, V): the block's batch (or
    sequence), query head, first row and key chunk, and its head's rows of Q, K and V."""
    GQA = gqa

    @_step
    def place_batched(q, k, v, n_q, n_k, n_heads):
        q0, bh, part, n_parts = query_block(q.shape[0], n_heads)
        b, h = bh // U(n_heads), bh % U(n_heads)
        return b, h, q0, part, n_parts, U(0), U(n_q), U(n_k), q[b, h], k[b, h], v[b, h]

    @_step
    def place_grouped(q, k, v, n_q, n_k, n_heads):
        # query head h reads K/V head h // (H / H_kv): a build of its own, so MHA's code is unchanged
        q0, bh, part, n_parts = query_block(q.shape[0], n_heads)
        b, h = bh // U(n_heads), bh % U(n_heads)
        hk = h * U(k.shape[1]) // U(n_heads)
        return b, h, q0, part, n_parts, U(0), U(n_q), U(n_k), q[b, h], k[b, hk], v[b, hk]

    @_step
    def place_paged(q, k, v, n_q, n_k, n_heads):
        # sequence b's own length; its keys are rows of the cache found through the block table
        q0, bh, part, n_parts = query_block(q.shape[0], n_heads)
        b, h = bh // U(n_heads), bh % U(n_heads)
        return b, h, q0, part, n_parts, U(0), U(n_q), U(n_k[b, 0]), q[b, h], k[:, h], v[:, h]

    @_step
    def place_packed(q, k, v, n_q, n_k, n_heads):
        # block x: (sequence b, first row q0) from the table; its rows and keys from cu_seqlens, as views
        b, h = U(n_q[cuda.blockIdx.x, 0]), U(cuda.blockIdx.y)
        q0, cq, ck = U(n_q[cuda.blockIdx.x, 1]), U(n_k[0, b]), U(n_k[1, b])
        hk = h
        if GQA:
            hk = h * U(k.shape[1]) // U(n_heads)
        nq, nk = U(n_k[0, b + U(1)]) - cq, U(n_k[1, b + U(1)]) - ck
        return b, h, q0, U(0), U(1), cq, nq, nk, q[cq:cq + nq, h], k[ck:ck + nk, hk], v[ck:ck + nk, hk]

    return place_packed if varlen else place_paged if paged else place_grouped if gqa else place_batched


def _out_views(split: bool, varlen: bool):
    """out_views(o, lse, b, h, part, n_parts, cq, nq) -> the rows of O and lse this block writes."""

    @_step
    def out_batched(o, lse, b, h, part, n_parts, cq, nq):
        return o[b, h], lse[b, h]

    @_step
    def out_split(o, lse, b, h, part, n_parts, cq, nq):  # (B, H * splits, ...) views of the partial outputs
        return o[b, h * n_parts + part], lse[b, h * n_parts + part]

    @_step
    def out_packed(o, lse, b, h, part, n_parts, cq, nq):
        return o[cq:cq + nq, h], lse[h, cq:cq + nq]

    return out_packed if varlen else out_split if split else out_batched


def _option_values(f: Features):
    """option_values(cap, slopes, b, h, n_heads, scale_log2) -> (cap, slope) in S's units: S stays raw here (the
    scale is applied in exp2), so the softcap and slopes, given in log2 units, are divided by the scale."""
    ALIBI = f.alibi
    ZERO = float32(0.0)

    @_step
    def option_values(cap, slopes, b, h, n_heads, scale_log2):
        slope = ZERO
        if ALIBI:
            slope = slopes[b * U(n_heads) + h] / scale_log2
        return cap / scale_log2, slope

    @_step
    def no_values(cap, slopes, b, h, n_heads, scale_log2):
        return ZERO, ZERO

    return option_values if f.per_score else no_values


def _tile_count(T: Traits, cut: bool):
    """tile_count(k_begin, k_end): the key tiles a block visits (cut: k_begin may be past 0, or past k_end)."""
    UBK = U(T.BK)

    @_step
    def tiles_from_zero(k_begin, k_end):
        return (k_end + UBK - U(1)) // UBK

    @_step
    def tiles_between(k_begin, k_end):
        return (k_end - k_begin + UBK - U(1)) // UBK if k_end > k_begin else U(0)

    return tiles_between if cut else tiles_from_zero


# ----------------------------------------------------------------------------------------------- Q and the rows
def _load_q(T: Traits):
    MT, KSTEPS, QREGS, DT = T.MT, T.KSTEPS, T.QREGS, float32 if T.WIDE else uint32

    @_step
    def load_q(qf, qh, w0, g, t, nq):
        """Q's A fragments, kept in registers for the whole loop: in m-tile mt, rows w0+16mt+g and w0+16mt+g+8
        (zeros past Nq)."""
        for mt in range(MT):
            for ks in range(KSTEPS):
                for j in range(4):  # a0: (g, c)  a1: (g+8, c)  a2: (g, c+4)  a3: (g+8, c+4), c = word t
                    row = w0 + g + U(16 * mt + 8 * (j % 2))
                    col = U(8 * ks) + t + U(4 * (j // 2))
                    qf[mt * QREGS + 4 * ks + j] = qh[row, col] if row < nq else DT(0)

    return load_q


def _start_rows(T: Traits):
    MT, NTD = T.MT, T.NTD

    @_step
    def start_rows(m, l, acc):
        for r in range(2 * MT):
            m[r] = NEG
            l[r] = 0.0
        for n in range(MT * NTD):
            for j in range(4):
                acc[n, j] = 0.0

    return start_rows


def _start_dropout(T: Traits, d_start, d_mix):
    MT = T.MT

    @_step
    def start_dropout(zrow, seed, b, h, w0, g):
        """Each row's hash state: keyed by (seed, batch, query head, row, col) as flashlab.dropout, with
        (seed, b, h) hashed once per block."""
        zh = d_start(seed, b, h)
        for r in range(2 * MT):
            zrow[r] = d_mix(zh, w0 + g + U(8 * r))

    return start_dropout


# ------------------------------------------------------------------------------------------ K and V to shared
def _copies(T: Traits, page: int):
    """copy_start(tid, kh, vh) -> what a thread's copies reuse; copy_tile(sh, j, kc, kh, vh, nk, tid, cs, kbuf,
    vbuf, n_k, b): tile j (keys kc ...) into stage j % 2, rows past Nk as zeros (0 * garbage = NaN);
    landed(j) -> is tile j - LAG in shared memory (after the barrier that follows)?"""
    BK, NT, W, CPR, RSTEP = T.BK, T.NT, T.W, T.CPR, T.RSTEP
    UW, URS, UBK, UVO, USTAGE = U(T.W), U(T.RS), U(T.BK), U(T.VO), U(T.STAGE)
    CHUNK_ITERS, CHUNKS_EVEN, CHUNKS, LOADS, LOADS_EVEN = T.CHUNK_ITERS, T.CHUNKS_EVEN, BK * CPR, T.LOADS, T.LOADS_EVEN
    PAGED, UPAGE, DT = page > 0, U(max(page, 1)), float32 if T.WIDE else uint32

    @_step
    def copy_start(tid, kh, vh):
        # this thread's first row and column chunk in a tile, K's and V's row strides in words, and where its chunks
        # sit in a tile (32 bits: block_k rows of a stride below 2^22 words, see _launch.py)
        copy_row, copy_col = tid // U(CPR), (tid % U(CPR)) * U(4)
        kstride, vstride = U(kh.strides[0]) // U(4), U(vh.strides[0]) // U(4)
        k_in, v_in = uint32(copy_row * kstride + copy_col), uint32(copy_row * vstride + copy_col)
        k_step, v_step = uint32(U(RSTEP) * kstride), uint32(U(RSTEP) * vstride)
        return copy_row, copy_col, kstride, vstride, k_in, v_in, k_step, v_step

    @_step
    def copy_linear(sh, j, kc, kh, vh, nk, tid, cs, kbuf, vbuf, n_k, b):
        """cp.async, 16 bytes per copy: this thread copies chunk copy_col of rows copy_row, copy_row + RSTEP, ..."""
        copy_row, copy_col, kstride, vstride, k_in, v_in, k_step, v_step = cs
        st = (j % U(2)) * USTAGE
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
                mma.cp_async16_flat(sh, dst + UVO, vh, vbase, vat, nbytes)

    @_step
    def copy_rows(sh, j, kc, kh, vh, nk, tid, cs, kbuf, vbuf, n_k, b):
        """cp.async, 16 bytes per copy; consecutive threads take consecutive chunks of a row (a paged cache finds
        each row through the block table)."""
        st = (j % U(2)) * USTAGE
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
                mma.cp_async16(sh, st + UVO + row * URS + col, vh, src, col, nbytes)

    @_step
    def copy_sync(sh, j, kc, kh, vh, nk, tid, cs, kbuf, vbuf, n_k, b):
        """sm_75 (no cp.async): all loads first, then all stores, so the loads are in flight together."""
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
                sh[UVO + row * URS + col] = vbuf[it] if ok else DT(0)

    @_step
    def landed_async(j):
        mma.cp_async_commit()
        if j == U(0):
            return False  # tile 0 is in flight; tile 1's copy starts next
        mma.cp_async_wait(1)  # this thread's copies of tile j - 1 have landed (the barrier: everyone's)
        return True

    @_step
    def landed_sync(j):
        return True

    @_step
    def stage_async(j):
        return ((j - U(1)) % U(2)) * USTAGE  # the stage tile j - 1 is in

    @_step
    def stage_one(j):
        return U(0)

    copy = copy_linear if T.LINEAR else copy_rows if T.ASYNC else copy_sync
    return copy_start, copy, landed_async if T.ASYNC else landed_sync, stage_async if T.ASYNC else stage_one


# ---------------------------------------------------------------------------------------------------- S = Q K^T
def _scores(T: Traits, mma16):
    """scores(s, s2, qf, sh, KO, lane, g, t): S = Q K^T for this warp's rows and the tile's keys, as C fragments
    (3xTF32: the big * big products in s, the two correction products in s2)."""
    MT, NTK, KSTEPS, QREGS, URS = T.MT, T.NTK, T.KSTEPS, T.QREGS, U(T.RS)

    @_step
    def scores_16bit(s, s2, qf, sh, KO, lane, g, t):
        for n in range(MT * NTK):
            for j in range(4):
                s[n, j] = 0.0
        for ks in range(KSTEPS):
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

    @_step
    def scores_tf32(s, s2, qf, sh, KO, lane, g, t):
        for n in range(NTK):
            for j in range(4):
                s[n, j] = 0.0
        for ks in range(KSTEPS):
            a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
            for n in range(NTK):  # B fragment: b0 = K[key n*8+g][dim 8ks+t], b1 = ... dim + 4
                base = KO + U(n * 8) * URS + g * URS + U(8 * ks) + t
                c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, sh[base], sh[base + U(4)],
                                                      s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                s[n, 0], s[n, 1], s[n, 2], s[n, 3] = c0, c1, c2, c3

    @_step
    def scores_3xtf32(s, s2, qf, sh, KO, lane, g, t):
        for n in range(NTK):
            for j in range(4):
                s[n, j] = 0.0
                s2[n, j] = 0.0
        for ks in range(KSTEPS):
            a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
            a0b, a1b, a2b, a3b = mma.round_tf32(a0), mma.round_tf32(a1), mma.round_tf32(a2), mma.round_tf32(a3)
            a0s, a1s = mma.round_tf32(a0 - a0b), mma.round_tf32(a1 - a1b)
            a2s, a3s = mma.round_tf32(a2 - a2b), mma.round_tf32(a3 - a3b)
            for n in range(NTK):  # B fragment: b0 = K[key n*8+g][dim 8ks+t], b1 = ... dim + 4
                base = KO + U(n * 8) * URS + g * URS + U(8 * ks) + t
                b0, b1 = sh[base], sh[base + U(4)]
                c0, c1, c2, c3 = s[n, 0], s[n, 1], s[n, 2], s[n, 3]
                # big*big in s; the two correction products in s2 (two independent chains)
                b0b, b1b = mma.round_tf32(b0), mma.round_tf32(b1)
                b0s, b1s = mma.round_tf32(b0 - b0b), mma.round_tf32(b1 - b1b)
                e0, e1, e2, e3 = s2[n, 0], s2[n, 1], s2[n, 2], s2[n, 3]
                e0, e1, e2, e3 = mma.mma_tf32_m16n8k8(a0s, a1s, a2s, a3s, b0b, b1b, e0, e1, e2, e3)
                e0, e1, e2, e3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0s, b1s, e0, e1, e2, e3)
                c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0b, a1b, a2b, a3b, b0b, b1b, c0, c1, c2, c3)
                s2[n, 0], s2[n, 1], s2[n, 2], s2[n, 3] = e0, e1, e2, e3
                s[n, 0], s[n, 1], s[n, 2], s[n, 3] = c0, c1, c2, c3

    return scores_3xtf32 if T.TF32X3 else scores_tf32 if T.WIDE else scores_16bit


# ---------------------------------------------------------------------------------------------------- the mask
def _mask(T: Traits, causal: bool, f: Features):
    """mask(s, s2, k0, w0, g, t, nk, off, cap, slope, left, right): the keys a row may not see get NEG. Without
    per-score options only the tiles at an edge (past Nk, or crossing causal's diagonal) are masked; with them,
    every tile is transformed (softcap, ALiBi) and masked (the aligned causal/window band), after 3xTF32's sum."""
    MT, NTK, UBK = T.MT, T.NTK, U(T.BK)
    CAUSAL = causal
    capped, key_band = device_functions(f).capped, device_functions(f).key_band
    BK = T.BK

    @_step
    def mask_edges(s, k0, w0, g, t, nk):
        # options.outside without a window, top-left: past Nk or (causal) after the row; in the plain kernels'
        # unsigned positions (signed ones cost registers: ptxas sm_90)
        if k0 + UBK > nk or (CAUSAL and k0 + UBK > w0 + U(1)):
            for mt in range(MT):
                for n in range(NTK):
                    for j in range(4):
                        row = w0 + g + U(16 * mt + 8 * (j // 2))
                        col = k0 + U(n * 8) + U(2) * t + U(j % 2)
                        if col >= nk or (CAUSAL and col > row):
                            s[mt * NTK + n, j] = NEG

    @_step
    def mask_band(s, k0, w0, g, t, nk, off, cap, slope, left, right):
        # options.outside, as the band of keys each row sees (key_band), computed once per row and compared in the
        # tile's own 32-bit columns: per entry that is two compares (64-bit positions and run-time bounds per
        # entry spilled at d = 64: ptxas sm_90)
        for mt in range(MT):
            for r in range(2):
                pos = I(w0 + g + U(16 * mt + 8 * r)) + off
                lo, hi = key_band(pos, pos, I(nk), left, right)
                lo_t = I32(min(max(lo - I(k0), I(-1)), I(BK)))  # the row's band in this tile's columns
                hi_t = I32(min(max(hi - I(k0), I(-1)), I(BK)))
                pos_t = I32(pos - I(k0))  # ALiBi's distance |pos - key| in the same columns
                for n in range(NTK):
                    for c in range(2):
                        j = 2 * r + c
                        cc = I32(n * 8 + c) + I32(2) * I32(t)
                        val, _ = capped(s[mt * NTK + n, j], pos_t, cc, cap, slope)
                        s[mt * NTK + n, j] = NEG if cc < lo_t or cc >= hi_t else val

    @_step
    def add_small(s, s2):  # 3xTF32: S = big * big + the correction terms
        for n in range(NTK):
            for j in range(4):
                s[n, j] += s2[n, j]

    @_step
    def mask_plain(s, s2, k0, w0, g, t, nk, off, cap, slope, left, right):
        mask_edges(s, k0, w0, g, t, nk)

    @_step
    def mask_plain_3xtf32(s, s2, k0, w0, g, t, nk, off, cap, slope, left, right):
        mask_edges(s, k0, w0, g, t, nk)
        add_small(s, s2)

    @_step
    def mask_options(s, s2, k0, w0, g, t, nk, off, cap, slope, left, right):
        mask_band(s, k0, w0, g, t, nk, off, cap, slope, left, right)

    @_step
    def mask_options_3xtf32(s, s2, k0, w0, g, t, nk, off, cap, slope, left, right):
        add_small(s, s2)
        mask_band(s, k0, w0, g, t, nk, off, cap, slope, left, right)

    if f.per_score:
        return mask_options_3xtf32 if T.TF32X3 else mask_options
    return mask_plain_3xtf32 if T.TF32X3 else mask_plain


def _warp_done(T: Traits, causal: bool, f: Features):
    """warp_done(k0, w0): every key of this tile is after all rows of this warp (warp-uniform: the warp skips
    the tile together); plain causal builds only (the options' band already cut the tiles)."""
    LAST = U(T.WROWS - 1)

    @_step
    def past_the_diagonal(k0, w0):
        return k0 > w0 + LAST

    @_step
    def never(k0, w0):
        return False

    return past_the_diagonal if causal and not f.per_score else never


# ------------------------------------------------------------------------------------------- the online softmax
def _softmax(T: Traits, guard: bool, dropout: bool, d_keep):
    """softmax(s, m, l, alpha, acc, zrow, k0, t, scale_log2): on S's C fragments, in each m-tile rows g (j = 0, 1)
    and g + 8 (j = 2, 3); S becomes P, m and l move on, and O's rows are rescaled (3xTF32: in the P V step)."""
    MT, NTK, NTD = T.MT, T.NTK, T.NTD
    HALF_NEG, ZERO = float32(0.5 * NEG), float32(0.0)

    @_step
    def offset_guarded(m_new, scale_log2):
        offset = m_new * scale_log2
        if m_new < HALF_NEG:
            # every key so far is masked. With offset = m_new * scale, the fused multiply-add below leaves NEG *
            # scale's rounding error (up to ~1e22 at d = 64), so p would be 1 or inf (and inf * 0 = NaN): offset 0
            # makes every p exp2(NEG * scale) = 0.
            offset = ZERO
        return offset

    @_step
    def offset_plain(m_new, scale_log2):
        return m_new * scale_log2

    @_step
    def keep_dropout(p, z, k0, n, c, t):
        # after the row sum: l and lse are dropout-free, only P V sees the mask. Key k0 + 8n + 2t + c in 32 bits:
        # the hash reads only those, and 64-bit keys spilled (28 bytes at 3xTF32 d = 128 with a window)
        return p * d_keep(z, uint32(k0) + uint32(8 * n + c) + uint32(2) * uint32(t))

    @_step
    def keep_all(p, z, k0, n, c, t):
        return p

    @_step
    def rescale_o(acc, alpha, mt, grew):
        # O's rows of the m-tile are rescaled only if some row's max grew: otherwise every alpha is exp2(0) = 1,
        # and the warp skips the multiplies together (one vote, no divergence)
        if mma.vote_any(grew):
            for n in range(mt * NTD, (mt + 1) * NTD):
                for r in range(2):
                    acc[n, 2 * r] *= alpha[2 * mt + r]
                    acc[n, 2 * r + 1] *= alpha[2 * mt + r]

    @_step
    def rescale_later(acc, alpha, mt, grew):
        return

    row_offset = offset_guarded if guard else offset_plain
    keep = keep_dropout if dropout else keep_all
    rescale = rescale_later if T.TF32X3 else rescale_o

    @_step
    def softmax(s, m, l, alpha, acc, zrow, k0, t, scale_log2):
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
                offset = row_offset(m_new, scale_log2)
                row_sum = float32(0.0)
                for n in range(NTK):
                    for c in range(2):
                        p = math.exp2(s[n0 + n, 2 * r + c] * scale_log2 - offset)
                        row_sum += p
                        s[n0 + n, 2 * r + c] = keep(p, zrow[rr], k0, n, c, t)
                l[rr] = l[rr] * alpha[rr] + row_sum  # the quad's partial sums are added once, at the end
            rescale(acc, alpha, mt, grew)

    return softmax


# ---------------------------------------------------------------------------------------------------- O += P V
def _pv(T: Traits, mma16, pack):
    """pv(s, s2, acc, alpha, pa, part, sh, KO, lane, g, t): O += P V with P straight from registers. For tf32,
    k-step kk is n-tile kk of S with its keys renumbered (column t <- key 2t, column t+4 <- key 2t+1), and V's rows
    renumbered the same way."""
    MT, NTK, NTD, PSTEPS, NG = T.MT, T.NTK, T.NTD, T.PSTEPS, T.NG
    URS, UVO = U(T.RS), U(T.VO)

    @_step
    def pv_16bit(s, s2, acc, alpha, pa, part, sh, KO, lane, g, t):
        for kk in range(PSTEPS):  # k-step kk = n-tiles 2kk and 2kk+1 of S, packed to 16 bits: the A fragment
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
                b00, b01, b10, b11 = mma.ldmatrix_x4_trans(sh, KO + UVO + key * URS + word)
                for mt in range(MT):
                    a0, a1, a2, a3 = pa[4 * mt], pa[4 * mt + 1], pa[4 * mt + 2], pa[4 * mt + 3]
                    for half in range(2):
                        n = mt * NTD + 2 * n2 + half
                        b0, b1 = (b00, b01) if half == 0 else (b10, b11)
                        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma16(
                            a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])

    @_step
    def pv_tf32(s, s2, acc, alpha, pa, part, sh, KO, lane, g, t):
        for kk in range(PSTEPS):
            a0, a1, a2, a3 = s[kk, 0], s[kk, 2], s[kk, 1], s[kk, 3]
            for n in range(NTD):
                base = KO + UVO + (U(8 * kk) + U(2) * t) * URS + U(8 * n) + g
                c0, c1, c2, c3 = mma.mma_tf32_m16n8k8(a0, a1, a2, a3, sh[base], sh[base + URS],
                                                      acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
                acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = c0, c1, c2, c3

    @_step
    def pv_3xtf32(s, s2, acc, alpha, pa, part, sh, KO, lane, g, t):
        # P = big + small. A tensor-core accumulator does not round like fp32 adds, and over thousands of keys its
        # error grows to ~3e-5; so each tile's P V is summed on tensor cores from zero, and added to O with an fp32
        # FMA (O = alpha * O + tile).
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
                    base = KO + UVO + (U(8 * kk) + U(2) * t) * URS + U(8 * (n0 + nn)) + g
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

    return pv_3xtf32 if T.TF32X3 else pv_tf32 if T.WIDE else pv_16bit


# ------------------------------------------------------------------------------------------------------ finish
def _finish(T: Traits, guard: bool, split: bool, pack):
    """finish(oh, lh, l, m, acc, w0, g, t, nq, scale_log2): add up each row's sum over its quad, normalise once,
    write O and lse. A row that saw no key (guard) gets o = 0 and lse = +inf (NEG for a split-KV chunk's partial
    row, which the merge then ignores), as options.row_end; lse is computed only for a row that saw a key."""
    MT, NTD = T.MT, T.NTD
    EMPTY = EMPTY_PARTIAL if split else EMPTY_LSE
    ZERO = float32(0.0)

    @_step
    def row_end(total, m_row, scale_log2):
        return float32(1.0) / total, (m_row * scale_log2 + math.log2(total)) * LN2

    @_step
    def row_end_guarded(total, m_row, scale_log2):
        if total > ZERO:
            return float32(1.0) / total, (m_row * scale_log2 + math.log2(total)) * LN2
        return ZERO, EMPTY

    @_step
    def store_words(oh, row, n, t, x0, x1):
        oh[row, U(4 * n) + t] = pack(x0, x1)

    @_step
    def store_floats(oh, row, n, t, x0, x1):  # float32 outputs (split: the partial outputs are float32)
        oh[row, U(8 * n) + U(2) * t] = x0
        oh[row, U(8 * n) + U(2) * t + U(1)] = x1

    end = row_end_guarded if guard else row_end
    store = store_floats if T.WIDE or split else store_words

    @_step
    def finish(oh, lh, l, m, acc, w0, g, t, nq, scale_log2):
        for rr in range(2 * MT):  # row rr of this lane: m-tile rr // 2, half r = rr % 2
            r = rr % 2
            total = l[rr]
            total += mma.shfl_xor(total, 1)
            total += mma.shfl_xor(total, 2)
            row = w0 + g + U(8 * rr)
            if row < nq:
                inv, row_lse = end(total, m[rr], scale_log2)
                for n in range(NTD):
                    n_o = (rr // 2) * NTD + n
                    store(oh, row, n, t, acc[n_o, 2 * r] * inv, acc[n_o, 2 * r + 1] * inv)
                if t == U(0):
                    lh[row] = row_lse

    return finish


# ------------------------------------------------------------------------------------------------------ the build
class Steps(NamedTuple):
    """The steps of one build, bound once from its options and precision (device functions, inlined)."""
    place: object
    load_q: object
    start_rows: object
    start_dropout: object
    key_range: object
    option_values: object
    tile_count: object
    copy_start: object
    copy_tile: object
    landed: object
    stage: object
    warp_done: object
    scores: object
    mask: object
    softmax: object
    pv: object
    out_views: object
    finish: object


def steps(d: int, tile: TensorTile, causal: bool, precision: str, split: bool = False, heavy_first: bool = False,
          gqa: bool = False, page: int = 0, features: Features = Features(), varlen: bool = False):
    """(Traits, Steps) of a build (see build)."""
    f = features
    if varlen and (split or heavy_first or page):
        raise ValueError("the varlen build orders its blocks itself and does not split the keys or page them")
    if f.dropout and page:
        raise ValueError(f"dropout_p={f.dropout_p} with page={page}: the paged build packs (query head, row) pairs "
                         "as rows, so it has no dropout; use page=0")
    T = traits(d, tile, precision, page > 0)
    mma16 = {"f16": mma.mma_f16_m16n8k16, "bf16": mma.mma_bf16_m16n8k16, "k8": mma.mma_f16_m16n8k8x2}.get(precision)
    pack = mma.pack_bf16x2 if precision == "bf16" else mma.pack_f16x2
    d_start, d_mix, d_keep = dropout_functions(f.dropout_p)
    query_block, key_range = forward_functions(T.BQ, T.BK, heavy_first, split, causal, f)
    # a row can see no key of its chunk (or, with a window, none at all), or a varlen sequence has no keys: keep
    # its p = 0 and its output finite
    guard = (split and (causal or page > 0)) or f.per_score or varlen
    return T, Steps(
        _place(T, gqa, page > 0, varlen, query_block), _load_q(T), _start_rows(T),
        _start_dropout(T, d_start, d_mix) if f.dropout else _no_dropout, key_range, _option_values(f),
        _tile_count(T, split or f.per_score), *_copies(T, page), _warp_done(T, causal, f), _scores(T, mma16),
        _mask(T, causal, f),
        _softmax(T, guard, f.dropout, d_keep), _pv(T, mma16, pack), _out_views(split, varlen),
        _finish(T, guard, split, pack))


@lru_cache(maxsize=None)
def build(d: int, tile: TensorTile, causal: bool, precision: str, split: bool = False, heavy_first: bool = False,
          gqa: bool = False, page: int = 0, features: Features = Features(), varlen: bool = False):
    """The forward kernel for (d, tile, causal, precision), its steps bound once from the options (`features`:
    what is compiled in; their values are arguments) and the precision. 16-bit precisions take Q, K, V and O as
    uint32 arrays (B, H, N, d/2) of packed pairs; fp32 ones as float32 (B, H, N, d). Arguments:

        (q, k, v, o, lse, n_q, n_k, n_heads, scale_log2, left, right, cap, slopes, seed)

    left, right, cap, slopes: options.OptionArgs (in log2 units: Extras.arguments(..., log2=True)); builds without
    per-score options ignore them. seed: the dropout seed (a runtime int64: a new seed needs no new compile);
    builds without dropout ignore it.
    split: o and lse are float32 partial outputs viewed as (B, H * splits, Nq, d) and (B, H * splits, Nq).
    page > 0: a paged KV cache of `page` keys per page (kernels/paged.py): k and v are the caches as
    (num_pages * page, H, d or d/2), and n_k is an int32 array (B, 1 + max_pages) holding cache_seqlens[b]
    then block_table[b]; key j of sequence b is row block_table[b, j // page] * page + j % page.
    features: with per-score options (window, alignment, softcap, ALiBi), key tiles outside the band of the
    block's rows are skipped, and the others are transformed and masked on S's C fragments; dropout alone keeps
    the plain kernel's masking (edge tiles only) and multiplies P by flashlab.dropout's mask after the row sum,
    keyed by (seed, b, query head h, row, key) as the register kernel.
    varlen: q, k, v, o are packed (total, H, d or d/2), lse is (H, total_q); n_q is the (n_blocks, 2) table of
    (sequence, first row) and n_k the int32 (2, B + 1) cu_seqlens of queries and keys; grid (n_blocks, H)."""
    T, S = steps(d, tile, causal, precision, split, heavy_first, gqa, page, features, varlen)
    return _kernel(T, S)


def _kernel(T: Traits, S: Steps):
    place, load_q, start_rows, start_dropout, key_range, option_values, tile_count = S[:7]
    copy_start, copy_tile, landed, stage, warp_done, scores, mask, softmax, pv, out_views, finish = S[7:]
    SH, DT, ALIGN = T.SH, float32 if T.WIDE else uint32, None if config.ENABLE_CUDASIM else 16
    QALL, ROWS2, OROWS, SROWS, S2ROWS = T.MT * T.QREGS, 2 * T.MT, T.MT * T.NTD, T.MT * T.NTK, T.NTK if T.TF32X3 else 1
    NG, PAW, LOADS, LAG, WROWS, UBK = T.NG, 4 * T.MT, T.LOADS, U(T.LAG), U(T.WROWS), U(T.BK)

    @cuda.jit(fastmath=FASTMATH)
    def flash_fwd_tensor(q, k, v, o, lse, n_q, n_k, n_heads, scale_log2, left, right, cap, slopes, seed):
        sh = cuda.shared.array(SH, DT, alignment=ALIGN)
        tid = U(cuda.threadIdx.x)
        warp, lane = tid // U(32), tid % U(32)
        g, t = lane // U(4), lane % U(4)  # quad (row group) and lane within the quad
        b, h, q0, part, n_parts, cq, nq, nk, qh, kh, vh = place(q, k, v, n_q, n_k, n_heads)
        w0 = q0 + warp * WROWS  # this warp's first row

        qf = cuda.local.array(QALL, DT)  # Q's A fragments, in registers for the whole loop
        m = cuda.local.array(ROWS2, float32)  # running max of each row, raw score units
        l = cuda.local.array(ROWS2, float32)  # this lane's share of the running sums
        acc = cuda.local.array((OROWS, 4), float32)  # O, unnormalised, as C fragments
        s = cuda.local.array((SROWS, 4), float32)  # S, then P, as C fragments
        s2 = cuda.local.array((S2ROWS, 4), float32)  # a second S where the precision splits its operands
        alpha = cuda.local.array(ROWS2, float32)  # this tile's rescale of each row
        part_o = cuda.local.array((NG, 4), float32)  # a tile's P V, where the precision sums it apart
        pa = cuda.local.array(PAW, uint32)  # one k-step's A fragments of P (16-bit), per m-tile
        zrow = cuda.local.array(ROWS2, uint64)  # dropout: the hash state of each row
        kbuf = cuda.local.array(LOADS, DT)  # a copy through registers: its words in flight
        vbuf = cuda.local.array(LOADS, DT)
        load_q(qf, qh, w0, g, t, nq)
        start_rows(m, l, acc)
        start_dropout(zrow, seed, b, h, w0, g)
        k_begin, k_end, off = key_range(q0, part, n_parts, nq, nk, left, right)  # the chunk, cut to the band
        capr, slope = option_values(cap, slopes, b, h, n_heads, scale_log2)
        n_tiles = tile_count(k_begin, k_end)
        cs = copy_start(tid, kh, vh)

        for j in range(n_tiles + LAG):  # tile j is copied while tile j - LAG is used
            cuda.syncthreads()  # everyone is done with the stage this copy overwrites
            if j < n_tiles:
                copy_tile(sh, j, k_begin + j * UBK, kh, vh, nk, tid, cs, kbuf, vbuf, n_k, b)
            if not landed(j):
                continue
            cuda.syncthreads()  # everyone's copies of tile j - LAG have landed
            k0, KO = k_begin + (j - LAG) * UBK, stage(j)
            if warp_done(k0, w0):
                continue
            scores(s, s2, qf, sh, KO, lane, g, t)
            mask(s, s2, k0, w0, g, t, nk, off, capr, slope, left, right)
            softmax(s, m, l, alpha, acc, zrow, k0, t, scale_log2)
            pv(s, s2, acc, alpha, pa, part_o, sh, KO, lane, g, t)

        oh, lh = out_views(o, lse, b, h, part, n_parts, cq, nq)
        finish(oh, lh, l, m, acc, w0, g, t, nq, scale_log2)

    return flash_fwd_tensor


def float16_source(step: str | None = None) -> str:
    """The float16 forward as a learner runs it (lesson 16): the kernel body, then each step function a float16
    causal build binds (and the steps it calls, from this module and split_kv.py), in the order the body calls
    them; no other precision's or option's variant, and no step that does nothing in this build. step: one step's
    function (a name of Steps: "load_q", "copy_tile", "scores", "mask", "softmax", "pv", "finish", ...) with the
    steps it calls; "body": the kernel body alone)."""
    T, S = steps(64, choose_tile(64, "f16"), True, "f16")
    if step is not None and step != "body":
        return "\n\n\n".join(_source(f) for f in _with_substeps(getattr(S, step)) if not _does_nothing(f))
    idle = tuple(name for name, fn in zip(Steps._fields, S) if _does_nothing(fn))
    body = [line for line in _source(_kernel(T, S)).splitlines() if not line.strip().startswith(
        tuple(f"{name}(" for name in idle))]  # a call of a step that does nothing here
    parts = ["\n".join(body)]
    if step == "body":
        return parts[0]
    for fn in S:
        for f in _with_substeps(fn):
            text = _source(f)
            if text not in parts and not _does_nothing(f):
                parts.append(text)
    return "\n\n\n".join(parts)


def _with_substeps(fn):
    """fn, then the step functions of this module and split_kv.py that it calls (through its closure)."""
    found = [fn]
    for cell in fn.py_func.__closure__ or ():
        inner = cell.cell_contents
        if hasattr(inner, "py_func") and inner.py_func.__module__ in (__name__, forward_functions.__module__):
            found += [f for f in _with_substeps(inner) if f not in found]
    return found


def _does_nothing(fn) -> bool:
    """A step bound where a build has nothing to do: its body is one return of nothing or of constants."""
    import ast

    body = [x for x in ast.parse(_source(fn)).body[0].body if not isinstance(x, ast.Expr)]  # less a docstring
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return False
    return body[0].value is None or all(isinstance(x, (ast.Constant, ast.Name, ast.Tuple, ast.Load))
                                        for x in ast.walk(body[0].value))


def _source(fn) -> str:
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(fn.py_func)).strip()


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
        hint = ("use precision='k8' (two m16n8k8)" if precision == "f16" else
                "pass float16 inputs there (the sm_75 build, precision 'k8')")
        raise ValueError(f"{dtype} with precision {precision!r} needs {why}, which needs compute capability "
                         f"{need[0]}.{need[1]}; this GPU has {cc[0]}.{cc[1]}: {hint}")
    return precision


def launches(q_shape, k_shape, scale, causal, tile: TensorTile, precision: str, *, splits: int = 1,
             heavy_first: bool = False, section=None, extras: Extras | None = None) -> Launches:
    """The forward's launches for q of shape (B, H, Nq, d) and k (B, H_kv, Nk, d) (values, not words), arrays by
    name: q, k, v, o, lse as the caller holds them (16-bit values are seen as uint32 pairs), slopes (a host array,
    Launches.host). splits > 1 (float16 and float32 only): split-KV, then the merge kernel (split_kv.py);
    heavy_first, section: see split_kv.grid. extras: the library's options (their values become arguments)."""
    B, H, Nq, d = q_shape
    H_kv, Nk = k_shape[1], k_shape[2]
    splits = split_chunk(Nk, splits, tile.block_k)[1]
    if splits > 1 and precision == "bf16":
        raise ValueError("split-KV writes its merged output as float16 or float32; bfloat16 runs with splits=1")
    ex = extras or PLAIN
    kernel = build(d, tile, causal, precision, split=splits > 1, heavy_first=heavy_first, gqa=H_kv != H,
                   features=ex.features())
    opt = ex.arguments(causal, B, H, log2=True)
    wide = precision in ("3xtf32", "tf32")
    words = (lambda name: name) if wide else (lambda name: Arg(name, dtype=np.uint32))
    inputs = tuple(words(name) for name in ("q", "k", "v"))
    rest = (Nq, Nk, H, np.float32(scale * LOG2E), opt.left, opt.right, opt.cap, "slopes", np.int64(0))
    if splits == 1:  # o as words too
        run = [Launch(kernel, grid(B, H, Nq, tile.block_q, 1, heavy_first, section), tile.threads,
                      (*inputs, words("o"), "lse", *rest))]
        return Launches(run, {}, {"slopes": opt.slopes})
    run, temporaries = forward_launches(kernel, grid(B, H, Nq, tile.block_q, splits, heavy_first, section),
                                        tile.threads, (B, H, Nq, d), splits, inputs, rest,
                                        out="o" if wide else Arg("o", dtype=np.float16))  # the merge writes values
    return Launches(run, temporaries, {"slopes": opt.slopes})


def launch(q, k, v, o, lse, n_heads, scale, causal, tile: TensorTile, precision: str, *, splits: int = 1,
           heavy_first: bool = False, section=None, alloc=None, extras=None, seed=0):
    """Launch on device arrays: (B, H, N, d/2) uint32 pairs for 16-bit precisions, float32 otherwise (the general
    path of `launches`). seed: the dropout seed (used when extras has dropout_p > 0). Returns the kernel."""
    B, H, Nq, w = q.shape
    d = w if precision in ("3xtf32", "tf32") else 2 * w
    run = launches((B, H, Nq, d), (B, k.shape[1], k.shape[2], d), scale, causal, tile, precision, splits=splits,
                   heavy_first=heavy_first, section=section, extras=extras)
    run.run({"q": q, "k": k, "v": v, "o": o, "lse": lse}, alloc, np.int64(seed))
    return run.launches[0].kernel


def varlen_launches(H: int, H_kv: int, d: int, table, cu, scale, causal, tile: TensorTile, precision: str,
                    extras=None) -> Launches:
    """The packed batch's launch (kernels/varlen.py), arrays by name: q, o (total_q, H, d), k, v (total_k, H_kv, d)
    as the caller holds them (16-bit values are seen as uint32 pairs), lse (H, total_q), and the host arrays table
    (int32 (n_blocks, 2): sequence, first row), cu (int32 (2, B + 1): cu_seqlens of queries and keys) and slopes;
    grid (table rows, H)."""
    ex = extras or PLAIN
    kernel = build(d, tile, causal, precision, gqa=H_kv != H, features=ex.features(), varlen=True)
    opt = ex.arguments(causal, cu.shape[1] - 1, H, log2=True)
    words = (lambda name: name) if precision in ("3xtf32", "tf32") else (lambda name: Arg(name, dtype=np.uint32))
    args = (*map(words, ("q", "k", "v", "o")), "lse", "table", "cu", H, np.float32(scale * LOG2E), opt.left,
            opt.right, opt.cap, "slopes", np.int64(0))
    return Launches([Launch(kernel, (len(table), H, 1), tile.threads, args)], {},
                    {"table": table, "cu": cu, "slopes": opt.slopes})


def paged_launches(B: int, H_kv: int, rows: int, d: int, page: int, pages: int, max_pages: int, splits: int,
                   scale, tile: TensorTile, precision: str) -> Launches:
    """Paged decoding's launches (kernels/paged.py): the paged build on q seen as (B, H_kv, rows, d) (rows: the
    G * Nq (query head, row) pairs of a GQA group), its key chunks' partial outputs, then the merge into o and lse
    seen the same way. Arrays by name: q (B, H, Nq, d), k_cache and v_cache (pages, page, H_kv, d), as the caller
    holds them (16-bit values, seen as uint32 pairs), o (B, H, Nq, d) float16, lse (B, H, Nq), and meta: int32
    (B, 1 + max_pages), each sequence's length, then its block table; slopes (a host array: no options here)."""
    kernel = build(d, tile, False, precision, split=True, page=page)
    opt, w = PLAIN.arguments(False, 1, 1, log2=True), d // 2
    cache = lambda name: Arg(name, (pages * page, H_kv, w), np.uint32)  # noqa: E731
    parts = (Arg("o_part", (B, H_kv * splits, rows, d)), Arg("lse_part", (B, H_kv * splits, rows)))
    temporaries = {"o_part": ((B, H_kv, splits, rows, d), np.float32),
                   "lse_part": ((B, H_kv, splits, rows), np.float32)}
    split = Launch(kernel, grid(B, H_kv, rows, tile.block_q, splits), tile.threads,
                   (Arg("q", (B, H_kv, rows, w), np.uint32), cache("k_cache"), cache("v_cache"), *parts, rows, "meta",
                    H_kv, np.float32(scale * LOG2E), opt.left, opt.right, opt.cap, "slopes", np.int64(0)))
    merge = Launch(build_merge(d, normalised=True), (rows, H_kv, B), d,
                   ("lse_part", "lse_part", "o_part", Arg("o", (B, H_kv, rows, d), np.float16),
                    Arg("lse", (B, H_kv, rows)), splits))
    return Launches([split, merge], temporaries, {"slopes": opt.slopes})


def signature(precision: str, split: bool = False, varlen: bool = False) -> tuple:
    """The kernel's argument types for C-contiguous arrays (uint32 pairs for 16-bit precisions, float32 for tf32
    and 3xTF32): for compiling a build ahead of a launch (kernels/plan.py, kernels/info.py, the sm_75 PTX check).
    split: float32 partial outputs. Paged builds take n_k as an int32 (B, 1 + max_pages) array instead."""
    from numba import int64, types

    n = 3 if varlen else 4
    ins = types.Array(float32 if precision in ("3xtf32", "tf32") else uint32, n, "C")
    out = types.Array(float32, n, "C") if split else ins
    tables = types.Array(types.int32, 2, "C") if varlen else int64  # n_q, n_k: varlen's tables, else lengths
    return (ins, ins, ins, out, types.Array(float32, n - 1, "C"), tables, tables, int64, float32,
            *argument_types(), int64)
