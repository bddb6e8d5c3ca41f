"""The library's options as the kernels compile them in: Extras (window, alignment, softcap, ALiBi, dropout),
the per-score transforms and mask (score_functions) and where a forward block works (block_functions)."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import float32

from ..device import get_cuda
from .common import I, U

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs


class Extras(NamedTuple):
    """The library options the register kernels compile in (checked by flashlab._inputs.check_options):
    window (left, right) with -1 unbounded, bottom-right alignment, softcap (0 = off), ALiBi slopes as a
    tuple of floats, one per head (per_batch: one per (batch, head), batch-major), dropout_p (0 = off; the
    seed is a kernel argument)."""
    left: int = -1
    right: int = -1
    bottom_right: bool = False
    softcap: float = 0.0
    slopes: tuple | None = None
    per_batch: bool = False
    dropout_p: float = 0.0

    def right_bound(self, causal: bool) -> int:
        """The furthest key to the right a row may see, relative to its aligned position: 0 under causal (or
        the window's right if smaller), else the window's right; -1 for no bound."""
        return (min(self.right, 0) if self.right >= 0 else 0) if causal else self.right

    @classmethod
    def from_options(cls, opt, B: int, H: int):
        """Extras for checked AttentionOptions, or None when they ask for nothing beyond causal."""
        slopes = per_batch = None
        if opt.alibi is not None:
            a = np.asarray(opt.alibi, np.float64)
            per_batch = a.ndim == 2
            slopes = tuple(float(x) for x in (np.broadcast_to(a, (B, H)) if per_batch else a).ravel())
        extras = cls(int(opt.window[0]), int(opt.window[1]), opt.align == "bottom_right", float(opt.softcap), slopes,
                     bool(per_batch), float(opt.dropout_p))
        return None if extras == cls() else extras


def score_functions(ex: Extras, causal: bool):
    """(capped, outside): the per-entry part of the library's options, shared by every kernel that takes them
    (the forwards kernels/register.py and kernels/tensor.py, the backwards kernels/register_backward.py and
    kernels/tensor_backward.py).

    capped(val, pos, col, cap, slope) -> (val', th): softcap then ALiBi's bias on one score at aligned query
    position pos and key col, with cap and slope in the score's units (each kernel keeps S in its own: scaled by
    log2(e), or raw); th = tanh(val / cap), 0 without softcap, for the backward's factor 1 - th^2.
    outside(pos, col, nk, right) -> True where the key is masked: past the keys, left of the window, or right of
    `right` (Extras.right_bound: compile-time in the forwards, decided at run time by the register backward)."""
    WL = I(ex.left)
    SOFTCAP, ALIBI = ex.softcap > 0, ex.slopes is not None

    @cuda.jit(device=True, inline=True)
    def capped(val, pos, col, cap, slope):
        th = float32(0.0)
        if SOFTCAP:
            th = math.tanh(val / cap)
            val = cap * th
        if ALIBI:
            val -= slope * float32(abs(pos - col))
        return val, th

    @cuda.jit(device=True, inline=True)
    def outside(pos, col, nk, right):
        return col >= nk or (WL >= I(0) and col < pos - WL) or (right >= I(0) and col > pos + right)

    return capped, outside


def block_functions(ex: Extras, causal: bool, extra: bool, block_q: int, block_k: int, heavy: bool, split: bool):
    """(query_block, key_range): where a forward thread block works, shared by kernels/register.py and
    kernels/tensor.py.

    query_block(batch, n_heads) -> (q0, bh, part, n_parts): the block's first query row, its (batch, head) index,
    and its key chunk among n_parts (split-KV), from the grid (see split_kv.grid: heaviest blocks first).
    key_range(q0, part, n_parts, nq, nk) -> (k_begin, k_end, off): the keys the block visits, cut to its chunk,
    to causal attention's triangle, or (extra: the library's options) to the band of its rows, and off, the
    alignment's shift of query positions (Nk - Nq bottom-right, else 0). Tiles outside the range are skipped."""
    WL, BRA, RIGHT = I(ex.left), bool(ex.bottom_right), I(ex.right_bound(causal))
    UBQ, UBK, HEAVY, SPLIT, CAUSAL, EXTRA = U(block_q), U(block_k), bool(heavy), bool(split), bool(causal), extra

    @cuda.jit(device=True, inline=True)
    def query_block(batch, n_heads):
        if HEAVY:  # grid (g, query blocks, sections x splits): in each section of g heads, the heaviest blocks first
            q0 = U(cuda.gridDim.y - 1 - cuda.blockIdx.y) * UBQ
            section, part, n_parts = U(cuda.blockIdx.z), U(0), U(1)
            if SPLIT:  # z = part * sections + section
                sections = U(batch) * U(n_heads) // U(cuda.gridDim.x)
                section, part, n_parts = section % sections, section // sections, U(cuda.gridDim.z) // sections
            bh = section * U(cuda.gridDim.x) + U(cuda.blockIdx.x)
        else:  # grid (query blocks, B*H, splits): the last (heaviest, under causal) blocks of a head first
            bh, part, n_parts = U(cuda.blockIdx.y), U(cuda.blockIdx.z), U(cuda.gridDim.z)
            q0 = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * UBQ
        return q0, bh, part, n_parts

    @cuda.jit(device=True, inline=True)
    def key_range(q0, part, n_parts, nq, nk):
        k_begin, k_end = U(0), nk
        if SPLIT:  # this block's chunk of keys: a multiple of block_k keys (split_chunk computes the same)
            chunk = ((nk + n_parts - U(1)) // n_parts + UBK - U(1)) // UBK * UBK
            k_begin = part * chunk
            k_end = min(nk, k_begin + chunk)
        if CAUSAL and not EXTRA:
            k_end = min(k_end, q0 + UBQ)  # key tiles after the block's last query are skipped
        off = I(0)
        if EXTRA:  # skip the key tiles entirely outside the band of this block's rows (signed positions)
            if BRA:
                off = I(nk) - I(nq)  # query i sits at position i + Nk - Nq
            if WL >= I(0):
                lo = I(q0) + off - WL
                if lo > I(k_begin):
                    k_begin = U(lo) // UBK * UBK  # chunks start on tile boundaries, so this stays in the chunk
            if RIGHT >= I(0):
                hi = I(q0) + I(UBQ) + off + RIGHT  # one past the last key the block's last row may see
                if hi < I(k_end):
                    k_end = U(max(hi, I(0)))
        return k_begin, k_end, off

    return query_block, key_range
