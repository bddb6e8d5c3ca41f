# %% [markdown]
# # 13 · Into a real model: flashlab behind PyTorch's attention
#
# **After this lesson you can**
# - wrap a forward and a backward written outside PyTorch into a `torch.autograd.Function`, and say what
#   it must save for the backward (the log-sum-exp, one number per query row) and what it must not (S, P);
# - swap `torch.nn.functional.scaled_dot_product_attention` for flashlab's inside a GPT-style model and
#   show that logits, loss and every parameter's gradient agree;
# - train that model for a few steps on flashlab's attention and watch the loss fall;
# - say what mixed precision with `torch.autocast` runs in bf16 and what it keeps in float32 (the master
#   weights), and why two correct attentions give bf16 loss curves that drift apart slightly;
# - judge whether two such curves match with a tolerance that a broken backward fails, and read the tokens/s
#   of both from one run on a GPU;
# - name what the drop-in does not support (an explicit `attn_mask`) and why it refuses it loudly instead of
#   computing something else.
#
# Lessons 05 and 06 built the FlashAttention-2 forward and backward (Dao 2023, arXiv 2307.08691,
# Algorithms 1 and 2) in NumPy, and lessons 08–09 as GPU kernels. Until now they ran alone. A model
# needs them inside autograd: the forward runs when the model is called, the backward when `loss.backward()`
# walks back through it.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

import flashlab
from flashlab import size
from flashlab.torch import FlashAttentionFunction, scaled_dot_product_attention as flash_sdpa

torch.manual_seed(0)

# %% [markdown]
# ## 1. What autograd keeps between the two passes
#
# When you write attention as three PyTorch operations, `S = Q K^T`, `P = softmax(S)`, `O = P V`, autograd
# records each one and keeps what its backward needs: P for the gradient of `P V`, and P again for the
# softmax's. For every (batch, head) that is an Nq x Nk matrix, held from the forward until the backward.
# The FlashAttention backward (lesson 06) needs only Q, K, V, O and the log-sum-exp
# `lse_i = m_i + log l_i` of each query row: it recomputes `P_ij = exp(S_ij - lse_i)` block by block.
#
# Here is what that means in memory for one attention layer (batch 8, 12 heads, d = 64, float32), as the
# context length N grows:

# %%
B, H, d, bytes_ = 8, 12, 64, 4
N = 2 ** np.arange(9, 16)
inputs_and_output = 4 * B * H * N * d * bytes_  # Q, K, V, O: saved by both
naive_extra = B * H * N * N * bytes_  # P (S is freed once P exists, if you are lucky)
flash_extra = B * H * N * 4  # lse: one float32 per query row

fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(N, (inputs_and_output + naive_extra) / 2**20, "o-", color="#d62728", label="matmul, softmax, matmul: Q, K, V, O + P")
ax.plot(N, (inputs_and_output + flash_extra) / 2**20, "o-", color="#2ca02c", label="FlashAttention: Q, K, V, O + lse")
ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="MiB saved for backward",
       title="Saved between forward and backward, one layer")
ax.set_xticks(N, [str(n) for n in N])
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# At N = 16384 the three-step version keeps 96 GiB per layer for P alone (1 GiB per head); FlashAttention
# keeps 6 MiB of lse. The lse is what ties the two passes together, so our Function must save it.
#
# ## 2. The autograd Function
#
# A `torch.autograd.Function` is a pair of static methods. `forward(ctx, q, k, v, is_causal, scale)` gets
# plain tensors, returns the output and stores what the backward needs with `ctx.save_for_backward`.
# `backward(ctx, dO)` returns one gradient per input. In formulas, with S = scale · Q Kᵀ (masked when
# causal):
#
# - forward: O = softmax(S) V, lse_i = log Σ_j exp(S_ij); save Q, K, V, O, lse;
# - backward: P = exp(S − lse), D_i = Σ_x dO_ix O_ix, dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D),
#   dQ = scale · dS K, dK = scale · dSᵀ Q, all block by block, as in lesson 06.
#
# flashlab's version sends CPU tensors to the NumPy code of lessons 05–06 and CUDA tensors to the GPU
# kernels. Its two helpers, without the argument checks (the `if q.is_cuda` branch calls the GPU kernels;
# the rest is the CPU path):

# %%
from flashlab import torch as flashlab_torch

print(inspect.getsource(flashlab_torch._forward))
print(inspect.getsource(flashlab_torch._backward))

# %% [markdown]
# `x.detach().numpy()` hands NumPy the tensor's memory without its autograd history; `torch.from_numpy`
# hands the result back. Let us check it against PyTorch's own `scaled_dot_product_attention` on
# random tensors, 4-dim (batch, heads, N, d), causal, with a length that is no multiple of any block size:

# %%
def max_rel(a, b):
    return flashlab.relative_error(a.detach().numpy(), b.detach().numpy())


q, k, v = (torch.randn(2, 4, 77, 16, requires_grad=True) for _ in range(3))
o = FlashAttentionFunction.apply(q, k, v, True)
o_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
dO = torch.randn_like(o)
grads = torch.autograd.grad(o, (q, k, v), dO, retain_graph=True)
grads_ref = torch.autograd.grad(o_ref, (q, k, v), dO)

print(f"O : relative error {max_rel(o, o_ref):.1e}")
for name, g, r in zip(("dQ", "dK", "dV"), grads, grads_ref):
    print(f"{name}: relative error {max_rel(g, r):.1e}")
print("saved for backward:", [tuple(t.shape) for t in o.grad_fn.saved_tensors])

# %% [markdown]
# Errors near 1e-7 are float32 rounding. The last line is the point of the lesson: Q, K, V, O and one
# (2, 4, 77) tensor, the lse. No (77, 77) matrix survives the forward. Is that lse right? Compare it with
# the float64 reference:

# %%
lse = o.grad_fn.saved_tensors[-1]
_, lse_ref = flashlab.reference_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), causal=True)
print(f"lse: relative error {flashlab.relative_error(lse.numpy(), lse_ref):.1e}")

# %% [markdown]
# ## 3. A drop-in for `scaled_dot_product_attention`
#
# `flashlab.torch.scaled_dot_product_attention` takes the same arguments as PyTorch's function and calls
# the Function above. It supports what FlashAttention supports here: 3-dim (batch, N, d) or 4-dim
# (batch, heads, N, d) tensors, `is_causal`, `scale`, Nq ≠ Nk and a value width different from d. Like
# PyTorch's, its `is_causal` aligns the mask top-left: query i sees keys 0..i, even when Nq < Nk (the
# `flash-attn` library aligns it bottom-right when the lengths differ, since its version 2.1; exercise 3
# shows why a decoder with a KV cache needs that). It also takes `dropout_p` and grouped-query attention
# (`enable_gqa=True`: fewer key/value heads than query heads), plus the FlashAttention library's own options,
# which lesson 18 teaches. An arbitrary `attn_mask` is the one thing it refuses, loudly, instead of quietly
# computing something else:

# %%
try:
    flash_sdpa(q, k, v, attn_mask=torch.ones(77, 77, dtype=torch.bool))
except NotImplementedError as err:
    print(f"an explicit mask: {err}")

# %% [markdown]
# ## 4. Inside a GPT
#
# `flashlab.gpt` holds a tiny GPT-style language model in the spirit of nanoGPT: embeddings, a few pre-norm
# blocks of causal self-attention and an MLP, and a head that predicts the next character. Its attention
# layer is the only place attention happens, and it calls a function it holds as an attribute:

# %%
from flashlab.gpt import GPT, TINY_TEXT, CharTokenizer, GPTConfig, train

print(inspect.getsource(flashlab.gpt.CausalSelfAttention.forward))

# %% [markdown]
# The text it will learn is a few lines written for this course (no download):

# %%
print(TINY_TEXT)
tok = CharTokenizer(TINY_TEXT)
data = tok.encode(TINY_TEXT)
cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32)
print(f"{len(data)} characters, vocabulary of {tok.vocab_size}; model: {cfg}")

# %% [markdown]
# Two copies of one model, same weights; the second uses flashlab's attention. One batch through both,
# then backward through both:

# %%
torch_model = GPT(cfg)
flash_model = GPT(cfg)
flash_model.load_state_dict(torch_model.state_dict())
flash_model.use_attention(flash_sdpa)

x, y = flashlab.gpt.get_batch(data, cfg.block_size, 8, torch.Generator().manual_seed(1))
logits_t, loss_t = torch_model(x, y)
logits_f, loss_f = flash_model(x, y)
loss_t.backward()
loss_f.backward()

print(f"logits: relative error {max_rel(logits_f, logits_t):.1e}")
print(f"loss  : torch {loss_t.item():.6f}   flashlab {loss_f.item():.6f}")
errors = {name: max_rel(p_f.grad, p_t.grad)
          for (name, p_t), p_f in zip(torch_model.named_parameters(), flash_model.parameters())}
worst = max(errors, key=errors.get)
print(f"gradients of {len(errors)} parameter tensors: worst relative error {errors[worst]:.1e} ({worst})")

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.bar(range(len(errors)), list(errors.values()), color="#2ca02c")
ax.axhline(1e-2, color="#d62728", ls="--", label="the 1e-2 the course asks for")
ax.set(yscale="log", ylabel="relative error vs torch", xlabel="parameter tensor",
       title="Every gradient of the GPT, flashlab vs torch attention")
ax.set_xticks(range(len(errors)), list(errors), rotation=90, fontsize=6)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Every gradient, not only the attention's, agrees to float32 rounding: the error that attention
# introduces would flow backward into every layer below it, so this is the test that matters.
#
# ## 5. Training on flashlab's attention
#
# Now train the flashlab copy from scratch for a few steps (AdamW, batches of random 32-character
# windows), and for comparison the same model with PyTorch's attention from the same start:

# %%
steps = size(150, 30)
torch.manual_seed(0)
start = GPT(cfg).state_dict()
runs = {}
for label, attention in (("torch SDPA", F.scaled_dot_product_attention), ("flashlab", flash_sdpa)):
    model = GPT(cfg)
    model.load_state_dict(start)
    model.use_attention(attention)
    runs[label] = (model, train(model, data, steps, batch_size=16, lr=1e-2, seed=0))

fig, ax = plt.subplots(figsize=(6.5, 3.4))
for (label, (_, losses)), style in zip(runs.items(), ("-", "--")):
    ax.plot(losses, style, label=label)
ax.axhline(np.log(tok.vocab_size), color="gray", lw=0.8, label="uniform guess: log(vocab)")
ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="Training loss")
ax.legend(fontsize=8)
plt.show()
for label, (_, losses) in runs.items():
    print(f"{label:>10}: loss {losses[0]:.3f} -> {np.mean(losses[-5:]):.3f} (mean of the last 5 steps)")

# %% [markdown]
# The two curves lie on top of each other: same data, same start, and gradients equal to rounding, so
# the same optimisation path (float32 rounding differences could make them drift apart slowly over
# thousands of steps). The model learns quickly that the text is made of lowercase words and spaces.
# Sample from the flashlab model (it still computes its attention with flashlab):

# %%
model = runs["flashlab"][0]
prompt = tok.encode("The ")[None]
out = model.generate(prompt, size(120, 60), generator=torch.Generator().manual_seed(0), temperature=0.8)
print(tok.decode(out[0]))

# %% [markdown]
# ## 6. Training in bf16 on a GPU
#
# Large models train in 16-bit mixed precision, not in float32. Here is the same comparison in bf16, at a size
# where attention matters (head dim 64 and long contexts: the figure's title gives the model), measured on a GPU by
# `benchmarks/generators/gpt_bf16.py`: three copies of one GPT trained from the same initial weights on the same batches,
# with torch's attention, with flashlab's, and with torch's a second time. The text is
# `flashlab.gpt.copy_text`: lines of random words from the lines above, each said twice, so that the second half
# of a line can be predicted only by attending back to the first.

# %%
import flashlab.gpt as gpt
from flashlab.viz.training import plot_bf16_run

bf16_run = gpt.load_bf16_run()  # the committed measurement, or None before its first GPU run
if bf16_run is None:
    print("The bf16 measurement has not been committed yet (python benchmarks/generators/gpt_bf16.py writes it on a GPU): "
          "no figure here. With a GPU, the last cell of this section measures it live.")
else:
    plot_bf16_run(bf16_run)
    plt.show()
    print(f"{bf16_run['gpu']}, torch {bf16_run['versions']['torch']}, {bf16_run['source']}")

# %% [markdown]
# **What runs in bf16.** bfloat16 keeps float32's 8 exponent bits, so it covers the same range of magnitudes,
# but only 7 of its 23 stored significand bits: each value is rounded to about three significant decimal digits
# (a relative error of at most 2^-8). Tensor cores multiply bf16 matrices far faster than the FP32 units
# multiply float32 ones (lesson 15). Under `torch.autocast(device_type="cuda", dtype=torch.bfloat16)` PyTorch
# decides op by op:
#
# - matrix products (every `nn.Linear`, `matmul`) cast their inputs to bf16 and return bf16; so the attention
#   receives q, k and v in bf16, straight from the `qkv` layer, and returns bf16;
# - ops that need range or precision run in float32: layer norm, softmax and log-softmax, the cross-entropy,
#   exp, sums;
# - the weights stay float32, the *master weights* (Micikevicius et al. 2018, arXiv 1710.03740). Autocast casts
#   a weight to bf16 each time a matrix product reads it; the gradient flows back through that cast and reaches
#   the weight in float32, and AdamW updates float32 weights with float32 moments. An update of lr times
#   about 1 is far smaller than the spacing of bf16 numbers near 1 (2^-7): applied to a bf16 weight it would
#   round away.
#
# Unlike float16, bf16 needs no loss scaling: its exponent range is float32's, so small gradients do not
# underflow to zero.
#
# **Why the two curves are not identical.** Two correct attentions differ in the last bits of their bf16
# results: they add the same terms in different orders, and one rounds an intermediate (P, say) to bf16 where
# the other keeps it in float32. After one step the weights of the two runs differ by roundings; every later
# step starts from its own weights, so the differences add up and the runs follow slightly different paths.
# They see the same batches, so the batch-to-batch ups and downs of the loss are common to both; what remains is
# a small drift. That is how the course compares two curves: the moving average of the per-step difference over
# `BF16_LOSS_WINDOW` steps, and its largest absolute value over the run (`flashlab.gpt.loss_gap`), must stay
# within `BF16_LOSS_TOLERANCE` nats. The constant's comment in `flashlab/gpt.py` says how it was chosen: correct
# attentions in bf16 on the CPU stayed several times below it, broken ones far above. The measured run:

# %%
if bf16_run is not None:
    runs = bf16_run["runs"]
    gap = gpt.loss_gap(runs["flashlab"]["losses"], runs["torch"]["losses"])
    print(f"tolerance: {gpt.BF16_LOSS_TOLERANCE} nats on the {gpt.BF16_LOSS_WINDOW}-step average")
    print(f"flashlab vs torch SDPA: largest gap {gap:.4f} nats, "
          f"{'within' if gap <= gpt.BF16_LOSS_TOLERANCE else 'OUTSIDE'} the tolerance")
    if "torch_again" in runs:
        again = gpt.loss_gap(runs["torch_again"]["losses"], runs["torch"]["losses"])
        print(f"torch SDPA vs torch SDPA again: largest gap {again:.4f} nats "
              f"({'bit for bit the same run' if again == 0 else 'torch alone is not deterministic here'})")
    for name, run in runs.items():
        print(f"{run['label']:>18}: loss {run['losses'][0]:.3f} -> {np.mean(run['losses'][-10:]):.3f}, "
              f"{run['tokens_per_s']:,.0f} tokens/s, first step {run['first_step_s']:.1f} s")
    print(f"flashlab trains at {runs['flashlab']['tokens_per_s'] / runs['torch']['tokens_per_s']:.2f} times "
          f"torch's speed (tokens/s after {bf16_run['training']['warmup']} warm-up steps, same process)")

# %% [markdown]
# Attention is only part of a training step: the linear layers, layer norms, the loss and AdamW run the same
# PyTorch code in both runs. Where the GPU is busy the whole step, the ratio of whole-step speeds lies between 1
# and the ratio of the attention kernels alone (lessons 10 and 15 time those). This model is too small for that:
# a step launches a few hundred small kernels, and the GPU finishes each before the host (Python, PyTorch's
# dispatcher, the driver) has launched the next. The step is then as long as the host's work, and tokens/s
# follows the host's time, not the kernels'. There flashlab's attention pays for being Python (its autograd
# Function, its checks and its kernel launches) where torch's is C++, however fast its kernels.
# `benchmarks/profiling/profile_gpt_bf16.py --parts split` measures it: the host's time in each phase of a step
# beside the step's wall time. The first steps are left out of tokens/s: flashlab compiles its kernels on its
# first call, which the first step's time above includes.
#
# **Would this comparison notice a wrong backward?** A tolerance nothing can fail proves nothing. Here is an
# attention whose forward is exact but whose backward forgets dQ and dK (q and k are detached, so only V gets a
# gradient): the kind of bug a test of the forward alone never sees. A small model on the CPU, float32, a few
# seconds:

# %%
def attention_without_dq_dk(q, k, v, is_causal=False):
    """Exact output; gradients reach v only, as if the backward returned dQ = dK = 0."""
    return F.scaled_dot_product_attention(q.detach(), k.detach(), v, is_causal=is_causal)


small = {**gpt.BF16_SETUP, "n_layer": 2, "n_head": 1, "n_embd": 64, "block_size": 64, "batch_size": 16,
         "steps": size(150, 100), "lr": 3e-3, "warmup": 2, "text_chars": 20_000}
cpu_run = gpt.compare_attention({"torch": F.scaled_dot_product_attention, "flashlab": flash_sdpa,
                                 "without dQ, dK": attention_without_dq_dk}, small)
plot_bf16_run(cpu_run, speed=False)
plt.show()
for name, run in cpu_run["runs"].items():
    if name != "torch":
        g = gpt.loss_gap(run["losses"], cpu_run["runs"]["torch"]["losses"])
        print(f"{name:>15}: first loss {run['losses'][0]:.5f} (torch {cpu_run['runs']['torch']['losses'][0]:.5f}), "
              f"largest gap {g:.4f} nats: {'within' if g <= gpt.BF16_LOSS_TOLERANCE else 'OUTSIDE'} the tolerance")

# %% [markdown]
# The first losses agree (the forward is right), then the broken run falls behind as soon as the model needs its
# attention to copy the second half of each line, and leaves the band. flashlab's float32 run on the CPU sits on
# torch's. `tests/test_gpt_bf16.py` keeps this check, and `tests/test_gpt_bf16_gpu.py` runs the bf16 comparison
# on a GPU, with the same broken attention as a control.
#
# With a GPU of compute capability 8.0 or newer (an A100, an H100), measure it yourself (a minute or so; three
# progress bars). On a T4, Colab's GPU, the cell says why it skips: no bf16 tensor cores there.

# %%
# torch.cuda.is_bf16_supported() is True on a T4 too (torch emulates bf16 there); flashlab's bf16 kernels need
# the bf16 tensor cores of compute capability 8.0, so the guard asks for that.
bf16_gpu = flashlab.device.has_gpu() and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
if bf16_gpu:
    live = gpt.compare_attention({"torch": F.scaled_dot_product_attention, "flashlab": flash_sdpa},
                                 {**gpt.BF16_SETUP, "steps": size(gpt.BF16_SETUP["steps"], 60)},
                                 device="cuda", autocast_dtype=torch.bfloat16)
    live["gpu"] = torch.cuda.get_device_name()
    plot_bf16_run(live)
    plt.show()
    g = gpt.loss_gap(live["runs"]["flashlab"]["losses"], live["runs"]["torch"]["losses"])
    print(f"largest gap {g:.4f} nats (tolerance {gpt.BF16_LOSS_TOLERANCE}); tokens/s: "
          + ", ".join(f"{r['label']} {r['tokens_per_s']:,.0f}" for r in live["runs"].values()))
elif flashlab.device.has_gpu():
    cc = torch.cuda.get_device_capability()
    print(f"Skipped: this GPU (compute capability {cc[0]}.{cc[1]}, a T4 in Colab) has no bf16 tensor cores, which "
          "flashlab's bf16 kernels need (8.0 or newer); the figure above is the committed run.")
else:
    print("No CUDA GPU with bf16 here" + (": the figure above is the committed run." if bf16_run else "."))

# %% [markdown]
# ## 7. On a GPU
#
# The same call on CUDA tensors runs the register kernel of lesson 09 (forward) and the FA2 backward
# kernel, with the lse saved in float32. The kernels need d in (16, 32, 64, 128) and the same width for V.
# These are float32 tensors, so a T4 (Colab's GPU) runs this cell as an H100 does, on its FP32 units.
# In the simulator this would take minutes, so it runs only where there is a GPU:

# %%
if flashlab.device.has_gpu() and torch.cuda.is_available():
    qc, kc, vc = (torch.randn(2, 8, 1000, 64, device="cuda", requires_grad=True) for _ in range(3))
    oc = flash_sdpa(qc, kc, vc, is_causal=True)
    oc_ref = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    print(f"CUDA forward: relative error {flashlab.relative_error(oc.detach().cpu().numpy(), oc_ref.detach().cpu().numpy()):.1e}")
    gc = torch.autograd.grad(oc.sum(), qc)[0]
    gc_ref = torch.autograd.grad(oc_ref.sum(), qc)[0]
    print(f"CUDA dQ     : relative error {flashlab.relative_error(gc.cpu().numpy(), gc_ref.cpu().numpy()):.1e}")
else:
    print("No CUDA GPU here: the CUDA path is tested by tests/test_torch_integration.py on a GPU machine.")

# %% [markdown]
# ## Summary
#
# - A `torch.autograd.Function` lets any forward/backward pair join autograd. FlashAttention's saves
#   Q, K, V, O and the lse (one number per query row): memory linear in N, where three PyTorch operations
#   keep an Nq × Nk matrix per head.
# - `flashlab.torch.scaled_dot_product_attention` is a drop-in for PyTorch's over the cases it supports,
#   (dropout and grouped-query attention included), and raises `NotImplementedError` for explicit masks.
# - Swapped into a GPT, it gives the same logits, loss and gradients (to float32 rounding), and the model
#   trains the same way.
# - In bf16 mixed precision (`torch.autocast`: matrix products in bf16; norms, softmax and the loss in
#   float32; float32 master weights and optimizer state) two correct attentions round differently, so their
#   loss curves drift apart slightly. Compare them on the same batches by the largest moving-average gap, within
#   `flashlab.gpt.BF16_LOSS_TOLERANCE`: a tolerance a backward without dQ and dK fails. Measure tokens/s after
#   the warm-up steps, in the same run for both.
#
# **Next:** write the Function yourself, count what it keeps for the backward, and use causal attention
# with a KV cache:
# [exercises/13_real_model.ipynb](../exercises/13_real_model.ipynb).
