# %% [markdown]
# # Exercises 13: FlashAttention as a PyTorch autograd Function
#
# Goes with lesson [13 into a real model](../notebooks/13_real_model.ipynb). You will write the CPU path
# of `flashlab.torch.FlashAttentionFunction` yourself: a `torch.autograd.Function` whose forward runs the
# NumPy FlashAttention-2 of lesson 05 and whose backward runs the FA2 backward of lesson 06
# (FlashAttention-2, Dao 2023, arXiv 2307.08691, Algorithms 1 and 2).
#
# The rule that makes it *Flash*attention: between forward and backward, keep **one number per query
# row** (the log-sum-exp `lse`), never the Nq x Nk matrices S or P. The checker looks at what your
# Function saved.

# %%
import numpy as np
import torch
import torch.nn.functional as F

import flashlab

# %% [markdown]
# ## 1. Forward and backward
#
# A `torch.autograd.Function` has two static methods:
#
# - `forward(ctx, q, k, v, is_causal)` computes the output from plain tensors and stores what the
#   backward needs with `ctx.save_for_backward(...)` (tensors) or as attributes of `ctx` (anything else);
# - `backward(ctx, do)` receives dL/dO and returns one gradient per input of `forward`: `(dq, dk, dv, None)`
#   (`None` for `is_causal`, which has no gradient).
#
# Tools: `x.detach().numpy()` gives a tensor's NumPy array (no copy, no autograd history);
# `torch.from_numpy(a)` goes back. `flashlab.flash_attention_v2(q, k, v, causal=...)` returns `(o, lse)`;
# `flashlab.flash_attention_v2_backward(q, k, v, o, lse, do, causal=...)` returns `(dq, dk, dv)`. Both
# take any leading dims, so (batch, N, d) and (batch, heads, N, d) work alike.

# %%
import torch


class MyFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        ### BEGIN SOLUTION
        o, lse = flashlab.flash_attention_v2(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                                             causal=is_causal)
        o, lse = torch.from_numpy(o), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do):
        ### BEGIN SOLUTION
        q, k, v, o, lse = (x.detach().numpy() for x in ctx.saved_tensors)
        dq, dk, dv = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do.detach().numpy(),
                                                          causal=ctx.is_causal)
        return torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None
        ### END SOLUTION


def attention_function(q, k, v, is_causal):
    """softmax(q k^T / sqrt(d)) v through your autograd Function (what F.scaled_dot_product_attention computes)."""
    return MyFlashAttention.apply(q, k, v, is_causal)


# %% [markdown]
# Try it on a small example before asking the checker: the output and all three gradients should
# match PyTorch's own attention.

# %%
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 10, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
o = attention_function(q, k, v, True)
print("saved:", [tuple(t.shape) for t in o.grad_fn.saved_tensors])
o.sum().backward()
print("max |dq - torch's dq|:",
      float((q.grad - torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), q)[0]).abs().max()))

# %%
flashlab.check("attention_function", attention_function)

# %% [markdown]
# ## 2. Think about it
#
# - Your forward saved q, k, v, o and lse. For batch 8, 12 heads, N = 4096, d = 64 in float32, how many
#   MiB is that, and how many would saving P instead of lse cost?
# - `torch.autograd.gradcheck` compares a backward with finite differences. Try it on your Function with
#   small float64 inputs: `torch.autograd.gradcheck(lambda a, b, c: attention_function(a, b, c, True), (q, k, v))`.
