"""The library's window, alignment, ALiBi, softcap and dropout in the tensor-core backward
(kernels/tensor_backward.py, build(..., features=), the values as arguments): dq, dk, dv against float64 gradients
(flashlab.flash_attention_v2_backward on the forward's float64 o and lse), in the simulator on one warp
(block_q = block_k = 16) and on a GPU.

The o and lse the kernel gets come from the float64 reference (o rounded to the input type), so a forward's
own error cannot hide or cause a backward one; rows that see no key get lse = +inf, as from the forward.
Tolerances as in test_tensor_backward.py: P^T and dS^T are rounded to float16 (~3e-4), 3xTF32 keeps ~1e-7. A
mask off by one, a lost softcap factor, a wrong ALiBi sign or a dropout mask drawn for another head is off by
1e-2 or more.
"""
import numpy as np
import pytest
from conftest import FAST_LAUNCH_ON

import flashlab as fl
from flashlab.kernels import flash_attention_backward

TOL = {np.float16: 2e-3, np.float32: 1e-5}
SEED = 2 ** 40 + 5  # high bits set: a seed cut to 32 bits draws another mask

CASES = {  # B, H, H_kv, Nq, Nk, options
    "causal-bottom-right-window": (1, 1, 1, 18, 29, dict(causal=True, align="bottom_right", window_size=(5, 2))),
    "softcap-alibi-per-batch": (2, 1, 1, 18, 29, dict(softcap=1.5, alibi_slopes=np.array([[0.5], [0.3]]))),
    # causal bottom-right with Nq > Nk: the first 11 rows see no key (lse = +inf); GQA, 2 query heads per K/V head,
    # each with its own ALiBi slope
    "gqa-window-empty-rows": (1, 2, 1, 29, 18, dict(window_size=(8, -1), causal=True, align="bottom_right",
                                                    alibi_slopes=np.array([0.5, 0.125]))),
    # two query heads of one K/V head: the mask is keyed by the query head
    "dropout-window": (1, 2, 1, 18, 29, dict(window_size=(6, 3), dropout_p=0.3, seed=SEED)),
}


def inputs(rng, B, H, H_kv, nq, nk, dtype, d=16):
    q = (1.5 * rng.standard_normal((B, H, nq, d))).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, nk, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((B, H, nq, d)).astype(dtype)
    return q, k, v, do


def expected(q, k, v, do, opts):
    """(o in q's dtype, lse float32, [dq, dk, dv] float64) from the float64 reference."""
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, do)]
    o, lse = fl.reference_attention(*f64[:3], **opts)
    grads = fl.flash_attention_v2_backward(*f64[:3], o, lse, f64[3], **opts)
    return o, lse, grads


def assert_close(got, want, tol, what):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape and np.isfinite(g).all(), f"{what}: {name} has NaN or inf, or shape {g.shape}"
        err = fl.relative_error(g, w)
        assert err < tol, f"{what}: {name} relative error {err:.2e} (tolerance {tol:.0e})"


# every case in float16; 3xTF32 (the slowest to simulate, the same option code) on the two with dropout and alignment
@pytest.mark.parametrize("case,dtype", [(c, np.float16) for c in CASES] + [
    (c, np.float32) for c in ("causal-bottom-right-window", "dropout-window")],
    ids=lambda x: {np.float16: "f16", np.float32: "3xtf32"}.get(x, x))
def test_simulated_options_match_float64(rng, case, dtype):
    B, H, H_kv, nq, nk, opts = CASES[case]
    q, k, v, do = inputs(rng, B, H, H_kv, nq, nk, dtype)
    o, lse, want = expected(q, k, v, do, opts)
    if case == "gqa-window-empty-rows":
        assert np.isinf(lse[..., :11]).all() and np.isfinite(lse[..., 11:]).all()
    got = flash_attention_backward(q, k, v, o.astype(dtype), lse.astype(np.float32), do, variant="tensor",
                                   block_q=16, block_k=16, **opts)
    assert all(g.dtype == dtype for g in got)
    assert_close(got, want, TOL[dtype], f"{case} {np.dtype(dtype).name}")


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_query_tiles_outside_the_band_are_never_read(rng, align, monkeypatch):
    """One key block (Nk = 16) and four query tiles; with window (4, 4) only the tiles that meet the band are
    loaded: NaN in q and do of the others (after the band: top_left; before it: bottom_right, where the first
    44 rows see no key) leave the gradients finite and right. A warp outside the band skips its products, so
    NaN alone would not notice a tile loaded for nothing: in the simulator the Q/dO row copies are recorded."""
    from flashlab.kernels import mma

    opts = dict(window_size=(4, 4), align=align)
    q, k, v, do = inputs(rng, 1, 1, 1, 64, 16, np.float16)
    o, lse, want = expected(q, k, v, do, opts)
    far = slice(32, 64) if align == "top_left" else slice(0, 32)  # rows 20.. (top_left), ..43 (bottom_right)
    assert np.isinf(lse[..., far]).all()
    q[..., far, :] = np.nan
    do[..., far, :] = np.nan
    rows = set()
    if not fl.device.has_gpu():
        copy = mma.cp_async16_flat

        def recording(dst, dst_index, src, base, offset, src_bytes):
            if src.shape[0] == 64 and int(src_bytes):  # Q or dO (K and V have 16 rows)
                rows.add((int(base) + int(offset)) // (src.strides[0] // src.itemsize))
            return copy(dst, dst_index, src, base, offset, src_bytes)

        monkeypatch.setattr(mma, "cp_async16_flat", recording)
    got = flash_attention_backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do, variant="tensor",
                                   block_q=16, block_k=16, **opts)
    assert not rows & set(range(64)[far]), f"rows outside the band were copied: {sorted(rows & set(range(64)[far]))}"
    assert fl.device.has_gpu() or rows, "no Q/dO copy was recorded (the kernel no longer uses cp_async16_flat?)"
    assert_close(got, want, TOL[np.float16], f"band skipping, {align}")


def test_options_are_checked_and_the_simulator_default_stays_register(rng, monkeypatch):
    import flashlab.kernels.backward as kb

    q, k, v, do = inputs(rng, 1, 1, 1, 16, 16, np.float16)
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
        o, lse, want = expected(q, k, v, do, dict(softcap=2.0))
        got = flash_attention_backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do, softcap=2.0)
        assert not called
        assert_close(got, want, TOL[np.float16], "register default")


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_tensor_backward_options(rng, d):
    """Every case at Nq ~ 300, Nk ~ 500 (GQA and empty rows kept), float16 and bfloat16 torch tensors (the register
    backward has no bfloat16), default tiles, against float64."""
    torch = pytest.importorskip("torch")
    for case, (B, H, H_kv, nq, nk, opts) in CASES.items():
        nq, nk = (300, 500) if nq < nk else (500, 300)
        base = inputs(rng, B, H, H_kv, nq, nk, np.float64, d)
        for dtype, tol in ((torch.float16, 3e-3), (torch.bfloat16, 2e-2)):
            tq, tk, tv, tdo = (torch.tensor(x, device="cuda", dtype=dtype) for x in base)
            o, lse, want = expected(*(x.double().cpu().numpy() for x in (tq, tk, tv, tdo)), opts)
            to = torch.tensor(o, device="cuda", dtype=dtype)
            tlse = torch.tensor(lse, device="cuda", dtype=torch.float32)
            got = flash_attention_backward(tq, tk, tv, to, tlse, tdo, **opts)  # the default: tensor on a GPU
            assert all(g.dtype == dtype for g in got)
            assert_close([g.double().cpu().numpy() for g in got], want, tol, f"{case} {dtype} d={d}")


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
