"""Lesson 08: checkers of its kernel exercises."""
from __future__ import annotations

import math

import numpy as np

from .core import exercise
from .simcheck import kernel_of, launch, not_implemented

LESSON = "08_first_flash_kernel"

def _attention_case_specs(t):
    # label, d, block_q, block_k, Nq, Nk, causal, q scale, hint
    from .attention import CAUSAL, HUGE, NQ_NK, RAGGED

    return [
        ("one tile", 8, 8, 8, 8, 8, False, 1, None),
        ("ragged tails", 8, 8, 4, 13, 11, False, 1, RAGGED),
        ("more keys than queries", 16, 4, 8, 5, 29, False, 1, NQ_NK),
        ("causal", 8, 8, 4, 13, 13, True, 1, CAUSAL),
        ("causal, Nq > Nk", 8, 8, 4, 20, 7, True, 1, CAUSAL),
        ("block_k > block_q, causal", 8, 4, 8, 6, 17, True, 1, CAUSAL),
        ("huge logits (scores ~ 1e4)", 8, 8, 4, 9, 10, False, 100, HUGE),
    ]


@exercise("flash_shared_kernel", lesson=LESSON, time_limit=45,
          hint="For each key c of the tile that the row may see (k0 + c < n_k, and k0 + c <= row when causal): "
               "s = q_row . K[c]; m_new = max(m, s); alpha = exp(m - m_new); p = exp(s - m_new); "
               "l = l * alpha + p; acc = acc * alpha + p * V[c]; m = m_new.")
def check_flash_shared_kernel(t, fn):
    from .attention import check_forward

    if not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    for label, d, bq, bk, nq, nk, causal, qs, hint in _attention_case_specs(t):
        Q, K, V = t.normal((nq, d), np.float32, qs), t.normal((nk, d), np.float32), t.normal((nk, d), np.float32)
        t.case(label, hint, Q=(nq, d), K=(nk, d), dtype="float32", causal=causal, block_q=bq, block_k=bk,
               grid=-(-nq // bq))
        kernel = kernel_of(t, fn, d, bq, bk, causal)
        scale = np.float32(1 / math.sqrt(d))

        def run(Kp, Vp, kernel=kernel, Q=Q, bq=bq):
            O = np.full(Q.shape, np.nan, np.float32)
            lse = np.full(Q.shape[0], np.nan, np.float32)
            return tuple(launch(t, kernel, -(-Q.shape[0] // bq), bq, [Q, Kp, Vp, O, lse, scale], [3, 4]))

        check_forward(t, run(K, V), Q, K, V, causal, bq, bk, rerun=run)


