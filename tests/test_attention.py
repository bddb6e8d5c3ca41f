"""Every NumPy attention implementation against the float64 reference, on random shapes and dtypes."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashlab as fl
from conftest import TOL, random_qkv

IMPLS = {
    "naive": lambda q, k, v, **kw: (fl.naive_attention(q, k, v, causal=kw["causal"], scale=kw.get("scale")), None),
    "fa1": fl.flash_attention_v1,
    "fa2": fl.flash_attention_v2,
}


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    return dict(
        batch=draw(st.sampled_from([(), (1,), (2,), (2, 3)])),
        nq=draw(st.integers(1, 70)),
        nk=draw(st.integers(1, 70)),
        d=draw(st.integers(1, 20)),
        dv=draw(st.integers(1, 20)),
        dtype=dtype,
        causal=draw(st.booleans()),
        block_q=draw(st.one_of(st.none(), st.integers(1, 40))),
        block_k=draw(st.one_of(st.none(), st.integers(1, 40))),
        huge=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def make_inputs(c):
    rng = np.random.default_rng(c["seed"])
    if c["huge"]:
        # Integer-valued q, k and scale 1: scores reach ~1e4 yet are exact in every dtype, so any error
        # comes from the softmax itself (overflow, cancellation), not from rounding the scores.
        hi = 60 if c["dtype"] == np.float16 else 300
        q = rng.integers(-hi, hi + 1, c["batch"] + (c["nq"], c["d"])).astype(c["dtype"])
        k = rng.integers(-8, 9, c["batch"] + (c["nk"], c["d"])).astype(c["dtype"])
        v = rng.standard_normal(c["batch"] + (c["nk"], c["dv"])).astype(c["dtype"])
        return q, k, v, 1.0
    q, k, v = random_qkv(rng, c["batch"], c["nq"], c["nk"], c["d"], c["dv"], c["dtype"])
    return q, k, v, None


@pytest.mark.parametrize("name", IMPLS)
@given(c=cases())
def test_matches_reference(name, c):
    q, k, v, scale = make_inputs(c)
    copies = [x.copy() for x in (q, k, v)]
    o_ref, lse_ref = fl.reference_attention(q, k, v, causal=c["causal"], scale=scale)
    kw = dict(causal=c["causal"], scale=scale)
    if name != "naive":
        kw.update(block_q=c["block_q"], block_k=c["block_k"])
    o, lse = IMPLS[name](q, k, v, **kw)

    assert o.shape == o_ref.shape and o.dtype == q.dtype
    assert np.all(np.isfinite(o))
    assert fl.relative_error(o, o_ref) <= TOL[c["dtype"]], c
    if lse is not None:
        assert lse.shape == lse_ref.shape and np.all(np.isfinite(lse))
        lse_tol = 1e-12 if c["dtype"] == np.float64 else 1e-6  # lse is accumulated in float32 at least
        assert fl.relative_error(lse, lse_ref) <= lse_tol, c
    for x, x0 in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, x0)  # inputs are never modified


@given(c=cases())
def test_fa1_and_fa2_agree(c):
    q, k, v, scale = make_inputs(c)
    kw = dict(causal=c["causal"], scale=scale, block_q=c["block_q"], block_k=c["block_k"])
    o1, lse1 = fl.flash_attention_v1(q, k, v, **kw)
    o2, lse2 = fl.flash_attention_v2(q, k, v, **kw)
    assert fl.relative_error(o1, o2) <= TOL[c["dtype"]]
    assert fl.relative_error(lse1, lse2) <= 1e-6


def test_reference_is_attention_by_definition(rng):
    """The reference itself, against softmax(QK^T/sqrt(d) + mask) V written out with explicit loops."""
    q, k, v = random_qkv(rng, (), 5, 7, 3, 2, np.float64)
    o, lse = fl.reference_attention(q, k, v, causal=True)
    for i in range(5):
        s = np.array([q[i] @ k[j] / np.sqrt(3) for j in range(i + 1)])
        w = np.exp(s) / np.exp(s).sum()
        np.testing.assert_allclose(o[i], w @ v[: i + 1], rtol=1e-12)
        np.testing.assert_allclose(lse[i], np.log(np.exp(s).sum()), rtol=1e-12)


def test_single_query_single_key_returns_v(rng):
    q, k, v = random_qkv(rng, (2,), 1, 1, 4, 3, np.float32)
    for f in (fl.flash_attention_v1, fl.flash_attention_v2):
        o, lse = f(q, k, v)
        np.testing.assert_allclose(o, v, rtol=1e-6)
        np.testing.assert_allclose(lse, (q * k).sum(-1) / 2, rtol=1e-5)  # scale 1/sqrt(4)


@pytest.mark.parametrize("f", [fl.flash_attention_v1, fl.flash_attention_v2])
def test_scores_of_1e4_do_not_overflow(f, rng):
    """Scores of magnitude 1e4 (far past float32's exp overflow at ~88) stay finite and exact."""
    q = np.full((4, 8), 100.0, np.float32)
    k = rng.integers(-12, 13, (9, 8)).astype(np.float32)  # scores = 100 * sum(k) ~ up to 1e4
    v = rng.standard_normal((9, 5)).astype(np.float32)
    o, lse = f(q, k, v, scale=1.0, block_q=3, block_k=4)
    o_ref, lse_ref = fl.reference_attention(q, k, v, scale=1.0)
    assert np.abs(lse_ref).max() > 1e3 or np.abs(q @ k.T).max() > 1e3
    assert fl.relative_error(o, o_ref) <= 1e-5 and fl.relative_error(lse, lse_ref) <= 1e-6


@pytest.mark.parametrize("f", [fl.flash_attention_v1, fl.flash_attention_v2])
def test_causal_rows_with_no_visible_key_in_a_block(f, rng):
    """block_k > block_q: the first rows of a block see none of a straddling key block. No NaN may leak."""
    q, k, v = random_qkv(rng, (), 9, 9, 4, 4, np.float32)
    o, lse = f(q, k, v, causal=True, block_q=2, block_k=8)
    o_ref, _ = fl.reference_attention(q, k, v, causal=True)
    assert np.all(np.isfinite(o)) and fl.relative_error(o, o_ref) <= 1e-5


def test_default_block_sizes_follow_the_paper_rule():
    # Bc = ceil(M / 4d), Br = min(Bc, d)
    assert fl.default_block_sizes(64, 16384) == (64, 64)
    assert fl.default_block_sizes(128, 16384) == (32, 32)
    assert fl.default_block_sizes(16, 16384) == (16, 256)
    assert fl.default_block_sizes(100, 1000) == (3, 3)  # ceil(2.5) = 3
    assert fl.default_block_sizes(64, 16384, backward=True) == (32, 32)


def test_float16_output_dtype_and_float32_accumulation(rng):
    q, k, v = random_qkv(rng, (2,), 300, 300, 16, 16, np.float16)
    o, lse = fl.flash_attention_v2(q, k, v)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    o_ref, _ = fl.reference_attention(q, k, v)
    # Accumulating 300 keys in float16 would cost ~1e-3..1e-2; float32 accumulation leaves only output rounding.
    assert fl.relative_error(o, o_ref) < 1e-3
