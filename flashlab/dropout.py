"""The dropout mask of attention, from a counter-based generator: one place for every implementation.

FlashAttention never stores its dropout mask: the backward regenerates it. So the mask is a pure function
of a key, here (seed, batch, head, row, col), and not the state of a sequential generator. (The FA library
uses Philox with the key as counter; this course uses a smaller hash of the same key, so its masks differ
from the library's but have the same property.)

The hash chains MurmurHash3's 32-bit finaliser ("fmix32", a bijection on 32-bit words) over the key's
fields. It needs only 32-bit multiply, xor and shift, computed in 64-bit integers and masked to 32 bits, so
the scalar `dropout_bits` runs unchanged in Python, in a Numba CPU or CUDA kernel (int64 products wrap,
their low 32 bits are exact), and `dropout_bits_array` is the same arithmetic on NumPy uint64 arrays. The
register kernels use `device_functions`: the same chain in uint64, hashing each key prefix once.

An element is kept when its 32-bit hash u satisfies u >= keep_threshold(p) = floor(p * 2**32): with
probability 1 - p. Kept values are scaled by 1 / (1 - p), so the mask leaves the expected output unchanged.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: keeps a field of 0 from leaving the state unchanged


def fmix32(h):
    """MurmurHash3's finaliser: a bijection of 32-bit words whose output bits all depend on every input bit."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    h ^= h >> 16
    return h


def dropout_bits(seed, batch, head, row, col):
    """The 32-bit hash of one key (scalar ints, seed in [0, 2**63)). Numba-friendly: integer ops only."""
    h = fmix32(((seed & M32) + GOLDEN) & M32)
    h = fmix32(((h ^ ((seed >> 32) & M32)) + GOLDEN) & M32)
    h = fmix32(((h ^ (batch & M32)) + GOLDEN) & M32)
    h = fmix32(((h ^ (head & M32)) + GOLDEN) & M32)
    h = fmix32(((h ^ (row & M32)) + GOLDEN) & M32)
    h = fmix32(((h ^ (col & M32)) + GOLDEN) & M32)
    return h


def dropout_bits_array(seed, batch, head, row, col):
    """`dropout_bits` on broadcast NumPy arrays of indices (computed in uint64, so products wrap)."""
    u = np.uint64
    m = u(M32)
    f = [np.asarray(x).astype(np.uint64) & m for x in (batch, head, row, col)]
    s = int(seed)
    h = np.asarray(fmix32(((s & M32) + GOLDEN) & M32), np.uint64)
    h = np.asarray(fmix32((((int(h) ^ ((s >> 32) & M32)) + GOLDEN) & M32)), np.uint64)
    with np.errstate(over="ignore"):  # uint64 products wrap by design; only their low 32 bits are kept
        for x in f:
            h = ((h ^ x) + u(GOLDEN)) & m
            h ^= h >> u(16)
            h = (h * u(0x85EBCA6B)) & m
            h ^= h >> u(13)
            h = (h * u(0xC2B2AE35)) & m
            h ^= h >> u(16)
    return h


def keep_threshold(p: float) -> int:
    """Keep an element when its hash is >= this: floor(p * 2**32), so the keep probability is 1 - p."""
    return int(p * 4294967296.0)


def keep_scale(seed, p, batch, head, row, col):
    """The dropout multiplier Z / (1 - p) (0 or 1/(1-p)) at broadcast index arrays, as float64."""
    keep = dropout_bits_array(seed, batch, head, row, col) >= np.uint64(keep_threshold(p))
    return keep / (1.0 - p)


@lru_cache(maxsize=None)
def device_functions(p: float):
    """CUDA device functions (start, mix, keep) for the kernels with dropout p (register, tensor backward).

    The hash is a chain over the key's fields, so a kernel hashes (seed, batch, head) once per block with
    start(seed, b, h), each of its rows once with mix(state, i), and then keep(row_state, j) gives the
    multiplier Z / (1 - p) (float32) at column j: one fmix32 per element of S. The arithmetic is uint64, in
    which a product of two 32-bit words never overflows, so the bits are `dropout_bits`' exactly, on a GPU,
    in the simulator and in Python, for any seed in [0, 2**63)."""
    from numba import float32

    from .device import get_cuda

    cuda = get_cuda()
    U = np.uint64
    MASK, GOLD, C1, C2 = U(M32), U(GOLDEN), U(0x85EBCA6B), U(0xC2B2AE35)
    THRESH, SCALE, ZERO = U(keep_threshold(p)), float32(1.0 / (1.0 - p)), float32(0.0)

    @cuda.jit(device=True, inline=True)
    def mix(state, x):
        """The state after one more field x: fmix32(((state ^ x) + GOLDEN) mod 2**32)."""
        h = ((state ^ (np.uint64(x) & MASK)) + GOLD) & MASK
        h ^= h >> np.uint64(16)
        h = (h * C1) & MASK
        h ^= h >> np.uint64(13)
        h = (h * C2) & MASK
        h ^= h >> np.uint64(16)
        return h

    @cuda.jit(device=True, inline=True)
    def start(seed, b, h):
        """The state after (seed's low and high 32 bits, batch b, query head h)."""
        s = np.uint64(seed)
        return mix(mix(mix(mix(np.uint64(0), s & MASK), s >> np.uint64(32)), b), h)

    @cuda.jit(device=True, inline=True)
    def keep(row_state, j):
        """Z / (1 - p) at column j of the row whose state is row_state: 1/(1-p) where kept, else 0."""
        return SCALE if mix(row_state, j) >= THRESH else ZERO

    return start, mix, keep


def batch_head_index(lead_shape):
    """(batch, head) index arrays of shape lead_shape + (1, 1) for q of shape lead_shape + (Nq, d).

    The last leading dim is the query head; the dims before it are flattened (row-major) into one batch
    index. q of shape (Nq, d) is batch 0, head 0; (H, Nq, d) is batch 0."""
    lead_shape = tuple(lead_shape)
    if not lead_shape:
        return np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64)
    flat = np.arange(int(np.prod(lead_shape, dtype=np.int64)), dtype=np.int64).reshape(lead_shape)
    h = lead_shape[-1]
    return (flat // h)[..., None, None], (flat % h)[..., None, None]
