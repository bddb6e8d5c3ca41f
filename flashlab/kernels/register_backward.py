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

Every kernel is made by a cached factory for one (d, block_q, block_k, threads): the sizes are closure
constants, so per-thread tiles are `cuda.local.array`s of compile-time size whose loops fully unroll and
stay in registers. No warp shuffles: the same code runs in Numba's CUDA simulator.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..device import get_cuda
from ..dropout import device_functions
from .options import Extras, score_functions

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


@functools.lru_cache(maxsize=None)
def make_kernels(d: int, block_q: int, block_k: int, threads: int, heavy_first: bool = False, gqa: bool = False,
                 extras=None, varlen: bool = False):
    """(preprocess, dkdv, cast) kernels specialised for one head dim and tile shape.

    extras: the library's window, alignment, ALiBi, softcap and dropout probability (kernels/register.py's
    Extras), compiled in; None builds the plain kernels, unchanged. dkdv takes the dropout seed as its last
    argument (int64, ignored without dropout): the mask is regenerated from it, never stored.

    dkdv(q, k, v, do, lse, D, dq, dk, dv, scale, causal, blocks, cu, seed): blocks and cu are read by the varlen
    build only (other builds take 0, 0). varlen: one launch over a packed batch (kernels/varlen_backward.py). The
    arrays are the packed ones viewed as batch 1, q (1, H, total_q, d), k (1, H_kv, total_k, d), lse (1, H,
    total_q); the grid is (len(blocks), H or H_kv under gqa, 1); blocks is an int32 table (n, 2) of (sequence b,
    first key k0 within it), cu the int32 (2, batch + 1) [cu_seqlens_q; cu_seqlens_k]. A block sees only its
    sequence's rows, so masks, alignment and band skipping work per sequence; dropout and per-batch ALiBi take b.

    heavy_first: dkdv's grid is (g, key blocks, B*H/g sections) instead of (key blocks, H, B): heads in
    sections of g, and under causal masking (where key block j has the most query blocks to visit when j is
    small) every head of a section has its heaviest blocks dispatched before any lighter one; see
    kernels/plan.py."""
    check_config(d, block_q, block_k, threads)
    from numba import float32, uint64

    # Per-thread tiles of the three products (see tile_split): S_ij and dP_ij are Br x Bc, dK_j and dV_j
    # are Bc x d, the block's share of dQ_i is Br x d. Plain ints size the arrays ...
    s_tr, s_tc, s_nr, s_nc = tile_split(block_q, block_k, threads)
    kv_tr, kv_td, kv_nr, kv_nd = tile_split(block_k, d, threads)
    q_tr, q_td, q_nr, q_nd = tile_split(block_q, d, threads)
    n_s, n_kv, n_q = s_tr * s_tc, kv_tr * kv_td, q_tr * q_td
    # Rows padded by one word: threads of a warp that read one column of different rows hit different banks.
    SK, SQ, SP = (block_k, d + 1), (block_q, d + 1), (block_q, block_k + 1)

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
    HEAVY, GQA, VARLEN = bool(heavy_first), bool(gqa), bool(varlen)
    if HEAVY and VARLEN:
        raise ValueError("heavy_first and varlen exclude each other: varlen's block table sets the order")

    EXTRA = extras is not None
    ex = extras or Extras()
    I = np.int64
    WL, BRA, CAP = I(ex.left), bool(ex.bottom_right), float32(ex.softcap)
    SOFTCAP, ALIBI, PER_B = ex.softcap > 0, ex.slopes is not None, bool(ex.per_batch)
    SLOPES = tuple(float(x) for x in (ex.slopes or (0.0,)))
    RIGHT_FREE = I(ex.right)  # without causal; with causal the kernel uses min(right, 0)
    n_t = n_s if SOFTCAP else 1  # tanh of each capped score, for dS's factor 1 - tanh^2
    DROP = ex.dropout_p > 0
    d_start, d_mix, d_keep = device_functions(ex.dropout_p)
    capped, outside = score_functions(ex, False)  # the band's right edge comes at run time (`right`)
    n_z = s_tr if DROP else 1

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
    def dkdv(q, k, v, do, lse, D, dq, dk, dv, scale, causal, blocks, cu, seed):
        # gqa (a build of its own, so that MHA's code is unchanged): one block per (key block, K/V head)
        # walks the query blocks of every query head of its group, so dK_j and dV_j add up in registers.
        if GQA:  # grid (key blocks, H_kv, B)
            hk, batch = uint64(cuda.blockIdx.y), uint64(cuda.blockIdx.z)
            k0 = uint64(cuda.blockIdx.x) * Bc
            n_group = uint64(q.shape[1]) // uint64(k.shape[1])
        elif HEAVY:  # grid (g, key blocks, sections)
            bh = uint64(cuda.blockIdx.z) * uint64(cuda.gridDim.x) + uint64(cuda.blockIdx.x)
            hk, batch = bh % uint64(q.shape[1]), bh // uint64(q.shape[1])
            k0 = uint64(cuda.blockIdx.y) * Bc
            n_group = uint64(1)
        else:  # grid (key blocks, H, B)
            hk, batch = cuda.blockIdx.y, cuda.blockIdx.z
            k0 = uint64(cuda.blockIdx.x) * Bc
            n_group = uint64(1)
        tid = uint64(cuda.threadIdx.x)
        nq, nk = uint64(q.shape[2]), uint64(k.shape[2])
        seq = batch  # dropout's and per-batch ALiBi's batch index
        if VARLEN:  # batch is 0; this block's sequence and key block come from the host's table
            seq, k0 = uint64(blocks[cuda.blockIdx.x, 0]), uint64(blocks[cuda.blockIdx.x, 1])
            cq, ck = uint64(cu[0, seq]), uint64(cu[1, seq])
            nq, nk = uint64(cu[0, seq + ONE]) - cq, uint64(cu[1, seq + ONE]) - ck
            # views from the sequence's first row: the code below indexes rows and keys within the sequence
            q, do, lse, D, dq = q[:, :, cq:], do[:, :, cq:], lse[:, :, cq:], D[:, :, cq:], dq[:, :, cq:]
            k, v, dk, dv = k[:, :, ck:], v[:, :, ck:], dk[:, :, ck:], dv[:, :, ck:]
        scale = float32(scale)

        Ks = cuda.shared.array(SK, float32)
        Vs = cuda.shared.array(SK, float32)
        Qs = cuda.shared.array(SQ, float32)
        dOs = cuda.shared.array(SQ, float32)
        Ps = cuda.shared.array(SP, float32)  # P_ij, later overwritten by scale * dS_ij
        Ls = cuda.shared.array(block_q, float32)
        Ds = cuda.shared.array(block_q, float32)

        # K_j, V_j: loaded once, coalesced (consecutive threads read consecutive features); zero past Nk.
        idx = tid
        while idx < K_ELEMS:
            c, e = idx // Dh, idx % Dh
            inside = k0 + c < nk
            Ks[c, e] = float32(k[batch, hk, k0 + c, e]) if inside else float32(0)
            Vs[c, e] = float32(v[batch, hk, k0 + c, e]) if inside else float32(0)
            idx += NT

        dK = cuda.local.array(n_kv, float32)
        dV = cuda.local.array(n_kv, float32)
        for n in range(n_kv):
            dK[n] = 0
            dV[n] = 0

        sy, sx = tid // S_NC, tid % S_NC  # this thread's place in S_ij
        ky, kx = tid // KV_ND, tid % KV_ND  # in dK_j / dV_j
        qy, qx = tid // Q_ND, tid % Q_ND  # in dQ_i
        S = cuda.local.array(n_s, float32)
        dP = cuda.local.array(n_s, float32)
        qa = cuda.local.array(s_tr, float32)
        oa = cuda.local.array(s_tr, float32)
        pa = cuda.local.array(kv_tr, float32)
        dQ = cuda.local.array(n_q, float32)
        sa = cuda.local.array(q_tr, float32)

        Th = cuda.local.array(n_t, float32)
        zrow = cuda.local.array(n_z, uint64)  # dropout: the hash state of each of this thread's rows of S_ij
        zh = uint64(0)
        off = I(0)
        right = RIGHT_FREE
        q_end = nq
        if EXTRA:
            if BRA:
                off = I(nk) - I(nq)  # query i sits at position i + Nk - Nq
            if causal:
                right = min(right, I(0)) if right >= I(0) else I(0)
            if WL >= I(0):  # rows past k0 + Bc - 1 - off + left see none of this block's keys
                last = I(k0) + I(Bc) - I(1) - off + WL
                q_end = uint64(min(max(last + I(1), I(0)), I(nq)))
        for gi in range(n_group):
            if GQA:
                head = hk * n_group + gi
            else:
                head = hk
            if DROP:  # the forward's mask, regenerated: keyed by (seed, batch, query head, row, col)
                zh = d_start(seed, seq, head)
            slope = float32(0)
            if ALIBI:
                slope = float32(SLOPES[uint64(seq) * uint64(q.shape[1]) + uint64(head) if PER_B else uint64(head)])
            # Causal: query block i sees key block j only if its last row reaches k0.
            q0 = (k0 // Br) * Br if causal else ZERO
            if EXTRA:  # the first row whose band reaches k0: k0 - off - right (aligned, windowed)
                q0 = ZERO
                if right >= I(0):
                    first = I(k0) - off - right
                    if first > I(0):
                        q0 = uint64(first) // Br * Br
            while q0 < q_end:
                cuda.syncthreads()  # everyone is done with the previous Q_i, dO_i, P_ij
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
                cuda.syncthreads()

                # S_ij = Q_i K_j^T and dP_ij = dO_i V_j^T: an S_TR x S_TC register tile of each.
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
                # P_ij = exp(scale * S_ij - lse_i), zero past Nq, past Nk and (causal) right of the diagonal.
                for a in range(S_TR):
                    r = sy + S_NR * a
                    if DROP:
                        zrow[a] = d_mix(zh, q0 + r)
                    for b in range(S_TC):
                        c = sx + S_NC * b
                        p = float32(0)
                        if EXTRA:
                            pos, col = I(q0 + r) + off, I(k0 + c)
                            sc, th = capped(S[a * S_TC + b] * scale, pos, col, CAP, slope)
                            if SOFTCAP:
                                Th[a * S_TC + b] = th
                            if q0 + r < nq and not outside(pos, col, I(nk), right):
                                p = math.exp(sc - Ls[r])
                        elif q0 + r < nq and k0 + c < nk and (not causal or k0 + c <= q0 + r):
                            p = math.exp(S[a * S_TC + b] * scale - Ls[r])
                        S[a * S_TC + b] = p  # dS uses the undropped P
                        if DROP:  # dV takes P * Z / (1-p), and dP reaches P only through the kept entries
                            z = d_keep(zrow[a], k0 + c)
                            p *= z
                            dP[a * S_TC + b] *= z
                        Ps[r, c] = p
                cuda.syncthreads()

                # dV_j += P_ij^T dO_i
                r = ZERO
                while r < Br:
                    for a in range(KV_TR):
                        pa[a] = Ps[r, ky + KV_NR * a]
                    for t in range(KV_TD):
                        g = dOs[r, kx + KV_ND * t]
                        for a in range(KV_TR):
                            dV[a * KV_TD + t] += pa[a] * g
                    r += ONE
                cuda.syncthreads()

                # dS_ij = P_ij * (dP_ij - D_i), stored times scale: both products below need exactly that.
                for a in range(S_TR):
                    r = sy + S_NR * a
                    for b in range(S_TC):
                        ds = S[a * S_TC + b] * (dP[a * S_TC + b] - Ds[r]) * scale
                        if SOFTCAP:  # d(cap tanh(s / cap)) / ds = 1 - tanh^2
                            th = Th[a * S_TC + b]
                            ds *= float32(1) - th * th
                        Ps[r, sx + S_NC * b] = ds
                cuda.syncthreads()

                # dK_j += scale * dS_ij^T Q_i
                r = ZERO
                while r < Br:
                    for a in range(KV_TR):
                        pa[a] = Ps[r, ky + KV_NR * a]
                    for t in range(KV_TD):
                        g = Qs[r, kx + KV_ND * t]
                        for a in range(KV_TR):
                            dK[a * KV_TD + t] += pa[a] * g
                    r += ONE

                # dQ_i += scale * dS_ij K_j: this key block's share, added atomically (many blocks share dQ_i).
                for n in range(n_q):
                    dQ[n] = 0
                c = ZERO
                while c < Bc:
                    for a in range(Q_TR):
                        sa[a] = Ps[qy + Q_NR * a, c]
                    for t in range(Q_TD):
                        kc = Ks[c, qx + Q_ND * t]
                        for a in range(Q_TR):
                            dQ[a * Q_TD + t] += sa[a] * kc
                    c += ONE
                for a in range(Q_TR):
                    i = q0 + qy + Q_NR * a
                    if i < nq:
                        for t in range(Q_TD):
                            cuda.atomic.add(dq, (batch, head, i, qx + Q_ND * t), dQ[a * Q_TD + t])
                q0 += Br

        # dK_j, dV_j to HBM in the output dtype (zero for keys no query sees).
        for a in range(KV_TR):
            c = k0 + ky + KV_NR * a
            if c < nk:
                for t in range(KV_TD):
                    e = kx + KV_ND * t
                    dk[batch, hk, c, e] = dK[a * KV_TD + t]
                    dv[batch, hk, c, e] = dV[a * KV_TD + t]

    @cuda.jit
    def cast(src, dst):
        """dst[i] = src[i] over flat arrays: dQ's float32 accumulator into a float16 result."""
        i = cuda.grid(1)
        if i < src.shape[0]:
            dst[i] = src[i]

    return preprocess, dkdv, cast


def default_config(d: int, simulator: bool = False):
    """(block_q, block_k, threads) used when the caller gives none."""
    return SIM_CONFIG if simulator else GPU_CONFIG[d]


