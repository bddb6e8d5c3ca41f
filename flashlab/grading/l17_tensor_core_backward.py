"""Lesson 17, the tensor-core backward: where the backward's dS comes from when dQ needs it as an A fragment, and
the shared memory of a backward tile."""
from __future__ import annotations

import numpy as np

from .. import fragments as F
from .core import exercise, int_answers, judge_answers

LESSON = "17_tensor_core_backward"


# ------------------------------------------------------------------------------- the dS transpose
def ds_sources(query_of, key_of, c_of, lane_of=lambda key, col: 4 * (key % 8) + col // 2, gt=lambda L: divmod(L, 4)):
    """(32, 8, 3) (n-tile, lane, c) of every A element of dS, from formulas for the A element's query and key
    (of g, t, i) and for C's register index (of the column within the n-tile and the key): the checker's
    statement of flashlab.viz.tensor.ds_sources (a test keeps them equal), replayable with a slip (lane_of: the
    C holder's lane from its row and column in the n-tile; gt: (g, t) of the A lane)."""
    out = np.zeros((32, 8, 3), np.int64)
    for lane in range(32):
        g, t = gt(lane)
        for i in range(8):
            query, key = query_of(g, t, i), key_of(g, t, i)
            col = query % 8
            out[lane, i] = (query // 8, lane_of(key, col), c_of(col, key))
    return out


RIGHT_DS = dict(query_of=lambda g, t, i: g + 8 * ((i // 2) % 2), key_of=lambda g, t, i: 2 * t + i % 2 + 8 * (i // 4),
                c_of=lambda col, key: col % 2 + 2 * (key // 8))


def _ds_slips(want):
    no_transpose = np.zeros_like(want)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):  # dS[query, key] looked up as if the stored tile were dS itself (rows = queries)
            query, key = RIGHT_DS["query_of"](g, t, i), RIGHT_DS["key_of"](g, t, i)
            no_transpose[lane, i] = (key // 8, 4 * (query % 8) + (key % 8) // 2, key % 2 + 2 * (query // 8))
    return [
        (no_transpose, "you located dS[query, key] in C fragments whose rows are queries: the warp holds dS "
                       "TRANSPOSED (rows = keys), so dS[query, key] is dS^T[key, query]: row = key, column = query"),
        (ds_sources(RIGHT_DS["query_of"], RIGHT_DS["key_of"], lambda col, key: 2 * (col % 2) + key // 8),
         "the C index is wrong: c0 and c1 are neighbouring columns of one row, c2 and c3 the same columns 8 rows "
         "lower"),
        (ds_sources(lambda g, t, i: g + 8 * (i // 4), lambda g, t, i: 2 * t + i % 2 + 8 * ((i // 2) % 2),
                    RIGHT_DS["c_of"]),
         "A's registers are in the wrong order: a2, a3 (register 1) are the rows 8 further down, a4..a7 the keys "
         "8 further right"),
        (ds_sources(**dict(RIGHT_DS, lane_of=lambda key, col: 4 * (col // 2) + key % 8)),
         "the source lane has g and t swapped: the C value at (row, column) of an n-tile is held by lane 4 g + t "
         "with g = row (here the key % 8) and t = column // 2 (here (query % 8) // 2)"),
        (ds_sources(**dict(RIGHT_DS, gt=lambda L: (L % 4, L // 4))),
         "your lane's (g, t) is wrong: g = lane // 4 (the group of 4 lanes sharing a row), t = lane % 4 (its "
         "place in the group)"),
    ]


@exercise("ds_source", lesson=LESSON,
          hint="First say which element of dS lane (g, t) holds as A element i (the A layout of lesson 15's "
               "exercise 1: row = query, column = key). That value is dS^T[key, query]; the warp holds dS^T as two 8-column C "
               "n-tiles: which n-tile is the query in, and which lane and c hold (row = key, column = query % 8)?")
def check_ds_source(t, fn):
    want = ds_sources(**RIGHT_DS)
    t.case("every element of every lane, in random order", lanes=32, elements_per_lane=8)
    got = np.full(want.shape, -1, np.int64)
    for lane, i in t.rng.permutation([(L, i) for L in range(32) for i in range(8)]):
        out = t.call(int(lane), int(i))
        if (not isinstance(out, (tuple, list, np.ndarray)) or len(out) != 3
                or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in out)):
            raise t.fail(f"return three ints (n_tile, source_lane, c); for lane {lane}, element {i} you returned "
                         f"{out!r:.60}")
        got[lane, i] = [max(min(int(x), 2**40), -2**40) for x in out]
    for slip, why in _ds_slips(want):  # before the range check: some slips leave the C fragments
        if np.array_equal(got, slip):
            raise t.fail(why)
    for lane, i in np.ndindex(32, 8):
        n, L, c = got[lane, i]
        if not (0 <= n < 2 and 0 <= L < 32 and 0 <= c < 4):
            raise t.fail(f"lane {lane}, element {i}: ({n}, {L}, {c}) is not a place in the C fragments: n_tile is "
                         "0 or 1, source_lane 0-31, c 0-3")
    if np.array_equal(got, want):
        # and with values: gathering a random dS^T's C fragments by these places gives dS's A fragment
        dS_T = t.normal((16, 16))
        C = np.stack([F.to_fragments(dS_T[:, 8 * n:8 * n + 8], "m16n8k16", "C") for n in range(2)])
        gathered = C[want[..., 0], want[..., 1], want[..., 2]]
        assert np.array_equal(gathered, F.to_fragments(dS_T.T, "m16n8k16", "A")), "the checker's own map is wrong"
        return
    bad = np.argwhere((got != want).any(-1))
    L, i = bad[0]
    raise t.fail(f"{len(bad)} of the 256 places are wrong; e.g. lane {L}, element {i}: you said "
                 f"{tuple(int(x) for x in got[L, i])}, the value is at {tuple(int(x) for x in want[L, i])} "
                 "(n_tile, source_lane, c)")


# ------------------------------------------------------------------------------------- backward tile bytes
def tile_words(d, block_q, block_k, stages, v_shared, wide, pad=4, pack_ds=True, stage_stats=True, v_rows=None,
               pack=True):
    """32-bit words of the tensor backward's shared memory (kernels/tensor_backward.BackwardTile.shared_words);
    the keyword arguments turn on one slip each, for the checker's verdicts."""
    row = (d if wide or not pack else d // 2) + pad  # a padded row of K, V, Q or dO
    ds_row = (block_q if wide or not pack_ds else block_q // 2) + pad  # a padded row of dS^T (rows = keys)
    v = v_shared if v_rows is None else v_rows
    return ((2 if v else 1) * block_k * row + 2 * stages * block_q * row + block_k * ds_row
            + 2 * (stages if stage_stats else 1) * block_q)


def _tile_cases(rng):
    """(d, block_q, block_k, stages, v_shared, wide): every combination of the flags, random sizes."""
    cases = []
    for wide in (False, True):
        for v_shared in (False, True):
            for stages in (1, 2):
                for _ in range(3):
                    cases.append((int(rng.choice([16, 32, 64, 128])), 16 * int(rng.integers(1, 5)),
                                  16 * int(rng.integers(1, 9)), stages, v_shared, wide))
    return cases


_TILE_SLIPS = [
    (dict(pad=0), "rows are not padded: every row of K, V, Q, dO and dS^T takes 4 more words (16 bytes), so that "
                  "the 8 rows one ldmatrix reads start in different banks"),
    (dict(pack=False), "16-bit values go two to a 32-bit word: a row of K, V, Q or dO is d / 2 words in 16 bits, d "
                       "words in float32"),
    (dict(pack_ds=False), "dS^T is stored like the inputs: in 16 bits two queries share a word (block_q / 2 words a "
                          "row), in float32 one"),
    (dict(stage_stats=False), "lse_i and D_i have a copy per stage, like Q_i and dO_i: the next tile's are copied "
                              "while this one's are used"),
    (dict(v_rows=True), "V_j is in shared memory only when v_shared; otherwise its fragments stay in registers"),
    (dict(v_rows=False), "with v_shared, V_j takes block_k padded rows in shared memory, like K_j"),
]


@exercise("backward_tile_bytes", lesson=LESSON,
          hint="Add up the regions in 32-bit words, then multiply by 4. A row of K, V, Q or dO holds d values: d / 2 "
               "words in 16 bits, d in float32, plus 4 words of padding. K_j (and V_j with v_shared) has block_k "
               "rows; Q_i and dO_i have block_q rows per stage; dS^T has block_k rows of block_q values (packed "
               "like the inputs) plus 4; lse_i and D_i are block_q floats each, per stage.")
def check_backward_tile_bytes(t, fn):
    cases = _tile_cases(t.rng)
    t.case(f"{len(cases)} tiles: d 16-128, block_q 16-64, block_k 16-128, 1 or 2 stages, V in shared memory or "
           "not, 16-bit or float32")
    got = int_answers(t, cases, "the bytes")
    if got == [tile_words(*c) for c in cases]:
        raise t.fail("you returned 32-bit words; return bytes (4 per word)")

    def mismatch(i, want):
        d, bq, bk, stages, v_shared, wide = cases[i]
        wrong = sum(g != 4 * tile_words(*c) for g, c in zip(got, cases))
        return (f"{wrong} of {len(cases)} tiles are wrong; e.g. d={d}, block_q={bq}, block_k={bk}, stages={stages}, "
                f"v_shared={v_shared}, wide={wide}: you said {got[i]} bytes, the kernel takes {want}")

    judge_answers(t, got, lambda **slip: [4 * tile_words(*c, **slip) for c in cases], _TILE_SLIPS, mismatch)
