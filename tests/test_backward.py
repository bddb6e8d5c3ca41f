"""FA2 backward against an analytic float64 gradient, which is itself checked by finite differences."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashlab as fl
from conftest import TOL, random_qkv


def analytic_grads(q, k, v, do, causal, scale=None):
    """dL/dq, dL/dk, dL/dv of L = sum(O * dO), written out with the full N x N matrices in float64."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))  # softmax Jacobian-vector product
    return scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv


def test_analytic_gradient_matches_finite_differences(rng):
    q, k, v = random_qkv(rng, (2,), 5, 6, 3, 4, np.float64)
    do = rng.standard_normal((2, 5, 4))
    grads = analytic_grads(q, k, v, do, causal=True)
    loss = lambda q, k, v: float((fl.reference_attention(q, k, v, causal=True)[0] * do).sum())
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = loss(q, k, v)
            x[idx] = old - eps
            down = loss(q, k, v)
            x[idx] = old
            fd[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


@given(
    batch=st.sampled_from([(), (2,), (2, 2)]),
    nq=st.integers(1, 50), nk=st.integers(1, 50), d=st.integers(1, 12), dv=st.integers(1, 12),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]), causal=st.booleans(),
    block_q=st.one_of(st.none(), st.integers(1, 30)), block_k=st.one_of(st.none(), st.integers(1, 30)),
    seed=st.integers(0, 2**32 - 1),
)
def test_fa2_backward_matches_analytic(batch, nq, nk, d, dv, dtype, causal, block_q, block_k, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, nq, nk, d, dv, dtype)
    do = rng.standard_normal(batch + (nq, dv)).astype(dtype)
    o, lse = fl.flash_attention_v2(q, k, v, causal=causal)
    args = [x.copy() for x in (q, k, v, o, lse, do)]
    grads = fl.flash_attention_v2_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k)
    want = analytic_grads(q, k, v, do, causal)
    # float16 o is rounded, so D = rowsum(dO * O) carries ~1e-3 error; the tolerance covers it.
    tol = 3e-2 if dtype == np.float16 else TOL[dtype] * 10
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype, name
        assert np.all(np.isfinite(g)), name
        err = fl.relative_error(g, w)
        assert err <= tol or np.linalg.norm(w) < 1e-6, (name, err)
    for a, a0 in zip((q, k, v, o, lse, do), args):
        np.testing.assert_array_equal(a, a0)


def test_keys_no_query_can_see_get_zero_gradient(rng):
    """Causal with Nk > Nq: keys after the last query are invisible, so dk and dv there are exactly 0."""
    q, k, v = random_qkv(rng, (), 4, 10, 3, 3, np.float64)
    do = rng.standard_normal((4, 3))
    o, lse = fl.flash_attention_v2(q, k, v, causal=True)
    _, dk, dv = fl.flash_attention_v2_backward(q, k, v, o, lse, do, causal=True, block_k=2)
    assert np.all(dk[4:] == 0) and np.all(dv[4:] == 0)
    assert np.abs(dv[:4]).sum() > 0


def test_backward_needs_the_forward_lse(rng):
    q, k, v = random_qkv(rng, (), 4, 4, 3, 3, np.float64)
    o, lse = fl.flash_attention_v2(q, k, v)
    with pytest.raises(ValueError, match="lse must have shape"):
        fl.flash_attention_v2_backward(q, k, v, o, lse[:-1], o)
    with pytest.raises(ValueError, match="do must have the shape of o"):
        fl.flash_attention_v2_backward(q, k, v, o, lse, o[:, :2])
    with pytest.raises(ValueError, match="lse contains inf or NaN"):
        fl.flash_attention_v2_backward(q, k, v, o, np.full_like(lse, np.nan), o)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_backward_matches_analytic(dtype, causal, rng):
    q, k, v = random_qkv(rng, (2,), 13, 21, 5, 3, dtype)
    do = rng.standard_normal((2, 13, 3)).astype(dtype)
    grads = fl.naive_attention_backward(q, k, v, do, causal=causal)
    tol = 3e-2 if dtype == np.float16 else TOL[dtype] * 10
    for g, w, x in zip(grads, analytic_grads(q, k, v, do, causal), (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
        assert fl.relative_error(g, w) <= tol


def test_naive_backward_rejects_bad_do(rng):
    q, k, v = random_qkv(rng, (), 4, 4, 3, 2, np.float64)
    with pytest.raises(ValueError, match=r"do must have shape \(4, 2\)"):
        fl.naive_attention_backward(q, k, v, np.ones((4, 3)))
