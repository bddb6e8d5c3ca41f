"""The backward kernels against float64 gradients: in the CUDA simulator (CI) and on a GPU (marked gpu).

Simulator cases are tiny (few blocks of 32 threads) but cover ragged tails, Nq != Nk, causal with skipped
blocks, float16, N = 1 and several tile splits. Tolerances: ~1e-4 (float32) and ~1e-2 (float16) relative
error; a kernel that drops the D term or shifts the causal diagonal by one is off by far more.
"""
import numpy as np
import pytest

import flashlab as fl
from flashlab.device import has_gpu

kb = pytest.importorskip("flashlab.kernels.backward")
from flashlab.kernels import SUPPORTED_D, register_backward  # noqa: E402

TOL = {np.float32: 1e-4, np.float16: 1e-2}


def exact_grads(q, k, v, do, causal):
    """(o, lse, dq, dk, dv) of attention in float64, with the full Nq x Nk matrices (test sizes only)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    scale = 1 / np.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    p /= l
    o = p @ v
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return o, (m + np.log(l))[..., 0], scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do


def make_case(rng, shape_q, nk, causal, dtype):
    B, H, nq, d = shape_q
    q, do = (rng.standard_normal((B, H, nq, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, H, nk, d)).astype(dtype) for _ in range(2))
    o, lse, *grads = exact_grads(q, k, v, do, causal)
    return (q, k, v, o.astype(dtype), lse.astype(np.float32), do), grads


def check(rng, shape_q, nk, causal, dtype, convert=lambda x: x, back=lambda x: x, **config):
    inputs, want = make_case(rng, shape_q, nk, causal, dtype)
    got = kb.flash_attention_backward(*map(convert, inputs), causal=causal, **config)
    for name, g, w in zip(("dq", "dk", "dv"), map(back, got), want):
        assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        # A gradient that is exactly zero (one visible key: dq = 0) has no relative error: compare absolutely.
        err = fl.relative_error(g, w) if np.linalg.norm(w) > 1e-6 else float(np.abs(g - w).max())
        assert err < TOL[dtype], f"{name}: relative error {err:.2e} (shape {shape_q}, Nk {nk}, causal {causal})"


SMALL = dict(block_q=8, block_k=16, threads=32)

# (B, H, Nq, d), Nk, causal, dtype, config
SIM_CASES = [
    ((1, 1, 19, 16), 23, False, np.float32, SMALL),  # ragged tails in both dims
    ((1, 2, 23, 16), 13, True, np.float32, SMALL),  # Nq > Nk, causal
    ((1, 1, 10, 16), 37, True, np.float32, SMALL),  # Nq < Nk, causal: key blocks past Nq get zero gradients
    ((2, 1, 17, 16), 17, True, np.float16, SMALL),  # float16 in, float32 accumulation
    ((1, 1, 1, 16), 1, False, np.float32, SMALL),  # N = 1 (dq = 0: one key)
    ((1, 1, 1, 16), 5, False, np.float32, SMALL),  # one query
    ((1, 1, 3, 16), 40, True, np.float32, SMALL),  # causal: 3 of 40 keys visible, later blocks skipped
    ((1, 1, 21, 32), 18, True, np.float32, dict(block_q=16, block_k=8, threads=32)),  # other tile splits
    ((1, 1, 9, 64), 11, False, np.float32, dict(block_q=4, block_k=8, threads=32)),
]


@pytest.mark.parametrize("shape_q, nk, causal, dtype, config", SIM_CASES)
def test_backward_matches_float64(rng, shape_q, nk, causal, dtype, config):
    check(rng, shape_q, nk, causal, dtype, **config)


def test_default_config_and_explicit_scale(rng):
    inputs, _ = make_case(rng, (1, 1, 12, 16), 12, False, np.float32)
    q, k, v, _, _, do = inputs
    scale = 0.3
    ref_o, ref_lse = fl.reference_attention(q, k, v, scale=scale)
    f64 = lambda x: x.astype(np.float64)
    want = fl.flash_attention_v2_backward(f64(q), f64(k), f64(v), ref_o, ref_lse, f64(do), scale=scale)
    got = kb.flash_attention_backward(q, k, v, ref_o.astype(np.float32), ref_lse.astype(np.float32), do,
                                      scale=scale)
    for g, w in zip(got, want):
        assert fl.relative_error(g, w) < TOL[np.float32]


def test_tile_split_covers_every_entry_once():
    for rows, cols, threads in [(16, 64, 128), (8, 32, 64), (64, 64, 128), (8, 16, 32), (32, 64, 256)]:
        tr, tc, nr, nc = register_backward.tile_split(rows, cols, threads)
        owned = [(y + nr * a, x + nc * b) for t in range(threads) for y, x in [divmod(t, nc)]
                 for a in range(tr) for b in range(tc)]
        assert sorted(owned) == [(r, c) for r in range(rows) for c in range(cols)]


def _inputs(rng, d=16, nq=8, nk=8, dtype=np.float32):
    return list(make_case(rng, (1, 1, nq, d), nk, False, dtype)[0])


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.__setitem__(0, a[0][..., :12]), ValueError, "12"),  # q's d (12) differs from k's
    (lambda a: a.__setitem__(4, a[4][..., :5]), ValueError, "lse"),
    (lambda a: a.__setitem__(5, a[5].astype(np.float16)), TypeError, "do"),
    (lambda a: a.__setitem__(4, a[4].astype(np.float64)), TypeError, "lse"),
    (lambda a: a.__setitem__(1, a[1][0]), ValueError, "k"),
])
def test_bad_inputs(rng, change, error, match):
    args = _inputs(rng)
    change(args)
    with pytest.raises(error, match=match):
        kb.flash_attention_backward(*args)


def test_unsupported_d_and_configs(rng):
    with pytest.raises(ValueError, match="24"):
        kb.flash_attention_backward(*_inputs(rng, d=24))
    args = _inputs(rng)
    with pytest.raises(ValueError, match="threads=48"):
        kb.flash_attention_backward(*args, threads=48)
    with pytest.raises(ValueError, match="shared memory"):
        kb.flash_attention_backward(*args, block_q=64, block_k=256)
    with pytest.raises(ValueError, match="block_k"):
        kb.flash_attention_backward(*args, block_k=0)
    with pytest.raises(TypeError, match="causal"):
        kb.flash_attention_backward(*args, causal=1)


# ---- on a GPU: the default (fast) tile shapes, every supported d ----

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", SUPPORTED_D)
@pytest.mark.parametrize("n", [1, 17, 128, 1000, 4096])
@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_gpu_backward(rng, n, d, causal, dtype):
    heads = 1 if n > 1000 else 3
    check(rng, (1, heads, n, d), n, causal, dtype)


@pytest.mark.parametrize("nq, nk", [(1000, 77), (77, 1000)])
@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_gpu_backward_nq_ne_nk(rng, nq, nk):
    check(rng, (2, 2, nq, 64), nk, True, np.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_gpu_torch_and_numba_inputs(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from numba import cuda

    check(rng, (1, 2, 300, 64), 300, True, np.float32,
          convert=lambda x: torch.from_numpy(x).cuda().transpose(1, 2).contiguous().transpose(1, 2),
          back=lambda x: x.cpu().numpy())  # a strided (non-contiguous) view: no copies, indexing by strides
    check(rng, (1, 2, 300, 64), 300, False, np.float16, convert=cuda.to_device, back=lambda x: x.copy_to_host())
