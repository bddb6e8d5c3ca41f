"""The register forward kernel with the FlashAttention library's options (window, align, ALiBi, softcap), in the
simulator on small shapes and on a GPU, against the float64 reference that builds the mask and bias explicitly."""
import numpy as np
import pytest

import flashlab as fl
from flashlab.kernels import flash_attention

register = pytest.importorskip("flashlab.kernels.register")


def check(rng, B, H, H_kv, nq, nk, d=16, splits=None, **opts):
    q = (2 * rng.standard_normal((B, H, nq, d))).astype(np.float32)
    k, v = (rng.standard_normal((B, H_kv, nk, d)).astype(np.float32) for _ in range(2))
    o, lse = flash_attention(q, k, v, variant="register", splits=splits, **opts)
    want_o, want_lse = fl.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), **opts)
    empty = np.isinf(want_lse)
    assert np.array_equal(np.isinf(lse), empty), (np.argwhere(np.isinf(lse) != empty)[:5], opts)
    assert np.all(o[empty] == 0)
    assert fl.relative_error(o[~empty], want_o[~empty]) < 2e-5, opts
    assert np.max(np.abs(lse[~empty] - want_lse[~empty])) < 1e-4, opts


CASES = [  # (B, H, H_kv, nq, nk, splits, options)
    (1, 2, 2, 37, 37, None, dict(window_size=(5, 3))),
    (1, 2, 1, 19, 45, None, dict(window_size=(6, 0), causal=True, align="bottom_right")),
    (1, 2, 2, 45, 19, None, dict(causal=True, align="bottom_right")),  # the first 26 rows see no key
    (2, 2, 2, 21, 30, None, dict(alibi_slopes=np.array([[0.5, 0.25], [0.125, 1.0]]), causal=True)),
    (1, 2, 2, 25, 25, None, dict(softcap=1.5, alibi_slopes=np.array([0.3, 0.7]))),
    (1, 2, 2, 33, 70, 2, dict(window_size=(8, 8), align="bottom_right")),  # split-KV: chunks a row never sees
    (1, 2, 2, 40, 40, None, dict(window_size=(0, 0))),  # each row sees only its own key
]


@pytest.mark.parametrize("B,H,H_kv,nq,nk,splits,opts", CASES)
def test_register_kernel_options_match_reference(rng, B, H, H_kv, nq, nk, splits, opts):
    check(rng, B, H, H_kv, nq, nk, splits=splits, **opts)


def test_window_skips_key_tiles(rng):
    """Tiles outside the band are never loaded: the kernel's loop bounds, seen through the key range it reads."""
    q = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    nan_far = k.copy()
    nan_far[..., 40:, :] = np.nan  # keys no row of block 0..15 may see with window (4, 4): must never be read
    o, _ = flash_attention(q[:, :, :16], nan_far, nan_far, variant="register", block_q=16, block_k=16,
                           window_size=(4, 4))
    assert np.all(np.isfinite(o))


def test_options_need_the_register_variant(rng):
    q = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    with pytest.raises(NotImplementedError, match="variant='register'"):
        flash_attention(q, q, q, variant="shared", softcap=2.0)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attention(q, q, q, window_size=3)


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_register_kernel_options_on_gpu(rng, d):
    for B, H, H_kv, nq, nk, splits, opts in CASES:
        check(rng, B, H, H_kv, 8 * nq, 8 * nk, d=d, splits=splits, **opts)


BACKWARD_CASES = [  # (B, H, H_kv, nq, nk, options)
    (1, 2, 2, 37, 37, dict(window_size=(5, 3))),
    (1, 4, 2, 19, 45, dict(window_size=(6, 0), causal=True, align="bottom_right")),
    (1, 2, 2, 45, 19, dict(causal=True, align="bottom_right")),
    (2, 2, 1, 21, 30, dict(alibi_slopes=np.array([[0.5, 0.25], [0.125, 1.0]]), causal=True)),
    (1, 2, 2, 25, 25, dict(softcap=1.5, alibi_slopes=np.array([0.3, 0.7]))),
]


@pytest.mark.parametrize("B,H,H_kv,nq,nk,opts", BACKWARD_CASES)
def test_register_backward_options_match_float64(rng, B, H, H_kv, nq, nk, opts):
    from flashlab.kernels import flash_attention_backward

    d = 16
    q = (2 * rng.standard_normal((B, H, nq, d))).astype(np.float32)
    k, v = (rng.standard_normal((B, H_kv, nk, d)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, H, nq, d)).astype(np.float32)
    o, lse = flash_attention(q, k, v, variant="register", **opts)
    got = flash_attention_backward(q, k, v, o, lse, do, variant="register", **opts)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    o64, lse64 = fl.reference_attention(*f64[:3], **opts)
    want = fl.flash_attention_v2_backward(*f64[:3], o64, lse64, f64[3], **opts)  # tested against autograd
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and fl.relative_error(g, w) < 1e-4, (name, opts)


def test_backward_options_need_a_backward_variant(rng):
    from flashlab.kernels import flash_attention_backward

    q = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="variant must be 'register', 'tensor' or 'wgmma' for the backward"):
        flash_attention_backward(q, q, q, q, lse, q, variant="shared", softcap=2.0)
