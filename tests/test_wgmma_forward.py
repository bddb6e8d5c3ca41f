"""variant="wgmma" (kernels/wgmma.py): FlashAttention-3's forward, against float64.

In the simulator (CI) the kernel runs with Hopper's instructions emulated (kernels/hopper.py): a producer
warpgroup's TMA copies, the mbarrier ring, two consumer warpgroups' wgmma, pingpong's named barriers. Simulated
launches are small (a few blocks of 384 threads). On an H100/H200 the GPU tests run wider shapes and hold the
error to torch's own (scripts/gpu_check_wgmma_forward.py prints the same with timings).

The bound: P is rounded to 16 bits before P V (relative error u = 2^-11 for float16, 2^-8 for bfloat16) and O is
rounded once at the end, so |O - O_64| <= about 2u max|V|; a wrong mask, rescale or fragment order errs by
more than 0.05.
"""
import numpy as np
import pytest

from device_views import strided_on_device, words_on_device
from flashlab import fragments as F
from flashlab.device import get_cuda, has_gpu

cuda = get_cuda()
wgmma = pytest.importorskip("flashlab.kernels.wgmma")
from flashlab.kernels.forward import flash_attention  # noqa: E402

gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
hopper_gpu = has_gpu() and cuda.get_current_device().compute_capability >= (9, 0)
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def reference(q, k, v, causal):
    """O and lse in float64; k and v may have fewer heads (GQA); causal is top-left."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.arange(k.shape[2])[None, :] > np.arange(q.shape[2])[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return p @ v / p.sum(-1, keepdims=True), (m + np.log(p.sum(-1, keepdims=True)))[..., 0]


def inputs(rng, B, H, H_kv, Nq, Nk, d, dtype, logits=1.0):
    """Values exactly representable in dtype (as float32)."""
    vals = lambda shape: F.from_bits16(F.to_bits16(rng.standard_normal(shape), dtype), dtype)  # noqa: E731
    return vals((B, H, Nq, d)) * np.float32(logits), vals((B, H_kv, Nk, d)), vals((B, H_kv, Nk, d))


def assert_close(o, lse, q, k, v, causal, dtype):
    o_ref, lse_ref = reference(q, k, v, causal)
    bound = 3 * UNIT[dtype] * np.abs(v).max()
    err = np.abs(o - o_ref).max()
    assert err <= bound, f"max |O - O_float64| = {err:.3g} > {bound:.3g}"
    lerr = np.abs(lse - lse_ref).max()
    assert lerr <= 1e-5 * (1 + np.abs(lse_ref).max()), f"max |lse - lse_float64| = {lerr:.3g}"


def run_kernel(q, k, v, causal, dtype, tile, heads_inside_rows=False):
    """wgmma.forward on numba device arrays of 16-bit pairs (bfloat16 has no NumPy type: this is its way in).
    heads_inside_rows: q, k and v lie in memory as (B, N, H, d), read in place through their strides."""
    kept = []
    words = lambda x: words_on_device(x, dtype, heads_inside_rows, kept)  # noqa: E731
    B, H, Nq, d = q.shape
    o = cuda.to_device(np.zeros((B, H, Nq, d // 2), np.uint32))
    lse = cuda.to_device(np.zeros((B, H, Nq), np.float32))
    wgmma.forward(words(q), words(k), words(v), o, lse, d ** -0.5, causal, dtype, tile)
    return F.from_bits16(o.copy_to_host().view(np.uint16), dtype), lse.copy_to_host()


# B, H, H_kv, Nq, Nk, d, causal, dtype, tile: ragged, Nq != Nk, GQA, N = 1, the ring refilled, pingpong on and
# off, three consumer warpgroups
CASES = [(1, 2, 1, 200, 150, 64, True, "float16", wgmma.WgmmaTile(64, 2)),
         (1, 1, 1, 130, 300, 128, False, "bfloat16", wgmma.WgmmaTile(64, 3, pingpong=False)),
         (2, 1, 1, 1, 1, 64, False, "bfloat16", wgmma.WgmmaTile(128, 2)),
         (1, 2, 2, 70, 260, 64, True, "float16", wgmma.WgmmaTile(48, 2, pingpong=False)),
         (1, 1, 1, 250, 200, 64, True, "float16", wgmma.WgmmaTile(64, 2, consumers=3))]


@pytest.mark.parametrize("B,H,H_kv,Nq,Nk,d,causal,dtype,tile", CASES)
def test_kernel_matches_float64(B, H, H_kv, Nq, Nk, d, causal, dtype, tile):
    rng = np.random.default_rng(Nq + Nk)
    q, k, v = inputs(rng, B, H, H_kv, Nq, Nk, d, dtype)
    o, lse = run_kernel(q, k, v, causal, dtype, tile)
    assert_close(o, lse, q, k, v, causal, dtype)


def test_kernel_reads_heads_inside_rows_in_place():
    """q, k, v laid out (B, N, H, d), as a GPT's linear layer leaves them, and viewed as (B, H, N, d): the 4-D tensor
    maps step over the other heads (GQA: 2 query heads on 1 K/V head, 2 batches), and a tile past a head's last
    row reads zeros, not the next row's other heads."""
    rng = np.random.default_rng(11)
    q, k, v = inputs(rng, 2, 2, 1, 70, 90, 64, "float16")
    o, lse = run_kernel(q, k, v, True, "float16", wgmma.WgmmaTile(64, 2), heads_inside_rows=True)
    assert_close(o, lse, q, k, v, True, "float16")


def test_wgmma_refuses_strides_tma_cannot_read():
    x = np.zeros((1, 2, 8, 64), np.float16)
    q, _ = strided_on_device(np.zeros((1, 2, 8, 68), np.float16)[..., :64])  # rows of 136 bytes
    with pytest.raises(ValueError, match="reads q with TMA.*multiples of 16 bytes"):
        flash_attention(q, x, x, variant="wgmma")


def test_flash_attention_variant_wgmma_with_huge_logits():
    """The public call (float16 NumPy arrays), scores in the thousands: the online softmax stays finite."""
    rng = np.random.default_rng(5)
    q, k, v = (x.astype(np.float16) for x in inputs(rng, 1, 2, 1, 90, 140, 64, "float16", logits=30.0))
    o, lse = flash_attention(q, k, v, causal=True, variant="wgmma", block_k=64)
    assert o.dtype == np.float16 and lse.shape == (1, 2, 90) and np.abs(lse).max() > 100
    assert_close(o.astype(np.float32), lse, q, k, v, True, "float16")


def test_a_wrong_schedule_would_fail():
    """The bound above catches a real slip: the same inputs with one key tile's P V left out."""
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, 1, 1, 1, 64, 128, 64, "float16")
    o_ref, _ = reference(q, k, v, False)
    o_missing, _ = reference(q, k[:, :, :64], v[:, :, :64], False)
    assert np.abs(o_missing - o_ref).max() > 20 * 3 * UNIT["float16"] * np.abs(v).max()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_q=64), ValueError, "block_k alone"),
    (dict(window_size=(8, 0)), NotImplementedError, "causal masking only"),
    (dict(block_k=40), ValueError, "multiple of 16"),
])
def test_wgmma_refuses_what_it_does_not_do(kwargs, error, match):
    q = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(error, match=match):
        flash_attention(q, q, q, variant="wgmma", **kwargs)


def test_wgmma_names_the_variant_for_float32_and_other_head_sizes():
    with pytest.raises(TypeError, match="variant='tensor'"):
        flash_attention(*(np.zeros((1, 1, 8, 64), np.float32),) * 3, variant="wgmma")
    with pytest.raises(ValueError, match="d in \\(64, 128\\)"):
        flash_attention(*(np.zeros((1, 1, 8, 32), np.float16),) * 3, variant="wgmma")
    with pytest.raises(ValueError, match="at least 2"):
        wgmma.WgmmaTile(128, 1).check(64)


@pytest.mark.parametrize("cc", [(8, 0), (10, 0)])
def test_wgmma_runs_on_hopper_alone(monkeypatch, cc):
    # sm_90a code runs on compute capability 9.0 only (the PTX ISA): before Hopper and after it, both calls refuse
    from flashlab.kernels import backward, forward

    x = np.zeros((1, 1, 8, 64), np.float16)
    for module in (forward, backward):
        monkeypatch.setattr(module, "device_limits", lambda: {"cc": cc})
    with pytest.raises(RuntimeError, match=f"needs a Hopper GPU .* has {cc[0]}.{cc[1]}. Use variant='tensor'"):
        flash_attention(x, x, x, variant="wgmma")
    with pytest.raises(RuntimeError, match=f"needs a Hopper GPU .* has {cc[0]}.{cc[1]}. Use variant='tensor'"):
        backward.flash_attention_backward(x, x, x, x, np.zeros((1, 1, 8), np.float32), x, variant="wgmma")


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu, reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("B,H,H_kv,Nq,Nk,d,causal,dtype", [
    (1, 4, 2, 1000, 777, 64, True, "float16"), (2, 3, 3, 1, 1, 128, False, "bfloat16"),
    (1, 2, 1, 2048, 2048, 128, True, "bfloat16"), (1, 2, 2, 300, 2049, 64, False, "float16"),
    (1, 8, 1, 1500, 1500, 128, False, "bfloat16")])
def test_gpu_wgmma_error_is_torchs(B, H, H_kv, Nq, Nk, d, causal, dtype):
    """Torch tensors through the public call: the error against float64 within 1.5x torch SDPA's own."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as Fn

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(Nq + Nk)
    q = torch.randn(B, H, Nq, d, device="cuda", generator=g).to(dt)
    k, v = (torch.randn(B, H_kv, Nk, d, device="cuda", generator=g).to(dt) for _ in range(2))
    o, lse = flash_attention(q, k, v, causal=causal, variant="wgmma")
    o_ref, lse_ref = reference(*(x.float().cpu().numpy() for x in (q, k, v)), causal)
    rep = H // H_kv
    o_torch = Fn.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=causal)
    err = np.abs(o.float().cpu().numpy() - o_ref).max()
    torch_err = np.abs(o_torch.float().cpu().numpy() - o_ref).max()
    assert err <= 1.5 * torch_err + 1e-6, f"error {err:.3g} against torch's {torch_err:.3g}"
    assert np.abs(lse.cpu().numpy() - lse_ref).max() <= 1e-4 * (1 + np.abs(lse_ref).max())


@pytest.mark.parametrize("call,match", [
    ("varlen", "no varlen build"), ("paged", "no paged build")])
def test_entry_points_without_a_wgmma_build_name_the_variant_that_serves(call, match):
    from flashlab.kernels import flash_attention_varlen, paged_decoding

    x = np.zeros((10, 2, 64), np.float16)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(ValueError, match=match):
        if call == "varlen":
            flash_attention_varlen(x, x, x, cu, cu, variant="wgmma")
        else:
            cache = np.zeros((2, 16, 2, 64), np.float16)
            paged_decoding(np.zeros((2, 2, 1, 64), np.float16), cache, cache, np.zeros((2, 1), np.int32),
                           np.array([4, 4], np.int32), variant="wgmma")


def test_kernel_info_describes_the_wgmma_tile():
    from flashlab.kernels import kernel_info

    info = kernel_info(64, variant="wgmma", dtype="bfloat16")
    assert (info["consumers"], info["block_q"], info["threads_per_block"]) == (3, 192, 512)
    assert info["shared_bytes_per_block"] == wgmma.choose_tile(64).shared_bytes(64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        kernel_info(64, variant="wgmma")  # float32, the default dtype
