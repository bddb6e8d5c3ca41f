"""variant="tensor" and its warp-level instructions: in the CUDA simulator (CI) and on a GPU (marked gpu).

In the simulator every mma, ldmatrix and shfl_xor runs flashlab's warp-collective emulation; on a GPU the
real instructions. The same tests check both: each instruction against NumPy from per-lane fragments laid
out by flashlab.fragments (on a GPU this checks the fragment model against the hardware), and the whole
kernel against float64 attention. Simulator shapes are tiny (one or two warps, a few blocks).
"""
import numpy as np
import pytest

import flashlab as fl
from flashlab import fragments as F
from flashlab.device import get_cuda, has_gpu

kernels = pytest.importorskip("flashlab.kernels")
from flashlab.kernels import flash_attention, mma, tensor  # noqa: E402
from flashlab.kernels.tensor import TensorTile  # noqa: E402

cuda = get_cuda()
gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
DT16 = {"f16": "float16", "k8": "float16", "bf16": "bfloat16"}
# o tolerances (relative error against float64 on the inputs as the kernel sees them): 16-bit outputs are
# rounded (~2.4e-4 for float16, ~2e-3 for bfloat16) and so is P; a dropped rescale or a shifted mask is off
# by far more. lse is computed in fp32 from exact 16-bit products.
TOL = {"f16": 2e-3, "k8": 2e-3, "bf16": 1e-2, "3xtf32": 1e-5, "tf32": 5e-3}
LSE_TOL = {"f16": 1e-5, "k8": 1e-5, "bf16": 1e-5, "3xtf32": 1e-5, "tf32": 1e-3}


# --------------------------------------------------------------------- one instruction at a time
@cuda.jit
def _mma_k16(out, a, b, c, which):
    lane = cuda.threadIdx.x
    if which == 0:
        r = mma.mma_f16_m16n8k16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                                 c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    elif which == 1:
        r = mma.mma_bf16_m16n8k16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                                  c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    else:
        r = mma.mma_f16_m16n8k8x2(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                                  c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        out[lane, i] = r[i]


@cuda.jit
def _mma_k8(out, a, b, c):
    lane = cuda.threadIdx.x
    r = mma.mma_f16_m16n8k8(a[lane, 0], a[lane, 1], b[lane, 0], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        out[lane, i] = r[i]


@cuda.jit
def _mma_tf32(out, a, b, c):
    lane = cuda.threadIdx.x
    r = mma.mma_tf32_m16n8k8(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                             c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        out[lane, i] = r[i]


def _registers(frags, dtype):
    """Per-lane 32-bit registers from per-lane elements: 16-bit values packed in pairs (low = first)."""
    if dtype == "tf32":
        return np.ascontiguousarray(frags, np.float32)
    bits = F.to_bits16(frags, dtype)
    return np.ascontiguousarray(F.pack16(bits[:, 0::2], bits[:, 1::2]))


def _random_operands(rng, shape, dtype):
    M, N, K = F.SHAPES[shape]
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    if dtype == "tf32":  # the kernel passes tf32 values (rounded by cvt.rna)
        A, B = F.round_tf32(A), F.round_tf32(B)
    else:
        A, B = (F.from_bits16(F.to_bits16(X, dtype), dtype) for X in (A, B))
    return A, B, rng.standard_normal((M, N)).astype(np.float32)


@pytest.mark.parametrize("name,shape,dtype", [("f16", "m16n8k16", "float16"), ("bf16", "m16n8k16", "bfloat16"),
                                              ("k8x2", "m16n8k16", "float16"), ("k8", "m16n8k8", "float16"),
                                              ("tf32", "m16n8k8", "tf32")])
def test_one_mma_equals_numpy_from_the_same_fragments(rng, name, shape, dtype):
    A, B, C = _random_operands(rng, shape, dtype)
    a = _registers(F.to_fragments(A, shape, "A", dtype), dtype)
    b = _registers(F.to_fragments(B, shape, "B", dtype), dtype)
    c = np.ascontiguousarray(F.to_fragments(C, shape, "C", dtype))
    out = np.full((32, 4), np.nan, np.float32)  # poisoned: every lane must write its 4 results
    if name == "k8":
        _mma_k8[1, 32](out, a, b, c)
    elif name == "tf32":
        _mma_tf32[1, 32](out, a, b, c)
    else:
        _mma_k16[1, 32](out, a, b, c, {"f16": 0, "bf16": 1, "k8x2": 2}[name])
    D = F.from_fragments(out, shape, "C", dtype)
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    # exact products; the hardware's fp32 summation order is its own: a few fp32 ulps of the largest term
    np.testing.assert_allclose(D, want, rtol=0, atol=1e-5 * np.abs(want).max())


@cuda.jit
def _ldmatrix(out, shared_in, row_words, trans):
    sh = cuda.shared.array(256, np.uint32)
    lane = cuda.threadIdx.x
    for i in range(8):
        sh[lane * 8 + i] = shared_in[lane * 8 + i]
    cuda.syncthreads()
    start = np.intp(lane * row_words)  # lane 8m + r points at row r of matrix m
    r = mma.ldmatrix_x4_trans(sh, start) if trans else mma.ldmatrix_x4(sh, start)
    for i in range(4):
        out[lane, i] = r[i]


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_gives_each_lane_its_fragment(rng, trans):
    halves = rng.integers(0, 2**16, size=(32, 8), dtype=np.uint16)  # 32 rows of 8 16-bit values
    words = F.pack16(halves[:, 0::2], halves[:, 1::2])  # (32, 4): rows stored 8 words apart
    shared = np.zeros((32, 8), np.uint32)
    shared[:, :4] = words
    out = np.zeros((32, 4), np.uint32)
    _ldmatrix[1, 32](out, shared.ravel(), 8, trans)
    for m in range(4):
        M = halves[8 * m:8 * m + 8]  # matrix m: rows given by lanes 8m .. 8m+7
        if trans:
            M = M.T
        lane = np.arange(32)
        want = F.pack16(M[lane // 4, 2 * (lane % 4)], M[lane // 4, 2 * (lane % 4) + 1])
        np.testing.assert_array_equal(out[:, m], want, err_msg=f"matrix {m}")


@cuda.jit
def _copies(out, src, flat):
    sh = cuda.shared.array(128, np.uint32)
    lane = cuda.threadIdx.x
    view = src[:, 1]  # rows of 8 words, 3 * 8 words apart in memory: a strided view, as varlen's K and V
    row, col = lane // 2, (lane % 2) * 4
    ok = row < 12  # a tile of 16 rows from row 4: its last 4 rows are past the end, zero-filled
    if flat:  # base: the tile's first element; rows past the end read the tile's first row, with 0 bytes
        offset = row * (view.strides[0] // 4) + col if ok else col
        mma.cp_async16_flat(sh, lane * 4, view, 4 * (view.strides[0] // 4), np.uint32(offset), 16 if ok else 0)
    else:
        mma.cp_async16(sh, lane * 4, view, 4 + row if ok else 4, col, 16 if ok else 0)
    mma.cp_async_commit()
    mma.cp_async_wait(0)
    cuda.syncthreads()
    for i in range(4):
        out[lane * 4 + i] = sh[lane * 4 + i]


@pytest.mark.parametrize("flat", [False, True])
def test_cp_async_copies_rows_of_a_strided_view(rng, flat):
    src = rng.integers(0, 2**32, size=(16, 3, 8), dtype=np.uint32)
    out = np.full(128, 7, np.uint32)
    _copies[1, 32](out, src, flat)
    want = np.zeros((16, 8), np.uint32)
    want[:12] = src[4:, 1]
    np.testing.assert_array_equal(out.reshape(16, 8), want)


@pytest.mark.skipif(has_gpu(), reason="the simulator's emulation checks the offset; a GPU copies what it is given")
def test_cp_async16_flat_refuses_an_offset_across_rows():
    src = np.zeros((4, 8), np.uint32)
    with pytest.raises(ValueError, match="not 4 elements inside one row"):
        mma.cp_async16_flat(np.zeros(8, np.uint32), 0, src, 4, 2, 16)
    with pytest.raises(ValueError, match="does not fit in 32 bits"):  # the GPU would drop the high bits
        mma.cp_async16_flat(np.zeros(8, np.uint32), 0, src, 0, 2**32, 16)


@cuda.jit
def _votes(out, flags):
    lane = cuda.threadIdx.x
    out[lane] = mma.vote_any(flags[lane] != 0)


@pytest.mark.parametrize("pattern", ["none", "one", "all"])
def test_vote_any_tells_every_lane_whether_any_lane_is_true(pattern):
    flags = np.zeros(64, np.int32)  # two warps: the second's votes must not see the first's flags
    if pattern == "one":
        flags[13] = 1
    if pattern == "all":
        flags[:32] = 1
    out = np.full(64, 7, np.int32)
    _votes[1, 64](out, flags)
    want = np.repeat([flags[:32].any(), flags[32:].any()], 32).astype(np.int32)
    np.testing.assert_array_equal(out, want)


@cuda.jit
def _helpers(out_bits, out_f, x, y):
    lane = cuda.threadIdx.x
    out_bits[lane, 0] = mma.pack_f16x2(x[lane], y[lane])
    out_bits[lane, 1] = mma.pack_bf16x2(x[lane], y[lane])
    out_f[lane, 0] = mma.round_tf32(x[lane])
    out_f[lane, 1] = mma.shfl_xor(x[lane], 5)


def test_pack_round_and_shuffle_match_numpy(rng):
    x = (rng.standard_normal(32) * 10).astype(np.float32)
    y = (rng.standard_normal(32) * 10).astype(np.float32)
    bits, f = np.zeros((32, 2), np.uint32), np.zeros((32, 2), np.float32)
    _helpers[1, 32](bits, f, x, y)
    for col, dtype in ((0, "float16"), (1, "bfloat16")):
        np.testing.assert_array_equal(bits[:, col], F.pack16(F.to_bits16(x, dtype), F.to_bits16(y, dtype)))
    np.testing.assert_array_equal(f[:, 0], F.round_tf32(x))
    np.testing.assert_array_equal(f[:, 1], x[np.arange(32) ^ 5])


@cuda.jit
def _shuffle_some(out, x, lo, hi):
    t = cuda.threadIdx.x
    if t % 32 < lo or t % 32 >= hi:  # these lanes leave before the warp instruction
        return
    out[t] = mma.shfl_xor(x[t], 1)


sim_only = pytest.mark.skipif(has_gpu(), reason="checks the simulator's emulation of warp instructions")


@sim_only
@pytest.mark.parametrize("lo,hi", [(8, 32), (0, 24)])
def test_simulator_reports_lanes_that_leave_before_a_warp_instruction(lo, hi):
    """A learner's early return: the emulation names it within seconds, whether the lanes that left were started
    before the waiting ones (lo > 0) or after them (hi < 32: only the quiet start loop tells them apart from lanes
    not started yet)."""
    import time

    x, out = np.arange(32, dtype=np.float32), np.zeros(32, np.float32)
    start = time.monotonic()
    with pytest.raises(mma.WarpDivergence, match="waited for the other lanes"):
        _shuffle_some[1, 32](out, x, lo, hi)
    assert time.monotonic() - start < 20


@sim_only
def test_simulator_waits_for_every_lane_of_a_big_block():
    """Eight warps: the simulator starts 256 threads one by one while the first lanes already wait."""
    x, out = np.arange(256, dtype=np.float32), np.zeros(256, np.float32)
    _shuffle_some[1, 256](out, x, 0, 32)
    np.testing.assert_array_equal(out, x[np.arange(256) ^ 1])


@cuda.jit
def _unpack(out, bits):
    lane = cuda.threadIdx.x
    out[lane, 0], out[lane, 1] = mma.unpack_f16x2(bits[lane, 0])
    out[lane, 2], out[lane, 3] = mma.unpack_bf16x2(bits[lane, 1])


def test_unpack_is_the_inverse_of_pack(rng):
    """unpack_*x2 (the tensor backward's D = rowsum(dO * O) reads 16-bit pairs) against NumPy's decoding."""
    x, y = ((rng.standard_normal(32) * 10).astype(np.float32) for _ in range(2))
    bits = np.stack([F.pack16(F.to_bits16(x, dt), F.to_bits16(y, dt)) for dt in ("float16", "bfloat16")], 1)
    out = np.zeros((32, 4), np.float32)
    _unpack[1, 32](out, np.ascontiguousarray(bits, np.uint32))
    for col, dt in ((0, "float16"), (2, "bfloat16")):
        np.testing.assert_array_equal(out[:, col], F.from_bits16(F.to_bits16(x, dt), dt))
        np.testing.assert_array_equal(out[:, col + 1], F.from_bits16(F.to_bits16(y, dt), dt))


@cuda.jit
def _early_exit(out, a):
    lane = cuda.threadIdx.x
    if lane == 3:
        return  # a lane that skips the warp instruction
    r = mma.mma_f16_m16n8k8(a[lane], a[lane], a[lane], 0.0, 0.0, 0.0, 0.0)
    out[lane] = r[0]


@pytest.mark.skipif(has_gpu(), reason="the simulator's check; on a GPU this is undefined behaviour")
def test_simulator_names_a_lane_that_skips_a_warp_instruction():
    with pytest.raises(Exception, match="must be executed by all 32 lanes"):
        _early_exit[1, 32](np.zeros(32, np.float32), np.zeros(32, np.uint32))


# ----------------------------------------------------------------------------- the whole kernel
def rand_qkv(rng, B, H, nq, nk, d, logit=1.0):
    q = rng.standard_normal((B, H, nq, d)) * logit
    return q, rng.standard_normal((B, H, nk, d)), rng.standard_normal((B, H, nk, d))


def run_tensor(q, k, v, causal, precision, tile):
    """Launch tensor.launch on NumPy inputs, 16-bit ones as packed bits (the only way to feed bfloat16
    without torch). Returns (o, lse, (q, k, v) as the kernel saw them, in float64)."""
    B, H, nq, d = q.shape
    if precision in DT16:
        dt = DT16[precision]
        bits = [F.to_bits16(x, dt) for x in (q, k, v)]
        args = [np.ascontiguousarray(x).view(np.uint32) for x in bits]
        seen = [F.from_bits16(x, dt).astype(np.float64) for x in bits]
        o = np.zeros((B, H, nq, d // 2), np.uint32)
    else:
        args = [np.ascontiguousarray(x, np.float32) for x in (q, k, v)]
        seen = [x.astype(np.float64) for x in args]
        o = np.full((B, H, nq, d), np.nan, np.float32)
    lse = np.full((B, H, nq), np.nan, np.float32)
    tensor.launch(*args, o, lse, H, 1 / np.sqrt(d), causal, tile, precision)
    if precision in DT16:
        o = F.from_bits16(o.view(np.uint16), DT16[precision])
    return o, lse, seen


def check(o, lse, seen, causal, precision):
    ro, rl = fl.reference_attention(*seen, causal=causal)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse)), "unwritten or non-finite outputs"
    err, lerr = fl.relative_error(o, ro), fl.relative_error(lse, rl)
    assert err < TOL[precision], f"{precision}: o relative error {err:.2e}"
    assert lerr < LSE_TOL[precision], f"{precision}: lse relative error {lerr:.2e}"


# (precision, nq, nk, d, causal, tile, logit)
SIM_CASES = [
    ("f16", 17, 14, 32, False, TensorTile(2, 16), 1.0),  # ragged Nq != Nk, one block
    ("f16", 40, 33, 16, True, TensorTile(2, 32), 1.0),  # causal, Nq > Nk, a warp skips a tile
    ("bf16", 21, 37, 32, True, TensorTile(1, 16), 1.0),  # bfloat16, causal, Nq < Nk
    ("k8", 20, 1, 16, True, TensorTile(1, 16), 1.0),  # the sm_75 build; one key
    ("3xtf32", 1, 9, 16, False, TensorTile(1, 16), 1.0),  # N = 1
    ("3xtf32", 37, 21, 16, True, TensorTile(2, 16), 1.0),  # fp32 accuracy, causal, Nq > Nk
    ("3xtf32", 9, 40, 16, False, TensorTile(1, 32), 30.0),  # huge logits (scores ~ 1e2)
    ("f16", 9, 40, 16, True, TensorTile(1, 16), 8.0),  # large logits in float16
    ("tf32", 19, 40, 16, False, TensorTile(1, 16), 1.0),  # one tf32 pass: ~1e-3; 3 key tiles (copies after compute)
    # two m-tiles per warp: each K / V fragment read feeds both
    ("f16", 45, 37, 32, True, TensorTile(1, 16, m_tiles=2), 1.0),  # causal, Nq > Nk, rows past Nq in m-tile 2
    ("bf16", 19, 50, 16, False, TensorTile(2, 32, m_tiles=2), 1.0),  # one block of 64 rows, ragged
    ("k8", 33, 20, 16, True, TensorTile(1, 16, m_tiles=2), 8.0),  # the sm_75 build, large logits, causal
]


@pytest.mark.parametrize("precision,nq,nk,d,causal,tile,logit", SIM_CASES)
def test_tensor_kernel_matches_float64(rng, precision, nq, nk, d, causal, tile, logit):
    q, k, v = rand_qkv(rng, 1, 2, nq, nk, d, logit)
    check(*run_tensor(q, k, v, causal, precision, tile), causal, precision)


def test_tf32_alone_is_less_accurate_than_3xtf32(rng):
    q, k, v = rand_qkv(rng, 1, 1, 16, 16, 16)
    errs = {}
    for precision in ("tf32", "3xtf32"):
        o, _, seen = run_tensor(q, k, v, False, precision, TensorTile(1, 16))
        errs[precision] = fl.relative_error(o, fl.reference_attention(*seen)[0])
    assert errs["3xtf32"] < 1e-6 < 1e-4 < errs["tf32"], errs


def test_public_api_float16_and_float32(rng):
    for dtype, precision in ((np.float16, None), (np.float32, None)):
        q, k, v = (x.astype(dtype) for x in rand_qkv(rng, 1, 1, 20, 19, 16))
        o, lse = flash_attention(q, k, v, causal=True, variant="tensor", block_q=16, block_k=16, precision=precision)
        assert o.dtype == dtype and o.shape == q.shape and lse.dtype == np.float32 and lse.shape == q.shape[:-1]
        check(o, lse, [x.astype(np.float64) for x in (q, k, v)], True, "f16" if dtype == np.float16 else "3xtf32")


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"precision": "tf32"}, ValueError, r"precision='tf32' does not apply to float16"),
    ({"precision": "bf16"}, ValueError, "use one of None, 'f16', 'k8'"),
    ({"block_q": 24}, ValueError, "block_q must be a positive multiple of 16"),
    ({"block_k": 8}, ValueError, "block_k must be a multiple of 16"),
    ({"block_k": 1024}, ValueError, "bytes of shared memory"),
    ({"tile": TensorTile()}, ValueError, "tile= configures the register kernel"),
])
def test_bad_arguments_are_named(rng, kwargs, exc, match):
    q = rng.standard_normal((1, 1, 4, 32)).astype(np.float16)
    with pytest.raises(exc, match=match):
        flash_attention(q, q, q, variant="tensor", **kwargs)


def test_bad_inputs_are_named(rng):
    q48 = rng.standard_normal((1, 1, 4, 48)).astype(np.float16)
    with pytest.raises(ValueError, match="d = 48 is not supported"):
        flash_attention(q48, q48, q48, variant="tensor")
    q64 = rng.standard_normal((1, 1, 4, 64))
    with pytest.raises(TypeError, match="float64; the tensor kernel takes float16, bfloat16 or float32"):
        flash_attention(q64, q64, q64, variant="tensor")
    with pytest.raises(ValueError, match="must have 4 dims"):
        flash_attention(q64[0].astype(np.float16), q64[0].astype(np.float16), q64[0].astype(np.float16),
                        variant="tensor")
    with pytest.raises(ValueError, match="precision applies to variant='tensor' only"):
        flash_attention(q64.astype(np.float32), q64.astype(np.float32), q64.astype(np.float32), precision="tf32")


def test_precision_follows_the_gpu_generation():
    assert tensor.resolve_precision("float16", None, (7, 5)) == "k8"
    assert tensor.resolve_precision("float16", None, (9, 0)) == "f16"
    assert tensor.resolve_precision("float32", None, (8, 0)) == "3xtf32"
    with pytest.raises(ValueError, match="bfloat16 mma, which needs compute capability 8.0; this GPU has 7.5"):
        tensor.resolve_precision("bfloat16", None, (7, 5))
    with pytest.raises(ValueError, match="tf32 mma, which needs compute capability 8.0"):
        tensor.resolve_precision("float32", "tf32", (7, 5))
    with pytest.raises(ValueError, match="use precision='k8'"):
        tensor.resolve_precision("float16", "f16", (7, 5))


# ------------------------------------------------------------------------------------------- GPU
GPU_NS = [1, 17, 128, 1000, 4096]


def _sdpa_error(q, k, v, causal, ref):
    import torch

    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fl.relative_error(o.float().cpu().numpy(), ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("n", GPU_NS)
def test_gpu_tensor_forward(rng, d, n):
    torch = pytest.importorskip("torch")
    from test_kernels import reference

    B, H = (1, 3) if n >= 1000 else (2, 3)
    nk = max(1, n - 3)
    for causal in (False, True):
        q, k, v = rand_qkv(rng, B, H, n, nk, d)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            tq, tk, tv = (torch.tensor(x, device="cuda", dtype=dtype) for x in (q, k, v))
            ref_o, ref_l = reference(*(x.double().cpu().numpy() for x in (tq, tk, tv)), causal)
            o, lse = flash_attention(tq, tk, tv, causal=causal, variant="tensor")
            assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == tq.shape
            err = fl.relative_error(o.float().cpu().numpy(), ref_o)
            lerr = fl.relative_error(lse.cpu().numpy(), ref_l)
            if dtype == torch.float32:
                assert err <= 1e-5, f"3xtf32 o error {err:.2e}"
            else:  # within what torch's own SDPA gets in the same dtype on the same inputs
                sdpa = _sdpa_error(tq, tk, tv, causal, ref_o)
                assert err <= 1.5 * sdpa + 5e-5, f"{dtype}: o error {err:.2e}, SDPA's {sdpa:.2e}"
            assert lerr <= 1e-5, f"{dtype}: lse error {lerr:.2e}"


@pytest.mark.gpu
@gpu
def test_gpu_tf32_precision_flag(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.float32) for x in rand_qkv(rng, 1, 2, 300, 297, 64))
    ref, _ = fl.reference_attention(*(x.double().cpu().numpy() for x in (q, k, v)))
    e1 = fl.relative_error(flash_attention(q, k, v, variant="tensor", precision="tf32")[0].cpu().numpy(), ref)
    e3 = fl.relative_error(flash_attention(q, k, v, variant="tensor", precision="3xtf32")[0].cpu().numpy(), ref)
    assert e3 <= 1e-5 and 1e-4 < e1 < 5e-3, (e1, e3)


@pytest.mark.gpu
@gpu
def test_gpu_cc75_build_uses_only_m16n8k8_and_runs_here(rng):
    from numba.cuda import compile_ptx

    kern = tensor.build(64, TensorTile(), True, "k8")
    ptx, _ = compile_ptx(kern.py_func, tensor.signature("k8"), cc=(7, 5), fastmath=True)
    assert ".target sm_75" in ptx and "mma.sync.aligned.m16n8k8" in ptx
    assert "m16n8k16" not in ptx and "bf16" not in ptx and "tf32" not in ptx
    q, k, v = rand_qkv(rng, 1, 2, 200, 197, 64)
    check(*run_tensor(q, k, v, True, "k8", TensorTile()), True, "k8")  # the same build, on this GPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [32, 64, 128])
def test_gpu_tensor_kernel_has_no_spills(d):
    # the planner compiles the kernel it would launch for this GPU and reads its registers and local memory
    from flashlab.kernels.plan import plan

    for dtype, precision in (("float16", "f16"), ("bfloat16", "bf16"), ("float32", "3xtf32")):
        for causal in (False, True):
            p = plan((1, 16, 1024, d), variant="tensor", dtype=dtype, causal=causal)
            assert p.precision == precision and p.registers_from == "the compiled kernel", p.explain()
            assert p.spill_bytes == 0 and p.registers <= 255, p.explain()


@pytest.mark.gpu
@gpu
def test_gpu_torch_tensors_in_and_out_without_copies():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flash_attention(q, k, v, variant="tensor")  # compile first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o, lse = flash_attention(q, k, v, variant="tensor")
    grown = torch.cuda.memory_allocated() - before
    assert o.dtype == torch.bfloat16 and o.is_cuda and lse.is_cuda
    assert grown <= o.numel() * 2 + lse.numel() * 4 + 4096, f"{grown} bytes: an input was copied"
    qt = q.transpose(-1, -2)  # last dim not contiguous: refused, not silently copied
    with pytest.raises(ValueError, match="last dim contiguous"):
        flash_attention(qt, qt, qt, variant="tensor")


def test_kernel_info_describes_the_tensor_tile():
    from flashlab.kernels import kernel_info

    info = kernel_info(64, variant="tensor", dtype=np.float16)
    tile = tensor.choose_tile(64, "f16")
    assert (info["precision"], info["block_q"], info["block_k"]) == ("f16", tile.block_q, tile.block_k)
    assert info["threads_per_block"] == tile.threads and info["shared_bytes_per_block"] == 4 * tile.shared_words(64, "f16")
    wide = kernel_info(128, variant="tensor")  # float32: 3xTF32, rows of d words
    assert wide["precision"] == "3xtf32" and wide["shared_bytes_per_block"] == 4 * tensor.choose_tile(
        128, "3xtf32").shared_words(128, "3xtf32")
    assert 0 < info["occupancy"] <= 1


def test_default_tiles_follow_the_spill_rule():
    """Two m-tiles per warp for 16-bit inputs where ptxas showed no spill (docs/runs/options-varlen-paged.md)."""
    ch = tensor.choose_tile
    assert ch(64, "f16") == TensorTile(4, 64, m_tiles=2) and ch(64, "bf16", causal=True) == TensorTile(4, 64, 2)
    assert ch(64, "f16", extras="light") == TensorTile(4, 64, m_tiles=2)  # one cheap option: no spill at 64
    assert ch(64, "f16", extras="heavy") == ch(64, "f16", extras=True) == TensorTile(4, 32, m_tiles=2)
    w = tensor.options_weight
    assert w(False, False, False, False) is False
    assert w(True, False, False, False) == w(False, True, False, False) == w(False, False, False, True) == "light"
    assert w(True, True, False, False) == "light"  # a window with softcap fits too
    assert w(False, False, True, False) == w(True, False, False, True) == w(False, True, False, True) == "heavy"
    assert ch(128, "f16") == TensorTile(8, 32, m_tiles=2) and ch(128, "f16").block_q == 256
    for kw in (dict(causal=True), dict(extras=True), dict(varlen=True)):  # where 8 x 2 m-tiles spilled
        assert ch(128, "f16", **kw).m_tiles == 1, kw
    assert ch(64, "3xtf32").m_tiles == 1 and ch(64, "k8").m_tiles == 1
    assert ch(64, "f16", block_q=64) == TensorTile(4, 32)  # a given block_q: one m-tile per warp
    with pytest.raises(ValueError, match="m_tiles=2: the float32 precisions keep one m-tile"):
        TensorTile(1, 16, m_tiles=2).check(16, "3xtf32")
    with pytest.raises(ValueError, match="m_tiles must be a positive integer"):
        TensorTile(1, 16, m_tiles=0).check(16, "f16")


def test_row_strides_beyond_32_bit_tile_offsets_are_refused():
    """The tensor kernels address a tile's rows with 32-bit offsets: a view whose rows are 2^22 words apart or
    more is refused with its name and stride, not read at the wrong place (to_device_words checks every input's
    row axis; NumPy inputs are made contiguous, so only torch and numba views can have such strides)."""
    from flashlab.kernels._launch import MAX_ROW_STRIDE, check_row_stride, to_device_words

    check_row_stride("k", MAX_ROW_STRIDE - 1)
    with pytest.raises(ValueError, match=r"k: consecutive rows \(the N axis .* 4194304 32-bit words apart"):
        check_row_stride("k", MAX_ROW_STRIDE)
    with pytest.raises(ValueError, match=r"the total axis of \(total, H, d\)"):
        check_row_stride("q", 2**23, "(total, H, d)")
    words, _, dtype = to_device_words(np.zeros((1, 2, 8, 4), np.float16), "q")
    assert dtype == "float16" and words.shape == (1, 2, 8, 2)
