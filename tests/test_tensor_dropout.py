"""Dropout in the tensor-core forward (kernels/tensor.py, extras with dropout_p > 0, the seed a kernel argument).

The mask must be flashlab.dropout's, keyed by (seed, batch, query head, row, key), bit for bit: with V = I the
zeros of O are the dropped elements themselves; l and lse stay dropout-free; a new seed draws a new mask without a
new build. In the simulator on a few blocks (block_q = block_k = 16); GPU-sized versions carry the gpu marker.
Dropout against the float64 reference with the same seed (alone and with the other options, forward and backward,
every variant): tests/test_kernel_options.py."""
import numpy as np
import pytest

import flashlab as fl
from flashlab import fragments as F
from flashlab.reference import dropout_scale

kernels = pytest.importorskip("flashlab.kernels")
from flashlab.kernels import flash_attention, tensor  # noqa: E402
from flashlab.kernels.options import Extras, Features  # noqa: E402
from flashlab.kernels.tensor import TensorTile  # noqa: E402

BIG = 2 ** 40 + 11  # a seed whose high 32 bits are not 0
DT16 = {"f16": "float16", "bf16": "bfloat16"}


def inputs(rng, B, H, H_kv, nq, nk, dtype, d=16):
    q = (1.5 * rng.standard_normal((B, H, nq, d))).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, nk, d)).astype(dtype) for _ in range(2))
    return q, k, v


def launch_words(q, k, v, precision, extras, seed, causal=False, tile=TensorTile(1, 16)):
    """tensor.launch on NumPy inputs, 16-bit ones as packed bits (bfloat16 without torch). Returns o as float32."""
    B, H, nq, d = q.shape
    if precision in DT16:
        args = [np.ascontiguousarray(F.to_bits16(x, DT16[precision])).view(np.uint32) for x in (q, k, v)]
        o = np.zeros((B, H, nq, d // 2), np.uint32)
    else:
        args = [np.ascontiguousarray(x, np.float32) for x in (q, k, v)]
        o = np.full((B, H, nq, d), np.nan, np.float32)
    lse = np.full((B, H, nq), np.nan, np.float32)
    tensor.launch(*args, o, lse, H, 1 / np.sqrt(d), causal, tile, precision, extras=extras, seed=seed)
    return (F.from_bits16(o.view(np.uint16), DT16[precision]) if precision in DT16 else o), lse


@pytest.mark.parametrize("precision", ["f16", "bf16", "tf32"])  # 3xTF32: test_kernel_options.py's f32 cells
def test_tensor_kernel_drops_the_elements_numpy_drops(rng, precision):
    """With V = I (d >= Nk) the output is P * Z / l: exactly 0 where the mask drops and only there (every P > 0,
    as there is no mask), for each batch, query head (GQA: two query heads share a K/V head) and row. Covers
    each way P reaches P V: packed float16 / bfloat16 pairs, tf32's renumbered keys, 3xTF32's big + small parts."""
    B, H, H_kv, nq, nk, d, p = 2, 2, 1, 16, 29, 32, 0.3
    q = (0.3 * rng.standard_normal((B, H, nq, d))).astype(np.float32)  # small scores: no P underflows in 16 bits
    k = rng.standard_normal((B, H_kv, nk, d)).astype(np.float32)
    v = np.broadcast_to(np.eye(nk, d, dtype=np.float32), (B, H_kv, nk, d)).copy()
    drop = dropout_scale(BIG, p, (B, H), nq, nk) == 0
    assert 0.15 < drop.mean() < 0.45 and not np.array_equal(drop[:, 0], drop[:, 1])  # heads draw their own masks
    o, lse = launch_words(q, k, v, precision, Extras(dropout_p=p), BIG)
    assert np.array_equal(o[..., :nk] == 0, drop) and np.all(o[..., nk:] == 0)
    seen = [F.from_bits16(F.to_bits16(x, DT16[precision]), DT16[precision]) if precision in DT16 else x
            for x in (q, k)]  # the inputs as the kernel saw them
    plain_lse = fl.reference_attention(*(x.astype(np.float64) for x in (*seen, v)))[1]
    assert np.max(np.abs(lse - plain_lse)) < 1e-3  # lse dropout-free


def test_seeds_draw_different_masks_with_one_build(rng):
    """seed, seed + 1 and seed + 2**40 (differing only in the high 32 bits) give three different outputs, each the
    reference's, from one compiled kernel: the seed is an argument, not a constant."""
    q, k, v = inputs(rng, 1, 1, 1, 16, 24, np.float16)
    outs, builds = [], []
    for seed in (3, 4, 3 + 2 ** 40):
        o, _ = flash_attention(q, k, v, variant="tensor", block_q=16, block_k=16, dropout_p=0.3, seed=seed)
        want = fl.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), dropout_p=0.3, seed=seed)[0]
        assert fl.relative_error(o, want) < 2e-3, seed
        outs.append(o)
        builds.append(tensor.build.cache_info().currsize)
    # the first call may build more than one kernel (on a GPU the planner compiles to read registers); the
    # later seeds build none
    assert builds[1] == builds[0] == builds[2]
    assert fl.relative_error(outs[0], outs[1]) > 0.1 and fl.relative_error(outs[0], outs[2]) > 0.1


def test_dropout_builds_and_the_paged_build():
    """Dropout alone keeps the plain kernel's masking (a build of its own); the paged build, whose rows are
    (query head, row) pairs of a GQA group, has no dropout and says so."""
    tile = TensorTile(1, 16)
    assert tensor.build(16, tile, True, "f16", features=Features(dropout_p=0.1)) is not \
        tensor.build(16, tile, True, "f16", features=Features(dropout_p=0.2))
    with pytest.raises(ValueError, match=r"dropout_p=0\.1 with page=16.*use page=0"):
        tensor.build(16, tile, False, "f16", split=True, page=16, features=Features(dropout_p=0.1))


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["f16", "bf16", "tf32", "3xtf32"])
def test_tensor_kernel_drops_the_elements_numpy_drops_on_gpu(rng, precision):
    test_tensor_kernel_drops_the_elements_numpy_drops(rng, precision)
    if precision == "f16":
        test_seeds_draw_different_masks_with_one_build(rng)
