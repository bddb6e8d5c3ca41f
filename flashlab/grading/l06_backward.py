"""Lesson 06, backward: D = rowsum(dO * O), and the FA2 backward that recomputes P from lse."""
from __future__ import annotations

import numpy as np

from ..reference import reference_attention
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
