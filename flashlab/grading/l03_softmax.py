"""Lesson 03, softmax: safe softmax, one-pass online statistics, merging two partial states."""
from __future__ import annotations

import numpy as np

from ..softmax import merge_softmax_states, safe_softmax
from .core import exercise

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


@exercise("safe_softmax", lesson=LESSON,
          hint="softmax(x) = exp(x) / sum(exp(x)) along the last axis; what can you subtract from a row first?")
def check_safe_softmax(t, fn):
    for x in softmax_inputs(t):
        t.compare(t.call(x), safe_softmax(x.astype(np.float64)), dtype=x.dtype)


@exercise("online_softmax_stats", lesson=LESSON,
          hint="When a new element raises the running max from m to m_new, every term already in l was "
               "computed relative to m: multiply l by exp(m - m_new) so it is relative to m_new.")
def check_online_softmax_stats(t, fn):
    for x in softmax_inputs(t):
        x64 = x.astype(np.float64)
        m_ref = x64.max(axis=-1)
        l_ref = np.exp(x64 - m_ref[..., None]).sum(axis=-1)
        out = t.call(x)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (m, l); got {type(out).__name__}")
        t.compare(out[0], m_ref, "m", min_dtype=x.dtype)
        t.compare(out[1], l_ref, "l", min_dtype=x.dtype)


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
