"""flashlab.fragments: the NumPy model of mma.sync fragments and of the tensor cores' number formats.

The maps are checked against the PTX ISA's formulas at sample lanes, and structurally (every element of
every operand held by exactly one (lane, element)); warp_mma against A @ B + C. A GPU test
(tests/test_tensor_kernel.py) checks the same model against the hardware.
"""
import numpy as np
import pytest

from flashlab import fragments as F

CASES = [("m16n8k16", "float16"), ("m16n8k16", "bfloat16"), ("m16n8k8", "float16"), ("m16n8k8", "tf32")]


@pytest.mark.parametrize("shape,dtype", CASES)
@pytest.mark.parametrize("operand", ["A", "B", "C"])
def test_every_element_is_held_by_exactly_one_lane(shape, dtype, operand):
    fmap = F.fragment_map(shape, operand, dtype)
    rows, cols = F.operand_shape(shape, operand)
    assert fmap.shape == (32, rows * cols // 32, 2)
    flat = fmap[..., 0] * cols + fmap[..., 1]
    assert sorted(flat.ravel().tolist()) == list(range(rows * cols))


def test_maps_follow_the_ptx_formulas():
    # lane 13: groupID g = 3, threadID_in_group t = 1
    a16 = F.fragment_map("m16n8k16", "A", "float16")[13]
    assert a16.tolist() == [[3, 2], [3, 3], [11, 2], [11, 3], [3, 10], [3, 11], [11, 10], [11, 11]]
    b16 = F.fragment_map("m16n8k16", "B", "bfloat16")[13]
    assert b16.tolist() == [[2, 3], [3, 3], [10, 3], [11, 3]]
    assert F.fragment_map("m16n8k8", "A", "float16")[13].tolist() == [[3, 2], [3, 3], [11, 2], [11, 3]]
    assert F.fragment_map("m16n8k8", "B", "float16")[13].tolist() == [[2, 3], [3, 3]]
    assert F.fragment_map("m16n8k8", "A", "tf32")[13].tolist() == [[3, 1], [11, 1], [3, 5], [11, 5]]
    assert F.fragment_map("m16n8k8", "B", "tf32")[13].tolist() == [[1, 3], [5, 3]]
    for shape, dtype in CASES:
        assert F.fragment_map(shape, "C", dtype)[13].tolist() == [[3, 2], [3, 3], [11, 2], [11, 3]]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_warp_mma_is_a_times_b_plus_c(rng, shape, dtype):
    M, N, K = F.SHAPES[shape]
    A, B = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    if dtype == "tf32":
        A, B = F.round_tf32(A), F.round_tf32(B)
    else:
        A, B = F.from_bits16(F.to_bits16(A, dtype), dtype), F.from_bits16(F.to_bits16(B, dtype), dtype)
    C = rng.standard_normal((M, N)).astype(np.float32)
    d = F.warp_mma(F.to_fragments(A, shape, "A", dtype), F.to_fragments(B, shape, "B", dtype),
                   F.to_fragments(C, shape, "C", dtype), shape, dtype)
    want = (A.astype(np.float64) @ B.astype(np.float64) + C).astype(np.float32)
    np.testing.assert_array_equal(F.from_fragments(d, shape, "C", dtype), want)


def test_a_tf32_mma_ignores_the_low_mantissa_bits(rng):
    A = rng.standard_normal((16, 8)).astype(np.float32)
    B = rng.standard_normal((8, 8)).astype(np.float32)
    frag = lambda X, op: F.to_fragments(X, "m16n8k8", op, "tf32")  # noqa: E731
    d = F.warp_mma(frag(A, "A"), frag(B, "B"), np.zeros((32, 4), np.float32), "m16n8k8", "tf32")
    want = F.truncate_tf32(A).astype(np.float64) @ F.truncate_tf32(B).astype(np.float64)
    np.testing.assert_array_equal(F.from_fragments(d, "m16n8k8", "C", "tf32"), want.astype(np.float32))


def test_round_tf32_is_nearest_ties_away_from_zero():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)  # tf32's unit in the last place at 1
    assert F.round_tf32(one + ulp / 2) == one + ulp  # a tie rounds away from zero
    assert F.round_tf32(-(one + ulp / 2)) == -(one + ulp)
    assert F.round_tf32(one + ulp / 2 - np.float32(2.0 ** -23)) == one  # just below the tie
    assert F.round_tf32(np.float32(np.inf)) == np.inf and np.isnan(F.round_tf32(np.float32(np.nan)))
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    r = F.round_tf32(x)
    assert np.all((r.view(np.uint32) & 0x1FFF) == 0)
    assert np.max(np.abs(r - x) / np.abs(x)) <= 2.0 ** -11


def test_split_tf32_keeps_about_fp32_precision(rng):
    x = rng.standard_normal(10000).astype(np.float32)
    big, small = F.split_tf32(x)
    for part in (big, small):
        assert np.all((part.view(np.uint32) & 0x1FFF) == 0)  # both are tf32 values
    rel = np.abs((big.astype(np.float64) + small) - x) / np.abs(x)
    assert rel.max() < 2.0 ** -21 and np.abs(big - x).max() / np.abs(x).max() > 2.0 ** -14


def test_bf16_and_f16_rounding_and_packing(rng):
    x = rng.standard_normal(1000).astype(np.float32) * 100
    for dtype, bits in (("float16", 11), ("bfloat16", 8)):
        back = F.from_bits16(F.to_bits16(x, dtype), dtype)
        assert np.max(np.abs(back - x) / np.abs(x)) <= 2.0 ** -bits
    assert F.from_bits16(F.to_bits16(np.float32(1 + 2.0 ** -8), "bfloat16"), "bfloat16") == 1.0  # tie to even
    assert F.from_bits16(F.to_bits16(np.float32(1 + 3 * 2.0 ** -8), "bfloat16"), "bfloat16") == 1 + 2.0 ** -6
    lo, hi = F.to_bits16(x[:10], "float16"), F.to_bits16(x[10:20], "float16")
    reg = F.pack16(lo, hi)
    assert reg.dtype == np.uint32
    np.testing.assert_array_equal(F.unpack16(reg)[0], lo)
    np.testing.assert_array_equal(F.unpack16(reg)[1], hi)
    # the low half is the lower-indexed element: a float16 pair in memory read as one little-endian word
    pair = np.array([1.5, -2.0], np.float16)
    assert pair.view(np.uint32)[0] == F.pack16(F.to_bits16(1.5, "float16"), F.to_bits16(-2.0, "float16"))


@pytest.mark.parametrize("call,match", [
    (lambda: F.fragment_map("m16n8k32", "A", "float16"), "shape must be one of"),
    (lambda: F.fragment_map("m16n8k16", "D", "float16"), "operand must be one of"),
    (lambda: F.fragment_map("m16n8k16", "A", "tf32"), "tf32 mma has shape m16n8k8"),
    (lambda: F.fragment_map("m16n8k8", "A", "float32"), "dtype must be one of"),
    (lambda: F.to_fragments(np.zeros((16, 8)), "m16n8k16", "A"), r"shape \(16, 16\)"),
    (lambda: F.from_fragments(np.zeros((32, 3)), "m16n8k16", "C"), r"have shape \(32, 4\)"),
    (lambda: F.to_bits16(1.0, "float32"), "'float16' or 'bfloat16'"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
