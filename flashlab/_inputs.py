"""Checking the arguments of every attention function, in one place.

Every public attention function starts with `check_attention_inputs`, so a learner who passes a
wrong shape gets the same clear message from the reference, the tiled NumPy code and the kernels.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def as_float_array(x, name: str) -> np.ndarray:
    """`x` as a NumPy array of float16/32/64, or a TypeError naming `name`."""
    if isinstance(x, np.ndarray):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except Exception as exc:  # e.g. ragged nested lists
            raise TypeError(f"{name} must be an array of floats; could not convert {type(x).__name__}: {exc}") from None
    if arr.dtype.type not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {arr.dtype}; expected float16, float32 or float64 "
            f"(convert with {name}.astype(np.float32))"
        )
    return arr


def compute_dtype(dtype) -> np.dtype:
    """Accumulate in float32 for float16/float32 inputs and in float64 for float64 inputs."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def check_scale(scale, d: int) -> float:
    """The softmax scale: 1/sqrt(d) by default, else a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r} of type {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite; got {scale!r}")
    return float(scale)


def check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r} of type {type(causal).__name__}")
    return bool(causal)


def check_block(value, name: str):
    """None (use the default) or a positive integer."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer or None; got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value}")
    return int(value)


def check_attention_inputs(q, k, v, *, causal=False, scale=None):
    """Validate (q, k, v, causal, scale) with the semantics of torch's scaled_dot_product_attention.

    q: (..., Nq, d), k: (..., Nk, d), v: (..., Nk, dv) with identical leading (batch, head) dims and
    one floating dtype. Returns (q, k, v, causal, scale) with scale resolved to a float.
    """
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, d); got shape {x.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            "q, k and v must have the same leading (batch, head) dims; got "
            f"q {q.shape[:-2]}, k {k.shape[:-2]}, v {v.shape[:-2]} (full shapes {q.shape}, {k.shape}, {v.shape})"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same feature dim d; got q.shape[-1]={q.shape[-1]}, k.shape[-1]={k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys Nk; got k.shape[-2]={k.shape[-2]}, v.shape[-2]={v.shape[-2]}")
    if k.shape[-2] == 0:
        raise ValueError(f"k has no keys (Nk = 0, shape {k.shape}); attention needs at least one key")
    if q.shape[-2] == 0:
        raise ValueError(f"q has no queries (Nq = 0, shape {q.shape}); pass at least one query")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"d and dv must be at least 1; got q shape {q.shape}, v shape {v.shape}")
    return q, k, v, check_causal(causal), check_scale(scale, q.shape[-1])


def check_backward_inputs(q, k, v, o, lse, do, *, causal=False, scale=None):
    """Validate the backward's arguments: the forward's plus o (like q but dv), lse (..., Nq), do (like o)."""
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale)
    o, do = as_float_array(o, "o"), as_float_array(do, "do")
    lse = as_float_array(lse, "lse")
    want_o = q.shape[:-1] + (v.shape[-1],)
    if o.shape != want_o:
        raise ValueError(f"o must have shape {want_o} (q's shape with v's last dim); got {o.shape}")
    if do.shape != want_o:
        raise ValueError(f"do must have the shape of o, {want_o}; got {do.shape}")
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {q.shape[:-1]} (one value per query row); got {lse.shape}")
    if not np.all(np.isfinite(lse)):
        raise ValueError("lse contains inf or NaN; pass the lse returned by the forward pass")
    return q, k, v, o, lse, do, causal, scale


def causal_mask(n_q: int, n_k: int, q0: int = 0, k0: int = 0) -> np.ndarray:
    """Boolean (n_q, n_k) mask, True where query q0+i may see key k0+j (top-left aligned: j <= i)."""
    return (k0 + np.arange(n_k))[None, :] <= (q0 + np.arange(n_q))[:, None]
