"""Split-KV attention (flash-decoding): the NumPy version, its pieces, and the Numba kernel in the simulator."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import flashlab
from flashlab.decoding import (chunk_bounds, chunk_partial, default_num_splits, flash_decoding, merge_partials,
                               merge_states, split_kv_partials)
from conftest import TOL, random_qkv


# ------------------------------------------------------------------------------------------------ NumPy
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_numpy_matches_reference(rng, batch, dtype):
    for nq in (1, 2, 3, 4):
        nk = int(rng.integers(1, 400))
        d, dv = (int(x) for x in rng.integers(1, 40, 2))
        q, k, v = random_qkv(rng, batch, nq, nk, d, dv, dtype, logit_scale=3.0)
        ref_o, ref_lse = flashlab.reference_attention(q, k, v)
        for num_splits in {1, 2, 7, nk, int(rng.integers(1, nk + 1)), None}:
            o, lse = flash_decoding(q, k, v, num_splits=num_splits)
            assert o.dtype == dtype and o.shape == ref_o.shape and lse.shape == ref_lse.shape
            assert flashlab.relative_error(o, ref_o) < TOL[dtype], (nq, nk, num_splits)
            assert flashlab.relative_error(lse, ref_lse) < min(TOL[dtype], 1e-5)


@given(nk=st.integers(1, 500), num_splits=st.integers(1, 500))
def test_chunk_bounds_cover_every_key_once_with_no_empty_chunk(nk, num_splits):
    num_splits = min(num_splits, nk)
    bounds = chunk_bounds(nk, num_splits)
    assert bounds[0][0] == 0 and bounds[-1][1] == nk
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    assert len(bounds) <= num_splits
    sizes = {b - a for a, b in bounds[:-1]}
    assert len(sizes) <= 1 and bounds[-1][1] - bounds[-1][0] <= max(sizes | {nk})  # only the last is shorter


def test_partials_are_the_chunks_own_softmax_state(rng):
    q, k, v = random_qkv(rng, (2,), 3, 50, 8, 5, np.float64)
    m, l, O = split_kv_partials(q, k, v, num_splits=4)  # chunks of 13, 13, 13, 11 keys
    assert m.shape == (2, 4, 3) and l.shape == (2, 4, 3) and O.shape == (2, 4, 3, 5)
    for c, (a, b) in enumerate(chunk_bounds(50, 4)):
        S = q @ k[:, a:b].swapaxes(-1, -2) / math.sqrt(8)
        np.testing.assert_allclose(m[:, c], S.max(-1))
        np.testing.assert_allclose(l[:, c], np.exp(S - S.max(-1, keepdims=True)).sum(-1))
        np.testing.assert_allclose(O[:, c], np.exp(S - S.max(-1, keepdims=True)) @ v[:, a:b])


def test_merge_is_order_free_and_empty_chunks_are_identity(rng):
    q, k, v = random_qkv(rng, (), 2, 60, 4, 4, np.float64, logit_scale=5.0)
    m, l, O = split_kv_partials(q, k, v, num_splits=5)
    ref_o, ref_lse = flashlab.reference_attention(q, k, v)
    perm = rng.permutation(5)
    o, lse = merge_partials(m[perm], l[perm], O[perm])
    assert flashlab.relative_error(o, ref_o) < 1e-12 and flashlab.relative_error(lse, ref_lse) < 1e-12
    empty = (np.full(2, -np.inf), np.zeros(2), np.zeros((2, 4)))
    for got, want in zip(merge_states(*empty, m[0], l[0], O[0]), (m[0], l[0], O[0])):
        np.testing.assert_allclose(got, want)
    m_e, l_e, O_e = merge_states(*empty, *empty)
    assert np.all(np.isneginf(m_e)) and np.all(l_e == 0) and np.all(O_e == 0) and not np.isnan(O_e).any()


def test_chunk_partial_survives_huge_logits(rng):
    q, k, v = random_qkv(rng, (), 1, 30, 16, 16, np.float32, logit_scale=500.0)  # scores ~ 2000
    m, l, O = chunk_partial(q, k, v, 0.25)
    assert np.isfinite(m).all() and np.isfinite(l).all() and np.isfinite(O).all() and (l >= 1).all()


def test_default_num_splits():
    assert default_num_splits(1, 100_000, n_sm=132) == 264  # one (batch, head): fill every SM twice
    assert default_num_splits(512, 100_000, n_sm=132) == 1  # enough (batch, head) blocks already
    assert default_num_splits(1, 100, n_sm=132) == 1  # chunks of at least MIN_CHUNK keys
    assert default_num_splits(1, 10, n_sm=132) == 1


@pytest.mark.parametrize("num_splits,err,match", [
    (0, ValueError, "between 1 and Nk = 10"), (11, ValueError, "between 1 and Nk = 10"),
    (2.0, TypeError, "num_splits must be a positive integer"), (True, TypeError, "num_splits"),
])
def test_bad_num_splits(rng, num_splits, err, match):
    q, k, v = random_qkv(rng, (), 1, 10, 4, 4, np.float32)
    with pytest.raises(err, match=match):
        flash_decoding(q, k, v, num_splits=num_splits)


def test_bad_shapes_are_named(rng):
    q, k, v = random_qkv(rng, (2,), 1, 10, 4, 4, np.float32)
    with pytest.raises(ValueError, match="same number of keys"):
        flash_decoding(q, k, v[:, :9])
    with pytest.raises(ValueError, match="feature dim"):
        flash_decoding(q[..., :3], k, v)
    with pytest.raises(ValueError, match="n_splits"):
        merge_partials(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 4, 5)))


# ------------------------------------------------------------------------------ the kernel (simulator/GPU)
kernels = pytest.importorskip("flashlab.kernels.decoding")


def _kernel_case(rng, B, H, nq, nk, d, dtype, num_splits, threads=32):
    q, k, v = random_qkv(rng, (B, H), nq, nk, d, d, dtype, logit_scale=2.0)
    o, lse, m, l, O = kernels.flash_decoding(q, k, v, num_splits=num_splits, threads=threads, return_partials=True)
    ref_o, ref_lse = flashlab.reference_attention(q, k, v)
    tol = TOL[np.float16] if dtype == np.float16 else 2e-5
    assert o.dtype == dtype and lse.dtype == np.float32 and o.shape == ref_o.shape
    assert flashlab.relative_error(o, ref_o) < tol and flashlab.relative_error(lse, ref_lse) < 1e-5
    pm, pl, pO = split_kv_partials(q, k, v, num_splits=num_splits)
    for got, want in ((m, pm), (l, pl), (O, pO)):
        assert got.shape == want.shape and flashlab.relative_error(got, want) < 1e-5


@pytest.mark.parametrize("nq,nk,d,dtype,num_splits", [
    (1, 200, 16, np.float32, 3),  # ragged chunks (67, 67, 66) and tiles of 32 keys: ragged tiles too
    (2, 97, 32, np.float16, 4),
    (3, 45, 16, np.float32, 2),  # Nq not a power of two
    (4, 130, 16, np.float32, 5),
])
def test_kernel_matches_reference_and_numpy_partials(rng, nq, nk, d, dtype, num_splits):
    _kernel_case(rng, 1, 2, nq, nk, d, dtype, num_splits)


def test_kernel_one_split_and_batch(rng):
    _kernel_case(rng, 2, 1, 1, 33, 16, np.float32, 1, threads=16)


@pytest.mark.parametrize("change,err,match", [
    (dict(q_shape=(1, 1, 17, 16)), ValueError, "at most 16"),
    (dict(d=20), ValueError, "not supported by the GPU kernels"),
    (dict(dtype=np.float64), TypeError, "float32 or float16"),
    (dict(threads=2, q_shape=(1, 1, 3, 16)), ValueError, "threads must be between 4"),
    (dict(threads=2048), ValueError, "1024"),
    (dict(num_splits=0), ValueError, "num_splits"),
])
def test_kernel_bad_inputs(rng, change, err, match):
    d = change.get("d", 16)
    q_shape = change.get("q_shape", (1, 1, 1, d))
    dtype = change.get("dtype", np.float32)
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal((1, 1, 8, d)).astype(dtype)
    with pytest.raises(err, match=match):
        kernels.flash_decoding(q, k, k, threads=change.get("threads"), num_splits=change.get("num_splits"))


gpu = pytest.mark.skipif(not flashlab.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_on_gpu_long_cache(rng, d):
    for nq, nk, dtype in ((1, 16384, np.float16), (4, 5000, np.float32)):
        q, k, v = random_qkv(rng, (2, 8), nq, nk, d, d, dtype)
        o, lse = kernels.flash_decoding(q, k, v)
        ref_o, ref_lse = flashlab.reference_attention(q, k, v)
        assert flashlab.relative_error(o, ref_o) < (1e-2 if dtype == np.float16 else 1e-5)
        assert flashlab.relative_error(lse, ref_lse) < 1e-5


@pytest.mark.gpu
@gpu
def test_kernel_on_gpu_with_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(a, device="cuda") for a in random_qkv(rng, (1, 4), 1, 3000, 64, 64, np.float32))
    o, lse = kernels.flash_decoding(q, k, v, num_splits=7)
    assert o.is_cuda and lse.is_cuda
    ref_o, _ = flashlab.reference_attention(*(t.cpu().numpy() for t in (q, k, v)))
    assert flashlab.relative_error(o.cpu().numpy(), ref_o) < 1e-5
