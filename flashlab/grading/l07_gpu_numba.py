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


