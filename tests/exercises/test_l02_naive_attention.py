"""Lesson 02's exercises (naive attention, its HBM traffic and peak memory): each checker passes the solution
and correct answers written differently, grades the blank "not implemented", and rejects kept wrong
solutions, naming the slip where the test gives words. The peak-memory model is checked against a walk over
what the three kernels allocate."""
import math

import numpy as np

from exercise_harness import _causal, _work, Lesson, LOG2E

LESSON = Lesson("02_naive_attention", min_alternatives=2)
mutant, alternative = LESSON.mutant, LESSON.alternative


# -- naive_attention ---------------------------------------------------------------------------------
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


mutant("naive_attention", "missing the scale")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, scale=False))
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, subtract_max=False))
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal, offset=-1))  # hides the diagonal
mutant("naive_attention", "bottom-right")(
    lambda Q, K, V, causal=False: _naive(Q, K, V, causal, bottom_right=True))
mutant("naive_attention", "wrong axis")(
    lambda Q, K, V, causal=False: _naive(Q, K, V, causal, axis=0))  # softmax over queries
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, False))  # ignores causal
mutant("naive_attention")(lambda Q, K, V, causal=False: _naive(Q, K, V, causal).astype(np.float64))  # dtype


@mutant("naive_attention", "float16 keeps about 3 decimal digits")
def naive_in_float16(Q, K, V, causal=False):
    S = Q @ K.T / Q.dtype.type(math.sqrt(Q.shape[1]))  # every step in the inputs' dtype
    if causal:
        S = _causal(S)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    return (P / P.sum(axis=-1, keepdims=True)) @ V


@mutant("naive_attention", "promoted to float64")
def naive_numpy_scalar_promotes(Q, K, V, causal=False):
    w = _work(Q)
    S = Q.astype(w) @ K.astype(w).T / np.sqrt(Q.shape[1])  # np.sqrt of an int is an np.float64
    if causal:
        S = _causal(S)
    P = np.exp(S - S.max(axis=-1, keepdims=True))
    return (P / P.sum(axis=-1, keepdims=True)) @ V.astype(w)


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


# -- naive_hbm_bytes ---------------------------------------------------------------------------------
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: b * (nq * d + nk * d + nq * nk + nk * d + nq * nk + nq * d))  # no P
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: b * (3 * nq * d + 4 * nq * nk))  # assumes Nq = Nk
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: b * (nq * d + 2 * nk * d + 2 * nq * nk))  # reads only
mutant("naive_hbm_bytes")(lambda nq, nk, d, b: nq * d + 2 * nk * d + 4 * nq * nk + nq * d)  # elements


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


# -- naive_peak_bytes: peak memory of naive attention ------------------------------------------------
def _inputs(Nq, Nk, d, dv):
    return Nq * d + Nk * d + Nk * dv


@mutant("naive_peak_bytes", "S and P alone")
def peak_s_and_p_only(B, H, Nq, Nk, d, dv, dtype):
    """counts S and P, forgets the inputs and O"""
    return B * H * dtype.itemsize * 2 * Nq * Nk


@mutant("naive_peak_bytes", "S can be freed")
def peak_never_frees(B, H, Nq, Nk, d, dv, dtype):
    """keeps S until the end"""
    return B * H * dtype.itemsize * (_inputs(Nq, Nk, d, dv) + 2 * Nq * Nk + Nq * dv)


@mutant("naive_peak_bytes", "step 3 holds more")
def peak_step2_only(B, H, Nq, Nk, d, dv, dtype):
    """assumes the softmax step is always the peak"""
    return B * H * dtype.itemsize * (_inputs(Nq, Nk, d, dv) + 2 * Nq * Nk)


@mutant("naive_peak_bytes", "B * H")
def peak_one_head(B, H, Nq, Nk, d, dv, dtype):
    """one head only"""
    return dtype.itemsize * (_inputs(Nq, Nk, d, dv) + Nq * Nk + max(Nq * Nk, Nq * dv))


@mutant("naive_peak_bytes", "4-byte")
def peak_float32_always(B, H, Nq, Nk, d, dv, dtype):
    """4 bytes per element whatever the dtype"""
    return B * H * 4 * (_inputs(Nq, Nk, d, dv) + Nq * Nk + max(Nq * Nk, Nq * dv))


@mutant("naive_peak_bytes", "width dv")
def peak_dv_is_d(B, H, Nq, Nk, d, dv, dtype):
    """V and O of width d"""
    return B * H * dtype.itemsize * (_inputs(Nq, Nk, d, d) + Nq * Nk + max(Nq * Nk, Nq * d))


@alternative("naive_peak_bytes")
def peak_by_step(B, H, Nq, Nk, d, dv, dtype):
    inputs = Nq * d + Nk * d + Nk * dv
    totals = [inputs + Nq * Nk, inputs + 2 * Nq * Nk, inputs + Nq * Nk + Nq * dv]
    return B * H * np.dtype(dtype).itemsize * max(totals)


@alternative("naive_peak_bytes")
def peak_in_bytes_from_the_start(B, H, Nq, Nk, d, dv, dtype):
    b = np.dtype(dtype).itemsize * B * H
    return b * (Nq * d + Nk * (d + dv)) + b * Nq * Nk + max(b * Nq * Nk, b * Nq * dv)


globals().update(LESSON.standard_tests())


def test_naive_peak_is_the_busiest_step():
    """The closed form against a step-by-step walk over what is allocated (lesson 02's three kernels)."""
    from flashlab.grading.l02_naive_attention import naive_peak_elements

    rng = np.random.default_rng(0)
    for _ in range(50):
        nq, nk, d, dv = (int(x) for x in rng.integers(1, 300, 4))
        size = {"Q": nq * d, "K": nk * d, "V": nk * dv, "S": nq * nk, "P": nq * nk, "O": nq * dv}
        steps = [({"Q", "K"}, "S"), ({"S"}, "P"), ({"P", "V"}, "O")]  # (reads, writes)
        live, peak = {"Q", "K", "V"}, 0
        for n, (reads, out) in enumerate(steps):
            live.add(out)
            peak = max(peak, sum(size[a] for a in live))
            later = set().union(*(r for r, _ in steps[n + 1:])) | {"Q", "K", "V", "O"}
            live = {a for a in live if a in later}
        assert naive_peak_elements(nq, nk, d, dv) == peak
