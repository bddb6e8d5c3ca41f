"""Lesson 14's exercises (split-KV decoding: a chunk's partial state, merging partials, the time of a decode
step): each checker passes the solution, grades the blank "not implemented", and rejects plausible wrong
solutions with a message and a hint that names the usual slips."""
import numpy as np

from exercise_harness import Lesson

LESSON = Lesson("14_decoding")
mutant = LESSON.mutant


# -- chunk_partial -----------------------------------------------------------------------------------
def _cp(q, k_c, v_c, scale, *, normalise=False, subtract=True, use_scale=True):
    ct = np.float64 if q.dtype == np.float64 else np.float32
    S = q.astype(ct) @ k_c.astype(ct).T * (ct(scale) if use_scale else 1)
    m = S.max(axis=-1)
    P = np.exp(S - m[:, None]) if subtract else np.exp(S)
    l, O = P.sum(-1), P @ v_c.astype(ct)
    return m, l, (O / l[:, None] if normalise else O)


mutant("chunk_partial")(lambda q, k, v, s: _cp(q, k, v, s, normalise=True))  # O already divided by l
mutant("chunk_partial")(lambda q, k, v, s: _cp(q, k, v, s, subtract=False))  # exp(S) without the max: overflows
mutant("chunk_partial")(lambda q, k, v, s: _cp(q, k, v, s, use_scale=False))  # forgot the scale
mutant("chunk_partial")(lambda q, k, v, s: (lambda m, l, O: (m, l, O.astype(np.float16)))(*_cp(q, k, v, s)))  # O in float16


@mutant("chunk_partial")
def chunk_partial_column_max(q, k_c, v_c, scale):  # max over the wrong axis
    S = q.astype(np.float64) @ k_c.astype(np.float64).T * scale
    m = np.broadcast_to(S.max(), S.shape[:1]).copy()
    P = np.exp(S - m[:, None])
    return m, P.sum(-1), P @ v_c


# -- merge_partials ----------------------------------------------------------------------------------
@mutant("merge_partials")
def merge_without_rescaling(m, l, O):  # adds states relative to different maxima
    l_all = l.sum(0)
    return O.sum(0) / l_all[:, None], m.max(0) + np.log(l_all)


@mutant("merge_partials")
def merge_rescales_l_only(m, l, O):
    w = np.exp(m - m.max(0))
    l_all = (w * l).sum(0)
    return O.sum(0) / l_all[:, None], m.max(0) + np.log(l_all)


@mutant("merge_partials")
def merge_averages_normalised_chunks(m, l, O):  # mean of the chunks' own outputs, ignoring their weights
    return (O / l[..., None]).mean(0), m.max(0) + np.log((np.exp(m - m.max(0)) * l).sum(0))


@mutant("merge_partials")
def merge_lse_without_log(m, l, O):
    w = np.exp(m - m.max(0))
    l_all = (w * l).sum(0)
    return (w[..., None] * O).sum(0) / l_all[:, None], m.max(0) + l_all


@mutant("merge_partials")
def merge_without_max(m, l, O):  # exp(m_c) overflows when chunks' maxima are large
    w = np.exp(m)
    l_all = (w * l).sum(0)
    with np.errstate(all="ignore"):
        return (w[..., None] * O).sum(0) / l_all[:, None], np.log(l_all)


# -- decode_time -------------------------------------------------------------------------------------
def _decode(*, qo=True, v=True, flops_per=4, combine=max):
    def decode_time(B, H, nq, nk, d, size, peak, bw):
        moved = B * H * ((2 * nq * d if qo else 0) + (2 if v else 1) * nk * d) * size
        t_mem, t_math = moved / bw, flops_per * B * H * nq * nk * d / peak
        return combine(t_mem, t_math), ("memory" if t_mem >= t_math else "compute")
    return decode_time


mutant("decode_time", hint="Reading Q and writing O")(_decode(qo=False))  # K and V only
mutant("decode_time")(_decode(v=False))  # K only
mutant("decode_time")(_decode(flops_per=2))  # one product only
mutant("decode_time", hint="not their sum")(_decode(combine=lambda a, b: a + b))  # adds the two times
mutant("decode_time")(lambda *args: (_decode()(*args)[0], "memory"))  # always memory-bound
mutant("decode_time")(lambda B, H, nq, nk, d, size, peak, bw: (2 * B * H * (nq + nk) * d * size / bw, "memory"))  # bandwidth only


globals().update(LESSON.standard_tests())
