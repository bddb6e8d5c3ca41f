"""Lesson 03's exercises (safe and online softmax, merging softmax states): each checker passes the solution and
correct answers written differently (exp2, log-sum-exp, blocks of columns), grades the blank "not
implemented", and rejects kept wrong solutions, naming the slip where the test gives words."""
import numpy as np

from exercise_harness import _work, Lesson, LOG2E

LESSON = Lesson("03_softmax", min_alternatives=2)
mutant, alternative = LESSON.mutant, LESSON.alternative


# -- safe_softmax ------------------------------------------------------------------------------------
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


# -- online_softmax_stats ----------------------------------------------------------------------------
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
mutant("online_softmax_stats", "exp(m_old - m_new), at most 1")(
    lambda x: _online(x, invert=True))  # rescales by exp(m_new - m)
mutant("online_softmax_stats", "start from m = -inf")(lambda x: _online(x, m0=0.0))  # starts the max at 0


@mutant("online_softmax_stats")
def online_sum_without_max(x):
    w = x.astype(_work(x))
    return w.max(axis=-1), np.exp(w).sum(axis=-1)


@mutant("online_softmax_stats", "read x a second time")
def online_two_passes(x):
    w = x.astype(_work(x))
    m = w.max(axis=-1)
    return m, np.exp(w - m[..., None]).sum(axis=-1)


@mutant("online_softmax_stats", "read x a second time")
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


# -- merge_softmax_states ----------------------------------------------------------------------------
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


globals().update(LESSON.standard_tests())
