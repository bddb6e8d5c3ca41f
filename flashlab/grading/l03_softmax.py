"""Lesson 03, softmax: safe softmax, one-pass online statistics, merging two partial states."""
from __future__ import annotations

import numpy as np

from numpy.lib.mixins import NDArrayOperatorsMixin

from ..softmax import merge_softmax_states, safe_softmax
from .core import exercise, tolerance

LESSON = "03_softmax"
HUGE = "exp() overflows for inputs above ~709 (float64) or ~88 (float32). Shifting a row by a constant does not change its softmax."
NEGATIVE = "Every entry of these rows is very negative: exp() of each underflows to 0 unless you shift first."
ROWS = "Each row is its own softmax: its max is not the max of the whole array."
MASKED = "-inf entries (masked scores) must get probability 0, without producing NaN."


def softmax_inputs(t):
    """Yield x for each case (rows along the last axis), after describing it with t.case()."""
    f64, f32, f16 = np.float64, np.float32, np.float16
    specs = [
        ("small", (2, 5), f64, 0, 1, None),
        ("one vector", (17,), f64, 0, 3, None),
        ("a batch of matrices", (3, 4, 9), f32, 0, 2, None),
        ("random shape", tuple(int(n) for n in t.rng.integers(1, 40, 2)), f64, 0, 5, None),
        ("huge inputs (~1e4)", (4, 12), f64, 1e4, 50, HUGE),
        ("huge inputs, float32 (~1e3)", (4, 12), f32, 1e3, 20, HUGE),
        ("very negative inputs (~ -1e4)", (3, 8), f64, -1e4, 5, NEGATIVE),
        ("rows far apart (offsets of +-900)", (4, 10), f64, 0, 5, ROWS),
        ("float16", (5, 33), f16, 0, 2, "float16 inputs: compute in float32 and return the input's dtype."),
        ("masked entries (-inf)", (6, 10), f64, 0, 3, MASKED),
    ]
    for label, shape, dtype, shift, scale, hint in specs:
        x = t.normal(shape, np.float64, scale, shift)
        if label.startswith("huge"):
            x[..., t.rng.integers(shape[-1])] += 10 * scale  # one clear winner per row
        if label.startswith("rows far apart"):
            x += np.array([0.0, 900.0, -900.0, 400.0])[:, None]
        if label.startswith("masked"):
            x[t.rng.random(shape) < 0.3] = -np.inf
            x[..., 0] = t.rng.standard_normal(shape[:-1])  # every row keeps a finite first entry
        x = x.astype(dtype)
        t.case(label, hint, shape=shape, dtype=np.dtype(dtype).name)
        yield x


def softmax_stats_tolerance(x, tol):
    """l = sum exp(x - m) carries relative rounding errors of about eps * |x| from each exponent."""
    eps = float(np.finfo(np.promote_types(x.dtype, np.float32)).eps)
    finite = np.abs(x[np.isfinite(x)])
    return max(tol, 16 * eps * float(finite.max(initial=0.0)))


@exercise("safe_softmax", lesson=LESSON,
          hint="softmax(x) = exp(x) / sum(exp(x)) along the last axis; what can you subtract from a row first?")
def check_safe_softmax(t, fn):
    for x in softmax_inputs(t):
        t.compare(t.call(x), safe_softmax(x.astype(np.float64)), dtype=x.dtype,
                  tol=softmax_stats_tolerance(x, tolerance(x.dtype)))


class OnePassRows(NDArrayOperatorsMixin):
    """An array the checker hands over in place of x, which notes whether any row is read a second time.

    Reading one column, a run of columns, or a row, as often as needed in a row, is one pass; a read that
    comes back to entries already read and moved past is a second one. So is reading a whole row of several
    entries twice (`x.max(-1)`, then `x - m`): that keeps the whole row around, which is what one pass avoids.
    Every read returns a plain copy, and `astype` / `copy` give a new OnePassRows, so a second pass over a
    converted copy is seen too. Reads of shape and dtype are free.
    """

    _FREE = {np.shape, np.ndim, np.size, np.result_type, np.zeros_like, np.ones_like, np.empty_like, np.full_like}

    def __init__(self, data, parent=None):
        self._parent = parent  # a converted copy reports its second pass to the array it came from
        self._data = np.array(data)
        self._data.flags.writeable = False
        self._seen = np.zeros(self._data.shape, bool)
        self._last = np.zeros(self._data.shape, bool)  # each row's entries of its latest read
        self.second_pass = False

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: self._data.size)

    def __len__(self):
        return len(self._data)

    def _read(self, key=Ellipsis):
        mask = np.zeros(self.shape, bool)
        mask[key] = True
        read = mask.any(axis=-1)
        again = (mask & self._seen).any(axis=-1)
        whole = mask.all(axis=-1) & (self.shape[-1] > 1)
        same = (mask == self._last).all(axis=-1)
        if np.any(read & again & ~(same & ~whole)):
            array = self
            while array is not None:
                array.second_pass, array = True, array._parent
        self._seen |= mask
        self._last = np.where(read[..., None], mask, self._last)
        return self._data[key].copy()

    def __getitem__(self, key):
        return self._read(key)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __array__(self, dtype=None, copy=None):
        out = self._read()
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype, *args, **kwargs):
        return OnePassRows(self._read().astype(dtype, *args, **kwargs), parent=self)

    def copy(self, *args, **kwargs):
        return self.astype(self.dtype)

    def __getattr__(self, name):  # x.max(axis=-1), x.T, x.sum(), ...: a read of all of x
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._read(), name)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(o, OnePassRows) for o in kwargs.get("out", ())):
            raise ValueError("x is read-only here: compute new arrays (x - m) instead of changing x in place")
        inputs = [np.asarray(x) if isinstance(x, OnePassRows) else x for x in inputs]
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        plain = (lambda x: x._data) if func in self._FREE else np.asarray
        unwrap = lambda a: plain(a) if isinstance(a, OnePassRows) else \
            type(a)(unwrap(v) for v in a) if isinstance(a, (list, tuple)) else a  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})

    def __repr__(self):
        return f"OnePassRows(shape={self.shape}, dtype={self.dtype})"


ONE_PASS = ("This exercise is about one pass: m and l come out of a single sweep along each row, as a kernel sees "
            "each key once. Your function read the row again after a first pass (x.max(-1), then "
            "exp(x - m), say; np.asarray(x), x.max() and x - m each read all of x): keep a running max and a running sum instead, and rescale the sum when the max grows.")


def _m_slip(m, x):
    if np.allclose(np.asarray(m, np.float64), np.maximum(x.max(axis=-1), 0.0)):
        return ("m starts at 0, so a row whose entries are all negative reports m = 0: start from m = -inf, which "
                "any entry raises")
    return None


def _l_slip(l, x):
    if np.isnan(np.asarray(l, np.float64)).all() and np.isfinite(x).all():
        return ("l is NaN in every row, from the first element on: the factor that brings the old terms to a new "
                "max is exp(m_old - m_new), at most 1. The other way round, exp(m_new - m_old) is inf while "
                "m_old = -inf, and 0 * inf is NaN.")
    return None


@exercise("online_softmax_stats", lesson=LESSON,
          hint="When a new element raises the running max from m to m_new, every term already in l was "
               "computed relative to m: multiply l by exp(m - m_new) so it is relative to m_new.")
def check_online_softmax_stats(t, fn):
    for x in softmax_inputs(t):
        x64 = x.astype(np.float64)
        m_ref = x64.max(axis=-1)
        l_ref = np.exp(x64 - m_ref[..., None]).sum(axis=-1)
        stream = OnePassRows(x)
        out = t.call(stream)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (m, l); got {type(out).__name__}")
        t.compare(out[0], m_ref, "m", min_dtype=x.dtype, explain=lambda m: ([], _m_slip(m, x64)))
        t.compare(out[1], l_ref, "l", min_dtype=x.dtype, tol=softmax_stats_tolerance(x, tolerance(x.dtype)),
                  explain=lambda l: ([], _l_slip(l, x64)))
        if stream.second_pass:
            raise t.fail("m and l are right, but your function read x a second time", hint=ONE_PASS)


def _state(t, shape, empty):
    """A random (m, l) state; rows flagged in `empty` have seen nothing: (-inf, 0)."""
    m = t.normal(shape, scale=5)
    l = t.rng.uniform(1, 20, shape)
    return np.where(empty, -np.inf, m), np.where(empty, 0.0, l)


@exercise("merge_softmax_states", lesson=LESSON,
          hint="Bring both sums to the common max m = max(m_a, m_b) before adding them: l_a was computed "
               "relative to m_a and l_b relative to m_b.")
def check_merge_softmax_states(t, fn):
    n = 12
    none = np.zeros(n, bool)
    specs = [("small", none, none, 0, None),
             ("random rows", none, none, 0, None),
             ("maxima far apart", none, none, 400, "When m_a and m_b differ a lot, one side's terms shrink "
              "to almost nothing; each side needs its own rescaling factor."),
             ("one side empty (m = -inf, l = 0)", t.rng.random(n) < 0.5, none, 0,
              "A chunk that has seen nothing has m = -inf, l = 0. Merging with it must change nothing, and "
              "exp(-inf - (-inf)) is NaN."),
             ("both sides empty in some rows", np.arange(n) % 3 == 0, np.arange(n) % 2 == 0, 0,
              "Merging two empty chunks gives an empty chunk (m = -inf, l = 0), never NaN.")]
    for label, empty_a, empty_b, spread, hint in specs:
        m_a, l_a = _state(t, n, empty_a)
        m_b, l_b = _state(t, n, empty_b)
        m_b = m_b + spread * t.rng.choice([-1, 1], n)
        t.case(label, hint, rows=n)
        out = t.call(m_a, l_a, m_b, l_b)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (m, l); got {type(out).__name__}")
        m_ref, l_ref = merge_softmax_states(m_a, l_a, m_b, l_b)
        t.compare(out[0], m_ref, "m", min_dtype=np.float64)
        t.compare(out[1], l_ref, "l", min_dtype=np.float64)
