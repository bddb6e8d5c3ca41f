"""Lesson 15's exercises (tensor cores, the instruction: the fragment map, a warp's mma, the tf32 split, 3xTF32):
each checker passes the solution, grades the blank "not implemented", and rejects kept wrong solutions for several
seeds, naming the slip. The checker's own statement of the fragment layouts is checked against flashlab.fragments.
"""
import numpy as np

from conftest import load_exercise
from exercise_harness import Lesson
from flashlab import fragments as F

LESSON = Lesson("15_tensor_cores")
STEM = LESSON.stem
SOLUTIONS = load_exercise(STEM)
mutant = LESSON.mutant

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


# -- 5: ldmatrix addresses ----------------------------------------------------------------------------
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
