"""Lesson 18, the FlashAttention library's options: which key blocks a query block visits under a window and
an alignment, one tile of the ALiBi bias, ALiBi's two causal forms (the same O, another lse), softcap's factor in
the backward, a packed batch looped over cu_seqlens, FA2's varlen grid, and a K tile gathered through a paged
cache's block table.

Every answer comes from flashlab's own semantics (reference_attention, reference.attention_mask,
reference.alibi_bias) where they have it, and otherwise from the rule applied item by item (every block of the
grid, every row of the tile), never from the closed form the solution uses.
"""
from __future__ import annotations

import math

import numpy as np

from ..reference import alibi_bias, attention_mask, reference_attention
from .attention import _as_pair, matching_slip
from .core import exercise, tolerance

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


# -- 2: one tile of the ALiBi bias ----------------------------------------------------------------
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


# -- 3: ALiBi's two causal forms ------------------------------------------------------------------
EMPTY_ROWS = ("With Nq > Nk and the bottom-right alignment, the first Nq - Nk rows see no key: their O is 0 and their "
              "lse +inf, in both forms.")


def _attend(Q, K, V, bias, visible):
    """(O, lse) in float64 of softmax(Q K^T / sqrt(d) + bias) V over the visible keys (O = 0, lse = +inf on a row
    that sees none): what the usual slips compute. The right answer comes from reference_attention."""
    S = np.where(visible, Q @ K.T / math.sqrt(Q.shape[1]) + bias, -np.inf)
    m = S.max(axis=1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    seen = l > 0
    return (P @ V) / np.where(seen, l, 1.0), np.where(seen, m + np.log(np.where(seen, l, 1.0)), np.inf)[:, 0]


def _alibi_forms(Q, K, V, slope):
    """The answer (O_abs, lse_abs, O_lin, lse_lin): flashlab's causal ALiBi from reference_attention; the +slope * j
    form has the same O and an lse larger by slope * pos_i (+inf stays +inf on a row that sees no key)."""
    o, lse = reference_attention(Q, K, V, causal=True, align="bottom_right", alibi_slopes=np.float64(slope))
    pos = np.arange(len(Q)) + len(K) - len(Q)
    return o, lse, o, lse + slope * pos


def _alibi_form_slips(Q, K, V, slope):
    """[(why, answer)] of the usual mistakes, each a whole (O_abs, lse_abs, O_lin, lse_lin) or a function of none."""
    nq, nk = len(Q), len(K)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    pos = i + nk - nq
    o, lse, _, lse_lin = _alibi_forms(Q, K, V, slope)
    shift = slope * pos[:, 0]
    scale = 1 / math.sqrt(Q.shape[1])
    both = lambda p, s=1.0: (*_attend(Q, K, V, -s * slope * np.abs(p - j), j <= p),  # noqa: E731
                             *_attend(Q, K, V, s * slope * j + 0 * p, j <= p))
    return [("The library aligns causal bottom-right: query i sits at pos_i = i + Nk - Nq and sees the keys "
             "j <= pos_i (the last query sees every key).", lambda: both(i)),
            ("The library's causal bias is +slope * j: a key nearer the query (a larger j) scores higher, as it does "
             "with -slope * |pos_i - j|.", lambda: (o, lse, *_attend(Q, K, V, -slope * j + 0 * pos, j <= pos))),
            ("The softmax cancels a constant added to a whole row, the lse keeps it: +slope * j = "
             "-slope * |pos_i - j| + slope * pos_i on every visible key, so lse_lin = lse_abs + slope * pos_i.",
             (o, lse, o, lse)),
            ("+slope * j is -slope * |pos_i - j| plus slope * pos_i: the lin form's scores are higher, and so is its "
             "lse (lse_lin = lse_abs + slope * pos_i, not minus).", (o, lse, o, lse - shift)),
            ("Add the bias, unscaled, to the scaled scores Q K^T / sqrt(d). (FA2 adds it before the scaling, so it "
             "divides the slope by the softmax scale first: the same sum.)", lambda: both(pos, scale)),
            ("The distance is from the query's position pos_i = i + Nk - Nq, not from its row index i.",
             lambda: (*_attend(Q, K, V, -slope * np.abs(i - j), j <= pos), o, lse_lin))]


@exercise("alibi_causal_forms", lesson=LESSON,
          hint="pos_i = i + Nk - Nq and key j is visible when j <= pos_i. For each bias: S = Q K^T / sqrt(d) + bias, "
               "-inf where hidden; m = row max (0 where the row is all -inf), l = row sum of exp(S - m), O = "
               "exp(S - m) V / l and lse = m + log(l), with O = 0 and lse = +inf where l = 0.")
def check_alibi_causal_forms(t, fn):
    specs = [("Nq < Nk", 5, 12, 16, 16, 0.25, None), ("Nq = Nk", 8, 8, 8, 8, 0.5, None),
             ("one query (a decoding step)", 1, 17, 8, 4, 0.125, None),
             ("Nq > Nk: the first rows see no key", 9, 4, 8, 8, 0.5, EMPTY_ROWS),
             ("a steep slope", 6, 10, 4, 4, 4.0, None)]
    for _ in range(4):
        nq, nk = (int(x) for x in t.rng.integers(1, 25, 2))
        specs.append(("random", nq, nk, int(t.rng.choice([4, 8, 16])), int(t.rng.choice([3, 8])),
                      float(2.0 ** -t.rng.integers(-2, 8)), EMPTY_ROWS if nq > nk else None))
    names = ("O_abs", "lse_abs", "O_lin", "lse_lin")
    for label, nq, nk, d, dv, slope, hint in specs:
        Q, K, V = t.normal((nq, d)), t.normal((nk, d)), t.normal((nk, dv))
        t.case(label, hint, Q=(nq, d), K=(nk, d), V=(nk, dv), slope=slope)
        out = t.call(Q, K, V, slope)
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and all(isinstance(x, (tuple, list)) and len(x) == 2 for x in out)):
            raise t.fail(f"return two pairs, ((O_abs, lse_abs), (O_lin, lse_lin)); got {type(out).__name__} "
                         f"{out!r:.60}")
        want = _alibi_forms(Q, K, V, slope)
        got = [t.array(x, w.shape, None, n, min_dtype=np.float64) for x, w, n in zip((*out[0], *out[1]), want, names)]

        def explain(_, got=got, want=want, args=(Q, K, V, slope)):
            details = []
            o_lin_right = np.allclose(got[2], want[2], rtol=1e-8, atol=1e-12)
            if o_lin_right and not np.allclose(got[3], want[3], rtol=1e-8, atol=1e-12, equal_nan=False):
                details.append("O_lin is right, lse_lin is not")
            return details, matching_slip(got, want, _alibi_form_slips(*args), tolerance(np.float64))

        for g, w, name in zip(got, want, names):
            t.compare(g, w, name, explain=explain)


# -- 4: softcap's factor in the backward ----------------------------------------------------------
MASKED_NAN = ("At a masked entry S' = -inf, so (S' / softcap)^2 = inf and dS' * (1 - inf) = 0 * (-inf) = NaN. Those "
              "entries get no gradient: compute the factor only where S' is finite (np.isfinite, np.where), 0 "
              "elsewhere.")


def _softcap_slips(S_capped, G, cap):
    """[(why, (answer,))] of the usual mistakes."""
    visible = np.isfinite(S_capped)
    Sc = np.where(visible, S_capped, 0.0).astype(np.float64)
    T = Sc / cap
    times = lambda factor: (np.where(visible, G * factor, 0.0),)  # noqa: E731
    cancel = ("The derivative of softcap * tanh(S / softcap) is softcap * (1 / softcap) * (1 - tanh^2): the softcap "
              "cancels, the factor is 1 - tanh(S / softcap)^2 alone.")
    square = "The derivative of tanh is 1 - tanh^2: square tanh(S / softcap) = S' / softcap."
    return [("dS' still has to go through the cap: multiply it by the cap's derivative 1 - tanh(S / softcap)^2.",
             times(1.0)),
            ("S' is already capped: tanh(S / softcap) is S' / softcap itself, so the factor is 1 - (S' / softcap)^2; "
             "tanh(S' / softcap) applies the cap a second time.", times(1 - np.tanh(Sc / cap) ** 2)),
            (cancel, times(cap * (1 - T * T))), (cancel, times((1 - T * T) / cap)),
            (square, times(1 - np.abs(T))), (square, times(1 - T))]


@exercise("softcap_dS", lesson=LESSON,
          hint="tanh(S / softcap) = S' / softcap, so dS = dS' * (1 - (S' / softcap)^2) wherever S' is finite; the "
               "masked entries (S' = -inf) get 0. Return it in S_capped's dtype.")
def check_softcap_dS(t, fn):
    f64, f32 = np.float64, np.float32
    # label, rows, cols, softcap, score scale (in caps), mask offset (key j visible when j <= i + offset; None: all)
    specs = [("a tile inside the band: nothing masked", 4, 6, 5.0, 1.0, None, f64),
             ("a tile on the causal diagonal", 6, 6, 3.0, 1.0, 0, f64),
             ("scores far beyond the cap", 5, 8, 2.0, 5.0, 2, f64),
             ("Gemma 2's cap of 50, scores well inside it", 4, 4, 50.0, 0.2, None, f64),
             ("a row the mask hides entirely", 4, 5, 4.0, 1.0, -1, f64),
             ("float32", 8, 8, 5.0, 1.5, 0, f32)]
    for _ in range(3):
        r, c = (int(x) for x in t.rng.integers(1, 17, 2))
        specs.append(("random", r, c, float(t.rng.choice([1.5, 5.0, 30.0])), float(t.rng.uniform(0.3, 3)),
                      t.rng.choice([None, 0, 3, -2]), t.rng.choice([f64, f32])))
    for label, r, c, cap, size, offset, dtype in specs:
        S = t.normal((r, c), scale=size * cap)
        visible = np.ones((r, c), bool) if offset is None else np.arange(c)[None, :] <= np.arange(r)[:, None] + offset
        S_capped = np.where(visible, cap * np.tanh(S / cap), -np.inf).astype(dtype)
        G = np.where(visible, t.normal((r, c)), 0.0).astype(dtype)
        t.case(label, MASKED_NAN if not visible.all() else None, tile=(r, c), softcap=cap, dtype=np.dtype(dtype).name,
               masked=int((~visible).sum()))
        out = t.call(S_capped, G, cap)
        want = np.where(visible, G.astype(np.float64) * (1 - np.tanh(S / cap) ** 2), 0.0)

        def explain(o, visible=visible, args=(S_capped, G.astype(np.float64), cap), want=want):
            o = np.asarray(o, np.float64)
            nan = np.isnan(o)
            if nan.any() and not (nan & visible).any():
                return ["NaN at the masked entries, and only there"], MASKED_NAN
            return [], matching_slip((o,), (want,), _softcap_slips(*args), tolerance(args[0].dtype))

        # Where the scores pass the cap, 1 - (S' / softcap)^2 cancels: float32's rounding of S' alone moves the
        # factor by ~1e-7, which is large next to a factor near 0. So the error is judged against the size of dS'
        # (the floor), not of the small answer: the slips above still miss by a good part of dS'.
        t.compare(out, want, "dS", dtype=dtype, explain=explain, floor=float(np.linalg.norm(G[visible])))


# -- 5: a packed batch, one sequence at a time ----------------------------------------------------
NO_QUERIES = ("A sequence without queries (cu_seqlens_q[b] == cu_seqlens_q[b+1]) has no rows to write: skip it "
              "(flash_attention_v2 refuses Nq = 0).")
NO_KEYS = ("A sequence without keys: its rows see no key, so o = 0 and lse = +inf there, as for any row that sees "
           "nothing (flash_attention_v2 refuses Nk = 0: fill those rows yourself).")


def _sequence(x, rows):
    """Rows of a packed (total, heads, d) array as one sequence's (1, heads, n, d)."""
    return x[rows].transpose(1, 0, 2)[None]


def _varlen_answer(q, k, v, cu_q, cu_k, causal, align="bottom_right"):
    """(o, lse) in float64: reference_attention on each sequence alone; o = 0 and lse = +inf on the rows of a
    sequence without keys."""
    o = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.full((q.shape[1], q.shape[0]), np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        k_b, v_b = _sequence(k, keys), _sequence(v, keys)
        if rows.stop <= rows.start or k_b.shape[-2] == 0:
            continue
        o_b, lse_b = reference_attention(_sequence(q, rows), k_b, v_b, causal=causal, align=align)
        o[rows], lse[:, rows] = o_b[0].transpose(1, 0, 2), lse_b[0]
    return o, lse


def _varlen_slips(q, k, v, cu_q, cu_k, causal):
    def whole_batch():
        if not len(q) or not len(k):
            return _varlen_answer(q, k, v, cu_q, cu_k, causal)
        o, lse = reference_attention(_sequence(q, slice(None)), _sequence(k, slice(None)), _sequence(v, slice(None)),
                                     causal=causal, align="bottom_right")
        return o[0].transpose(1, 0, 2), lse[0]

    return [("The library's causal mask is aligned bottom-right within each sequence: pass align='bottom_right' "
             "(the last query of a sequence sees all its keys, as in decoding).",
             lambda: _varlen_answer(q, k, v, cu_q, cu_k, causal, align="top_left")),
            ("Each sequence attends to its own keys only: one attention over the whole packed batch lets its queries "
             "see the other sequences' keys.", whole_batch),
            ("The keys and values of sequence b are rows cu_seqlens_k[b] .. cu_seqlens_k[b+1] - 1 of k and v: slice "
             "them with cu_seqlens_k, not cu_seqlens_q.", lambda: _varlen_answer(q, k, v, cu_q, cu_q, causal))]


def _first_wrong_sequence(o, lse, want_o, want_lse, cu_q, cu_k):
    for b in range(len(cu_q) - 1):
        r = slice(cu_q[b], cu_q[b + 1])
        if r.stop <= r.start:
            continue
        ok = np.allclose(o[r], want_o[r], rtol=1e-4, atol=1e-6) and np.array_equal(np.isinf(lse[:, r]),
                                                                                   np.isinf(want_lse[:, r]))
        ok = ok and np.allclose(np.where(np.isinf(want_lse[:, r]), 0, lse[:, r]),
                                np.where(np.isinf(want_lse[:, r]), 0, want_lse[:, r]), rtol=1e-4, atol=1e-6)
        if not ok:
            return [f"first sequence with wrong rows: b = {b} (rows {r.start}..{r.stop - 1}, "
                    f"{cu_q[b + 1] - cu_q[b]} queries, {cu_k[b + 1] - cu_k[b]} keys)"]
    return []


@exercise("varlen_attention", lesson=LESSON, time_limit=30,
          hint="For each sequence b: rows r = slice(cu_seqlens_q[b], cu_seqlens_q[b+1]) and keys "
               "slice(cu_seqlens_k[b], cu_seqlens_k[b+1]). Skip it when either is empty (start o at 0 and lse at "
               "+inf); else call flash_attention_v2 on x[r].transpose(1, 0, 2)[None] with align='bottom_right' and "
               "write o_b[0].transpose(1, 0, 2) into o[r] and lse_b[0] into lse[:, r].")
def check_varlen_attention(t, fn):
    f64, f32 = np.float64, np.float32
    # label, query lengths, key lengths, H, H_kv, d, dv, causal, block_q, block_k, dtype
    specs = [("the lesson's batch (GQA)", [5, 7, 8], [6, 7, 11], 4, 2, 8, 8, True, 4, 4, f64),
             ("not causal, Nq != Nk", [3, 9], [10, 2], 2, 2, 8, 6, False, 4, 3, f64),
             ("a sequence without queries", [4, 0, 6], [5, 3, 9], 2, 1, 8, 8, True, 4, 4, f64),
             ("a sequence without keys", [3, 5, 2], [6, 0, 4], 2, 2, 4, 4, True, 2, 4, f64),
             ("causal, more queries than keys: rows that see no key", [9, 4], [3, 4], 1, 1, 8, 8, True, 4, 4, f64),
             ("float32, GQA", [7, 13], [7, 20], 8, 2, 16, 16, True, 8, 8, f32),
             ("one sequence", [11], [11], 2, 2, 8, 8, True, 4, 4, f64)]
    for _ in range(3):
        n = int(t.rng.integers(1, 6))
        H, H_kv = (int(x) for x in [(1, 1), (2, 1), (4, 2), (3, 3)][int(t.rng.integers(0, 4))])
        specs.append(("random", [int(x) for x in t.rng.integers(0, 17, n)], [int(x) for x in t.rng.integers(0, 17, n)],
                      H, H_kv, int(t.rng.choice([4, 8])), int(t.rng.choice([4, 8])), bool(t.rng.integers(0, 2)),
                      int(t.rng.integers(1, 9)), int(t.rng.integers(1, 9)), t.rng.choice([f64, f32])))
    for label, nq, nk, H, H_kv, d, dv, causal, bq, bk, dtype in specs:
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int64) for n in (nq, nk))
        q = t.normal((int(cu_q[-1]), H, d), dtype)
        k, v = t.normal((int(cu_k[-1]), H_kv, d), dtype), t.normal((int(cu_k[-1]), H_kv, dv), dtype)
        no_keys = any(a > 0 and b == 0 for a, b in zip(nq, nk))
        hints = [h for h, edge in ((NO_QUERIES, 0 in nq), (NO_KEYS, no_keys)) if edge]
        t.case(label, " ".join(hints) or None, lengths_q=nq, lengths_k=nk, heads=(H, H_kv), d=d, dv=dv, causal=causal,
               block_q=bq, block_k=bk, dtype=np.dtype(dtype).name)
        out = t.call(q, k, v, cu_q, cu_k, causal, bq, bk)
        o, lse = _as_pair(t, out, ("o", "lse"))
        want_o, want_lse = _varlen_answer(q, k, v, cu_q, cu_k, causal)
        if np.shape(lse) == (q.shape[0], H) != want_lse.shape:
            raise t.fail(f"lse has shape {np.shape(lse)} = (total_q, H); the library's varlen lse is (H, total_q) = "
                         f"{want_lse.shape}, heads first")
        o = t.array(o, want_o.shape, None, "o", min_dtype=dtype)
        lse = t.array(lse, want_lse.shape, None, "lse", min_dtype=dtype)

        def explain(_, got=(o, lse), want=(want_o, want_lse), args=(q, k, v, cu_q, cu_k, causal)):
            details = _first_wrong_sequence(*got, *want, args[3], args[4])
            return details, matching_slip(got, want, _varlen_slips(*args), tolerance(dtype))

        t.compare(o, want_o, "o", min_dtype=dtype, explain=explain)
        t.compare(lse, want_lse, "lse", min_dtype=dtype, explain=explain)


# -- 6: FA2's varlen grid -------------------------------------------------------------------------
def _grid(cu, max_seqlen_q, bq, heads):
    """(working, idle), block by block of FA2's grid (m, b, h): block m of sequence b works when its first row
    m * block_q lies before the sequence's end."""
    lengths = np.diff(np.asarray(cu))
    blocks = -(-max_seqlen_q // bq)
    working = sum(1 for m in range(blocks) for n in lengths if m * bq < n) * heads
    return working, blocks * len(lengths) * heads - working


def _grid_slips(cu, max_seqlen_q, bq, heads):
    lengths = [int(n) for n in np.diff(np.asarray(cu))]
    working, idle = _grid(cu, max_seqlen_q, bq, heads)
    launched = working + idle
    ceil = lambda n: -(-n // bq)  # noqa: E731
    other = lambda w: (w, launched - w)  # noqa: E731
    return [((working, ceil(max(lengths, default=0)) * len(lengths) * heads - working),
             "FA2 sizes its grid with max_seqlen_q as the caller passes it, which can exceed the longest sequence: "
             "the blocks past every sequence's end exit too."),
            (other(sum(n // bq for n in lengths) * heads),
             "A sequence of n rows has ceil(n / block_q) working blocks: the last may hold fewer than block_q rows."),
            ((working // heads, idle // heads), "The grid's third axis is the head: every head has its own blocks, so "
                                                "multiply by heads."),
            (other(sum(max(1, ceil(n)) for n in lengths) * heads),
             "A sequence with no rows has no working block: its block 0 starts at row 0, already its end, and exits."),
            (other(ceil(sum(lengths)) * heads), "A block never holds rows of two sequences: count ceil(n_b / block_q) "
                                                "per sequence, not over the packed rows."),
            ((idle, working), "Return (working, idle), in that order."),
            ((working, launched), "idle counts the blocks that exit at once: those launched minus those that work.")]


@exercise("fa2_varlen_grid", lesson=LESSON,
          hint="The grid has ceil(max_seqlen_q / block_q) * batch * heads blocks. Sequence b of n_b rows has "
               "ceil(n_b / block_q) working blocks per head (0 when n_b = 0); the rest of its ceil(max_seqlen_q / "
               "block_q) exit at once.")
def check_fa2_varlen_grid(t, fn):
    specs = [("the lesson's batch", [5, 7, 8], 8, 4, 4),
             ("max_seqlen_q above the longest sequence", [3, 10], 16, 4, 2),
             ("an empty sequence", [7, 0, 13], 13, 4, 3),
             ("lengths that are multiples of block_q", [8, 8, 24], 24, 8, 1),
             ("one sequence", [129], 129, 64, 8),
             ("one long sequence among short ones", [4096] + [32] * 63, 4096, 128, 16)]
    for _ in range(6):
        lengths = [int(x) for x in t.rng.integers(0, 300, int(t.rng.integers(1, 11)))]
        extra = int(t.rng.choice([0, 0, int(t.rng.integers(1, 65))]))
        specs.append(("random", lengths, max(lengths) + extra or 1, int(t.rng.choice([16, 32, 64, 128])),
                      int(t.rng.integers(1, 17))))
    for label, lengths, max_q, bq, heads in specs:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        t.case(label, cu_seqlens_q=cu.tolist() if len(cu) <= 12 else f"{len(lengths)} sequences of {min(lengths)} to "
               f"{max(lengths)} rows", max_seqlen_q=max_q, block_q=bq, heads=heads)
        out = t.call(cu, max_q, bq, heads)
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in out)):
            raise t.fail(f"return two integers (working, idle); got {type(out).__name__} {out!r:.60}")
        got, want = (int(out[0]), int(out[1])), _grid(cu, max_q, bq, heads)
        if got == want:
            continue
        why = [w for value, w in _grid_slips(cu, max_q, bq, heads) if value == got]
        raise t.fail(f"got (working, idle) = {got}; expected {want} (a grid of {sum(want)} blocks)",
                     **({"hint": why[0]} if why else {}))


# -- 7: a K tile through the block table ----------------------------------------------------------
PAST_THE_TABLE = ("This tile runs past the end of block_table[b] (max_pages * page_size keys): rows at and past "
                  "cache_seqlens[b] must not be looked up at all; they are zeros.")


def _paged_cache(t, B, max_pages, page_size, d, lengths):
    """(k_cache, block_table, cache_seqlens): distinct pages for the keys in use, never two consecutive ones in a row
    (so a tile read across a page boundary as if the pages were adjacent in memory is wrong) and never page n as a
    sequence's n-th (so reading logical pages is wrong too, and the two slips differ); the unused entries of each row
    point at pages of other sequences (stale keys, as in a reused table row). The pool ends with pages no table uses,
    so that a read past a page stays inside it and its slip can be recognised."""
    num_pages = B * max_pages + 2
    while True:
        table = t.rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
        if not (np.any(np.diff(table, axis=1) == 1) or np.any(table == np.arange(max_pages))):
            break
    for b, n in enumerate(lengths):
        used = -(-n // page_size)
        table[b, used:] = t.rng.integers(0, num_pages, max_pages - used)
    spare = -(-16 // page_size) + 1  # room for a tile of up to 16 keys read past the last page
    return t.normal((num_pages + spare, page_size, d)), table.astype(np.int32), np.array(lengths, np.int32)


def _tile(k_cache, table, seqlens, b, k0, bk, *, last=None, lookup=None):
    """Rows k0 .. k0 + bk - 1 of sequence b (zero from position `last`, cache_seqlens[b] unless a slip says otherwise),
    each read from lookup(pos) (through the block table unless a slip says otherwise)."""
    page = k_cache.shape[1]
    last = seqlens[b] if last is None else last
    lookup = lookup or (lambda pos: k_cache[table[b, pos // page], pos % page])
    out = np.zeros((bk, k_cache.shape[2]))
    for r, pos in enumerate(range(k0, k0 + bk)):
        if pos < last:
            out[r] = lookup(pos)
    return out


def _tile_slips(k_cache, table, seqlens, b, k0, bk):
    """[(why, (answer,))] of the usual mistakes, leaving out those that would have raised here."""
    page, flat = k_cache.shape[1], k_cache.reshape(-1, k_cache.shape[2])
    capacity = table.shape[1] * page
    start = int(table[b, min(k0 // page, table.shape[1] - 1)]) * page + k0 % page
    slips = [("pos // page_size is the sequence's logical page: its keys are on the physical page "
              "block_table[b, pos // page_size].", dict(lookup=lambda pos: k_cache[pos // page, pos % page])),
             ("The tile spans more than one page: the rows after the end of a page are on the next page of "
              "block_table[b], not on the next page in memory. Find each row through the table (FA2 reads a tile "
              "from one address only because its pages hold a multiple of 256 keys).",
              dict(lookup=lambda pos: flat[start + pos - k0])),
             ("Rows at and past cache_seqlens[b] are not keys of sequence b: their slots hold stale keys, of another "
              "sequence or an earlier one. Make them zero.", dict(last=min(k0 + bk, capacity))),
             ("Sequence b's keys are positions 0 .. cache_seqlens[b] - 1: row cache_seqlens[b] is already past its "
              "end.", dict(last=min(int(seqlens[b]) + 1, capacity)))]
    out = []
    for why, kw in slips:
        try:
            out.append((why, (_tile(k_cache, table, seqlens, b, k0, bk, **kw),)))
        except IndexError:
            continue
    return out


@exercise("paged_k_tile", lesson=LESSON,
          hint="Row r of the tile is key pos = k0 + r. If pos < cache_seqlens[b], copy k_cache[block_table[b, pos // "
               "page_size], pos % page_size]; else leave the row zero. In NumPy: pos = np.arange(k0, min(k0 + block_k, "
               "cache_seqlens[b])), then one fancy-indexed read into the first len(pos) rows of a zero tile.")
def check_paged_k_tile(t, fn):
    # label, B, max_pages, page_size, d, lengths, b, k0, block_k
    specs = [("a tile inside one page", 2, 3, 8, 4, [20, 13], 0, 8, 8),
             ("a tile across two pages", 2, 3, 6, 4, [14, 9], 0, 4, 4),
             ("a tile longer than a page: two pages and more", 2, 4, 4, 4, [16, 11], 0, 8, 8),
             ("a tile past the sequence's end", 2, 3, 4, 4, [10, 12], 0, 8, 4),
             ("a tile past the end of the table", 2, 3, 4, 4, [11, 12], 0, 8, 8),
             ("an empty sequence", 2, 2, 4, 4, [0, 5], 0, 0, 4),
             ("a tile wholly past the sequence's end", 2, 4, 4, 4, [5, 16], 0, 8, 4),
             ("pages of one key", 2, 12, 1, 4, [9, 12], 1, 4, 4),
             ("pages of 3 keys, tiles of 4", 3, 5, 3, 4, [12, 15, 7], 1, 4, 4)]
    for _ in range(5):
        B, max_pages, page = int(t.rng.integers(1, 4)), int(t.rng.integers(1, 6)), int(t.rng.choice([2, 3, 4, 8, 16]))
        lengths = [int(x) for x in t.rng.integers(0, max_pages * page + 1, B)]
        b, bk = int(t.rng.integers(0, B)), int(t.rng.choice([2, 4, 8, 16]))
        k0 = bk * int(t.rng.integers(0, -(-max(lengths[b], 1) // bk)))
        specs.append(("random", B, max_pages, page, int(t.rng.choice([2, 8])), lengths, b, k0, bk))
    for label, B, max_pages, page, d, lengths, b, k0, bk in specs:
        k_cache, table, seqlens = _paged_cache(t, B, max_pages, page, d, lengths)
        past_table = k0 + bk > max_pages * page
        t.case(label, PAST_THE_TABLE if past_table else None, k_cache=k_cache.shape, block_table=table.tolist(),
               cache_seqlens=seqlens.tolist(), b=b, k0=k0, block_k=bk)
        out = t.call(k_cache, table, seqlens, b, k0, bk)
        want = _tile(k_cache, table, seqlens, b, k0, bk)
        n_keys = int(np.clip(seqlens[b] - k0, 0, bk))
        if np.ndim(out) == 2 and np.shape(out) == (n_keys, d) and n_keys < bk:
            raise t.fail(f"the tile has {n_keys} rows; expected block_k = {bk}: a kernel's tile has a fixed size, and "
                         f"its rows past the sequence's end are zeros")

        def explain(o, args=(k_cache, table, seqlens, b, k0, bk), want=want):
            o = np.asarray(o, np.float64)
            bad = np.flatnonzero(~np.isclose(o, want, rtol=1e-12, atol=1e-12).all(axis=1))
            details = []
            if bad.size:
                r = int(bad[0])
                where = "past the sequence's end" if k0 + r >= args[2][b] else \
                    f"on page {int(args[1][b, (k0 + r) // page])}, slot {(k0 + r) % page}"
                details.append(f"first wrong row: {r}, key {k0 + r}, {where}")
            return details, matching_slip((o,), (want,), _tile_slips(*args), tolerance(np.float64))

        t.compare(out, want, "the tile", dtype=k_cache.dtype, explain=explain, floor=1.0)
