"""Lesson 06, backward: D = rowsum(dO * O), the FA2 backward that recomputes P from lse, and what
recomputing costs and saves."""
from __future__ import annotations

import math

import numpy as np

from ..reference import reference_attention
from ..roofline import PUBLISHED, PUBLISHED_FP32
from ..tiled import flash_attention_v2_backward
from .attention import attention_cases, first_wrong_block, _as_pair, _rows_wrong
from .core import exercise, tolerance

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


@exercise("fa2_backward", lesson=LESSON, time_limit=40,
          hint="Per tile: recompute P_ij = exp(S_ij - lse_i); dV_j += P^T dO_i; dP = dO_i V_j^T; "
               "dS = P * (dP - D_i); then dQ_i and dK_j from dS, each scaled like S was.")
def check_fa2_backward(t, fn):
    for Q, K, V, causal, bq, bk in attention_cases(t, causal=True, min_n=2):
        o64, lse = reference_attention(Q, K, V, causal=causal)
        O, dO = o64.astype(Q.dtype), t.normal(o64.shape, Q.dtype)
        lse = lse.astype(np.float32 if Q.dtype == np.float16 else Q.dtype)
        # The float64 reference: flashlab's own backward, run in float64.
        refs = flash_attention_v2_backward(*(x.astype(np.float64) for x in (Q, K, V, O, lse, dO)), causal=causal)
        out = _as_pair(t, t.call(Q, K, V, O, lse, dO, causal=causal, block_q=bq, block_k=bk), ("dQ", "dK", "dV"))
        tol = tolerance(Q.dtype)
        for name, grad, ref, block, what in zip(("dQ", "dK", "dV"), out, refs, (bq, bk, bk), ("query", "key", "key")):
            grad = t.array(grad, ref.shape, Q.dtype, name)
            wrong = _rows_wrong(grad, ref, tol)
            others = [n for n, g, r in zip(("dQ", "dK", "dV"), out, refs)
                      if n != name and np.shape(g) == r.shape and not _rows_wrong(g, r, tol).any()]
            details = [first_wrong_block(wrong, block, what)[1]] if wrong.any() else []
            if others:
                details.append(f"{' and '.join(others)} {'is' if len(others) == 1 else 'are'} right")
            t.compare(grad, ref, name, dtype=Q.dtype, explain=lambda _: (details, None))


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
