"""The backward kernels (kernels/register_backward.py, kernels/tensor_backward.py) take the options' values as
arguments (options.OptionArgs) and compile only their presence (options.Features): a new window, softcap or slope
set builds nothing; both visit the query tiles of options.query_band; each describes its launches once, with the
seed in the main kernel's last argument. In the simulator."""
import numpy as np
import pytest

import flashlab as fl
from flashlab.kernels import backward as kb
from flashlab.kernels import flash_attention_backward, register_backward, tensor, tensor_backward
from flashlab.kernels.options import Extras, Features, plain_arguments, query_band, tile_band
from flashlab.kernels.varlen_backward import key_blocks


def case(rng, nq, nk, dtype=np.float16, H=2, d=16):
    q = rng.standard_normal((1, H, nq, d)).astype(dtype)
    k, v = (rng.standard_normal((1, H, nk, d)).astype(dtype) for _ in range(2))
    o, do = (rng.standard_normal((1, H, nq, d)).astype(dtype) for _ in range(2))
    lse = (rng.random((1, H, nq)) + 2).astype(np.float32)
    return q, k, v, o, lse, do


@pytest.mark.parametrize("variant", ["register", "tensor"])
def test_new_option_values_build_nothing(rng, variant):
    build = register_backward.make_kernels if variant == "register" else tensor_backward.build
    args = case(rng, 17, 20)
    runs = [dict(window_size=(5, 2), softcap=2.0, alibi_slopes=np.array([0.5, 0.25])),
            dict(window_size=(3, 7), softcap=1.5, alibi_slopes=np.array([0.1, 0.75])),
            dict(window_size=(9, 0), softcap=4.0, alibi_slopes=np.array([0.3, 0.2]))]
    sizes = []
    for opts in runs:
        want = fl.flash_attention_v2_backward(*(x.astype(np.float64) for x in args), causal=True, **opts)
        got = flash_attention_backward(*args, causal=True, variant=variant, block_q=16, block_k=16, **opts)
        for g, w in zip(got, want):  # the values reached the kernel: a stale window or slope is off by far more
            assert fl.relative_error(g, w) < 5e-3
        sizes.append(build.cache_info().currsize)
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0]


def test_a_key_blocks_query_band_is_the_options_one():
    """varlen's table weighs a key block by the tiles of options.query_band, as the kernels visit them."""
    cq, ck = np.array([0, 7, 20, 25]), np.array([0, 9, 18, 31])
    opt = type("Opt", (), dict(window=(4, 1), align="bottom_right", causal=True))()
    table = key_blocks(cq, ck, 8, 8, opt)
    weights = []
    for b, k0 in table:
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        right = Extras(4, 1).right_bound(True)  # causal: 0
        lo, hi = query_band(k0, k0 + 7, nk - nq, nq, 4, right)
        rows = [i for i in range(nq) if any(k0 <= j < k0 + 8 and i + nk - nq - 4 <= j <= i + nk - nq + right
                                            for j in range(nk))]
        assert (lo, hi) == ((rows[0], rows[-1] + 1) if rows else (lo, lo)) or (not rows and lo >= hi)
        weights.append(int(tile_band(lo, hi, 8)[2]))
    assert weights == sorted(weights, reverse=True)  # heaviest first
    every = [(b, k0) for b in range(3) for k0 in range(0, ck[b + 1] - ck[b], 8)]
    assert sorted(map(tuple, table.tolist())) == every


def test_register_launches_are_described_once():
    kernels = register_backward.make_kernels(16, 8, 16, 32, features=Features(window=True))
    args = Extras(3, 1).arguments(True, 1, 2, False)
    described = register_backward.launches(kernels, 1, 2, 9, 16, (2, 2, 1), 32, 0.25, True, args, True, 32)
    launches, temporaries = described.launches, described.temporaries
    assert described.seeded == 1 and described.host["slopes"] is args.slopes
    assert [x.arrays for x in launches] == [("o", "do", "D", "dq_acc"),
                                            ("q", "k", "v", "do", "lse", "D", "dq_acc", "dk", "dv", "slopes"),
                                            ("dq_acc", "dq")]
    assert launches[1].args[-5:-1] == (3, 0, np.float32(0), "slopes")  # left, right (causal folded in), cap
    assert set(temporaries) == {"D", "dq_acc"}


def test_tensor_launches_are_described_once():
    tile = tensor_backward.choose_tile(16, "f16")
    kernels = tensor_backward.build(16, tile, False, "f16", features=Features(softcap=True))
    args = Extras(softcap=2.0).arguments(False, 1, 2, True)
    described = tensor_backward.launches(kernels, 1, 2, 9, 11, 16, 2, 0.25, tile, "f16", args)
    launches, temporaries = described.launches, described.temporaries
    assert described.seeded == 1
    assert launches[1].arrays == ("q", "k", "v", "do", "lse", "D", "dq_acc", "dk", "dv", "slopes")
    assert launches[1].args[-5:-2] == (-1, -1, np.float32(2.0 * 1.4426950408889634))
    assert launches[1].shared == 4 * tile.shared_words(16, "f16") and set(temporaries) == {"D", "dq_acc"}
    assert len(tensor_backward.signature("f16")) == len(launches[1].args) == 17


def test_register_signature_matches_the_kernel():
    import inspect

    dkdv = register_backward.make_kernels(16, 8, 16, 32)[1]
    assert len(register_backward.signature("float32")) == len(inspect.signature(dkdv.py_func).parameters)
    main = tensor_backward.build(16, tensor_backward.choose_tile(16, "f16"), False, "f16")[1]
    assert len(tensor_backward.signature("f16")) == len(inspect.signature(main.py_func).parameters)


def test_plain_arguments_reach_a_plain_build(rng):
    """The plain build ignores the option values: any left, cap or slopes give the same gradients."""
    from flashlab.device import get_cuda

    cuda = get_cuda()
    q, k, v, o, lse, do = case(rng, 9, 12, np.float32, H=1)
    kernels = register_backward.make_kernels(16, 8, 16, 32)
    outs = []
    for args in (plain_arguments(True), plain_arguments(True)._replace(left=3, cap=np.float32(5.0),
                                                                       slopes=np.ones(4, np.float32))):
        described = register_backward.launches(kernels, 1, 1, 9, 16, (1, 1, 1), 32, 0.25, True, args, False, 32)
        arrays = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=np.zeros(q.shape, np.float32),
                      dk=np.zeros(k.shape, np.float32), dv=np.zeros(k.shape, np.float32))
        described.run(arrays, lambda shape, dt: cuda.to_device(np.zeros(shape, dt)), seed=np.int64(0))
        outs.append([arrays[n].copy() for n in ("dq", "dk", "dv")])
    assert all(np.abs(x).max() > 0 for x in outs[0])  # the kernels ran
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


def test_bfloat16_below_sm80_gets_the_forwards_error(monkeypatch):
    """bfloat16 on a GPU without bf16 mma goes to the tensor backward (not an upcast to the register kernel), which
    refuses it as the forward does: tensor.resolve_precision's error."""
    q = type("Q", (), {"dtype": "torch.bfloat16"})()
    monkeypatch.setattr(kb, "has_gpu", lambda: True)
    monkeypatch.setattr(kb, "device_limits", lambda: {"cc": (7, 5)})
    assert kb.default_variant(q) == "tensor"
    q16 = type("Q", (), {"dtype": "torch.float16"})()
    assert kb.default_variant(q16) == "tensor"
    with pytest.raises(ValueError, match="compute capability 8.0") as err:
        tensor.resolve_precision("bfloat16", None, (7, 5))
    monkeypatch.setattr(kb, "device_limits", lambda: {"cc": (7, 0)})
    assert kb.default_variant(q16) == "register" and kb.default_variant(q) == "tensor"
    assert "bfloat16" in str(err.value)
