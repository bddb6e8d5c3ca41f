"""Lesson 14, split-KV decoding: partial (m, l, O) states of key chunks and their merge."""
from __future__ import annotations

import numpy as np

from ..decoding import merge_partials
from ..reference import reference_attention
from .core import exercise

LESSON = "14_decoding"

HUGE = "Scores near 1e3 overflow exp(): subtract the chunk's max m before exponentiating."
SPREAD = ("The chunks' maxima differ by hundreds here: each chunk's l and O are relative to its own m, so "
          "bring them to the common max with exp(m_c - m) before adding.")
EMPTY = "A chunk with no keys has m = -inf, l = 0, O = 0: it must change nothing (and produce no NaN)."


def _partials(t, n_q, chunks, d, dv, dtype, spread=0.0, size=1.0, empty=()):
    """(m, l, O) of consecutive key chunks and the reference (o, lse) over all the keys, from one score matrix
    S whose chunk c is shifted by spread * (c % 3 - 1), so the chunks' maxima can lie far apart."""
    starts = np.cumsum([0] + list(chunks))
    S = t.normal((n_q, d), np.float64, size) @ t.normal((starts[-1], d), np.float64).T / np.sqrt(d)
    for c, (a, b) in enumerate(zip(starts, starts[1:])):
        S[:, a:b] += spread * (c % 3 - 1)
    V = t.normal((starts[-1], dv), np.float64)
    parts = []
    for a, b in zip(starts, starts[1:]):
        m = S[:, a:b].max(axis=-1)
        P = np.exp(S[:, a:b] - m[:, None])
        parts.append((m, P.sum(-1), P @ V[a:b]))
    ct = np.float64 if dtype == np.float64 else np.float32
    m, l, O = (np.stack(x).astype(ct) for x in zip(*parts))
    for c in empty:
        m[c], l[c], O[c] = -np.inf, 0, 0
        S[:, starts[c]:starts[c + 1]] = -np.inf  # the reference must not see that chunk either
    m_all = S.max(axis=-1)
    P = np.exp(S - m_all[:, None])
    return m, l, O, (P @ V) / P.sum(-1)[:, None], m_all + np.log(P.sum(-1))


@exercise("merge_partials", lesson=LESSON,
          hint="m = the max of the chunks' m; every chunk's l and O are relative to its own m_c, so multiply "
               "both by exp(m_c - m) before summing over chunks. Then o = O / l and lse = m + log(l).")
def check_merge_partials(t, fn):
    f64, f32 = np.float64, np.float32
    specs = [("the example: 1 query, 3 chunks", 1, (4, 4, 4), 4, 4, f64, 0, 1, (), None),
             ("one chunk", 2, (9,), 4, 3, f64, 0, 1, (), None),
             ("ragged chunks, 4 queries", 4, (7, 7, 7, 3), 8, 5, f64, 0, 1, (), None),
             ("chunks far apart", 2, (5, 6, 5, 6, 5), 8, 8, f64, 300, 1, (), SPREAD),
             ("huge logits, float32", 3, (16, 16, 9), 16, 16, f32, 0, 60, (), HUGE),
             ("an empty chunk", 2, (6, 1, 6), 4, 4, f64, 0, 1, (1,), EMPTY),
             ("random", int(t.rng.integers(1, 5)), tuple(int(x) for x in t.rng.integers(1, 40, t.rng.integers(2, 9))),
              8, 8, f32, 0, 2, (), None)]
    for label, n_q, chunks, d, dv, dtype, spread, size, empty, hint in specs:
        m, l, O, ref_o, ref_lse = _partials(t, n_q, chunks, d, dv, dtype, spread, size, empty)
        t.case(label, hint, n_splits=len(chunks), Nq=n_q, dv=dv, dtype=dtype)
        out = t.call(m, l, O)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (o, lse); got {type(out).__name__}")
        tol = 1e-10 if dtype == f64 else 1e-5
        t.compare(out[0], ref_o, "o", min_dtype=dtype, tol=tol)
        t.compare(out[1], ref_lse, "lse", min_dtype=dtype, tol=tol)


@exercise("chunk_partial", lesson=LESSON,
          hint="S = scale * q k_c^T; m = max of each row of S; P = exp(S - m); l = row sums of P; O = P v_c, "
               "NOT divided by l (the merge divides once, at the end).")
def check_chunk_partial(t, fn):
    f64, f32, f16 = np.float64, np.float32, np.float16
    specs = [("the example", 1, 8, 4, 4, f64, 1.0, None), ("4 queries, dv != d", 4, 13, 8, 5, f64, 1.0, None),
             ("a chunk of one key", 2, 1, 4, 4, f64, 1.0, None),
             ("huge logits (scores ~ 1e3)", 3, 20, 16, 16, f64, 60.0, HUGE),
             ("float32, another scale", 2, 33, 16, 16, f32, 1.0, None), ("float16", 2, 17, 16, 16, f16, 1.0, None)]
    for label, n_q, n, d, dv, dtype, size, hint in specs:
        q = t.normal((n_q, d), dtype, size)
        k_c, v_c = t.normal((n, d), dtype), t.normal((n, dv), dtype)
        scale = float(t.rng.uniform(0.1, 1.0)) if "scale" in label else 1 / np.sqrt(d)
        t.case(label, hint, Nq=n_q, chunk=n, d=d, dv=dv, scale=scale, dtype=dtype)
        out = t.call(q, k_c, v_c, scale)
        if not isinstance(out, tuple) or len(out) != 3:
            raise t.fail(f"return a tuple (m, l, O); got {type(out).__name__}")
        S = q.astype(f64) @ k_c.astype(f64).T * scale
        m = S.max(axis=-1)
        P = np.exp(S - m[:, None])
        want_dtype = f64 if dtype == f64 else f32
        tol = 1e-10 if dtype == f64 else 1e-5
        t.compare(out[0], m, "m", min_dtype=want_dtype, tol=tol)
        t.compare(out[1], P.sum(-1), "l", min_dtype=want_dtype, tol=tol)
        t.compare(out[2], P @ v_c.astype(f64), "O (unnormalised)", min_dtype=want_dtype, tol=tol)
        o, _ = merge_partials(out[0][None], out[1][None], out[2][None])  # it must also merge to attention
        if not np.allclose(o, reference_attention(q, k_c, v_c, scale=scale)[0], rtol=1e-3, atol=1e-3):
            raise t.fail("(m, l, O) do not give softmax(S) v once merged: o = O / l")
