"""The softmax family of lesson 03 against a float64 softmax."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashlab as fl
from conftest import TOL


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


shapes = st.tuples(st.integers(1, 4), st.integers(1, 60))
dtypes = st.sampled_from([np.float16, np.float32, np.float64])


@given(shape=shapes, dtype=dtypes, spread=st.sampled_from([1.0, 30.0, 1e4]), seed=st.integers(0, 2**32 - 1))
def test_safe_and_online_softmax_match_float64(shape, dtype, spread, seed):
    if dtype == np.float16:
        spread = min(spread, 1e3)
    x = (np.random.default_rng(seed).standard_normal(shape) * spread).astype(dtype)
    want = softmax64(x)
    for f in (fl.safe_softmax, fl.online_softmax):
        got = f(x)
        assert got.dtype == dtype and np.all(np.isfinite(got))
        assert fl.relative_error(got, want) <= TOL[dtype], f.__name__


@given(shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_online_stats_are_max_and_sum(shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape) * 20
    m, l = fl.online_softmax_stats(x)
    np.testing.assert_array_equal(m, x.max(-1))
    np.testing.assert_allclose(l, np.exp(x - x.max(-1, keepdims=True)).sum(-1), rtol=1e-12)


def test_naive_softmax_overflows_where_safe_does_not():
    x = np.array([[1000.0, 1001.0, 1002.0]], np.float32)
    assert not np.all(np.isfinite(fl.naive_softmax(x)))
    np.testing.assert_allclose(fl.safe_softmax(x), softmax64(x), rtol=1e-6)
    small = np.array([[0.5, -1.0, 2.0]])
    np.testing.assert_allclose(fl.naive_softmax(small), softmax64(small), rtol=1e-12)


@given(n=st.integers(2, 50), cut=st.integers(0, 50), seed=st.integers(0, 2**32 - 1))
def test_merging_two_chunks_equals_the_whole(n, cut, seed):
    cut = min(cut, n)
    x = np.random.default_rng(seed).standard_normal((3, n)) * 50
    empty = (np.full(3, -np.inf), np.zeros(3))
    a = fl.online_softmax_stats(x[:, :cut]) if cut else empty  # an empty chunk merges as the identity
    b = fl.online_softmax_stats(x[:, cut:]) if cut < n else empty
    m, l = fl.merge_softmax_states(*a, *b)
    m_all, l_all = fl.online_softmax_stats(x)
    np.testing.assert_allclose(m, m_all, rtol=1e-12)
    np.testing.assert_allclose(l, l_all, rtol=1e-12)


def test_merging_two_empty_chunks_gives_no_nan():
    m, l = fl.merge_softmax_states(-np.inf, 0.0, -np.inf, 0.0)
    assert m == -np.inf and l == 0.0
