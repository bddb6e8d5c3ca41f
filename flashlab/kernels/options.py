"""The library's options, defined once for every kernel (forward and backward, register and tensor cores) and for
the host code that plans around them (the planner's work model, the varlen block tables) and NumPy's tiled
FlashAttention (flashlab/tiled.py), which mirrors the device functions here; tests/test_options_band.py holds the
two equal.

What an option means, in one place:
- the band: query i sits at aligned position pos = i + off among the keys (off = Nk - Nq bottom-right, else 0)
  and sees key j when pos - left <= j <= pos + right and j < Nk; -1 leaves a side unbounded, and causal masking
  is right = 0 (or the window's right if smaller: Extras.right_bound). `key_band` gives the keys a run of rows
  can see, `query_band` the rows that can see a run of keys; a kernel visits only the tiles that overlap them;
- the element mask (`outside`) and the score transforms (`capped`: softcap, then ALiBi's bias); the kernels mask
  through each row's `key_band`, compared in the tile's own columns, which tests/test_options_band.py holds equal
  to `outside` element by element;
- dropout: flashlab.dropout's hash, keyed by (seed, batch, query head, row, key);
- the end-of-row convention (`row_end`): a row that saw no key gets o = 0 and lse = +inf (NEG inside a split-KV
  chunk, so that the merge ignores it); each kernel's finish step applies it beside its own lse arithmetic.

An option's presence is compiled in (`Features`, part of a build's key); its values are kernel arguments
(`OptionArgs`: the window's bounds, the softcap and the ALiBi slopes), so a new window or slope set compiles
nothing. The dropout probability stays compiled in: its keep threshold and 1/(1 - p) are constants of the hash
test, and a model trains with one p (the seed, which changes every step, is an argument).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import float32

from ..device import get_cuda
from .common import I, LOG2E, NEG

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs


class Features(NamedTuple):
    """The options a build compiles in, without their values (those are OptionArgs)."""
    window: bool = False  # a left or right bound besides causal's
    bottom_right: bool = False  # aligned bottom-right: off = Nk - Nq
    softcap: bool = False
    alibi: bool = False
    dropout_p: float = 0.0

    @property
    def per_score(self) -> bool:
        """True when every tile's scores are transformed and masked (window, alignment, softcap, ALiBi): the
        builds' per-score path. Dropout alone keeps the plain masking (edge tiles only)."""
        return self.window or self.bottom_right or self.softcap or self.alibi

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0

    @property
    def any(self) -> bool:
        return self.per_score or self.dropout


class OptionArgs(NamedTuple):
    """The options' values as kernel arguments, in the kernel's units.
    left, right: the band (-1 unbounded; right has causal folded in, Extras.right_bound); cap: the softcap (0 off),
    times log2(e) where the kernel keeps S in log2 units; slopes: float32 (B * H,) ALiBi slopes indexed b * H + h
    (per-head slopes repeated for each batch), times log2(e) likewise; one 0 without ALiBi."""
    left: int
    right: int
    cap: np.float32
    slopes: np.ndarray


class Extras(NamedTuple):
    """The library options of one call (checked by flashlab._inputs.check_options): window (left, right) with -1
    unbounded, bottom-right alignment, softcap (0 = off), ALiBi slopes as a tuple of floats, one per head
    (per_batch: one per (batch, head), batch-major), dropout_p (0 = off; the seed is a kernel argument).
    features() is what a build compiles in, arguments() the values it takes at launch."""
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

    def features(self) -> Features:
        return Features(self.left >= 0 or self.right >= 0, bool(self.bottom_right), self.softcap > 0,
                        self.slopes is not None, float(self.dropout_p))

    def arguments(self, causal: bool, B: int, H: int, log2: bool) -> OptionArgs:
        """The kernel arguments for B batches (sequences, for varlen) of H query heads; log2: the kernel keeps S
        scaled by log2(e), so softcap and slopes are too (in float64, then rounded once to float32)."""
        unit = LOG2E if log2 else 1.0
        slopes = np.zeros(1, np.float32)
        if self.slopes is not None:
            a = np.asarray(self.slopes, np.float64).reshape((B, H) if self.per_batch else (1, H))
            slopes = np.ascontiguousarray(np.broadcast_to(a * unit, (B, H)).astype(np.float32).ravel())
        return OptionArgs(int(self.left), int(self.right_bound(causal)), np.float32(self.softcap * unit), slopes)

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


PLAIN = Extras()


def argument_types() -> tuple:
    """The numba types of OptionArgs as kernels take them (left, right, cap, slopes): for signatures."""
    from numba import int64, types

    return (int64, int64, float32, types.Array(float32, 1, "C"))


def plain_arguments(causal: bool = False) -> OptionArgs:
    """The arguments of a build without options (it ignores them; its signature is every build's)."""
    return PLAIN.arguments(causal, 1, 1, False)


# ---------------------------------------------------------------------------------- the band, on the host
# NumPy twins of the device functions below (scalars or arrays of positions; the bounds are scalars): the planner's
# work model, the varlen block tables and NumPy's tiled FlashAttention use them. Signed int64 throughout.

def key_band(first, last, nk, left: int, right: int):
    """[lo, hi): the keys that at least one row at aligned positions first..last can see, within [0, nk)
    (lo >= hi: none)."""
    first, last, nk = np.asarray(first, np.int64), np.asarray(last, np.int64), np.asarray(nk, np.int64)
    lo = np.maximum(first - left, 0) if left >= 0 else np.zeros_like(first)
    hi = np.minimum(last + right + 1, nk) if right >= 0 else np.broadcast_to(nk, np.broadcast(first, nk).shape)
    return lo, np.asarray(hi)


def query_band(first, last, off, nq, left: int, right: int):
    """[lo, hi): the query rows (indices i, at positions i + off) that can see at least one of keys first..last,
    within [0, nq) (lo >= hi: none). Row i sees key j when j - right <= i + off <= j + left."""
    first, last = np.asarray(first, np.int64), np.asarray(last, np.int64)
    off, nq = np.asarray(off, np.int64), np.asarray(nq, np.int64)
    lo = np.clip(first - right - off, 0, nq) if right >= 0 else np.zeros(np.broadcast(first, off, nq).shape, np.int64)
    hi = np.clip(last + left + 1 - off, 0, nq) if left >= 0 else np.broadcast_to(nq, lo.shape)
    return lo, np.asarray(hi)


def outside(pos, col, nk, left: int, right: int):
    """True where key col is masked for the row at aligned position pos: past the keys, left of the window, or
    right of `right`."""
    pos, col = np.asarray(pos, np.int64), np.asarray(col, np.int64)
    out = col >= nk
    if left >= 0:
        out = out | (col < pos - left)
    if right >= 0:
        out = out | (col > pos + right)
    return out


def tile_band(lo, hi, block: int):
    """The tiles of `block` keys (or rows) that overlap [lo, hi): (first tile's start, one past the last tile's
    end, number of tiles); the start is a multiple of block, none where lo >= hi."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    start = lo // block * block
    n = np.where(hi > lo, -(-(hi - start) // block), 0)
    return start, start + n * block, n


# -------------------------------------------------------------------------------- the options, on the device
def device_functions(f: Features):
    """The device functions of the options a build compiles in (Features), inlined into the kernel by Numba
    (inline="always": no call, and the kernel's fastmath flags apply to them). Signed int64 positions; left and
    right are run-time values (OptionArgs), the presence of a window is compile-time (f.window).

    key_band(first, last, nk, left, right) -> (lo, hi) and query_band(first, last, off, nq, left, right) -> (lo, hi):
    as the host twins above.
    outside(pos, col, nk, left, right) -> True where the key is masked.
    capped(val, pos, col, cap, slope) -> (val', th): softcap then ALiBi's bias on one score, with cap and slope in
    the score's units (each kernel keeps S in its own); th = tanh(val / cap), 0 without softcap, for the backward's
    factor 1 - th^2.
    row_end(total, lse, empty) -> (inv, lse): 1 / total and the row's lse, or (0, empty) for a row that saw no key
    (total = 0): empty is +inf for a finished row (the FA library's o = 0, lse = +inf), NEG for a split-KV chunk's
    partial row (the merge then gives it no weight)."""
    WINDOW, SOFTCAP, ALIBI = bool(f.window), bool(f.softcap), bool(f.alibi)
    ZERO = float32(0.0)

    @cuda.jit(device=True, inline="always")
    def key_band(first, last, nk, left, right):
        lo, hi = I(0), I(nk)
        if WINDOW and left >= I(0):
            lo = max(first - left, I(0))
        if right >= I(0):
            hi = min(last + right + I(1), I(nk))
        return lo, hi

    @cuda.jit(device=True, inline="always")
    def query_band(first, last, off, nq, left, right):
        lo, hi = I(0), I(nq)
        if right >= I(0):
            lo = min(max(first - right - off, I(0)), I(nq))
        if WINDOW and left >= I(0):
            hi = min(max(last + left + I(1) - off, I(0)), I(nq))
        return lo, hi

    @cuda.jit(device=True, inline="always")
    def outside_(pos, col, nk, left, right):
        return col >= nk or (WINDOW and left >= I(0) and col < pos - left) or (right >= I(0) and col > pos + right)

    @cuda.jit(device=True, inline="always")
    def capped(val, pos, col, cap, slope):
        th = ZERO
        if SOFTCAP:
            th = math.tanh(val / cap)
            val = cap * th
        if ALIBI:
            val -= slope * float32(abs(pos - col))
        return val, th

    @cuda.jit(device=True, inline="always")
    def row_end(total, lse, empty):
        if total > ZERO:
            return float32(1.0) / total, lse
        return ZERO, empty

    return OptionFunctions(key_band, query_band, outside_, capped, row_end)


class OptionFunctions(NamedTuple):
    key_band: object
    query_band: object
    outside: object
    capped: object
    row_end: object


EMPTY_LSE = float32(math.inf)  # row_end's `empty` for a finished row
EMPTY_PARTIAL = float32(NEG)  # ... and for a split-KV chunk's partial row
