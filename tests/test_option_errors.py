"""The options' argument checks and refusals in the kernels' public calls, and which backward a call with options
gets by default. The options against float64, and the variants that refuse them (the wgmma forward), are the
matrix of tests/test_kernel_options.py."""
import numpy as np
import pytest

import flashlab as fl
from flashlab.kernels import flash_attention, flash_attention_backward


def test_options_need_the_register_variant(rng):
    q = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    with pytest.raises(NotImplementedError, match="variant='register'"):
        flash_attention(q, q, q, variant="shared", softcap=2.0)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attention(q, q, q, window_size=3)


def test_backward_options_need_a_backward_variant(rng):
    q = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="variant must be 'register', 'tensor' or 'wgmma' for the backward"):
        flash_attention_backward(q, q, q, q, lse, q, variant="shared", softcap=2.0)


def test_dropout_needs_the_register_or_tensor_variant(rng):
    """The textbook kernel has no dropout and says so rather than returning a dropout-free output."""
    q = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match=r"dropout_p=0\.1 needs variant='register' or 'tensor'.*got variant='shared'"):
        flash_attention(q, q, q, variant="shared", dropout_p=0.1)
    # the backward has dropout on all its variants
    with pytest.raises(ValueError, match="variant must be 'register', 'tensor' or 'wgmma' for the backward"):
        flash_attention_backward(q, q, q, q, lse, q, variant="shared", dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flash_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        flash_attention_backward(q, q, q, q, lse, q, dropout_p=0.1, seed=-1)


def test_tensor_backward_options_are_checked_and_the_simulator_default_stays_register(rng, monkeypatch):
    import flashlab.kernels.backward as kb

    q, k, v, do = (rng.standard_normal((1, 1, 16, 16)).astype(np.float16) for _ in range(4))
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attention_backward(q, k, v, q, lse, do, variant="tensor", window_size=3)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flash_attention_backward(q, k, v, q, lse, do, variant="tensor", dropout_p=1.5)
    called = []
    monkeypatch.setattr(kb, "_tensor_backward", lambda *a, **kw: called.append(kw))
    flash_attention_backward(q, k, v, q, lse, do, variant="tensor", softcap=2.0, dropout_p=0.1, seed=7)
    assert called and called[0]["softcap"] == 2.0 and called[0]["dropout_p"] == 0.1 and called[0]["seed"] == 7
    if not fl.device.has_gpu():  # the default for float16 in the simulator: the register backward
        called.clear()
        f64 = [x.astype(np.float64) for x in (q, k, v, do)]
        o, lse = fl.reference_attention(*f64[:3], softcap=2.0)
        want = fl.flash_attention_v2_backward(*f64[:3], o, lse, f64[3], softcap=2.0)
        got = flash_attention_backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do, softcap=2.0)
        assert not called
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert fl.relative_error(g, w) < 2e-3, name
