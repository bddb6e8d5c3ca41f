"""flashlab inside PyTorch: an autograd Function and a drop-in scaled_dot_product_attention (lesson 13).

    from flashlab.torch import scaled_dot_product_attention as sdpa
    y = sdpa(q, k, v, is_causal=True)          # like torch.nn.functional.scaled_dot_product_attention
    y.sum().backward()                         # gradients from flashlab's FA2 backward

CPU tensors run the NumPy FA2 (`flash_attention_v2` / `flash_attention_v2_backward`); CUDA tensors run the
Numba kernels (`flashlab.kernels`): the forward on Hopper's wgmma (variant "wgmma", FlashAttention-3: float16 and
bfloat16 at d = 64 or 128, without the library's options), else on tensor cores (variant "tensor": float16,
bfloat16, and float32 through 3xTF32) on GPUs that have them for the dtype, else the register kernel; the backward on
Hopper's wgmma where it was measured faster (kernels/wgmma_backward.py: 16-bit, d = 64 or 128, Nq and Nk of 512
or more, no options or GQA; kernels/plan.wgmma_backward_fits), else on tensor cores for float16 and bfloat16
(kernels/tensor_backward.py), on the FP32 units for float32. Under
`torch.autocast`, q, k and v are cast to the autocast dtype first, as PyTorch's own attention is. The
forward saves q, k, v, o and the log-sum-exp lse (one number per query row) for the backward, which
recomputes P from lse: no Nq x Nk tensor is kept between the passes.

Beyond torch's signature, the FlashAttention library's options (lesson 18; semantics of
`flashlab.reference_attention`): grouped-query attention (k, v with H_kv heads, H_kv dividing H; torch's
`enable_gqa=True`), `window_size=(left, right)`, `align` ("top_left" as torch, or "bottom_right"),
`alibi_slopes` (H,) or (B, H), `softcap` and `dropout_p` with a `seed` (drawn from torch's generator when not
given, and kept for the backward, which regenerates the mask). GQA runs everywhere. On CUDA every option runs on
the kernel the call would use without it (tensor cores for float16 and bfloat16, forward and backward), drawing
the same dropout mask as on the CPU for the same seed; the seed is a kernel argument, so a new seed per step
compiles nothing.

Packed variable-length batches: `flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)` with
autograd (the NumPy varlen on CPU tensors, the one-launch kernels on CUDA ones: the forward on tensor cores
for 16-bit inputs, the backward on the register kernel, float32 and float16).

This module is named `torch` inside the flashlab package. Its `import torch` lines are absolute imports
(flashlab itself imports its own modules relatively), so they find the real PyTorch; they sit inside the
functions so that `import flashlab` never imports torch.
"""
from __future__ import annotations

import math

from ._inputs import OPTION_DEFAULTS

__all__ = ["FlashAttentionFunction", "scaled_dot_product_attention", "flash_attention", "flash_attention_varlen"]

_CPU_DTYPES = ("float16", "float32", "float64")
_TENSOR_D = (16, 32, 64, 128)  # head dims of the tensor kernels
_CUDA_DTYPES = ("float16", "bfloat16", "float32")


def _function_class():
    """Build the autograd Function on first use (torch is imported only then)."""
    import torch
    from torch.autograd.function import once_differentiable

    class FlashAttentionFunction(torch.autograd.Function):
        """o = softmax(scale * q k^T [causal mask]) v, with flashlab's FlashAttention-2 forward and backward.

        apply(q, k, v, is_causal=False, scale=None, options=None): q (B, Nq, d) or (B, H, Nq, d); k, v
        (..., Nk, d|dv); options: a dict of the library options (see the module's docstring, `_options`).
        Saves (q, k, v, o, lse) with lse of shape (B[, H], Nq); look at `o.grad_fn.saved_tensors`.
        """

        @staticmethod
        def forward(ctx, q, k, v, is_causal=False, scale=None, options=None):
            options = options or {}
            # a kept call was made for tensors of this key (shapes, strides, dtypes, device), which passed the checks
            plain = not options and getattr(q, "is_cuda", False)
            call = _fast_call("forward", (q, k, v), bool(is_causal), scale) if plain else None
            if call is None:
                _check_tensors(q, k, v)
                o, lse = _forward(q, k, v, bool(is_causal), scale, options)
            else:
                o, lse = call(q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.is_causal, ctx.scale, ctx.options = bool(is_causal), scale, options
            return o

        @staticmethod
        @once_differentiable
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.is_causal, ctx.scale, ctx.options)
            need = ctx.needs_input_grad
            return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None)

    FlashAttentionFunction.__module__ = __name__
    FlashAttentionFunction.__qualname__ = "FlashAttentionFunction"
    return FlashAttentionFunction


def _check_tensors(q, k, v):
    import torch

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() not in (3, 4):
            raise ValueError(f"{name} must have 3 dims (batch, N, d) or 4 dims (batch, heads, N, d); "
                             f"got shape {tuple(x.shape)}")
        allowed = _CUDA_DTYPES if x.is_cuda else _CPU_DTYPES
        if str(x.dtype).replace("torch.", "") not in allowed:
            raise TypeError(f"{name} has dtype {x.dtype}; flashlab takes {', '.join('torch.' + a for a in allowed)} "
                            f"on {'CUDA' if x.is_cuda else 'the CPU'} (convert with {name}.float())")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"q, k and v must have the same number of dims; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flashlab runs on CPU or CUDA tensors; got device {q.device}")


def _to_numpy(x):
    return x.detach().contiguous().numpy()


_DEFAULTS = dict(OPTION_DEFAULTS, seed=0)


def _options(window_size=(-1, -1), align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None):
    """The library options as a dict holding only those that differ from the defaults (alibi_slopes as a float64
    NumPy array; a seed drawn from torch's generator when dropout is on and none is given)."""
    import numpy as np
    import torch

    if isinstance(alibi_slopes, torch.Tensor):
        alibi_slopes = alibi_slopes.detach().cpu().double().numpy()
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # random per call, as torch's dropout; saved for backward
    given = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                 dropout_p=dropout_p, seed=0 if seed is None else seed)
    out = {}
    for name, value in given.items():
        default = _DEFAULTS[name]
        if name == "alibi_slopes":
            if value is not None:
                out[name] = np.asarray(value, dtype=np.float64)
        elif name == "window_size":
            if not (isinstance(value, (tuple, list)) and tuple(value) == default):
                out[name] = value  # a bad value reaches the NumPy check, which names it
        elif name == "seed":
            if given["dropout_p"]:
                out[name] = value
        elif value != default:
            out[name] = value
    return out


# Plain 4-D CUDA calls, by (direction, the tensors' key: shapes, strides, dtypes, device; causal, scale): the
# kernels' prepared call that the first such call made (kernels.forward.prepared_call, backward.prepared_call). A
# later call with the same key goes straight to it: no variant choice, stride checks or kernel-side key (a GPT's
# attention calls with one key every step, and a training step is host-bound at small sizes; measured in
# benchmarks/profiling/torch_call_host.py).
_CALLS: dict = {}


def _fast_call(direction, tensors, causal, scale):
    """The kept prepared call for these tensors, or None (then the general way runs, and keeps one)."""
    from .kernels import prepared

    call = _CALLS.get((direction, prepared.torch_key(*tensors), causal, scale))
    if call is None or any(t.data_ptr() % 16 for t in tensors):  # TMA and cp.async read 16-byte aligned rows
        return None
    return call


def _keep_call(direction, tensors, causal, scale, call):
    from .kernels import prepared

    if call is not None:
        if len(_CALLS) >= prepared.MAX_CALLS:
            _CALLS.pop(next(iter(_CALLS)))
        _CALLS[(direction, prepared.torch_key(*tensors), causal, scale)] = call


def _forward(q, k, v, causal, scale, options=None):
    """(o, lse) as tensors on q's device: the NumPy FA2 on the CPU, the Numba kernel on CUDA."""
    import torch

    options = options or {}
    if q.is_cuda:
        plain = not options and q.dim() == 4
        call = _fast_call("forward", (q, k, v), causal, scale) if plain else None
        if call is not None:
            return call(q, k, v)
        from .kernels import flash_attention
        from .kernels.forward import prepared_call

        four = q.dim() == 4
        # (B, N, d) as (1, B, N, d): the NumPy code reads the leading dim as heads of batch 0 (the dropout key's
        # head, ALiBi's (H,) slopes), so CUDA draws the CPU's mask
        q4, k4, v4 = (x if four else x.unsqueeze(0) for x in (q, k, v))
        variant = _cuda_variant(q, bool(options))  # tensor and register take every option
        if variant == "tensor":  # the tensor kernel reads 16-byte chunks of rows: the last dim must be contiguous
            q4, k4, v4 = (x if x.stride(-1) == 1 else x.contiguous() for x in (q4, k4, v4))
        elif variant == "wgmma":  # TMA reads any (B, H, N, d) strides but a few (_tma_readable)
            q4, k4, v4 = (_tma_readable(x) for x in (q4, k4, v4))
        o, lse = flash_attention(q4.detach(), k4.detach(), v4.detach(), causal=causal, scale=scale, variant=variant,
                                 **options)
        if plain and all(a is b for a, b in zip((q4, k4, v4), (q, k, v))):  # no copies: the same tensors can take the kept call
            _keep_call("forward", (q, k, v), causal, scale, prepared_call(q, k, v, causal, scale, variant))
        return (o, lse) if four else (o.squeeze(0), lse.squeeze(0))
    from .tiled import flash_attention_v2

    o, lse = flash_attention_v2(_to_numpy(q), _to_numpy(k), _to_numpy(v), causal=causal, scale=scale, **options)
    return torch.from_numpy(o), torch.from_numpy(lse)


def _tma_readable(x):
    """x, or a contiguous copy where TMA cannot read it in place: the wgmma kernels' tensor maps take a contiguous
    last axis and other strides of multiples of 16 bytes (kernels/wgmma.check_tma_strides); a (B, N, H, d) tensor's
    transpose(1, 2), as a GPT makes its heads, passes, so neither direction copies it."""
    from .kernels import wgmma

    return x if x.dim() == 4 and wgmma.torch_strides(x) is not None else x.contiguous()


def _cuda_variant(q, options: bool = False) -> str:
    """The forward kernel for q on this GPU: flashlab.kernels.plan.forward_variant decides (wgmma on Hopper for
    16-bit inputs without options, the tensor kernel where the GPU has the dtype's mma, else the register one)."""
    from .device import device_limits
    from .kernels.plan import forward_variant

    return forward_variant(str(q.dtype).replace("torch.", ""), q.shape[-1], device_limits()["cc"], options)


def _backward(q, k, v, o, lse, do, causal, scale, options=None):
    import torch

    options = options or {}
    if q.is_cuda:
        plain = not options and q.dim() == 4
        tensors = (q, k, v, o, lse, do)
        call = _fast_call("backward", tensors, causal, scale) if plain else None
        if call is not None:
            return call(*tensors)
        from .device import device_limits
        from .kernels import flash_attention_backward
        from .kernels.backward import default_variant, prepared_call
        from .kernels.plan import wgmma_backward_fits

        four = q.dim() == 4
        args = [x if four else x.unsqueeze(0) for x in tensors]
        variant = default_variant(q) if q.shape[-1] in _TENSOR_D else "register"  # both variants take the options
        if wgmma_backward_fits(str(q.dtype).replace("torch.", ""), q.shape[-1], device_limits()["cc"], q.shape[-2],
                               k.shape[-2], gqa=q.shape[-3] != k.shape[-3], options=bool(options)):
            variant = "wgmma"
            args = [_tma_readable(x) for x in args]  # a GPT's (B, N, H, d) heads are read in place
        elif variant == "tensor":  # 16-byte copies of rows: the last dim must be contiguous (do may be a broadcast)
            args = [x if x.stride(-1) == 1 else x.contiguous() for x in args]
        grads = flash_attention_backward(*(x.detach() for x in args), causal=causal, scale=scale, variant=variant,
                                         **options)
        if plain and all(a is t for a, t in zip(args, tensors)) and all(g.dtype == q.dtype for g in grads):
            _keep_call("backward", tensors, causal, scale, prepared_call(*tensors, causal, scale, variant))
        grads = tuple(g.to(q.dtype) for g in grads)
        return grads if four else tuple(g.squeeze(0) for g in grads)
    from .tiled import flash_attention_v2_backward

    grads = flash_attention_v2_backward(*(_to_numpy(x) for x in (q, k, v, o, lse, do)), causal=causal, scale=scale,
                                        **options)
    return tuple(torch.from_numpy(g) for g in grads)


def flash_attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), align="top_left",
                    alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
    """(o, lse) for torch tensors, without autograd: handy for looking at the log-sum-exp."""
    _check_tensors(q, k, v)
    options = _options(window_size, align, alibi_slopes, softcap, dropout_p, seed)
    return _forward(q, k, v, bool(causal), scale, options)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False, window_size=(-1, -1), align="top_left", alibi_slopes=None,
                                 softcap=0.0, seed=None):
    """A drop-in for torch.nn.functional.scaled_dot_product_attention, backed by flashlab's FA2.

    Supported: 3-dim (batch, N, d) or 4-dim (batch, heads, N, d) tensors of one shape family, is_causal
    (top-left aligned, as torch, unless align="bottom_right"), scale (default 1/sqrt(d)), Nq != Nk, a different
    dv, grouped-query attention with enable_gqa=True (as torch), dropout_p (flashlab's counter-based mask: a
    `seed` gives the same mask every time; without one each call draws a seed from torch's generator).
    Beyond torch: window_size, align, alibi_slopes and softcap, as in flashlab.reference_attention (CUDA tensors:
    float32, float16 and bfloat16; dropout on CUDA in float32 and float16). Not supported, with a
    NotImplementedError that says so: attn_mask.
    """
    if attn_mask is not None:
        raise NotImplementedError(
            f"flashlab's scaled_dot_product_attention does not take attn_mask (got a {type(attn_mask).__name__}"
            f"{' of shape ' + str(tuple(attn_mask.shape)) if hasattr(attn_mask, 'shape') else ''}); for causal "
            "masking pass is_causal=True, otherwise use torch.nn.functional.scaled_dot_product_attention")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1); got {dropout_p!r}")
    if getattr(query, "dim", lambda: 0)() == 4 and getattr(key, "dim", lambda: 0)() == 4 \
            and query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key/value {key.shape[1]}: pass enable_gqa=True for "
                         "grouped-query attention (as torch's scaled_dot_product_attention asks)")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be True or False; got {is_causal!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise TypeError(f"scale must be a finite number or None; got {scale!r}")
    if window_size == (-1, -1) and align == "top_left" and alibi_slopes is None and not softcap and not dropout_p:
        options = {}  # the common call: none of the library's options
    else:
        options = _options(window_size, align, alibi_slopes, softcap, float(dropout_p), seed)
    query, key, value = _autocast(query, key, value)
    return _get_function().apply(query, key, value, is_causal, scale, options)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, scale=None, window_size=(-1, -1), align="top_left", alibi_slopes=None,
                           softcap=0.0, dropout_p=0.0, seed=None):
    """Attention over packed sequences with autograd, as the FA library's flash_attn_varlen_func: q of shape
    (total_q, H, d), k and v (total_k, H_kv, d), cu_seqlens_* (batch + 1,) integer tensors or lists. Returns o
    (total_q, H, d). CPU tensors run flashlab.varlen (NumPy); CUDA tensors (float32, float16) the one-launch
    kernels (kernels.flash_attention_varlen and its backward). Options as in scaled_dot_product_attention."""
    import numpy as np
    import torch

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-dim torch.Tensor (total, heads, d) for varlen; got "
                             f"{type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}")
    cu = [np.asarray(c.detach().cpu() if isinstance(c, torch.Tensor) else c) for c in (cu_seqlens_q, cu_seqlens_k)]
    options = dict(_options(window_size, align, alibi_slopes, softcap, float(dropout_p), seed),
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    q, k, v = _autocast(q, k, v)
    return _get_varlen_function().apply(q, k, v, cu[0], cu[1], bool(causal), scale, options)


def _varlen_function_class():
    import torch
    from torch.autograd.function import once_differentiable

    class FlashAttentionVarlenFunction(torch.autograd.Function):
        """flash_attention_varlen's autograd Function: saves (q, k, v, o, lse), lse of shape (H, total_q)."""

        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, options):
            if q.is_cuda:
                from .kernels import flash_attention_varlen as run
            else:
                from .varlen import flash_attention_varlen as run
            o, lse = run(*_varlen_inputs(q, k, v), cu_q, cu_k, causal=causal, scale=scale, **options)
            o, lse = (x if q.is_cuda else torch.from_numpy(x) for x in (o, lse))
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.args = cu_q, cu_k, causal, scale, options
            return o

        @staticmethod
        @once_differentiable
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            cu_q, cu_k, causal, scale, options = ctx.args
            if q.is_cuda:
                from .kernels import flash_attention_varlen_backward as run
            else:
                from .varlen import flash_attention_varlen_backward as run
            grads = run(*_varlen_inputs(q, k, v, o, lse, do), cu_q, cu_k, causal=causal, scale=scale, **options)
            grads = [g.to(q.dtype) if q.is_cuda else torch.from_numpy(g) for g in grads]
            return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None, None, None)

    FlashAttentionVarlenFunction.__module__ = __name__
    return FlashAttentionVarlenFunction


def _varlen_inputs(*xs):
    """CUDA tensors as they are (the kernels read strides; detached), CPU ones as NumPy arrays."""
    return [x.detach() if x.is_cuda else _to_numpy(x) for x in xs]


def _get_varlen_function():
    cls = globals().get("FlashAttentionVarlenFunction")
    if cls is None:
        cls = globals()["FlashAttentionVarlenFunction"] = _varlen_function_class()
    return cls


def _autocast(*xs):
    """Under torch.autocast on CUDA, the tensors in the autocast dtype (as PyTorch's attention runs there);
    the casts are ordinary autograd ops, so gradients flow back in the callers' dtypes."""
    import torch

    if not all(isinstance(x, torch.Tensor) and x.is_cuda for x in xs) or not torch.is_autocast_enabled("cuda"):
        return xs
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(x.to(dtype) if x.dtype != dtype and x.is_floating_point() else x for x in xs)


def _get_function():
    cls = globals().get("FlashAttentionFunction")
    if cls is None:
        cls = globals()["FlashAttentionFunction"] = _function_class()  # built once
    return cls


def __getattr__(name):  # `flashlab.torch.FlashAttentionFunction` builds the class on first access
    if name == "FlashAttentionFunction":
        return _get_function()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
