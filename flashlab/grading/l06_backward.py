"""Lesson 06, backward: D = rowsum(dO * O), the FA2 backward that recomputes P from lse, and what
recomputing costs and saves."""
from __future__ import annotations

import math

import numpy as np

from .._inputs import causal_mask
from ..reference import reference_attention
from ..roofline import PUBLISHED, PUBLISHED_FP32
from .attention import FP16, HUGE, _as_pair, _rows_wrong, attention_cases, first_wrong_block, matching_slip
from .core import exercise, noise_floor, tolerance

LESSON = "06_backward"


@exercise("delta", lesson=LESSON,
          hint="D_i is one number per query row: the dot product of row i of dO with row i of O.")
def check_delta(t, fn):
    shapes = [("small", (4, 3)), ("random shape", tuple(int(n) for n in t.rng.integers(1, 50, 2))),
              ("one row", (1, 7)), ("float32", (9, 16))]
    for label, shape in shapes:
        dtype = np.float32 if label == "float32" else np.float64
        O, dO = t.normal(shape, dtype), t.normal(shape, dtype)
        t.case(label, shape=shape, dtype=np.dtype(dtype).name)
        ref = np.sum(O.astype(np.float64) * dO.astype(np.float64), axis=-1)
        t.compare(t.call(O, dO), ref, "D", min_dtype=dtype)


BACKWARD_HINTS = {  # the forward's case hints, as they read for a backward
    HUGE: "Scores near 1e4 make P one-hot, so dQ and dK are almost 0 (the check allows for their rounding "
          "noise). P = exp(S - lse) cannot overflow: lse is the row's largest score plus a little.",
    FP16: "float16 inputs: compute in float32 and return the gradients in the input's dtype.",
}


def _dense_backward(Q, K, V, O, lse, dO, causal, *, use_D=True, dQ_scale=1.0, dK_scale=1.0, offset=0,
                    key_end=None, query_end=None, tile_norm=None, P_from_lse=True, magnitude=False):
    """(dQ, dK, dV) of attention in float64 from whole matrices, or a usual slip of it.

    offset: the causal diagonal moved by this many keys; key_end / query_end: keys / queries from there on
    left out (a dropped last block); tile_norm: block_k, P normalised within each tile; P_from_lse=False:
    P = exp(S) unshifted. magnitude=True: every factor by its absolute value, the size of the terms that a
    right answer's rounding noise scales with.
    """
    Q, K, V, O, lse, dO = (np.asarray(x, np.float64) for x in (Q, K, V, O, lse, dO))
    scale = 1 / math.sqrt(Q.shape[1])
    S = Q @ K.T * scale
    visible = np.ones(S.shape, bool)
    if causal:
        visible = causal_mask(*S.shape) if offset == 0 else \
            np.arange(S.shape[1])[None, :] <= np.arange(S.shape[0])[:, None] + offset
    if key_end is not None:
        visible[:, key_end:] = False
    if query_end is not None:
        visible[query_end:] = False
    with np.errstate(all="ignore"):
        if tile_norm:
            P = np.zeros_like(S)
            for k0 in range(0, S.shape[1], tile_norm):
                tile = np.where(visible[:, k0:k0 + tile_norm], S[:, k0:k0 + tile_norm], -np.inf)
                m = np.max(tile, axis=1, keepdims=True, initial=-np.inf)
                e = np.exp(tile - np.where(np.isfinite(m), m, 0))
                P[:, k0:k0 + tile_norm] = e / np.where(e.sum(1, keepdims=True) > 0, e.sum(1, keepdims=True), 1)
        else:
            P = np.where(visible, np.exp(S - (lse[:, None] if P_from_lse else 0)), 0.0)
    if magnitude:  # exp(S - lse) carries a relative error of about eps * |S|
        P = P * (1 + np.abs(S) + np.abs(lse)[:, None])
        K, V, O, Q, dO = np.abs(K), np.abs(V), np.abs(O), np.abs(Q), np.abs(dO)
    dP = dO @ V.T
    D = np.sum(dO * O, axis=-1)
    dS = P * (dP + D[:, None]) if magnitude else P * (dP - D[:, None]) if use_D else P * dP
    dV = P.T @ dO
    return dQ_scale * scale * dS @ K, dK_scale * scale * dS.T @ Q, dV


def _backward_slips(args, causal, bq, bk):
    """(hint, function giving the slip's (dQ, dK, dV)) for the usual mistakes of an FA2 backward."""
    Q, K = args[0], args[1]
    nq, nk, scale = len(Q), len(K), 1 / math.sqrt(Q.shape[1])
    grads = lambda c=causal, **kw: lambda: _dense_backward(*args, c, **kw)  # noqa: E731
    slips = [
        ("these are the gradients without D: the softmax ties every P_ij to its whole row, which gives "
         "dS = P * (dP - D), with D_i = rowsum(dO_i * O_i) taken off every entry of row i", grads(use_D=False)),
        ("dK is missing the softmax scale: S = scale * Q K^T, so dK = scale * dS^T Q", grads(dK_scale=1 / scale)),
        ("dQ is missing the softmax scale: S = scale * Q K^T, so dQ = scale * dS K", grads(dQ_scale=1 / scale)),
        ("dQ and dK are missing the softmax scale: S = scale * Q K^T, so both carry one factor of scale",
         grads(dQ_scale=1 / scale, dK_scale=1 / scale)),
        ("dQ and dK carry the scale twice: it belongs once, either in dS or in the two products",
         grads(dQ_scale=scale, dK_scale=scale)),
        ("P is normalised within each tile; it must be the whole row's probabilities, exp(S_ij - lse_i), "
         "which lse already normalises", grads(tile_norm=bk)),
        ("P is exp(S) without lse: subtract lse_i, the log of row i's sum, so that P is normalised",
         grads(P_from_lse=False)),
    ]
    if nk % bk:
        slips.append((f"the last key block (keys {nk // bk * bk}..{nk - 1}) is shorter than block_k and is left "
                      "out: it counts too", grads(key_end=nk // bk * bk)))
    if nq % bq:
        slips.append((f"the last query block (rows {nq // bq * bq}..{nq - 1}) is shorter than block_q and is left "
                      "out: it counts too", grads(query_end=nq // bq * bq)))
    if causal:
        slips += [("the causal mask hides the diagonal: query i sees keys j <= i, its own position included",
                   grads(offset=-1)),
                  ("the causal mask lets query i see key i + 1: it sees keys j <= i only", grads(offset=1)),
                  ("the causal mask is missing: with causal=True, P_ij = 0 for j > i", grads(c=False))]
    return slips


def _backward_where(wrong):
    """A pointer from which gradients are wrong to where the slip is."""
    if wrong == {"dV"}:
        return "only dV is wrong: dV_j = sum over query blocks of P_ij^T dO_i needs neither D nor the scale"
    if "dV" not in wrong:
        return ("dV is right, so P is right: look at dP, dS = P * (dP - D) and the two products dQ += dS K_j, "
                "dK_j += dS^T Q_i, each with the scale")
    return ("dV = P^T dO is wrong too, so P itself is: check the scale inside S, the causal mask and "
            "P = exp(S - lse), tile by tile against the whole-matrix formulas")


@exercise("fa2_backward", lesson=LESSON, time_limit=40,
          hint="Work out the gradients of a tiny case with the whole-matrix formulas of the lesson (one block, "
               "two queries and two keys) and compare them with your function's, tile by tile.")
def check_fa2_backward(t, fn):
    for Q, K, V, causal, bq, bk in attention_cases(t, causal=True, hints=BACKWARD_HINTS):
        o64, lse = reference_attention(Q, K, V, causal=causal)
        O, dO = o64.astype(Q.dtype), t.normal(o64.shape, Q.dtype)
        lse = lse.astype(np.float32 if Q.dtype == np.float16 else Q.dtype)
        args = (Q, K, V, O, lse, dO)
        refs = _dense_backward(*args, causal)
        out = _as_pair(t, t.call(*args, causal=causal, block_q=bq, block_k=bk), NAMES)
        grads = [t.array(g, r.shape, Q.dtype, name) for name, g, r in zip(NAMES, out, refs)]
        tol = tolerance(Q.dtype)
        # Where P is one-hot (huge scores, one visible key) dQ and dK are sums that cancel to about 0: judge
        # them against the size of their terms, not against the reference's own rounding noise.
        mags = _dense_backward(*args, causal, magnitude=True)
        floors = [noise_floor(m, Q.dtype, tol, terms=max(Q.shape + K.shape)) for m in mags]
        wrong = {n: _rows_wrong(g, r, tol, f) for n, g, r, f in zip(NAMES, grads, refs, floors)}
        details, hint = [], None
        if any(w.any() for w in wrong.values()):
            bad = {n for n, w in wrong.items() if w.any()}
            for name, block, what in zip(NAMES, (bq, bk, bk), ("query", "key", "key")):
                if name in bad:
                    details.append(f"{name}: " + first_wrong_block(wrong[name], block, what)[1])
            right = [n for n in NAMES if n not in bad]
            if right:
                details.append(f"{' and '.join(right)} {'is' if len(right) == 1 else 'are'} right")
            hint = matching_slip(grads, refs, _backward_slips(args, causal, bq, bk), tol, floors) or \
                _backward_where(bad)
        for name, grad, ref, floor in zip(NAMES, grads, refs, floors):
            t.compare(grad, ref, name, dtype=Q.dtype, floor=floor, explain=lambda _: (details, hint))
        if details:
            raise t.fail("some rows of the gradients are wrong", details=details, hint=hint)


NAMES = ("dQ", "dK", "dV")


def recompute_tradeoff(Nq, Nk, d, block_k, bytes_per_element, peak_flops, bandwidth):
    """(extra matmul FLOPs, HBM bytes saved, whether recomputing P beats storing it) for one head.

    Storing: the forward writes P, the fused backward reads each tile of it once. Recomputing: the forward
    writes lse (float32), the backward reads lse_i with every tile (once per key block) and recomputes
    S_ij = Q_i K_j^T from tiles it loads anyway.
    """
    flops = 2 * Nq * Nk * d
    saved = 2 * Nq * Nk * bytes_per_element - 4 * (Nq + math.ceil(Nk / block_k) * Nq)
    return flops, saved, flops / peak_flops < saved / bandwidth


#: (label, peak FLOP/s, bandwidth, bytes per element) from the vendors' datasheets (flashlab.roofline)
MACHINES = [("A100, float16 on tensor cores", PUBLISHED["A100"].peak_flops, PUBLISHED["A100"].bandwidth, 2),
            ("H100, float32 on FP32 units", PUBLISHED_FP32["H100"], PUBLISHED["H100"].bandwidth, 4),
            ("T4, float32 on FP32 units", PUBLISHED_FP32["T4"], PUBLISHED["T4"].bandwidth, 4)]


@exercise("recompute_tradeoff", lesson=LESSON,
          hint="Recomputing P costs one Nq x Nk x d matrix product (2 FLOPs per multiply-add) and saves what "
               "storing P moves: its write in the forward and its read in the backward, less the lse traffic "
               "(float32, read again for every key block). Recomputing wins when its FLOPs take less time at "
               "peak_flops than the saved bytes at bandwidth.")
def check_recompute_tradeoff(t, fn):
    rand = lambda lo, hi: int(t.rng.integers(lo, hi))  # noqa: E731
    cases = [(f"{name}, d = {d}", 4096, 4096, d, 64, b, peak, bw) for name, peak, bw, b in MACHINES for d in (64, 128)]
    while len(cases) < 12:
        nq, nk, d, bk, b = rand(1, 20000), rand(1, 20000), rand(1, 257), rand(1, 257), [2, 4][rand(0, 2)]
        peak, bw = float(10 ** t.rng.uniform(12, 15)), float(10 ** t.rng.uniform(11, 13))
        flops, saved, _ = recompute_tradeoff(nq, nk, d, bk, b, peak, bw)
        if saved > 0 and abs(math.log(flops / peak * bw / saved)) > 0.1:  # not a near tie
            cases.append(("random", nq, nk, d, bk, b, peak, bw))
    for label, nq, nk, d, bk, b, peak, bw in cases:
        t.case(label, Nq=nq, Nk=nk, d=d, block_k=bk, bytes_per_element=b, peak_flops=peak, bandwidth=bw)
        out = t.call(nq, nk, d, bk, b, peak, bw)
        if not isinstance(out, tuple) or len(out) != 3:
            raise t.fail(f"return a tuple (extra_flops, bytes_saved, recompute_wins); got {out!r:.80}")
        flops, saved, wins = recompute_tradeoff(nq, nk, d, bk, b, peak, bw)
        t.scalar(out[0], flops, "extra_flops", tol=1e-12,
                 slips=[(2 * flops, "that counts two products; only S = Q K^T is recomputed (dP = dO V^T is needed "
                                    "either way)"),
                        (flops / 2, "a multiply-add is 2 FLOPs")])
        tc, lse_write = math.ceil(nk / bk), 4 * nq
        t.scalar(out[1], saved, "bytes_saved", tol=1e-12,
                 slips=[(3 * nq * nk * b - lse_write - 4 * tc * nq, "that reads P twice; in the fused backward each "
                                                                    "tile of P is read once and used on chip for dV and dS"),
                        (nq * nk * b - lse_write - 4 * tc * nq, "storing P also costs its write in the forward, not "
                                                                "only the read in the backward"),
                        (2 * nq * nk * b, "the recomputing variant moves lse instead: written once, read with every tile"),
                        (2 * nq * nk * b - 2 * lse_write, "lse_i is read with every tile, once per key block: "
                                                          "ceil(Nk / block_k) times"),
                        (2 * nq * nk * b - b * (nq + tc * nq), "lse is kept in float32 (4 bytes) whatever the "
                                                              "inputs' dtype"),
                        (2 * nq * nk * 4 - lse_write - 4 * tc * nq, "P has the inputs' dtype: bytes_per_element")])
        if not isinstance(out[2], (bool, np.bool_)):
            raise t.fail(f"recompute_wins should be True or False; got {type(out[2]).__name__} {out[2]!r:.40}")
        if bool(out[2]) != wins:
            raise t.fail(f"recompute_wins is {bool(out[2])}: recomputing takes {flops / peak:.3g} s at peak_flops, "
                         f"moving the saved bytes {saved / bw:.3g} s at bandwidth",
                         hint="compare the two times; the smaller one wins")
