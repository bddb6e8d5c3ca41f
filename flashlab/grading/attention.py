"""Inputs and diagnoses shared by the attention exercises (lessons 02, 04, 05, 06).

`attention_cases` builds the visible example and the hidden cases (ragged tails, Nq != Nk, blocks of one
row or larger than N, causal, huge logits, float16). `check_forward` compares (O, lse) with the float64
reference and, when they are wrong, says which quantity is off, the first query block with wrong rows and
the first key block after which that block's output goes wrong (found by re-running on a prefix of K/V).
"""
from __future__ import annotations

import math

import numpy as np

from .._inputs import causal_mask
from ..reference import reference_attention
from .core import Failed, NotImplementedYet, tolerance

RAGGED = "N need not be a multiple of the block size: the last block is shorter than the others, and it counts too."
NQ_NK = "Q and K/V can have different lengths (Nq != Nk), and V its own width dv."
BLOCKS = "Block sizes can be 1, or larger than the whole sequence."
CAUSAL = ("Causal: query i sees keys j <= i only (top-left aligned, also when Nq != Nk); "
          "the other scores become -inf before the softmax.")
HUGE = "Scores near 1e4 overflow exp(). Subtracting a row's (running) max keeps every exponent <= 0."
FP16 = "float16 inputs: compute in float32 and return O in the input's dtype."


def attention_cases(t, *, causal=False, blocks=True, dv_differs=True, hints=None):
    """Yield (Q, K, V, causal, block_q, block_k) for each case, after describing it with t.case().

    hints: replacements for the case hints (e.g. {HUGE: ...} for a backward, where nothing overflows).
    """
    rng = t.rng
    f64, f32, f16 = np.float64, np.float32, np.float16
    # label, Nq, Nk, d, dv, dtype, block_q, block_k, causal, input scale, hint
    specs = [
        ("small", 8, 8, 4, 4, f64, 4, 4, False, 1, None),
        ("ragged tails", 13, 11, 8, 8, f64, 4, 3, False, 1, RAGGED),
        ("more keys than queries", 5, 29, 16, 16, f32, 2, 8, False, 1, NQ_NK),
        ("more queries than keys", 37, 6, 8, 5, f32, 8, 4, False, 1, NQ_NK),
        ("blocks larger than the sequence", 6, 7, 4, 3, f64, 16, 32, False, 1, BLOCKS),
        ("blocks of one row", 5, 4, 3, 3, f64, 1, 1, False, 1, BLOCKS),
        ("random shape", *rng.integers(1, 48, 2), *rng.integers(1, 24, 2), f32, *rng.integers(2, 17, 2), False, 1, RAGGED),
        ("huge logits (scores ~ 1e4)", 9, 10, 8, 8, f64, 4, 4, False, 100, HUGE),
        ("float16", 17, 19, 16, 16, f16, 8, 8, False, 1, FP16),
    ]
    if causal:
        specs += [
            ("causal", 13, 13, 8, 8, f64, 4, 4, True, 1, CAUSAL),
            ("causal, ragged, Nq < Nk", 7, 20, 8, 6, f64, 3, 4, True, 1, CAUSAL),
            ("causal, ragged, Nq > Nk", 20, 7, 8, 8, f32, 6, 4, True, 1, CAUSAL),
            ("causal, random shape", *rng.integers(1, 48, 2), *rng.integers(1, 24, 2), f64, *rng.integers(2, 17, 2), True, 1, CAUSAL),
            ("causal, huge logits", 12, 12, 8, 8, f64, 4, 4, True, 100, HUGE),
            ("causal, float16", 16, 21, 16, 16, f16, 4, 8, True, 1, FP16),
        ]
    for label, nq, nk, d, dv, dtype, bq, bk, c, scale, hint in specs:
        nq, nk, d, bq, bk = int(nq), int(nk), int(d), int(bq), int(bk)
        dv = int(dv) if dv_differs else d
        Q, K, V = t.normal((nq, d), dtype, scale), t.normal((nk, d), dtype, scale), t.normal((nk, dv), dtype)
        info = dict(Q=(nq, d), K=(nk, d), V=(nk, dv), dtype=np.dtype(dtype).name)
        if causal:
            info["causal"] = c
        if blocks:
            info.update(block_q=bq, block_k=bk)
        if not blocks and hint in (RAGGED, BLOCKS):  # about block sizes, which this exercise does not have
            hint = None
        t.case(label, (hints or {}).get(hint, hint), **info)
        yield Q, K, V, c, bq, bk


def _rows_wrong(out, ref, tol, floor=0.0):
    """Boolean per row (first axis): wrong by more than tol times the typical row's norm, or not finite.

    floor: as in Checker.compare, the size below which a whole output counts as near zero.
    """
    out = np.asarray(out, dtype=np.float64).reshape(len(ref), -1)
    ref = np.asarray(ref, dtype=np.float64).reshape(len(ref), -1)
    typical = max(float(np.linalg.norm(ref)), floor) / math.sqrt(len(ref)) or 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.linalg.norm(out - ref, axis=1)
    return ~np.isfinite(err) | (err > tol * typical)


def _span(start, size, n):
    end = min(start + size, n) - 1
    return f"{start}" if end == start else f"{start}..{end}"


def first_wrong_block(wrong_rows, block, what="query"):
    """Index of the first block holding a wrong row, and a sentence about it (or None)."""
    rows = np.flatnonzero(wrong_rows)
    if not rows.size:
        return None, None
    i = int(rows[0]) // block
    return i, f"first {what} block with wrong rows: block {i} ({what} rows {_span(i * block, block, len(wrong_rows))})"


def matching_slip(outs, refs, slips, tol, floors=None):
    """The hint of the first usual slip whose answer the learner's outputs reproduce, or None.

    outs, refs: the learner's and the right arrays; slips: [(hint, arrays or a function giving them)]. A slip
    counts only where it differs from the right answer, and matches when every output is within a loose
    tolerance (10 x tol, at least 1e-3) of it.
    """
    floors = floors or [0.0] * len(refs)
    loose = max(10 * tol, 1e-3)

    def close(xs, ys, limit):
        for x, y, floor in zip(xs, ys, floors):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            if x.shape != y.shape or not np.array_equal(np.isfinite(x), np.isfinite(y)):
                return False
            fin = np.isfinite(y)
            if not fin.any():  # all NaN on both sides says nothing about which slip it was
                return False
            if np.linalg.norm(x[fin] - y[fin]) > limit * max(float(np.linalg.norm(y[fin])), floor):
                return False
        return True

    for hint, wrong in slips:
        with np.errstate(all="ignore"):
            wrong = wrong() if callable(wrong) else wrong
        if not close(wrong, refs, loose) and close(outs, wrong, loose):
            return hint
    return None


def _dense_forward(Q, K, V, causal, *, scale=True, axis=-1, offset=0, bottom_right=False, key_end=None):
    """(O, lse) in float64 from whole matrices, or a usual slip of it (see forward_slips)."""
    Q, K, V = (np.asarray(x, np.float64) for x in (Q, K, V))
    S = Q @ K.T / (math.sqrt(Q.shape[1]) if scale else 1.0)
    rows, cols = np.arange(S.shape[0])[:, None], np.arange(S.shape[1])[None, :]
    visible = np.ones(S.shape, bool)
    if causal:
        visible = cols <= rows + offset + (S.shape[1] - S.shape[0] if bottom_right else 0)
    if key_end is not None:
        visible &= cols < key_end
    S = np.where(visible, S, -np.inf)
    m = np.max(S, axis=axis, keepdims=True)
    P = np.exp(S - m)
    P = P / P.sum(axis=axis, keepdims=True)
    m_row = S.max(axis=-1)
    lse = m_row + np.log(np.exp(S - m_row[:, None]).sum(axis=-1))
    return P @ V, lse


def _fa2_flawed(Q, K, V, causal, block_q, block_k, *, rescale_O=True, normalise_each_step=False):
    """FA2's loops in float64 with one slip: O_i not rescaled when the max grows, or divided by l every step."""
    Q, K, V = (np.asarray(x, np.float64) for x in (Q, K, V))
    S_all = np.where(causal_mask(len(Q), len(K)) if causal else True, Q @ K.T / math.sqrt(Q.shape[1]), -np.inf)
    O, lse = np.zeros((len(Q), V.shape[1])), np.zeros(len(Q))
    for q0 in range(0, len(Q), block_q):
        r = slice(q0, q0 + block_q)
        n = S_all[r].shape[0]
        acc, l, m = np.zeros((n, V.shape[1])), np.zeros(n), np.full(n, -np.inf)
        for k0 in range(0, len(K), block_k):
            S = S_all[r, k0:k0 + block_k]
            m_new = np.maximum(m, S.max(axis=1))
            safe = np.where(np.isfinite(m_new), m_new, 0.0)
            P, alpha = np.exp(S - safe[:, None]), np.exp(m - safe)
            l_new = alpha * l + P.sum(axis=1)
            if normalise_each_step:
                acc = (alpha[:, None] * acc + P @ V[k0:k0 + block_k]) / np.where(l_new > 0, l_new, 1.0)[:, None]
            else:
                acc = (alpha[:, None] if rescale_O else 1.0) * acc + P @ V[k0:k0 + block_k]
            l, m = l_new, m_new
        O[r] = acc if normalise_each_step else acc / l[:, None]
        lse[r] = m + np.log(l)
    return O, lse


def forward_slips(Q, K, V, causal, block_q=None, block_k=None):
    """(hint, function giving the slip's (O, lse)) for the usual mistakes of an attention forward."""
    nq, nk = len(Q), len(K)
    dense = lambda c=causal, **kw: lambda: _dense_forward(Q, K, V, c, **kw)  # noqa: E731
    slips = [("S is missing the scale 1/sqrt(d)", dense(scale=False)),
             ("the softmax runs over the wrong axis: each query's row of S is normalised over its keys", dense(axis=0))]
    if causal:
        slips += [("the causal mask hides the diagonal: query i sees keys j <= i, its own position included",
                   dense(offset=-1)),
                  ("the causal mask lets query i see key i + 1: it sees keys j <= i only", dense(offset=1)),
                  ("the causal mask is missing: with causal=True, query i sees keys j <= i only", dense(c=False))]
        if nq != nk:
            slips.append(("the causal mask is aligned bottom-right (the last query on the last key); here it is "
                          "top-left: query i sees keys j <= i whatever Nq and Nk are", dense(bottom_right=True)))
    if block_k and nk % block_k:
        slips.append((f"the last key block (keys {nk // block_k * block_k}..{nk - 1}) is shorter than block_k and "
                      "is left out: it counts too", dense(key_end=nk // block_k * block_k)))
    if block_q and block_k:
        flawed = lambda **kw: lambda: _fa2_flawed(Q, K, V, causal, block_q, block_k, **kw)  # noqa: E731
        slips += [("lse is right but O_i is not rescaled when a key block raises the running max: its terms were "
                   "weighted relative to the old max, like l's", flawed(rescale_O=False)),
                  ("O_i is divided by l_i after every key block, but the next block adds to it as if it were not: "
                   "either keep O_i unnormalised and divide once at the end, or undo the division first",
                   flawed(normalise_each_step=True))]
    return slips


def _as_pair(t, out, names):
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise t.fail(f"return a tuple ({', '.join(names)}); got {type(out).__name__}"
                     + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return out


def check_forward(t, out, Q, K, V, causal, block_q, block_k, rerun=None):
    """Compare the learner's (O, lse) with the reference, diagnosing what went wrong.

    rerun(K_prefix, V_prefix) -> (O, lse) calls the learner's function again on a prefix of the keys.
    """
    o_ref, lse_ref = reference_attention(Q, K, V, causal=causal)
    O, lse = _as_pair(t, out, ("O", "lse"))
    O = t.array(O, o_ref.shape, Q.dtype, "O")
    lse = t.array(lse, lse_ref.shape, None, "lse", min_dtype=Q.dtype)
    # A right kernel's scores carry rounding errors of about eps * |S|; where two keys nearly tie, P and O move
    # by that much (huge logits in float32: ~1e-3), so O's tolerance grows with the largest score.
    scores = np.abs(Q.astype(np.float64) @ K.astype(np.float64).T).max(initial=0.0) / math.sqrt(Q.shape[-1])
    tol = tolerance(Q.dtype)
    o_tol = max(tol, 16 * float(np.finfo(np.promote_types(Q.dtype, np.float32)).eps) * scores)  # fp32 scores at least
    o_bad, l_bad = _rows_wrong(O, o_ref, o_tol), _rows_wrong(lse, lse_ref, tol)
    if not (o_bad.any() or l_bad.any()):
        t.compare(O, o_ref, "O", dtype=Q.dtype, tol=o_tol)  # the rows are fine; this checks the overall error too
        t.compare(lse, lse_ref, "lse", min_dtype=Q.dtype)
        return

    details, hint = [], matching_slip((O, lse), (o_ref, lse_ref), forward_slips(Q, K, V, causal, block_q, block_k),
                                      tol)
    if o_bad.any() and not l_bad.any():
        details.append("lse is right but O is not: the statistics m and l are fine, so look at how O is "
                       "accumulated and normalised")
    elif l_bad.any() and not o_bad.any():
        details.append("O is right but lse is not")
        hint = hint or _lse_hint(Q, K, causal, lse)
    else:
        details.append("O and lse are both wrong: the running max m or the running sum l already goes wrong")
    i, sentence = first_wrong_block(o_bad | l_bad, block_q)
    details.append(sentence)
    if rerun is not None:
        details += _first_bad_prefix(t, rerun, Q, K, V, causal, block_q, block_k, i, tol)
    explain = lambda _: (details, hint)  # noqa: E731
    t.compare(O, o_ref, "O", dtype=Q.dtype, explain=explain)
    t.compare(lse, lse_ref, "lse", min_dtype=Q.dtype, explain=explain)
    raise t.fail("O or lse has wrong rows", details=details)  # wrong rows, yet a small overall error


def _lse_hint(Q, K, causal, lse):
    """Recognise the two classic lse slips: returning m alone or log(l) alone."""
    S = (Q.astype(np.float64) @ K.astype(np.float64).T) / math.sqrt(Q.shape[-1])
    if causal:
        S = np.where(causal_mask(Q.shape[0], K.shape[0]), S, -np.inf)
    m = S.max(axis=-1)
    log_l = np.log(np.exp(S - m[:, None]).sum(axis=-1))
    lse = np.asarray(lse, dtype=np.float64)
    for name, wrong in (("the row max m alone", m), ("log(l) alone", log_l)):
        if np.allclose(lse, wrong, rtol=1e-3, atol=1e-3):
            return f"your lse equals {name}; lse = log(sum_j exp(S_ij)) needs both parts of the statistics."
    return "lse is the log of the whole row sum of exp(S): combine the final m and l."


def _first_bad_prefix(t, rerun, Q, K, V, causal, block_q, block_k, i, tol):
    """Re-run on K/V truncated after 1, 2, ... key blocks: after which block does query block i go wrong?"""
    nk = K.shape[0]
    n_blocks = math.ceil(nk / block_k)
    if n_blocks < 2:
        return []
    rows = slice(i * block_q, (i + 1) * block_q)
    for j in range(min(n_blocks, 16)):
        n = min((j + 1) * block_k, nk)
        try:
            out = rerun(K[:n], V[:n])
            O, lse = out
            o_ref, lse_ref = reference_attention(Q, K[:n], V[:n], causal=causal)
            wrong = _rows_wrong(np.asarray(O)[rows], o_ref[rows], tol).any() or \
                _rows_wrong(np.asarray(lse)[rows], lse_ref[rows], tol).any()
        except (Failed, NotImplementedYet, ValueError, TypeError, IndexError):
            return []
        if wrong:
            partial = " (the last, partial block)" if j == n_blocks - 1 and nk % block_k else \
                " (the last block)" if j == n_blocks - 1 else ""
            before = "key block 0" if j == 1 else f"key blocks 0..{j - 1}"
            first = "already wrong with only the first key block" if j == 0 else \
                f"right with {before}, wrong once key block {j} is added"
            return [f"query block {i} is {first} (keys {_span(j * block_k, block_k, nk)}){partial}"]
    return []


def poison_unvisited(K, V, n_q, block_k):
    """Causal FA2 never loads key blocks that start after the last query: fill them with NaN.

    Returns (K, V) copies and the number of poisoned keys.
    """
    first = math.ceil(n_q / block_k) * block_k  # start of the first key block after every query
    K, V = K.copy(), V.copy()
    K[first:], V[first:] = np.nan, np.nan
    return K, V, max(K.shape[0] - first, 0)
