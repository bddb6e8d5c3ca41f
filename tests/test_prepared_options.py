"""The prepared paths (kernels/prepared.py) of the calls with the library's options: torch CUDA tensors take them
from their first call, one entry per key (options but the dropout seed, which each call passes to its launch). On
a GPU against the general path, and on the CPU with the GPU-only pieces faked. The options against float64:
tests/test_kernel_options.py."""
import numpy as np
import pytest
from conftest import FAST_LAUNCH_ON

import flashlab as fl
from flashlab.kernels import flash_attention_backward

gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_prepared_calls_match_the_general_path(rng, monkeypatch, dtype):
    """Torch CUDA tensors: the forward with options and the tensor backward take prepared paths
    (kernels/prepared.py) from their first call; they give what the general path gives: o, lse, dK and dV bit for bit,
    dQ to its float32 atomics' rounding, under GQA. One prepared entry per key, reused by later calls, and a new
    dropout seed is passed to the launch, not a new entry."""
    import torch

    from flashlab.kernels import flash_attention, prepared

    monkeypatch.setattr(prepared, "_CALLS", {})  # counted below: no entries from other tests, none evicted
    B, H, H_kv, N, d = 2, 4, 2, 300, 64
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape)).to("cuda", getattr(torch, dtype))  # noqa: E731
    q, k, v, do = t(B, H, N, d), t(B, H_kv, N, d), t(B, H_kv, N, d), t(B, H, N, d)
    option_sets = (dict(), dict(causal=True, window_size=(64, 0), softcap=20.0, alibi_slopes=np.linspace(0.1, 0.4, H)),
                   dict(dropout_p=0.2, causal=True))
    for opts in option_sets:
        before = len(prepared._CALLS)
        for seed in (7, 2 ** 40 + 8):  # the second call reuses the entries with another seed
            monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "0")
            o, lse = flash_attention(q, k, v, variant="tensor", seed=seed, **opts)  # GQA: 2 query heads a K/V head
            want = flash_attention_backward(q, k, v, o, lse, do, variant="tensor", seed=seed, **opts)
            if dtype != "bfloat16":  # the register forward takes float16 and float32
                o_reg = flash_attention(q, k, v, variant="register", seed=seed, **opts)
            monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", FAST_LAUNCH_ON)
            o2, lse2 = flash_attention(q, k, v, variant="tensor", seed=seed, **opts)
            assert torch.equal(o2, o) and torch.equal(lse2, lse), opts
            if dtype != "bfloat16":
                assert all(torch.equal(a, b) for a, b in zip(flash_attention(q, k, v, variant="register", seed=seed,
                                                                             **opts), o_reg)), opts
            got = flash_attention_backward(q, k, v, o, lse, do, variant="tensor", seed=seed, **opts)
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert g.dtype == w.dtype and g.shape == w.shape
                if name == "dq":
                    err = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                    assert err < (1e-2 if dtype == "bfloat16" else 1e-3 if dtype == "float16" else 1e-6), (name, err)
                else:
                    assert torch.equal(g, w), (name, opts, seed)
        assert len(prepared._CALLS) == before + (2 if dtype == "bfloat16" else 3), opts  # forwards and a backward


def test_prepared_paths_key_without_the_seed(monkeypatch):
    """The prepared-call wiring, on the CPU with the GPU-only pieces faked: the forward with options, the tensor
    backward and varlen each prepare once per key and pass each call's dropout seed to the launch (the GPU test
    above checks what the launches compute)."""
    import flashlab.kernels.prepared as fast
    from flashlab.kernels import backward, forward, varlen

    calls = []

    class Fake:
        def __init__(self, *args, **kwargs):
            calls.append(("prepare", type(self).__name__))

        def __call__(self, *args):
            calls.append(("call", args[-1]))
            return "prepared"

    monkeypatch.setattr(fast, "available", lambda: True)
    monkeypatch.setattr(fast, "torch_key", lambda *tensors: tuple(x.shape for x in tensors))
    monkeypatch.setattr(fast, "_CALLS", {})
    for module, name in ((forward, "PreparedForward"), (backward, "PreparedTensorBackward"), (varlen, "PreparedVarlen")):
        monkeypatch.setattr(module, name, type(name, (Fake,), {}))
    q, lse = np.zeros((1, 2, 16, 16), np.float32), np.zeros((1, 2, 16), np.float32)
    qv, cu = np.zeros((16, 2, 16), np.float32), np.array([0, 7, 16], np.int32)
    for seed in (3, 4):
        assert forward.flash_attention(q, q, q, variant="register", softcap=2.0, dropout_p=0.1, seed=seed) == "prepared"
    for seed in (5, 6):
        assert backward.flash_attention_backward(q, q, q, q, lse, q, variant="tensor", dropout_p=0.1, seed=seed) == "prepared"
    for seed in (7, 2 ** 40):
        assert varlen.flash_attention_varlen(qv, qv, qv, cu, cu, dropout_p=0.2, seed=seed) == "prepared"
    assert calls == [("prepare", "PreparedForward"), ("call", 3), ("call", 4), ("prepare", "PreparedTensorBackward"),
                     ("call", 5), ("call", 6), ("prepare", "PreparedVarlen"), ("call", 7), ("call", 2 ** 40)]
    with pytest.raises(ValueError, match="seed must be an integer"):  # a later call's seed is still checked
        varlen.flash_attention_varlen(qv, qv, qv, cu, cu, dropout_p=0.2, seed=-1)
