"""Lesson 06's exercises (D, FlashAttention-2's backward, recompute or store): each checker passes the solution
and correct answers written differently, grades the blank "not implemented", and rejects kept wrong
solutions, naming the slip where the test gives words. The lse traffic of the trade-off checker is checked
against flashlab's instrumented forward and backward."""
import math

import numpy as np
import pytest

from conftest import load_exercise
from exercise_harness import _causal, _work, Lesson, LOG2E
from flashlab.grading import check

LESSON = Lesson("06_backward", min_alternatives=2)
mutant, alternative = LESSON.mutant, LESSON.alternative
SOLUTIONS = load_exercise(LESSON.stem)


# -- delta -------------------------------------------------------------------------------------------
mutant("delta")(lambda O, dO: np.sum(dO * O, axis=0))  # sums over rows
mutant("delta")(lambda O, dO: dO * O)  # forgets the sum
mutant("delta")(lambda O, dO: np.mean(dO * O, axis=-1))
mutant("delta")(lambda O, dO: np.sum(dO, axis=-1) * np.sum(O, axis=-1))


@alternative("delta")
def delta_einsum(O, dO):
    return np.einsum("ij,ij->i", dO, O)


@alternative("delta")
def delta_diagonal(O, dO):
    return np.diag(dO @ O.T)


@alternative("delta")
def delta_vecdot(O, dO):
    return (dO * O) @ np.ones(O.shape[-1], O.dtype)


# -- fa2_backward ------------------------------------------------------------------------------------
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


mutant("fa2_backward", "without D")(lambda *a, **k: _bwd(*a, **k, use_D=False))  # no D term
mutant("fa2_backward", "dK is missing the softmax scale")(lambda *a, **k: _bwd(*a, **k, scale_dK=False))
mutant("fa2_backward", "last key block")(lambda *a, **k: _bwd(*a, **k, drop_tail=True))
mutant("fa2_backward", "hides the diagonal")(lambda *a, **k: _bwd(*a, **k, offset=-1))  # causal mask off by one
mutant("fa2_backward", "normalised within each tile")(
    lambda *a, **k: _bwd(*a, **k, P_from="block"))  # normalises P within each tile


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


# -- recompute_tradeoff: recompute or store ----------------------------------------------------------
def _tradeoff(Nq, Nk, d, bk, b, peak, bw, *, p_moves=2, lse_reads=None, lse_bytes=4, matmuls=1, flop_per_fma=2,
              reverse=False):
    flops = flop_per_fma * matmuls * Nq * Nk * d
    reads = math.ceil(Nk / bk) if lse_reads is None else lse_reads
    saved = p_moves * Nq * Nk * b - lse_bytes * (Nq + reads * Nq)
    wins = flops / peak < saved / bw
    return flops, saved, (not wins) if reverse else wins


@mutant("recompute_tradeoff", "reads P twice")
def trade_p_read_twice(Nq, Nk, d, bk, b, peak, bw):
    """P read twice, as in the unfused backward"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, p_moves=3)


@mutant("recompute_tradeoff", "its write in the forward")
def trade_no_p_write(Nq, Nk, d, bk, b, peak, bw):
    """storing P costs only its read"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, p_moves=1)


@mutant("recompute_tradeoff", "moves lse instead")
def trade_no_lse(Nq, Nk, d, bk, b, peak, bw):
    """lse traffic forgotten"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, lse_bytes=0)


@mutant("recompute_tradeoff", "once per key block")
def trade_lse_read_once(Nq, Nk, d, bk, b, peak, bw):
    """lse read once, not with every tile"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, lse_reads=1)


@mutant("recompute_tradeoff", "float32 (4 bytes)")
def trade_lse_input_dtype(Nq, Nk, d, bk, b, peak, bw):
    """lse in the inputs' dtype"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, lse_bytes=b)


@mutant("recompute_tradeoff", "two products")
def trade_two_matmuls(Nq, Nk, d, bk, b, peak, bw):
    """counts the forward's two products"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, matmuls=2)


@mutant("recompute_tradeoff", "multiply-add is 2 FLOPs")
def trade_one_flop_per_fma(Nq, Nk, d, bk, b, peak, bw):
    """one FLOP per multiply-add"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, flop_per_fma=1)


@mutant("recompute_tradeoff", "recompute_wins is")
def trade_reversed(Nq, Nk, d, bk, b, peak, bw):
    """the comparison the wrong way round"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, reverse=True)


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


globals().update(LESSON.standard_tests())


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


@pytest.mark.parametrize("nq,nk,bk", [(24, 40, 16), (7, 33, 8), (16, 16, 64)])
def test_lse_traffic_of_the_tradeoff_matches_the_instrumented_backward(nq, nk, bk):
    from flashlab import HBMModel, flash_attention_v2, flash_attention_v2_backward
    from flashlab.grading.l06_backward import recompute_tradeoff

    rng = np.random.default_rng(nq + nk)
    q, k, v, do = (rng.standard_normal((n, 8)) for n in (nq, nk, nk, nq))
    fwd, bwd = HBMModel(M=None), HBMModel(M=None)
    o, lse = flash_attention_v2(q, k, v, block_q=8, block_k=bk, io=fwd)
    flash_attention_v2_backward(q, k, v, o, lse, do, block_q=8, block_k=bk, io=bwd)
    lse_elements = fwd.writes["lse"] + bwd.reads["lse"]
    _, saved, _ = recompute_tradeoff(nq, nk, 8, bk, 2, 1e12, 1e12)
    assert saved == 2 * nq * nk * 2 - 4 * lse_elements
