"""Correct answers written differently from the solutions pass their checks.

A learner with a right answer who is told it is wrong is stuck, so every exercise of lessons 01-06 is run
here with at least two correct solutions that differ from the one in course/exercises/: an equivalent
formula, another loop order, exp2 with log2(e) folded in, log-sum-exp instead of subtracting the max.
Each must pass on ten seeds.
"""
import math

import numpy as np
import pytest

from flashlab.grading import EXERCISES, check

SEEDS = range(10)
LOG2E = 1.4426950408889634
ALTERNATIVES = {}  # exercise -> [functions]


def alternative(name):
    def register(fn):
        ALTERNATIVES.setdefault(name, []).append(fn)
        return fn
    return register


def _work(x):
    return np.float64 if x.dtype == np.float64 else np.float32


# -- 01 memory hierarchy -------------------------------------------------------------------------
@alternative("matmul_intensity")
def intensity_per_byte(M, N, K, bytes_per_element):
    elements = M * K + K * N + M * N
    return (2.0 * M * N * K / elements) / bytes_per_element


@alternative("matmul_intensity")
def intensity_in_steps(M, N, K, bytes_per_element):
    flops = 0
    flops += M * N * K  # multiplies
    flops += M * N * K  # adds
    return flops / float(np.dot([M * K, K * N, M * N], [bytes_per_element] * 3))


@alternative("softmax_intensity")
def softmax_per_element(rows, cols, bytes_per_element):
    return 5 / (2 * bytes_per_element)


@alternative("softmax_intensity")
def softmax_counted(rows, cols, bytes_per_element):
    n = rows * cols
    return (n + n + n + n + n) / (n * bytes_per_element + n * bytes_per_element)


@alternative("roofline")
def roofline_by_comparing_times(intensity, peak_flops, bandwidth):
    memory_rate = bandwidth * intensity
    if memory_rate < peak_flops:
        return memory_rate, "memory"
    return peak_flops, "compute"


@alternative("roofline")
def roofline_with_ridge(intensity, peak_flops, bandwidth):
    ridge = peak_flops / bandwidth
    bound = "compute" if intensity >= ridge else "memory"
    return float(np.minimum(peak_flops, intensity * bandwidth)), bound


# -- 02 naive attention --------------------------------------------------------------------------
@alternative("naive_attention")
def naive_logsumexp(Q, K, V, causal=False):
    w = _work(Q)
    S = np.einsum("qd,kd->qk", Q.astype(w), K.astype(w)) * (1 / math.sqrt(Q.shape[-1]))
    if causal:
        S = np.where(np.tri(*S.shape, dtype=bool), S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(S - m).sum(axis=-1, keepdims=True))
    return (np.exp(S - lse) @ V.astype(w)).astype(Q.dtype)


@alternative("naive_attention")
def naive_exp2_row_by_row(Q, K, V, causal=False):
    w = _work(Q)
    Qw, Kw, Vw = Q.astype(w), K.astype(w), V.astype(w)
    c = w(LOG2E / math.sqrt(Q.shape[-1]))  # scale and log2(e) folded into one factor
    O = np.empty((Q.shape[0], V.shape[1]), w)
    for i in range(Q.shape[0]):
        s = (Kw @ Qw[i]) * c
        if causal:
            s[i + 1:] = -np.inf
        p = np.exp2(s - s.max())
        O[i] = p @ Vw / p.sum()
    return O.astype(Q.dtype)


@alternative("naive_hbm_bytes")
def hbm_by_kernel(Nq, Nk, d, bytes_per_element):
    step1 = (Nq * d + Nk * d) + Nq * Nk  # read Q, K; write S
    step2 = Nq * Nk + Nq * Nk  # read S; write P
    step3 = (Nq * Nk + Nk * d) + Nq * d  # read P, V; write O
    return bytes_per_element * (step1 + step2 + step3)


@alternative("naive_hbm_bytes")
def hbm_reads_plus_writes(Nq, Nk, d, bytes_per_element):
    reads = Nq * d + 2 * Nk * d + 2 * Nq * Nk
    writes = 2 * Nq * Nk + Nq * d
    return reads * bytes_per_element + writes * bytes_per_element


@alternative("naive_peak_bytes")
def peak_by_step(B, H, Nq, Nk, d, dv, dtype):
    inputs = Nq * d + Nk * d + Nk * dv
    totals = [inputs + Nq * Nk, inputs + 2 * Nq * Nk, inputs + Nq * Nk + Nq * dv]
    return B * H * np.dtype(dtype).itemsize * max(totals)


@alternative("naive_peak_bytes")
def peak_in_bytes_from_the_start(B, H, Nq, Nk, d, dv, dtype):
    b = np.dtype(dtype).itemsize * B * H
    return b * (Nq * d + Nk * (d + dv)) + b * Nq * Nk + max(b * Nq * Nk, b * Nq * dv)


# -- 03 softmax ----------------------------------------------------------------------------------
@alternative("safe_softmax")
def softmax_logsumexp(x):
    w = x.astype(_work(x))
    m = w.max(axis=-1, keepdims=True)
    lse = m + np.log(np.sum(np.exp(w - m), axis=-1, keepdims=True))
    return np.exp(w - lse).astype(x.dtype)


@alternative("safe_softmax")
def softmax_exp2(x):
    w = x.astype(_work(x))
    c = w.dtype.type(LOG2E)
    e = np.exp2(w * c - (w.max(axis=-1, keepdims=True) * c))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


@alternative("safe_softmax")
def softmax_exp2_in_float64(x):
    w = x.astype(np.float64) * LOG2E
    e = np.exp2(w - np.max(w, axis=-1)[..., None])
    return (e / e.sum(axis=-1)[..., None]).astype(x.dtype)


@alternative("online_softmax_stats")
def online_exp2(x):
    w = _work(x)
    m = np.full(x.shape[:-1], -np.inf, w)  # in log2 units until the end
    l = np.zeros(x.shape[:-1], w)
    for j in range(x.shape[-1]):
        x_j = x[..., j].astype(w) * w(LOG2E)
        m_new = np.maximum(m, x_j)
        l = l * np.exp2(m - m_new) + np.exp2(x_j - m_new)
        m = m_new
    return m / w(LOG2E), l


@alternative("online_softmax_stats")
def online_branching_on_a_copy(x):
    work = x.astype(_work(x))  # one conversion up front, then one sweep over the copy
    m, l = work[..., 0].copy(), np.ones(work.shape[:-1], work.dtype)
    l[np.isneginf(m)] = 0.0
    for j in range(1, work.shape[-1]):
        x_j = work[..., j]
        grows = x_j > m
        with np.errstate(invalid="ignore"):
            l = np.where(grows, l * np.exp(m - x_j) + 1.0, l + np.exp(x_j - m))
        l = np.where(np.isneginf(m) & np.isneginf(x_j), 0.0, l)
        m = np.maximum(m, x_j)
    return m, l


@alternative("online_softmax_stats")
def online_in_chunks(x):
    w = _work(x)
    m = np.full(x.shape[:-1], -np.inf, w)
    l = np.zeros(x.shape[:-1], w)
    for start in range(0, x.shape[-1], 4):  # a block of columns at a time, as FlashAttention takes keys
        block = np.asarray(x[..., start:start + 4], dtype=w)
        m_new = np.maximum(m, block.max(axis=-1))
        safe = np.where(np.isneginf(m_new), 0.0, m_new)
        l = l * np.exp(m - safe) + np.exp(block - safe[..., None]).sum(axis=-1)
        m = m_new
    return m, l


@alternative("merge_softmax_states")
def merge_by_cases(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    low = np.minimum(m_a, m_b)
    l_high = np.where(m_a >= m_b, l_a, l_b)
    l_low = np.where(m_a >= m_b, l_b, l_a)
    with np.errstate(invalid="ignore"):
        factor = np.where(np.isneginf(low), 0.0, np.exp(low - m))
    return m, l_high + l_low * factor


@alternative("merge_softmax_states")
def merge_through_lse(m_a, l_a, m_b, l_b):
    with np.errstate(divide="ignore"):
        lse = np.logaddexp(m_a + np.log(l_a), m_b + np.log(l_b))  # log of the merged, unshifted sum
    m = np.maximum(m_a, m_b)
    with np.errstate(invalid="ignore"):
        l = np.where(np.isneginf(m), 0.0, np.exp(lse - m))
    return m, l


# -- 04 tiling, FA1 ------------------------------------------------------------------------------
@alternative("block_sizes")
def blocks_integer_ceil(M, d):
    block_k = -(-M // (4 * d))
    return min(block_k, d), block_k


@alternative("block_sizes")
def blocks_math_ceil(M, d):
    block_k = int(math.ceil(M / 4 / d))
    return int(min(d, block_k)), block_k


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


# -- 05 FA2 --------------------------------------------------------------------------------------
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


def _fa2(Q, K, V, causal, block_q, block_k, *, base2):
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
    return _fa2(Q, K, V, causal, block_q, block_k, base2=True)


@alternative("fa2_forward")
def fa2_forward_break_when_past(Q, K, V, causal=False, block_q=16, block_k=16):
    return _fa2(Q, K, V, causal, block_q, block_k, base2=False)


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


# -- 06 backward ---------------------------------------------------------------------------------
@alternative("delta")
def delta_einsum(O, dO):
    return np.einsum("ij,ij->i", dO, O)


@alternative("delta")
def delta_diagonal(O, dO):
    return np.diag(dO @ O.T)


@alternative("delta")
def delta_vecdot(O, dO):
    return (dO * O) @ np.ones(O.shape[-1], O.dtype)


def _backward(Q, K, V, O, lse, dO, causal, block_q, block_k, *, D_from, order="keys outside", base2=False):
    dtype, w = Q.dtype, _work(Q)
    Q, K, V, O, lse, dO = (x.astype(w) for x in (Q, K, V, O, lse, dO))
    Nq, Nk = len(Q), len(K)
    scale = w(1 / math.sqrt(Q.shape[1]))
    D = D_from(O, dO)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    tiles = [(q0, k0) for k0 in range(0, Nk, block_k) for q0 in range(0, Nq, block_q)]
    if order == "queries outside":
        tiles.sort()
    for q0, k0 in tiles:
        r, c = slice(q0, q0 + block_q), slice(k0, k0 + block_k)
        if causal and k0 > min(q0 + block_q, Nq) - 1:
            continue
        if base2:
            P = np.exp2(Q[r] @ K[c].T * (scale * w(LOG2E)) - lse[r, None] * w(LOG2E))
        else:
            P = np.exp(Q[r] @ K[c].T * scale - lse[r, None])
        if causal:
            P = np.where(np.arange(k0, k0 + P.shape[1])[None, :] <= np.arange(q0, q0 + P.shape[0])[:, None], P, 0)
        dV[c] += P.T @ dO[r]
        dS = P * (dO[r] @ V[c].T - D[r, None]) * scale  # scale folded into dS once
        dQ[r] += dS @ K[c]
        dK[c] += dS.T @ Q[r]
    return dQ.astype(dtype), dK.astype(dtype), dV.astype(dtype)


_D_FORMS = {"einsum": lambda O, dO: np.einsum("ij,ij->i", dO, O),
            "ones": lambda O, dO: (dO * O) @ np.ones(O.shape[1], O.dtype),
            "diag": lambda O, dO: np.diag(dO @ O.T),
            "vecdot": lambda O, dO: np.sum(O * dO, axis=1, dtype=np.float64).astype(O.dtype)}


@alternative("fa2_backward")
def backward_einsum_D(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16):
    return _backward(Q, K, V, O, lse, dO, causal, block_q, block_k, D_from=_D_FORMS["einsum"])


@alternative("fa2_backward")
def backward_ones_D_queries_outside(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16):
    return _backward(Q, K, V, O, lse, dO, causal, block_q, block_k, D_from=_D_FORMS["ones"], order="queries outside")


@alternative("fa2_backward")
def backward_diag_D_exp2(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16):
    return _backward(Q, K, V, O, lse, dO, causal, block_q, block_k, D_from=_D_FORMS["diag"], base2=True)


@alternative("fa2_backward")
def backward_D_accumulated_in_float64(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16):
    return _backward(Q, K, V, O, lse, dO, causal, block_q, block_k, D_from=_D_FORMS["vecdot"])


@alternative("recompute_tradeoff")
def tradeoff_as_rates(Nq, Nk, d, block_k, bytes_per_element, peak_flops, bandwidth):
    flops = 2 * d * Nq * Nk
    store = Nq * Nk * bytes_per_element * 2
    recompute = 4 * Nq * (1 + -(-Nk // block_k))
    saved = store - recompute
    return flops, saved, flops * bandwidth < saved * peak_flops


@alternative("recompute_tradeoff")
def tradeoff_per_tile(Nq, Nk, d, block_k, bytes_per_element, peak_flops, bandwidth):
    flops = saved = 0
    for k0 in range(0, Nk, block_k):
        keys = min(block_k, Nk - k0)
        flops += 2 * Nq * keys * d
        saved += 2 * Nq * keys * bytes_per_element - 4 * Nq  # P's tile both ways, less the lse read with it
    saved -= 4 * Nq  # the forward writes lse once
    return flops, saved, (flops / peak_flops) < (saved / bandwidth)


# ------------------------------------------------------------------------------------------------
LESSONS = {"01", "02", "03", "04", "05", "06"}
NAMES = sorted(name for name, ex in EXERCISES.items() if ex.lesson[:2] in LESSONS)


def test_every_exercise_has_two_alternatives():
    assert len(NAMES) == 18
    assert {n: len(ALTERNATIVES.get(n, [])) for n in NAMES} == {n: max(2, len(ALTERNATIVES.get(n, []))) for n in NAMES}


@pytest.mark.parametrize("name,fn", [(n, f) for n in sorted(ALTERNATIVES) for f in ALTERNATIVES[n]],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_correct_alternative_passes(name, fn):
    for seed in SEEDS:
        result = check(name, fn, seed=seed, quiet=True)
        assert result.passed, f"{fn.__name__}, seed {seed}:\n{result}"
