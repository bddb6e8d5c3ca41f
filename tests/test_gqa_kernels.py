"""GQA / MQA in the kernels: k and v with H_kv heads beside q's H, query head h reading K/V head
h // (H / H_kv), with no copies of K and V. In the simulator, on tiny shapes, each forward kernel against the
float64 reference on K/V repeated per query head (the tensor backward's GQA is in test_tensor_backward.py)."""
import numpy as np
import pytest

import flashlab as fl

pytest.importorskip("flashlab.kernels")
from flashlab.kernels import register, shared, tensor  # noqa: E402
from flashlab.kernels.register import Tile  # noqa: E402
from flashlab.kernels.tensor import TensorTile  # noqa: E402
from test_tensor_kernel import DT16, run_tensor  # noqa: E402


def inputs(rng, H, h_kv, nq, nk, d):
    q = rng.standard_normal((1, H, nq, d))
    k, v = (rng.standard_normal((1, h_kv, nk, d)) for _ in range(2))
    return q, k, v


def reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    return fl.reference_attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), causal=causal)


@pytest.mark.parametrize("H,h_kv,causal", [(4, 2, True), (3, 1, False)])
def test_register_and_shared_forward_read_the_grouped_kv_head(rng, H, h_kv, causal):
    q, k, v = (x.astype(np.float32) for x in inputs(rng, H, h_kv, 19, 23, 16))
    want_o, want_lse = reference(q, k, v, causal)
    for name, launch in (("register", lambda o, lse: register.launch(q, k, v, o, lse, H, 0.25, causal,
                                                                     Tile(16, 16, 4, 4))),
                         ("shared", lambda o, lse: shared.launch(q, k, v, o, lse, H, 0.25, causal, 16, 16))):
        o, lse = np.full(q.shape, np.nan, np.float32), np.full(q.shape[:3], np.nan, np.float32)
        launch(o, lse)
        assert fl.relative_error(o, want_o) < 1e-5 and fl.relative_error(lse, want_lse) < 1e-5, name


@pytest.mark.parametrize("precision", ["f16", "3xtf32"])
def test_tensor_forward_reads_the_grouped_kv_head(rng, precision):
    q, k, v = inputs(rng, 4, 1, 17, 14, 32)
    o, lse, seen = run_tensor(q, k, v, True, precision, TensorTile(1, 16))
    want_o, want_lse = reference(*seen, True)
    assert fl.relative_error(o, want_o) < (2e-3 if precision in DT16 else 1e-5)
    assert fl.relative_error(lse, want_lse) < 1e-5


def test_register_backward_sums_dk_dv_over_the_group(rng):
    from flashlab.kernels import backward as kb
    from flashlab.kernels.options import plain_arguments
    from test_kernels_backward import exact_grads

    H, h_kv, nq, nk, d = 4, 2, 19, 23, 16
    q, do = (rng.standard_normal((1, H, nq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, h_kv, nk, d)).astype(np.float32) for _ in range(2))
    o, lse, dq, dk, dv = exact_grads(q, np.repeat(k, 2, 1), np.repeat(v, 2, 1), do, True)
    preprocess, dkdv, _ = kb.make_kernels(d, 8, 16, 32, gqa=True)
    D, dq_got = np.zeros((1, H, nq), np.float32), np.zeros((1, H, nq, d), np.float32)
    dk_got, dv_got = (np.zeros((1, h_kv, nk, d), np.float32) for _ in range(2))
    o32, lse32 = o.astype(np.float32), lse.astype(np.float32)
    preprocess[(1, H, 1), 32](o32, do, D, dq_got)
    left, right, cap, slopes = plain_arguments(True)
    dkdv[(-(-nk // 16), h_kv, 1), 32](q, k, v, do, lse32, D, dq_got, dk_got, dv_got, np.float32(0.25), True, 0, 0, left,
                                      right, cap, slopes, 0)
    for name, got, want in (("dq", dq_got, dq), ("dk", dk_got, dk.reshape(1, h_kv, 2, nk, d).sum(2)),
                            ("dv", dv_got, dv.reshape(1, h_kv, 2, nk, d).sum(2))):
        assert fl.relative_error(got, want) < 1e-4, name


def test_the_public_api_takes_gqa(rng):
    """flash_attention and flash_attention_backward accept k and v with H_kv heads (NumPy in, the simulator)."""
    from flashlab.kernels import flash_attention, flash_attention_backward

    q, k, v = (x.astype(np.float32) for x in inputs(rng, 4, 2, 9, 11, 16))
    do = rng.standard_normal(q.shape).astype(np.float32)
    want_o, want_lse = reference(q, k, v, True)
    want = fl.flash_attention_v2_backward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), want_o,
                                          want_lse, do.astype(np.float64), causal=True)
    for variant in ("register", "shared"):
        o, lse = flash_attention(q, k, v, causal=True, variant=variant, block_q=16, block_k=16)
        assert fl.relative_error(o, want_o) < 1e-5, variant
    got = flash_attention_backward(q, k, v, o, lse, do, causal=True, block_q=8, block_k=16, threads=32)
    assert got[1].shape == k.shape
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert fl.relative_error(g, w) < 1e-4, name
    with pytest.raises(ValueError, match="divide"):
        flash_attention(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gqa_every_variant_against_float64(rng, causal):
    """On a GPU, torch tensors in: each forward variant and each backward reads K/V head h // (H / H_kv)."""
    torch = pytest.importorskip("torch")
    from flashlab.device import has_gpu

    if not has_gpu():
        pytest.skip("needs a CUDA GPU")
    from flashlab.kernels import flash_attention, flash_attention_backward

    H, h_kv, nq, nk, d = 8, 2, 333, 517, 64
    q, k, v = inputs(rng, H, h_kv, nq, nk, d)
    do = rng.standard_normal(q.shape)
    want_o, want_lse = reference(q, k, v, causal)
    want = fl.flash_attention_v2_backward(q, k, v, want_o, want_lse, do, causal=causal)
    for dtype, variants, tol in ((torch.float32, ("register", "shared", "tensor"), 1e-4),
                                 (torch.float16, ("tensor",), 5e-3)):
        tq, tk, tv, tdo = (torch.tensor(x, device="cuda", dtype=dtype) for x in (q, k, v, do))
        for variant in variants:
            o, lse = flash_attention(tq, tk, tv, causal=causal, variant=variant)
            assert fl.relative_error(o.double().cpu().numpy(), want_o) < tol, (variant, dtype)
        bwd = ("register", "tensor") if dtype == torch.float32 else ("tensor",)
        for variant in bwd:
            got = flash_attention_backward(tq, tk, tv, o, lse, tdo, causal=causal, variant=variant)
            assert got[1].shape == tk.shape
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                err = fl.relative_error(g.double().cpu().numpy(), w)
                assert err < 10 * tol, f"{variant} {dtype} {name}: {err:.2e}"
