"""Lesson 18, the FlashAttention library's options: which key blocks a query block visits under a window and
an alignment, the GQA head map and what packing query heads saves, one tile of the ALiBi bias, the dropout
mask regenerated from its key, and a paged KV cache's block-table lookup.

Every answer is computed here from flashlab's own semantics (reference.attention_mask, reference.alibi_bias,
dropout.keep_scale), never from a second statement of the rules.
"""
from __future__ import annotations

import math

import numpy as np

from ..dropout import keep_scale
from ..reference import alibi_bias, attention_mask
from .core import exercise

LESSON = "18_real_api"

ALIGN = ("The alignment decides where query i sits among the keys: at position i for 'top_left', at "
         "i + (Nk - Nq) for 'bottom_right' (the last query on the last key).")


# -- 1: the key blocks a query block visits ------------------------------------------------------
def _band_blocks(i_block, bq, bk, nq, nk, window, offset, last_row=None):
    """Key blocks touched by rows i_block*bq .. min((i_block+1)*bq, last_row)-1 at positions row + offset."""
    rows = np.arange(i_block * bq, min((i_block + 1) * bq, nq if last_row is None else last_row))[:, None]
    pos, j = rows + offset, np.arange(nk)[None, :]
    keep = np.ones((len(rows), nk), bool)
    if window[0] >= 0:
        keep &= j >= pos - window[0]
    if window[1] >= 0:
        keep &= j <= pos + window[1]
    return [b for b in range(math.ceil(nk / bk)) if keep[:, b * bk:(b + 1) * bk].any()]


def _visited(i_block, bq, bk, nq, nk, window, align):
    """The answer, from the reference's explicit mask: the key blocks with at least one visible pair."""
    mask = attention_mask(nq, nk, window_size=window, align=align)[i_block * bq:(i_block + 1) * bq]
    return [j for j in range(math.ceil(nk / bk)) if mask[:, j * bk:(j + 1) * bk].any()]


def _visited_slips(i_block, bq, bk, nq, nk, window, align):
    """(answer, why) of the usual mistakes: the right rule with one thing changed."""
    other = "top_left" if align == "bottom_right" else "bottom_right"
    off = nk - nq if align == "bottom_right" else 0
    return [(_visited(i_block, bq, bk, nq, nk, window, other), f"Those are the blocks of align={other!r}. " + ALIGN),
            (_band_blocks(i_block, bq, bk, nq, nk, window, nq - nk if align == "bottom_right" else 0),
             "bottom_right puts query i at position i + (Nk - Nq), not i + (Nq - Nk)."),
            (_band_blocks(i_block, bq, bk, nq, nk, window, off, last_row=(i_block + 1) * bq),
             "The last query block can be short: its rows stop at Nq - 1, not at (i_block + 1) * block_q - 1.")]


def _as_index_list(t, out, name):
    try:
        items = [int(x) for x in out]
    except Exception:
        raise t.fail(f"{name} should be a list of integers; got {type(out).__name__} {out!r:.80}") from None
    if any(int(x) != x for x in out):
        raise t.fail(f"{name} should hold integer block indices; got {out!r:.80}")
    return items


@exercise("visited_key_blocks", lesson=LESSON,
          hint="Take the query rows of the block, r0 = i_block * block_q to r1 = min(r0 + block_q, Nq) - 1, at "
               "positions p = r + offset (offset = Nk - Nq for bottom_right, 0 for top_left). Their keys run from "
               "p0 - left to p1 + right (unbounded where -1), clipped to 0 .. Nk - 1; visit the key blocks that "
               "range touches (none if it is empty).")
def check_visited_key_blocks(t, fn):
    specs = [("causal, square, top_left", 2, 4, 4, 16, 16, (-1, 0), "top_left"),
             ("no mask: every block", 1, 4, 4, 10, 13, (-1, -1), "top_left"),
             ("causal, Nq < Nk, bottom_right", 0, 4, 4, 6, 20, (-1, 0), "bottom_right"),
             ("causal, Nq < Nk, top_left", 0, 4, 4, 6, 20, (-1, 0), "top_left"),
             ("causal, Nq > Nk, bottom_right: rows that see nothing", 0, 4, 4, 20, 6, (-1, 0), "bottom_right"),
             ("sliding window (3, 0)", 3, 4, 4, 24, 24, (3, 0), "top_left"),
             ("window (2, 5), bottom_right", 1, 4, 8, 10, 30, (2, 5), "bottom_right"),
             ("a short last query block", 2, 8, 4, 19, 40, (0, 0), "top_left"),
             ("a short last query block, bottom_right", 2, 8, 4, 19, 40, (1, 1), "bottom_right"),
             ("window entirely past the keys", 2, 4, 4, 16, 4, (0, 2), "top_left")]
    for _ in range(40):
        nq, nk = (int(x) for x in t.rng.integers(1, 50, 2))
        bq, bk = (int(x) for x in t.rng.choice([1, 2, 3, 4, 8, 16], 2))
        window = tuple(int(x) for x in t.rng.choice([-1, -1, 0, 1, 2, 5, 11], 2))
        align = str(t.rng.choice(["top_left", "bottom_right"]))
        specs.append(("random", int(t.rng.integers(0, math.ceil(nq / bq))), bq, bk, nq, nk, window, align))
    for label, i, bq, bk, nq, nk, window, align in specs:
        t.case(label, i_block=i, block_q=bq, block_k=bk, Nq=nq, Nk=nk, window_size=window, align=align)
        out = t.call(i, bq, bk, nq, nk, window, align)
        got, want = _as_index_list(t, out, "the result"), _visited(i, bq, bk, nq, nk, window, align)
        if got == want:
            continue
        if sorted(set(got)) == want:
            raise t.fail(f"list each block once, in increasing order: got {got}, expected {want}")
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        msg = f"visited {got}; expected {want}"
        if missing:
            msg += f". Missing {missing}: at least one query of the block sees a key there"
        if extra:
            msg += f". Extra {extra}: every (query, key) pair there is masked, so the block is skipped"
        why = [w for value, w in _visited_slips(i, bq, bk, nq, nk, window, align) if value == got]
        raise t.fail(msg, **({"hint": why[0]} if why else {}))


# -- 2: the GQA head map and what packing saves ---------------------------------------------------
@exercise("kv_head", lesson=LESSON,
          hint="The H query heads form H_kv groups of G = H // H_kv consecutive heads; group g reads K/V head g. "
               "So query head h reads K/V head h // G.")
def check_kv_head(t, fn):
    specs = [("MHA", 8, 8), ("MQA", 8, 1), ("GQA, 4 groups of 2", 8, 4), ("GQA, 2 groups of 4", 8, 2),
             ("GQA, 3 groups of 4", 12, 3), ("GQA, 4 groups of 8 (Llama-2 70B's 64 / 8 has G = 8)", 32, 4)]
    for _ in range(4):
        h_kv = int(t.rng.integers(1, 9))
        specs.append(("random", h_kv * int(t.rng.integers(1, 9)), h_kv))
    for label, H, H_kv in specs:
        G = H // H_kv
        got = []
        for h in range(H):
            t.case(label, h=h, H=H, H_kv=H_kv)
            out = t.call(h, H, H_kv)
            if isinstance(out, (bool, np.bool_)) or not isinstance(out, (int, np.integer)):
                raise t.fail(f"return the K/V head as an int; got {type(out).__name__} {out!r:.60}")
            got.append(int(out))
        want = [h // G for h in range(H)]
        if got == want:
            continue
        h = next(i for i in range(H) if got[i] != want[i])
        t.case(label, h=h, H=H, H_kv=H_kv)
        hint = None
        if got == [x % H_kv for x in range(H)]:
            hint = ("h % H_kv deals the query heads out in turn (interleaved); the FA library and GQA checkpoints "
                    "group consecutive heads: heads 0 .. G-1 share K/V head 0.")
        elif got == [x // H_kv for x in range(H)]:
            hint = "Divide by the group size G = H // H_kv (query heads per K/V head), not by H_kv."
        raise t.fail(f"query head {h} should read K/V head {want[h]}; got {got[h]} (all heads: {got})",
                     **({"hint": hint} if hint else {}))


@exercise("kv_bytes_read", lesson=LESSON,
          hint="One decoding step reads the K and V caches: seqlen x d numbers each, per sequence and per K/V "
               "head. A kernel with one thread block per query head reads them once per query head (H times); "
               "packing the G query heads of a group into one block reads each K/V head once (H_kv times).")
def check_kv_bytes_read(t, fn):
    specs = [("MHA, packed or not, float32", 1, 8, 8, 1024, 64, 4, True), ("MHA, not packed", 1, 8, 8, 1024, 64, 4, False),
             ("GQA, packed", 3, 32, 8, 4096, 128, 2, True), ("GQA, one block per query head", 3, 32, 8, 4096, 128, 2, False),
             ("MQA, packed", 4, 16, 1, 8192, 128, 2, True), ("MQA, not packed, float32", 4, 16, 1, 777, 64, 4, False)]
    for _ in range(6):
        h_kv = int(t.rng.integers(1, 9))
        specs.append(("random", int(t.rng.integers(1, 9)), h_kv * int(t.rng.integers(1, 9)), h_kv,
                      int(t.rng.integers(1, 100000)), int(t.rng.choice([64, 96, 128, 256])), int(t.rng.choice([1, 2, 4])),
                      bool(t.rng.integers(0, 2))))
    for label, B, H, H_kv, n, d, size, packed in specs:
        t.case(label, B=B, H=H, H_kv=H_kv, seqlen=n, d=d, itemsize=size, packed=packed)
        out = t.call(B, H, H_kv, n, d, size, packed)
        heads = H_kv if packed else H
        want = 2 * B * heads * n * d * size
        other = 2 * B * (H if packed else H_kv) * n * d * size
        t.scalar(out, want, "the bytes read", tol=1e-12, slips=[
            (want / 2, "Count both caches: decoding reads V as well as K."),
            (other, "Packed: the G query heads of a group share one read of their K/V head (H_kv reads). "
                    "Not packed: every query head's block reads its K/V head again (H reads)."),
            (want / B, "Every sequence of the batch has its own cache: multiply by B."),
            (want / size, "Bytes, not numbers: multiply by itemsize.")])


# -- 3: one tile of the ALiBi bias ----------------------------------------------------------------
def _alibi_slips(slope, i0, j0, bq, bk, nq, nk, align):
    rows, cols = slice(i0, i0 + bq), slice(j0, j0 + bk)
    other = "top_left" if align == "bottom_right" else "bottom_right"
    pos = np.arange(nq)[rows, None] + (nk - nq if align == "bottom_right" else 0)
    j = np.arange(nk)[None, cols]
    local = -slope * np.abs(np.arange(len(pos))[:, None] - np.arange(j.shape[1])[None, :])
    return [(alibi_bias(slope, (), nq, nk, align=other)[rows, cols], f"That is the bias of align={other!r}. " + ALIGN),
            (-alibi_bias(slope, (), nq, nk, align=align)[rows, cols],
             "The bias is -slope * |i - j|: it lowers the scores of distant keys, so it is never positive."),
            (-slope * (pos - j), "Take the absolute distance |pos_i - j|: keys after the query are far too."),
            (-slope * (j - pos), "Take the absolute distance |pos_i - j|, for keys before and after the query."),
            (local, "Use the tile's global indices i0 + r and j0 + c, not the offsets r, c inside the tile.")]


@exercise("alibi_tile", lesson=LESSON,
          hint="For rows i = i0 .. min(i0 + block_q, Nq) - 1 and keys j = j0 .. min(j0 + block_k, Nk) - 1, the bias "
               "is -slope * |pos_i - j| with pos_i = i + (Nk - Nq) for bottom_right and pos_i = i for top_left.")
def check_alibi_tile(t, fn):
    specs = [("square, first tile", 0.5, 0, 0, 4, 4, 8, 8, "top_left"),
             ("an inner tile", 0.25, 4, 8, 4, 4, 16, 16, "top_left"),
             ("Nq < Nk, bottom_right", 0.125, 0, 8, 4, 8, 6, 24, "bottom_right"),
             ("Nq < Nk, top_left", 0.125, 0, 8, 4, 8, 6, 24, "top_left"),
             ("a ragged edge tile", 1.0, 8, 12, 8, 8, 13, 17, "bottom_right"),
             ("keys after the queries", 0.5, 0, 12, 4, 4, 16, 16, "top_left")]
    for _ in range(12):
        nq, nk = (int(x) for x in t.rng.integers(1, 40, 2))
        bq, bk = (int(x) for x in t.rng.choice([1, 2, 4, 8, 16], 2))
        i0 = bq * int(t.rng.integers(0, math.ceil(nq / bq)))
        j0 = bk * int(t.rng.integers(0, math.ceil(nk / bk)))
        specs.append(("random", float(2.0 ** -t.rng.integers(0, 9)), i0, j0, bq, bk, nq, nk,
                      str(t.rng.choice(["top_left", "bottom_right"]))))
    for label, slope, i0, j0, bq, bk, nq, nk, align in specs:
        t.case(label, slope=slope, i0=i0, j0=j0, block_q=bq, block_k=bk, Nq=nq, Nk=nk, align=align)
        out = t.call(slope, i0, j0, bq, bk, nq, nk, align)
        want = alibi_bias(slope, (), nq, nk, align=align)[i0:i0 + bq, j0:j0 + bk]

        def explain(o, args=(slope, i0, j0, bq, bk, nq, nk, align)):
            o = np.asarray(o, np.float64)
            for value, why in _alibi_slips(*args):
                if value.shape == o.shape and np.allclose(o, value, rtol=1e-9, atol=1e-12):
                    return [], why
            return [], None

        if np.ndim(out) == 2 and np.shape(out) == (bq, bk) != want.shape:
            raise t.fail(f"the tile has shape {np.shape(out)}; expected {want.shape}: a tile at the edge keeps "
                         f"only the rows < Nq and keys < Nk")
        t.compare(out, want, "the bias tile", tol=1e-12, explain=explain)


# -- 4: the dropout mask, regenerated ---------------------------------------------------------------
@exercise("dropout_keep", lesson=LESSON,
          hint="Call flashlab.dropout.dropout_bits_array(seed, b, h, rows[:, None], cols[None, :]) with the absolute "
               "row and column indices, and keep where the hash is >= flashlab.dropout.keep_threshold(p).")
def check_dropout_keep(t, fn):
    specs = [("a first tile", 0, 0, 0, np.arange(4), np.arange(4), 0.5),
             ("an inner tile", 7, 1, 3, np.arange(8, 16), np.arange(32, 40), 0.25),
             ("a non-square tile", 123, 0, 2, np.arange(2, 5), np.arange(10, 30), 0.1),
             ("a large seed (its high 32 bits count too)", 2 ** 40 + 5, 2, 1, np.arange(16, 24), np.arange(0, 8), 0.3),
             ("p close to 1", 11, 1, 0, np.arange(6), np.arange(64), 0.9)]
    for _ in range(6):
        r0, c0 = (int(x) for x in t.rng.integers(0, 500, 2))
        specs.append(("random", int(t.rng.integers(0, 2 ** 62)), int(t.rng.integers(0, 4)), int(t.rng.integers(0, 8)),
                      np.arange(r0, r0 + int(t.rng.integers(1, 17))), np.arange(c0, c0 + int(t.rng.integers(1, 17))),
                      float(t.rng.choice([0.05, 0.1, 0.2, 0.5, 0.7]))))
    for label, seed, b, h, rows, cols, p in specs:
        t.case(label, seed=seed, b=b, h=h, rows=f"{rows[0]}..{rows[-1]}", cols=f"{cols[0]}..{cols[-1]}", p=p)
        out = t.call(seed, b, h, rows, cols, p)
        want = keep_scale(seed, p, b, h, rows[:, None], cols[None, :]) > 0
        if not isinstance(out, np.ndarray):
            raise t.fail(f"return a NumPy array of booleans; got {type(out).__name__}")
        if out.shape != want.shape:
            raise t.fail(f"the mask has shape {out.shape}; expected {want.shape} (len(rows), len(cols))")
        if out.dtype != bool:
            raise t.fail(f"the mask has dtype {out.dtype}; return booleans (True = kept)")
        if np.array_equal(out, want):
            continue
        key = lambda b_, h_, r, c: keep_scale(seed, p, b_, h_, r, c) > 0  # noqa: E731
        R, C = rows[:, None], cols[None, :]
        slips = [(key(b, h, C, R),
                  "Rows and columns are swapped: the key is (seed, batch, head, row, col), row = the query index."),
                 (key(h, b, R, C), "Batch and head are swapped: the key is (seed, batch, head, row, col)."),
                 (key(b, h, R - rows[0], C - cols[0]),
                  "Use the absolute row and column indices, not the offsets inside the tile: the forward and the "
                  "backward tile differently, and the mask must not depend on it."),
                 (~key(b, h, R, C), "Keep where the hash is >= keep_threshold(p): that happens with probability 1 - p."),
                 (keep_scale(seed, 1 - p, b, h, R, C) > 0,
                  "The threshold is keep_threshold(p), the probability of dropping; kept entries are those above it.")]
        why = [w for value, w in slips if value.shape == out.shape and np.array_equal(out, value)]
        raise t.fail(f"{int((out != want).sum())} of {out.size} entries differ from the mask the forward used; it "
                     f"keeps {out.mean():.2f} of them, expected {want.mean():.2f}", **({"hint": why[0]} if why else {}))


# -- 5: where a key lives in a paged cache ----------------------------------------------------------
def _slot(bt, sl, b, pos, ps):
    if not 0 <= pos < sl[b]:
        return None
    return int(bt[b, pos // ps]), pos % ps


@exercise("physical_slot", lesson=LESSON,
          hint="Key pos of sequence b is on logical page pos // page_size, at offset pos % page_size; the physical "
               "page is block_table[b, pos // page_size]. Return None unless 0 <= pos < cache_seqlens[b].")
def check_physical_slot(t, fn):
    specs = []
    for label, B, ps, max_pages, lengths in [("the lesson's cache", 3, 4, 4, [10, 3, 16]),
                                             ("page size 1", 2, 1, 6, [6, 2]),
                                             ("an empty sequence", 3, 8, 3, [0, 17, 24]),
                                             ("random", int(t.rng.integers(1, 5)), int(t.rng.choice([2, 3, 16])), 5, None)]:
        if lengths is None:
            lengths = [int(x) for x in t.rng.integers(0, ps * max_pages + 1, B)]
        pages = t.rng.permutation(B * max_pages + 3)[:B * max_pages].reshape(B, max_pages)
        sl = np.array(lengths, np.int32)
        bt = pages.astype(np.int32)
        for b in range(B):
            n = int(sl[b])
            positions = sorted({0, n - 1, n, -1, ps, ps - 1, max(0, n - ps), *(int(x) for x in t.rng.integers(0, max(n, 1), 3))})
            specs += [(label, bt, sl, b, pos, ps) for pos in positions]
    for label, bt, sl, b, pos, ps in specs:
        t.case(label, block_table=bt.tolist(), cache_seqlens=sl.tolist(), b=b, pos=pos, page_size=ps)
        out = t.call(bt, sl, b, pos, ps)
        want = _slot(bt, sl, b, pos, ps)
        if want is None:
            if out is not None:
                why = ("pos = -1 is not a key: Python's negative indexing would read the last page's slot."
                       if pos < 0 else f"Sequence {b} has {sl[b]} keys, at positions 0 .. {sl[b] - 1}: position "
                       f"{pos} is past its end (the rest of its last page is unused, or belongs to nobody).")
                raise t.fail(f"returned {out!r:.60} for a position outside the sequence; expected None", hint=why)
            continue
        if out is None:
            raise t.fail(f"returned None, but key {pos} of sequence {b} exists (the sequence has {sl[b]} keys); "
                         f"expected {want}")
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise t.fail(f"return a pair (physical page, offset); got {out!r:.60}")
        try:
            got = (int(out[0]), int(out[1]))
        except Exception:
            raise t.fail(f"return two integers (physical page, offset); got {out!r:.60}") from None
        if got == want:
            continue
        hint = None
        if got == (pos // ps, pos % ps):
            hint = "pos // page_size is the LOGICAL page; look it up in block_table[b] to find the physical one."
        elif got[1] == want[1] and -(-pos // ps) < bt.shape[1] and got[0] == int(bt[b, -(-pos // ps)]):
            hint = "The logical page is pos // page_size (rounded down): key 0 .. page_size - 1 are on page 0."
        raise t.fail(f"key {pos} of sequence {b} is at {want} (physical page, offset); got {got}",
                     **({"hint": hint} if hint else {}))
