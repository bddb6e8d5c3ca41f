"""flashlab.torch.flash_attention_varlen: packed sequences with autograd, against attention written in torch per
sequence (autograd through softmax), on CPU tensors (NumPy) and, with a GPU, CUDA tensors (the kernels)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flashlab as fl  # noqa: E402
from flashlab.torch import flash_attention_varlen  # noqa: E402


def torch_reference(q, k, v, cu_q, cu_k, causal=False, align="top_left"):
    """Each sequence on its own: softmax(q k^T / sqrt(d) + mask) v, K/V heads repeated for GQA."""
    out = []
    G = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kb, vb = (x[cu_k[b]:cu_k[b + 1]].repeat_interleave(G, dim=1).transpose(0, 1) for x in (k, v))
        s = qb @ kb.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            nq, nk = qb.shape[1], kb.shape[1]
            off = nk - nq if align == "bottom_right" else 0
            i, j = torch.arange(nq, device=s.device), torch.arange(nk, device=s.device)
            s = s.masked_fill(j[None, :] > i[:, None] + off, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row without keys: 0, as flashlab's o = 0
        out.append((p @ vb).transpose(0, 1))
    return torch.cat(out)


def packed(rng, lens_q, lens_k, H, H_kv, d, device="cpu", dtype=torch.float64):
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]) for x in (lens_q, lens_k))
    make = lambda n, h: torch.tensor(rng.standard_normal((n, h, d)), dtype=dtype, device=device,  # noqa: E731
                                     requires_grad=True)
    return make(cu_q[-1], H), make(cu_k[-1], H_kv), make(cu_k[-1], H_kv), cu_q, cu_k


@pytest.mark.parametrize("lens_q,lens_k,H,H_kv,opts", [
    ([5, 9, 3], [7, 9, 4], 2, 2, dict()),
    ([6, 11], [6, 11], 4, 2, dict(causal=True)),                        # GQA
    ([4, 8], [9, 5], 2, 1, dict(causal=True, align="bottom_right")),    # MQA; rows with no key get 0
])
def test_varlen_autograd_matches_torch(rng, lens_q, lens_k, H, H_kv, opts):
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, H, H_kv, 8)
    w = torch.tensor(rng.standard_normal((q.shape[0], H, 8)))
    o = flash_attention_varlen(q, k, v, torch.tensor(cu_q, dtype=torch.int32), cu_k, **opts)
    grads = torch.autograd.grad((o * w).sum(), (q, k, v))
    want = torch_reference(q, k, v, cu_q, cu_k, **opts)
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    assert fl.relative_error(o.detach().numpy(), want.detach().numpy()) < 1e-10
    for g, wg in zip(grads, want_grads):
        assert fl.relative_error(g.numpy(), wg.numpy()) < 1e-10


def test_varlen_autograd_dropout_is_reproducible(rng):
    """With a seed the mask is the same in forward and backward: the gradient matches central differences."""
    q, k, v, cu_q, cu_k = packed(rng, [5, 7], [6, 7], 2, 2, 4)
    f = lambda q_: flash_attention_varlen(q_, k, v, cu_q, cu_k, dropout_p=0.4, seed=11).sum()  # noqa: E731
    assert torch.autograd.gradcheck(f, (q,), eps=1e-6, atol=1e-6)
    assert not torch.equal(flash_attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.4, seed=11),
                           flash_attention_varlen(q, k, v, cu_q, cu_k))


def test_varlen_rejects_batched_tensors(rng):
    q = torch.zeros(2, 3, 4, 8)
    with pytest.raises(ValueError, match="3-dim torch.Tensor"):
        flash_attention_varlen(q, q, q, [0, 3], [0, 3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fl.device.has_gpu(), reason="needs a CUDA GPU")
def test_varlen_autograd_on_gpu(rng):
    q, k, v, cu_q, cu_k = packed(rng, [1, 300, 77], [5, 300, 500], 4, 2, 64, device="cuda", dtype=torch.float32)
    w = torch.randn(q.shape, device="cuda", dtype=torch.float64)
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, align="bottom_right")
    grads = torch.autograd.grad((o.double() * w).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch_reference(q64, k64, v64, cu_q, cu_k, causal=True, align="bottom_right")
    want_grads = torch.autograd.grad((want * w).sum(), (q64, k64, v64))
    assert fl.relative_error(o.detach().double().cpu().numpy(), want.detach().cpu().numpy()) < 1e-5
    for g, wg in zip(grads, want_grads):
        assert fl.relative_error(g.double().cpu().numpy(), wg.cpu().numpy()) < 1e-4
