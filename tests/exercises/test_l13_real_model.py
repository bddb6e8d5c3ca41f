"""Lesson 13's exercises (an autograd Function, the backward's memory, attention over a KV cache): each checker
passes the solution, grades the blank "not implemented", and rejects plausible wrong solutions with a
message and a hint that names the usual slips. Needs PyTorch."""
import numpy as np
import pytest

import flashlab
from exercise_harness import Lesson

torch = pytest.importorskip("torch")
F = torch.nn.functional

LESSON = Lesson("13_real_model")
mutant = LESSON.mutant


# -- attention_function ------------------------------------------------------------------------------
def _function(forward_extra=None, backward=None, causal_fwd=None, save_p=False, scale=None):
    """An autograd Function built from the library, with one thing changed."""

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal):
            c = is_causal if causal_fwd is None else causal_fwd
            qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
            o, lse = flashlab.flash_attention_v2(qn, kn, vn, causal=c, scale=scale)
            o, lse = torch.from_numpy(o), torch.from_numpy(lse)
            saved = [q, k, v, o, lse]
            if save_p:
                S = torch.from_numpy(qn @ np.swapaxes(kn, -1, -2) / np.sqrt(qn.shape[-1]))
                saved.append(torch.softmax(S, -1))
            ctx.save_for_backward(*saved)
            ctx.is_causal = is_causal
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = (x.detach().numpy() for x in ctx.saved_tensors[:5])
            g = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do.numpy(), causal=ctx.is_causal)
            g = [torch.from_numpy(x) for x in g]
            return (*(backward(g) if backward else g), None)

    return lambda q, k, v, is_causal: F.apply(q, k, v, is_causal)


mutant("attention_function")(_function(save_p=True))  # keeps the N x N probabilities for the backward
mutant("attention_function")(_function(backward=lambda g: (g[1], g[0], g[2]) if g[0].shape == g[1].shape else (g[0], g[0][..., :1, :].expand_as(g[1]), g[2])))  # dq/dk mixed up
mutant("attention_function")(_function(causal_fwd=False))  # forward ignores is_causal
mutant("attention_function")(_function(backward=lambda g: (g[0] * 0, g[1], g[2])))  # forgets dq
mutant("attention_function")(_function(scale=1.0))  # no 1/sqrt(d) in the forward


@mutant("attention_function")
def plain_torch_attention(q, k, v, is_causal):  # right numbers, but keeps S and P through autograd
    d = q.shape[-1]
    S = q @ k.transpose(-1, -2) / d ** 0.5
    if is_causal:
        S = S.masked_fill(~torch.ones(S.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(S, -1) @ v


# -- backward_memory ---------------------------------------------------------------------------------
def _memory(*, lse_in_input_dtype=False, with_o=True, v_width_d=False, p_float32=False, p_square=False):
    def memory(B, H, nq, nk, d, dv, dtype):
        size = dtype.itemsize
        lse = size if lse_in_input_dtype else (8 if dtype == torch.float64 else 4)
        w = d if v_width_d else dv
        saved = B * H * (nq * d + nk * d + nk * w + with_o * nq * w) * size + B * H * nq * lse
        return saved, B * H * nq * (nq if p_square else nk) * (4 if p_float32 else size)
    return memory


mutant("backward_memory", hint="float32")(_memory(lse_in_input_dtype=True))  # lse in float16 for float16 inputs
mutant("backward_memory", hint="output O")(_memory(with_o=False))  # forgets O
mutant("backward_memory")(_memory(v_width_d=True))  # V and O with d columns
mutant("backward_memory")(_memory(p_float32=True))  # P always float32
mutant("backward_memory")(_memory(p_square=True))  # P as Nq x Nq


@mutant("backward_memory")
def memory_in_numbers(B, H, nq, nk, d, dv, dtype):  # counts numbers, not bytes
    return B * H * (nq * d + nk * d + nk * dv + nq * dv + nq), B * H * nq * nk


# -- cached_attention --------------------------------------------------------------------------------
@mutant("cached_attention", hint="top-left")
def cached_top_left(q, k, v):  # is_causal=True: right only when Nq == Nk
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@mutant("cached_attention", hint="Only a single new token")
def cached_no_mask(q, k, v):  # right only for one new token
    return F.scaled_dot_product_attention(q, k, v)


@mutant("cached_attention")
def cached_pad_after(q, k, v):  # pads the queries on the wrong side: top-left again
    nq, nk = q.shape[-2], k.shape[-2]
    pad = torch.zeros(q.shape[:-2] + (nk - nq, q.shape[-1]), dtype=q.dtype)
    return F.scaled_dot_product_attention(torch.cat([q, pad], -2), k, v, is_causal=True)[..., :nq, :]


@mutant("cached_attention")
def cached_cache_only(q, k, v):  # new tokens see the cache but not each other (nor themselves)
    nq, nk = q.shape[-2], k.shape[-2]
    keep = nk - nq if nk > nq else nk
    return F.scaled_dot_product_attention(q, k[..., :keep, :], v[..., :keep, :])


@mutant("cached_attention")
def cached_float32(q, k, v):  # computes in float32 whatever the input
    nq, nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(q.dtype)


globals().update(LESSON.standard_tests())
