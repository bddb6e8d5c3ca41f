"""flashlab.torch: the autograd Function and the SDPA drop-in against torch's own scaled_dot_product_attention.

CPU tensors (the NumPy FA2 forward and backward) always; CUDA tensors (the Numba kernels) when a GPU exists.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashlab  # noqa: E402
from flashlab.torch import FlashAttentionFunction, flash_attention, scaled_dot_product_attention as sdpa  # noqa: E402


def rel(a, b) -> float:
    """||a - b|| / ||b||, with ||b|| floored at 1e-3 * sqrt(size): a gradient that is exactly 0 in exact
    arithmetic (causal, one query) comes out of torch as rounding noise ~1e-8."""
    a, b = a.detach().cpu().double().numpy(), b.detach().cpu().double().numpy()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-3 * np.sqrt(b.size)))


def qkv(rng, q_shape, nk, dv=None, dtype=torch.float32, device="cpu", logit_scale=1.0):
    """Fresh random q, k, v (leaf tensors requiring grad) from the test's own NumPy stream."""
    k_shape = q_shape[:-2] + (nk, q_shape[-1])
    v_shape = q_shape[:-2] + (nk, dv or q_shape[-1])
    arrays = [rng.standard_normal(s) * f for s, f in ((q_shape, logit_scale), (k_shape, 1), (v_shape, 1))]
    return [torch.tensor(a, dtype=dtype, device=device, requires_grad=True) for a in arrays]


def both(q, k, v, causal, scale=None):
    """Outputs and gradients (for one random dO) of flashlab and of torch on the same inputs."""
    out = sdpa(q, k, v, is_causal=causal, scale=scale)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    do = torch.randn_like(ref)
    return (out, *torch.autograd.grad(out, (q, k, v), do)), (ref, *torch.autograd.grad(ref, (q, k, v), do))


SHAPES = [  # q shape, Nk, dv: 3-dim and 4-dim, ragged N (not multiples of any block), Nq != Nk, dv != d
    ((2, 17, 16), 17, None),
    ((3, 13, 8), 29, 5),
    ((1, 2, 31, 16), 9, None),
    ((2, 3, 40, 32), 40, 24),
    ((1, 1, 1, 8), 50, None),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_shape,nk,dv", SHAPES)
def test_forward_and_gradients_match_torch_float32(rng, q_shape, nk, dv, causal):
    q, k, v = qkv(rng, q_shape, nk, dv)
    ours, ref = both(q, k, v, causal)
    assert ours[0].shape == ref[0].shape and ours[0].dtype == torch.float32
    assert rel(ours[0], ref[0]) < 1e-5
    for name, g, r in zip(("dq", "dk", "dv"), ours[1:], ref[1:]):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert rel(g, r) < 1e-4, name  # the bar is 1e-2; float32 does far better


def test_float64_gradcheck(rng):
    """torch's own finite-difference check of the backward, in float64, causal, ragged, dv != d."""
    for causal in (False, True):
        q, k, v = qkv(rng, (1, 2, 5, 3), 7, 4, dtype=torch.float64)
        assert torch.autograd.gradcheck(lambda a, b, c: sdpa(a, b, c, is_causal=causal), (q, k, v))


@pytest.mark.parametrize("q_shape,nk", [((2, 3, 19, 16), 19), ((2, 11, 8), 23)])
def test_lse_is_saved_with_one_number_per_row_and_no_n_by_n_tensor(rng, q_shape, nk):
    q, k, v = qkv(rng, q_shape, nk, logit_scale=4.0)
    o = FlashAttentionFunction.apply(q, k, v, True)
    saved = o.grad_fn.saved_tensors
    nq = q_shape[-2]
    assert [tuple(t.shape) for t in saved] == [tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(o.shape),
                                               q_shape[:-1]]
    assert all(t.numel() < nq * nk for t in saved[-1:])  # lse: Nq numbers per (batch, head)
    _, ref_lse = flashlab.reference_attention(*(t.detach().numpy() for t in (q, k, v)), causal=True)
    assert flashlab.relative_error(saved[-1].numpy(), ref_lse) < 1e-6
    o2, lse2 = flash_attention(q, k, v, causal=True)
    assert torch.equal(o2, o.detach()) and torch.equal(lse2, saved[-1])


def test_scale_and_large_logits(rng):
    q, k, v = qkv(rng, (2, 2, 21, 16), 21, logit_scale=30.0)  # scores in the hundreds: overflow without max
    for scale in (None, 0.05, 2.0):
        ours, ref = both(q, k, v, True, scale)
        assert all(torch.isfinite(x).all() for x in ours)
        assert rel(ours[0], ref[0]) < 1e-5
        assert all(rel(g, r) < 1e-3 for g, r in zip(ours[1:], ref[1:]))


def test_float16_and_float64_inputs(rng):
    q, k, v = qkv(rng, (2, 2, 12, 16), 12, dtype=torch.float64)
    ours, ref = both(q, k, v, True)
    assert ours[0].dtype == torch.float64 and rel(ours[0], ref[0]) < 1e-12
    assert all(g.dtype == torch.float64 and rel(g, r) < 1e-10 for g, r in zip(ours[1:], ref[1:]))
    q16, k16, v16 = (t.detach().half() for t in (q, k, v))
    out = sdpa(q16, k16, v16, is_causal=True)
    assert out.dtype == torch.float16 and rel(out, ref[0]) < 1e-2


def test_only_requested_gradients_are_returned(rng):
    q, k, v = qkv(rng, (1, 9, 8), 9)
    k.requires_grad_(False)
    sdpa(q, k, v, is_causal=True).sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


def test_model_with_flashlab_attention_matches_torch(rng):
    from flashlab.gpt import GPT, GPTConfig

    torch.manual_seed(int(rng.integers(1 << 30)))
    cfg = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16)
    ref_model, our_model = GPT(cfg), GPT(cfg)
    our_model.load_state_dict(ref_model.state_dict())
    our_model.use_attention(sdpa)
    idx = torch.randint(11, (3, 13))
    targets = torch.randint(11, (3, 13))
    (ref_logits, ref_loss), (our_logits, our_loss) = ref_model(idx, targets), our_model(idx, targets)
    assert rel(our_logits, ref_logits) < 1e-5 and abs(our_loss.item() - ref_loss.item()) < 1e-5
    ref_loss.backward()
    our_loss.backward()
    for (name, p_ref), p_ours in zip(ref_model.named_parameters(), our_model.parameters()):
        assert rel(p_ours.grad, p_ref.grad) < 1e-4, name


def test_attn_mask_is_refused_clearly(rng):
    q, k, v = qkv(rng, (1, 2, 9, 8), 9)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=torch.ones(9, 9, dtype=torch.bool))


@pytest.mark.parametrize("call,err,match", [
    (lambda q, k, v: sdpa(q, k[:, :1], v[:, :1]), ValueError, "enable_gqa=True"),
    (lambda q, k, v: sdpa(q, k[:, :3], v[:, :3], enable_gqa=True), ValueError, "divid"),
    (lambda q, k, v: sdpa(q, k, v, dropout_p=1.5), ValueError, "dropout_p"),
    (lambda q, k, v: sdpa(q, k, v, window_size=4), TypeError, "window_size"),
    (lambda q, k, v: sdpa(q, k, v, align="middle"), ValueError, "align"),
])
def test_bad_options_name_the_problem(rng, call, err, match):
    q, k, v = qkv(rng, (1, 4, 9, 8), 9)
    with pytest.raises(err, match=match):
        call(q, k, v)


def test_gqa_matches_torch_enable_gqa(rng):
    q, k, v = qkv(rng, (2, 6, 19, 8), 23, dtype=torch.float64)
    k, v = (x[:, :2].detach().requires_grad_() for x in (k, v))  # 3 query heads per K/V head
    for causal in (False, True):
        out = sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        do = torch.randn_like(ref)
        ours, theirs = torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)
        assert rel(out, ref) < 1e-10
        for g, r in zip(ours, theirs):
            assert g.shape == r.shape and rel(g, r) < 1e-10


def explicit_attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), align="top_left",
                       alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
    """float64 torch attention with every option built as a full Nq x Nk mask and bias (reference.py's
    pieces), differentiated by torch's autograd: the gradients' ground truth."""
    from flashlab.reference import alibi_bias, attention_mask, dropout_scale

    nq, nk, g = q.shape[-2], k.shape[-2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + torch.from_numpy(alibi_bias(alibi_slopes, q.shape[:-2], nq, nk, align=align))
    mask = torch.from_numpy(attention_mask(nq, nk, causal=causal, window_size=window_size, align=align))
    seen = mask.any(-1, keepdim=True)  # a row whose window holds no key gets o = 0 (the library's rule), not NaN
    p = torch.softmax(s.masked_fill(~mask, float("-inf")).masked_fill(~seen, 0.0), dim=-1) * seen
    if dropout_p:
        p = p * torch.from_numpy(dropout_scale(seed, dropout_p, q.shape[:-2], nq, nk))
    return p @ v


OPTIONS = [
    dict(window_size=(5, 2)),
    dict(window_size=(4, 0), align="bottom_right", causal=True),
    dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    dict(alibi_slopes=np.linspace(0.1, 0.8, 8).reshape(2, 4), causal=True, align="bottom_right"),
    dict(softcap=2.0),
    dict(dropout_p=0.3, seed=1234),
    dict(softcap=5.0, window_size=(6, 6), alibi_slopes=np.full(4, 0.3), dropout_p=0.2, seed=7, causal=True),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(sorted(o)))
@pytest.mark.parametrize("nq,nk", [(17, 17), (11, 26), (26, 11)])
def test_library_options_forward_and_gradients(rng, opts, nq, nk):
    """Every option through the drop-in and autograd on CPU tensors, GQA included, against float64 autograd."""
    opts = dict(opts)
    causal = opts.pop("causal", False)
    q, k, v = qkv(rng, (2, 4, nq, 8), nk, dtype=torch.float64, logit_scale=3.0)
    k, v = (x[:, :2].detach().requires_grad_() for x in (k, v))
    out = sdpa(q, k, v, is_causal=causal, enable_gqa=True, **opts)
    ref = explicit_attention(q, k, v, causal=causal, **opts)
    do = torch.randn_like(ref)
    ours = torch.autograd.grad(out, (q, k, v), do)
    theirs = torch.autograd.grad(ref, (q, k, v), do)
    assert rel(out, ref) < 1e-10
    for name, g, r in zip("qkv", ours, theirs):
        assert g.shape == r.shape and rel(g, r) < 1e-9, name


def test_dropout_without_seed_draws_one_and_the_backward_reuses_it(rng):
    q, k, v = qkv(rng, (1, 2, 12, 8), 12, dtype=torch.float64)
    torch.manual_seed(0)
    a = sdpa(q, k, v, dropout_p=0.5)
    b = sdpa(q, k, v, dropout_p=0.5)
    assert not torch.equal(a, b)  # a fresh mask per call, as torch's dropout
    seed = a.grad_fn.options["seed"] if hasattr(a.grad_fn, "options") else None
    assert seed is not None
    ref = explicit_attention(q, k, v, dropout_p=0.5, seed=seed)
    do = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(a, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        assert rel(g, r) < 1e-9


def test_options_keep_dropout_and_its_seed():
    """The options handed to the kernels keep dropout_p and its seed (drawn once, kept for the backward), and drop
    the seed when there is no dropout."""
    from flashlab.torch import _options

    assert _options(dropout_p=0.2, seed=2 ** 40 + 1, softcap=3.0) == dict(dropout_p=0.2, seed=2 ** 40 + 1, softcap=3.0)
    assert _options(seed=5, softcap=3.0) == dict(softcap=3.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cuda_16bit_options_backward_runs_on_tensor_cores(rng, monkeypatch, dtype):
    """Options through autograd in 16 bits: the backward runs on the tensor backward with the options compiled in
    (and the forward on the tensor kernel), against float64 autograd on the same rounded inputs."""
    import flashlab.kernels.backward as kb

    monkeypatch.setattr(kb, "TENSOR_DEFAULT", True)
    calls = spy_tensor_backward_builds(monkeypatch)
    opts = dict(softcap=5.0, window_size=(6, 6), alibi_slopes=np.full(4, 0.3))
    opts.update(dropout_p=0.2, seed=2 ** 40 + 7)
    q, k, v = qkv(rng, (2, 4, 150, 64), 170, logit_scale=3.0)
    f64 = [x.detach().to(dtype).double().requires_grad_() for x in (q, k[:, :2], v[:, :2])]
    gpu_in = [x.detach().to(dtype).cuda().requires_grad_() for x in f64]
    out = sdpa(*gpu_in, is_causal=True, enable_gqa=True, **opts)
    ref = explicit_attention(*f64, causal=True, **opts)
    do = torch.randn_like(ref)
    ours = torch.autograd.grad(out, gpu_in, do.to(dtype).cuda())
    theirs = torch.autograd.grad(ref, f64, do.to(dtype).double())
    assert calls and calls[-1][0] == ("f16" if dtype == torch.float16 else "bf16") and calls[-1][1].any
    tol_o, tol_g = (3e-3, 1e-2) if dtype == torch.float16 else (2e-2, 5e-2)
    assert rel(out, ref) < tol_o
    for name, g, r in zip("qkv", ours, theirs):
        assert g.dtype == dtype and g.shape == r.shape and rel(g, r) < tol_g, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_shape", [(2, 3, 40, 32), (3, 40, 32)], ids=["4dim", "3dim"])
def test_cuda_dropout_draws_the_cpu_mask(rng, q_shape):
    """Dropout on CUDA (the register kernels) and on the CPU (the NumPy FA2) with one seed: the same outputs and
    gradients, 3-dim tensors included (their leading dim is the dropout key's head on both)."""
    q, k, v = qkv(rng, q_shape, 50, dtype=torch.float64)
    gpu_in = [x.detach().float().cuda().requires_grad_() for x in (q, k, v)]
    out = sdpa(*gpu_in, dropout_p=0.3, seed=2 ** 40 + 3, is_causal=True)
    ref = sdpa(q, k, v, dropout_p=0.3, seed=2 ** 40 + 3, is_causal=True)
    do = torch.randn_like(ref)
    assert rel(out, ref) < 1e-4
    for g, r in zip(torch.autograd.grad(out, gpu_in, do.float().cuda()), torch.autograd.grad(ref, (q, k, v), do)):
        assert rel(g, r) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(sorted(o)))
def test_cuda_library_options_forward_and_gradients(rng, opts):
    """The register kernels with window / align / ALiBi / softcap / dropout through autograd, against float64
    autograd."""
    opts = dict(opts)
    causal = opts.pop("causal", False)
    q, k, v = qkv(rng, (2, 4, 150, 64), 170, logit_scale=3.0)
    f64 = [x.detach().double().requires_grad_() for x in (q, k[:, :2], v[:, :2])]
    gpu_in = [x.detach().float().cuda().requires_grad_() for x in f64]
    out = sdpa(*gpu_in, is_causal=causal, enable_gqa=True, **opts)
    ref = explicit_attention(*f64, causal=causal, **opts)
    do = torch.randn_like(ref)
    ours = torch.autograd.grad(out, gpu_in, do.float().cuda())
    theirs = torch.autograd.grad(ref, f64, do)
    assert rel(out, ref) < 1e-4
    for name, g, r in zip("qkv", ours, theirs):
        assert g.shape == r.shape and rel(g, r) < 1e-3, name


@pytest.mark.parametrize("make,err,match", [
    (lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0]), ValueError, "got shape \\(9, 8\\)"),
    (lambda q, k, v: (q[None], k[None], v[None]), ValueError, "got shape \\(1, 1, 2, 9, 8\\)"),
    (lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16()), TypeError, "bfloat16"),
    (lambda q, k, v: (q, k[0], v[0]), ValueError, "same number of dims"),
    (lambda q, k, v: (q.detach().numpy(), k, v), TypeError, "torch.Tensor"),
    (lambda q, k, v: (q, k[..., :5], v), ValueError, "feature dim"),
])
def test_bad_inputs_name_the_problem(rng, make, err, match):
    q, k, v = qkv(rng, (1, 2, 9, 8), 9)
    with pytest.raises(err, match=match):
        sdpa(*make(q, k, v))


def test_is_causal_must_be_bool(rng):
    q, k, v = qkv(rng, (1, 4, 8), 4)
    with pytest.raises(TypeError, match="is_causal"):
        sdpa(q, k, v, is_causal="yes")


def test_import_flashlab_does_not_import_torch_and_module_finds_real_torch():
    import subprocess
    import sys

    code = ("import sys, flashlab; assert 'torch' not in sys.modules; import flashlab.torch as ft; "
            "assert 'torch' not in sys.modules; F = ft.FlashAttentionFunction; import torch; "
            "assert issubclass(F, torch.autograd.Function) and torch.__file__.find('flashlab') < 0")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------- CUDA tensors
def _gpu_ready():
    return torch.cuda.is_available() and flashlab.device.has_gpu()


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU (torch.cuda and numba-cuda)")


def cuda_vs_float64(q, k, v, causal):
    """flashlab on CUDA tensors, and torch's SDPA in float64 on the CPU as the reference (torch's own
    float32 GPU kernels may use TF32 tensor cores, so they are no float32-exact reference)."""
    out = sdpa(q, k, v, is_causal=causal)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
    return (out, *grads), (ref, *torch.autograd.grad(ref, ref_in, do.cpu().double()))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_shape,nk", [((2, 3, 130, 64), 130), ((2, 77, 32), 200), ((1, 4, 256, 128), 100)])
def test_cuda_tensors_match_float64(rng, q_shape, nk, causal):
    q, k, v = qkv(rng, q_shape, nk, device="cuda")
    ours, ref = cuda_vs_float64(q, k, v, causal)
    assert ours[0].is_cuda and ours[0].dtype == torch.float32 and all(g.is_cuda for g in ours[1:])
    assert rel(ours[0], ref[0]) < 1e-5
    for name, g, r in zip(("dq", "dk", "dv"), ours[1:], ref[1:]):
        assert rel(g, r) < 1e-4, name
    o = FlashAttentionFunction.apply(q, k, v, causal)  # keep o alive: torch frees a saved output with it
    lse = o.grad_fn.saved_tensors[-1]
    _, ref_lse = flashlab.reference_attention(*(t.detach().cpu().numpy() for t in (q, k, v)), causal=causal)
    assert tuple(lse.shape) == q_shape[:-1] and flashlab.relative_error(lse.cpu().numpy(), ref_lse) < 1e-5


@pytest.mark.gpu
@gpu
def test_cuda_float16(rng):
    q, k, v = qkv(rng, (2, 4, 100, 64), 100, dtype=torch.float16, device="cuda")
    ours, ref = cuda_vs_float64(q, k, v, True)
    assert ours[0].dtype == torch.float16 and rel(ours[0], ref[0]) < 1e-2
    assert all(g.dtype == torch.float16 and rel(g, r) < 2e-2 for g, r in zip(ours[1:], ref[1:]))


@pytest.mark.parametrize("cc,dtype,d,want", [
    ((9, 0), torch.float16, 64, "wgmma"), ((9, 0), torch.bfloat16, 128, "wgmma"), ((9, 0), torch.float32, 64, "tensor"),
    ((9, 0), torch.float16, 32, "tensor"), ((8, 0), torch.bfloat16, 128, "tensor"),
    ((7, 5), torch.float16, 64, "tensor"), ((7, 5), torch.float32, 64, "register"),  # a T4: no tf32 mma
    ((9, 0), torch.float32, 48, "register"),  # a head dim the kernels do not take: the register path says so
    ((10, 0), torch.float16, 64, "tensor"),  # after Hopper: sm_90a code does not run there (the PTX ISA)
])
def test_cuda_variant_follows_the_gpu_and_dtype(monkeypatch, cc, dtype, d, want):
    import flashlab.device
    import flashlab.torch as ft

    monkeypatch.setattr(flashlab.device, "device_limits", lambda: {"cc": cc})
    assert ft._cuda_variant(torch.zeros(1, 2, 3, d, dtype=dtype)) == want
    if want == "wgmma":  # the library's options run on the tensor kernel
        assert ft._cuda_variant(torch.zeros(1, 2, 3, d, dtype=dtype), options=True) == "tensor"


@pytest.mark.parametrize("cc,dtype,d,nq,nk,gqa,options,want", [
    ((9, 0), "float16", 64, 4096, 4096, False, False, True), ((9, 0), "bfloat16", 128, 16384, 8192, False, False, True),
    ((9, 0), "float16", 64, 1024, 2048, False, False, True), ((9, 0), "bfloat16", 64, 1024, 512, False, False, True),
    ((9, 0), "float16", 64, 256, 4096, False, False, False),  # N 256: shorter than any timed
    ((9, 0), "float16", 64, 4096, 4096, True, False, False),  # grouped-query heads: not timed on a GPU yet
    ((9, 0), "float16", 64, 4096, 4096, False, True, False),  # the library's options run on the tensor backward
    ((9, 0), "float32", 64, 4096, 4096, False, False, False), ((9, 0), "float16", 32, 4096, 4096, False, False, False),
    ((8, 0), "float16", 64, 4096, 4096, False, False, False), (None, "float16", 64, 4096, 4096, False, False, False),
    ((10, 0), "float16", 64, 4096, 4096, False, False, False),  # after Hopper: sm_90a code does not run there
])
def test_wgmma_backward_runs_where_it_was_measured_faster(cc, dtype, d, nq, nk, gqa, options, want):
    from flashlab.kernels.plan import wgmma_backward_fits

    assert wgmma_backward_fits(dtype, d, cc, nq, nk, gqa=gqa, options=options) is want


@pytest.mark.gpu
@gpu
def test_cuda_bfloat16_on_tensor_cores_with_autograd(rng):
    import flashlab.torch as ft

    q, k, v = qkv(rng, (2, 4, 100, 64), 90, dtype=torch.bfloat16, device="cuda")
    assert ft._cuda_variant(q) == ("wgmma" if torch.cuda.get_device_capability() >= (9, 0) else "tensor")
    ours, ref = cuda_vs_float64(q, k, v, True)
    assert ours[0].dtype == torch.bfloat16 and rel(ours[0], ref[0]) < 2e-2
    assert all(g.dtype == torch.bfloat16 and rel(g, r) < 5e-2 for g, r in zip(ours[1:], ref[1:]))


@pytest.mark.gpu
@gpu
def test_cuda_16bit_backward_runs_on_tensor_cores(rng, monkeypatch):
    import flashlab.kernels.backward as kb

    monkeypatch.setattr(kb, "TENSOR_DEFAULT", True)  # the default; set here so the test holds if it is turned off

    calls = spy_tensor_backward_builds(monkeypatch)
    for dtype, precision in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        q, k, v = qkv(rng, (1, 2, 150, 64), 150, dtype=dtype, device="cuda")
        sdpa(q, k, v, is_causal=True).sum().backward()  # do is a stride-0 broadcast: made contiguous first
        assert calls and calls[-1][0] == precision and q.grad.dtype == dtype and torch.isfinite(q.grad).all()


def spy_tensor_backward_builds(monkeypatch):
    """A list that gets (precision, features) for each tensor-backward build the calls ask for: the general path
    (launch) and the prepared one (PreparedBackward, emptied here so it prepares again) both call build."""
    import flashlab.kernels.tensor_backward as tb
    from flashlab.kernels import prepared

    monkeypatch.setattr(prepared, "_CALLS", {})
    calls, real = [], tb.build
    monkeypatch.setattr(tb, "build", lambda *a, **kw: calls.append((a[3], kw.get("features"))) or real(*a, **kw))
    return calls


@pytest.mark.gpu
@gpu
def test_autocast_casts_like_torch_sdpa(rng):
    q, k, v = qkv(rng, (2, 4, 200, 64), 200, device="cuda")  # float32 leaves
    do = torch.randn(2, 4, 200, 64, device="cuda")
    outs = {}
    for name, fn in (("flashlab", sdpa), ("torch", F.scaled_dot_product_attention)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(q, k, v, is_causal=True)
        outs[name] = (out, *torch.autograd.grad(out, (q, k, v), do.to(out.dtype)))
    assert outs["flashlab"][0].dtype == outs["torch"][0].dtype == torch.bfloat16
    for a, b in zip(outs["flashlab"], outs["torch"]):
        assert a.dtype == b.dtype and rel(a.float(), b.float()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["register", "tensor", "wgmma"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (2, 3), (3, 2)])
def test_cuda_tiny_backward_keeps_its_temporaries_apart(nq, nk, variant):
    """At N = 1 the backward's D and dQ accumulator fit one 512-byte block of torch's allocator: the prepared path
    must hold both while its kernels are enqueued, or they share memory. Twice, so that the second call is the
    prepared one."""
    from flashlab.kernels import flash_attention as kernel_forward, flash_attention_backward

    if variant == "wgmma" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the wgmma backward needs Hopper")
    dtype = torch.float32 if variant == "register" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(nq + nk)
    q, do = (torch.randn(1, 1, nq, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, nk, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    o, lse = kernel_forward(q, k, v, variant="tensor" if variant != "register" else "register")
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q64, k64, v64), (q64, k64, v64),
                               do.double())
    for _ in range(2):
        got = flash_attention_backward(q, k, v, o, lse, do, variant=variant)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            err = (a.double() - b).abs().max().item()
            assert err <= 1e-2 * max(1.0, b.abs().max().item()), f"{variant} {name}: max error {err:.3g}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_long_sequences_on_hopper_take_the_wgmma_backward(rng, monkeypatch, causal):
    """N = 4096, float16: on Hopper, autograd's backward runs variant="wgmma" (plan.wgmma_backward_fits), and its
    gradients match float64 as the tensor backward's do."""
    import flashlab.kernels as fk

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the wgmma backward needs Hopper")
    seen = []
    real = fk.flash_attention_backward
    monkeypatch.setattr(fk, "flash_attention_backward", lambda *a, **kw: seen.append(kw["variant"]) or real(*a, **kw))
    q, k, v = qkv(rng, (1, 2, 4096, 64), 4096, dtype=torch.float16, device="cuda")
    ours, ref = cuda_vs_float64(q, k, v, causal)
    assert seen == ["wgmma"]
    assert all(g.dtype == torch.float16 and rel(g, r) < 2e-2 for g, r in zip(ours[1:], ref[1:]))


def test_a_gpts_heads_are_read_in_place_and_odd_strides_copied():
    """flashlab.torch hands the wgmma kernels a GPT's heads (views of one linear output) as they lie, and copies
    only what TMA cannot read: a broadcast, rows of 60 values (120 bytes), a last axis with a stride."""
    import flashlab.torch as ft

    B, N, H, d = 2, 16, 4, 64
    x = torch.zeros(B, N, 3 * H * d, dtype=torch.float16)
    q = x[..., :H * d].view(B, N, H, d).transpose(1, 2)
    assert ft._tma_readable(q) is q
    for odd in (torch.zeros(1, 1, N, d).expand(B, H, N, d), torch.zeros(B, H, N, 68)[..., :60],
                torch.zeros(B, H, N, 2 * d)[..., ::2]):
        out = ft._tma_readable(odd)
        assert out is not odd and out.is_contiguous()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,causal", [(1024, True), (300, False)])
def test_cuda_a_gpts_heads_on_hopper(N, causal):
    """The GPT's layout (q, k, v views of one (B, N, 3 H d) tensor) through autograd on Hopper: the wgmma forward's
    O comes back laid out (B, N, H, d), so that y.transpose(1, 2).reshape(B, N, H d) is a view, as torch's is, and
    so do the wgmma backward's dq, dk, dv (N 1024), so that the heads' transpose and view take them back without a
    copy; the gradient of the linear output matches torch's SDPA in float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernels need Hopper")
    B, H, d = 2, 4, 64
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(B, N, 3 * H * d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    do = torch.randn(B, N, H * d, device="cuda", generator=g).to(torch.bfloat16)

    def layer(fn, x):
        heads = [t.view(B, N, H, d).transpose(1, 2) for t in x.split(H * d, dim=2)]
        y = fn(*heads, is_causal=causal)
        return y, y.transpose(1, 2).reshape(B, N, H * d), heads

    y, out, heads = layer(sdpa, x)
    assert y.transpose(1, 2).is_contiguous()  # O laid out (B, N, H, d): the reshape made no copy
    dx, *grads = torch.autograd.grad(out, [x, *heads], do)
    if N >= 512:  # the wgmma backward (plan.wgmma_backward_fits)
        assert all(g.transpose(1, 2).is_contiguous() for g in grads), [g.stride() for g in grads]
    x64 = x.detach().double().requires_grad_()
    _, out64, _ = layer(F.scaled_dot_product_attention, x64)
    dx64, = torch.autograd.grad(out64, x64, do.double())
    assert rel(out.double(), out64) < 2e-2 and rel(dx.double(), dx64) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1024, 200])
def test_cuda_repeated_calls_take_the_kept_prepared_call(N, monkeypatch):
    """The second autograd call with the same tensors' key skips the kernels' entry points (the kept prepared calls
    of flashlab.torch) and gives the first call's bits."""
    import flashlab.kernels as fk

    entries = []
    for name in ("flash_attention", "flash_attention_backward"):
        real = getattr(fk, name)
        monkeypatch.setattr(fk, name, lambda *a, _real=real, _name=name, **kw: entries.append(_name) or _real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(2, N, 3 * 4 * 64, device="cuda", generator=g).to(torch.float16)
    do = torch.randn(2, 4, N, 64, device="cuda", generator=g).to(torch.float16)
    outs = []
    for _ in range(2):
        leaf = x.detach().requires_grad_()
        q, k, v = (t.view(2, N, 4, 64).transpose(1, 2) for t in leaf.split(4 * 64, dim=2))
        y = sdpa(q, k, v, is_causal=True)
        outs.append((y, *torch.autograd.grad(y, leaf, do)))
    assert entries == ["flash_attention", "flash_attention_backward"]  # the second call: neither
    assert torch.equal(outs[0][0], outs[1][0])
    assert rel(outs[0][1].float(), outs[1][1].float()) < 1e-3  # dQ's atomics add in any order
