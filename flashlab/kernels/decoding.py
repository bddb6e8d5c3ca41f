"""Split-KV attention ("Flash-Decoding") as two Numba-CUDA kernels (lesson 14).

The NumPy version, with the algorithm in words, is `flashlab.decoding`. Here:

`split` kernel, grid (n_splits, H, B): thread block c owns key chunk c of one (batch, head) and all Nq
(a few) queries. It walks over its chunk in tiles of BK keys:
    K tile -> shared memory (coalesced), then thread (qi, j) computes the score S[qi, j] = q_qi . k_j
    the tile max and the tile sum of exp2(S - m_new) per query by a tree reduction in shared memory
    thread (qi, x) keeps O[qi, x] in a register: O = alpha * O + sum_j P[qi, j] V[j, x]
        (V is read straight from global memory: neighbouring threads read neighbouring x, coalesced)
and writes its unnormalised partial state (m_c, l_c, O_c) to a float32 scratch array.

The same split kernel serves kernels/paged.py (`build(..., group, paged=True)`). Two steps are device functions
chosen at build time: where key j of sequence b lives (key_rows: row j of contiguous K/V, or slot j % page_size
of page block_table[b, j // page_size] of a paged cache), and which query head and query a row of the block is
(query_rows: under GQA one block serves the group of query heads of its K/V head, their queries as rows).

`merge` kernel, grid (Nq, H, B), one thread per output dim x: m = max_c m_c, l = sum_c l_c 2^(m_c - m),
o = sum_c O_c 2^(m_c - m) / l, lse = (m + log2 l) ln 2: the same merge as `decoding.merge_partials`.

Scores are kept in log2 units (q is pre-scaled by scale * log2(e), so exp becomes exp2), like the
forward kernels. No warp shuffles: every reduction goes through shared memory, so the CUDA simulator runs
this same code. Nq is a compile-time constant (at most MAX_NQ): this kernel is for decoding; for many
queries use `flash_attention`.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .._inputs import check_block
from ..decoding import check_num_splits, chunk_bounds, default_num_splits
from ..device import device_limits, get_cuda, has_gpu
from ._launch import Launch, Launches, check_kernel_inputs, empty, like_input, to_device
from .common import FASTMATH, LN2, LOG2E, NEG
from .split_kv import build_merge

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs

MAX_NQ = 16
K_TILE_BYTES = 40 * 1024  # shared memory for one K tile of BK x (d + 1) floats


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def key_tile(d: int, n_q: int, threads: int) -> int:
    """BK, keys per tile: a power of two with n_q * BK <= threads (one score per thread) whose padded K tile
    fits K_TILE_BYTES."""
    nq_pow2 = 1 << (n_q - 1).bit_length()
    return max(1, min(threads // nq_pow2, _pow2_floor(K_TILE_BYTES // (4 * (d + 1)))))


def key_rows(paged: bool):
    """kv_at(k, block_table, b, h, j, x): entry x of key j of sequence b, K/V head h, in k (or v): where a key row
    lives. Contiguous K/V (B, H, Nk, d): k[b, h, j, x], block_table unused. A paged cache (num_pages, page_size,
    H_kv, d): slot j % page_size of page block_table[b, j // page_size]."""
    step = cuda.jit(device=True, inline="always")

    @step
    def contiguous(k, block_table, b, h, j, x):
        return k[b, h, j, x]

    @step
    def through_table(k, block_table, b, h, j, x):
        page = k.shape[1]
        return k[block_table[b, j // page], j % page, h, x]

    return through_table if paged else contiguous


def query_rows(group: int, n_q: int):
    """(head_of, query_of): row r of a block that serves K/V head hk is query query_of(r) of query head
    head_of(hk, r). Under GQA the block packs the `group` query heads of its K/V head as rows, (head g, query i)
    -> row g * n_q + i, so each key is read once per K/V head; without it (group 1) row r is query r of head hk."""
    G, NQ = group, n_q
    step = cuda.jit(device=True, inline="always")

    @step
    def one_head(hk, r):
        return hk

    @step
    def query(r):
        return r

    @step
    def group_head(hk, r):
        return hk * G + r // NQ

    @step
    def group_query(r):
        return r % NQ

    return (group_head, group_query) if group > 1 else (one_head, query)


@functools.lru_cache(maxsize=None)
def build(d: int, n_q: int, threads: int, group: int = 1, paged: bool = False):
    """(split, merge) kernels for head dim d, n_q queries per head and `threads` threads per block. group: query
    heads per K/V head, packed as rows of one block (query_rows); paged: K/V in a paged cache, found through a
    block table (key_rows), with causal masking as a run-time argument (kernels/paged.py). The split kernel:

        contiguous: split(q, k, v, m_part, l_part, o_part, n_k, chunk, scale_log2)
        paged:      split(q, k_cache, v_cache, block_table, seqlens, m_part, l_part, o_part, chunk, scale_log2,
                          causal)

    grid (n_splits, H_kv, B) (H_kv = H without GQA), `threads` threads; the merge kernel: split_kv.build_merge."""
    from numba import float32

    D, NQ, T = d, n_q, threads
    R = group * n_q  # rows of a block: (query head of the group, query)
    DP = d + 1  # a padded row of the K tile (a compile-time constant, as shared array shapes must be)
    BK = key_tile(d, R, threads)
    NS = R * BK  # threads that hold one score each
    K_LOADS = (BK * D + T - 1) // T  # K-tile elements each thread copies
    O_PER = (R * D + T - 1) // T  # O entries each thread owns
    tile_step = online_softmax_step(NS, BK)
    kv_at, (head_of, query_of) = key_rows(paged), query_rows(group, n_q)

    @cuda.jit(device=True, inline="always")
    def attend_chunk(q, k, v, block_table, n_k, m_part, l_part, o_part, chunk, scale_log2, causal):
        """Block (c, hk, b): key chunk c of sequence b for the rows of K/V head hk; writes their partial state."""
        Qs = cuda.shared.array((R, D), float32)
        Ks = cuda.shared.array((BK, DP), float32)  # +1: thread j reads row j, so rows fall in different banks
        Ps = cuda.shared.array((R, BK), float32)  # scores, then probabilities
        red = cuda.shared.array(NS, float32)  # tree reductions, one segment of BK per row
        Ms = cuda.shared.array(R, float32)
        Ls = cuda.shared.array(R, float32)
        As = cuda.shared.array(R, float32)  # alpha = 2^(m_old - m_new) of the current tile
        t = cuda.threadIdx.x
        c, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        k_begin = c * chunk
        k_stop = min(k_begin + chunk, n_k)
        r_s = t // BK  # this thread's score: row r_s, key j_s of the tile
        j_s = t % BK
        last = n_k - NQ + r_s % NQ  # causal: the last key row r_s may see (bottom-right alignment)

        # q of every row, in log2 units; m = -inf, l = 0, O = 0
        for e in range(t, R * D, T):
            r = e // D
            Qs[r, e % D] = float32(q[b, head_of(hk, r), query_of(r), e % D]) * scale_log2
        if t < R:
            Ms[t] = NEG
            Ls[t] = 0.0
        acc = cuda.local.array(O_PER, float32)
        for i in range(O_PER):
            acc[i] = 0.0

        for k0 in range(k_begin, k_stop, BK):
            # K tile -> shared memory
            cuda.syncthreads()  # Qs/Ms written, or the previous tile's Ks, Ps and As no longer read
            for i in range(K_LOADS):
                e = i * T + t
                if e < BK * D:
                    r = e // D
                    x = e % D
                    Ks[r, x] = 0.0
                    if k0 + r < k_stop:
                        Ks[r, x] = float32(kv_at(k, block_table, b, hk, k0 + r, x))
            cuda.syncthreads()
            # S = q . k, one score per thread; then P, m, l and alpha of the tile
            s = float32(NEG)
            if t < NS and k0 + j_s < k_stop and (not causal or k0 + j_s <= last):
                s = 0.0
                for x in range(D):
                    s += Qs[r_s, x] * Ks[j_s, x]
            tile_step(s, t, Ps, red, Ms, Ls, As)
            # O = alpha O + P V: thread owns entries (r, x) = divmod(i*T + t, D); V straight from global memory
            n_keys = min(BK, k_stop - k0)
            for i in range(O_PER):
                e = i * T + t
                if e < R * D:
                    r = e // D
                    x = e % D
                    o_acc = acc[i] * As[r]
                    for j in range(n_keys):
                        o_acc += Ps[r, j] * float32(kv_at(v, block_table, b, hk, k0 + j, x))
                    acc[i] = o_acc

        # the chunk's unnormalised partial state (m_c, l_c, O_c)
        for i in range(O_PER):
            e = i * T + t
            if e < R * D:
                o_part[b, head_of(hk, e // D), c, query_of(e // D), e % D] = acc[i]
        if t < R:
            m_part[b, head_of(hk, t), c, query_of(t)] = Ms[t] * LN2  # natural-log units, like flashlab.decoding
            l_part[b, head_of(hk, t), c, query_of(t)] = Ls[t]

    if paged:
        @cuda.jit(fastmath=FASTMATH)
        def split(q, k_cache, v_cache, block_table, seqlens, m_part, l_part, o_part, chunk, scale_log2, causal):
            attend_chunk(q, k_cache, v_cache, block_table, seqlens[cuda.blockIdx.z], m_part, l_part, o_part, chunk,
                         scale_log2, causal)
    else:
        @cuda.jit(fastmath=FASTMATH)
        def split(q, k, v, m_part, l_part, o_part, n_k, chunk, scale_log2):
            attend_chunk(q, k, v, 0, n_k, m_part, l_part, o_part, chunk, scale_log2, False)

    return split, build_merge(d)


def online_softmax_step(NS: int, BK: int):
    """The online-softmax step of one key tile in the split kernel (both builds, contiguous and paged): thread
    t < NS holds the score s of row t // BK and key t % BK (NEG where masked). It writes P = 2^(s - m_new) over s
    in Ps (0 where masked, even in a row whose keys so far are all masked), and updates the rows' running max Ms
    and sum Ls, leaving each row's rescale factor alpha = 2^(m_old - m_new) in As for the O update. Tree
    reductions in shared memory (red, one segment of BK per row; BK a power of two), no warp shuffles, so the
    simulator runs the same code. Every thread of the block must call it: it synchronises."""
    from numba import float32

    @cuda.jit(device=True, inline=True)
    def step(s, t, Ps, red, Ms, Ls, As):
        r_s, j_s = t // BK, t % BK
        if t < NS:
            Ps[r_s, j_s] = s
            red[t] = s
        cuda.syncthreads()
        w = BK // 2
        while w > 0:  # tile max of each row: red[r * BK]
            if t < NS and j_s < w:
                red[t] = max(red[t], red[t + w])
            cuda.syncthreads()
            w //= 2
        m_old = float32(0.0)
        m_new = float32(0.0)
        if t < NS:
            m_old = Ms[r_s]
            m_new = max(m_old, red[r_s * BK])
        cuda.syncthreads()  # everyone has read the max before red is reused
        if t < NS:
            s = Ps[r_s, j_s]
            p = math.exp2(s - m_new) if s > 0.5 * NEG else float32(0.0)
            Ps[r_s, j_s] = p
            red[t] = p
        cuda.syncthreads()
        w = BK // 2
        while w > 0:  # tile sum of each row: red[r * BK]
            if t < NS and j_s < w:
                red[t] += red[t + w]
            cuda.syncthreads()
            w //= 2
        if t < NS and j_s == 0:
            alpha = math.exp2(m_old - m_new)
            As[r_s] = alpha
            Ls[r_s] = Ls[r_s] * alpha + red[t]
            Ms[r_s] = m_new
        cuda.syncthreads()

    return step


def default_threads() -> int:
    return 128 if has_gpu() else 32  # the simulator runs one OS thread per CUDA thread


def launches(kernels, B: int, H: int, H_kv: int, Nq: int, d: int, n_splits: int, chunk: int, threads: int,
             scale: float, Nk: int = 0, paged: bool = False, causal: bool = False) -> Launches:
    """The split kernel and the merge of one call, described once (_launch.Launch) for the general and the prepared
    path. Arrays by name: q, k, v (the caches, for a paged build), o, lse, block_table and seqlens (int32, paged),
    and the temporaries m_part, l_part, o_part, the chunks' float32 partial states. kernels: build(...)'s
    (split, merge), built with the same `paged`: a paged build takes its lengths from seqlens and causal at run
    time, a contiguous one Nk."""
    split, merge = kernels
    scale_log2 = np.float32(scale * LOG2E)
    states = ("m_part", "l_part", "o_part")
    args = ("q", "k", "v", "block_table", "seqlens", *states, chunk, scale_log2, bool(causal)) if paged else \
        ("q", "k", "v", *states, Nk, chunk, scale_log2)
    temporaries = {"m_part": ((B, H, n_splits, Nq), np.float32), "l_part": ((B, H, n_splits, Nq), np.float32),
                   "o_part": ((B, H, n_splits, Nq, d), np.float32)}
    return Launches((Launch(split, (n_splits, H_kv, B), threads, args),
                     Launch(merge, (Nq, H, B), d, (*states, "o", "lse", n_splits))), temporaries, {})


def flash_decoding(q, k, v, *, scale=None, num_splits=None, threads=None, return_partials=False):
    """Split-KV attention on the GPU (or the simulator): every query sees every key. Returns (o, lse).

    q: (B, H, Nq, d) with Nq <= MAX_NQ; k, v: (B, H, Nk, d); float32 or float16, d in (16, 32, 64, 128);
    NumPy arrays, numba device arrays or torch CUDA tensors. o has q's dtype, lse is float32 (B, H, Nq).
    num_splits: key chunks (thread blocks) per (batch, head); default `default_num_splits` for this GPU.
    threads: per block (default 128 on a GPU, 32 in the simulator). return_partials: also return the
    chunks' float32 (m, l, O), shaped (B, H, n_splits, Nq[, d]) like `decoding.split_kv_partials`.
    """
    (q_d, kind), (k_d, _), (v_d, _) = to_device(q, "q"), to_device(k, "k"), to_device(v, "v")
    B, H, Nq, Nk, d, _, scale = check_kernel_inputs(q_d, k_d, v_d, scale=scale)
    if Nq > MAX_NQ:
        raise ValueError(f"q has Nq = {Nq} queries; the decoding kernel takes at most {MAX_NQ} "
                         "(for more queries use flashlab.kernels.flash_attention)")
    threads = check_block(threads, "threads") or default_threads()
    if not (1 << (Nq - 1).bit_length()) <= threads <= 1024:
        raise ValueError(f"threads must be between {1 << (Nq - 1).bit_length()} (Nq = {Nq} rounded up to a power "
                         f"of two) and 1024; got {threads}")
    if num_splits is None:
        num_splits = default_num_splits(B * H, Nk, n_sm=device_limits()["sms"])
    bounds = chunk_bounds(Nk, check_num_splits(num_splits, Nk))
    n_splits, chunk = len(bounds), bounds[0][1] - bounds[0][0]
    split, merge = build(d, Nq, threads)

    described = launches((split, merge), B, H, H, Nq, d, n_splits, chunk, threads, scale, Nk=Nk)
    new = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    # the partial states are made here, not as temporaries: return_partials hands them back
    arrays = {name: new(shape, dt) for name, (shape, dt) in described.temporaries.items()}
    o, lse = new((B, H, Nq, d), q_d.dtype), new((B, H, Nq), np.float32)
    described._replace(temporaries={}).run(dict(arrays, q=q_d, k=k_d, v=v_d, o=o, lse=lse))
    m_part, l_part, o_part = arrays["m_part"], arrays["l_part"], arrays["o_part"]
    out = (like_input(o, kind), like_input(lse, kind))
    if return_partials:
        out += tuple(like_input(x, kind) for x in (m_part, l_part, o_part))
    return out
