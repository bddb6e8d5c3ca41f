"""Lesson 13, flashlab inside a PyTorch model: an autograd Function."""
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
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
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
        want = torch.autograd.grad(ref, (q, k, v), do)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            if g.shape != w.shape:
                raise t.fail(f"{name} has shape {tuple(g.shape)}; expected {tuple(w.shape)} (the input's)")
            t.compare(g.detach().numpy(), w.detach().numpy(), name, dtype=g.detach().numpy().dtype, tol=tol * 10)
