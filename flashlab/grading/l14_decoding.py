"""Lesson 14, split-KV decoding: partial (m, l, O) states of key chunks, their merge, and the time bound of a
decoding step."""
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


@exercise("decode_time", lesson=LESSON,
          hint="Bytes: read Q (Nq x d) and K, V (Nk x d each), write O (Nq x d), per (batch, head), times the "
               "element size. FLOPs: Q K^T and P V are 2 Nq Nk d each, per (batch, head). The time is at least "
               "bytes / bandwidth and at least FLOPs / peak: the larger one is the bound.")
def check_decode_time(t, fn):
    h100 = (989e12, 3.35e12)  # FLOP/s (FP16 dense tensor cores) and bytes/s (HBM3) of an H100 SXM
    specs = [("the lesson's decoding step", 1, 16, 1, 16384, 128, 2, *h100),
             ("float32 (FP32 peak)", 1, 16, 1, 16384, 128, 4, 66.9e12, 3.35e12), ("a batch of 8 sequences", 8, 32, 1, 4096, 128, 2, *h100),
             ("8 queries at once (speculative decoding)", 1, 16, 8, 8192, 128, 2, *h100),
             ("few keys: Q and O matter", 2, 8, 64, 64, 64, 2, *h100),
             ("a long prompt chunk", 1, 16, 2048, 4096, 128, 2, *h100)]
    for _ in range(4):
        nq = int(2 ** t.rng.integers(0, 12))
        specs.append(("random", int(t.rng.integers(1, 9)), int(t.rng.integers(1, 65)), nq,
                      nq + int(t.rng.integers(1, 65536)), int(2 ** t.rng.integers(5, 9)), int(t.rng.choice([2, 4])),
                      float(t.rng.uniform(50e12, 1000e12)), float(t.rng.uniform(0.5e12, 5e12))))
    for label, B, H, nq, nk, d, size, peak, bw in specs:
        t.case(label, B=B, H=H, Nq=nq, Nk=nk, d=d, itemsize=size, peak_flops=peak, bandwidth=bw)
        out = t.call(B, H, nq, nk, d, size, peak, bw)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise t.fail(f"return a pair (seconds, 'memory' or 'compute'); got {out!r:.80}")
        kv, qo, flops = 2 * B * H * nk * d * size, 2 * B * H * nq * d * size, 4 * B * H * nq * nk * d
        t_mem, t_math = (kv + qo) / bw, flops / peak
        t.scalar(out[0], max(t_mem, t_math), "the time (seconds)", tol=1e-9, slips=[
            (max(kv / bw, t_math), "Reading Q and writing O move bytes too; they matter once Nq is not small next to Nk."),
            (max((kv / 2 + qo) / bw, t_math), "Decoding reads V as well as K: both caches, Nk x d each."),
            (max(t_mem, t_math / 2), "Count both products: Q K^T and P V take 2 Nq Nk d FLOPs each."),
            (max(t_mem, 2 * t_math), "A multiply-add is 2 FLOPs: Q K^T is 2 Nq Nk d FLOPs, P V as many, 4 Nq Nk d in all."),
            (t_mem + t_math, "Memory traffic and arithmetic overlap: the time is the larger of the two, not their sum."),
            (t_mem, "The arithmetic takes FLOPs / peak_flops, and here that is the larger: a bound must take both."),
            (t_math, "Moving the bytes takes bytes / bandwidth, and here that is the larger: a bound must take both."),
            (max(t_mem / size, t_math), "Bytes, not numbers: multiply by itemsize.")])
        want = "memory" if t_mem >= t_math else "compute"
        if out[1] != want:
            raise t.fail(f"the bound is {out[1]!r}; expected {want!r}: moving the bytes takes {t_mem:.3g} s, the "
                         f"arithmetic {t_math:.3g} s")
