"""Every checker accepts the reference solution and rejects plausible wrong solutions ("mutants").

The solutions are the ones in course/exercises/ (the same code the solution notebooks hold). Each mutant
is a mistake a learner could make; each must fail its check, for several random seeds.
"""
import math

import numpy as np
import pytest

from flashlab.grading import EXERCISES, check
from conftest import assert_rejected_naming_its_slip, load_exercise
from test_new_exercises_a import NEW_EXERCISES  # checked in their own file

SEEDS = (1, 2, 3)




# Lessons 01-06; later lessons keep their mutants beside their own tests, and so do the exercises added later.
MINE = sorted(name for name, ex in EXERCISES.items()
              if ex.lesson[:2] in {"01", "02", "03", "04", "05", "06"} and name not in NEW_EXERCISES)
SOLUTIONS = {name: load_exercise(EXERCISES[name].lesson)[name] for name in MINE}
MUTANTS = {}  # exercise name -> [mutant functions]


def mutant(name):
    def register(fn):
        MUTANTS.setdefault(name, []).append(fn)
        return fn
    return register


def _work(x):
    return np.float64 if x.dtype == np.float64 else np.float32


def _causal(S, q0=0, k0=0, offset=0):
    r = np.arange(q0, q0 + S.shape[0])[:, None]
    c = np.arange(k0, k0 + S.shape[1])[None, :]
    return np.where(c <= r + offset, S, -np.inf)


# -- 01 memory hierarchy -------------------------------------------------------------------------
mutant("matmul_intensity")(lambda M, N, K, b: M * N * K / (b * (M * K + K * N + M * N)))  # one FLOP per (i,j,k)
mutant("matmul_intensity")(lambda M, N, K, b: 2 * M * N * K / (b * (M * K + K * N)))  # forgets writing C
mutant("matmul_intensity")(lambda M, N, K, b: 2 * M * N * K / (M * K + K * N + M * N))  # elements, not bytes
mutant("matmul_intensity")(lambda M, N, K, b: 2 * M * N * K / (b * 3 * M * N))  # assumes square matrices

mutant("softmax_intensity")(lambda rows, cols, b: 5 * rows * cols / (b * rows * cols))  # forgets the writes
mutant("softmax_intensity")(lambda rows, cols, b: 5 / (2 * b) * cols)  # grows with the row length
mutant("softmax_intensity")(lambda rows, cols, b: 5 * rows * cols / 2)  # bytes_per_element ignored
mutant("softmax_intensity")(lambda rows, cols, b: 1 / (2 * b))  # one FLOP per element


@mutant("roofline")
def roofline_max(intensity, peak, bw):
    return max(peak, bw * intensity), "memory" if intensity < peak / bw else "compute"


@mutant("roofline")
def roofline_labels_swapped(intensity, peak, bw):
    return min(peak, bw * intensity), "compute" if intensity < peak / bw else "memory"


@mutant("roofline")
def roofline_ridge_inverted(intensity, peak, bw):
    return min(peak, bw * intensity), "memory" if intensity < bw / peak else "compute"


@mutant("roofline")
def roofline_divides(intensity, peak, bw):
    return min(peak, bw / intensity), "memory" if intensity < peak / bw else "compute"


# -- 02 naive attention --------------------------------------------------------------------------
def _naive(Q, K, V, causal, *, scale=True, subtract_max=True, axis=-1, offset=0, bottom_right=False):
    w = _work(Q)
    S = Q.astype(w) @ K.astype(w).T
    if scale:
        S = S / math.sqrt(Q.shape[1])
    if causal:
        S = _causal(S, offset=offset + (K.shape[0] - Q.shape[0] if bottom_right else 0))
    with np.errstate(all="ignore"):
        P = np.exp(S - S.max(axis=axis, keepdims=True)) if subtract_max else np.exp(S)
        P = P / P.sum(axis=axis, keepdims=True)
    return (P @ V.astype(w)).astype(Q.dtype)


mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, scale=False))
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, subtract_max=False))
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, offset=-1))  # hides the diagonal
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, bottom_right=True))
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, axis=0))  # softmax over queries
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, False))  # ignores causal
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal).astype(np.float64))  # dtype

mutant("naive_hbm_bytes")(lambda nq, nk, d, b: b * (nq * d + nk * d + nq * nk + nk * d + nq * nk + nq * d))  # no P
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: b * (3 * nq * d + 4 * nq * nk))  # assumes Nq = Nk
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: b * (nq * d + 2 * nk * d + 2 * nq * nk))  # reads only
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: nq * d + 2 * nk * d + 4 * nq * nk + nq * d)  # elements


# -- 03 softmax ----------------------------------------------------------------------------------
@mutant("safe_softmax")
def softmax_no_max(x):
    e = np.exp(x.astype(_work(x)))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


@mutant("safe_softmax")
def softmax_global_max(x):
    w = x.astype(_work(x))
    e = np.exp(w - w.max())  # one max for the whole array: rows far below it underflow to 0/0
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


@mutant("safe_softmax")
def softmax_wrong_axis(x):
    w = x.astype(_work(x))
    e = np.exp(w - w.max(axis=0, keepdims=True))
    return (e / e.sum(axis=0, keepdims=True)).astype(x.dtype)


@mutant("safe_softmax")
def softmax_in_place(x):
    x -= x.max(axis=-1, keepdims=True)
    e = np.exp(x.astype(_work(x)))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


@mutant("safe_softmax")
def softmax_float16_math(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float64)  # returns float64 for every input


def _online(x, *, rescale=True, invert=False, m0=-np.inf):
    w = x.astype(_work(x))
    m = np.full(x.shape[:-1], m0, w.dtype)
    l = np.zeros(x.shape[:-1], w.dtype)
    for j in range(x.shape[-1]):
        m_new = np.maximum(m, w[..., j])
        factor = (np.exp(m_new - m) if invert else np.exp(m - m_new)) if rescale else 1.0
        l = l * factor + np.exp(w[..., j] - m_new)
        m = m_new
    return m, l


mutant("online_softmax_stats")(lambda x: _online(x, rescale=False))  # forgets to rescale the running sum
mutant("online_softmax_stats")(lambda x: _online(x, invert=True))  # rescales by exp(m_new - m)
mutant("online_softmax_stats")(lambda x: _online(x, m0=0.0))  # starts the max at 0


@mutant("online_softmax_stats")
def online_sum_without_max(x):
    w = x.astype(_work(x))
    return w.max(axis=-1), np.exp(w).sum(axis=-1)


@mutant("merge_softmax_states")
def merge_forgets_b(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return m, l_a * np.exp(m_a - m_safe) + l_b


@mutant("merge_softmax_states")
def merge_no_guard(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)  # NaN once both sides are empty
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)


@mutant("merge_softmax_states")
def merge_inverted(m_a, l_a, m_b, l_b):
    m = np.maximum(m_a, m_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return m, l_a * np.exp(m_safe - m_a) + l_b * np.exp(m_safe - m_b)


@mutant("merge_softmax_states")
def merge_adds_maxima(m_a, l_a, m_b, l_b):
    return m_a + m_b, l_a + l_b


# -- 04 tiling, FA1 ------------------------------------------------------------------------------
mutant("block_sizes")(lambda M, d: (min(M // (4 * d), d), M // (4 * d)))  # floor instead of ceil
mutant("block_sizes")(lambda M, d: (math.ceil(M / (4 * d)), math.ceil(M / (4 * d))))  # block_q not capped at d
mutant("block_sizes")(lambda M, d: (math.ceil(M / (4 * d)), min(math.ceil(M / (4 * d)), d)))  # swapped
mutant("block_sizes")(lambda M, d: (min(math.ceil(M / (4 * d)), d), M / (4 * d)))  # a float


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
mutant("fa1_forward")(lambda *a: _fa1(*a, update=MUTANTS["fa1_update"][0]))


# -- 05 FA2 --------------------------------------------------------------------------------------
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


mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, normalise_each_step=True))
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, skip=False))  # masks, but loads every key block
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, offset=-1))  # causal mask off by one
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, offset=1))
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, drop_tail=True))
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, rescale_O=False))
mutant("fa2_forward")(lambda *a, **k: _fa2(*a, **k, lse_mode="log l"))


# -- 06 backward ---------------------------------------------------------------------------------
mutant("delta")(lambda O, dO: np.sum(dO * O, axis=0))  # sums over rows
mutant("delta")(lambda O, dO: dO * O)  # forgets the sum
mutant("delta")(lambda O, dO: np.mean(dO * O, axis=-1))
mutant("delta")(lambda O, dO: np.sum(dO, axis=-1) * np.sum(O, axis=-1))


def _bwd(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16, *, use_D=True, scale_dK=True, drop_tail=False,
         offset=0, P_from="lse"):
    dtype, w = Q.dtype, _work(Q)
    Q, K, V, O, lse, dO = (x.astype(w) for x in (Q, K, V, O, lse, dO))
    Nq, Nk = Q.shape[0], K.shape[0]
    scale = 1 / math.sqrt(Q.shape[1])
    D = np.sum(dO * O, axis=-1)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for k0 in range(0, Nk // block_k * block_k if drop_tail else Nk, block_k):
        cols = slice(k0, k0 + block_k)
        for q0 in range(0, Nq, block_q):
            rows = slice(q0, q0 + block_q)
            S = Q[rows] @ K[cols].T * scale
            if causal:
                S = _causal(S, q0, k0, offset)
            P = np.exp(S - lse[rows, None]) if P_from == "lse" else np.exp(S) / np.exp(S).sum(-1, keepdims=True)
            dV[cols] += P.T @ dO[rows]
            dP = dO[rows] @ V[cols].T
            dS = P * (dP - D[rows, None]) if use_D else P * dP
            dQ[rows] += scale * dS @ K[cols]
            dK[cols] += (scale if scale_dK else 1.0) * dS.T @ Q[rows]
    return dQ.astype(dtype), dK.astype(dtype), dV.astype(dtype)


mutant("fa2_backward")(lambda *a, **k: _bwd(*a, **k, use_D=False))  # no D term
mutant("fa2_backward")(lambda *a, **k: _bwd(*a, **k, scale_dK=False))
mutant("fa2_backward")(lambda *a, **k: _bwd(*a, **k, drop_tail=True))
mutant("fa2_backward")(lambda *a, **k: _bwd(*a, **k, offset=-1))  # causal mask off by one
mutant("fa2_backward")(lambda *a, **k: _bwd(*a, **k, P_from="block"))  # normalises P within each tile


# ------------------------------------------------------------------------------------------------
def test_every_exercise_has_at_least_three_mutants():
    assert set(MUTANTS) == set(MINE)
    assert all(len(m) >= 3 for m in MUTANTS.values()), {k: len(v) for k, v in MUTANTS.items()}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", MINE)
def test_solution_passes(name, seed):
    result = check(name, SOLUTIONS[name], seed=seed, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", MINE)
def test_mutants_fail(name, seed):
    for i, fn in enumerate(MUTANTS[name]):
        result = check(name, fn, seed=seed, quiet=True)
        assert result.status == "failed", f"mutant {i} of {name} ({fn.__name__}) was not rejected:\n{result}"
        assert result.message


@pytest.mark.parametrize("name", MINE)
def test_blank_is_not_implemented(name):
    blank = load_exercise(EXERCISES[name].lesson, keep=False)[name]
    assert check(name, blank, seed=0, quiet=True).status == "not implemented"


# -- wrong answers the checkers once accepted, and slips whose verdict must name them -----------------
NAMED = []  # (exercise, kept wrong solution, words its verdict must contain)


def named(name, says):
    def register(fn):
        NAMED.append((name, fn, says))
        return fn
    return register


@named("roofline", "at the ridge point itself")
def roofline_memory_at_the_ridge(intensity, peak, bw):
    return min(peak, bw * intensity), "memory" if intensity <= peak / bw else "compute"


@named("online_softmax_stats", "read x a second time")
def online_two_passes(x):
    w = x.astype(_work(x))
    m = w.max(axis=-1)
    return m, np.exp(w - m[..., None]).sum(axis=-1)


@named("online_softmax_stats", "read x a second time")
def online_two_loops(x):
    w = _work(x)
    m = np.full(x.shape[:-1], -np.inf, w)
    for j in range(x.shape[-1]):
        m = np.maximum(m, x[..., j].astype(w))
    safe = np.where(np.isneginf(m), 0.0, m)
    l = np.zeros(x.shape[:-1], w)
    for j in range(x.shape[-1]):  # a second sweep along each row
        l = l + np.exp(x[..., j].astype(w) - safe)
    return m, l


@named("naive_attention", "float16 keeps about 3 decimal digits")
def naive_in_float16(Q, K, V, causal=False):
    S = Q @ K.T / Q.dtype.type(math.sqrt(Q.shape[1]))  # every step in the inputs' dtype
    if causal:
        S = _causal(S)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    return (P / P.sum(axis=-1, keepdims=True)) @ V


@named("naive_attention", "promoted to float64")
def naive_numpy_scalar_promotes(Q, K, V, causal=False):
    w = _work(Q)
    S = Q.astype(w) @ K.astype(w).T / np.sqrt(Q.shape[1])  # np.sqrt of an int is an np.float64
    if causal:
        S = _causal(S)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    return (P / P.sum(axis=-1, keepdims=True)) @ V.astype(w)


named("fa2_backward", "without D")(lambda *a, **k: _bwd(*a, **k, use_D=False))
named("fa2_backward", "dK is missing the softmax scale")(lambda *a, **k: _bwd(*a, **k, scale_dK=False))
named("fa2_backward", "last key block")(lambda *a, **k: _bwd(*a, **k, drop_tail=True))
named("fa2_backward", "hides the diagonal")(lambda *a, **k: _bwd(*a, **k, offset=-1))
named("fa2_backward", "normalised within each tile")(lambda *a, **k: _bwd(*a, **k, P_from="block"))
named("fa2_forward", "not rescaled")(lambda *a, **k: _fa2(*a, **k, rescale_O=False))
named("fa2_forward", "divided by l_i after every key block")(lambda *a, **k: _fa2(*a, **k, normalise_each_step=True))
named("fa2_forward", "last key block")(lambda *a, **k: _fa2(*a, **k, drop_tail=True))
named("fa2_forward", "keys after the last query")(lambda *a, **k: _fa2(*a, **k, skip=False))
named("naive_attention", "missing the scale")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, scale=False))
named("naive_attention", "wrong axis")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, axis=0))
named("naive_attention", "bottom-right")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, bottom_right=True))
named("online_softmax_stats", "start from m = -inf")(lambda x: _online(x, m0=0.0))
named("online_softmax_stats", "exp(m_old - m_new), at most 1")(lambda x: _online(x, invert=True))


@pytest.mark.parametrize("name,fn,says", NAMED, ids=[f"{n}-{s}" for n, _, s in NAMED])
def test_named_slip(name, fn, says):
    assert_rejected_naming_its_slip(name, fn, getattr(fn, "__name__", "?"), says, SEEDS)


def test_backward_huge_logits_hint_is_about_the_backward():
    """A wrong backward that fails on huge logits is not told that exp() overflows: it cannot, with lse."""
    def wrong_only_when_one_hot(Q, K, V, O, lse, dO, causal=False, block_q=16, block_k=16):
        dQ, dK, dV = SOLUTIONS["fa2_backward"](Q, K, V, O, lse, dO, causal, block_q, block_k)
        if np.abs(Q).max() > 50:  # the huge-logits cases only
            dQ = dQ + 1e-3 * np.abs(Q).max()
        return dQ, dK, dV
    result = check("fa2_backward", wrong_only_when_one_hot, seed=0, quiet=True)
    assert result.status == "failed" and "huge" in result.case, result
    assert "overflow" not in str(result) and "cannot overflow" not in (result.hint or "")
