"""Bad input: every public attention function raises a clear error naming the argument and the value."""
import numpy as np
import pytest

import flashlab as fl

FORWARD = [fl.reference_attention, fl.naive_attention, fl.flash_attention_v1, fl.flash_attention_v2]
rng = np.random.default_rng(0)
Q, K, V = (rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3))

BAD = [  # (id, q, k, v, kwargs, exception, message that must appear)
    ("1-dim q", Q[0, 0], K, V, {}, ValueError, r"q must have at least 2 dims .* got shape \(4,\)"),
    ("batch mismatch", Q, K[:1], V[:1], {}, ValueError, r"same leading \(batch, head\) dims; got q \(2,\), k \(1,\)"),
    ("d mismatch", Q, K[..., :3], V, {}, ValueError, r"q.shape\[-1\]=4, k.shape\[-1\]=3"),
    ("Nk mismatch", Q, K, V[:, :4], {}, ValueError, r"k.shape\[-2\]=5, v.shape\[-2\]=4"),
    ("no keys", Q, K[:, :0], V[:, :0], {}, ValueError, r"Nk = 0"),
    ("no queries", Q[:, :0], K, V, {}, ValueError, r"Nq = 0"),
    ("int dtype", Q.astype(np.int32), K, V, {}, TypeError, r"q has dtype int32; expected float16, float32 or float64"),
    ("string dtype", np.full((5, 4), "a"), K[0], V[0], {}, TypeError, r"q has dtype <U1"),
    ("complex dtype", Q, K.astype(np.complex64), V, {}, TypeError, r"k has dtype complex64"),
    ("mixed dtypes", Q, K.astype(np.float64), V, {}, TypeError, r"share one dtype; got q float32, k float64"),
    ("inf scale", Q, K, V, {"scale": np.inf}, ValueError, r"scale must be finite; got inf"),
    ("nan scale", Q, K, V, {"scale": float("nan")}, ValueError, r"scale must be finite; got nan"),
    ("string scale", Q, K, V, {"scale": "0.5"}, TypeError, r"scale must be a real number or None; got '0.5'"),
    ("causal not bool", Q, K, V, {"causal": "yes"}, TypeError, r"causal must be True or False; got 'yes'"),
]


@pytest.mark.parametrize("f", FORWARD, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_named(f, case):
    _, q, k, v, kw, exc, msg = case
    with pytest.raises(exc, match=msg):
        f(q, k, v, **kw)


@pytest.mark.parametrize("f", [fl.flash_attention_v1, fl.flash_attention_v2])
@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("value, exc, msg", [
    (0, ValueError, "must be a positive integer; got 0"),
    (-3, ValueError, "must be a positive integer; got -3"),
    (2.5, TypeError, "must be a positive integer or None; got 2.5 of type float"),
    (True, TypeError, "must be a positive integer or None; got True of type bool"),
    ("8", TypeError, "must be a positive integer or None; got '8' of type str"),
])
def test_bad_block_sizes(f, name, value, exc, msg):
    with pytest.raises(exc, match=f"{name} {msg}"):
        f(Q, K, V, **{name: value})


def test_backward_rejects_bad_blocks_and_shapes():
    o, lse = fl.flash_attention_v2(Q, K, V)
    with pytest.raises(ValueError, match="block_k must be a positive integer; got 0"):
        fl.flash_attention_v2_backward(Q, K, V, o, lse, o, block_k=0)
    with pytest.raises(ValueError, match=r"o must have shape \(2, 5, 4\)"):
        fl.flash_attention_v2_backward(Q, K, V, o[:, :3], lse, o)
    with pytest.raises(TypeError, match="do has dtype int64"):
        fl.flash_attention_v2_backward(Q, K, V, o, lse, np.ones((2, 5, 4), np.int64))


def test_lists_and_numpy_integer_blocks_are_accepted():
    o, _ = fl.flash_attention_v2(Q.tolist(), K.tolist(), V.tolist(), block_q=np.int64(2))
    np.testing.assert_allclose(o, fl.reference_attention(Q.astype(float), K.astype(float), V.astype(float))[0], rtol=1e-10)


@pytest.mark.parametrize("f", [fl.naive_softmax, fl.safe_softmax, fl.online_softmax])
def test_softmax_bad_input(f):
    with pytest.raises(TypeError, match="x has dtype int64"):
        f(np.arange(4))
    with pytest.raises(ValueError, match=r"at least one element along its last axis; got shape \(3, 0\)"):
        f(np.ones((3, 0)))
