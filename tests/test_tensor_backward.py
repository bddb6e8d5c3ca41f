"""variant="tensor" backward (kernels/tensor_backward.py): in the CUDA simulator (CI) and on a GPU (marked gpu).

In the simulator every mma, ldmatrix(.trans) and pack runs flashlab's exact warp-level emulation, so these
tiny cases (one or two warps, a few blocks) check the kernel's fragment bookkeeping: each of the five
products, the dS^T round trip through shared memory, the masks and the dQ atomics. Gradients are compared
with float64 ones computed from the inputs as the kernel sees them (rounded to 16 bits).
Tolerances (relative error): P^T and dS^T are rounded to 16 bits before their products, ~3e-4 for float16
and ~3e-3 for bfloat16; 3xTF32 keeps ~1e-7. A dropped D term, a swapped a1/a2 or a causal diagonal off by
one is off by 1e-1 or more.
"""
import numpy as np
import pytest

import flashlab as fl
from flashlab import fragments as F
from flashlab.device import has_gpu

pytest.importorskip("flashlab.kernels")
from flashlab.kernels import flash_attention_backward, tensor_backward as tb  # noqa: E402
from flashlab.kernels.backward import default_variant  # noqa: E402
from test_kernels_backward import exact_grads  # noqa: E402

gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
TOL = {"f16": 2e-3, "k8": 2e-3, "bf16": 1.5e-2, "3xtf32": 1e-5, "tf32": 5e-3}
DTYPE = {"f16": "float16", "k8": "float16", "bf16": "bfloat16", "3xtf32": "float32", "tf32": "float32"}


def rounded(x, precision):
    """x as the kernel sees it: rounded to the 16-bit type, or float32."""
    dt = DTYPE[precision]
    return x.astype(np.float32) if dt == "float32" else F.from_bits16(F.to_bits16(x, dt), dt)


def words(x, precision):
    """The kernel's input: float32, or 16-bit values packed in pairs of the last axis (uint32)."""
    dt = DTYPE[precision]
    if dt == "float32":
        return np.ascontiguousarray(x, np.float32)
    bits = F.to_bits16(x, dt)
    return np.ascontiguousarray(F.pack16(bits[..., 0::2], bits[..., 1::2]))


def values(w, precision):
    dt = DTYPE[precision]
    if dt == "float32":
        return np.asarray(w, np.float64)
    lo, hi = F.unpack16(np.asarray(w))
    return np.stack([F.from_bits16(lo, dt), F.from_bits16(hi, dt)], -1).reshape(*w.shape[:-1], -1).astype(np.float64)


def run_sim(rng, B, H, nq, nk, d, causal, precision, tile, logit_scale=1.0, h_kv=None):
    """Gradients from tensor_backward.launch (on NumPy arrays: the simulator) and the float64 ones.
    h_kv < H: GQA, k and v have h_kv heads (query head h reads head h // (H / h_kv))."""
    h_kv = h_kv or H
    q, k, v, do = (rounded(rng.standard_normal((B, heads, n, d)) * s, precision)
                   for heads, n, s in ((H, nq, logit_scale), (h_kv, nk, logit_scale), (h_kv, nk, 1.0), (H, nq, 1.0)))
    rep = lambda x: np.repeat(x, H // h_kv, axis=1)  # noqa: E731 (the float64 reference's copies of K/V)
    o, lse, dq, dk, dv = exact_grads(q, rep(k), rep(v), do, causal)
    fold = lambda g: g.reshape(B, h_kv, H // h_kv, nk, d).sum(2)  # noqa: E731 (a K/V head's gradient: its group's sum)
    want = [dq, fold(dk), fold(dv)]
    o = rounded(o, precision)
    wide = DTYPE[precision] == "float32"
    dq = np.zeros((B, H, nq, d if wide else d // 2), np.float32 if wide else np.uint32)
    dk, dv = (np.zeros((B, h_kv, nk, dq.shape[-1]), dq.dtype) for _ in range(2))
    dq_acc = dq if wide else np.zeros((B, H, nq, d), np.float32)
    tb.launch(*(words(x, precision) for x in (q, k, v, o)), lse.astype(np.float32), words(do, precision), dq, dk, dv,
              dq_acc, np.zeros((B, H, nq), np.float32), H, 1 / np.sqrt(d), causal, tile, precision)
    return [values(x, precision) for x in (dq, dk, dv)], want, (q, k, v, do)


def assert_close(got, want, tol, what):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(g).all(), f"{what}: {name} has NaN or inf"
        err = fl.relative_error(g, w) if np.linalg.norm(w) > 1e-6 else float(np.abs(g - w).max())
        assert err < tol, f"{what}: {name} relative error {err:.2e} (tolerance {tol:.0e})"


W1 = tb.BackwardTile(warps=1, block_q=16, stages=2)
# (B, H, Nq, Nk, d, causal, precision, tile)
SIM_CASES = [
    (1, 1, 19, 23, 32, False, "f16", W1),  # ragged tails in both dims
    (1, 2, 21, 18, 32, True, "f16", tb.BackwardTile(2, 16, 2)),  # two warps share dQ's tile; Nq > Nk, causal
    (1, 1, 10, 37, 16, True, "f16", W1),  # Nq < Nk: key blocks no query sees get zero dK, dV
    (1, 1, 33, 20, 16, False, "f16", tb.BackwardTile(1, 32, 1)),  # block_q 32: two row groups of dQ per warp
    (1, 1, 19, 23, 32, True, "bf16", W1),
    (1, 1, 19, 23, 16, True, "3xtf32", W1),
    (1, 1, 17, 12, 16, False, "tf32", W1),
    (1, 1, 19, 23, 32, True, "k8", tb.BackwardTile(1, 16, 1)),  # the sm_75 build: copies through registers
    (1, 1, 1, 1, 16, True, "f16", W1),  # N = 1
    (1, 1, 20, 19, 32, True, "bf16", tb.BackwardTile(1, 16, 2, v_shared=True)),  # V's fragments by ldmatrix
    (1, 1, 20, 19, 16, False, "3xtf32", tb.BackwardTile(1, 16, 1, v_shared=True)),
]


@pytest.mark.parametrize("H,h_kv,causal,precision,tile", [(4, 2, True, "f16", W1), (3, 1, False, "3xtf32", W1),
                                                         (2, 1, True, "k8", tb.BackwardTile(1, 16, 1))])
def test_simulated_gqa_sums_dk_dv_over_the_group(rng, H, h_kv, causal, precision, tile):
    got, want, _ = run_sim(rng, 1, H, 18, 21, 16, causal, precision, tile, h_kv=h_kv)
    assert got[1].shape[1] == h_kv
    assert_close(got, want, TOL[precision], f"GQA {H}:{h_kv} {precision}")


@pytest.mark.parametrize("B,H,nq,nk,d,causal,precision,tile", SIM_CASES)
def test_simulated_tensor_backward(rng, B, H, nq, nk, d, causal, precision, tile):
    got, want, _ = run_sim(rng, B, H, nq, nk, d, causal, precision, tile)
    assert_close(got, want, TOL[precision], f"{precision} {(B, H, nq, nk, d)} causal={causal} {tile}")


@pytest.mark.parametrize("block_q,v_shared", [(48, False), (64, True)])
def test_simulated_tile_with_more_rows_than_threads(rng, block_q, v_shared):
    """block_q > 32 * warps: each thread loads several rows of the tile's lse and D (a single warp with
    block_q = 64 used to leave rows 32-63 unloaded, and every gradient came out wrong)."""
    tile = tb.BackwardTile(1, block_q, 2, v_shared=v_shared)
    got, want, _ = run_sim(rng, 1, 1, block_q + 2, 20, 16, False, "f16", tile)
    assert_close(got, want, TOL["f16"], f"f16 d16 {tile}")


def test_simulated_huge_logits_stay_finite(rng):
    """Scores of a few hundred: P is almost one-hot and exp(-lse) of padded keys would overflow 16 bits. dS
    then nearly cancels (dP - D ~ 0 where P ~ 1), so dQ and dK are compared within the bound that rounding dS
    and O to float16 allows, elementwise: 2^-10 * scale * (|dS| @ |K|), not relative to their tiny norms."""
    got, want, (q, k, v, do) = run_sim(rng, 1, 1, 18, 21, 16, True, "f16", W1, logit_scale=12.0)
    assert all(np.isfinite(g).all() for g in got)
    assert fl.relative_error(got[2], want[2]) < 2e-3  # dV = P^T dO is well conditioned
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((18, 21), bool)), q @ np.swapaxes(k, -1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ np.swapaxes(v, -1, -2)
    # |dS| plus what O's rounding to float16 (in D = rowsum(dO * O)) moves it by, with P ~ 1 and dP - D ~ 0
    ds = np.abs(p * (dp - (dp * p).sum(-1, keepdims=True))) + p * (np.abs(do) * np.abs(p @ v)).sum(-1, keepdims=True)
    for name, g, w, bound in (("dq", got[0], want[0], ds @ np.abs(k)), ("dk", got[1], want[1],
                                                                     np.swapaxes(ds, -1, -2) @ np.abs(q))):
        excess = np.abs(g - w) - (2.0 ** -10 * scale * bound + 2.0 ** -11 * np.abs(w) + 1e-7)
        assert excess.max() <= 0, f"{name}: beyond float16 rounding of dS by {excess.max():.2e}"


def test_api_runs_the_tensor_variant_on_numpy_float16(rng):
    q, k, v, do = (rng.standard_normal((1, 1, n, 16)).astype(np.float16) for n in (9, 11, 11, 9))
    o, lse, *want = exact_grads(q, k, v, do, False)
    got = flash_attention_backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do, variant="tensor",
                                   block_q=16, block_k=16)
    assert all(g.dtype == np.float16 for g in got)
    assert_close([g.astype(np.float64) for g in got], want, 2e-3, "API, float16")


def test_clear_errors():
    x = np.zeros((1, 1, 8, 16), np.float16)
    lse = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="block_q must be a multiple of 16"):
        flash_attention_backward(x, x, x, x, lse, x, variant="tensor", block_q=8)
    with pytest.raises(ValueError, match="threads= configures the register backward"):
        flash_attention_backward(x, x, x, x, lse, x, variant="tensor", threads=64)
    with pytest.raises(ValueError, match="variant must be 'register', 'tensor' or 'wgmma'"):
        flash_attention_backward(x, x, x, x, lse, x, variant="shared")
    with pytest.raises(ValueError, match="lse must be float32 of shape"):
        flash_attention_backward(x, x, x, x, lse[..., :4], x, variant="tensor")
    with pytest.raises(TypeError, match="do has dtype float32; expected q's dtype float16"):
        flash_attention_backward(x, x, x, x, lse, x.astype(np.float32), variant="tensor")
    with pytest.raises(ValueError, match="needs [0-9]+ bytes of shared memory"):
        tb.BackwardTile(8, 64, 2).check(128, "3xtf32")


def test_tiles_fit_and_default_variant():
    for d in (16, 32, 64, 128):
        for precision in ("f16", "bf16", "k8", "3xtf32", "tf32"):
            for bq, bk in ((None, None), (16, None), (None, 32), (32, 32)):
                try:
                    tile = tb.choose_tile(d, precision, bq, bk)
                except ValueError as exc:  # only a forced tile may not fit, and then the error says why
                    assert bq and bk and "bytes of shared memory" in str(exc), (d, precision, bq, bk)
                    continue
                assert 4 * tile.shared_words(d, precision) <= tb.SHARED_LIMIT
                assert tile.block_q == (bq or tile.block_q) and tile.block_k == (bk or tile.block_k)
                assert precision != "k8" or tile.stages == 1  # no cp.async on sm_75
    assert default_variant(np.zeros(2, np.float32)) == "register"
    if not has_gpu():
        assert default_variant(np.zeros(2, np.float16)) == "register"  # the simulator keeps the FP32-unit kernel


def test_default_tiles_follow_the_devices_shared_memory_limit():
    """The defaults past 48 KB (dynamic shared memory) are taken where the opt-in limit allows them, and a device
    with less gets the first tile that fits: the planner passes each device's limit."""
    from flashlab.kernels.plan import A100, H100, T4, plan

    big = tb.choose_tile(128, "f16", limit=227 * 1024)
    assert (big.warps, big.block_q) == tb.DEFAULT_TILES["16-bit"][128][:2]
    assert 4 * big.shared_words(128, "f16") > tb.SHARED_LIMIT  # the reason for the dynamic array
    small = tb.choose_tile(128, "f16")  # 48 KB: the fallback search
    assert 4 * small.shared_words(128, "f16") <= tb.SHARED_LIMIT and small != big
    for device in (T4, A100, H100):
        for dtype in ("float16", "float32"):
            if device is T4 and dtype == "float32":
                continue  # no tf32 on sm_75
            p = plan((1, 4, 1024, 1024, 128), variant="tensor", direction="backward", dtype=dtype, device=device)
            assert p.shared_bytes <= device.dynamic_shared_per_block, (device.name, dtype)
    assert H100.dynamic_shared_per_block == 227 * 1024 and T4.dynamic_shared_per_block == 64 * 1024
    text = plan((1, 4, 1024, 1024, 128), variant="tensor", direction="backward", dtype="float16", device=H100).explain()
    assert "the kernel opts in; 232,448 allowed" in text
    with pytest.raises(ValueError, match="limit per block is 49152 bytes"):
        big.check(128, "f16")


def test_dynamic_shared_opt_in_is_asked_once_past_48_kb(monkeypatch):
    """_launch.allow_dynamic_shared: nothing at or under 48 KB; above, one driver call per kernel and device with
    the bytes asked (a smaller request later needs no call). benchmarks/experiments/probe_dynamic_shared.py checks the call
    itself on a GPU."""
    from types import SimpleNamespace

    from flashlab.kernels import _launch

    calls = []
    monkeypatch.setattr(_launch, "_opt_in", lambda *a: calls.append(a))
    monkeypatch.setattr(_launch, "_OPTED_IN", {})
    cufunc = SimpleNamespace(handle=1234, device=SimpleNamespace(id=0))
    compiled = SimpleNamespace(_codelibrary=SimpleNamespace(get_cufunc=lambda: cufunc))
    _launch.allow_dynamic_shared(compiled, 48 * 1024)
    assert calls == []
    _launch.allow_dynamic_shared(compiled, 80_384)
    _launch.allow_dynamic_shared(compiled, 60_000)
    assert len(calls) == 1
    assert calls[0] == (1234, 0, 80_384)
    _launch.allow_dynamic_shared(compiled, 100_000)
    assert len(calls) == 2 and calls[1][2] == 100_000


def test_planner_knows_the_tensor_backward():
    from flashlab.kernels.plan import plan

    p = plan((2, 4, 1000, 1000, 64), variant="tensor", direction="backward", dtype="bfloat16", causal=True,
             device="H100")
    assert p.precision == "bf16" and p.grid == (-(-1000 // p.block_k), 8) and not p.heavy_first
    assert "backward tensor (bf16)" in p.explain()
    with pytest.raises(ValueError, match="register backward takes float32 or float16"):
        plan((1, 1, 64, 64), direction="backward", dtype="bfloat16", device="H100")


# ------------------------------------------------------------------------------------------- GPU
def _sdpa_grads(tq, tk, tv, tdo, causal):
    import torch

    q, k, v = (x.detach().clone().requires_grad_() for x in (tq, tk, tv))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(tdo)
    return [x.grad for x in (q, k, v)]


def _error(got, want, scale):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(scale), 1e-300))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("n", [1, 17, 1000, 4096])
def test_gpu_tensor_backward(rng, d, n):
    """Every precision against float64 gradients, within what torch's SDPA gets in the same dtype."""
    torch = pytest.importorskip("torch")
    from flashlab.kernels import flash_attention

    B, H = (1, 2) if n >= 1000 else (2, 3)
    nk = max(1, n - 3)
    for causal in (False, True):
        base = [rng.standard_normal((B, H, m, d)) for m in (n, nk, nk, n)]
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            tq, tk, tv, tdo = (torch.tensor(x, device="cuda", dtype=dtype) for x in base)
            o, lse = flash_attention(tq, tk, tv, causal=causal, variant="tensor")
            o64, _, *want = exact_grads(*(x.double().cpu().numpy() for x in (tq, tk, tv, tdo)), causal)
            got = flash_attention_backward(tq, tk, tv, o, lse, tdo, causal=causal, variant="tensor")
            sdpa = _sdpa_grads(tq, tk, tv, tdo, causal)
            for name, g, s, w in zip(("dq", "dk", "dv"), got, sdpa, want):
                assert g.dtype == dtype and g.shape == s.shape
                # With one key P = 1, so dS = P(dP - D) = 0 and dQ, dK are exactly zero: float64's own rounding
                # would be the denominator. Measure it against dV's size, the scale of the gradients, instead.
                scale = want[2] if (name in ("dq", "dk") and nk == 1) else w
                err = _error(g.double().cpu().numpy(), w, scale)
                ref = _error(s.double().cpu().numpy(), w, scale)
                bound = 1e-5 if dtype == torch.float32 else 2 * ref + 1e-4
                assert err <= bound, f"{dtype} {name} n={n} d={d} causal={causal}: {err:.2e} (SDPA {ref:.2e})"


@pytest.mark.gpu
@gpu
def test_gpu_default_variant_and_reproducibility():
    torch = pytest.importorskip("torch")
    from flashlab.kernels import flash_attention

    from flashlab.kernels import backward

    q, k, v, do = (torch.randn(1, 4, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(4))
    assert default_variant(q) == ("tensor" if backward.TENSOR_DEFAULT else "register")
    o, lse = flash_attention(q, k, v, causal=True, variant="tensor")
    runs = [flash_attention_backward(q, k, v, o, lse, do, causal=True, variant="tensor") for _ in range(3)]
    for dq, dk, dv in runs[1:]:
        assert torch.equal(dk, runs[0][1]) and torch.equal(dv, runs[0][2])  # no atomics: bit-reproducible
        assert (dq.float() - runs[0][0].float()).abs().max() <= 1e-2 * runs[0][0].float().abs().max()


@pytest.mark.gpu
@gpu
def test_gpu_tensor_backward_has_no_spills_at_d64():
    from flashlab.kernels.plan import plan

    for dtype, precision in (("float16", "f16"), ("bfloat16", "bf16"), ("float32", "3xtf32")):
        p = plan((1, 16, 1024, 64), variant="tensor", direction="backward", dtype=dtype)
        assert p.precision == precision and p.registers_from == "the compiled kernel", p.explain()
        assert p.spill_bytes == 0, p.explain()


@pytest.mark.gpu
@gpu
def test_gpu_cc75_backward_build_uses_only_m16n8k8():
    from numba.cuda import compile_ptx

    main = tb.build(64, tb.choose_tile(64, "k8"), True, "k8")[1]
    ptx, _ = compile_ptx(main.py_func, tb.signature("k8"), cc=(7, 5), fastmath=True)
    assert ".target sm_75" in ptx and "mma.sync.aligned.m16n8k8" in ptx
    assert "m16n8k16" not in ptx and "cp.async" not in ptx


@pytest.mark.gpu
@gpu
def test_gpu_backward_memory_is_linear_in_n():
    torch = pytest.importorskip("torch")
    from flashlab.kernels import flash_attention

    extra = {}
    for n in (2048, 8192):
        q, k, v, do = (torch.randn(1, 8, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = flash_attention(q, k, v, causal=True, variant="tensor")
        flash_attention_backward(q, k, v, o, lse, do, causal=True)  # compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        flash_attention_backward(q, k, v, o, lse, do, causal=True)
        torch.cuda.synchronize()
        extra[n] = torch.cuda.max_memory_allocated() - before
    # dq, dk, dv (bf16), dQ's float32 accumulator and D: 3*2 + 4 bytes per element, + 4 per row
    assert extra[8192] <= 4.5 * extra[2048], extra
    assert extra[8192] <= 8 * 8192 * (64 * 10 + 4) * 1.1, extra
