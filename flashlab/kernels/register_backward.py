"""FlashAttention-2 backward as Numba-CUDA kernels (arXiv 2307.08691, Algorithm 2).

Three launches; none holds an Nq x Nk array, so memory grows linearly with N:

1. `preprocess`: D_i = rowsum(dO_i * O_i) per query row, and dQ's float32 accumulator set to zero.
2. `dkdv` (the main kernel): one thread block per (batch*head, key block j). K_j and V_j sit in shared
   memory, dK_j and dV_j in registers. The block walks over the query blocks i that can see key block j
   (causal: it starts at the diagonal), recomputes P_ij = exp(scale * Q_i K_j^T - lse_i) and
   dS_ij = P_ij * (dO_i V_j^T - D_i), accumulates dV_j += P_ij^T dO_i and dK_j += scale * dS_ij^T Q_i,
   and adds its share scale * dS_ij K_j of dQ_i into HBM with float32 atomics.
3. `cast`: dQ from float32 to float16 (float16 inputs only).

Why atomics for dQ: a second kernel looping over key blocks per query block would recompute S and dP,
3 more matrix products on top of these 5 (+60% FLOPs). The atomics cost one float32 add per 10 * block_k
FLOPs, spread over L2. The price: dQ's rounding depends on the order in which blocks finish, so dQ is not
bit-reproducible from run to run (dK and dV are).

Every kernel is made by a cached factory for one (d, block_q, block_k, threads) and the options it compiles in
(options.Features; their values are dkdv's arguments, so a new window or slope set compiles nothing): the sizes
are closure constants (Traits), so per-thread tiles are `cuda.local.array`s of compile-time size whose loops fully
unroll and stay in registers. dkdv is a list of steps bound once per build and inlined by Numba
(inline="always"). No warp shuffles: the same code runs in Numba's CUDA simulator. `launches` describes the
three launches once, for the general and the prepared path.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import float32, uint64

from ..device import get_cuda
from ..dropout import device_functions as dropout_functions
from ._launch import Arg, Launch, Launches
from .common import I
from .options import Features, OptionArgs, argument_types, device_functions

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs

SMEM_LIMIT = 48 * 1024  # bytes of static shared memory per block (more needs dynamic shared memory)

# (block_q, block_k, threads) per d on a GPU. d = 64 and 128: the fastest of the tile sweep in
# docs/runs/backward-fp32.md (H200); d = 16 and 32 were not swept.
GPU_CONFIG = {16: (32, 64, 128), 32: (32, 64, 128), 64: (32, 32, 64), 128: (16, 16, 64)}
# The simulator runs one OS thread per CUDA thread: small blocks keep it quick.
SIM_CONFIG = (8, 16, 32)


def tile_split(rows: int, cols: int, threads: int):
    """Share a rows x cols tile among `threads`: each owns tile_r x tile_c entries.

    Thread t sits at (t // n_c, t % n_c) and owns rows y + n_r*a and columns x + n_c*b (interleaved, so a
    warp touches neighbouring columns). Picks the split with the fewest shared-memory loads per step of
    the product loop (tile_r + tile_c), then the most threads along columns. Returns
    (tile_r, tile_c, n_r, n_c), or None when no split fits.
    """
    best = None
    n_c = 1
    while n_c <= threads:
        n_r = threads // n_c
        if threads % n_c == 0 and cols % n_c == 0 and rows % n_r == 0:
            cand = (rows // n_r, cols // n_c, n_r, n_c)
            if best is None or (cand[0] + cand[1], -n_c) < (best[0] + best[1], -best[3]):
                best = cand
        n_c *= 2
    return best


def shared_bytes(d: int, block_q: int, block_k: int) -> int:
    """Static shared memory of the main kernel: K_j, V_j, Q_i, dO_i (rows padded to d+1), P_ij/dS_ij, lse_i, D_i."""
    return 4 * (2 * block_k * (d + 1) + 2 * block_q * (d + 1) + block_q * (block_k + 1) + 2 * block_q)


def check_config(d: int, block_q: int, block_k: int, threads: int):
    """ValueError unless (block_q, block_k, threads) gives every phase an even split and fits shared memory."""
    need = shared_bytes(d, block_q, block_k)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"block_q={block_q}, block_k={block_k} need {need} bytes of shared memory at d={d}; "
            f"the limit is {SMEM_LIMIT} (try smaller blocks, e.g. {GPU_CONFIG[d][:2]})"
        )
    for what, rows, cols in (("S_ij", block_q, block_k), ("dK_j/dV_j", block_k, d), ("dQ_i", block_q, d)):
        if tile_split(rows, cols, threads) is None:
            raise ValueError(
                f"threads={threads} cannot share the {rows} x {cols} tile {what} evenly "
                f"(block_q={block_q}, block_k={block_k}, d={d}); use powers of two with threads <= block_q * block_k"
            )


@dataclass(frozen=True)
class Traits:
    """The main kernel's tile constants, derived once from (d, block_q, block_k, threads): each product's
    per-thread tile (tile_split: rows, cols per thread; threads along rows, cols) for S_ij and dP_ij (Br x Bc),
    dK_j and dV_j (Bc x d) and the block's share of dQ_i (Br x d), and the shared arrays' shapes, rows padded
    by one word so that threads of a warp reading one column of different rows hit different banks."""
    d: int
    block_q: int
    block_k: int
    threads: int

    @property
    def s(self):
        return tile_split(self.block_q, self.block_k, self.threads)

    @property
    def kv(self):
        return tile_split(self.block_k, self.d, self.threads)

    @property
    def dq(self):
        return tile_split(self.block_q, self.d, self.threads)

    @property
    def shapes(self):
        """(K_j and V_j, Q_i and dO_i, P_ij) in shared memory."""
        return (self.block_k, self.d + 1), (self.block_q, self.d + 1), (self.block_q, self.block_k + 1)


@functools.lru_cache(maxsize=None)
def make_kernels(d: int, block_q: int, block_k: int, threads: int, heavy_first: bool = False, gqa: bool = False,
                 features: Features = Features(), varlen: bool = False):
    """(preprocess, dkdv, cast) kernels specialised for one head dim and tile shape.

    features: the library's options a build compiles in (options.Features); their values are dkdv's arguments
    left, right, cap, slopes (options.OptionArgs, raw score units: Extras.arguments(causal, B, H, log2=False)),
    which a plain build ignores (pass options.plain_arguments(causal)). The dropout seed is dkdv's last argument
    (int64, ignored without dropout): the mask is regenerated from it, never stored.

    dkdv(q, k, v, do, lse, D, dq, dk, dv, scale, causal, blocks, cu, left, right, cap, slopes, seed): blocks and
    cu are read by the varlen build only (other builds take 0, 0). varlen: one launch over a packed batch
    (kernels/varlen_backward.py). The arrays are the packed ones viewed as batch 1, q (1, H, total_q, d),
    k (1, H_kv, total_k, d), lse (1, H, total_q); the grid is (len(blocks), H or H_kv under gqa, 1); blocks is an
    int32 table (n, 2) of (sequence b, first key k0 within it), cu the int32 (2, batch + 1) [cu_seqlens_q;
    cu_seqlens_k]. A block sees only its sequence's rows, so masks, alignment and band skipping work per sequence;
    dropout and ALiBi take b.

    heavy_first: dkdv's grid is (g, key blocks, B*H/g sections) instead of (key blocks, H, B): heads in
    sections of g, and under causal masking (where key block j has the most query blocks to visit when j is
    small) every head of a section has its heaviest blocks dispatched before any lighter one; see
    kernels/plan.py."""
    check_config(d, block_q, block_k, threads)
    if heavy_first and varlen:
        raise ValueError("heavy_first and varlen exclude each other: varlen's block table sets the order")
    t = Traits(d, block_q, block_k, threads)
    s_tr, s_tc, s_nr, s_nc = t.s
    kv_tr, kv_td, kv_nr, kv_nd = t.kv
    q_tr, q_td, q_nr, q_nd = t.dq
    n_s, n_kv, n_q = s_tr * s_tc, kv_tr * kv_td, q_tr * q_td  # plain ints size the local arrays ...
    SK, SQ, SP = t.shapes
    # ... and unsigned constants do the index arithmetic. Numba wraps negative indices the Python way,
    # three integer instructions per shared-memory load, unless the index is unsigned. (Numba turns
    # uint64 mixed with int64 into float64, so every index here is uint64.) The hot loops are `while`
    # loops: LLVM unrolls those without the bookkeeping of Numba's `range`.
    u = np.uint64
    Br, Bc, NT, Dh, ZERO, ONE = u(block_q), u(block_k), u(threads), u(d), u(0), u(1)
    S_TR, S_TC, S_NR, S_NC = u(s_tr), u(s_tc), u(s_nr), u(s_nc)
    KV_TR, KV_TD, KV_NR, KV_ND = u(kv_tr), u(kv_td), u(kv_nr), u(kv_nd)
    Q_TR, Q_TD, Q_NR, Q_ND = u(q_tr), u(q_td), u(q_nr), u(q_nd)
    K_ELEMS, Q_ELEMS = u(block_k * d), u(block_q * d)
    OPTIONS, BOTTOM_RIGHT, SOFTCAP, ALIBI = features.any, bool(features.bottom_right), bool(features.softcap), \
        bool(features.alibi)
    DROP = features.dropout
    n_t = n_s if SOFTCAP else 1  # tanh of each capped score, for dS's factor 1 - tanh^2
    n_z = s_tr if DROP else 1  # dropout: the hash state of each of this thread's rows of S_ij
    opt = device_functions(features)
    d_start, d_mix, d_keep = dropout_functions(features.dropout_p)
    place = _place(gqa, heavy_first, Bc)
    sequence = _sequence(varlen)
    head_of = _head_of(gqa)

    @cuda.jit(device=True, inline="always")
    def load_kv(k, v, Ks, Vs, batch, hk, k0, nk, tid):
        """K_j, V_j to shared memory, coalesced (consecutive threads read consecutive features); zero past Nk."""
        idx = tid
        while idx < K_ELEMS:
            c, e = idx // Dh, idx % Dh
            inside = k0 + c < nk
            Ks[c, e] = float32(k[batch, hk, k0 + c, e]) if inside else float32(0)
            Vs[c, e] = float32(v[batch, hk, k0 + c, e]) if inside else float32(0)
            idx += NT

    @cuda.jit(device=True, inline="always")
    def load_q(q, do, lse, D, Qs, dOs, Ls, Ds, batch, head, q0, nq, tid):
        """Q_i, dO_i, lse_i and D_i to shared memory; zero past Nq."""
        idx = tid
        while idx < Q_ELEMS:
            r, e = idx // Dh, idx % Dh
            inside = q0 + r < nq
            Qs[r, e] = float32(q[batch, head, q0 + r, e]) if inside else float32(0)
            dOs[r, e] = float32(do[batch, head, q0 + r, e]) if inside else float32(0)
            idx += NT
        if tid < Br:
            inside = q0 + tid < nq
            Ls[tid] = lse[batch, head, q0 + tid] if inside else float32(0)
            Ds[tid] = D[batch, head, q0 + tid] if inside else float32(0)

    @cuda.jit(device=True, inline="always")
    def scores(Qs, dOs, Ks, Vs, S, dP, qa, oa, sy, sx):
        """S_ij = Q_i K_j^T and dP_ij = dO_i V_j^T: an S_TR x S_TC register tile of each."""
        for n in range(n_s):
            S[n] = 0
            dP[n] = 0
        x = ZERO
        while x < Dh:
            for a in range(S_TR):
                qa[a] = Qs[sy + S_NR * a, x]
                oa[a] = dOs[sy + S_NR * a, x]
            for b in range(S_TC):
                kb = Ks[sx + S_NC * b, x]
                vb = Vs[sx + S_NC * b, x]
                for a in range(S_TR):
                    S[a * S_TC + b] += qa[a] * kb
                    dP[a * S_TC + b] += oa[a] * vb
            x += ONE

    @cuda.jit(device=True, inline="always")
    def plain_band(row, off, nq, nk, left, right):
        return I(0), I(0)  # unused: plain_p masks by itself

    @cuda.jit(device=True, inline="always")
    def options_band(row, off, nq, nk, left, right):
        """[lo, hi): the keys query row `row` (at aligned position row + off) sees (options.key_band of one row);
        none past Nq."""
        pos = I(row) + off
        lo, hi = opt.key_band(pos, pos, I(nk), left, right)
        return lo, hi if row < nq else lo

    @cuda.jit(device=True, inline="always")
    def plain_p(s, scale, lse, row, col, off, nq, nk, causal, lo, hi, cap, slope):
        """(P, 0): P = exp(scale S - lse), zero past Nq, past Nk and (causal) right of the diagonal. Unsigned
        comparisons: the signed ones of options_p cost the plain build registers."""
        if row < nq and col < nk and (not causal or col <= row):
            return math.exp(s * scale - lse), float32(0)
        return float32(0), float32(0)

    @cuda.jit(device=True, inline="always")
    def options_p(s, scale, lse, row, col, off, nq, nk, causal, lo, hi, cap, slope):
        """(P, tanh): P from the score as the forward transformed it (softcap, ALiBi), zero outside the row's
        keys [lo, hi); the softcap's tanh(s / cap), for dS."""
        sc, th = opt.capped(s * scale, I(row) + off, I(col), cap, slope)
        if lo <= I(col) and I(col) < hi:
            return math.exp(sc - lse), th
        return float32(0), th

    # The band once per row, not per entry: a smaller loop body, which the compiler still unrolls fully (S_ij,
    # dP_ij in registers, not local memory).
    band_of, p_of = (options_band, options_p) if features.per_score else (plain_band, plain_p)

    @cuda.jit(device=True, inline="always")
    def probs(S, dP, Ps, Th, zrow, Ls, q0, k0, nq, nk, sy, sx, scale, causal, off, left, right, cap, slope, zh):
        """S_ij becomes P_ij (undropped: dS uses it), Ps gets P_ij times dropout's Z / (1-p) (dV takes that), and
        dP_ij reaches P only through the kept entries."""
        for a in range(S_TR):
            r = sy + S_NR * a
            if DROP:
                zrow[a] = d_mix(zh, q0 + r)
            lo, hi = band_of(q0 + r, off, nq, nk, left, right)
            for b in range(S_TC):
                c = sx + S_NC * b
                p, th = p_of(S[a * S_TC + b], scale, Ls[r], q0 + r, k0 + c, off, nq, nk, causal, lo, hi, cap, slope)
                if SOFTCAP:
                    Th[a * S_TC + b] = th
                S[a * S_TC + b] = p
                if DROP:
                    z = d_keep(zrow[a], k0 + c)
                    p *= z
                    dP[a * S_TC + b] *= z
                Ps[r, c] = p

    @cuda.jit(device=True, inline="always")
    def grad_scores(S, dP, Ds, Th, Ps, sy, sx, scale):
        """dS_ij = P_ij * (dP_ij - D_i), stored times scale: both products after it need exactly that."""
        for a in range(S_TR):
            r = sy + S_NR * a
            for b in range(S_TC):
                ds = S[a * S_TC + b] * (dP[a * S_TC + b] - Ds[r]) * scale
                if SOFTCAP:  # d(cap tanh(s / cap)) / ds = 1 - tanh^2
                    th = Th[a * S_TC + b]
                    ds *= float32(1) - th * th
                Ps[r, sx + S_NC * b] = ds

    @cuda.jit(device=True, inline="always")
    def add_transposed(Ps, X, acc, pa, ky, kx):
        """acc += Ps^T X: dV_j += P_ij^T dO_i, then dK_j += scale * dS_ij^T Q_i."""
        r = ZERO
        while r < Br:
            for a in range(KV_TR):
                pa[a] = Ps[r, ky + KV_NR * a]
            for t_ in range(KV_TD):
                g = X[r, kx + KV_ND * t_]
                for a in range(KV_TR):
                    acc[a * KV_TD + t_] += pa[a] * g
            r += ONE

    @cuda.jit(device=True, inline="always")
    def add_dq(Ps, Ks, dQ, sa, dq, batch, head, q0, nq, qy, qx):
        """dQ_i += scale * dS_ij K_j: this key block's share, added atomically (many blocks share dQ_i)."""
        for n in range(n_q):
            dQ[n] = 0
        c = ZERO
        while c < Bc:
            for a in range(Q_TR):
                sa[a] = Ps[qy + Q_NR * a, c]
            for t_ in range(Q_TD):
                kc = Ks[c, qx + Q_ND * t_]
                for a in range(Q_TR):
                    dQ[a * Q_TD + t_] += sa[a] * kc
            c += ONE
        for a in range(Q_TR):
            i = q0 + qy + Q_NR * a
            if i < nq:
                for t_ in range(Q_TD):
                    cuda.atomic.add(dq, (batch, head, i, qx + Q_ND * t_), dQ[a * Q_TD + t_])

    @cuda.jit(device=True, inline="always")
    def store(dk, dv, dK, dV, batch, hk, k0, nk, ky, kx):
        """dK_j, dV_j to HBM in the output dtype (zero for keys no query sees)."""
        for a in range(KV_TR):
            c = k0 + ky + KV_NR * a
            if c < nk:
                for t_ in range(KV_TD):
                    e = kx + KV_ND * t_
                    dk[batch, hk, c, e] = dK[a * KV_TD + t_]
                    dv[batch, hk, c, e] = dV[a * KV_TD + t_]

    @cuda.jit(device=True, inline="always")
    def band_right(causal, right):
        """The band's right bound: the argument (causal folded in) with options; from causal in a plain build."""
        if OPTIONS:
            return right
        return I(0) if causal else I(-1)

    @cuda.jit(device=True, inline="always")
    def diagonal_tiles(k0, nq, nk, causal, off, left, right):
        """[first, end) of the query tiles whose rows can see this block's keys: from the diagonal's tile on under
        causal, else all. Unsigned, as the loop counts: the signed band below costs registers it does not need."""
        return (k0 // Br * Br if causal else ZERO), nq

    @cuda.jit(device=True, inline="always")
    def band_tiles(k0, nq, nk, causal, off, left, right):
        """The same with a window or bottom-right alignment: the tiles that overlap options.query_band."""
        lo, hi = opt.query_band(I(k0), I(min(k0 + Bc, nk)) - I(1), off, I(nq), left, right)
        return uint64(lo) // Br * Br, uint64(hi) if lo < hi else ZERO

    query_tiles = band_tiles if features.window or features.bottom_right else diagonal_tiles

    @cuda.jit(device=True, inline="always")
    def offset(nq, nk):
        """The alignment's shift of query positions: row i sits at i + Nk - Nq bottom-right, else at i."""
        return I(nk) - I(nq) if BOTTOM_RIGHT else I(0)

    @cuda.jit(device=True, inline="always")
    def slope_of(slopes, seq, head, n_heads):
        return float32(slopes[uint64(seq) * uint64(n_heads) + uint64(head)]) if ALIBI else float32(0)

    @cuda.jit(device=True, inline="always")
    def row_hash(seed, seq, head):
        """Dropout: the forward's mask, regenerated, keyed by (seed, batch, query head, row, col)."""
        return d_start(seed, seq, head) if DROP else uint64(0)

    @cuda.jit
    def preprocess(o, do, D, dq):
        """D[.., i] = sum_e dO[.., i, e] * O[.., i, e] and dq[.., i, :] = 0, one thread per query row."""
        head, batch = cuda.blockIdx.y, cuda.blockIdx.z
        i = uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x) + uint64(cuda.threadIdx.x)
        if i < uint64(o.shape[2]):
            acc = float32(0)
            for e in range(Dh):
                acc += float32(do[batch, head, i, e]) * float32(o[batch, head, i, e])
                dq[batch, head, i, e] = 0
            D[batch, head, i] = acc

    @cuda.jit
    def dkdv(q, k, v, do, lse, D, dq, dk, dv, scale, causal, blocks, cu, left, right, cap, slopes, seed):
        batch, hk, k0, n_group = place(q, k)
        q, k, v, do, lse, D, dq, dk, dv, seq, k0, nq, nk = sequence(q, k, v, do, lse, D, dq, dk, dv, batch, k0,
                                                                    blocks, cu)
        scale = float32(scale)
        tid = uint64(cuda.threadIdx.x)
        Ks = cuda.shared.array(SK, float32)
        Vs = cuda.shared.array(SK, float32)
        Qs = cuda.shared.array(SQ, float32)
        dOs = cuda.shared.array(SQ, float32)
        Ps = cuda.shared.array(SP, float32)  # P_ij, later overwritten by scale * dS_ij
        Ls = cuda.shared.array(block_q, float32)
        Ds = cuda.shared.array(block_q, float32)
        dK = cuda.local.array(n_kv, float32)
        dV = cuda.local.array(n_kv, float32)
        S = cuda.local.array(n_s, float32)
        dP = cuda.local.array(n_s, float32)
        qa = cuda.local.array(s_tr, float32)
        oa = cuda.local.array(s_tr, float32)
        pa = cuda.local.array(kv_tr, float32)
        dQ = cuda.local.array(n_q, float32)
        sa = cuda.local.array(q_tr, float32)
        Th = cuda.local.array(n_t, float32)
        zrow = cuda.local.array(n_z, uint64)

        load_kv(k, v, Ks, Vs, batch, hk, k0, nk, tid)
        for n in range(n_kv):
            dK[n] = 0
            dV[n] = 0
        # After the K/V tile's load, as their first use: placed before it, ptxas keeps them live across the load
        # loop and the d = 128 build takes 14 more registers (153 -> 167, sm_90).
        sy, sx = tid // S_NC, tid % S_NC  # this thread's place in S_ij
        ky, kx = tid // KV_ND, tid % KV_ND  # in dK_j / dV_j
        qy, qx = tid // Q_ND, tid % Q_ND  # in dQ_i
        off, right = offset(nq, nk), band_right(causal, right)
        q_first, q_end = query_tiles(k0, nq, nk, causal, off, left, right)
        for gi in range(n_group):
            head = head_of(hk, n_group, gi)
            zh, slope = row_hash(seed, seq, head), slope_of(slopes, seq, head, q.shape[1])
            q0 = q_first
            while q0 < q_end:
                cuda.syncthreads()  # everyone is done with the previous Q_i, dO_i, P_ij
                load_q(q, do, lse, D, Qs, dOs, Ls, Ds, batch, head, q0, nq, tid)
                cuda.syncthreads()
                scores(Qs, dOs, Ks, Vs, S, dP, qa, oa, sy, sx)
                probs(S, dP, Ps, Th, zrow, Ls, q0, k0, nq, nk, sy, sx, scale, causal, off, left, right, cap, slope,
                      zh)
                cuda.syncthreads()
                add_transposed(Ps, dOs, dV, pa, ky, kx)  # dV_j += P_ij^T dO_i
                cuda.syncthreads()
                grad_scores(S, dP, Ds, Th, Ps, sy, sx, scale)
                cuda.syncthreads()
                add_transposed(Ps, Qs, dK, pa, ky, kx)  # dK_j += scale * dS_ij^T Q_i
                add_dq(Ps, Ks, dQ, sa, dq, batch, head, q0, nq, qy, qx)
                q0 += Br
        store(dk, dv, dK, dV, batch, hk, k0, nk, ky, kx)

    @cuda.jit
    def cast(src, dst):
        """dst[i] = src[i] over flat arrays: dQ's float32 accumulator into a float16 result."""
        i = cuda.grid(1)
        if i < src.shape[0]:
            dst[i] = src[i]

    return preprocess, dkdv, cast


def _place(gqa: bool, heavy: bool, Bc):
    """place(q, k) -> (batch, K/V head, first key k0, query heads per K/V head): where a dkdv block works.
    gqa (a build of its own, so that MHA's code is unchanged): one block per (key block, K/V head) walks the query
    blocks of every query head of its group, so dK_j and dV_j add up in registers."""
    if gqa:
        @cuda.jit(device=True, inline="always")
        def place(q, k):  # grid (key blocks, H_kv, B)
            return (uint64(cuda.blockIdx.z), uint64(cuda.blockIdx.y), uint64(cuda.blockIdx.x) * Bc,
                    uint64(q.shape[1]) // uint64(k.shape[1]))
    elif heavy:
        @cuda.jit(device=True, inline="always")
        def place(q, k):  # grid (g, key blocks, sections)
            bh = uint64(cuda.blockIdx.z) * uint64(cuda.gridDim.x) + uint64(cuda.blockIdx.x)
            return bh // uint64(q.shape[1]), bh % uint64(q.shape[1]), uint64(cuda.blockIdx.y) * Bc, uint64(1)
    else:
        @cuda.jit(device=True, inline="always")
        def place(q, k):  # grid (key blocks, H, B)
            return cuda.blockIdx.z, cuda.blockIdx.y, uint64(cuda.blockIdx.x) * Bc, uint64(1)
    return place


def _sequence(varlen: bool):
    """sequence(q, k, v, do, lse, D, dq, dk, dv, batch, k0, blocks, cu) -> (the arrays, the batch index of dropout
    and ALiBi, k0, Nq, Nk). varlen: batch is 0; the block's sequence and key block come from the host's table, and
    the arrays are viewed from the sequence's first row, so rows and keys are indexed within the sequence."""
    if not varlen:
        @cuda.jit(device=True, inline="always")
        def sequence(q, k, v, do, lse, D, dq, dk, dv, batch, k0, blocks, cu):
            return q, k, v, do, lse, D, dq, dk, dv, batch, k0, uint64(q.shape[2]), uint64(k.shape[2])
        return sequence

    @cuda.jit(device=True, inline="always")
    def sequence(q, k, v, do, lse, D, dq, dk, dv, batch, k0, blocks, cu):
        seq, k0 = uint64(blocks[cuda.blockIdx.x, 0]), uint64(blocks[cuda.blockIdx.x, 1])
        cq, ck = uint64(cu[0, seq]), uint64(cu[1, seq])
        nq, nk = uint64(cu[0, seq + uint64(1)]) - cq, uint64(cu[1, seq + uint64(1)]) - ck
        return (q[:, :, cq:], k[:, :, ck:], v[:, :, ck:], do[:, :, cq:], lse[:, :, cq:], D[:, :, cq:], dq[:, :, cq:],
                dk[:, :, ck:], dv[:, :, ck:], seq, k0, nq, nk)
    return sequence


def _head_of(gqa: bool):
    """head_of(hk, n_group, gi): the query head of a block's gi-th pass (gqa: gi of the K/V head's group)."""
    if gqa:
        @cuda.jit(device=True, inline="always")
        def head_of(hk, n_group, gi):
            return hk * n_group + gi
    else:
        @cuda.jit(device=True, inline="always")
        def head_of(hk, n_group, gi):
            return hk
    return head_of


# ------------------------------------------------------------------------------------- the launches
PREPROCESS_ROWS = {"gpu": 128, "simulator": 32}  # query rows (threads) per preprocess block


def launches(kernels, B: int, H: int, Nq: int, d: int, grid, threads: int, scale: float, causal: bool,
             args: OptionArgs, half: bool, rows: int, tables: bool = False):
    """The three launches of one call, described once (_launch.Launch) for the general and the prepared path:
    preprocess, dkdv (grid: the plan's, or (key blocks, H_kv, B)) and, for float16 (half), the cast of dQ's float32
    accumulator. Arrays by name: q, k, v, o, do, lse, slopes (args.slopes on the device), dk, dv, dq (the result)
    and the temporaries D and (half) dq_acc (name -> (shape, dtype)); the slopes are the description's host array,
    and the seed goes to dkdv (seeded=1).
    tables: the varlen build (kernels/varlen_backward.py), which also reads blocks and cu, casts "dq_packed" (the
    accumulator as packed, where dq_acc is its heads-major view) and gives its grids and views itself."""
    preprocess, dkdv, cast = kernels
    acc = "dq_acc" if half else "dq"
    temporaries = {"D": ((B, H, Nq), np.float32)}
    if half:
        temporaries["dq_acc"] = ((B, H, Nq, d), np.float32)
    n = B * H * Nq * d
    out = [Launch(preprocess, (-(-Nq // rows), H, B), rows, ("o", "do", "D", acc)),
           Launch(dkdv, tuple(grid), threads, ("q", "k", "v", "do", "lse", "D", acc, "dk", "dv", np.float32(scale),
                                                bool(causal), *(("blocks", "cu") if tables else (0, 0)),
                                                int(args.left), int(args.right), np.float32(args.cap), "slopes", 0))]
    if half:
        out.append(Launch(cast, (-(-n // 256),), 256, (Arg("dq_packed", (n,)) if tables else Arg(acc, (n,)),
                                                       Arg("dq", (n,)))))
    return Launches(out, temporaries, {"slopes": args.slopes}, seeded=1)


def signature(dtype: str):
    """dkdv's argument types for C-contiguous arrays of `dtype` ("float32" or "float16"; kernels/plan.py)."""
    from numba import float32 as f32, int64, types

    dt = {"float32": f32, "float16": types.float16}[dtype]
    a4, f3, f4 = types.Array(dt, 4, "C"), types.Array(f32, 3, "C"), types.Array(f32, 4, "C")
    # int64s: varlen's tables (unused here); then the options' values and the dropout seed
    return (a4, a4, a4, a4, f3, f3, f4, a4, a4, f32, types.boolean, int64, int64) + argument_types() + (int64,)


def default_config(d: int, simulator: bool = False):
    """(block_q, block_k, threads) used when the caller gives none."""
    return SIM_CONFIG if simulator else GPU_CONFIG[d]


