"""Lesson 07: checkers of its kernel exercises."""
from __future__ import annotations

import numpy as np

from .core import exercise
from .simcheck import launch, require_kernel, threads_per_block

LESSON = "07_gpu_numba"


@exercise("block_sums", lesson=LESSON, time_limit=30,
          hint="Each thread loads one element (0 past the end of x) into a shared array of TPB floats, "
               "cuda.syncthreads(), then halve the number of active threads each step (buf[t] += buf[t + s] "
               "for t < s) with a cuda.syncthreads() after every step; thread 0 writes buf[0].")
def check_block_sums(t, fn):
    require_kernel(t, fn)
    tpb = threads_per_block(fn, "TPB", 32)
    specs = [("one block", tpb), ("four full blocks", 4 * tpb), ("a short last block", 2 * tpb + 5),
             ("fewer elements than threads", 3), ("one element", 1), ("random length", int(t.rng.integers(1, 5 * tpb)))]
    for label, n in specs:
        # Positive values: a sum that cancels to ~0 has an unbounded relative error even when computed right.
        x = (np.abs(t.normal(n, np.float64)) + 0.5).astype(np.float32)
        blocks = -(-n // tpb)
        t.case(label, "n need not be a multiple of TPB: threads past the end of x add 0." if n % tpb else None,
               n=n, TPB=tpb, grid=blocks)
        out = np.full(blocks, np.nan, np.float32)
        (got,) = launch(t, fn, blocks, tpb, [x, out], [1])
        ref = np.add.reduceat(x.astype(np.float64), np.arange(0, n, tpb))
        t.compare(got, ref, "out", dtype=np.float32)


@exercise("transpose_tiled", lesson=LESSON, time_limit=30,
          hint="Read a[r, c] with r = blockIdx.y*TILE + ty, c = blockIdx.x*TILE + tx into tile[ty, tx]; "
               "cuda.syncthreads(); write out[blockIdx.x*TILE + ty, blockIdx.y*TILE + tx] = tile[tx, ty]. "
               "Guard both the read and the write with the array bounds.")
def check_transpose_tiled(t, fn):
    require_kernel(t, fn)
    tile = threads_per_block(fn, "TILE", 8)
    specs = [("one tile", tile, tile), ("ragged edges", tile + 5, tile + 2), ("a wide matrix", 3, 2 * tile + 1),
             ("a tall matrix", 2 * tile + 1, 1),
             ("random shape", int(t.rng.integers(1, 2 * tile + 1)), int(t.rng.integers(1, 2 * tile + 1)))]
    for label, rows, cols in specs:
        a = t.normal((rows, cols), np.float32)
        grid = (-(-cols // tile), -(-rows // tile))
        t.case(label, "The matrix need not be a multiple of TILE: guard reads and writes." if rows % tile or cols % tile
               else None, a=(rows, cols), TILE=tile, grid=grid, block=(tile, tile))
        out = np.full((cols, rows), np.nan, np.float32)
        (got,) = launch(t, fn, grid, (tile, tile), [a, out], [1])
        t.compare(got, a.T, "out", dtype=np.float32)
        log = t.last_log
        if log.active and not any(arr.w_tid.max() >= 0 for arr in log.arrays if arr.block is not None):
            raise t.fail("right answer, but no shared tile: write a[r, c] into a TILE x TILE shared array and "
                         "write the transposed tile out, so that both the reads of a and the writes of out are "
                         "coalesced (consecutive threads, consecutive addresses)")




# -------------------------------------------------------------------------------- sectors per request
def _sector_slips(a, n):
    """(count, diagnosis) of the usual wrong ways to count a warp request's sectors."""
    return [
        (a.size, "you counted one sector per thread; threads whose bytes fall in the same 32-byte sector "
                 "share it"),
        (np.unique(a).size, "you counted distinct addresses; several addresses share one 32-byte sector"),
        (np.unique(a // 128).size, "you counted 128-byte lines; the unit is the 32-byte sector (4 to a line)"),
        (int((a.max() + n - 1) // 32 - a.min() // 32 + 1), "you counted every sector from the lowest address to "
                                                           "the highest; sectors no thread reads are not fetched"),
        (np.unique(a * n // 32).size, "the addresses are byte addresses already: do not multiply them by nbytes"),
        (np.unique(a // (32 * n)).size, "a sector is 32 bytes whatever each thread reads; divide byte addresses "
                                        "by 32, not by 32 * nbytes"),
    ]


def _sector_cases(t):
    lane = np.arange(32)
    base = 256 * int(t.rng.integers(0, 1 << 20))  # allocations start on a 256-byte boundary
    k = int(t.rng.integers(1, 32))
    cases = [
        ("consecutive floats", base + 4 * lane, 4, None),
        ("consecutive floats, shifted by one float", base + 4 + 4 * lane, 4,
         "An access that does not start on a sector boundary straddles one more sector."),
        ("every other float", base + 8 * lane, 4, None),
        ("one row per thread (64 floats per row)", base + 256 * lane, 4, None),
        ("all threads read one float", np.full(32, base + 4 * k), 4, "Threads reading the same bytes share them."),
        ("16-byte loads, consecutive", base + 16 * lane, 16, None),
        ("8-byte loads, every third element", base + 24 * lane, 8, None),
        ("single bytes, consecutive", base + lane, 1, None),
        ("threads in shuffled order", base + 4 * t.rng.permutation(32), 4, "The order of the threads does not matter."),
        ("8 threads per row, 4 rows of 64 floats", base + 4 * (lane // 8 * 64 + lane % 8), 4, None),
        ("a partial warp", base + 4 * np.arange(k) + 4 * int(t.rng.integers(0, 8)), 4,
         "A warp may have fewer than 32 active threads."),
    ]
    for _ in range(4):
        n = int(t.rng.choice([1, 2, 4, 8, 16]))
        count = int(t.rng.integers(1, 33))
        idx = t.rng.integers(0, int(t.rng.choice([16, 64, 512])), size=count)
        cases.append(("random gather", base + n * idx, n, None))
    return cases


@exercise("sectors_per_request", lesson=LESSON,
          hint="Each thread reads bytes address ... address + nbytes - 1; byte b lies in sector b // 32. Count the "
               "different sectors over all threads (np.unique), not threads, addresses or 128-byte lines.")
def check_sectors_per_request(t, fn):
    from ..memory_access import sectors_per_request

    cases = _sector_cases(t)
    args = [(np.asarray(a, dtype=np.int64), n) for _, a, n, _ in cases]
    for k, ((label, _, _, hint), (addresses, nbytes)) in enumerate(zip(cases, args)):
        t.case(label, hint, addresses=_short_array(addresses), nbytes=nbytes)
        out = t.call(addresses.copy(), nbytes)
        if isinstance(out, (bool, np.bool_)) or not isinstance(out, (int, np.integer)):
            raise t.fail(f"return the number of sectors as an int; got {type(out).__name__} {out!r:.60}")
        want = sectors_per_request(addresses, nbytes)
        if int(out) != want:
            why = t.which_slip(args, _sector_slips, k, int(out))
            raise t.fail(f"you returned {int(out)}; the request touches {want} sectors" + (f": {why}" if why else ""))


def _short_array(a, n=6):
    head = ", ".join(str(int(x)) for x in a[:n])
    return f"[{head}{', ...' if a.size > n else ''}] ({a.size} threads)"
