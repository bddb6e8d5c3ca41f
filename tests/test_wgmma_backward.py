"""kernels/wgmma_backward.py: the FA3-style backward on wgmma, against float64 gradients, in the simulator (every
Hopper instruction emulated exactly). Small launches: a few blocks of up to 384 threads. On a GPU,
scripts/gpu_check_wgmma_backward.py runs the same check beside torch's error and times it."""
import numpy as np
import pytest

from device_views import words_on_device, zero_words_on_device
from flashlab import fragments as F
from flashlab.device import get_cuda, has_gpu

cuda = get_cuda()
wb = pytest.importorskip("flashlab.kernels.wgmma_backward")
pytestmark = pytest.mark.skipif(has_gpu() and cuda.get_current_device().compute_capability < (9, 0),
                                reason="wgmma needs compute capability 9.0")
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def gradients(q, k, v, do, scale, causal):
    """(o, lse, dq, dk, dv) in float64; causal top-left."""
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if causal:
        s = np.where(np.arange(k.shape[2])[None, :] > np.arange(q.shape[2])[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    p /= l
    o = p @ v
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return o, (m + np.log(l))[..., 0], ds @ k * scale, ds.transpose(0, 1, 3, 2) @ q * scale, \
        p.transpose(0, 1, 3, 2) @ do


def rounded_like(x, dtype):
    """x rounded to dtype, in float64."""
    return F.from_bits16(F.to_bits16(x, dtype), dtype).astype(np.float64)


def rounded(rng, shape, dtype):
    """Standard normal values, rounded to dtype, in float64."""
    return rounded_like(rng.standard_normal(shape), dtype)


def run_backward(q, k, v, do, o, lse, causal, dtype, heads_inside_rows=False, **options):
    """wgmma_backward.backward on float64 inputs rounded to dtype: (dq, dk, dv) as float64. heads_inside_rows: the
    inputs and the gradients lie in memory as (B, N, H, d), read and written in place through their strides."""
    d = q.shape[-1]
    kept = []
    words = lambda x: words_on_device(x, dtype, heads_inside_rows, kept)  # noqa: E731
    out, host = zip(*(zero_words_on_device(x.shape[:3] + (d // 2,), heads_inside_rows, kept) for x in (q, k, v)))
    wb.backward(words(q), words(k), words(v), words(o), cuda.to_device(lse.astype(np.float32)), words(do), *out,
                d ** -0.5, causal, dtype, **options)
    return [F.from_bits16(np.ascontiguousarray(h()).view(np.uint16), dtype) for h in host]


def check_close(got, want, v, dtype, terms=1):
    """16-bit operands of every product (P, dS rounded) and a 16-bit result: a few units of the dtype's rounding
    (times the heads summed into one gradient)."""
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        bound = 8 * UNIT[dtype] * terms * max(np.abs(w).max(), np.abs(v).max())
        assert np.abs(g - w).max() <= bound, f"{name}: max error {np.abs(g - w).max():.3g} > {bound:.3g}"


@pytest.mark.parametrize("B,H,Nq,Nk,d,causal,dtype", [
    (1, 1, 70, 64, 64, False, "float16"),  # Nq past one query tile, one key block
    (1, 2, 150, 130, 64, True, "float16"),  # ragged, causal, three key blocks and three query tiles each
    (1, 1, 1, 1, 64, False, "bfloat16"),  # N = 1: dq and dk are 0
    (1, 1, 90, 70, 128, True, "bfloat16"),  # d = 128: two boxes per row; Nq > Nk under causal
    (1, 1, 260, 140, 128, True, "float16"),  # d = 128 causal: a ring of three stages, refilled (five query tiles)
])
def test_gradients_match_float64(B, H, Nq, Nk, d, causal, dtype):
    rng = np.random.default_rng(Nq + Nk)
    q, k, v, do = (rounded(rng, (B, H, n, d), dtype) for n in (Nq, Nk, Nk, Nq))
    o, lse, *want = gradients(q, k, v, do, d ** -0.5, causal)
    check_close(run_backward(q, k, v, do, rounded_like(o, dtype), lse, causal, dtype), want, v, dtype)


def test_inputs_with_heads_inside_rows_are_read_in_place():
    """q, k, v, o and dO laid out (B, N, H, d), as a GPT's attention gets them, and dq, dk, dv written so (as the
    prepared call for torch tensors lays them out), with grouped-query heads: within the bound of float64."""
    rng = np.random.default_rng(3)
    B, H, H_kv, Nq, Nk, d, dtype = 2, 2, 1, 70, 60, 64, "float16"
    q, do = (rounded(rng, (B, H, Nq, d), dtype) for _ in range(2))
    k, v = (rounded(rng, (B, H_kv, Nk, d), dtype) for _ in range(2))
    group = H // H_kv
    o, lse, dq, dk, dv = gradients(q, np.repeat(k, group, 1), np.repeat(v, group, 1), do, d ** -0.5, True)
    dk, dv = (x.reshape(B, H_kv, group, Nk, d).sum(2) for x in (dk, dv))
    got = run_backward(q, k, v, do, rounded_like(o, dtype), lse, True, dtype, heads_inside_rows=True)
    check_close(got, (dq, dk, dv), v, dtype, terms=group)


def test_a_dropped_ds_term_would_fail():
    """The bound can fail: dropping D from dS (dS = P dP) moves dq far past it."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, 64, 64)) for _ in range(4))
    o, _, dq, _, _ = gradients(q, k, v, do, 0.125, False)
    s = q @ k.transpose(0, 1, 3, 2) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    wrong = (p * (do @ v.transpose(0, 1, 3, 2))) @ k * 0.125
    assert np.abs(wrong - dq).max() > 8 * UNIT["float16"] * 10 * max(np.abs(dq).max(), np.abs(v).max())


def test_grouped_query_heads_sum_into_their_kv_head():
    """GQA: two query heads share a K/V head (one block walks both heads' tiles); dK and dV are the sums over the
    group, dQ each head's own. Nq past one tile, causal, against float64 on K/V repeated per head."""
    rng = np.random.default_rng(7)
    B, H, H_kv, Nq, Nk, d, dtype = 1, 2, 1, 70, 60, 64, "float16"
    q, do, k, v = (rounded(rng, (B, h, n, d), dtype) for h, n in ((H, Nq), (H, Nq), (H_kv, Nk), (H_kv, Nk)))
    rep = lambda x: np.repeat(x, H // H_kv, axis=1)  # noqa: E731
    o, lse, dq, dk, dv = gradients(q, rep(k), rep(v), do, d ** -0.5, True)
    want = (dq, dk.reshape(B, H_kv, H // H_kv, Nk, d).sum(2), dv.reshape(B, H_kv, H // H_kv, Nk, d).sum(2))
    check_close(run_backward(q, k, v, do, rounded_like(o, dtype), lse, True, dtype), want, v, dtype, terms=2)


ONE, TWO = wb.BackwardTile(), wb.BackwardTile(consumers=2)  # the default is two


@pytest.mark.parametrize("tile", [ONE, TWO], ids=["one_consumer", "two_consumers"])
@pytest.mark.parametrize("H,H_kv,Nq,Nk,d,causal,dtype,deterministic", [
    (1, 1, 70, 150, 64, True, "float16", False),  # two blocks of 128 keys, the second ragged; dQ in 32-column halves
    (1, 1, 90, 140, 128, False, "bfloat16", False),  # d = 128: each consumer's dQ half is one 64-column box
    (2, 1, 130, 130, 64, True, "float16", True),  # GQA, deterministic, causal: the last query tile takes two turns
])
def test_one_and_two_consumer_warpgroups_match_float64(H, H_kv, Nq, Nk, d, causal, dtype, deterministic, tile):
    """BackwardTile(): one consumer warpgroup, 64 keys a block, a producer warp. consumers=2: 128 keys a block, two
    consumer warpgroups of 64 keys that share the Q/dO ring and split dQ's columns, a producer warpgroup and
    setmaxnreg. Against float64; deterministic, two calls' bits too."""
    rng = np.random.default_rng(Nq + Nk + d)
    q, do = (rounded(rng, (1, H, Nq, d), dtype) for _ in range(2))
    k, v = (rounded(rng, (1, H_kv, Nk, d), dtype) for _ in range(2))
    group = H // H_kv
    o, lse, dq, dk, dv = gradients(q, np.repeat(k, group, 1), np.repeat(v, group, 1), do, d ** -0.5, causal)
    want = dq, dk.reshape(1, H_kv, group, Nk, d).sum(2), dv.reshape(1, H_kv, group, Nk, d).sum(2)
    runs = [run_backward(q, k, v, do, rounded_like(o, dtype), lse, causal, dtype, tile=tile,
                         deterministic=deterministic) for _ in range(1 + deterministic)]
    check_close(runs[0], want, v, dtype, terms=group)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("consumers,H,Nq,Nk,deterministic", [(2, 1, 70, 150, False), (2, 2, 130, 130, True),
                                                              (1, 1, 130, 100, False)])
def test_the_producers_second_warp_can_reduce_dq(consumers, H, Nq, Nk, deterministic):
    """dq_warp: the consumers stage dQ's rows and a producer warp adds them (barriers 2 and 3 hand the rows over
    and back), as FlashAttention-3's warp 1 does. Causal, d = 64, float16, GQA in the second case, deterministic
    turns taken by that warp: against float64, and two deterministic calls give the same bits."""
    rng = np.random.default_rng(Nq + 3 * Nk)
    q, do = (rounded(rng, (1, H, Nq, 64), "float16") for _ in range(2))
    k, v = (rounded(rng, (1, 1, Nk, 64), "float16") for _ in range(2))
    o, lse, dq, dk, dv = gradients(q, np.repeat(k, H, 1), np.repeat(v, H, 1), do, 0.125, True)
    want = dq, dk.reshape(1, 1, H, Nk, 64).sum(2), dv.reshape(1, 1, H, Nk, 64).sum(2)
    tile = wb.BackwardTile(consumers=consumers, dq_warp=True)
    runs = [run_backward(q, k, v, do, rounded_like(o, "float16"), lse, True, "float16", tile=tile,
                         deterministic=deterministic) for _ in range(1 + deterministic)]
    check_close(runs[0], want, v, "float16", terms=H)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)


def test_two_consumers_differ_from_one_only_in_dq_rounding():
    """One consumer and two on the same inputs: dK and dV come from the same products in the same order (each
    consumer's 64 keys), so they are the same bits; dQ's shares are summed over 128 keys, not 64, so it may differ
    by rounding."""
    rng = np.random.default_rng(5)
    q, k, v, do = (rounded(rng, (1, 1, n, 64), "float16") for n in (64, 128, 128, 64))
    o, lse, *want = gradients(q, k, v, do, 0.125, False)
    one, two = (run_backward(q, k, v, do, rounded_like(o, "float16"), lse, False, "float16", tile=tile)
                for tile in (ONE, TWO))
    for name, a, b in zip(("dq", "dk", "dv"), one, two):
        if name != "dq":
            np.testing.assert_array_equal(a, b, err_msg=name)
    check_close(two, want, v, "float16")


@pytest.mark.parametrize("H,H_kv,Nq,Nk,causal,deterministic,dq_warp", [
    (1, 1, 150, 140, True, False, False),  # ragged, causal: every tile masked
    (1, 1, 270, 260, False, False, False),  # interior tiles (128 queries before Nq, 64 keys before Nk) unmasked
    (1, 1, 260, 270, True, False, False),  # causal with interior tiles below the diagonal, Nk > Nq
    (2, 1, 150, 130, True, True, False),  # GQA, deterministic: two calls, the same bits
    (1, 1, 200, 150, True, False, True),  # dQ's 128 rows reduced by the producer's second warp
])
def test_tiles_of_128_queries_match_float64(H, H_kv, Nq, Nk, causal, deterministic, dq_warp):
    """block_q=128: each consumer's S^T and dP^T are 64 keys x 128 queries, dS^T lies in two boxes of 64 queries,
    and each consumer forms the dQ of its own 64 queries over all 128 keys. Against float64, d = 64, float16."""
    rng = np.random.default_rng(Nq + Nk + 64)
    q, do = (rounded(rng, (1, H, Nq, 64), "float16") for _ in range(2))
    k, v = (rounded(rng, (1, H_kv, Nk, 64), "float16") for _ in range(2))
    group = H // H_kv
    o, lse, dq, dk, dv = gradients(q, np.repeat(k, group, 1), np.repeat(v, group, 1), do, 0.125, causal)
    want = dq, dk.reshape(1, H_kv, group, Nk, 64).sum(2), dv.reshape(1, H_kv, group, Nk, 64).sum(2)
    tile = wb.BackwardTile(consumers=2, block_q=128, dq_warp=dq_warp)
    runs = [run_backward(q, k, v, do, rounded_like(o, "float16"), lse, causal, "float16", tile=tile,
                         deterministic=deterministic) for _ in range(1 + deterministic)]
    check_close(runs[0], want, v, "float16", terms=group)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs,match", [(dict(consumers=3), "consumers must be 1 or 2"),
                                          (dict(consumers=2, producer=32), "producer must be 128"),
                                          (dict(producer=32, dq_warp=True), "producer must be 64 or more"),
                                          (dict(consumers=2, block_q=96), "block_q must be 64 or 128; got 96"),
                                          (dict(block_q=128), "consumers must be 2; got 1")])
def test_a_tile_that_cannot_run_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wb.BackwardTile(**kwargs)


def test_tiles_of_128_queries_are_refused_at_d_128():
    with pytest.raises(ValueError, match="block_q=128 runs at d = 64 only .* got d=128"):
        wb.build(128, "float16", False, wb.BackwardTile(consumers=2, block_q=128))


@pytest.mark.parametrize("Nq,causal", [(70, False), (200, True), (70, True)])
def test_deterministic_mode_adds_dq_in_key_block_order(Nq, causal):
    """deterministic=True: each query tile takes the key blocks' shares in turn (three key blocks: 0, 1, 2; causal,
    from the diagonal block down, with the grid run from the last key block); the gradients match float64 and two
    calls give the same bits. The simulator runs blocks one after another, so a block that found its turn not yet
    come would wait forever on a GPU: the kernel raises there instead. (The wait itself is checked on a GPU.)"""
    rng = np.random.default_rng(11)
    B, H, Nk, d, dtype = 1, 1, 150, 64, "float16"
    q, do, k, v = (rounded(rng, (B, H, n, d), dtype) for n in (Nq, Nq, Nk, Nk))
    o, lse, *want = gradients(q, k, v, do, d ** -0.5, causal)
    runs = [run_backward(q, k, v, do, rounded_like(o, dtype), lse, causal, dtype, deterministic=True)
            for _ in range(2)]
    check_close(runs[0], want, v, dtype)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_deterministic_is_refused_off_the_wgmma_backward():
    from flashlab.kernels import flash_attention_backward

    x = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(NotImplementedError, match="deterministic=True runs on variant='wgmma' only"):
        flash_attention_backward(x, x, x, x, np.zeros((1, 1, 8), np.float32), x, variant="tensor",
                                 deterministic=True)


def test_query_heads_must_be_a_multiple_of_kv_heads():
    x = cuda.to_device(np.zeros((1, 3, 8, 32), np.uint32))
    kv = cuda.to_device(np.zeros((1, 2, 8, 32), np.uint32))
    with pytest.raises(ValueError, match="H=3 must be a multiple of the K/V heads H_kv=2"):
        wb.backward(x, kv, kv, x, cuda.to_device(np.zeros((1, 3, 8), np.float32)), x, x, kv, kv, 0.125, False,
                    "float16")


def test_flash_attention_backward_takes_variant_wgmma():
    """The public call (float16 NumPy arrays), after the wgmma forward, against float64."""
    from flashlab.kernels import flash_attention, flash_attention_backward

    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal((1, 1, n, 64)).astype(np.float16) for n in (80, 100, 100, 80))
    o, lse = flash_attention(q, k, v, causal=True, variant="wgmma", block_k=64)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, variant="wgmma")
    want = gradients(*(x.astype(np.float64) for x in (q, k, v, do)), 0.125, True)[2:]
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == np.float16
        assert np.abs(got - w).max() <= 8 * UNIT["float16"] * max(np.abs(w).max(), 4.0), name


@pytest.mark.parametrize("kwargs,error,match", [(dict(block_k=64), ValueError, "takes no block_k"),
                                               (dict(softcap=-1.0), ValueError, "softcap")])
def test_variant_wgmma_backward_refuses_what_it_does_not_do(kwargs, error, match):
    from flashlab.kernels import flash_attention_backward

    q = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(error, match=match):
        flash_attention_backward(q, q, q, q, np.zeros((1, 1, 8), np.float32), q, variant="wgmma", **kwargs)
    with pytest.raises(TypeError, match="variant='tensor'"):
        x = np.zeros((1, 1, 8, 64), np.float32)
        flash_attention_backward(x, x, x, x, np.zeros((1, 1, 8), np.float32), x, variant="wgmma")


def test_the_kernel_reads_its_operands_as_the_lessons_table_says():
    """pipeline.BACKWARD_OPERANDS (lesson 20's table, exercise 20.5) against the wgmma builds the kernel makes."""
    import inspect

    from flashlab import pipeline

    source = inspect.getsource(wb._kernel)
    assert 'mma_s = hopper.wgmma_ss(BQ, dtype)' in source  # S^T and dP^T: A and B K-major, from shared memory
    assert 'mma_kv = hopper.wgmma_rs(d, dtype, b_major="MN")' in source  # dV, dK: A from registers, B MN-major
    assert 'mma_q = hopper.wgmma_ss(DQN, dtype, a_major="MN", b_major="MN")' in source  # dQ: dS^T read MN-major
    table = pipeline.BACKWARD_OPERANDS
    assert table["S^T = K Q^T"] == table["dP^T = V dO^T"] == ("shared", "K", "shared", "K")
    assert table["dV += P^T dO"] == table["dK += dS^T Q"] == ("registers", "K", "shared", "MN")
    assert table["dQ += dS K"] == ("shared", "MN", "shared", "MN")


@pytest.mark.parametrize("consumers", [1, 2])
def test_deterministic_mode_takes_the_options(consumers, monkeypatch):
    """deterministic=True under the options (causal bottom-right, a window, softcap) over three key blocks and three
    query tiles (two blocks of 128 keys with two consumers), each block's band of tiles and each tile's band of
    blocks partial: dq, dk, dv against float64 gradients (flashlab.flash_attention_v2_backward on the reference's o
    and lse; o rounded to float16), through the public call. Each option against float64 on one block:
    tests/test_kernel_options.py's wgmma cells."""
    import flashlab as fl
    from flashlab.kernels import flash_attention_backward

    monkeypatch.setattr(wb, "default_tile", lambda d, causal: wb.BackwardTile(consumers=consumers))

    B, H, H_kv, nq, nk = 1, 1, 1, 150, 140
    opts = dict(causal=True, align="bottom_right", window_size=(70, 0), softcap=2.0)
    rng = np.random.default_rng(27)
    q = (1.5 * rng.standard_normal((B, H, nq, 64))).astype(np.float16)
    k, v = (rng.standard_normal((B, H_kv, nk, 64)).astype(np.float16) for _ in range(2))
    do = rng.standard_normal((B, H, nq, 64)).astype(np.float16)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    o, lse = fl.reference_attention(*f64[:3], **opts)
    want = fl.flash_attention_v2_backward(*f64[:3], o, lse, f64[3], **opts)
    got = flash_attention_backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do, variant="wgmma",
                                   deterministic=True, **opts)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == np.float16 and g.shape == w.shape and np.isfinite(g).all(), name
        err = fl.relative_error(g.astype(np.float64), w)
        assert err < 2e-3, f"{name} relative error {err:.2e}"
