"""How one warp's memory accesses are served: sectors of global memory, banks of shared memory (07, 08).

A tiny model in NumPy, for one warp instruction (up to 32 threads, "lanes"):

    coalescing(addresses, nbytes)   global memory: the 32-byte sectors the warp's bytes fall in. On compute
                                    capability 6.0 and later a warp's loads or stores "coalesce into a
                                    number of transactions equal to the number of 32-byte transactions
                                    necessary to service all of the threads of the warp" (CUDA C++ Best
                                    Practices Guide, "Coalesced Access to Global Memory").
    bank_conflict_degree(words)     shared memory: 32 banks, successive 32-bit words in successive banks;
                                    threads reading different words of one bank are served one after the
                                    other, threads reading the same word share it (a broadcast). The
                                    degree is the number of passes: the most distinct words asked of one
                                    bank (Best Practices Guide, "Shared Memory and Memory Banks"; CUDA C++
                                    Programming Guide, compute capability 5.x "Shared Memory").

The bank model is for 4-byte accesses; for 8- and 16-byte accesses NVIDIA documents no rule, and this
model gives a lower bound only (a pass delivers at most 32 banks x 4 bytes = 128 bytes).

The kernels' own access patterns (which lane touches which word in the tile copies of
flashlab/kernels/shared.py and register.py) are reproduced by `shared_kernel_copy` and
`register_kernel_copy`; tests/test_memory_access.py checks them against the kernels run in the simulator.
"""
from __future__ import annotations

import numpy as np

WARP = 32  # threads per warp
SECTOR = 32  # bytes: the unit global memory is fetched in
LINE = 128  # bytes: a cache line, 4 sectors
BANKS = 32  # shared-memory banks
WORD = 4  # bytes per bank per cycle

REGISTER_PAD = {"Qt": 4, "Kt": 4, "Pt": 4, "V": 8}  # words added to each row by flashlab/kernels/register.py


def _lane_array(values, name, max_lanes=WARP) -> np.ndarray:
    """A 1-D array of 1..max_lanes non-negative integers, or a ValueError naming the argument."""
    try:
        a = np.asarray(values)
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"{name} must be a 1-D sequence of non-negative integers; got {values!r:.80}") from exc
    if a.ndim != 1 or not 1 <= a.size <= max_lanes:
        raise ValueError(f"{name} must hold one entry per active lane of a warp (1 to {max_lanes}); "
                         f"got shape {a.shape}")
    if a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu" or (a < 0).any():
        raise ValueError(f"{name} must be non-negative integers; got {a[:8]!r}")
    return a.astype(np.int64)


def _nbytes(nbytes) -> int:
    if nbytes not in (1, 2, 4, 8, 16):
        raise ValueError(f"nbytes must be 1, 2, 4, 8 or 16 (what one thread can load at once); got {nbytes!r}")
    return int(nbytes)


# ---------------------------------------------------------------------------------------- global memory
def sectors_touched(addresses, nbytes=4) -> np.ndarray:
    """Sorted indices (address // 32) of the 32-byte sectors that the lanes' bytes fall in."""
    a, n = _lane_array(addresses, "addresses"), _nbytes(nbytes)
    first, last = a // SECTOR, (a + n - 1) // SECTOR
    return np.unique(np.concatenate([np.arange(f, l + 1) for f, l in zip(first, last)]))


def coalescing(addresses, nbytes=4) -> dict:
    """What a warp's request costs: sectors and 128-byte lines touched, bytes used and fetched.

    addresses: byte address of each active lane; nbytes: bytes each lane loads (4 for a float, 16 for a
    16-byte vector load). efficiency = distinct bytes used / bytes fetched (32 per sector).
    """
    a, n = _lane_array(addresses, "addresses"), _nbytes(nbytes)
    secs = sectors_touched(a, n)
    used = np.unique((a[:, None] + np.arange(n)[None, :]).ravel()).size
    return {"sectors": int(secs.size), "lines": int(np.unique(secs // (LINE // SECTOR)).size),
            "bytes_used": int(used), "bytes_fetched": int(secs.size * SECTOR),
            "efficiency": used / (secs.size * SECTOR)}


def sectors_per_request(addresses, nbytes=4) -> int:
    """Number of 32-byte sectors one warp request touches (what exercise 07 asks for)."""
    return int(sectors_touched(addresses, nbytes).size)


# ---------------------------------------------------------------------------------------- shared memory
def banks(words) -> np.ndarray:
    """The bank of each 32-bit word index: successive words sit in successive banks."""
    return _lane_array(words, "words", max_lanes=4 * WARP) % BANKS


def bank_conflict_degree(words) -> int:
    """Passes a warp's shared-memory access needs: the largest number of distinct words asked of one bank.

    words: the 32-bit word index (byte address // 4) of each active lane. 1 means conflict-free (lanes
    reading the same word share it); k means a k-way conflict, served in k passes.
    """
    w = np.unique(_lane_array(words, "words", max_lanes=4 * WARP))
    return int(np.bincount(w % BANKS, minlength=BANKS).max())


def bank_table(words) -> list:
    """For each bank, the distinct words asked of it, in order: [[w, ...], ...] (32 lists)."""
    w = np.unique(_lane_array(words, "words", max_lanes=4 * WARP))
    return [sorted(int(x) for x in w[w % BANKS == b]) for b in range(BANKS)]


# ---------------------------------------------------------------------------------------- access patterns
def tile_access(lanes_per_row, row_len, offset=0, warp=WARP):
    """(row, col) of each lane when a warp reads a tile with `lanes_per_row` consecutive lanes on a row.

    lanes_per_row = 32: the warp reads 32 consecutive elements of one row; 1: one element of each of 32
    rows (a column). offset shifts every column (a misaligned start). Returns (rows, cols) arrays.
    """
    if lanes_per_row not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"lanes_per_row must be a power of two from 1 to 32; got {lanes_per_row!r}")
    if not isinstance(row_len, (int, np.integer)) or row_len < lanes_per_row + offset:
        raise ValueError(f"row_len must be an integer >= lanes_per_row + offset = {lanes_per_row + offset}; "
                         f"got {row_len!r}")
    lane = np.arange(warp)
    return lane // lanes_per_row, lane % lanes_per_row + offset


def shared_kernel_copy(d, block_q, block_k, it=0, warp=0):
    """Tile rows c and dims x each active lane of `warp` copies in iteration `it` of the textbook kernel's
    tile copy (flashlab/kernels/shared.py: element e = it * block_q + t, c = e // d, x = e % d)."""
    t = warp * WARP + np.arange(min(WARP, block_q - warp * WARP))
    e = it * block_q + t
    e = e[e < block_k * d]
    return e // d, e % d


def register_kernel_copy(d, tile, it=0, warp=0, rows=None):
    """Tile rows c and dims x each active lane of `warp` copies in iteration `it` of the register kernel's tile
    copy (flashlab/kernels/register.py): runs of 8 lanes read 8 adjacent floats (32 bytes) of one row,
    so a warp covers 4 rows. rows: the tile's rows (block_k for K and V, block_q for Q)."""
    rows = tile.block_k if rows is None else rows
    t = warp * WARP + np.arange(min(WARP, tile.threads - warp * WARP))
    e = it * tile.threads + t
    e = e[e < rows * d]  # the last iteration may leave lanes idle
    return (e // 8) % rows, (e // 8) // rows * 8 + e % 8


def register_kernel_stores(d, tile, it=0, warp=0, pad=None):
    """Word offsets, within each array, of the shared-memory stores of `warp` in copy iteration `it` of
    the register kernel: {"Qt": ..., "Kt": ..., "V": ...}. Qt and Kt are stored transposed (row x holds
    dim x of every query or key), V as it is. pad: words added to each row, REGISTER_PAD by default;
    pass {"Kt": 0, ...} to see the layout without padding."""
    pad = {**REGISTER_PAD, **(pad or {})}
    cq, xq = register_kernel_copy(d, tile, it, warp, rows=tile.block_q)
    ck, xk = register_kernel_copy(d, tile, it, warp, rows=tile.block_k)
    return {"Qt": xq * (tile.block_q + pad["Qt"]) + cq,
            "Kt": xk * (tile.block_k + pad["Kt"]) + ck,
            "V": ck * (d + pad["V"]) + xk}


def register_kernel_loads(d, tile, step=0, warp=0):
    """Word offsets, within each array, that the lanes of `warp` read at step `step` of the register
    kernel's two product loops: "Qt" and "Kt" at dim x = step of S = Q K^T, "Pt" and "V" at key c = step
    of O += P V. Each is a list with one (lanes, 4) array per load instruction: a thread's runs of 4 adjacent
    words (rows, keys or dims) are what the compiler turns into 16-byte vector loads (runs of 2 or 1 when
    the micro-tile is narrower)."""
    from .kernels.register import _vec

    rm, rn, rd = tile.micro(d)
    t = warp * WARP + np.arange(min(WARP, tile.threads - warp * WARP))
    ty, tx = t // tile.tc, t % tile.tc

    def runs(n, thread, nthreads, stride):  # the thread's n entries, in runs of v adjacent ones
        v = _vec(n)
        k = np.arange(n)
        idx = ((k // v) * nthreads + thread[:, None]) * v + k % v
        return [step * stride + idx[:, r * v:(r + 1) * v] for r in range(n // v)]

    pad = REGISTER_PAD
    return {"Qt": runs(rm, ty, tile.tr, tile.block_q + pad["Qt"]),
            "Kt": runs(rn, tx, tile.tc, tile.block_k + pad["Kt"]),
            "Pt": runs(rm, ty, tile.tr, tile.block_q + pad["Pt"]),
            "V": runs(rd, tx, tile.tc, d + pad["V"])}
