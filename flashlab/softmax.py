"""The softmax family that FlashAttention is built from (lesson 03).

naive_softmax    exp(x) / sum(exp(x)): overflows once x > ~88 in float32 (~11 in float16)
safe_softmax     subtract the row max first: three passes (max, sum, normalise)
online_softmax   one pass computes the max and the sum together (Milakov & Gimelshein, arXiv 1805.02867),
                 rescaling the running sum whenever the max grows; a second pass normalises
merge_softmax_states   combine the (m, l) statistics of two chunks of a row: the step tiling is built on
"""
from __future__ import annotations

import numpy as np

from ._inputs import as_float_array, compute_dtype


def _prep(x, name="x"):
    x = as_float_array(x, name)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one element along its last axis; got shape {x.shape}")
    return x, x.astype(compute_dtype(x.dtype))


def naive_softmax(x):
    """Softmax over the last axis straight from the definition. Overflows to inf/NaN for large inputs."""
    x, xc = _prep(x)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(xc)
        return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def safe_softmax(x):
    """Softmax over the last axis with the row max subtracted, so every exponent is <= 0."""
    x, xc = _prep(x)
    e = np.exp(xc - xc.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def online_softmax_stats(x):
    """One pass over the last axis, element by element, keeping a running max m and running sum l.

    Returns (m, l) with l = sum_j exp(x_j - m). When a new element raises the max, the sum so far is
    rescaled by exp(m_old - m_new) so it stays relative to the current max.
    """
    x, xc = _prep(x)
    m = np.full(xc.shape[:-1], -np.inf, xc.dtype)
    l = np.zeros(xc.shape[:-1], xc.dtype)
    for j in range(xc.shape[-1]):
        x_j = xc[..., j]
        m_new = np.maximum(m, x_j)
        l = l * np.exp(m - m_new) + np.exp(x_j - m_new)
        m = m_new
    return m, l


def online_softmax(x):
    """Softmax from one statistics pass (online_softmax_stats) plus one normalising pass."""
    x, xc = _prep(x)
    m, l = online_softmax_stats(xc)
    return (np.exp(xc - m[..., None]) / l[..., None]).astype(x.dtype)


def merge_softmax_states(m_a, l_a, m_b, l_b):
    """Merge the statistics of two disjoint chunks of the same rows into those of their union.

    (m_a, l_a) and (m_b, l_b) are running maxima and sums (l = sum exp(x - m)) of chunk a and chunk b.
    An empty chunk is (m = -inf, l = 0) and merges as the identity.
    """
    m_a, l_a, m_b, l_b = (np.asarray(t, dtype=np.result_type(t, np.float32)) for t in (m_a, l_a, m_b, l_b))
    m = np.maximum(m_a, m_b)
    m_safe = np.where(np.isneginf(m), 0, m)  # both empty: keep exponents finite
    return m, l_a * np.exp(m_a - m_safe) + l_b * np.exp(m_b - m_safe)
