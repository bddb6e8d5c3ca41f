"""Lesson 13, flashlab inside a PyTorch model: an autograd Function, the memory it keeps for the backward,
and causal attention for a decoder with a KV cache."""
from __future__ import annotations

import numpy as np

from .core import exercise

LESSON = "13_real_model"


@exercise("attention_function", lesson=LESSON, time_limit=60,
          hint="forward: run flashlab.flash_attention_v2 on the tensors' NumPy arrays and save q, k, v, o and "
               "lse with ctx.save_for_backward; backward: flashlab.flash_attention_v2_backward from those "
               "five and dO, with the same causal flag and scale.")
def check_attention_function(t, fn):
    import torch
    import torch.nn.functional as F

    specs = [("the example", (2, 2, 8, 4), 8, 4, False, torch.float64, 1.0),
             ("causal", (2, 2, 8, 4), 8, 4, True, torch.float64, 1.0),
             ("3-dim inputs (batch, N, d)", (3, 11, 8), 11, 8, True, torch.float64, 1.0),
             ("ragged, Nq != Nk, dv != d", (1, 3, 13, 8), 29, 5, False, torch.float64, 1.0),
             ("causal with Nq != Nk", (1, 2, 9, 8), 5, 8, True, torch.float64, 1.0),
             ("large logits", (1, 2, 10, 16), 10, 16, True, torch.float64, 20.0),
             ("float32", (2, 2, 33, 16), 33, 16, True, torch.float32, 1.0)]
    for label, q_shape, nk, dv, causal, dtype, size in specs:
        t.case(label, q_shape=q_shape, Nk=nk, dv=dv, is_causal=causal, dtype=str(dtype))
        shapes = (q_shape, q_shape[:-2] + (nk, q_shape[-1]), q_shape[:-2] + (nk, dv))
        q, k, v = (torch.tensor(t.normal(s, np.float64, f), dtype=dtype, requires_grad=True)
                   for s, f in zip(shapes, (size, 1, 1)))
        out = t.call(q, k, v, causal)
        if not isinstance(out, torch.Tensor):
            raise t.fail(f"return the output tensor o (from YourFunction.apply); got {type(out).__name__}")
        if out.grad_fn is None:
            raise t.fail("the output has no grad_fn: return the result of your autograd Function's apply(...), "
                         "computed from the inputs that require grad")
        # The reference in float64, so that a float32 answer is judged against the truth, not against
        # torch's own float32 rounding.
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        t.compare(out.detach().numpy(), ref.detach().numpy(), "o", dtype=out.detach().numpy().dtype, tol=tol)
        if out.dtype != q.dtype:
            raise t.fail(f"o has dtype {out.dtype}; expected the inputs' {q.dtype}")
        saved = getattr(out.grad_fn, "saved_tensors", ())
        nq = q_shape[-2]
        big = [tuple(s.shape) for s in saved if s.dim() >= 2 and s.shape[-2:] == (nq, nk)]
        if big:
            raise t.fail(f"your Function saved a tensor of shape {big[0]}: an Nq x Nk matrix (S or P). Save the "
                         "log-sum-exp, one number per query row, and recompute P in the backward.")
        if not any(tuple(s.shape) == tuple(q_shape[:-1]) for s in saved):
            raise t.fail(f"save the log-sum-exp lse (shape {tuple(q_shape[:-1])}) with ctx.save_for_backward; "
                         f"the saved tensors have shapes {[tuple(s.shape) for s in saved]}")
        do = torch.tensor(t.normal(out.shape, np.float64), dtype=dtype)
        try:
            grads = torch.autograd.grad(out, (q, k, v), do)
        except Exception as exc:
            raise t.fail(f"the backward raised {type(exc).__name__}: {exc}") from None
        want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            if g.shape != w.shape:
                raise t.fail(f"{name} has shape {tuple(g.shape)}; expected {tuple(w.shape)} (the input's)")
            t.compare(g.detach().numpy(), w.detach().numpy(), name, dtype=g.detach().numpy().dtype, tol=tol * 10)


@exercise("backward_memory", lesson=LESSON,
          hint="Look at o.grad_fn.saved_tensors of a small example: which tensors, which shapes, which dtypes. "
               "Q (Nq x d), K (Nk x d), V (Nk x dv), O (Nq x dv) per (batch, head) in the inputs' dtype, plus one "
               "lse per query row in float32 (float64 for float64 inputs). P has Nq x Nk entries per (batch, head).")
def check_backward_memory(t, fn):
    import torch

    f16, f32, f64 = torch.float16, torch.float32, torch.float64
    specs = [("the lesson's layer", 8, 12, 4096, 4096, 64, 64, f32), ("float16", 4, 16, 2048, 2048, 128, 128, f16),
             ("float64", 2, 4, 1000, 1000, 32, 32, f64), ("decoding: one query, a long cache", 16, 32, 1, 32768, 128, 128, f16),
             ("V wider than Q and K", 1, 2, 300, 500, 16, 48, f32)]
    for dtype in (f16, f32, f64):
        B, H = (int(x) for x in t.rng.integers(1, 33, 2))
        nq, nk = (int(x) for x in t.rng.integers(1, 20000, 2))
        d, dv = (int(2 ** x) for x in t.rng.integers(4, 9, 2))
        specs.append(("random", B, H, nq, nk, d, dv, dtype))
    for label, B, H, nq, nk, d, dv, dtype in specs:
        t.case(label, B=B, H=H, Nq=nq, Nk=nk, d=d, dv=dv, dtype=str(dtype))
        out = t.call(B, H, nq, nk, d, dv, dtype)
        if not isinstance(out, (tuple, list, np.ndarray)) or len(out) != 2:
            raise t.fail(f"return a pair (bytes your Function saves, bytes of P); got {out!r:.80}")
        size, lse_size = dtype.itemsize, (8 if dtype == f64 else 4)
        tensors = B * H * (nq * d + nk * d + nk * dv + nq * dv)
        flash = tensors * size + B * H * nq * lse_size
        p = B * H * nq * nk * size
        t.scalar(out[0], flash, "the bytes saved for backward", tol=1e-12, slips=[
            (tensors * size + B * H * nq * size, f"The lse is kept in float32 for {dtype} inputs, not in the inputs' "
                                                 "dtype: look at the saved tensors' dtypes." if dtype == f16 else
                                                 "The lse is kept in float64 for float64 inputs."),
            (flash - B * H * nq * dv * size, "The Function also saves its output O: the backward needs it for "
                                             "D = rowsum(dO * O)."),
            (B * H * (2 * nq * d + 2 * nk * d) * size + B * H * nq * lse_size,
             "V and O have dv columns, which need not equal d."),
            (tensors * size + B * H * nq * nk * lse_size, "The lse is one number per query row, not per score."),
            (tensors * size, "Count the lse too: one number per query row."),
            (flash / (B * H), "Count every (batch, head): B * H of each."),
            (tensors + B * H * nq, "Bytes, not numbers: multiply by each tensor's element size.")])
        t.scalar(out[1], p, "the bytes of P", tol=1e-12, slips=[
            (B * H * nq * nk * 4, f"P in the inputs' dtype ({dtype}), as the three-operation attention keeps it."),
            (B * H * nq * nq * size, "P is Nq x Nk per (batch, head): one probability per query and key."),
            (nq * nk * size, "Count every (batch, head): B * H matrices."),
            (B * H * nq * nk, "Bytes, not numbers: multiply by the element size.")])


def _masked_reference(q, k, v, offset):
    """softmax(q k^T / sqrt(d) with query i seeing keys j <= i + offset; offset None: no mask) v, in float64."""
    S = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if offset is not None:
        i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
        S = np.where(j <= i + offset, S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    return (P / P.sum(-1, keepdims=True)) @ v


@exercise("cached_attention", lesson=LESSON, time_limit=30,
          hint="The Nq new tokens are the LAST Nq of the Nk: new token i sits at position Nk - Nq + i and sees keys "
               "0 .. Nk - Nq + i. is_causal=True aligns the mask top-left (query i sees keys 0 .. i), which is right "
               "only when Nq == Nk. Build the mask yourself, or split the keys into the cache and the new block.")
def check_cached_attention(t, fn):
    import torch

    f32, f64 = torch.float32, torch.float64
    specs = [("the example: 3 new tokens, 5 cached", (1, 1), 3, 8, 4, 4, f64), ("one new token (decoding)", (2, 3), 1, 20, 8, 8, f64),
             ("no cache yet (Nq == Nk)", (1, 2), 9, 9, 8, 8, f64), ("a chunk of new tokens", (2, 2), 16, 40, 16, 8, f64),
             ("float32", (1, 4), 7, 33, 16, 16, f32)]
    nq = int(t.rng.integers(2, 20))
    specs.append(("random", (int(t.rng.integers(1, 3)), int(t.rng.integers(1, 4))), nq, nq + int(t.rng.integers(1, 50)),
                  int(2 ** t.rng.integers(2, 6)), int(t.rng.integers(1, 20)), f64))
    for label, lead, nq, nk, d, dv, dtype in specs:
        t.case(label, q=lead + (nq, d), k=lead + (nk, d), v=lead + (nk, dv), dtype=str(dtype))
        q, k, v = (t.normal(lead + s) for s in ((nq, d), (nk, d), (nk, dv)))
        out = t.call(*(torch.tensor(x, dtype=dtype) for x in (q, k, v)))
        if not isinstance(out, torch.Tensor):
            raise t.fail(f"return a torch tensor of shape {lead + (nq, dv)}; got {type(out).__name__}")
        if out.dtype != dtype:
            raise t.fail(f"the output has dtype {out.dtype}; expected the inputs' {dtype}")
        ref = _masked_reference(q, k, v, nk - nq)
        slips = [(_masked_reference(q, k, v, 0), "That is the top-left causal mask (is_causal=True): new token i sees "
                                                 "keys 0..i, but it sits at position Nk - Nq + i of the sequence."),
                 (_masked_reference(q, k, v, None), "Every new token sees every key here, also the new tokens after it. "
                                                    "Only a single new token (Nq = 1) needs no mask.")]

        def explain(o, slips=slips):
            o = np.asarray(o, np.float64)
            for wrong, why in slips:
                if np.allclose(o, wrong, rtol=1e-4, atol=1e-6):
                    return [], why
            if np.allclose(o, ref, rtol=1e-4, atol=1e-6):
                return [], f"Close, but not to {dtype} accuracy: compute in the inputs' dtype throughout."
            return [], None

        t.compare(out.detach().cpu().numpy(), ref, "the output", tol=1e-10 if dtype == f64 else 1e-5, explain=explain,
                  min_dtype=np.float32)
