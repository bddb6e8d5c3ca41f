"""Lesson 15's exercises (tensor cores, the instruction: the fragment map, a warp's mma, the tf32 split, 3xTF32):
each checker passes the solution, grades the blank "not implemented", and rejects kept wrong solutions for several
seeds, naming the slip. The checker's own statement of the fragment layouts is checked against flashlab.fragments.
"""
import math

import numpy as np

from conftest import load_exercise
from exercise_harness import Lesson
from flashlab import fragments as F
from flashlab.grading import l15_tensor_cores as G

LESSON = Lesson("15_tensor_cores")
STEM = LESSON.stem
SOLUTIONS = load_exercise(STEM)
mutant, alternative = LESSON.mutant, LESSON.alternative

# -- 1: the fragment map -------------------------------------------------------------------------
_right = SOLUTIONS["fragment_position"]


@mutant("fragment_position", "row and column are swapped")
def position_b_transposed(layout, operand, lane, i):
    """B read as N x K: (g, 2t ...) instead of (2t ..., g)"""
    r, c = _right(layout, operand, lane, i)
    return (c, r) if operand == "B" else (r, c)


@mutant("fragment_position", "g and t are swapped")
def position_g_t_swapped(layout, operand, lane, i):
    """g = lane % 4, t = lane // 4"""
    g, t = lane % 4, lane // 4
    if operand == "C":
        return g + 8 * (i // 2), 2 * t + i % 2
    if layout == "f16":
        if operand == "A":
            return g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)
        return 2 * t + i % 2 + 8 * (i // 2), g
    if operand == "A":
        return g + 8 * (i % 2), t + 4 * (i // 2)
    return t + 4 * i, g


@mutant("fragment_position", "wrong order")
def position_plus8_on_wrong_elements(layout, operand, lane, i):
    """f16 A: the +8 columns before the +8 rows (a2, a3 swapped with a4, a5)"""
    if layout == "f16" and operand == "A":
        i = {2: 4, 3: 5, 4: 2, 5: 3}.get(i, i)
    return _right(layout, operand, lane, i)


@mutant("fragment_position", "wrong order")
def position_tf32_a1_a2_swapped(layout, operand, lane, i):
    """tf32 A: a1 at (g, t + 4) and a2 at (g + 8, t)"""
    if layout == "tf32" and operand == "A":
        i = {1: 2, 2: 1}.get(i, i)
    return _right(layout, operand, lane, i)


@mutant("fragment_position", "is held by")
def position_c_columns_t(layout, operand, lane, i):
    """C columns t and t + 1 instead of 2t and 2t + 1"""
    r, c = _right(layout, operand, lane, i)
    return (r, c - lane % 4) if operand == "C" else (r, c)


# -- 2: a warp's mma -----------------------------------------------------------------------------
def _elements(regs, swap=False):
    halves = np.stack([regs >> 16, regs & 0xFFFF] if swap else [regs & 0xFFFF, regs >> 16], axis=-1)
    return halves.astype(np.uint16).view(np.float16).reshape(32, -1).astype(np.float64)


def _matrices(a, b, c, swap=False):
    A = F.from_fragments(_elements(a, swap), "m16n8k16", "A")
    B = F.from_fragments(_elements(b), "m16n8k16", "B")  # (swapping B's halves too would not change A B)
    return A, B, F.from_fragments(np.asarray(c, np.float64), "m16n8k16", "C")


@mutant("warp_mma", "halves of each register are swapped")
def mma_halves_swapped(a, b, c):
    """A's high 16 bits read as the lower-numbered element"""
    A, B, C = _matrices(a, b, c, swap=True)
    return F.to_fragments((A @ B + C).astype(np.float32), "m16n8k16", "C")


@mutant("warp_mma", "accumulator C is added")
def mma_without_c(a, b, c):
    """D = A B, C forgotten"""
    A, B, _ = _matrices(a, b, c)
    return F.to_fragments((A @ B).astype(np.float32), "m16n8k16", "C")


@mutant("warp_mma", "wrong places")
def mma_row_major_out(a, b, c):
    """D handed back in row-major order, not as C fragments"""
    A, B, C = _matrices(a, b, c)
    return (A @ B + C).astype(np.float32).reshape(32, 4)


@mutant("warp_mma", "float32")
def mma_float16_accumulator(a, b, c):
    """accumulates in float16"""
    A, B, C = _matrices(a, b, c)
    D = (A.astype(np.float16) @ B.astype(np.float16) + C.astype(np.float16)).astype(np.float32)
    return F.to_fragments(D, "m16n8k16", "C")


# -- 3: the tf32 split ---------------------------------------------------------------------------
def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _round(x, add=0x1000, mask=0xFFFFE000):
    return ((_bits(x) + np.uint32(add)) & np.uint32(mask)).view(np.float32)


@mutant("split_tf32", "truncates")
def split_truncated(x):
    """big = x with the low 13 bits cleared"""
    big = (_bits(x) & np.uint32(0xFFFFE000)).view(np.float32)
    return big, (_bits(x - big) & np.uint32(0xFFFFE000)).view(np.float32)


@mutant("split_tf32", "ties to even")
def split_ties_to_even(x):
    """round half to even"""
    def rne(v):
        b = _bits(v).astype(np.uint64)
        return ((b + 0xFFF + ((b >> 13) & 1)) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    big = rne(x)
    return big, rne(x - big)


@mutant("split_tf32", "round it to tf32 as well")
def split_small_not_rounded(x):
    """small = x - big, not rounded"""
    big = _round(x)
    return big, (x - big).astype(np.float32)


@mutant("split_tf32", "tf32 keeps 10")
def split_twelve_bits(x):
    """clears 12 bits (keeps 11 stored mantissa bits)"""
    big = _round(x, 0x800, 0xFFFFF000)
    return big, _round(x - big, 0x800, 0xFFFFF000)


# -- 4: 3xTF32 -----------------------------------------------------------------------------------
_split = SOLUTIONS["split_tf32"]


def _zeros(A, B):
    return np.zeros((A.shape[0], B.shape[1]), np.float32)


@mutant("matmul_3xtf32", "small(A) x big(B) is missing")
def three_without_small_a(A, B, mma):
    """drops small(A) x big(B)"""
    (Ab, _), (Bb, Bs) = _split(A), _split(B)
    return mma(Ab, Bb, mma(Ab, Bs, _zeros(A, B)))


@mutant("matmul_3xtf32", "1xTF32")
def one_product(A, B, mma):
    """one tf32 product of the rounded inputs"""
    return mma(_split(A)[0], _split(B)[0], _zeros(A, B))


@mutant("matmul_3xtf32", "small x small")
def big_big_and_small_small(A, B, mma):
    """big x big + small x small"""
    (Ab, As), (Bb, Bs) = _split(A), _split(B)
    return mma(Ab, Bb, mma(As, Bs, _zeros(A, B)))


@mutant("matmul_3xtf32", "not a tf32 value")
def unsplit_input(A, B, mma):
    """passes the float32 inputs to mma as they are"""
    return mma(A, B, _zeros(A, B))


@mutant("matmul_3xtf32", "never called mma")
def no_tensor_core(A, B, mma):
    """multiplies in float64, no tensor core"""
    return (A.astype(np.float64) @ B.astype(np.float64)).astype(np.float32)


# -- 5: a tensor core's truncating sum ------------------------------------------------------------------------
_tc = SOLUTIONS["tc_accumulate"]


def _f64(a, b, c):
    return (np.asarray(x, np.float64) for x in (a, b, c))


@mutant("tc_accumulate", "rounded once to nearest")
def tc_round_once(a, b, c):
    """the exact sum rounded once to float32"""
    a, b, c = _f64(a, b, c)
    return (a @ b + c).astype(np.float32)


@mutant("tc_accumulate", "one at a time in float32")
def tc_fp32_adds(a, b, c):
    """c + a0 b0 + a1 b1 + ... in float32"""
    d = np.array(c, np.float32)
    for k in range(a.shape[1]):
        d = d + np.outer(a[:, k], b[k]).astype(np.float32)
    return d


@mutant("tc_accumulate", "truncated only the final sum")
def tc_final_cut_only(a, b, c):
    """exact sum, then cut to 24 bits"""
    a, b, c = _f64(a, b, c)
    s = a @ b + c
    q = np.ldexp(1.0, np.frexp(s)[1] - 24)
    return (np.trunc(s / q) * q).astype(np.float32)


@mutant("tc_accumulate", "the sum is rounded to nearest")
def tc_sum_rounded(a, b, c):
    """terms cut, the sum rounded by astype(np.float32)"""
    return G.tc_model(a, b, c, final="nearest")


@mutant("tc_accumulate", "aligned the terms to c's exponent")
def tc_align_to_c(a, b, c):
    """every term cut at C's last bit"""
    return G.tc_model(a, b, c, align="c")


@mutant("tc_accumulate", "c is a term too")
def tc_align_to_products(a, b, c):
    """the largest product sets the exponent, C left out"""
    return G.tc_model(a, b, c, align="products")


@mutant("tc_accumulate", "toward minus infinity")
def tc_floor(a, b, c):
    """np.floor for np.trunc"""
    return G.tc_model(a, b, c, rounding=np.floor)


@mutant("tc_accumulate", "23 significant bits")
def tc_23_bits(a, b, c):
    """multiples of 2**(e - 22)"""
    return G.tc_model(a, b, c, bits=23)


@mutant("tc_accumulate", "rounded each cut to nearest")
def tc_rint(a, b, c):
    """np.rint for np.trunc: rounds to nearest instead of truncating"""
    return G.tc_model(a, b, c, rounding=np.rint)


@mutant("tc_accumulate", "the model gives")
def tc_float32_sum(a, b, c):
    """terms cut right, then summed in float32"""
    a, b, c = _f64(a, b, c)
    terms = np.concatenate([c[:, None, :], a[:, :, None] * b[None, :, :]], axis=1)
    e = G.exponent(np.abs(terms).max(axis=1))[:, None, :]
    s = G.cut(terms, e).astype(np.float32).sum(axis=1, dtype=np.float32).astype(np.float64)
    return G.cut(s, G.exponent(s)).astype(np.float32)


@alternative("tc_accumulate")
def tc_with_integers(a, b, c):
    """element by element in Python integers: int() truncates toward zero"""
    m, k = a.shape
    out = np.zeros(c.shape, np.float32)
    for i in range(m):
        for j in range(c.shape[1]):
            terms = [float(c[i, j])] + [float(a[i, l]) * float(b[l, j]) for l in range(k)]
            big = max(abs(x) for x in terms)
            if big == 0:
                continue
            e = math.frexp(big)[1] - 1
            total = sum(int(math.ldexp(x, 23 - e)) for x in terms)  # in units of 2**(e - 23)
            if total:
                drop = max(0, abs(total).bit_length() - 24)  # bits past 24 significant ones
                total = int(total / 2 ** drop) if drop else total
                out[i, j] = math.ldexp(total, e - 23 + drop)
    return out


@alternative("tc_accumulate")
def tc_with_log2(a, b, c):
    """exponents from np.floor(np.log2(...)), cuts with np.fix"""
    a, b, c = _f64(a, b, c)
    terms = np.concatenate([c[:, None, :], np.einsum("ik,kj->ikj", a, b)], axis=1)

    def grid(x):  # the last bit of 24 significant bits led by x's first bit
        with np.errstate(divide="ignore"):
            e = np.where(x != 0, np.floor(np.log2(np.abs(x))), 0.0)
        return 2.0 ** (e - 23)

    q = grid(np.abs(terms).max(axis=1, keepdims=True))
    s = (np.fix(terms / q) * q).sum(axis=1)
    return (np.fix(s / grid(s)) * grid(s)).astype(np.float32)


def test_the_model_is_the_lessons():
    """The checker's model is the truncating sum of the lesson's figure (flashlab.viz.tensor)."""
    from flashlab.viz import tensor as tviz

    rng = np.random.default_rng(2)
    for _ in range(20):
        a = F.round_tf32(rng.standard_normal((16, 8)) * np.ldexp(1.0, rng.integers(-12, 12, (16, 8))))
        b = F.round_tf32(rng.standard_normal((8, 8)).astype(np.float32))
        c = rng.standard_normal((16, 8)).astype(np.float32)
        products = a.astype(np.float64)[:, :, None] * b.astype(np.float64)[None]
        np.testing.assert_array_equal(G.tc_model(a, b, c), tviz._tc_add(c.astype(np.float64), products))


def test_every_slip_is_told_apart():
    """On the checker's cases, each named slip differs from the model and from every other slip (so a verdict can
    name it), for several seeds."""
    from flashlab.grading.core import EXERCISES, Checker

    for seed in range(5):
        cases = G._tc_cases(Checker(EXERCISES["tc_accumulate"], None, seed))
        outs = [[fn(a, b, c) for _, a, b, c in cases] for fn, _ in G._TC_SLIPS]
        right = [G.tc_model(a, b, c) for _, a, b, c in cases]
        for i, out in enumerate(outs):
            assert not all(np.array_equal(x, y) for x, y in zip(out, right)), G._TC_SLIPS[i][1]
            for j in range(i):
                assert not all(np.array_equal(x, y) for x, y in zip(out, outs[j])), (i, j)


# -- 6: ldmatrix addresses ----------------------------------------------------------------------------
@mutant("ldmatrix_address", "matrices 1 and 2 are swapped")
def ldmatrix_columns_first(lane, row_stride):
    """matrix 1 taken as the next 8 columns, matrix 2 as the next 8 rows"""
    matrix, r = lane // 8, lane % 8
    return (r + 8 * (matrix // 2)) * row_stride + 2 * 8 * (matrix % 2)


@mutant("ldmatrix_address", "2 bytes")
def ldmatrix_columns_as_bytes(lane, row_stride):
    """the column offset counted in values, not bytes"""
    matrix, r = lane // 8, lane % 8
    return (r + 8 * (matrix % 2)) * row_stride + 8 * (matrix // 2)


@mutant("ldmatrix_address", "lane 8i + r points at row r")
def ldmatrix_fragment_rows(lane, row_stride):
    """the row taken as the fragment's g = lane // 4"""
    matrix = lane // 8
    return (lane // 4 + 8 * (matrix % 2)) * row_stride + 16 * (matrix // 2)


@mutant("ldmatrix_address", "lanes 8-31")
def ldmatrix_one_matrix(lane, row_stride):
    """every lane into matrix 0"""
    return (lane % 8) * row_stride


def test_the_ldmatrix_checker_is_the_a_fragment():
    """The checker's addresses, read as ldmatrix reads them, give each lane exactly its A fragment."""
    from flashlab.grading.l15_tensor_cores import ldmatrix_address

    stride = 48
    A = F.fragment_map("m16n8k16", "A")
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            start = ldmatrix_address(8 * i + g, stride)  # the lane that points at row g of matrix i
            row, col = divmod(start, stride)
            assert [tuple(x) for x in A[lane, 2 * i:2 * i + 2]] == [(row, col // 2 + 2 * t), (row, col // 2 + 2 * t + 1)]


def test_the_checkers_formulas_are_the_fragment_maps():
    from flashlab.grading.l15_tensor_cores import LAYOUTS, positions

    lane = np.arange(32)
    for layout, (shape, dtype) in LAYOUTS.items():
        for operand in ("A", "B", "C"):
            np.testing.assert_array_equal(positions(layout, operand, lane // 4, lane % 4),
                                          F.fragment_map(shape, operand, dtype), err_msg=f"{layout} {operand}")
            n = F.fragment_map(shape, operand, dtype).shape[1]
            got = np.array([[_right(layout, operand, L, i) for i in range(n)] for L in lane])
            np.testing.assert_array_equal(got, F.fragment_map(shape, operand, dtype))


globals().update(LESSON.standard_tests())
