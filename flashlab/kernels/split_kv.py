"""Split-KV and block order for the forward kernels: the key chunks (split_chunk), the launch grid (grid:
heaviest blocks first) and the merge kernel that folds the chunks' partial results (build_merge, merge_split),
lesson 03's (m, l) merge rule, as lesson 14's decoding uses it."""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import float32

from ..device import get_cuda
from .common import LN2, LOG2E, NEG

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs


def split_chunk(nk: int, splits: int, block_k: int) -> tuple:
    """(chunk, n_chunks): split-KV cuts Nk keys into chunks of ceil(Nk / splits) keys rounded up to a multiple of
    block_k (so no key tile straddles two chunks), which can need fewer chunks than asked for; no chunk is empty.
    The kernels compute the same chunk from Nk and their grid."""
    splits = max(1, min(int(splits), nk))
    chunk = -(-(-(-nk // splits)) // block_k) * block_k
    return chunk, -(-nk // chunk)


def grid(B: int, H: int, Nq: int, block_q: int, splits: int = 1, heavy_first: bool = False, section=None):
    """The launch grid of the forward kernels (this one and the tensor kernel): see the module docstring.
    section: heads per section under heavy_first (a divisor of B*H; None: all of them)."""
    blocks = (Nq + block_q - 1) // block_q
    if not heavy_first:
        return (blocks, B * H, splits)
    g = section or B * H
    if (B * H) % g:
        raise ValueError(f"section = {g} heads must divide B*H = {B * H}")
    return (g, blocks, B * H // g * splits)


@functools.lru_cache(maxsize=None)
def build_merge(d: int, normalised: bool = False):
    """The merge kernel, grid (Nq, H, B), one thread per output dim. Partial states are m_part, l_part
    (B, H, n_splits, Nq) and o_part (B, H, n_splits, Nq, d), float32, m in natural-log units.

    normalised=True: each chunk's state is written as an attention output over its keys, o_c = O_c / l_c and
    lse_c = m_c + log(l_c) (the forward kernels' split mode, kernels/plan.py); that is the state
    (m = lse_c, l = 1, O = o_c), so l_part is not read. The same merge rule either way."""
    UNIT_L = normalised

    @cuda.jit(fastmath={"contract", "afn", "arcp"})
    def merge(m_part, l_part, o_part, o, lse, n_splits):
        x = cuda.threadIdx.x
        qi, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        m = float32(NEG)  # log2 units again below
        for c in range(n_splits):
            m = max(m, m_part[b, h, c, qi] * LOG2E)
        l = float32(0.0)
        acc = float32(0.0)
        for c in range(n_splits):
            w = math.exp2(m_part[b, h, c, qi] * LOG2E - m)
            l += w if UNIT_L else l_part[b, h, c, qi] * w
            acc += o_part[b, h, c, qi, x] * w
        if l > 0 and m > 0.5 * NEG:  # some chunk saw a key (an empty chunk's m is NEG)
            o[b, h, qi, x] = acc / l
            if x == 0:
                lse[b, h, qi] = (m + math.log2(l)) * LN2
        else:  # no chunk saw a key for this row (paged decoding, causal or empty): o = 0, lse = +inf
            o[b, h, qi, x] = 0.0
            if x == 0:
                lse[b, h, qi] = math.inf

    return merge


def merge_split(run, o, lse, splits: int, alloc=None):
    """Split-KV for the forward kernels (kernels/plan.py): `run(o_part, lse_part)` launches a forward kernel that
    writes each key chunk's float32 attention output and lse into views (B, H * splits, Nq, d) and
    (B, H * splits, Nq); the merge kernel then folds the chunks into o (B, H, Nq, d) and lse (B, H, Nq).
    alloc(shape, dtype) makes the partial buffers (default: numba device arrays)."""
    B, H, Nq, d = o.shape
    alloc = alloc or (lambda shape, dtype: get_cuda().device_array(shape, dtype=dtype))
    o_part = alloc((B, H, splits, Nq, d), np.float32)
    lse_part = alloc((B, H, splits, Nq), np.float32)
    run(o_part.reshape(B, H * splits, Nq, d), lse_part.reshape(B, H * splits, Nq))
    build_merge(d, normalised=True)[(Nq, H, B), d](lse_part, lse_part, o_part, o, lse, splits)
