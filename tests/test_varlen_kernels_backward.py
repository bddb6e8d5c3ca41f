"""The register backward over a packed variable-length batch in one launch (kernels/varlen_backward.py),
in the simulator on tiny shapes, against flashlab.varlen's NumPy backward in float64."""
import numpy as np
import pytest

import flashlab as fl
from flashlab import varlen

pytest.importorskip("flashlab.kernels")
from flashlab.kernels.varlen_backward import flash_attention_varlen_backward, key_blocks  # noqa: E402

# Sequence 1 has no queries (its dK, dV are 0), sequence 2 no keys (its dQ is 0); the others have Nq != Nk.
LENS = ([5, 0, 12, 3], [9, 7, 0, 13])
CASES = [  # (H, H_kv, options)
    (2, 2, dict()),
    (2, 2, dict(causal=True)),
    (4, 2, dict(causal=True, align="bottom_right")),  # GQA
    (2, 2, dict(window_size=(4, 2), align="bottom_right")),
    (2, 1, dict(causal=True, alibi_slopes=np.array([[0.5, 0.25], [0.1, 0.2], [1.0, 0.3], [0.7, 0.05]]))),
    (2, 2, dict(softcap=1.5)),
    (2, 2, dict(dropout_p=0.3, seed=2**40 + 7)),
]


def packed_case(rng, H, H_kv, lens_q=LENS[0], lens_k=LENS[1], d=16, **opts):
    """Packed float64 inputs, the NumPy forward's o and lse, do, cu_seqlens and the NumPy gradients."""
    cq, ck = (np.concatenate([[0], np.cumsum(n)]) for n in (lens_q, lens_k))
    q = 2 * rng.standard_normal((cq[-1], H, d))
    k, v = (rng.standard_normal((ck[-1], H_kv, d)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    o, lse = varlen.flash_attention_varlen(q, k, v, cq, ck, **opts)
    want = varlen.flash_attention_varlen_backward(q, k, v, o, lse, do, cq, ck, **opts)
    return (q, k, v, o, lse, do), cq, ck, want


def check(got, want, cq, ck, tol):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == got[0].dtype, name
        assert fl.relative_error(g.astype(np.float64), w) < tol, name
    empty_q, empty_k = np.flatnonzero(np.diff(cq) == 0), np.flatnonzero(np.diff(ck) == 0)
    for b in empty_k:  # no keys: dQ exactly 0
        assert not got[0][cq[b]:cq[b + 1]].any()
    for b in empty_q:  # no queries: dK, dV exactly 0
        assert not got[1][ck[b]:ck[b + 1]].any() and not got[2][ck[b]:ck[b + 1]].any()


@pytest.mark.parametrize("H,H_kv,opts", CASES)
def test_one_launch_matches_numpy(rng, H, H_kv, opts):
    args, cq, ck, want = packed_case(rng, H, H_kv, **opts)
    f32 = [x.astype(np.float32) for x in args]
    got = flash_attention_varlen_backward(*f32, cq, ck, block_q=8, block_k=16, threads=32, **opts)
    check(got, want, cq, ck, 1e-4)


def test_float16_and_device_arrays(rng):
    """float16 inputs (dQ cast back to float16); numba device arrays in, cu_seqlens on the device too."""
    from flashlab.device import get_cuda

    cuda = get_cuda()
    opts = dict(causal=True, align="bottom_right")
    (q, k, v, o, lse, do), cq, ck, _ = packed_case(rng, 2, 1, **opts)
    q, k, v, o, do = (x.astype(np.float16) for x in (q, k, v, o, do))
    want = varlen.flash_attention_varlen_backward(*(x.astype(np.float64) for x in (q, k, v, o, lse, do)), cq, ck,
                                                  **opts)
    dev = [cuda.to_device(x) for x in (q, k, v, o, lse.astype(np.float32), do)]
    got = flash_attention_varlen_backward(*dev, cuda.to_device(cq.astype(np.int32)), ck, **opts)
    got = [g.copy_to_host() for g in got]
    assert all(g.dtype == np.float16 for g in got)
    check(got, want, cq, ck, 1e-2)


def test_key_blocks_heaviest_first():
    """Causal: key block j of a sequence visits its query blocks from the diagonal on, so the long sequence's
    first key blocks come first and blocks of a sequence without queries (nothing to visit) last."""
    cq, ck = np.array([0, 4, 4, 36]), np.array([0, 4, 20, 52])
    from flashlab._inputs import check_options

    opt = check_options((1, 1, 1, 16), causal=True)
    table = key_blocks(cq, ck, 8, 8, opt)
    assert table.tolist() == [[2, 0], [2, 8], [2, 16], [0, 0], [2, 24], [1, 0], [1, 8]]


def test_bad_inputs_name_the_argument(rng):
    (q, k, v, o, lse, do), cq, ck, _ = packed_case(rng, 2, 2, lens_q=[3, 4], lens_k=[2, 5])
    f32 = [x.astype(np.float32) for x in (q, k, v, o, lse, do)]
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0, never decrease .* got \[0, 4, 3, 7\]"):
        flash_attention_varlen_backward(*f32, np.array([0, 4, 3, 7]), np.array([0, 2, 3, 7]))
    with pytest.raises(ValueError, match="same number of sequences; got 2 and 3"):
        flash_attention_varlen_backward(*f32, cq, np.array([0, 2, 3, 7]))
    with pytest.raises(ValueError, match="end at 7 .*got \\[0, 2, 6\\]"):  # a length that disagrees with k
        flash_attention_varlen_backward(*f32, cq, np.array([0, 2, 6]))
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 7\)"):
        flash_attention_varlen_backward(*f32[:4], f32[4].T, f32[5], cq, ck)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence \\(4\\)"):
        flash_attention_varlen_backward(*f32, cq, ck, max_seqlen_q=3)
    with pytest.raises(TypeError, match="float32 or float16"):
        flash_attention_varlen_backward(q, k, v, o, lse, do, cq, ck)


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_one_launch_matches_numpy_on_gpu(rng, d):
    """GPU-sized: the default tiles, sequences of many blocks (one empty of each kind), float32 and float16."""
    lens = ([0, 300, 77, 512], [129, 300, 0, 380])  # 4 sequences, as CASES' per-batch ALiBi slopes
    for H, H_kv, opts in CASES:
        args, cq, ck, want = packed_case(rng, H, H_kv, *lens, d=d, **opts)
        for dt, tol in ((np.float32, 1e-4), (np.float16, 1e-2)):
            x = [a.astype(np.float32 if i == 4 else dt) for i, a in enumerate(args)]  # lse stays float32
            # float16: against the float64 gradients of the rounded inputs
            w = want if dt == np.float32 else varlen.flash_attention_varlen_backward(
                *(a.astype(np.float64) for a in x), cq, ck, **opts)
            check(flash_attention_varlen_backward(*x, cq, ck, **opts), w, cq, ck, tol)


@pytest.mark.gpu
@gpu
def test_torch_tensors_on_gpu(rng):
    """torch CUDA tensors in (cu_seqlens too), torch tensors of the input dtype out, no copies of the inputs."""
    torch = pytest.importorskip("torch")
    opts = dict(causal=True, align="bottom_right")
    args, cq, ck, _ = packed_case(rng, 4, 2, [0, 300, 77, 512], [129, 300, 0, 380], d=64, **opts)
    x = [a.astype(np.float32 if i == 4 else np.float16) for i, a in enumerate(args)]
    want = varlen.flash_attention_varlen_backward(*(a.astype(np.float64) for a in x), cq, ck, **opts)
    t = [torch.from_numpy(a).cuda() for a in x]
    cu = [torch.from_numpy(c.astype(np.int32)).cuda() for c in (cq, ck)]
    got = flash_attention_varlen_backward(*t, *cu, **opts)
    assert all(isinstance(g, torch.Tensor) and g.is_cuda and g.dtype == torch.float16 for g in got)
    check([g.cpu().numpy() for g in got], want, cq, ck, 1e-2)
