"""Split-KV and block order for the forward kernels: the key chunks (split_chunk), the launch grid (grid:
heaviest blocks first), where a block works in that grid and which keys it visits (forward_functions, device
functions of kernels/register.py and kernels/tensor.py), the merge kernel that folds the chunks' partial results
(build_merge), lesson 03's (m, l) merge rule, as lesson 14's decoding uses it, and the launches of a forward
kernel followed by the merge (forward_launches)."""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import float32

from ..device import get_cuda
from ._launch import Arg, Launch
from .common import FASTMATH, LN2, LOG2E, NEG, I, U
from .options import Features, device_functions

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


def forward_functions(block_q: int, block_k: int, heavy: bool, split: bool, causal: bool, f: Features):
    """(query_block, key_range): where a forward thread block works, device functions inlined into the kernel.

    query_block(batch, n_heads) -> (q0, bh, part, n_parts): the block's first query row, its (batch, head) index,
    and its key chunk among n_parts (split-KV), from the grid (see `grid`: heaviest blocks first).
    key_range(q0, part, n_parts, nq, nk, left, right) -> (k_begin, k_end, off): the keys the block visits, its
    chunk cut to the band of its rows (options.key_band: causal's, or with per-score options the aligned window
    of the run-time left, right), k_begin on a tile boundary; and off, the alignment's shift of query positions
    (Nk - Nq bottom-right, else 0). Tiles outside the range are skipped."""
    step = cuda.jit(device=True, inline="always", fastmath=FASTMATH)
    UBQ, UBK, LAST = U(block_q), U(block_k), U(block_q - 1)
    key_band, BOTTOM_RIGHT = device_functions(f).key_band, f.bottom_right

    @step
    def block_in_order(batch, n_heads):
        # grid (query blocks, B*H, splits): the last (heaviest, under causal) blocks of a head first
        q0 = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * UBQ
        return q0, U(cuda.blockIdx.y), U(cuda.blockIdx.z), U(cuda.gridDim.z)

    @step
    def block_heavy_first(batch, n_heads):
        # grid (g, query blocks, sections): in each section of g heads, the heaviest blocks first
        q0 = U(cuda.gridDim.y - 1 - cuda.blockIdx.y) * UBQ
        return q0, U(cuda.blockIdx.z) * U(cuda.gridDim.x) + U(cuda.blockIdx.x), U(0), U(1)

    @step
    def block_heavy_first_split(batch, n_heads):
        # grid (g, query blocks, sections x splits), z = part * sections + section
        q0 = U(cuda.gridDim.y - 1 - cuda.blockIdx.y) * UBQ
        sections = U(batch) * U(n_heads) // U(cuda.gridDim.x)
        z = U(cuda.blockIdx.z)
        section, part, n_parts = z % sections, z // sections, U(cuda.gridDim.z) // sections
        return q0, section * U(cuda.gridDim.x) + U(cuda.blockIdx.x), part, n_parts

    @step
    def all_keys(part, n_parts, nk):
        return U(0), nk

    @step
    def chunk_keys(part, n_parts, nk):
        # this block's chunk of keys: a multiple of block_k keys (split_chunk computes the same)
        chunk = ((nk + n_parts - U(1)) // n_parts + UBK - U(1)) // UBK * UBK
        k_begin = part * chunk
        return k_begin, min(nk, k_begin + chunk)

    keys = chunk_keys if split else all_keys

    @step
    def causal_range(q0, part, n_parts, nq, nk, left, right):
        # causal's band (key_band with right = 0, top-left), in unsigned arithmetic as the rest of the plain
        # kernels: keys after the block's last row are skipped
        k_begin, k_end = keys(part, n_parts, nk)
        return k_begin, min(k_end, q0 + UBQ), I(0)

    @step
    def all_range(q0, part, n_parts, nq, nk, left, right):
        k_begin, k_end = keys(part, n_parts, nk)
        return k_begin, k_end, I(0)

    @step
    def band_range(q0, part, n_parts, nq, nk, left, right):
        k_begin, k_end = keys(part, n_parts, nk)
        off = I(0)
        if BOTTOM_RIGHT:
            off = I(nk) - I(nq)  # query i sits at position i + Nk - Nq
        lo, hi = key_band(I(q0) + off, I(q0 + LAST) + off, I(nk), left, right)
        k_begin = max(k_begin, U(lo) // UBK * UBK)  # chunks start on tile boundaries, so this stays in the chunk
        return k_begin, U(max(min(I(k_end), hi), I(0))), off

    query_block = (block_heavy_first_split if split else block_heavy_first) if heavy else block_in_order
    return query_block, band_range if f.per_score else causal_range if causal else all_range


def forward_launches(kernel, grid_, threads: int, shape: tuple, splits: int, inputs: tuple, rest: tuple,
                     out="o") -> tuple:
    """([Launch], temporaries) of a forward kernel, kernel(*inputs, o, lse, *rest) over grid_, for outputs o
    (B, H, Nq, d) and lse (B, H, Nq); with splits > 1 it writes each key chunk's float32 output and lse into the
    temporaries o_part (B, H, splits, Nq, d) and lse_part (B, H, splits, Nq), seen as (B, H * splits, ...), and the
    merge kernel folds them into o (as `out` sees it: the tensor kernel's pairs as float16 values) and lse."""
    B, H, Nq, d = shape
    if splits == 1:
        return [Launch(kernel, grid_, threads, (*inputs, "o", "lse", *rest))], {}
    parts = (Arg("o_part", (B, H * splits, Nq, d)), Arg("lse_part", (B, H * splits, Nq)))
    temporaries = {"o_part": ((B, H, splits, Nq, d), np.float32), "lse_part": ((B, H, splits, Nq), np.float32)}
    merge = Launch(build_merge(d, normalised=True), (Nq, H, B), d, ("lse_part", "lse_part", "o_part", out, "lse",
                                                                     splits))
    return [Launch(kernel, grid_, threads, (*inputs, *parts, *rest)), merge], temporaries


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
