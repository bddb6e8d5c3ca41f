"""variant="register": FlashAttention-2 forward with register tiling (lesson 09).

One thread block owns block_q = Br query rows of one (batch, head) and loops over the keys in tiles of
block_k = Bc. Its tr x tc threads are laid out like a GEMM's: thread (ty, tx) owns an RM x RN micro-tile
of S = Q K^T (RM = Br/tr rows, RN = Bc/tc keys) and an RM x RD micro-tile of O (RD = d/tc dims). Per step
of a product loop it reads RM + RN numbers from shared memory for RM*RN multiply-adds, instead of the
textbook kernel's one read per multiply-add. A thread's rows, keys and dims come in runs of 4 adjacent
ones ("vec"), so those reads compile to 16-byte vector loads (ld.shared.v4.f32).

O, m and l live in `cuda.local.array`s of compile-time size indexed only by unrolled loop counters, so they
stay in registers (kernel_info(...)["local_bytes_per_thread"] == 0 means no spills).

Shared memory, one float32 buffer, sized to fit 48 KB:
    Qt  d x (Br+4)    Q transposed, pre-scaled by scale*log2(e) so exp becomes exp2
    Kt  d x (Bc+4)    K transposed; once S is computed the same space holds Pt = P transposed
    V   Bc x (d+8)
    red tc x (Br+4)   each thread's row maxima (then row sums), combined across the tc threads of a row
(Paddings keep rows 16-byte aligned and spread the tile copies over the banks.) Tiles are copied from
global memory by runs of 8 threads reading 8 adjacent floats of one row (a 32-byte sector), 4 rows per
warp, so the transposed stores of a warp hit 32 different banks. No warp shuffles: reductions go through
`red`, so the CUDA simulator runs this same code.

Two launch options, both chosen by kernels/plan.py (lesson 10):
- split: the keys are cut into chunks of a multiple of Bc keys, one thread block per (query block, chunk);
  each writes its chunk's attention output o_c and lse_c (float32), and kernels/split_kv.py's merge kernel
  combines them. Under causal masking a row may see no key of a chunk: those rows get o_c = 0 and
  lse_c = -1e30, which the merge weighs by zero.
- heavy_first: the grid is (g, query blocks, B*H/g sections x splits): heads go in sections of g, and within
  a section (and a chunk) every head's last (heaviest, under causal) query block is dispatched before any
  lighter one. g is chosen so that a section's K and V fit in L2 (plan.l2_section). Otherwise the grid is
  (query blocks, B*H, splits) and the heaviest-first order holds within each head. Both orders take the
  query block from one grid index (no division in the kernel: a division's result would hold registers).

varlen (flash_attention_varlen, kernels/varlen.py): one launch over sequences packed along one axis, q of shape
(total_q, H, d) and k, v (total_k, H_kv, d). The grid is (query blocks of all sequences, H); each block reads
its (sequence, first row) from a host-made table, ordered heaviest first, finds its rows and keys from
cu_seqlens and works on views of them, so the tile loop is the same code.

The code, as it reads: `traits` derives a build's tile constants once, build binds one device function per step
(where a block works, the Q tile, the K/V tile copy, S = QK^T, the mask, the online softmax, O += PV, the finish)
from the options (options.Features: their presence; their values are the arguments left, right, cap, slopes), and
the kernel body calls them in order, inlined by Numba. `launches` describes a call's launches once, for the general
path and the prepared one (kernels/prepared.py).

Index arithmetic is unsigned (U = uint64): Numba adds a negative-index check to every signed index, which
in the inner loops costs more instructions than the multiply-adds themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numba import config, float32, uint64

from ..device import get_cuda
from ..dropout import device_functions as dropout_functions
from ._launch import Launch, Launches
from .common import FASTMATH, I, LN2, LOG2E, NEG, U
from .options import EMPTY_LSE, EMPTY_PARTIAL, PLAIN, Extras, Features, argument_types, device_functions
from .split_kv import forward_functions, forward_launches, grid, split_chunk

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs
I32 = np.int32  # a tile's own columns


@dataclass(frozen=True)
class Tile:
    """A register-kernel configuration: block_q x block_k tiles computed by tr x tc threads."""

    block_q: int = 64
    block_k: int = 32
    tr: int = 16
    tc: int = 8
    prefetch: bool = False  # load the next K/V tile into registers while computing this one

    @property
    def threads(self) -> int:
        return self.tr * self.tc

    def micro(self, d: int):
        """(RM, RN, RD): rows, keys and dims of O owned by each thread."""
        return self.block_q // self.tr, self.block_k // self.tc, d // self.tc

    def shared_floats(self, d: int) -> int:
        br, bc = self.block_q, self.block_k
        return d * (br + 4) + max(d * (bc + 4), bc * (br + 4)) + bc * (d + 8) + self.tc * (br + 4)

    def shared_bytes(self, d: int) -> int:
        return 4 * self.shared_floats(d)

    def check(self, d: int, shared_limit: int = 48 * 1024):
        """Raise ValueError unless the threads divide the tile evenly and shared memory fits."""
        for name in ("block_q", "block_k", "tr", "tc"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.block_q % self.tr or self.block_k % self.tc or d % self.tc:
            raise ValueError(f"tile {self}: tr must divide block_q, and tc must divide block_k and d={d}")
        if self.threads > 1024:
            raise ValueError(f"tile {self}: {self.threads} threads per block; at most 1024")
        if self.shared_bytes(d) > shared_limit:
            raise ValueError(f"tile {self} needs {self.shared_bytes(d)} bytes of shared memory at d={d}; "
                             f"the limit per block is {shared_limit} bytes: use a smaller block_q or block_k")
        return self


# Preferred tiles per d, best first: from the tile sweep on an H200 (sm_90, the H100's SM),
# flashlab/data/tile_sweep.csv (d = 16, 32: chosen by the same rule, not swept).
PREFERRED = {
    16: [Tile(128, 32, 32, 4), Tile(64, 32, 16, 8)],
    32: [Tile(128, 32, 32, 4), Tile(64, 32, 16, 8)],
    64: [Tile(128, 16, 32, 4), Tile(64, 16, 16, 4), Tile(64, 32, 16, 8)],
    128: [Tile(32, 16, 8, 16), Tile(16, 16, 4, 16)],
}

# d = 128 redesigned after the d = 64 tile: 4 threads per row (tc = 4), 4 rows per thread in one run of 4, and a
# 4 x 2 micro-tile of S (0.5 shared loads per FMA against 0.8 for PREFERRED[128][0], which gives each thread one
# key of S). Q's tile (d x block_q) is what 48 KB cannot hold at block_q = 128, so block_q = 64, block_k = 8
# (46,400 bytes). Not measured yet: the planner picks it only when asked, flash_attention(..., tile=D128_REDESIGN)
# or plan(..., tile=...); `python benchmarks/timing/bench_kernels.py --suite --parts d128` times it against the default.
D128_REDESIGN = Tile(64, 8, 16, 4)


def choose_tile(d: int, block_q=None, block_k=None, shared_limit: int = 48 * 1024,
                shared_per_sm: int | None = None) -> Tile:
    """The first preferred tile that fits the device; block_q / block_k override its sizes.

    A tile must fit `shared_limit` bytes per block; when `shared_per_sm` is given, tiles that leave room
    for two blocks per SM come first (on a T4, 64 KB per SM, one 48 KB block would leave the SM idle
    at every barrier). With an override, the thread layout keeps tc = 8 (or fewer, dividing block_k and
    d) and takes tr = block_q / 4, so each thread owns 4 rows.
    """
    if block_q is None and block_k is None:
        fits = [t for t in PREFERRED[d] if t.shared_bytes(d) <= shared_limit]
        roomy = [t for t in fits if shared_per_sm is None or shared_per_sm // (t.shared_bytes(d) + 1024) >= 2]
        if roomy or fits:
            return (roomy or fits)[0]
    base = PREFERRED[d][0]
    br, bc = block_q or base.block_q, block_k or base.block_k
    tc = math.gcd(math.gcd(8, bc), d)
    tr = max(1, br // 4) if br % 4 == 0 else br
    return Tile(br, bc, tr, tc).check(d, shared_limit)


def _vec(n: int) -> int:
    """Length of a thread's runs of adjacent rows/keys/dims: 4 (one 16-byte load) when it divides n."""
    return 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)


class Traits(NamedTuple):
    """The tile constants of one build, derived once from (d, tile, unroll). Thread (ty, tx) owns
    row (ii*TR + ty)*VM + u for ii < RM/VM, u < VM (ty*RM + i when RM = VM), key (jj*TC + tx)*VN + u and O dim
    (jj*TC + tx)*VD + u, so a warp's vector loads cover consecutive 16-byte chunks: no bank conflicts. Offsets and
    strides are in floats of the one shared buffer: Qt, then Kt (or Pt), V and red."""
    RM: int  # rows, keys and dims of O a thread owns (ints: local array shapes must be signed constants)
    RN: int
    RD: int
    VM: int  # lengths of a thread's runs of adjacent rows, keys and dims
    VN: int
    VD: int
    BR: int
    BC: int
    TR: int
    TC: int
    NT: int  # threads
    D: int
    QS: int  # padded row strides of Qt, Kt, Pt, V and red
    KS: int
    PS: int
    VS: int
    RS: int
    KP: int  # offsets of Kt/Pt, V and red
    VO: int
    RO: int
    SH: int  # floats of shared memory
    Q_LOADS: int  # elements each thread copies of a Q tile, of a K/V tile
    KV_LOADS: int
    XSTEP: int  # the product loops' unrolled steps
    CSTEP: int
    KV_REGS: int  # prefetched K/V values per thread (1 without prefetch)


def traits(d: int, tile: Tile, unroll: int) -> Traits:
    BR, BC, TR, TC = tile.block_q, tile.block_k, tile.tr, tile.tc
    RM, RN, RD = tile.micro(d)
    QS, KS, PS, VS, RS = BR + 4, BC + 4, BR + 4, d + 8, BR + 4
    KP = d * QS
    VO = KP + max(d * KS, BC * PS)
    RO = VO + BC * VS
    kv_loads = -(-BC * d // (TR * TC))
    return Traits(RM, RN, RD, _vec(RM), _vec(RN), _vec(RD), BR, BC, TR, TC, TR * TC, d, QS, KS, PS, VS, RS, KP, VO,
                  RO, RO + TC * RS, -(-BR * d // (TR * TC)), kv_loads, math.gcd(unroll, d), math.gcd(unroll, BC),
                  kv_loads if tile.prefetch else 1)


def _step(fn):
    """A step of the kernel: inlined into it by Numba (no call), under the kernel's fastmath flags."""
    return cuda.jit(device=True, inline="always", fastmath=FASTMATH)(fn)


def _indices(T: Traits):
    """row_of(i, ty), key_of(j, tx), dim_of(j, tx): the tile row, key and O dim of a thread's i-th / j-th."""
    UTR, UTC, UVM, UVN, UVD = U(T.TR), U(T.TC), U(T.VM), U(T.VN), U(T.VD)

    @_step
    def row_of(i, ty):
        return ((i // UVM) * UTR + ty) * UVM + i % UVM

    @_step
    def key_of(j, tx):
        return ((j // UVN) * UTC + tx) * UVN + j % UVN

    @_step
    def dim_of(j, tx):
        return ((j // UVD) * UTC + tx) * UVD + j % UVD

    return row_of, key_of, dim_of


# ------------------------------------------------------------------------------------------- where a block works
def _place(gqa: bool, varlen: bool, query_block):
    """place(q, k, v, n_q, n_k, n_heads) -> (bh, q0, part, n_parts, cq, nq, nk, Q, K, V): the block's (batch or
    sequence, query head) as one index b * H + h, its first row and key chunk, and its head's (N, d) matrices.
    One index, not two, stays live through the loop (the steps that need b and h divide it)."""

    @_step
    def place_batched(q, k, v, n_q, n_k, n_heads):
        # each view divides bh itself: one (b, h) pair shared by the three views stays live longer, and the split
        # causal heavy-first build at d = 32 took 137 registers instead of 126 (ptxas, sm_90)
        q0, bh, part, n_parts = query_block(q.shape[0], n_heads)
        return bh, q0, part, n_parts, U(0), U(n_q), U(n_k), q[bh // U(n_heads), bh % U(n_heads)], \
            k[bh // U(n_heads), bh % U(n_heads)], v[bh // U(n_heads), bh % U(n_heads)]

    @_step
    def place_grouped(q, k, v, n_q, n_k, n_heads):
        # query head h reads K/V head h // (H / H_kv): a build of its own, so MHA's code is unchanged
        q0, bh, part, n_parts = query_block(q.shape[0], n_heads)
        b, h = bh // U(n_heads), bh % U(n_heads)
        hk = h * U(k.shape[1]) // U(n_heads)
        return bh, q0, part, n_parts, U(0), U(n_q), U(n_k), q[b, h], k[b, hk], v[b, hk]

    @_step
    def place_packed(q, k, v, n_q, n_k, n_heads):
        # block x: (sequence b, first row q0) from the table; its rows and keys from cu_seqlens, as views
        q0, h, part, n_parts = query_block(q.shape[0], n_heads)
        b = U(n_q[cuda.blockIdx.x, 0])
        q0, cq, ck = U(n_q[cuda.blockIdx.x, 1]), U(n_k[0, b]), U(n_k[1, b])
        nq, nk = U(n_k[0, b + U(1)]) - cq, U(n_k[1, b + U(1)]) - ck
        hk = h * U(k.shape[1]) // U(n_heads) if gqa else h
        bh = b * U(n_heads) + h  # as if batched: the dropout key and per-sequence ALiBi use sequence b
        return bh, q0, part, n_parts, cq, nq, nk, q[cq:cq + nq, h], k[ck:ck + nk, hk], v[ck:ck + nk, hk]

    return place_packed if varlen else place_grouped if gqa else place_batched


def _out_views(split: bool, varlen: bool):
    """out_views(o, lse, bh, n_heads, part, n_parts, cq, nq) -> the rows of O and lse this block writes."""

    @_step
    def out_batched(o, lse, bh, n_heads, part, n_parts, cq, nq):
        b, h = bh // U(n_heads), bh % U(n_heads)
        return o[b, h], lse[b, h]

    @_step
    def out_split(o, lse, bh, n_heads, part, n_parts, cq, nq):  # (B, H * splits, ...) views of the partial outputs
        b, h = bh // U(n_heads), bh % U(n_heads) * n_parts + part
        return o[b, h], lse[b, h]

    @_step
    def out_packed(o, lse, bh, n_heads, part, n_parts, cq, nq):
        h = bh % U(n_heads)
        return o[cq:cq + nq, h], lse[h, cq:cq + nq]

    return out_packed if varlen else out_split if split else out_batched


def _option_values(f: Features):
    """option_values(cap, slopes, bh) -> (cap, slope), in log2 units as S here (slopes are indexed b * H + h)."""
    ALIBI, ZERO = f.alibi, float32(0.0)

    @_step
    def option_values(cap, slopes, bh):
        slope = ZERO
        if ALIBI:
            slope = slopes[bh]
        return cap, slope

    @_step
    def no_values(cap, slopes, bh):
        return ZERO, ZERO

    return option_values if f.per_score else no_values


# ------------------------------------------------------------------------------------------------ tiles to shared
def _load_q(T: Traits):
    D, NT, QS, Q_LOADS, UBR = U(T.D), U(T.NT), U(T.QS), U(T.Q_LOADS), U(T.BR)

    @_step
    def load_q(sh, qh, q0, t, nq, scale_log2):
        """Q tile -> shared, transposed and scaled (S comes out in log2 units); rows past Nq are zeros."""
        for it in range(Q_LOADS):
            e = it * NT + t
            if e < UBR * D:
                r = (e // U(8)) % UBR  # element e of the tile: row r, dim x (runs of 8 dims per row)
                x = (e // U(8)) // UBR * U(8) + e % U(8)
                val = float32(0.0)
                if q0 + r < nq:
                    val = float32(qh[q0 + r, x]) * scale_log2
                sh[x * QS + r] = val

    return load_q


def _copies(T: Traits, prefetch: bool):
    """fetch(kreg, vreg, kh, vh, c0, nk, t): with prefetch, load the K/V tile at key c0 into registers (they land
    while this tile is computed); store_tile(sh, kreg, vreg, kh, vh, k0, nk, t): the tile at k0 into shared memory,
    K transposed, zeros past Nk (0 * garbage could be NaN); each 8 threads read one 32-byte run of a row."""
    D, NT, KV_LOADS, UBC = U(T.D), U(T.NT), U(T.KV_LOADS), U(T.BC)
    KP, KS, VO, VS = U(T.KP), U(T.KS), U(T.VO), U(T.VS)

    @_step
    def fetch(kreg, vreg, kh, vh, c0, nk, t):
        for it in range(KV_LOADS):
            e = it * NT + t
            c = c0 + (e // U(8)) % UBC
            x = (e // U(8)) // UBC * U(8) + e % U(8)
            kreg[it] = 0.0
            vreg[it] = 0.0
            if e < UBC * D and c < nk:
                kreg[it] = float32(kh[c, x])
                vreg[it] = float32(vh[c, x])

    @_step
    def no_fetch(kreg, vreg, kh, vh, c0, nk, t):
        return

    @_step
    def store_fetched(sh, kreg, vreg, kh, vh, k0, nk, t):
        for it in range(KV_LOADS):
            e = it * NT + t
            if e < UBC * D:
                c = (e // U(8)) % UBC
                x = (e // U(8)) // UBC * U(8) + e % U(8)
                sh[KP + x * KS + c] = kreg[it]
                sh[VO + c * VS + x] = vreg[it]

    @_step
    def copy_tile(sh, kreg, vreg, kh, vh, k0, nk, t):
        for it in range(KV_LOADS):
            e = it * NT + t
            if e < UBC * D:
                c = (e // U(8)) % UBC
                x = (e // U(8)) // UBC * U(8) + e % U(8)
                kval = float32(0.0)
                vval = float32(0.0)
                if k0 + c < nk:
                    kval = float32(kh[k0 + c, x])
                    vval = float32(vh[k0 + c, x])
                sh[KP + x * KS + c] = kval
                sh[VO + c * VS + x] = vval

    return (fetch, store_fetched) if prefetch else (no_fetch, copy_tile)


def _start_rows(T: Traits):
    URM, URD = U(T.RM), U(T.RD)

    @_step
    def start_rows(m, l, acc):
        for i in range(URM):
            m[i] = NEG
            l[i] = 0.0
            for j in range(URD):
                acc[i, j] = 0.0

    return start_rows


def _start_dropout(T: Traits, row_of, d_start, d_mix):
    URM = U(T.RM)

    @_step
    def start_dropout(zrow, seed, bh, n_heads, q0, ty):
        """Each row's hash state: keyed by (seed, batch, query head, row, col) as flashlab.dropout, with
        (seed, b, h) hashed once per block."""
        zh = d_start(seed, bh // U(n_heads), bh % U(n_heads))
        for i in range(URM):
            zrow[i] = d_mix(zh, q0 + row_of(i, ty))

    return start_dropout


# -------------------------------------------------------------------------------------------------- the products
def _scores(T: Traits, row_of, key_of):
    """scores(s, a, bk, sh, ty, tx): the thread's S micro-tile = Q K^T: per x, RM + RN shared reads (vector loads)
    for RM*RN FMAs."""
    URM, URN, D, XSTEP, QS, KP, KS = U(T.RM), U(T.RN), U(T.D), U(T.XSTEP), U(T.QS), U(T.KP), U(T.KS)

    @_step
    def scores(s, a, bk, sh, ty, tx):
        for i in range(URM):
            for j in range(URN):
                s[i, j] = 0.0
        for x0 in range(U(0), D, XSTEP):
            for xx in range(XSTEP):
                x = x0 + xx
                for i in range(URM):
                    a[i] = sh[x * QS + row_of(i, ty)]
                for j in range(URN):
                    bk[j] = sh[KP + x * KS + key_of(j, tx)]
                for i in range(URM):
                    for j in range(URN):
                        s[i, j] += a[i] * bk[j]

    return scores


def _pv(T: Traits, row_of, dim_of):
    """pv(acc, a, bv, sh, ty, tx): the thread's O micro-tile += P V: per key c, RM + RD shared reads for RM*RD
    FMAs."""
    URM, URD, UBC, CSTEP, KP, PS, VO, VS = U(T.RM), U(T.RD), U(T.BC), U(T.CSTEP), U(T.KP), U(T.PS), U(T.VO), U(T.VS)

    @_step
    def pv(acc, a, bv, sh, ty, tx):
        for c0 in range(U(0), UBC, CSTEP):
            for cc in range(CSTEP):
                c = c0 + cc
                for i in range(URM):
                    a[i] = sh[KP + c * PS + row_of(i, ty)]
                for j in range(URD):
                    bv[j] = sh[VO + c * VS + dim_of(j, tx)]
                for i in range(URM):
                    for j in range(URD):
                        acc[i, j] += a[i] * bv[j]

    return pv


# ---------------------------------------------------------------------------------------------------- the mask
def _mask(T: Traits, causal: bool, f: Features, row_of, key_of):
    """mask(s, k0, q0, ty, tx, nk, off, cap, slope, left, right): the keys a row may not see get NEG. Without
    per-score options only the tiles at an edge (past Nk, or crossing causal's diagonal) are masked; with them,
    every tile is transformed (softcap, ALiBi) and masked (the aligned causal/window band)."""
    URM, URN, UBC = U(T.RM), U(T.RN), U(T.BC)
    CAUSAL = causal
    capped, key_band = device_functions(f).capped, device_functions(f).key_band
    BC = T.BC

    @_step
    def mask_edges(s, k0, q0, ty, tx, nk, off, cap, slope, left, right):
        # options.outside without a window, top-left: past Nk or (causal) after the row; in the plain kernels'
        # unsigned positions (signed ones cost registers: ptxas sm_90)
        if k0 + UBC > nk or (CAUSAL and k0 + UBC > q0 + U(1)):
            for i in range(URM):
                row = q0 + row_of(i, ty)
                for j in range(URN):
                    col = k0 + key_of(j, tx)
                    if col >= nk or (CAUSAL and col > row):
                        s[i, j] = NEG

    @_step
    def mask_band(s, k0, q0, ty, tx, nk, off, cap, slope, left, right):
        # options.outside, as the band of keys each row sees (key_band), once per row, compared in the tile's own
        # 32-bit columns (64-bit positions and run-time bounds per entry cost registers: ptxas sm_90)
        for i in range(URM):
            pos = I(q0 + row_of(i, ty)) + off
            lo, hi = key_band(pos, pos, I(nk), left, right)
            lo_t = I32(min(max(lo - I(k0), I(-1)), I(BC)))  # the row's band in this tile's columns
            hi_t = I32(min(max(hi - I(k0), I(-1)), I(BC)))
            pos_t = I32(pos - I(k0))  # ALiBi's distance |pos - key| in the same columns
            for j in range(URN):
                cc = I32(key_of(j, tx))
                val, _ = capped(s[i, j], pos_t, cc, cap, slope)
                s[i, j] = NEG if cc < lo_t or cc >= hi_t else val

    return mask_band if f.per_score else mask_edges


# ------------------------------------------------------------------------------------------- the online softmax
def _softmax(T: Traits, guard: bool, dropout: bool, d_keep, row_of, key_of):
    """row_max(s, sh, ty, tx): this thread's row maxima, shared with the row's other tc threads through red;
    softmax(s, m, l, acc, sh, zrow, k0, ty, tx): the new maxima, P (written transposed over Kt: every thread is past
    its S loop), the running sums, and O's rescale."""
    URM, URN, URD, UTC, KP, PS, RO, RS = U(T.RM), U(T.RN), U(T.RD), U(T.TC), U(T.KP), U(T.PS), U(T.RO), U(T.RS)
    HALF_NEG, ONE, ZERO = float32(0.5 * NEG), float32(1.0), float32(0.0)

    @_step
    def row_max(s, sh, ty, tx):
        for i in range(URM):
            mx = s[i, 0]
            for j in range(U(1), URN):
                mx = max(mx, s[i, j])
            sh[RO + tx * RS + row_of(i, ty)] = mx

    @_step
    def live_guarded(m_new):  # every key so far is masked: exp2(NEG - NEG) would be 1
        return ZERO if m_new < HALF_NEG else ONE

    @_step
    def live_always(m_new):
        return ONE

    @_step
    def times_live(p, live):
        return p * live

    @_step
    def as_is(p, live):
        return p

    @_step
    def keep_dropout(p, zrow, i, col):  # after the row sum: l and lse are dropout-free, only P V sees the mask
        return p * d_keep(zrow[i], col)

    @_step
    def keep_all(p, zrow, i, col):
        return p

    row_live, live_p = (live_guarded, times_live) if guard else (live_always, as_is)
    keep = keep_dropout if dropout else keep_all

    @_step
    def softmax(s, m, l, acc, sh, zrow, k0, ty, tx):
        for i in range(URM):
            rl = row_of(i, ty)  # row within the tile
            m_new = m[i]
            for t2 in range(UTC):
                m_new = max(m_new, sh[RO + t2 * RS + rl])
            alpha = math.exp2(m[i] - m_new)  # rescales what was accumulated so far
            m[i] = m_new
            live = row_live(m_new)
            row_sum = float32(0.0)
            for j in range(URN):
                p = live_p(math.exp2(s[i, j] - m_new), live)
                row_sum += p
                cl = key_of(j, tx)
                sh[KP + cl * PS + rl] = keep(p, zrow, i, k0 + cl)
            l[i] = l[i] * alpha + row_sum
            for j in range(URD):
                acc[i, j] *= alpha

    return row_max, softmax


# ------------------------------------------------------------------------------------------------------ finish
def _finish(T: Traits, guard: bool, split: bool, row_of, dim_of):
    """share_sums(sh, l, ty, tx): each thread's share of its rows' sums, to red; finish(sh, oh, lh, m, acc, q0, nq,
    ty, tx): add up the tc partial sums of each row, normalise once, write O and lse. A row that saw no key (guard)
    gets o = 0 and lse = +inf (NEG for a split-KV chunk's partial row, which the merge then ignores), as
    options.row_end; lse is computed only for a row that saw a key."""
    URM, URD, UTC, RO, RS = U(T.RM), U(T.RD), U(T.TC), U(T.RO), U(T.RS)
    EMPTY, ZERO = EMPTY_PARTIAL if split else EMPTY_LSE, float32(0.0)

    @_step
    def share_sums(sh, l, ty, tx):
        for i in range(URM):
            sh[RO + tx * RS + row_of(i, ty)] = l[i]

    @_step
    def row_end(total, m_row):
        return float32(1.0) / total, (m_row + math.log2(total)) * LN2

    @_step
    def row_end_guarded(total, m_row):
        inv, row_lse = ZERO, EMPTY
        if total > ZERO:
            inv, row_lse = float32(1.0) / total, (m_row + math.log2(total)) * LN2
        return inv, row_lse

    end = row_end_guarded if guard else row_end

    @_step
    def finish(sh, oh, lh, m, acc, q0, nq, ty, tx):
        for i in range(URM):
            rl = row_of(i, ty)
            total = float32(0.0)
            for t2 in range(UTC):
                total += sh[RO + t2 * RS + rl]
            if q0 + rl < nq:
                inv, row_lse = end(total, m[i])
                for j in range(URD):
                    oh[q0 + rl, dim_of(j, tx)] = acc[i, j] * inv
                if tx == U(0):
                    lh[q0 + rl] = row_lse

    return share_sums, finish


# ------------------------------------------------------------------------------------------------------ the build
@lru_cache(maxsize=None)
def build(d: int, tile: Tile, causal: bool, unroll: int = 4, max_registers: int | None = None,
          split: bool = False, heavy_first: bool = False, gqa: bool = False, features: Features = Features(),
          varlen: bool = False):
    """The forward kernel for (d, tile, causal), its steps bound once from the options (`features`: what is
    compiled in; their values are arguments). Numba compiles it on first launch, once per input dtype (float32 or
    float16). Arguments:

        (q, k, v, o, lse, n_q, n_k, n_heads, scale_log2, left, right, cap, slopes, seed)

    left, right, cap, slopes: options.OptionArgs in log2 units (Extras.arguments(..., log2=True)); builds without
    per-score options (window, alignment, softcap, ALiBi) ignore them. seed: the dropout seed (a runtime int64, so
    a new seed per step needs no new compile); builds without dropout ignore it.

    split: the kernel works on one chunk of keys per block (grid axis "splits") and o, lse are the float32
    partial outputs viewed as (B, H * splits, Nq, d) and (B, H * splits, Nq); heavy_first: the grid's axes
    are (B*H, splits, query blocks) instead of (query blocks, B*H, splits). See the module docstring.

    unroll: steps of the two product loops per loop iteration (4 measured best; deeper unrolling adds
    registers, benchmarks/experiments/register_experiments.py); max_registers: a cap for the compiler (None: its own
    choice; a low cap spills). varlen: the packed build (see the module docstring): its n_q argument is the
    int32 block table (n_blocks, 2) of (sequence, first row) and n_k the int32 (2, batch + 1) array of
    cu_seqlens_q and cu_seqlens_k; q, o are (total_q, H, d), k, v (total_k, H_kv, d), lse (H, total_q)."""
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(f"unroll must be a positive integer (steps per loop iteration); got {unroll!r}")
    if max_registers is not None and (isinstance(max_registers, bool) or not isinstance(max_registers, int)
                                      or not 16 <= max_registers <= 255):
        raise ValueError(f"max_registers must be None or an integer from 16 to 255 (a thread's limit); "
                         f"got {max_registers!r}")
    if varlen and (split or heavy_first):
        raise ValueError("the varlen build orders its blocks itself and does not split the keys")
    f = features
    T = traits(d, tile, unroll)
    row_of, key_of, dim_of = _indices(T)
    d_start, d_mix, d_keep = dropout_functions(f.dropout_p)
    query_block, key_range = forward_functions(T.BR, T.BC, heavy_first, split, causal, f)
    # a row can see no key of its chunk (causal), of the window, or of its varlen sequence: keep its p = 0 and its
    # output finite
    guard = (split and causal) or f.per_score or varlen
    fetch, store_tile = _copies(T, tile.prefetch)
    row_max, softmax = _softmax(T, guard, f.dropout, d_keep, row_of, key_of)
    share_sums, finish = _finish(T, guard, split, row_of, dim_of)
    place, load_q, start_rows = _place(gqa, varlen, query_block), _load_q(T), _start_rows(T)
    start_dropout = _start_dropout(T, row_of, d_start, d_mix) if f.dropout else _no_dropout
    option_values, mask, out_views = _option_values(f), _mask(T, causal, f, row_of, key_of), _out_views(split, varlen)
    scores, pv = _scores(T, row_of, key_of), _pv(T, row_of, dim_of)
    SH, RM, RN, RD, KV_REGS, UBC, UTC = T.SH, T.RM, T.RN, T.RD, T.KV_REGS, U(T.BC), U(T.TC)
    ZR = RM if f.dropout else 1
    ALIGN = None if config.ENABLE_CUDASIM else 16  # the simulator has no aligned shared arrays
    options = {"max_registers": max_registers} if max_registers is not None and not config.ENABLE_CUDASIM else {}

    @cuda.jit(fastmath=FASTMATH, **options)
    def flash_fwd_register(q, k, v, o, lse, n_q, n_k, n_heads, scale_log2, left, right, cap, slopes, seed):
        sh = cuda.shared.array(SH, float32, alignment=ALIGN)
        t = U(cuda.threadIdx.x)
        ty, tx = t // UTC, t % UTC
        bh, q0, part, n_parts, cq, nq, nk, qh, kh, vh = place(q, k, v, n_q, n_k, n_heads)
        load_q(sh, qh, q0, t, nq, scale_log2)

        m = cuda.local.array(RM, float32)  # running row max (log2 units)
        l = cuda.local.array(RM, float32)  # this thread's share of the running row sum
        acc = cuda.local.array((RM, RD), float32)  # unnormalised O
        s = cuda.local.array((RM, RN), float32)  # S, then P
        a = cuda.local.array(RM, float32)
        bk = cuda.local.array(RN, float32)
        bv = cuda.local.array(RD, float32)
        zrow = cuda.local.array(ZR, uint64)  # dropout: the hash state of each of this thread's rows
        kreg = cuda.local.array(KV_REGS, float32)  # prefetched K/V values
        vreg = cuda.local.array(KV_REGS, float32)
        start_rows(m, l, acc)
        start_dropout(zrow, seed, bh, n_heads, q0, ty)
        k_begin, k_end, off = key_range(q0, part, n_parts, nq, nk, left, right)  # the chunk, cut to the band
        capl, slope = option_values(cap, slopes, bh)
        fetch(kreg, vreg, kh, vh, k_begin, nk, t)

        for k0 in range(k_begin, k_end, UBC):
            cuda.syncthreads()  # everyone is done with the previous tile's Pt and V
            store_tile(sh, kreg, vreg, kh, vh, k0, nk, t)
            cuda.syncthreads()
            fetch(kreg, vreg, kh, vh, k0 + UBC, nk, t)  # the next tile's loads land while this one is computed
            scores(s, a, bk, sh, ty, tx)
            mask(s, k0, q0, ty, tx, nk, off, capl, slope, left, right)
            row_max(s, sh, ty, tx)
            cuda.syncthreads()
            softmax(s, m, l, acc, sh, zrow, k0, ty, tx)
            cuda.syncthreads()
            pv(acc, a, bv, sh, ty, tx)

        cuda.syncthreads()
        share_sums(sh, l, ty, tx)
        cuda.syncthreads()
        oh, lh = out_views(o, lse, bh, n_heads, part, n_parts, cq, nq)
        finish(sh, oh, lh, m, acc, q0, nq, ty, tx)

    return flash_fwd_register


@_step
def _no_dropout(zrow, seed, bh, n_heads, q0, ty):
    return


def launches(q_shape, k_shape, scale, causal, tile: Tile, *, splits: int = 1, heavy_first: bool = False,
             section=None, extras: Extras | None = None, **options) -> Launches:
    """The forward's launches for q of shape (B, H, Nq, d) and k (B, H_kv, Nk, d), arrays by name: q, k, v, o,
    lse, and slopes (a host array, Launches.host). splits > 1: split-KV, then the merge kernel (split_kv.py);
    heavy_first, section: see split_kv.grid. extras: the library's options (their values become arguments);
    options: build's unroll, max_registers."""
    B, H, Nq, d = q_shape
    H_kv, Nk = k_shape[1], k_shape[2]
    splits = split_chunk(Nk, splits, tile.block_k)[1]
    ex = extras or PLAIN
    kernel = build(d, tile, causal, split=splits > 1, heavy_first=heavy_first, gqa=H_kv != H,
                   features=ex.features(), **options)
    opt = ex.arguments(causal, B, H, log2=True)
    rest = (Nq, Nk, H, np.float32(scale * LOG2E), opt.left, opt.right, opt.cap, "slopes", np.int64(0))
    run, temporaries = forward_launches(kernel, grid(B, H, Nq, tile.block_q, splits, heavy_first, section),
                                        tile.threads, (B, H, Nq, d), splits, ("q", "k", "v"), rest)
    return Launches(run, temporaries, {"slopes": opt.slopes})


def launch(q, k, v, o, lse, n_heads, scale, causal, tile: Tile, *, splits: int = 1, heavy_first: bool = False,
           section=None, alloc=None, extras=None, seed=0, **options):
    """Launch on device arrays (B, H, N, d); o and lse are written (the general path of `launches`). options:
    build's unroll, max_registers. seed: the dropout seed (used when extras has dropout_p > 0). splits > 1: the
    float32 partial outputs come from alloc(shape, dtype), default a numba device array. Returns the kernel."""
    run = launches(q.shape, k.shape, scale, causal, tile, splits=splits, heavy_first=heavy_first, section=section,
                   extras=extras, **options)
    run.run({"q": q, "k": k, "v": v, "o": o, "lse": lse}, alloc, np.int64(seed))
    return run.launches[0].kernel


def varlen_launches(H: int, H_kv: int, d: int, table, cu, scale, causal, tile: Tile, extras=None) -> Launches:
    """The packed batch's launch (kernels/varlen.py), arrays by name: q, o (total_q, H, d), k, v (total_k, H_kv, d),
    lse (H, total_q), and the host arrays table (int32 (n_blocks, 2): sequence, first row), cu (int32 (2, B + 1):
    cu_seqlens of queries and keys) and slopes; grid (table rows, H)."""
    ex = extras or PLAIN
    kernel = build(d, tile, causal, gqa=H_kv != H, features=ex.features(), varlen=True)
    opt = ex.arguments(causal, cu.shape[1] - 1, H, log2=True)
    args = ("q", "k", "v", "o", "lse", "table", "cu", H, np.float32(scale * LOG2E), opt.left, opt.right, opt.cap,
            "slopes", np.int64(0))
    return Launches([Launch(kernel, (len(table), H, 1), tile.threads, args)], {},
                    {"table": table, "cu": cu, "slopes": opt.slopes})


def signature(dtype: str, split: bool = False, varlen: bool = False) -> tuple:
    """The kernel's argument types for C-contiguous arrays of `dtype` ("float32" or "float16"): for compiling a
    build ahead of a launch (kernels/plan.py, kernels/info.py). split: float32 partial outputs."""
    from numba import int64, types

    dt = {"float32": float32, "float16": types.float16}[dtype]
    n = 3 if varlen else 4
    ins, out = types.Array(dt, n, "C"), types.Array(float32 if split else dt, n, "C")
    tables = types.Array(types.int32, 2, "C") if varlen else int64  # n_q, n_k: varlen's tables, else lengths
    return (ins, ins, ins, out, types.Array(float32, n - 1, "C"), tables, tables, int64, float32,
            *argument_types(), int64)
