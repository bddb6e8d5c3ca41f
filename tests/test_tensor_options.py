"""The library's window, alignment, ALiBi and softcap in the tensor-core forward (kernels/tensor.py, extras=...)
against the float64 reference: in the simulator on a few blocks, on a GPU at larger shapes."""
import numpy as np
import pytest

import flashlab as fl
from flashlab.kernels import flash_attention

CASES = [  # B, H, H_kv, Nq, Nk, dtype, splits, options
    (1, 1, 1, 20, 29, np.float16, None, dict(causal=True, align="bottom_right", window_size=(5, 2))),
    (2, 1, 1, 18, 18, np.float32, None, dict(causal=True, softcap=1.5, alibi_slopes=np.array([[0.5], [0.3]]))),
    (1, 2, 1, 17, 33, np.float16, None, dict(window_size=(8, -1), softcap=3.0)),   # GQA; rows see no key at the top
    (1, 1, 1, 16, 40, np.float32, 2, dict(window_size=(6, 6), align="bottom_right")),  # split-KV with a window
]


def inputs(rng, B, H, H_kv, nq, nk, dtype, d=16):
    q = (1.5 * rng.standard_normal((B, H, nq, d))).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, nk, d)).astype(dtype) for _ in range(2))
    return q, k, v


def check(q, k, v, splits, opts, block=16):
    o, lse = flash_attention(q, k, v, variant="tensor", block_q=block, block_k=block, splits=splits, **opts)
    want_o, want_lse = fl.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), **opts)
    empty = np.isinf(want_lse)
    assert np.array_equal(np.isinf(lse), empty) and np.all(o[empty] == 0), opts
    tol, lse_tol = (2e-3, 1e-3) if q.dtype == np.float16 else (1e-5, 1e-5)
    assert fl.relative_error(o, want_o) < tol, opts
    assert np.max(np.abs(lse[~empty] - want_lse[~empty])) < lse_tol, opts


@pytest.mark.parametrize("B,H,H_kv,nq,nk,dtype,splits,opts", CASES)
def test_tensor_kernel_options_match_reference(rng, B, H, H_kv, nq, nk, dtype, splits, opts):
    check(*inputs(rng, B, H, H_kv, nq, nk, dtype), splits, opts)


def test_tensor_window_skips_key_tiles(rng):
    """Key tiles outside the band of a block's rows are never read: NaN keys there leave the output finite."""
    q, k, v = inputs(rng, 1, 1, 1, 16, 64, np.float16)
    k[..., 40:, :] = np.nan  # rows 0..15 with window (4, 4) see keys 0..19; tiles 32.. must not even be loaded
    v[..., 40:, :] = np.nan
    o, _ = flash_attention(q, k, v, variant="tensor", block_q=16, block_k=16, window_size=(4, 4))
    assert np.all(np.isfinite(o))


def test_tensor_variant_takes_dropout_with_the_other_options(rng):
    """Dropout on top of the transformed and masked S (its own tests: test_tensor_dropout.py); the textbook kernel
    still has no dropout and says so rather than returning a dropout-free output."""
    q, k, v = inputs(rng, 1, 1, 1, 20, 29, np.float16)
    opts = dict(causal=True, align="bottom_right", window_size=(9, 2), softcap=2.0, alibi_slopes=np.array([0.4]))
    check(q, k, v, None, dict(opts, dropout_p=0.25, seed=2 ** 40 + 5))
    o = flash_attention(q, k, v, variant="tensor", block_q=16, block_k=16, dropout_p=0.25, seed=2 ** 40 + 5, **opts)[0]
    plain = flash_attention(q, k, v, variant="tensor", block_q=16, block_k=16, **opts)[0]
    assert fl.relative_error(o, plain) > 0.1  # the mask was applied
    with pytest.raises(ValueError, match=r"dropout_p=0\.1 needs variant='register' or 'tensor'.*got variant='shared'"):
        flash_attention(q, k, v, variant="shared", dropout_p=0.1, seed=1)


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_tensor_kernel_options_on_gpu(rng, d):
    for B, H, H_kv, nq, nk, dtype, splits, opts in CASES:
        q, k, v = inputs(rng, B, H, H_kv, 20 * nq, 20 * nk, dtype, d)
        o, lse = flash_attention(q, k, v, variant="tensor", splits=splits, **opts)
        want_o, want_lse = fl.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), **opts)
        empty = np.isinf(want_lse)
        assert np.array_equal(np.isinf(lse), empty)
        assert fl.relative_error(o, want_o) < (3e-3 if dtype == np.float16 else 1e-5), opts
