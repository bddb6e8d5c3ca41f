# %% [markdown]
# # Exercises 13: FlashAttention as a PyTorch autograd Function
#
# Goes with lesson [13 into a real model](../notebooks/13_real_model.ipynb). You will write the CPU path
# of `flashlab.torch.FlashAttentionFunction` yourself: a `torch.autograd.Function` whose forward runs the
# NumPy FlashAttention-2 of lesson 05 and whose backward runs the FA2 backward of lesson 06
# (FlashAttention-2, Dao 2023, arXiv 2307.08691, Algorithms 1 and 2). Then you will count the memory it
# keeps for the backward, and use causal attention the way a decoder with a KV cache needs it.
#
# The rule that makes it *Flash*attention: between forward and backward, keep **one number per query
# row** (the log-sum-exp `lse`), never the Nq x Nk matrices S or P. The checker looks at what your
# Function saved.

# %%
import numpy as np
import torch
import torch.nn.functional as F

import flashlab
from flashlab.torch import FlashAttentionFunction

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
# ## 2. How much memory waits for the backward?
#
# Between forward and backward, autograd keeps whatever `save_for_backward` stored. Write a function that
# says how many bytes `flashlab.torch.FlashAttentionFunction` keeps for one attention call on inputs of
# shape (B, H, Nq, d) for q, (B, H, Nk, d) for k and (B, H, Nk, dv) for v, all of dtype `dtype` (a torch
# dtype; `dtype.itemsize` is its size in bytes). Return also the bytes of the probabilities P, the
# (B, H, Nq, Nk) tensor in the same dtype that attention written as three PyTorch operations keeps instead.
#
# Do not guess: run the Function on a small example of each dtype, look at `o.grad_fn.saved_tensors`
# (shapes *and* dtypes), and only then write the formula. The checker asks about layers far too large
# to run here.

# %%
def backward_memory(B, H, Nq, Nk, d, dv, dtype):
    """(bytes FlashAttentionFunction saves for backward, bytes of P) for one attention call."""
    ### BEGIN SOLUTION
    size = dtype.itemsize
    lse_size = 8 if dtype == torch.float64 else 4  # lse is float32, float64 for float64 inputs
    saved = B * H * (Nq * d + Nk * d + Nk * dv + Nq * dv) * size + B * H * Nq * lse_size  # q, k, v, o, lse
    return saved, B * H * Nq * Nk * size
    ### END SOLUTION


# %%
for dtype in (torch.float16, torch.float32, torch.float64):
    q, k, v = (torch.randn(2, 3, n, w, dtype=dtype, requires_grad=True) for n, w in ((5, 4), (7, 4), (7, 6)))
    saved = FlashAttentionFunction.apply(q, k, v, True).grad_fn.saved_tensors
    measured = sum(x.numel() * x.element_size() for x in saved)
    print(f"{dtype}: measured {measured} bytes, yours {backward_memory(2, 3, 5, 7, 4, 6, dtype)[0]}")
flash, p = backward_memory(8, 12, 16384, 16384, 64, 64, torch.float32)
print(f"lesson 13's layer at N = 16384: {flash / 2**20:.0f} MiB saved, P alone would be {p / 2**30:.0f} GiB")

# %%
flashlab.check("backward_memory", backward_memory)

# %% [markdown]
# ## 3. Causal attention with a KV cache
#
# `is_causal=True`, in PyTorch and in flashlab, aligns the mask **top-left**: query i sees keys 0..i,
# whatever Nk is. That is right when queries and keys are the same tokens. A decoder that generates text
# with a **KV cache** is different: it keeps the keys and values of the tokens it has already processed,
# and each step brings `Nq` new tokens (one when generating, many when reading a prompt). Their queries
# `q` (B, H, Nq, d) attend to `k`, `v` holding all `Nk` tokens so far, the cache followed by the new ones.
# Each new token must see every cached token, itself, and the new tokens before it; not the ones after it.
#
# Write `cached_attention(q, k, v)` with scale 1/sqrt(d). You may build the mask yourself and pass it
# to `torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=...)` (a boolean mask: True
# where a query may look), or find a way without a mask. First print, for Nq = 3 and Nk = 8, which keys
# each new token may see.

# %%
def cached_attention(q, k, v):
    """Attention of the Nq newest tokens (q) over all Nk tokens so far (k, v: the cache, then the new tokens)."""
    ### BEGIN SOLUTION
    nq, nk = q.shape[-2], k.shape[-2]
    # new token i is token nk - nq + i of the sequence: it sees keys 0 .. nk - nq + i (bottom-right aligned)
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ### END SOLUTION


# %% [markdown]
# Check it the way a decoder would use it: the whole sequence at once (`is_causal=True` is right there,
# since Nq = Nk) must give the same last rows as the cached call for the newest tokens.

# %%
torch.manual_seed(1)
q_all, k_all, v_all = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
full = F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True)
print("max |difference|:", float((cached_attention(q_all[:, :, 5:], k_all, v_all) - full[:, :, 5:]).abs().max()))

# %%
flashlab.check("cached_attention", cached_attention)

# %% [markdown]
# ## 4. Think about it
#
# - In exercise 2, for one new token against a cache of 32768 (decoding), what dominates the saved bytes?
#   Does a decoder even need to keep anything for a backward?
# - flashlab's `scaled_dot_product_attention` refuses masks. How could you still compute `cached_attention`
#   with it? (Two ways: pad q, or split the keys into the cache and the new block and merge the two results
#   with their lse, as in lessons 03 and 14.) What does each cost when Nq = 1 and Nk = 32768?
# - `torch.autograd.gradcheck` compares a backward with finite differences. Try it on your Function with
#   small float64 inputs: `torch.autograd.gradcheck(lambda a, b, c: attention_function(a, b, c, True), (q, k, v))`.
