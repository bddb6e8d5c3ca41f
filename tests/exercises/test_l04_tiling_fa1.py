"""Lesson 04's exercises (block sizes, FlashAttention-1's update and forward): each checker passes the solution
and correct answers written differently, grades the blank "not implemented", and rejects kept wrong
solutions."""
import math

import numpy as np

from conftest import load_exercise
from exercise_harness import _work, Lesson

LESSON = Lesson("04_tiling_fa1", min_alternatives=2)
mutant, alternative = LESSON.mutant, LESSON.alternative
SOLUTIONS = load_exercise(LESSON.stem)


# -- block_sizes -------------------------------------------------------------------------------------
mutant("block_sizes")(lambda M, d: (min(M // (4 * d), d), M // (4 * d)))  # floor instead of ceil
mutant("block_sizes")(lambda M, d: (math.ceil(M / (4 * d)), math.ceil(M / (4 * d))))  # block_q not capped at d
mutant("block_sizes")(lambda M, d: (math.ceil(M / (4 * d)), min(math.ceil(M / (4 * d)), d)))  # swapped
mutant("block_sizes")(lambda M, d: (min(math.ceil(M / (4 * d)), d), M / (4 * d)))  # a float


@alternative("block_sizes")
def blocks_integer_ceil(M, d):
    block_k = -(-M // (4 * d))
    return min(block_k, d), block_k


@alternative("block_sizes")
def blocks_math_ceil(M, d):
    block_k = int(math.ceil(M / 4 / d))
    return int(min(d, block_k)), block_k


# -- fa1_update --------------------------------------------------------------------------------------
def _fa1_update(O_i, l_i, m_i, S_ij, V_j, *, undo_norm=True, guard=True, alpha_on_l=True, old_denominator=False):
    m_new = np.maximum(m_i, S_ij.max(axis=-1))
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
    P = np.exp(S_ij - m_safe[:, None])
    alpha = np.exp(m_i - m_safe)
    l_new = (alpha if alpha_on_l else 1.0) * l_i + P.sum(axis=-1)
    denom = np.where(l_new > 0, l_new, 1.0)
    if old_denominator:
        denom = np.where(l_i > 0, l_i, 1.0)
    O_old = (l_i * alpha)[:, None] * O_i if undo_norm else alpha[:, None] * O_i
    return (O_old + P @ V_j) / denom[:, None], l_new, m_new


mutant("fa1_update")(lambda *a: _fa1_update(*a, undo_norm=False))  # forgets that O_i was normalised
mutant("fa1_update")(lambda *a: _fa1_update(*a, guard=False))  # NaN for rows that have seen nothing
mutant("fa1_update")(lambda *a: _fa1_update(*a, alpha_on_l=False))  # l not rescaled
mutant("fa1_update")(lambda *a: _fa1_update(*a, old_denominator=True))  # divides by the old l


@alternative("fa1_update")
def fa1_update_unnormalised(O_i, l_i, m_i, S_ij, V_j):
    m_new = np.maximum(m_i, S_ij.max(axis=-1, initial=-np.inf))
    safe = np.where(np.isfinite(m_new), m_new, 0.0)
    P = np.exp(S_ij - safe[:, None])
    l_old = l_i * np.exp(m_i - safe)
    l_new = l_old + P.sum(axis=-1)
    numerator = O_i * l_old[:, None] + P @ V_j  # back to the unnormalised sum, then divide once
    with np.errstate(invalid="ignore", divide="ignore"):
        O_new = np.where(l_new[:, None] > 0, numerator / l_new[:, None], 0.0)
    return O_new.astype(O_i.dtype), l_new, m_new


@alternative("fa1_update")
def fa1_update_weights(O_i, l_i, m_i, S_ij, V_j):
    m_block = S_ij.max(axis=-1, initial=-np.inf)
    m_new = np.maximum(m_i, m_block)
    out_O, out_l = np.zeros_like(O_i), np.zeros_like(l_i)
    for r in range(len(m_new)):  # one row at a time
        if np.isneginf(m_new[r]):
            continue
        old = l_i[r] * math.exp(m_i[r] - m_new[r])
        p = np.exp(S_ij[r] - m_new[r])
        out_l[r] = old + p.sum()
        out_O[r] = (old / out_l[r]) * O_i[r] + (p @ V_j) / out_l[r]
    return out_O, out_l, m_new


# -- fa1_forward -------------------------------------------------------------------------------------
def _fa1(Q, K, V, block_q, block_k, *, drop_tail=False, scale=True, lse_mode="m+log l", update=None):
    w = _work(Q)
    Nq, Nk, dv = Q.shape[0], K.shape[0], V.shape[1]
    O, l, m = np.zeros((Nq, dv), w), np.zeros(Nq, w), np.full(Nq, -np.inf, w)
    k_end = Nk // block_k * block_k if drop_tail else Nk
    for k0 in range(0, k_end, block_k):
        K_j, V_j = K[k0:k0 + block_k].astype(w), V[k0:k0 + block_k].astype(w)
        for q0 in range(0, Nq, block_q):
            rows = slice(q0, q0 + block_q)
            S = Q[rows].astype(w) @ K_j.T * (1 / math.sqrt(Q.shape[1]) if scale else 1.0)
            O[rows], l[rows], m[rows] = (update or SOLUTIONS["fa1_update"])(O[rows], l[rows], m[rows], S, V_j)
    lse = {"m+log l": m + np.log(l), "log l": np.log(l), "m": m}[lse_mode]
    return O.astype(Q.dtype), lse


mutant("fa1_forward")(lambda *a: _fa1(*a, drop_tail=True))  # drops the last partial key block
mutant("fa1_forward")(lambda *a: _fa1(*a, scale=False))
mutant("fa1_forward")(lambda *a: _fa1(*a, lse_mode="log l"))
mutant("fa1_forward")(lambda *a: _fa1(*a, lse_mode="m"))
mutant("fa1_forward")(lambda *a: _fa1(*a, update=LESSON.mutants["fa1_update"][0].fn))


def _fa1_forward(Q, K, V, block_q, block_k, update):
    w = _work(Q)
    Nq, dv = Q.shape[0], V.shape[1]
    O, l, m = np.zeros((Nq, dv), w), np.zeros(Nq, w), np.full(Nq, -np.inf, w)
    for k0 in range(0, K.shape[0], block_k):
        K_j, V_j = K[k0:k0 + block_k].astype(w), V[k0:k0 + block_k].astype(w)
        for q0 in range(0, Nq, block_q):
            r = slice(q0, q0 + block_q)
            S = (Q[r].astype(w) / w(math.sqrt(Q.shape[1]))) @ K_j.T
            O[r], l[r], m[r] = update(O[r], l[r], m[r], S, V_j)
    return O.astype(Q.dtype), m + np.log(l)


@alternative("fa1_forward")
def fa1_forward_alt_update(Q, K, V, block_q, block_k):
    return _fa1_forward(Q, K, V, block_q, block_k, fa1_update_unnormalised)


@alternative("fa1_forward")
def fa1_forward_log_of_sum(Q, K, V, block_q, block_k):
    O, lse = _fa1_forward(Q, K, V, block_q, block_k, fa1_update_weights)
    return O, lse


globals().update(LESSON.standard_tests())
