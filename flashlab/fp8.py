"""FP8 (e4m3) attention simulated in NumPy, as FlashAttention-3 does it (arXiv 2407.08608, section 3.3).

round_e4m3            round to the nearest e4m3 value (ties to even), saturating at +-448
quantize_e4m3         e4m3 codes and float scales: one scale per tensor, or one per block of rows
incoherent_transform  Q M and K M with M = diag(random +-1) @ Hadamard / sqrt(d): Q K^T is unchanged
round_p_e4m3          P rounded to e4m3 as FA3 feeds it to the P V product: scaled by 2^8 first
fp8_attention         quantise Q, K, V (and P) the FA3 way, then run flashlab's FA2 forward on the FP8 values
accuracy_study        the paper's Table 3 experiment: RMSE against float64 on inputs with outliers
error_vs_block        the same experiment swept over block sizes, with and without incoherent processing

Only the rounding is simulated: values stay float numbers that happen to lie on the e4m3 grid (times a
scale), and the products are exact sums in float32. Real FP8 tensor cores differ in two ways flashlab does
not model: Hopper's FP8 matrix instructions take no scale operands (the kernel applies the scales in FP32,
outside the instruction), and their accumulation keeps only about 14 bits of precision, not float32's 24
(DeepSeek-V3 report, arXiv 2412.19437, section 3.3.2, measured on H800).
"""
from __future__ import annotations

import numbers

import numpy as np

E4M3_MAX = 448.0  # largest finite e4m3 value: 1.75 * 2^8
E4M3_MIN_NORMAL = 2.0 ** -6  # exponent bias 7: smallest normal is 2^(1-7)
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # 3 mantissa bits below the smallest normal
MANTISSA_BITS = 3
#: FA3 computes P = exp(S - m + 8 ln 2) for FP8, so P fills [0, 256] rather than [0, 1] and fewer of its
#: small values round to zero (Dao-AILab/flash-attention, hopper/softmax.h, Max_offset = 8).
P_SCALE = 2.0 ** 8

#: arXiv 2407.08608, Table 3: RMSE against an FP64 reference, inputs N(0,1) + N(0,100) * Bernoulli(0.001).
PAPER_RMSE = {"per-tensor": 2.4e-2, "block": 2.4e-2, "block + incoherent": 9.1e-3}
METHODS = tuple(PAPER_RMSE)


def _float_array(x, name):
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise TypeError(f"{name} must be an array of real numbers; got dtype {arr.dtype}")
    return arr


def _positive_int(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def round_e4m3(x):
    """Round to the nearest e4m3 (OCP FP8 E4M3, no infinities) value, ties to even; saturate at +-448.

    Inf saturates to +-448 (the conversion FA3 uses never produces NaN); NaN input is an error.
    Returns float64 for integer input, else the input's float dtype (every e4m3 value fits exactly).
    """
    arr = _float_array(x, "x")
    out_dtype = arr.dtype if arr.dtype.kind == "f" else np.dtype(np.float64)
    a = np.abs(arr.astype(np.float64))
    if np.isnan(a).any():
        raise ValueError("x contains NaN; e4m3 rounding needs real numbers (inf saturates to +-448)")
    a = np.minimum(a, E4M3_MAX)  # saturate first: nothing rounds past 448, inf becomes 448
    # The spacing of e4m3 values around a: 2^(e - 3) in the binade [2^e, 2^(e+1)), and a fixed
    # 2^-9 among the subnormals below 2^-6. frexp gives a = f * 2^k with f in [0.5, 1), so e = k - 1.
    _, k = np.frexp(np.maximum(a, E4M3_MIN_NORMAL))
    step = np.ldexp(1.0, k - 1 - MANTISSA_BITS)
    r = np.round(a / step) * step  # np.round rounds halves to the even integer: ties-to-even mantissa
    return np.copysign(r, arr).astype(out_dtype)


def _blocks(n, block):
    return [slice(i, min(i + block, n)) for i in range(0, n, block)]


def quantize_e4m3(x, block=None):
    """Scale x into e4m3's range and round. Returns (codes, scales) with x ~= codes * scale.

    block=None: one scale for the whole tensor (per-tensor scaling); scales has shape ().
    block=b: one scale per block of b rows along axis -2 (and per leading batch/head index), as FA3
    scales each Q, K and V tile; scales has shape x.shape[:-2] + (ceil(N / b),).
    Each scale maps the block's largest |value| to 448, so nothing saturates; all-zero blocks get 1.
    """
    x = _float_array(x, "x").astype(np.float64)
    if block is None:
        amax = np.abs(x).max() if x.size else 0.0
        scales = np.asarray(amax / E4M3_MAX if amax > 0 else 1.0)
        return round_e4m3(x / scales), scales
    block = _positive_int(block, "block")
    if x.ndim < 2:
        raise ValueError(f"block scaling needs x of shape (..., N, d); got shape {x.shape}")
    codes = np.empty_like(x)
    scales = np.empty(x.shape[:-2] + (len(_blocks(x.shape[-2], block)),))
    for b, rows in enumerate(_blocks(x.shape[-2], block)):
        amax = np.abs(x[..., rows, :]).max(axis=(-2, -1))
        s = np.where(amax > 0, amax / E4M3_MAX, 1.0)
        scales[..., b] = s
        codes[..., rows, :] = round_e4m3(x[..., rows, :] / s[..., None, None])
    return codes, scales


def dequantize_e4m3(codes, scales, block=None):
    """codes * scale, the inverse of quantize_e4m3 (exact: no further rounding)."""
    codes, scales = np.asarray(codes, np.float64), np.asarray(scales, np.float64)
    if block is None:
        return codes * scales
    block = _positive_int(block, "block")
    per_row = np.repeat(scales, block, axis=-1)[..., : codes.shape[-2]]
    return codes * per_row[..., None]


def fake_quantize_e4m3(x, block=None):
    """x rounded through e4m3 and scaled back: what an FP8 tensor core sees, as float64."""
    return dequantize_e4m3(*quantize_e4m3(x, block), block=block)


def round_p_e4m3(p):
    """A tile of softmax probabilities (values in [0, 1]) as FA3's FP8 kernel multiplies it with V: scaled
    by P_SCALE, rounded to e4m3, scaled back (the row sums are taken before rounding)."""
    return round_e4m3(np.asarray(p) * P_SCALE) / P_SCALE


def hadamard(d):
    """The d x d Hadamard matrix scaled by 1/sqrt(d), so it is orthogonal (Sylvester's construction)."""
    d = _positive_int(d, "d")
    if d & (d - 1):
        raise ValueError(f"d must be a power of two for a Hadamard matrix; got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def random_signs(d, seed=0):
    """d random +-1 values: the diagonal that makes the rotation random, so no fixed input defeats it."""
    return np.random.default_rng(seed).choice([-1.0, 1.0], size=_positive_int(d, "d"))


def incoherent_transform(q, k, *, seed=0):
    """(Q M, K M) with M = diag(signs) @ H, H the scaled Hadamard matrix. M is orthogonal, so
    (Q M)(K M)^T = Q M M^T K^T = Q K^T: the scores are unchanged, but an outlier in one feature is
    spread over all d features, so it no longer dominates its row's quantisation error.
    """
    q, k = _float_array(q, "q"), _float_array(k, "k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share their last dim d; got {q.shape[-1]} and {k.shape[-1]}")
    d = q.shape[-1]
    m = random_signs(d, seed)[:, None] * hadamard(d)
    return q @ m, k @ m


def fp8_attention(q, k, v, *, scaling="block", incoherent=False, block=128, seed=0, causal=False, scale=None,
                  quantize_p=True):
    """Attention with Q, K, V rounded to e4m3 the FA3 way, run by flashlab's FA2 forward in float32.

    scaling: "tensor" (one scale per tensor) or "block" (one per block of `block` rows).
    incoherent: rotate Q and K by incoherent_transform (seed picks the random signs) before quantising.
    quantize_p: round each tile of P with round_p_e4m3 before P V, as FA3 does (False keeps P float32).
    The default softmax scale is 1/sqrt(d) of the original d (the rotation keeps d). Returns O, float32.
    """
    from .tiled import flash_attention_v2

    if scaling not in ("tensor", "block"):
        raise ValueError(f"scaling must be 'tensor' or 'block'; got {scaling!r}")
    q, k, v = (_float_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if incoherent:
        q, k = incoherent_transform(q, k, seed=seed)
    b = block if scaling == "block" else None
    q8, k8, v8 = (fake_quantize_e4m3(x, b).astype(np.float32) for x in (q, k, v))
    big = max(q.shape[-2], k.shape[-2])  # large tiles keep NumPy's loop short; the result does not depend on them
    o, _ = flash_attention_v2(q8, k8, v8, causal=causal, scale=scale, block_q=min(big, 512), block_k=min(big, 1024),
                              round_p=round_p_e4m3 if quantize_p else None)
    return o


def outlier_inputs(shape, seed=0, *, outlier_std=10.0, p=1e-3):
    """Samples of N(0, 1) + N(0, outlier_std^2) * Bernoulli(p): the paper's inputs with rare large outliers."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    return base + outlier_std * rng.standard_normal(shape) * (rng.random(shape) < p)


def rmse(out, ref):
    """Root-mean-square error, the measure of the paper's Table 3."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2)))


def _study_inputs(n, d, heads, seed, outlier_std, p):
    """Q, K, V from outlier_inputs (seeds seed, seed+1, seed+2) and their float64 attention output."""
    from .tiled import flash_attention_v2

    n, d, heads = (_positive_int(x, name) for x, name in ((n, "n"), (d, "d"), (heads, "heads")))
    if not (np.isfinite(outlier_std) and outlier_std >= 0):
        raise ValueError(f"outlier_std must be a finite number >= 0; got {outlier_std!r}")
    if not 0 <= p <= 1:
        raise ValueError(f"p (the outlier probability) must be in [0, 1]; got {p!r}")
    q, k, v = (outlier_inputs((heads, n, d), seed + i, outlier_std=outlier_std, p=p) for i in range(3))
    ref, _ = flash_attention_v2(q, k, v, block_q=min(n, 512), block_k=min(n, 1024))  # float64 throughout
    return q, k, v, ref


def accuracy_study(n=8192, d=128, heads=1, *, block=128, seed=0, outlier_std=10.0, p=1e-3, quantize_p=True):
    """RMSE against float64 attention of per-tensor FP8, block FP8 and block FP8 + incoherent processing.

    Q, K and V are drawn from outlier_inputs((heads, n, d), outlier_std, p): the defaults are the paper's.
    P is rounded to FP8 too unless quantize_p=False. Returns {method: RMSE}.
    """
    q, k, v, ref = _study_inputs(n, d, heads, seed, outlier_std, p)
    runs = {
        "per-tensor": dict(scaling="tensor"),
        "block": dict(scaling="block"),
        "block + incoherent": dict(scaling="block", incoherent=True),
    }
    return {name: rmse(fp8_attention(q, k, v, block=block, seed=seed, quantize_p=quantize_p, **kw), ref)
            for name, kw in runs.items()}



def error_vs_block(blocks, n=512, d=64, heads=1, *, seed=0, outlier_std=10.0, p=1e-3, metric="relative",
                   quantize_p=True):
    """Error of block-scaled FP8 attention at each block size in `blocks`, without and with incoherent
    processing, on the inputs of accuracy_study. A block of n rows or more is per-tensor scaling (per head).

    metric: "relative" (||O - ref|| / ||ref||, the course's measure) or "rmse" (the paper's).
    Returns {False: errors, True: errors}, keyed by `incoherent`, each an array aligned with `blocks`.
    """
    if metric not in ("relative", "rmse"):
        raise ValueError(f"metric must be 'relative' or 'rmse'; got {metric!r}")
    blocks = [_positive_int(b, "block") for b in blocks]
    q, k, v, ref = _study_inputs(n, d, heads, seed, outlier_std, p)

    def error(o):
        return rmse(o, ref) if metric == "rmse" else float(np.linalg.norm(o - ref) / np.linalg.norm(ref))

    return {inc: np.array([error(fp8_attention(q, k, v, block=b, incoherent=inc, seed=seed, quantize_p=quantize_p))
                           for b in blocks]) for inc in (False, True)}
