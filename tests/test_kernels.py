"""The forward kernels against float64 attention: in the CUDA simulator (CI) and on a GPU (marked gpu).

Simulator cases are tiny (one to a few blocks of <= 64 threads: the simulator runs one OS thread per
CUDA thread) but cover ragged tails, Nq != Nk, causal with skipped key blocks, float16, N = 1, huge
logits and several thread layouts. Tolerances: 1e-5 relative error for float32 (a kernel that drops a
rescale, shifts the causal diagonal by one or misses a tail is off by 1e-2 or more) and 1e-2 for
float16 inputs (their own rounding is ~5e-4).
"""
import numpy as np
import pytest

import flashlab as fl
from flashlab.device import has_gpu

kernels = pytest.importorskip("flashlab.kernels")
from flashlab.kernels import flash_attention, kernel_info  # noqa: E402
from flashlab.kernels.register import Tile  # noqa: E402

TOL = {np.float32: 1e-5, np.float16: 1e-2}
LSE_TOL = 1e-5


def rand_qkv(rng, B, H, nq, nk, d, dtype, logit=1.0):
    q = rng.standard_normal((B, H, nq, d)) * logit
    k, v = rng.standard_normal((B, H, nk, d)), rng.standard_normal((B, H, nk, d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def reference(q, k, v, causal):
    """float64 (o, lse): flashlab.reference_attention, or the same formula in torch on the GPU (fast at N=4096)."""
    if not has_gpu() or q.shape[-2] < 1000:
        return fl.reference_attention(q, k, v, causal=causal)
    import torch

    q, k, v = (torch.as_tensor(x, device="cuda", dtype=torch.float64) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), -torch.inf)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v).cpu().numpy(), lse.cpu().numpy()


def check(q, k, v, causal, ref=None, **kw):
    o, lse = flash_attention(q, k, v, causal=causal, **kw)
    ro, rl = ref or reference(q, k, v, causal)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    err, lerr = fl.relative_error(o, ro), fl.relative_error(lse, rl)
    assert err < TOL[q.dtype.type], f"o: relative error {err:.2e}"
    assert lerr < LSE_TOL, f"lse: relative error {lerr:.2e}"
    return err


# ------------------------------------------------------------------------------------ simulator (CI)
# (nq, nk, causal, dtype, variant, config): config = register Tile or (block_q, block_k) for "shared".
SIM_CASES = [
    (16, 16, False, np.float32, "register", Tile(16, 16, 4, 4)),  # exactly one tile
    (21, 37, False, np.float32, "register", Tile(16, 16, 4, 4)),  # ragged Nq and Nk, Nq != Nk
    (37, 21, True, np.float32, "register", Tile(16, 16, 4, 4)),  # causal, Nq > Nk, skipped key tiles
    (33, 40, True, np.float16, "register", Tile(16, 8, 4, 4)),  # float16, causal, block_k != block_q
    (1, 9, False, np.float32, "register", Tile(16, 8, 4, 4)),  # N = 1 query
    (20, 1, True, np.float32, "register", Tile(8, 8, 2, 4)),  # one key: every row sees only key 0
    (19, 24, True, np.float32, "register", Tile(32, 8, 4, 2)),  # 8 rows/thread: two runs of 4 (ii > 0)
    (21, 37, True, np.float16, "register", Tile(16, 8, 4, 4, prefetch=True)),  # next K/V tile in registers
    (21, 37, True, np.float32, "shared", (16, 8)),
    (1, 5, False, np.float16, "shared", (8, 8)),
    (30, 17, False, np.float32, "shared", (16, 16)),
]


@pytest.mark.parametrize("nq,nk,causal,dtype,variant,config", SIM_CASES)
def test_forward_matches_reference(rng, nq, nk, causal, dtype, variant, config):
    q, k, v = rand_qkv(rng, 1, 2, nq, nk, 16, dtype)
    kw = {"tile": config} if variant == "register" else {"block_q": config[0], "block_k": config[1]}
    check(q, k, v, causal, variant=variant, **kw)


@pytest.mark.parametrize("variant", ["register", "shared"])
def test_huge_logits_stay_finite(rng, variant):
    # scores ~ 1e4: exp overflows without the running max; masked entries must not turn into NaN
    q, k, v = rand_qkv(rng, 1, 1, 12, 20, 16, np.float32, logit=3e3)
    kw = {"tile": Tile(8, 8, 2, 4)} if variant == "register" else {"block_q": 8, "block_k": 8}
    o, lse = flash_attention(q, k, v, causal=True, variant=variant, **kw)
    ro, rl = fl.reference_attention(q, k, v, causal=True)
    assert np.all(np.isfinite(o)) and fl.relative_error(o, ro) < 1e-4
    assert fl.relative_error(lse, rl) < 1e-5


def test_d128_one_key_per_thread(rng):
    # d = 128 with the T4 default tile: RN = 1 key per thread, 8 dims per thread in two runs of 4.
    q, k, v = rand_qkv(rng, 1, 1, 16, 20, 128, np.float32)
    check(q, k, v, True, tile=Tile(16, 16, 4, 16))


def test_tile_choice_follows_device_limits():
    from flashlab.kernels.register import PREFERRED, choose_tile

    h100 = choose_tile(64, shared_per_sm=228 * 1024)
    t4 = choose_tile(64, shared_per_sm=64 * 1024)
    assert h100 == PREFERRED[64][0]
    assert 64 * 1024 // (t4.shared_bytes(64) + 1024) >= 2  # two blocks per SM on a T4
    for d in (16, 32, 64, 128):
        assert choose_tile(d).shared_bytes(d) <= 48 * 1024
    assert choose_tile(64, block_q=32, block_k=64).block_q == 32


@pytest.mark.parametrize("options", [{"unroll": 8}, {"unroll": 16, "max_registers": 96}])
def test_register_build_options_compute_the_same(rng, options):
    # the variants benchmarks/experiments/register_experiments.py times (deeper unrolling, a register cap) stay correct
    from flashlab.device import get_cuda
    from flashlab.kernels import register

    cuda = get_cuda()
    q, k, v = rand_qkv(rng, 1, 2, 13, 19, 16, np.float32)
    o, lse = cuda.device_array(q.shape, np.float32), cuda.device_array(q.shape[:3], np.float32)
    register.launch(*(cuda.to_device(x) for x in (q, k, v)), o, lse, 2, 0.25, True, Tile(8, 8, 2, 4), **options)
    ro, rl = fl.reference_attention(q, k, v, causal=True)
    assert fl.relative_error(o.copy_to_host(), ro) < 1e-5 and fl.relative_error(lse.copy_to_host(), rl) < 1e-5


@pytest.mark.parametrize("options, word", [({"unroll": 0}, "unroll"), ({"unroll": 2.5}, "unroll"),
                                           ({"max_registers": 8}, "max_registers"),
                                           ({"max_registers": 300}, "max_registers")])
def test_register_build_options_are_checked(options, word):
    from flashlab.kernels import register

    with pytest.raises(ValueError, match=word):
        register.build(16, Tile(8, 8, 2, 4), False, **options)


def test_d32_and_batch_and_scale(rng):
    q, k, v = rand_qkv(rng, 2, 1, 9, 12, 32, np.float32)
    o, lse = flash_attention(q, k, v, scale=0.3, tile=Tile(8, 8, 2, 4))
    ro, rl = fl.reference_attention(q, k, v, scale=0.3)
    assert fl.relative_error(o, ro) < 1e-5 and fl.relative_error(lse, rl) < 1e-5


def test_default_tile_one_block(rng):
    # The default (GPU-sized) register tile, one block: the configuration the GPU runs, in the simulator.
    q, k, v = rand_qkv(rng, 1, 1, 40, 70, 16, np.float32)
    check(q, k, v, True)


def test_numba_device_arrays_in_and_out(rng):
    from flashlab.device import get_cuda

    cuda = get_cuda()
    q, k, v = rand_qkv(rng, 1, 1, 10, 10, 16, np.float32)
    o, lse = flash_attention(*(cuda.to_device(x) for x in (q, k, v)), tile=Tile(8, 8, 2, 4))
    assert not isinstance(o, np.ndarray) and hasattr(o, "copy_to_host")  # stays on the device
    ro, _ = fl.reference_attention(q, k, v)
    assert fl.relative_error(o.copy_to_host(), ro) < 1e-5


@pytest.mark.parametrize("bad,match", [
    (dict(shape=(1, 1, 4, 20)), "d = 20 is not supported.*16, 32, 64, 128"),
    (dict(shape=(4, 16)), "4 dims"),
    (dict(dtype=np.float64), "float32 or float16"),
    (dict(dtype=np.int32), "dtype int32"),
])
def test_bad_inputs_raise_clear_errors(rng, bad, match):
    shape, dtype = bad.get("shape", (1, 1, 4, 16)), bad.get("dtype", np.float32)
    q = (rng.standard_normal(shape) * 3).astype(dtype)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention(q, q, q)


def test_bad_arguments(rng):
    q, k, v = rand_qkv(rng, 1, 1, 4, 4, 16, np.float32)
    with pytest.raises(ValueError, match="variant"):
        flash_attention(q, k, v, variant="fast")
    with pytest.raises(ValueError, match="same number of keys"):
        flash_attention(q, k, v[:, :, :3])
    with pytest.raises(TypeError, match="block_q"):
        flash_attention(q, k, v, block_q=1.5)
    with pytest.raises(ValueError, match="shared memory"):
        flash_attention(q, k, v, block_q=512, block_k=512)
    with pytest.raises(TypeError, match="causal"):
        flash_attention(q, k, v, causal="yes")


def test_kernel_info_reports_the_tile():
    info = kernel_info(64)
    assert info["threads_per_block"] == info["tr"] * info["tc"]
    assert 0 < info["shared_bytes_per_block"] <= 48 * 1024
    assert 0 < info["occupancy"] <= 1
    if not has_gpu():
        assert info["registers_per_thread"] is None and "GPU" in info["note"]
    shared = kernel_info(128, variant="shared", block_k=16)
    assert shared["shared_bytes_per_block"] == 2 * 16 * 128 * 4


# ------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
GPU_NS = [1, 17, 128, 1000, 4096]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("n", GPU_NS)
def test_gpu_forward(rng, d, n):
    for causal in (False, True):
        for dtype in (np.float32, np.float16):
            B, H = (1, 3) if n >= 1000 else (2, 3)
            q, k, v = rand_qkv(rng, B, H, n, n if n < 1000 else n - 3, d, dtype)  # Nk != Nq for large N
            ref = reference(q, k, v, causal)
            for variant in ("register", "shared"):
                check(q, k, v, causal, ref=ref, variant=variant)


@pytest.mark.gpu
@gpu
def test_gpu_register_has_no_spills():
    for d in (16, 32, 64, 128):
        info = kernel_info(d)
        assert info["local_bytes_per_thread"] == 0, info
        assert info["registers_per_thread"] <= 255


@pytest.mark.gpu
@gpu
def test_gpu_torch_tensors_no_copy(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda") for _ in range(3))
    o, lse = flash_attention(q, k, v, causal=True)
    assert isinstance(o, torch.Tensor) and o.is_cuda and o.dtype == torch.float32 and lse.is_cuda
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert fl.relative_error(o.cpu().numpy(), ref.cpu().numpy()) < 1e-5
