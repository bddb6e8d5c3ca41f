"""The one-launch varlen forward (flashlab/kernels/varlen.py: register.build(varlen=True) and
tensor.build(varlen=True)) against the NumPy varlen (flashlab/varlen.py) in float64: in the simulator on small
packed batches, on a GPU at larger ones."""
import numpy as np
import pytest
from conftest import FAST_LAUNCH_ON

import flashlab as fl
from flashlab.varlen import flash_attention_varlen as numpy_varlen

kvarlen = pytest.importorskip("flashlab.kernels.varlen")


def packed(rng, lens_q, lens_k, H, H_kv, d, dtype=np.float32):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = (1.5 * rng.standard_normal((cu_q[-1], H, d))).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], H_kv, d)).astype(dtype) for _ in range(2))
    return q, k, v, cu_q, cu_k


def check(q, k, v, cu_q, cu_k, tol=2e-5, **opts):
    blocks = {key: opts.pop(key) for key in ("block_q", "block_k", "variant") if key in opts}
    o, lse = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k, **opts, **blocks)
    want_o, want_lse = numpy_varlen(*(x.astype(np.float64) for x in (q, k, v)), cu_q, cu_k, **opts)
    assert o.shape == want_o.shape and o.dtype == q.dtype and lse.shape == want_lse.shape
    empty = np.isinf(want_lse)  # rows of a sequence without keys, or outside every window
    assert np.array_equal(np.isinf(lse), empty) and np.all(o[empty.T] == 0)
    assert fl.relative_error(o, want_o) < tol, opts
    assert np.max(np.abs(lse[~empty] - want_lse[~empty]), initial=0) < 1e-4


CASES = [  # lengths of q and k per sequence, H, H_kv, options
    ([5, 0, 13, 3], [7, 4, 9, 0], 2, 2, dict()),                        # an empty q sequence, an empty k one
    ([9, 17], [9, 17], 2, 1, dict(causal=True)),                        # MQA, causal, several query blocks
    ([6, 11], [14, 3], 4, 2, dict(causal=True, align="bottom_right")),  # GQA; Nq > Nk leaves rows with no key
    ([12, 7, 1], [12, 7, 1], 2, 2, dict(window_size=(3, 1), softcap=2.0, alibi_slopes=np.array([[0.5, 0.25]] * 3))),
    ([10, 8], [12, 8], 2, 2, dict(dropout_p=0.3, seed=2 ** 41 + 3, causal=True)),  # the mask keyed by sequence
]


@pytest.mark.parametrize("lens_q,lens_k,H,H_kv,opts", CASES)
def test_varlen_kernel_matches_numpy(rng, lens_q, lens_k, H, H_kv, opts):
    check(*packed(rng, lens_q, lens_k, H, H_kv, 16), block_q=8, block_k=8, variant="register", **opts)


@pytest.mark.parametrize("lens_q,lens_k,H,H_kv,opts,dtype", [(*c, np.float16) for c in CASES] +
                         [(*c, np.float32) for c in CASES[2:4]])  # 3xTF32 is slow to simulate: GQA, the options
def test_tensor_varlen_kernel_matches_numpy(rng, lens_q, lens_k, H, H_kv, opts, dtype):
    """The tensor-core build: one warp per block of 16 rows, float16 (m16n8k16) and float32 (3xTF32)."""
    tol = 2e-3 if dtype == np.float16 else 2e-5
    check(*packed(rng, lens_q, lens_k, H, H_kv, 16, dtype), tol=tol, block_q=16, block_k=16, variant="tensor", **opts)


def test_varlen_kernel_float16(rng):
    check(*packed(rng, [7, 12], [9, 12], 2, 2, 16, np.float16), tol=2e-3, block_q=8, block_k=8, causal=True,
          variant="register")


def test_varlen_plans_with_its_build(rng, monkeypatch):
    """The plan learns that the build is varlen, and has the library's options only when they are asked for (the
    tensor forward's tile depends on both: kernels/tensor.choose_tile)."""
    import importlib

    planner = importlib.import_module("flashlab.kernels.plan")
    seen, real = [], planner.plan
    monkeypatch.setattr(planner, "plan", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    q, k, v, cu_q, cu_k = packed(rng, [3, 5], [4, 2], 2, 2, 16)
    for opts in ({}, {"softcap": 5.0}, {"softcap": 5.0, "dropout_p": 0.2, "seed": 3}):
        check(q, k, v, cu_q, cu_k, variant="register", block_q=16, block_k=16, **opts)
    assert [(kw["extras"], kw["varlen"]) for kw in seen] == [(False, True), ("light", True), ("heavy", True)], seen


def test_block_table_is_heaviest_first():
    """Every query block of every sequence appears once; under causal masking the blocks near the end of the
    longest sequence (which visit the most key tiles) come first."""
    cu = np.array([0, 3, 40, 40, 57])
    table = kvarlen.block_table(cu, cu, 8, 8, causal=True)
    want = {(b, q0) for b in range(4) for q0 in range(0, int(cu[b + 1] - cu[b]), 8)}
    assert sorted(map(tuple, table.tolist())) == sorted(want)
    assert tuple(table[0]) == (1, 32)  # the last block of the 37-row sequence sees 5 key tiles
    weights = [min(int(cu[b + 1] - cu[b]), q0 + 8) for b, q0 in table]
    assert all(-(-x // 8) >= -(-y // 8) for x, y in zip(weights, weights[1:]))


@pytest.mark.parametrize("change,match", [
    (dict(cu_seqlens_q=[0, 9, 5]), "never decrease"),
    (dict(cu_seqlens_k=[0, 4, 20]), "end at"),
    (dict(cu_seqlens_k=[0, 21]), "same number of sequences"),
    (dict(alibi_slopes=np.ones(3)), "alibi_slopes must have shape"),
    (dict(variant="shared"), "variant must be 'register' or 'tensor' for varlen; got 'shared'"),
    (dict(variant="register", precision="f16"), "precision applies to variant='tensor' only"),
])
def test_varlen_kernel_bad_inputs(rng, change, match):
    q, k, v, cu_q, cu_k = packed(rng, [4, 5], [10, 11], 2, 2, 16)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update({key: change[key] for key in args if key in change})
    extra = {key: val for key, val in change.items() if key not in args}
    with pytest.raises(ValueError, match=match):
        kvarlen.flash_attention_varlen(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], **extra)


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d,dtype,variant", [(64, np.float32, "register"), (128, np.float16, "register"),
                                             (64, np.float16, "tensor"), (128, np.float16, "tensor"),
                                             (64, np.float32, "tensor")])
def test_varlen_kernel_on_gpu(rng, d, dtype, variant):
    lens = [1, 300, 0, 777, 64, 1000]
    tol = 2e-5 if dtype == np.float32 else 2e-3
    for opts in (dict(), dict(causal=True), dict(causal=True, align="bottom_right", window_size=(100, 0))):
        check(*packed(rng, lens, lens[::-1], 4, 2, d, dtype), tol=tol, variant=variant, **opts)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant,dtype", [("tensor", "float16"), ("tensor", "bfloat16"), ("register", "float32")])
def test_prepared_varlen_calls_match_the_general_path(rng, monkeypatch, variant, dtype):
    """Torch CUDA tensors take the prepared path (kernels/prepared.py): it gives the general path's output bit for
    bit; a new cu_seqlens is a new entry, a new dropout seed is not."""
    import torch

    from flashlab.kernels import prepared

    monkeypatch.setattr(prepared, "_CALLS", {})  # counted below: no entries from other tests, none evicted
    lens_q, lens_k = [1, 300, 0, 777, 64], [5, 300, 9, 700, 0]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, 4, 2, 64)
    q, k, v = (torch.from_numpy(x).to("cuda", getattr(torch, dtype)) for x in (q, k, v))
    opts = dict(causal=True, align="bottom_right", window_size=(100, 0), softcap=5.0,
                alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), variant=variant)
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "0")
    want = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k, **opts)
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", FAST_LAUNCH_ON)
    before = len(prepared._CALLS)
    for _ in range(2):  # the first call prepares, the second only launches
        got = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k, **opts)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    assert len(prepared._CALLS) == before + 1
    cu_k2 = cu_k.copy()
    cu_k2[1:] = np.minimum(cu_k2[1:] + 3, cu_k[-1])  # other key lengths: a new prepared call, the right output
    got = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k2, **opts)
    assert len(prepared._CALLS) == before + 2
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "0")
    want = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k2, **opts)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for seed in (3, 2 ** 40 + 1):  # dropout: one more entry, and each call's seed reaches the kernel
        drop = dict(opts, dropout_p=0.25, seed=seed)
        monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "0")
        want = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k, **drop)
        monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", FAST_LAUNCH_ON)
        got = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k, **drop)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), seed
    assert len(prepared._CALLS) == before + 3


def test_varlen_kernels_forward_then_backward(rng):
    """The forward kernel's (o, lse) feed the backward kernel as they come (lse (H, total_q)): the gradients match
    the NumPy varlen backward in float64."""
    from flashlab.kernels import flash_attention_varlen_backward
    from flashlab.varlen import flash_attention_varlen_backward as numpy_backward

    q, k, v, cu_q, cu_k = packed(rng, [9, 0, 14], [11, 5, 14], 4, 2, 16)
    do = rng.standard_normal(q.shape).astype(np.float32)
    opts = dict(causal=True, align="bottom_right", softcap=3.0)
    o, lse = kvarlen.flash_attention_varlen(q, k, v, cu_q, cu_k, block_q=8, block_k=8, **opts)
    got = flash_attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, **opts)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    o64, lse64 = numpy_varlen(*f64[:3], cu_q, cu_k, **opts)
    want = numpy_backward(*f64[:3], o64, lse64, f64[3], cu_q, cu_k, **opts)
    for g, w in zip(got, want):
        assert g.shape == w.shape and fl.relative_error(g, w) < 1e-4
