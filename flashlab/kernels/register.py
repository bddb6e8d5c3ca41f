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

Index arithmetic is unsigned (U = uint64): Numba adds a negative-index check to every signed index, which
in the inner loops costs more instructions than the multiply-adds themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import config, float32, uint64

from ..device import get_cuda
from ..dropout import device_functions
from .common import FASTMATH, I, LN2, LOG2E, NEG, U
from .options import Extras, block_functions, score_functions
from .split_kv import grid, merge_split, split_chunk

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs


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


@lru_cache(maxsize=None)
def build(d: int, tile: Tile, causal: bool, unroll: int = 4, max_registers: int | None = None,
          split: bool = False, heavy_first: bool = False, gqa: bool = False, extras: Extras | None = None,
          varlen: bool = False):
    """Compile-time specialised kernel for (d, tile, causal). Numba compiles it on first launch,
    once per input dtype (float32 or float16).

    split: the kernel works on one chunk of keys per block (grid axis "splits") and o, lse are the float32
    partial outputs viewed as (B, H * splits, Nq, d) and (B, H * splits, Nq); heavy_first: the grid's axes
    are (B*H, splits, query blocks) instead of (query blocks, B*H, splits). See the module docstring.

    unroll: steps of the two product loops per loop iteration (4 measured best; deeper unrolling adds
    registers, benchmarks/experiments/register_experiments.py); max_registers: a cap for the compiler (None: its own
    choice; a low cap spills). extras: the FlashAttention library's window, alignment, ALiBi, softcap and dropout
    probability (`Extras`), compiled in as constants; None builds the plain kernel, unchanged. Every build takes
    the dropout seed as its last argument (a runtime int64, so a new seed per step needs no new compile); builds
    without dropout ignore it. varlen: the packed build (see the module docstring): its n_q argument is the
    int32 block table (n_blocks, 2) of (sequence, first row) and n_k the int32 (2, batch + 1) array of
    cu_seqlens_q and cu_seqlens_k; q, o are (total_q, H, d), k, v (total_k, H_kv, d), lse (H, total_q)."""
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
        raise ValueError(f"unroll must be a positive integer (steps per loop iteration); got {unroll!r}")
    if max_registers is not None and (isinstance(max_registers, bool) or not isinstance(max_registers, int)
                                      or not 16 <= max_registers <= 255):
        raise ValueError(f"max_registers must be None or an integer from 16 to 255 (a thread's limit); "
                         f"got {max_registers!r}")
    BR, BC, TR, TC = tile.block_q, tile.block_k, tile.tr, tile.tc
    RM, RN, RD = tile.micro(d)  # ints: local array shapes must be signed constants
    VM, VN, VD = _vec(RM), _vec(RN), _vec(RD)
    # Thread (ty, tx) owns row   (ii*TR + ty)*VM + u  for ii < RM/VM, u < VM   (ty*RM + i when RM = VM)
    #                   key    (jj*TC + tx)*VN + u  for jj < RN/VN, u < VN
    #                   O dim  (jj*TC + tx)*VD + u  for jj < RD/VD, u < VD
    # so a warp's vector loads cover consecutive 16-byte chunks: no bank conflicts.
    D, NT = U(d), U(TR * TC)
    QS, KS, PS, VS, RS = U(BR + 4), U(BC + 4), U(BR + 4), U(d + 8), U(BR + 4)  # padded row strides
    KP = D * QS  # offsets of Kt/Pt, V and red in the one shared buffer
    VO = KP + max(D * KS, U(BC) * PS)
    RO = VO + U(BC) * VS
    SH = int(RO + U(TC) * RS)
    Q_LOADS, KV_LOADS = U(-(-BR * d // (TR * TC))), U(-(-BC * d // (TR * TC)))
    UBR, UBC, UTR, UTC = U(BR), U(BC), U(TR), U(TC)
    UVM, UVN, UVD = U(VM), U(VN), U(VD)
    URM, URN, URD = U(RM), U(RN), U(RD)
    XSTEP = U(math.gcd(unroll, d))  # product loops unrolled `unroll` deep (an inner loop of constant length)
    CSTEP = U(math.gcd(unroll, BC))
    KV_REGS = int(KV_LOADS) if tile.prefetch else 1
    PREFETCH = tile.prefetch
    ALIGN = None if config.ENABLE_CUDASIM else 16  # the simulator has no aligned shared arrays
    CAUSAL = causal
    SPLIT, HEAVY = bool(split), bool(heavy_first)
    GUARD = SPLIT and CAUSAL  # a row can see no key of its chunk: keep its p = 0 and its output finite
    HALF_NEG = float32(0.5 * NEG)

    options = {"max_registers": max_registers} if max_registers is not None and not config.ENABLE_CUDASIM else {}

    GQA = bool(gqa)
    EXTRA = extras is not None
    ex = extras or Extras()
    CAPL = float32(ex.softcap * LOG2E)  # softcap in log2 units: S is kept scaled by log2(e)
    ALIBI, PER_B = ex.slopes is not None, bool(ex.per_batch)
    SLOPES = tuple(float(x) * LOG2E for x in (ex.slopes or (0.0,)))
    RIGHT = I(ex.right_bound(causal))
    VARLEN = bool(varlen)
    if VARLEN and (split or heavy_first):
        raise ValueError("the varlen build orders its blocks itself and does not split the keys")
    # windows (and bottom-right causal with Nq > Nk) leave rows with no key; so does a varlen sequence with no key
    GUARD = GUARD or EXTRA or VARLEN
    INF = float32(math.inf)
    DROP = ex.dropout_p > 0
    d_start, d_mix, d_keep = device_functions(ex.dropout_p)
    capped, outside = score_functions(ex, causal)
    query_block, key_range = block_functions(ex, causal, EXTRA, BR, BC, HEAVY, SPLIT)
    ZR = RM if DROP else 1

    @cuda.jit(fastmath=FASTMATH, **options)
    def flash_fwd_register(q, k, v, o, lse, n_q, n_k, n_heads, scale_log2, seed):
        sh = cuda.shared.array(SH, float32, alignment=ALIGN)
        t = U(cuda.threadIdx.x)
        ty = t // UTC
        tx = t % UTC
        q0, bh, part, n_parts = query_block(q.shape[0], n_heads)
        if VARLEN:  # block x: (sequence b, first row q0) from the table; its rows and keys from cu_seqlens
            b, h = U(n_q[cuda.blockIdx.x, 0]), bh
            q0, cq, ck = U(n_q[cuda.blockIdx.x, 1]), U(n_k[0, b]), U(n_k[1, b])
            nq, nk = U(n_k[0, b + U(1)]) - cq, U(n_k[1, b + U(1)]) - ck
            bh = b * U(n_heads) + h  # as if batched: the dropout key and per-batch ALiBi use sequence b
            hk = h * U(k.shape[1]) // U(n_heads) if GQA else h
            qh, kh, vh = q[cq:cq + nq, h], k[ck:ck + nk, hk], v[ck:ck + nk, hk]
        elif GQA:  # query head h reads K/V head h // (H / H_kv); a build of its own, so MHA's code is unchanged
            nq, nk = U(n_q), U(n_k)
            b, h = bh // U(n_heads), bh % U(n_heads)
            hk = h * U(k.shape[1]) // U(n_heads)
            qh, kh, vh = q[b, h], k[b, hk], v[b, hk]
        else:
            nq, nk = U(n_q), U(n_k)
            qh, kh, vh = q[bh // U(n_heads), bh % U(n_heads)], k[bh // U(n_heads), bh % U(n_heads)], \
                v[bh // U(n_heads), bh % U(n_heads)]  # this head's (N, d) matrices

        # Q tile -> shared, transposed and scaled (S comes out in log2 units); rows past Nq are zeros.
        for it in range(Q_LOADS):
            e = it * NT + t
            if e < UBR * D:
                r = (e // U(8)) % UBR  # element e of the tile: row r, dim x (runs of 8 dims per row)
                x = (e // U(8)) // UBR * U(8) + e % U(8)
                val = float32(0.0)
                if q0 + r < nq:
                    val = float32(qh[q0 + r, x]) * scale_log2
                sh[x * QS + r] = val

        m = cuda.local.array(RM, float32)  # running row max (log2 units)
        l = cuda.local.array(RM, float32)  # this thread's share of the running row sum
        acc = cuda.local.array((RM, RD), float32)  # unnormalised O
        s = cuda.local.array((RM, RN), float32)  # S, then P
        a = cuda.local.array(RM, float32)
        bk = cuda.local.array(RN, float32)
        bv = cuda.local.array(RD, float32)
        for i in range(URM):
            m[i] = NEG
            l[i] = 0.0
            for j in range(URD):
                acc[i, j] = 0.0
        zrow = cuda.local.array(ZR, uint64)  # dropout: the hash state of each of this thread's rows
        if DROP:  # keyed by (seed, batch, query head, row, col) as flashlab.dropout: (seed, b, h) once per block
            zh = d_start(seed, bh // U(n_heads), bh % U(n_heads))
            for i in range(URM):
                zrow[i] = d_mix(zh, q0 + ((i // UVM) * UTR + ty) * UVM + i % UVM)

        k_begin, k_end, off = key_range(q0, part, n_parts, nq, nk)  # the chunk, cut to causal or the band
        slope = float32(0.0)
        if EXTRA:
            if ALIBI:
                if GQA or VARLEN:
                    bb, hh = b, h
                else:
                    bb, hh = bh // U(n_heads), bh % U(n_heads)
                slope = float32(SLOPES[bb * U(n_heads) + hh if PER_B else hh])
        kreg = cuda.local.array(KV_REGS, float32)  # prefetched K/V values (PREFETCH only)
        vreg = cuda.local.array(KV_REGS, float32)
        if PREFETCH:
            for it in range(KV_LOADS):
                e = it * NT + t
                c = k_begin + (e // U(8)) % UBC
                x = (e // U(8)) // UBC * U(8) + e % U(8)
                kreg[it] = 0.0
                vreg[it] = 0.0
                if e < UBC * D and c < nk:
                    kreg[it] = float32(kh[c, x])
                    vreg[it] = float32(vh[c, x])
        for k0 in range(k_begin, k_end, UBC):
            cuda.syncthreads()  # everyone is done with the previous tile's Pt and V
            for it in range(KV_LOADS):  # each 8 threads read one 32-byte run of a row
                e = it * NT + t
                if e < UBC * D:
                    c = (e // U(8)) % UBC
                    x = (e // U(8)) // UBC * U(8) + e % U(8)
                    kval = float32(0.0)
                    vval = float32(0.0)  # zeros past Nk: 0 * garbage could be NaN
                    if PREFETCH:
                        kval = kreg[it]
                        vval = vreg[it]
                    elif k0 + c < nk:
                        kval = float32(kh[k0 + c, x])
                        vval = float32(vh[k0 + c, x])
                    sh[KP + x * KS + c] = kval
                    sh[VO + c * VS + x] = vval
            cuda.syncthreads()
            if PREFETCH:  # start the next tile's loads now; they land while this tile is computed
                for it in range(KV_LOADS):
                    e = it * NT + t
                    c = k0 + UBC + (e // U(8)) % UBC
                    x = (e // U(8)) // UBC * U(8) + e % U(8)
                    kreg[it] = 0.0
                    vreg[it] = 0.0
                    if e < UBC * D and c < nk:
                        kreg[it] = float32(kh[c, x])
                        vreg[it] = float32(vh[c, x])

            # S micro-tile = Q K^T: per x, RM + RN shared reads (vector loads) for RM*RN FMAs.
            for i in range(URM):
                for j in range(URN):
                    s[i, j] = 0.0
            for x0 in range(U(0), D, XSTEP):
                for xx in range(XSTEP):
                    x = x0 + xx
                    for i in range(URM):
                        a[i] = sh[x * QS + ((i // UVM) * UTR + ty) * UVM + i % UVM]
                    for j in range(URN):
                        bk[j] = sh[KP + x * KS + ((j // UVN) * UTC + tx) * UVN + j % UVN]
                    for i in range(URM):
                        for j in range(URN):
                            s[i, j] += a[i] * bk[j]

            if EXTRA:  # softcap, ALiBi, then the aligned causal/window mask, on every tile
                for i in range(URM):
                    pos = I(q0 + ((i // UVM) * UTR + ty) * UVM + i % UVM) + off
                    for j in range(URN):
                        col = I(k0 + ((j // UVN) * UTC + tx) * UVN + j % UVN)
                        val, _ = capped(s[i, j], pos, col, CAPL, slope)
                        s[i, j] = NEG if outside(pos, col, I(nk), RIGHT) else val
            elif k0 + UBC > nk or (CAUSAL and k0 + UBC > q0 + U(1)):  # only edge tiles need masking
                for i in range(URM):
                    row = q0 + ((i // UVM) * UTR + ty) * UVM + i % UVM
                    for j in range(URN):
                        col = k0 + ((j // UVN) * UTC + tx) * UVN + j % UVN
                        if col >= nk or (CAUSAL and col > row):
                            s[i, j] = NEG
            for i in range(URM):  # this thread's row maxima, shared with the row's other tc threads
                mx = s[i, 0]
                for j in range(U(1), URN):
                    mx = max(mx, s[i, j])
                sh[RO + tx * RS + ((i // UVM) * UTR + ty) * UVM + i % UVM] = mx
            cuda.syncthreads()

            for i in range(URM):
                rl = ((i // UVM) * UTR + ty) * UVM + i % UVM  # row within the tile
                m_new = m[i]
                for t2 in range(UTC):
                    m_new = max(m_new, sh[RO + t2 * RS + rl])
                alpha = math.exp2(m[i] - m_new)  # rescales what was accumulated so far
                m[i] = m_new
                live = float32(1.0)
                if GUARD and m_new < HALF_NEG:  # every key so far is masked: exp2(NEG - NEG) would be 1
                    live = float32(0.0)
                row_sum = float32(0.0)
                for j in range(URN):
                    p = math.exp2(s[i, j] - m_new)
                    if GUARD:
                        p *= live
                    row_sum += p
                    cl = ((j // UVN) * UTC + tx) * UVN + j % UVN
                    if DROP:  # after the row sum: l and lse are dropout-free, only P V sees the mask
                        p *= d_keep(zrow[i], k0 + cl)
                    sh[KP + cl * PS + rl] = p  # Pt overwrites Kt: every thread is past its S loop
                l[i] = l[i] * alpha + row_sum
                for j in range(URD):
                    acc[i, j] *= alpha
            cuda.syncthreads()

            # O micro-tile += P V: per key c, RM + RD shared reads for RM*RD FMAs.
            for c0 in range(U(0), UBC, CSTEP):
                for cc in range(CSTEP):
                    c = c0 + cc
                    for i in range(URM):
                        a[i] = sh[KP + c * PS + ((i // UVM) * UTR + ty) * UVM + i % UVM]
                    for j in range(URD):
                        bv[j] = sh[VO + c * VS + ((j // UVD) * UTC + tx) * UVD + j % UVD]
                    for i in range(URM):
                        for j in range(URD):
                            acc[i, j] += a[i] * bv[j]

        # l: add up the tc partial sums of each row, then normalise once and write O and lse.
        cuda.syncthreads()
        for i in range(URM):
            sh[RO + tx * RS + ((i // UVM) * UTR + ty) * UVM + i % UVM] = l[i]
        cuda.syncthreads()
        if VARLEN:
            oh, lh = o[cq:cq + nq, h], lse[h, cq:cq + nq]
        else:
            ob, oh_ = bh // U(n_heads), bh % U(n_heads)
            if SPLIT:
                oh_ = oh_ * n_parts + part  # o, lse: (B, H * splits, ...) views of the partial outputs
            oh, lh = o[ob, oh_], lse[ob, oh_]
        for i in range(URM):
            rl = ((i // UVM) * UTR + ty) * UVM + i % UVM
            total = float32(0.0)
            for t2 in range(UTC):
                total += sh[RO + t2 * RS + rl]
            if q0 + rl < nq:
                inv = float32(0.0)  # GUARD: the row sees no key of this chunk (total = 0)
                row_lse = float32(NEG)
                if (EXTRA or VARLEN) and not SPLIT:
                    row_lse = INF  # no key at all: the FA library's o = 0, lse = +inf
                if not GUARD or total > float32(0.0):
                    inv = float32(1.0) / total
                    row_lse = (m[i] + math.log2(total)) * LN2
                for j in range(URD):
                    oh[q0 + rl, ((j // UVD) * UTC + tx) * UVD + j % UVD] = acc[i, j] * inv
                if tx == U(0):
                    lh[q0 + rl] = row_lse

    return flash_fwd_register


def launch(q, k, v, o, lse, n_heads, scale, causal, tile: Tile, *, splits: int = 1, heavy_first: bool = False,
           section=None, alloc=None, extras=None, seed=0, **options):
    """Launch on device arrays (B, H, N, d); o and lse are written. options: build's unroll, max_registers.
    seed: the dropout seed (used when extras has dropout_p > 0).

    splits > 1: split-KV (the float32 partial outputs come from alloc(shape, dtype), default a numba device
    array, and the merge kernel writes o and lse); heavy_first: see `grid`."""
    B, H, Nq, d = q.shape
    splits = split_chunk(k.shape[2], splits, tile.block_k)[1]
    split = splits > 1
    kernel = build(d, tile, causal, split=split, heavy_first=heavy_first, gqa=k.shape[1] != H, extras=extras,
                   **options)
    g = grid(B, H, Nq, tile.block_q, splits, heavy_first, section)
    scale_log2, seed = np.float32(scale * LOG2E), np.int64(seed)
    if not split:
        kernel[g, tile.threads](q, k, v, o, lse, Nq, k.shape[2], n_heads, scale_log2, seed)
        return kernel
    merge_split(lambda o_part, lse_part: kernel[g, tile.threads](q, k, v, o_part, lse_part, Nq, k.shape[2], n_heads,
                                                                 scale_log2, seed), o, lse, splits, alloc)
    return kernel
