"""Lesson 05's exercises (FlashAttention-2: the key blocks to visit, the forward, the work of its grid): each
checker passes the solution and correct answers written differently, grades the blank "not implemented",
and rejects kept wrong solutions, naming the slip where the test gives words. The FLOP count behind the
work checker is checked against flashlab's instrumented forward."""
import math

import numpy as np
import pytest

from conftest import load_exercise
from exercise_harness import _causal, _work, Lesson, LOG2E

LESSON = Lesson("05_fa2", min_alternatives=2)
mutant, alternative = LESSON.mutant, LESSON.alternative
SOLUTIONS = load_exercise(LESSON.stem)


# -- kv_blocks_to_visit ------------------------------------------------------------------------------
def _visit(i, nq, nk, bq, bk, causal, *, first_row=False, ignore_tail=False, off_by_one=False):
    n = math.ceil(nk / bk)
    if not causal:
        return n
    last = i * bq if first_row else (i + 1) * bq - 1 if ignore_tail else min((i + 1) * bq, nq) - 1
    return min(n, last // bk + (0 if off_by_one else 1))


mutant("kv_blocks_to_visit")(lambda *a: _visit(*a, first_row=True))
mutant("kv_blocks_to_visit")(lambda *a: _visit(*a, ignore_tail=True))  # forgets the ragged last query block
mutant("kv_blocks_to_visit")(lambda *a: _visit(*a, off_by_one=True))
mutant("kv_blocks_to_visit")(lambda i, nq, nk, bq, bk, causal: _visit(i, nq, nk, bq, bk, True))  # always causal


@alternative("kv_blocks_to_visit")
def visit_by_scanning(i, Nq, Nk, block_q, block_k, causal):
    n = 0
    last_row = min((i + 1) * block_q, Nq) - 1
    for k0 in range(0, Nk, block_k):
        if causal and k0 > last_row:
            break
        n += 1
    return n


@alternative("kv_blocks_to_visit")
def visit_by_ceil(i, Nq, Nk, block_q, block_k, causal):
    blocks = math.ceil(Nk / block_k)
    if not causal:
        return blocks
    keys_seen = min((i + 1) * block_q, Nq)  # the block's last row sees keys 0 .. keys_seen - 1
    return int(min(blocks, math.ceil(keys_seen / block_k)))


# -- fa2_forward -------------------------------------------------------------------------------------
def _fa2(Q, K, V, causal=False, block_q=16, block_k=16, *, normalise_each_step=False, skip=True, offset=0,
         drop_tail=False, rescale_O=True, lse_mode="m+log l"):
    w = _work(Q)
    Nq, Nk, dv = Q.shape[0], K.shape[0], V.shape[1]
    O, lse = np.empty((Nq, dv), Q.dtype), np.empty(Nq, w)
    for i, q0 in enumerate(range(0, Nq, block_q)):
        Q_i = Q[q0:q0 + block_q].astype(w)
        r = len(Q_i)
        O_i, l_i, m_i = np.zeros((r, dv), w), np.zeros(r, w), np.full(r, -np.inf, w)
        n = SOLUTIONS["kv_blocks_to_visit"](i, Nq, Nk, block_q, block_k, causal and skip)
        if drop_tail:
            n = min(n, Nk // block_k)
        for j in range(n):
            k0 = j * block_k
            K_j, V_j = K[k0:k0 + block_k].astype(w), V[k0:k0 + block_k].astype(w)
            S = Q_i @ K_j.T / math.sqrt(Q.shape[1])
            if causal:
                S = _causal(S, q0, k0, offset)
            m_new = np.maximum(m_i, S.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            P = np.exp(S - m_safe[:, None])
            alpha = np.exp(m_i - m_safe)
            l_new = alpha * l_i + P.sum(axis=-1)
            if normalise_each_step:  # divides every step, but rescales the old O_i by alpha only
                O_i = (alpha[:, None] * O_i + P @ V_j) / np.where(l_new > 0, l_new, 1)[:, None]
            else:
                O_i = (alpha[:, None] if rescale_O else 1.0) * O_i + P @ V_j
            l_i, m_i = l_new, m_new
        O[q0:q0 + r] = O_i if normalise_each_step else O_i / l_i[:, None]
        lse[q0:q0 + r] = m_i + np.log(l_i) if lse_mode == "m+log l" else np.log(l_i)
    return O, lse


mutant("fa2_forward", "divided by l_i after every key block")(lambda *a, **k: _fa2(*a, **k, normalise_each_step=True))
mutant("fa2_forward", "keys after the last query")(
    lambda *a, **k: _fa2(*a, **k, skip=False))  # masks, but loads every key block
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, offset=-1))  # causal mask off by one
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, offset=1))
mutant("fa2_forward", "last key block")(lambda *a, **k: _fa2(*a, **k, drop_tail=True))
mutant("fa2_forward", "not rescaled")(lambda *a, **k: _fa2(*a, **k, rescale_O=False))
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, lse_mode="log l"))


def _fa2_alternative(Q, K, V, causal, block_q, block_k, *, base2):
    w = _work(Q)
    Nq, Nk, dv = Q.shape[0], K.shape[0], V.shape[1]
    c = w((LOG2E if base2 else 1.0) / math.sqrt(Q.shape[1]))
    exp = np.exp2 if base2 else np.exp
    O, lse = np.empty((Nq, dv), Q.dtype), np.empty(Nq, w)
    for q0 in range(0, Nq, block_q):
        Q_i = Q[q0:q0 + block_q].astype(w)
        rows = np.arange(q0, q0 + len(Q_i))
        acc, l, m = np.zeros((len(Q_i), dv), w), np.zeros(len(Q_i), w), np.full(len(Q_i), -np.inf, w)
        for k0 in range(0, Nk, block_k):
            if causal and k0 > rows[-1]:
                break
            K_j, V_j = K[k0:k0 + block_k].astype(w), V[k0:k0 + block_k].astype(w)
            S = (Q_i @ K_j.T) * c
            if causal:
                S[np.arange(k0, k0 + len(K_j))[None, :] > rows[:, None]] = -np.inf
            m_new = np.fmax(m, S.max(axis=1))
            P = exp(S - m_new[:, None])
            alpha = exp(m - m_new)
            acc = acc * alpha[:, None] + P @ V_j
            l = l * alpha + P.sum(axis=1)
            m = m_new
        O[q0:q0 + len(Q_i)] = (acc / l[:, None]).astype(Q.dtype)
        lse[q0:q0 + len(Q_i)] = (m / LOG2E if base2 else m) + np.log(l)
    return O, lse


@alternative("fa2_forward")
def fa2_forward_exp2(Q, K, V, causal=False, block_q=16, block_k=16):
    return _fa2_alternative(Q, K, V, causal, block_q, block_k, base2=True)


@alternative("fa2_forward")
def fa2_forward_break_when_past(Q, K, V, causal=False, block_q=16, block_k=16):
    return _fa2_alternative(Q, K, V, causal, block_q, block_k, base2=False)


# -- fa2_work: the work of FA2's grid ----------------------------------------------------------------
def _visits(i, Nq, Nk, bq, bk, causal):
    n = math.ceil(Nk / bk)
    return min(n, (min((i + 1) * bq, Nq) - 1) // bk + 1) if causal else n


def _grid_work(B, H, Nq, Nk, d, bq, bk, causal, *, full_rows=False, padded_keys=False, skip=True, matmuls=2):
    tr = math.ceil(Nq / bq)
    flops = 0
    for i in range(tr):
        rows = bq if full_rows else min((i + 1) * bq, Nq) - i * bq
        keys = _visits(i, Nq, Nk, bq, bk, causal and skip) * bk
        flops += 2 * matmuls * d * rows * (keys if padded_keys else min(keys, Nk))
    return B * H * tr, B * H * flops


@mutant("fa2_work", "FA1's grid")
def work_fa1_grid(B, H, Nq, Nk, d, bq, bk, causal):
    """one thread block per (batch, head)"""
    return B * H, _grid_work(B, H, Nq, Nk, d, bq, bk, causal)[1]


@mutant("fa2_work", "half of the full count")
def work_ideal_half(B, H, Nq, Nk, d, bq, bk, causal):
    """the benchmark convention: causal is half the full work"""
    return B * H * math.ceil(Nq / bq), 4 * B * H * Nq * Nk * d // (2 if causal else 1)


@mutant("fa2_work", "only the scores the mask keeps")
def work_exact_mask(B, H, Nq, Nk, d, bq, bk, causal):
    """counts only unmasked scores"""
    keys = sum(min(r + 1, Nk) for r in range(Nq)) if causal else Nq * Nk
    return B * H * math.ceil(Nq / bq), 4 * B * H * d * keys


@mutant("fa2_work", "counts one matmul")
def work_one_matmul(B, H, Nq, Nk, d, bq, bk, causal):
    """forgets P V"""
    return _grid_work(B, H, Nq, Nk, d, bq, bk, causal, matmuls=1)


@mutant("fa2_work", "last query block")
def work_full_rows(B, H, Nq, Nk, d, bq, bk, causal):
    """the last query block counted as full"""
    return _grid_work(B, H, Nq, Nk, d, bq, bk, causal, full_rows=True)


@mutant("fa2_work", "last key block")
def work_padded_keys(B, H, Nq, Nk, d, bq, bk, causal):
    """the last key block counted as full"""
    return _grid_work(B, H, Nq, Nk, d, bq, bk, causal, padded_keys=True)


@mutant("fa2_work", "skips the key blocks")
def work_no_skipping(B, H, Nq, Nk, d, bq, bk, causal):
    """no causal block skipping"""
    return _grid_work(B, H, Nq, Nk, d, bq, bk, causal, skip=False)


@alternative("fa2_work")
def work_loop_over_tiles(B, H, Nq, Nk, d, block_q, block_k, causal):
    blocks = 0
    flops = 0
    for q0 in range(0, Nq, block_q):
        rows = min(block_q, Nq - q0)
        blocks += 1
        for k0 in range(0, Nk, block_k):
            if causal and k0 > q0 + rows - 1:
                break
            flops += 2 * 2 * d * rows * min(block_k, Nk - k0)
    return B * H * blocks, B * H * flops


@alternative("fa2_work")
def work_by_visited_keys(B, H, Nq, Nk, d, block_q, block_k, causal):
    tr = -(-Nq // block_q)
    total = 0
    for i in range(tr):
        last = min((i + 1) * block_q, Nq)
        keys = Nk if not causal else min(Nk, -(-last // block_k) * block_k)
        total += (last - i * block_q) * keys
    return B * H * tr, 4 * d * total * B * H


globals().update(LESSON.standard_tests())


@pytest.mark.parametrize("nq,nk,bq,bk,causal", [(37, 37, 8, 8, True), (37, 20, 8, 6, True), (13, 40, 4, 16, False),
                                                (50, 50, 16, 4, True), (9, 9, 32, 32, True)])
def test_fa2_flop_count_matches_the_instrumented_forward(nq, nk, bq, bk, causal):
    from flashlab import HBMModel, flash_attention_v2
    from flashlab.grading.l05_fa2 import fa2_matmul_flops

    rng = np.random.default_rng(nq * nk + bq)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (nq, nk, nk))
    io = HBMModel(M=None)
    flash_attention_v2(q, k, v, causal=causal, block_q=bq, block_k=bk, io=io)
    assert io.matmul_flops == 2 * 3 * fa2_matmul_flops(nq, nk, 8, bq, bk, causal)
