"""Dropout in the register kernels: the forward drops P V's P, the backward regenerates the mask.

The kernels must drop exactly the elements the NumPy code drops, keyed by (seed, batch, query head, row, col),
bit for bit, and draw a new mask for a new seed without a new build. In the simulator on small shapes; GPU-sized
versions carry the gpu marker. Dropout against float64 (alone and with the other options, forward and backward,
every variant): tests/test_kernel_options.py."""
import numpy as np
import pytest

import flashlab as fl
from flashlab import dropout as fd
from flashlab.reference import dropout_scale

kernels = pytest.importorskip("flashlab.kernels")
from flashlab.kernels import flash_attention, flash_attention_backward  # noqa: E402

BIG = 2 ** 40 + 11  # a seed whose high 32 bits are not 0: the 64-bit path


def inputs(rng, B, H, H_kv, nq, nk, d, dtype=np.float32):
    q = (2 * rng.standard_normal((B, H, nq, d))).astype(dtype)
    k, v = (rng.standard_normal((B, H_kv, nk, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((B, H, nq, d)).astype(dtype)
    return q, k, v, do


def test_device_hash_gives_dropout_bits():
    """flashlab.dropout's device functions, run in a kernel, against the scalar hash, up to seed 2**63 - 1."""
    from flashlab.device import get_cuda

    global cuda  # a module global: the simulator swaps in its fake `cuda` through the kernel's globals
    cuda = get_cuda()
    start, mix, keep = fd.device_functions(0.3)

    @cuda.jit
    def bits(seed, b, h, i, out, z):
        j = cuda.threadIdx.x
        row = mix(start(seed, b, h), i)
        out[j] = mix(row, j)
        z[j] = keep(row, j)

    for seed, b, h, i in [(0, 0, 0, 0), (12345, 1, 3, 7), (BIG, 2, 0, 40), (2 ** 63 - 1, 5, 7, 2 ** 31)]:
        out, z = np.zeros(32, np.uint64), np.zeros(32, np.float32)
        bits[1, 32](seed, b, h, i, out, z)
        assert out.tolist() == [fd.dropout_bits(seed, b, h, i, j) for j in range(32)], seed
        assert np.array_equal(z, fd.keep_scale(seed, 0.3, b, h, i, np.arange(32)).astype(np.float32)), seed


def test_kernels_drop_the_elements_numpy_drops(rng):
    """With V = I the output is P * Z / l, so o == 0 exactly where the mask drops (P > 0 everywhere: no mask);
    with dO = I, dV = (P * Z)^T dO holds the backward's mask. Both must equal flashlab.dropout's mask."""
    B, H, nq, nk, d, p = 2, 3, 20, 32, 32, 0.3
    q = rng.standard_normal((B, H, nq, d)).astype(np.float32)
    k = rng.standard_normal((B, H, nk, d)).astype(np.float32)
    v = np.broadcast_to(np.eye(nk, d, dtype=np.float32), (B, H, nk, d)).copy()
    drop = dropout_scale(BIG, p, (B, H), nq, nk) == 0
    assert 0.15 < drop.mean() < 0.45  # the mask has dropped entries and kept ones
    o, lse = flash_attention(q, k, v, dropout_p=p, seed=BIG)
    assert np.array_equal(o == 0, drop)
    do = np.broadcast_to(np.eye(nq, d, dtype=np.float32), (B, H, nq, d)).copy()
    dv = flash_attention_backward(q, k, v, o, lse, do, dropout_p=p, seed=BIG)[2]
    assert np.array_equal(dv[..., :nq] == 0, np.swapaxes(drop, -1, -2))


def test_p_zero_is_the_kernel_without_dropout(rng):
    q, k, v, do = inputs(rng, 1, 2, 2, 21, 27, 16)
    for opts in (dict(causal=True), dict(window_size=(5, 1))):
        o, lse = flash_attention(q, k, v, **opts)
        o0, lse0 = flash_attention(q, k, v, dropout_p=0.0, seed=BIG, **opts)
        assert np.array_equal(o, o0) and np.array_equal(lse, lse0), opts
        g = flash_attention_backward(q, k, v, o, lse, do, **opts)
        g0 = flash_attention_backward(q, k, v, o, lse, do, dropout_p=0.0, seed=BIG, **opts)
        assert all(np.array_equal(a, b) for a, b in zip(g, g0)), opts


def test_seeds_draw_different_masks_with_one_build(rng):
    """seed, seed + 1 and seed + 2**40 (differing only in the high 32 bits) give three different outputs, each the
    NumPy one, from one compiled kernel: the seed is an argument, not a constant."""
    from flashlab.kernels import register

    q, k, v, _ = inputs(rng, 1, 2, 2, 16, 24, 16)
    outs, builds = [], []
    for seed in (3, 4, 3 + 2 ** 40):
        o, _ = flash_attention(q, k, v, dropout_p=0.3, seed=seed)
        assert fl.relative_error(o, fl.flash_attention_v2(q, k, v, dropout_p=0.3, seed=seed)[0]) < 2e-5, seed
        outs.append(o)
        builds.append(register.build.cache_info().currsize)
    # the first call may build more than one kernel (on a GPU the planner compiles to read registers); the
    # later seeds build none
    assert builds[1] == builds[0] == builds[2]
    assert fl.relative_error(outs[0], outs[1]) > 0.1 and fl.relative_error(outs[0], outs[2]) > 0.1


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_kernels_drop_the_elements_numpy_drops_on_gpu(rng):
    test_kernels_drop_the_elements_numpy_drops(rng)
    test_seeds_draw_different_masks_with_one_build(rng)


def test_compile_signatures_have_the_seed():
    """On a GPU, the planner (plan.kernel_and_signature) and kernel_info compile kernels from explicit signatures:
    each must have one type per kernel parameter, the register and tensor builds' last one the int64 seed."""
    import inspect

    from numba import int64

    from flashlab.kernels import info, plan, register_backward, tensor_backward
    from flashlab.kernels.plan import resolve_config

    def n_params(kernel):
        return len(inspect.signature(kernel.py_func).parameters)

    for variant, direction, precision in [("register", "forward", None), ("register", "backward", None),
                                          ("shared", "forward", None), ("tensor", "forward", "3xtf32"),
                                          ("tensor", "backward", "3xtf32")]:
        if direction == "forward":
            config = resolve_config(variant, 16, precision=precision)
        elif variant == "register":
            config = register_backward.default_config(16, simulator=True)
        else:
            config = tensor_backward.choose_tile(16, precision)
        kernel, sig = plan.kernel_and_signature(variant, direction, 16, "float32", precision, config, True, False,
                                                False)
        assert len(sig) == n_params(kernel), (variant, direction)
        assert (sig[-1] == int64) == (variant in ("register", "tensor")), (variant, direction)
    # kernel_info compiles through plan.kernel_and_signature too
    assert "kernel_and_signature" in inspect.getsource(info.kernel_info)
