"""Lesson 16, the tensor-core forward: the S = Q K^T step of one warp as a Numba kernel (graded in the simulator),
and which 16-byte chunks of a K tile each thread of the forward copies."""
from __future__ import annotations

import numpy as np

from .. import fragments as F
from .core import exercise, fail_on_slip
from .simcheck import launch, require_kernel

LESSON = "16_tensor_core_forward"


# --------------------------------------------------------------------------- one warp's S = Q K^T
def _a1_a2_swapped(Q):
    """The A operand the tensor core sees when a kernel passes registers a1 and a2 in each other's place: in every
    16-column k-step, the 8 x 8 block of rows 8-15, columns 0-7 and that of rows 0-7, columns 8-15 trade places."""
    A = Q.copy()
    for c in range(0, Q.shape[1], 16):
        A[8:16, c:c + 8], A[0:8, c + 8:c + 16] = Q[0:8, c + 8:c + 16], Q[8:16, c:c + 8]
    return A


def _s_tile_explain(Q, K, tol):
    """explain(S) for the kernel check: which usual slip the wrong S looks like."""
    Q64, K64 = Q.astype(np.float64), K.astype(np.float64)
    ref = Q64 @ K64.T
    d = Q.shape[1]

    def explain(S):
        S = np.asarray(S, np.float64)
        scale = np.abs(ref).max()
        if np.isnan(S).any():
            rows, cols = np.nonzero(np.isnan(S))
            return [f"S[{r}, {c}] was never written" for r, c in zip(rows[:3], cols[:3])] + [
                "every lane stores its four results c0..c3 of every 8-key n-tile, at the places C's layout gives "
                "them: together the 32 lanes cover all 16 x 8 entries of each n-tile"], None
        if d > 16:
            for ks, what in ((d // 16 - 1, "the last"), (0, "the first")):
                part = Q64[:, 16 * ks:16 * ks + 16] @ K64[:, 16 * ks:16 * ks + 16].T
                if np.abs(S - part).max() <= tol * scale:
                    return [], (f"S holds only {what} k-step's 16 dims: the accumulators c0..c3 must start at 0 once "
                                "per n-tile and carry over all d / 16 k-steps (pass the previous c into each mma).")
        if np.abs(S - _a1_a2_swapped(Q64) @ K64.T).max() <= tol * scale:
            return [], ("the A registers are in the wrong order: you passed Q's words as (row g, w), (g, w + 4), "
                        "(g + 8, w), (g + 8, w + 4). PTX's order is a0 a1 = row g, a2 a3 = row g + 8 (a register "
                        "each), then the same rows 8 columns on: (g, w), (g + 8, w), (g, w + 4), (g + 8, w + 4).")
        wrong = np.abs(S - ref) > tol * scale
        details = []
        top, bottom = wrong[:8].any(), wrong[8:].any()
        if top != bottom:
            details.append(f"only rows {'0-7' if top else '8-15'} are wrong: look at the registers of rows "
                           f"{'g' if top else 'g + 8'} (a0/a2 or a1/a3, and c0/c1 or c2/c3)")
        even, odd = wrong[:, 0::2].any(), wrong[:, 1::2].any()
        if even != odd:
            details.append(f"only {'even' if even else 'odd'} columns are wrong: c{'0' if even else '1'} and "
                           f"c{'2' if even else '3'} go to columns {'2t' if even else '2t + 1'} of each n-tile")
        tiles = [bool(wrong[:, 8 * n:8 * n + 8].any()) for n in range(S.shape[1] // 8)]
        if any(tiles) and not all(tiles):
            details.append(f"n-tiles {[n for n, w in enumerate(tiles) if w]} (keys 8n to 8n + 7) are wrong, "
                           f"{[n for n, w in enumerate(tiles) if not w]} right")
        if wrong.all():
            details.append("every entry is wrong: check the B registers (K[key 8n + g], words 8ks + t and "
                           "8ks + t + 4) and the A registers (Q rows g and g + 8, words 8ks + t and 8ks + t + 4)")
        return details, None

    return explain


@exercise("s_tile", lesson=LESSON, time_limit=30,
          hint="Use the positions of lesson 15's exercise 1, counted in 32-bit words: a register holds columns 2w "
               "and 2w + 1 of a row, which is word w. A is Q: its rows are query rows, and k-step ks is words 8ks "
               "to 8ks + 7. B is "
               "Kᵀ: B's columns are the n-tile's 8 keys and B's rows are dims, so a lane's B register is a word of "
               "one row of K. Accumulate c0..c3 over all k-steps of an n-tile, then store them where C's layout "
               "puts them.")
def check_s_tile(t, fn):
    require_kernel(t, fn)
    d_rand, nk_rand = int(t.rng.choice([16, 32, 64])), 8 * int(t.rng.integers(1, 5))
    specs = [("one k-step, one n-tile", 16, 8), ("two k-steps", 32, 16), ("four n-tiles", 16, 32),
             ("d = 64, two n-tiles", 64, 16), ("random", d_rand, nk_rand)]
    for label, d, nk in specs:
        Q = F.round_f16(t.normal((16, d), np.float32))
        K = F.round_f16(t.normal((nk, d), np.float32))
        q = np.ascontiguousarray(F.to_bits16(Q, "float16")).view(np.uint32)
        k = np.ascontiguousarray(F.to_bits16(K, "float16")).view(np.uint32)
        s = np.full((16, nk), np.nan, np.float32)
        t.case(label, d=d, n_keys=nk, q=f"(16, {d // 2}) uint32", k=f"({nk}, {d // 2}) uint32", launch="[1, 32]")
        (got,) = launch(t, fn, 1, 32, [q, k, s], [2])
        ref = Q.astype(np.float64) @ K.astype(np.float64).T
        t.compare(got, ref, "S", dtype=np.float32, tol=1e-5, explain=_s_tile_explain(Q, K, 1e-4))


# ------------------------------------------------------------------------------------- row padding
def row_padding(row_words, rows=8, group=4, banks=32):
    """The fewest 4-byte words of padding, a multiple of `group` (rows stay 16-byte aligned), after which the first
    16 bytes of `rows` consecutive rows fall in `rows` different groups of `group` banks."""
    for pad in range(0, banks + 1, group):
        if len({(r * (row_words + pad)) % banks // group for r in range(rows)}) == rows:
            return pad
    raise AssertionError("some multiple of the group size below the bank count works")


_PADDING_SLIPS = [
    (dict(group=1), "the padding must be a multiple of 4 words: cp.async and ldmatrix move 16-byte chunks, so every "
                    "row must start on a 16-byte boundary"),
    (dict(rows=2), "all 8 rows of a phase must start in different bank groups, not just two neighbouring rows"),
]


@exercise("row_padding", lesson=LESSON,
          hint="Row r of the tile starts at word r * (W + p), in bank (r * (W + p)) % 32; a 16-byte chunk covers 4 "
               "banks, so the chunk's bank group is that // 4. Try p = 0, 4, 8, ... and keep the first p for which "
               "the 8 rows of a phase give 8 different groups.")
def check_row_padding(t, fn):
    widths = sorted({4 * w for w in range(1, 65)} | {4 * int(w) for w in t.rng.integers(65, 200, 4)})
    t.case(f"rows of W = {widths[0]} to {widths[-1]} words, every multiple of 4 up to 256 and a few above")
    got = []
    for W in widths:
        p = t.call(W)
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise t.fail(f"return the padding as an int number of 4-byte words; for W={W} you returned {p!r:.60}")
        got.append(int(p))
    want = [row_padding(W) for W in widths]
    if got == want:
        return
    if all(g == 4 * w for g, w in zip(got, want)):
        raise t.fail("count the padding in 4-byte words (banks are 4 bytes wide), not in bytes")
    if all(g == 4 for g in got):
        raise t.fail("4 words is right whenever W / 4 is even (every d the kernel takes), but when W / 4 is odd the "
                     f"rows already start in 8 different groups: W={widths[0]} needs {want[0]}")
    for keywords, why in _PADDING_SLIPS:
        if got == [row_padding(W, **keywords) for W in widths]:
            raise t.fail(why)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    starts = [(r * (widths[i] + got[i])) % 32 // 4 for r in range(8)]
    raise t.fail(f"W={widths[i]}: you said {got[i]}; with that padding the 8 rows of a phase start in bank groups "
                 f"{starts}, and the smallest padding that makes them all different is {want[i]}")


# ------------------------------------------------------------------------------------- copy plan
def copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide, pad=4, pack=True, stride=True, chunks_first=True,
              clamp=True):
    """(shared word, source word, bytes) of each 16-byte copy thread `tid` makes of one K tile in the tensor
    forward (kernels/tensor.py, the LINEAR copies); the keyword arguments turn on one slip each."""
    W = d if wide or not pack else d // 2  # 32-bit words in a row of K
    cpr = W // 4  # 16-byte chunks in a row
    if chunks_first:  # consecutive threads take consecutive chunks of a row
        row0, col, step = tid // cpr, 4 * (tid % cpr), threads // cpr
    else:  # consecutive threads take consecutive rows
        rows = threads // cpr
        row0, col, step = tid % rows, 4 * (tid // rows), rows
    out, rs = [], row_stride if stride else W
    for row in range(row0, block_k, step):
        ok = k0 + row < n_k
        out.append((row * (W + pad) + col, (k0 + row) * rs + col if ok or not clamp else k0 * rs + col, 16 if ok else 0))
    return out


def _copy_cases(rng):
    """(threads, d, block_k, k0, n_k, row_stride, wide): contiguous and packed (varlen-like) rows, tiles that
    end inside and past the keys."""
    cases = []
    for wide in (False, True):
        for packed in (False, True):
            for _ in range(4):
                d = int(rng.choice([16, 32, 64, 128]))
                W = d if wide else d // 2
                threads = int(rng.choice([t for t in (32, 64, 128, 256) if t % (W // 4) == 0]))
                block_k = int(rng.choice([16, 32, 64]))
                k0 = block_k * int(rng.integers(0, 4))
                n_k = k0 + int(rng.integers(1, 2 * block_k))
                row_stride = W * (int(rng.integers(2, 9)) if packed else 1)
                cases.append((threads, d, block_k, k0, n_k, row_stride, wide))
    return cases


_COPY_SLIPS = [
    (dict(pad=0), "rows in shared memory are padded by 4 words (16 bytes), so that the 8 rows one ldmatrix reads "
                  "start in different banks: a row starts every d/2 + 4 words (16-bit) or d + 4 (float32)"),
    (dict(pack=False), "16-bit values go two to a 32-bit word: a row of K is d / 2 words in 16 bits, d in float32"),
    (dict(stride=False), "the source's rows are row_stride words apart, not d/2 (or d): in a packed varlen batch the "
                         "other heads' values sit between two rows of this head"),
    (dict(chunks_first=False), "consecutive threads take consecutive 16-byte chunks of one row (so a warp reads "
                               "whole rows, coalesced), then the next rows: row tid // chunks, chunk tid % chunks"),
    (dict(clamp=False), "a row past n_k copies 0 bytes (cp.async writes 16 zero bytes), and its source address "
                        "must still be valid: use the same column of the tile's first row k0, which always exists "
                        "(source word k0 * row_stride + column)"),
]


@exercise("copy_plan", lesson=LESSON,
          hint="Number the tile's 16-byte chunks row by row: a row of W words has W/4 of them. For a warp's reads to "
               "be consecutive, thread tid takes chunk tid first; all threads together then move on by `threads` "
               "chunks, a whole number of rows, so each thread keeps its column. Turn a chunk number into (row, "
               "column word), then into the shared word (rows W + 4 apart) and the source word (rows row_stride "
               "apart, from row k0). A row past n_k copies 0 bytes, from the same column of row k0.")
def check_copy_plan(t, fn):
    cases = _copy_cases(t.rng)
    t.case(f"{len(cases)} tiles (d 16-128, 32-256 threads, block_k 16-64, contiguous and packed rows, tiles that "
           "end past n_k), every thread of each")
    got, want, where = [], [], []
    for threads, d, block_k, k0, n_k, row_stride, wide in cases:
        for tid in range(threads):
            out = t.call(tid, threads, d, block_k, k0, n_k, row_stride, wide)
            try:
                out = [tuple(int(x) for x in c) for c in out]
                if any(len(c) != 3 for c in out):
                    raise ValueError
            except (TypeError, ValueError):
                raise t.fail(f"return a list of (shared word, source word, bytes) tuples; for tid={tid} you "
                             f"returned {out!r:.80}") from None
            got.append(out)
            want.append(copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide))
            where.append((tid, threads, d, block_k, k0, n_k, row_stride, wide))
    if got == want:
        return
    fail_on_slip(t, got, lambda **slip: [copy_plan(*w, **slip) for w in where], _COPY_SLIPS)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    tid, threads, d, block_k, k0, n_k, row_stride, wide = where[i]
    raise t.fail(f"{sum(g != w for g, w in zip(got, want))} of {len(got)} threads' plans are wrong; e.g. tid={tid} of "
                 f"{threads}, d={d}, block_k={block_k}, k0={k0}, n_k={n_k}, row_stride={row_stride}, wide={wide}: you "
                 f"said {got[i][:3]}{'...' if len(got[i]) > 3 else ''}, the kernel copies {want[i][:3]}"
                 f"{'...' if len(want[i]) > 3 else ''}")
