"""Checking the arguments of every attention function, in one place.

Every public attention function starts with `check_attention_inputs`, so a learner who passes a
wrong shape gets the same clear message from the reference, the tiled NumPy code and the kernels.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

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


def check_attention_inputs(q, k, v, *, causal=False, scale=None, gqa=False):
    """Validate (q, k, v, causal, scale) with the semantics of torch's scaled_dot_product_attention.

    q: (..., Nq, d), k: (..., Nk, d), v: (..., Nk, dv) with identical leading (batch, head) dims and
    one floating dtype. Returns (q, k, v, causal, scale) with scale resolved to a float.
    gqa=True also accepts, for 4-dim (B, H, N, d) arrays, k and v with H_kv heads (dim -3) where H_kv divides
    q's H (GQA/MQA). (3-dim arrays keep the strict check: their first dim may be a batch.)
    """
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, d); got shape {x.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if gqa and q.ndim >= 4 and q.ndim == k.ndim == v.ndim and k.shape[:-2] == v.shape[:-2] \
            and q.shape[:-3] == k.shape[:-3] and q.shape[-3] != k.shape[-3]:
        h, h_kv = q.shape[-3], k.shape[-3]
        if h_kv == 0 or h % h_kv:
            raise ValueError(f"k and v have H_kv = {h_kv} heads (dim -3), which must divide q's H = {h} "
                             f"(GQA: query head h uses KV head h // (H / H_kv)); got q {q.shape}, k {k.shape}")
    elif not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
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


def check_backward_inputs(q, k, v, o, lse, do, *, causal=False, scale=None, gqa=False, allow_empty_rows=False):
    """Validate the backward's arguments: the forward's plus o (like q but dv), lse (..., Nq), do (like o).

    allow_empty_rows: accept lse = +inf, the forward's mark of a row whose mask hides every key."""
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale, gqa=gqa)
    o, do = as_float_array(o, "o"), as_float_array(do, "do")
    lse = as_float_array(lse, "lse")
    want_o = q.shape[:-1] + (v.shape[-1],)
    if o.shape != want_o:
        raise ValueError(f"o must have shape {want_o} (q's shape with v's last dim); got {o.shape}")
    if do.shape != want_o:
        raise ValueError(f"do must have the shape of o, {want_o}; got {do.shape}")
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {q.shape[:-1]} (one value per query row); got {lse.shape}")
    if np.any(np.isnan(lse) | np.isneginf(lse)) or (not allow_empty_rows and np.any(np.isinf(lse))):
        raise ValueError("lse contains inf or NaN; pass the lse returned by the forward pass"
                         + (" (+inf is allowed: it marks a row that sees no key)" if allow_empty_rows else ""))
    return q, k, v, o, lse, do, causal, scale


def causal_mask(n_q: int, n_k: int, q0: int = 0, k0: int = 0) -> np.ndarray:
    """Boolean (n_q, n_k) mask, True where query q0+i may see key k0+j (top-left aligned: j <= i)."""
    return (k0 + np.arange(n_k))[None, :] <= (q0 + np.arange(n_q))[:, None]


# ---- The FlashAttention library's options: window, alignment, ALiBi, softcap, dropout ----

ALIGNS = ("top_left", "bottom_right")


class AttentionOptions(NamedTuple):
    """The checked options. window: (left, right), -1 = unbounded. alibi: float64 slopes of shape (H,) or
    q.shape[:-2], or None. softcap: 0 = off. dropout_p: 0 = off. seed: key of the dropout generator."""
    causal: bool
    scale: float
    window: tuple
    align: str
    alibi: object
    softcap: float
    dropout_p: float
    seed: int

    def offset(self, nq: int, nk: int) -> int:
        """Aligned position of query 0: query i sits at position i + offset among the keys."""
        return nk - nq if self.align == "bottom_right" else 0

    def bounds(self):
        """(left, right) key offsets of the visible band, None where unbounded; causal caps right at 0."""
        left, right = self.window
        left = None if left < 0 else left
        right = 0 if self.causal else (None if right < 0 else right)
        return left, right

    @property
    def plain(self) -> bool:
        """True when only causal/scale are in use (the classic path, with every row seeing a key)."""
        return self.window == (-1, -1) and self.align == "top_left" and self.alibi is None \
            and self.softcap == 0 and self.dropout_p == 0


def _check_real(value, name, expected):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise (TypeError if not isinstance(value, numbers.Real) else ValueError)(
            f"{name} must be {expected}; got {value!r} of type {type(value).__name__}")
    return float(value)


# The library's options at their defaults, where each option is off: what a call that passes none of them means
OPTION_DEFAULTS = dict(window_size=(-1, -1), align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0)


def check_options(q_shape, *, causal=False, scale=None, window_size=(-1, -1), align="top_left",
                  alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0) -> AttentionOptions:
    """Validate the FA library's options for queries of shape q_shape (..., H, Nq, d)."""
    causal, scale = check_causal(causal), check_scale(scale, q_shape[-1])
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_)) for w in window_size):
        raise TypeError(f"window_size must be a pair of integers (left, right), -1 meaning unbounded; "
                        f"got {window_size!r}")
    window = tuple(int(w) for w in window_size)
    if min(window) < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size!r}")
    if not isinstance(align, str) or align not in ALIGNS:
        raise ValueError(f"align must be 'top_left' or 'bottom_right'; got {align!r}")
    alibi = None
    if alibi_slopes is not None:
        alibi = np.asarray(alibi_slopes)
        if alibi.dtype.kind not in "fiu":
            raise TypeError(f"alibi_slopes must be an array of real numbers; got dtype {alibi.dtype}")
        heads = tuple(q_shape[-3:-2])
        allowed = {heads, tuple(q_shape[:-2])}
        if alibi.shape not in allowed:
            raise ValueError(f"alibi_slopes must have shape (H,) = {heads} or (B, H) = {tuple(q_shape[:-2])} "
                             f"for q of shape {tuple(q_shape)}; got {alibi.shape}")
        if not np.all(np.isfinite(alibi)):
            raise ValueError("alibi_slopes must be finite; got inf or NaN")
        alibi = alibi.astype(np.float64)
    softcap = _check_real(softcap, "softcap", "a finite number >= 0 (0 = off)")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off); got {softcap}")
    dropout_p = _check_real(dropout_p, "dropout_p", "a number in [0, 1)")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return AttentionOptions(causal, scale, window, align, alibi, softcap, dropout_p, check_seed(seed))


def check_seed(seed) -> int:
    """The dropout seed as an int in [0, 2**63), or a ValueError naming it."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an integer in [0, 2**63); got {seed!r}")
    return int(seed)
