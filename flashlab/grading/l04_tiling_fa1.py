"""Lesson 04, tiling and FlashAttention-1: block sizes from the SRAM budget, one FA1 step, the FA1 loops."""
from __future__ import annotations

import numpy as np

from ..iomodel import default_block_sizes
from ..softmax import safe_softmax
from .attention import attention_cases, check_forward
from .core import exercise

LESSON = "04_tiling_fa1"
EMPTY = ("A row that has seen no key yet has m = -inf, l = 0, O = 0, and a block can hide all of a row's "
         "keys (scores -inf). Keep exp() away from -inf - (-inf), which is NaN.")


def check_integers(t, out, want, names):
    if not isinstance(out, tuple) or len(out) != len(want):
        raise t.fail(f"return a tuple ({', '.join(names)}); got {out!r:.80}")
    for name, o, w in zip(names, out, want):
        if isinstance(o, (bool, np.bool_)) or not isinstance(o, (int, np.integer)):
            raise t.fail(f"{name} should be an int; got {type(o).__name__} {o!r:.40}")
        if o != w:
            raise t.fail(f"{name} is {o}; expected {w}")


@exercise("block_sizes", lesson=LESSON,
          hint="Four d-wide tiles (Q_i, K_j, V_j, O_i) share the M elements of SRAM; block_q is also capped "
               "at d (arXiv 2205.14135, Algorithm 1). Round so that the budget is used, not exceeded by much.")
def check_block_sizes(t, fn):
    cases = [("the example", 16384, 64), ("d = 128", 16384, 128), ("a larger SRAM", 100000, 64),
             ("M not a multiple of 4d", 1000, 24), ("tiny d", 4096, 1)]
    cases += [("random", int(t.rng.integers(16, 10**6)), int(t.rng.integers(1, 512))) for _ in range(6)]
    for label, M, d in cases:
        t.case(label, M=M, d=d)
        check_integers(t, t.call(M, d), default_block_sizes(d, M), ("block_q", "block_k"))


def _scores(t, rows, cols, shift, masked):
    S = t.normal((rows, cols), scale=3, shift=shift)
    if masked:
        S[t.rng.random(S.shape) < 0.3] = -np.inf
        S[:: 3] = -np.inf  # every third row sees none of these keys
    return S


def _stats(S, V):
    """Definition-level (m, l, O = softmax(S) V) of the score rows S, an empty row giving (-inf, 0, 0)."""
    if S.shape[1] == 0:
        return np.full(len(S), -np.inf), np.zeros(len(S)), np.zeros((len(S), V.shape[1]))
    m = S.max(axis=-1)
    seen = np.isfinite(m)
    l = np.where(seen, np.exp(S - np.where(seen, m, 0)[:, None]).sum(axis=-1), 0.0)
    P = safe_softmax(np.where(seen[:, None], S, 0.0))
    return m, l, np.where(seen[:, None], P @ V, 0.0)


@exercise("fa1_update", lesson=LESSON,
          hint="Three updates: the new max; the old sum rescaled by exp(m_i - m_new) plus the new block's "
               "sum; and O_i, which is normalised, so undo its old 1/l_i before adding P V_j and dividing by l_new.")
def check_fa1_update(t, fn):
    # label, rows, keys seen so far, keys in this block, dv, shift of the new scores, masked, dtype, hint
    specs = [("small", 2, 3, 3, 2, 0, False, np.float64, None),
             ("random sizes", *t.rng.integers(1, 12, 4), 0, False, np.float64, None),
             ("the first block (nothing seen yet)", 4, 0, 5, 3, 0, False, np.float64, EMPTY),
             ("the new block raises the max a lot", 5, 6, 4, 3, 30, False, np.float64,
              "When the max grows, both l_i and O_i were computed relative to the old max."),
             ("the new block is far below the max", 5, 6, 4, 3, -30, False, np.float64, None),
             ("huge scores (~1e4)", 3, 4, 4, 2, 1e4, False, np.float64,
              "Scores near 1e4 overflow exp(): take exponents relative to the (new) max."),
             ("masked scores (-inf)", 9, 5, 6, 3, 0, True, np.float64, EMPTY),
             ("float32", 6, 7, 8, 4, 0, False, np.float32, None)]
    for label, rows, seen, cols, dv, shift, masked, dtype, hint in specs:
        rows, seen, cols, dv = int(rows), int(seen), int(cols), int(dv)
        S_prev = _scores(t, rows, seen, shift if label.startswith("huge") else 0, masked)
        S_ij = _scores(t, rows, cols, shift, masked)
        V_prev, V_j = t.normal((seen, dv)), t.normal((cols, dv))
        if masked and seen:
            S_prev[::6] = -np.inf  # some rows have seen nothing so far, and see nothing here either
        m_i, l_i, O_i = _stats(S_prev, V_prev)
        m_ref, l_ref, O_ref = _stats(np.concatenate([S_prev, S_ij], 1), np.concatenate([V_prev, V_j]))
        args = [a.astype(dtype) for a in (O_i, l_i, m_i, S_ij, V_j)]
        t.case(label, hint, rows=rows, keys_seen=seen, block_keys=cols, dv=dv, dtype=np.dtype(dtype).name)
        out = t.call(*args)
        if not isinstance(out, tuple) or len(out) != 3:
            raise t.fail(f"return a tuple (O_new, l_new, m_new); got {type(out).__name__}")
        t.compare(out[2], m_ref, "m_new", min_dtype=dtype)
        t.compare(out[1], l_ref, "l_new", min_dtype=dtype)
        t.compare(out[0], O_ref, "O_new", min_dtype=dtype)


@exercise("fa1_forward", lesson=LESSON, time_limit=30,
          hint="If your fa1_update passes its own check, look at the loops around it: which blocks are visited, "
               "which rows and keys each slice holds (the last block is shorter), and how lse is formed at the end.")
def check_fa1_forward(t, fn):
    for Q, K, V, _, bq, bk in attention_cases(t):
        out = t.call(Q, K, V, bq, bk)
        check_forward(t, out, Q, K, V, False, bq, bk, rerun=lambda Kp, Vp: t.call(Q, Kp, Vp, bq, bk))
