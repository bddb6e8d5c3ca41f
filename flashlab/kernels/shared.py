"""variant="shared": the textbook first flash kernel (lesson 08).

One thread per query row: a block of block_q threads owns block_q rows of one (batch, head). The block
walks over the keys in tiles of block_k rows of K and V, copied cooperatively into shared memory; each
thread keeps its row of Q, its row of O and its m, l in registers and runs the online softmax one key
at a time. It is correct and simple, and slow (lessons 08 and 10 profile it): each thread does all d
multiply-adds of its row alone, as a dependent chain, with few other warps to hide the waits; it rescales
its row of O after every key; and every multiply-add needs a float from shared memory (all threads read
the same K and V element, a broadcast). Lesson 09's register variant fixes all three.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import float32

from ..device import get_cuda
from ._launch import Launch, Launches
from .common import FASTMATH, LN2, LOG2E, NEG

cuda = get_cuda()  # a module global, so the simulator can swap in its fake module

DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K = 64, 32


def shared_bytes(d: int, block_k: int) -> int:
    return 2 * block_k * d * 4  # one K tile and one V tile, float32


def check_blocks(d: int, block_q: int, block_k: int, shared_limit: int = 48 * 1024):
    if block_q > 1024:
        raise ValueError(f"block_q = {block_q} threads per block; at most 1024 for variant='shared'")
    if shared_bytes(d, block_k) > shared_limit:
        raise ValueError(f"block_k = {block_k} needs {shared_bytes(d, block_k)} bytes of shared memory at d={d}; "
                         f"the limit is {shared_limit}: use a smaller block_k")


@lru_cache(maxsize=None)
def build(d: int, block_q: int, block_k: int, causal: bool, gqa: bool = False):
    D, BR, BC, CAUSAL, GQA = d, block_q, block_k, causal, bool(gqa)
    LOADS = (BC * D + BR - 1) // BR  # tile elements each thread copies

    @cuda.jit(fastmath=FASTMATH)
    def flash_fwd_shared(q, k, v, o, lse, n_q, n_k, n_heads, scale_log2):
        Ks = cuda.shared.array((BC, D), float32)
        Vs = cuda.shared.array((BC, D), float32)
        t = cuda.threadIdx.x
        q0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BR
        row = q0 + t
        b = cuda.blockIdx.y // n_heads
        h = cuda.blockIdx.y % n_heads
        hk = h
        if GQA:  # query head h reads K/V head h // (H / H_kv); a build of its own, so MHA's code is unchanged
            hk = h * k.shape[1] // n_heads

        q_row = cuda.local.array(D, float32)  # scaled so scores come out in log2 units
        o_row = cuda.local.array(D, float32)
        for x in range(D):
            q_row[x] = 0.0
            o_row[x] = 0.0
            if row < n_q:
                q_row[x] = float32(q[b, h, row, x]) * scale_log2
        m = float32(NEG)
        l = float32(0.0)

        k_end = n_k
        if CAUSAL:
            k_end = min(n_k, q0 + BR)  # skip key tiles no row of this block can see
        for k0 in range(0, k_end, BC):
            cuda.syncthreads()  # the previous tile is no longer read
            for it in range(LOADS):
                e = it * BR + t
                if e < BC * D:
                    c = e // D
                    x = e % D
                    Ks[c, x] = 0.0
                    Vs[c, x] = 0.0
                    if k0 + c < n_k:
                        Ks[c, x] = float32(k[b, hk, k0 + c, x])
                        Vs[c, x] = float32(v[b, hk, k0 + c, x])
            cuda.syncthreads()
            for c in range(BC):  # online softmax, one key at a time
                key = k0 + c
                if key < n_k and (not CAUSAL or key <= row):
                    score = float32(0.0)
                    for x in range(D):
                        score += q_row[x] * Ks[c, x]
                    m_new = max(m, score)
                    alpha = math.exp2(m - m_new)
                    p = math.exp2(score - m_new)
                    l = l * alpha + p
                    for x in range(D):
                        o_row[x] = o_row[x] * alpha + p * Vs[c, x]
                    m = m_new

        if row < n_q:
            inv = float32(1.0) / l
            for x in range(D):
                o[b, h, row, x] = o_row[x] * inv
            lse[b, h, row] = (m + math.log2(l)) * LN2

    return flash_fwd_shared


def launches(q_shape, k_shape, scale, causal, block_q, block_k) -> Launches:
    """The launch for q of shape (B, H, Nq, d) and k (B, H_kv, Nk, d), arrays by name: q, k, v, o, lse."""
    B, H, Nq, d = q_shape
    kernel = build(d, block_q, block_k, causal, gqa=k_shape[1] != H)
    grid = ((Nq + block_q - 1) // block_q, B * H)
    return Launches([Launch(kernel, grid, block_q, ("q", "k", "v", "o", "lse", Nq, k_shape[2], H,
                                                     np.float32(scale * LOG2E)))], {}, {})


def launch(q, k, v, o, lse, n_heads, scale, causal, block_q, block_k):
    """Launch on device arrays (B, H, N, d) (the general path of `launches`); returns the kernel."""
    run = launches(q.shape, k.shape, scale, causal, block_q, block_k)
    run.run({"q": q, "k": k, "v": v, "o": o, "lse": lse})
    return run.launches[0].kernel
