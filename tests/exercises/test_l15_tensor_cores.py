"""Lesson 15's exercises (tensor cores: the fragment map, a warp's mma, the tf32 split, 3xTF32, the S tile kernel,
where dS comes from, the backward tile's shared memory, the forward's K/V copies): each checker passes the
solution, grades the blank "not implemented", and rejects kept wrong solutions for several seeds, naming the
slip. The checker's own statement of the fragment layouts, of the tile's shared memory and of the copies is
checked against flashlab.fragments and the kernels.
"""
import numpy as np
import pytest

from conftest import load_exercise
from exercise_harness import Lesson
from flashlab import fragments as F
from flashlab.device import has_gpu
from flashlab.grading import check

LESSON = Lesson("15_tensor_cores")
STEM = LESSON.stem
SOLUTIONS = load_exercise(STEM)
mutant = LESSON.mutant
LESSON.source_exercise("s_tile", "s_tile", mutant_seeds=(1, 2))

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


# -- 5: the kernel (edits of the solution's source, run in the simulator) -------------------------
KERNEL_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain)
    ("a1 and a2 swapped (the +4 words before the +8 rows)",
     [("MMA16(q[g, w], q[g + 8, w], q[g, w + 4], q[g + 8, w + 4],",
       "MMA16(q[g, w], q[g, w + 4], q[g + 8, w], q[g + 8, w + 4],")], "S is wrong"),
    ("accumulators restarted at every k-step",
     [("k[key, w], k[key, w + 4], c0, c1, c2, c3)",
       "k[key, w], k[key, w + 4], np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0))")],
     "k-step"),
    ("B read as the next word instead of 4 words on",
     [("k[key, w], k[key, w + 4], c0", "k[key, w], k[key, w + 1], c0")], "B registers"),
    ("C written to columns t, t + 1", [("col = 8 * n + 2 * t", "col = 8 * n + t")], "never written"),
    ("only the first n-tile", [("for n in range(k.shape[0] // 8):", "for n in range(1):")], "never written"),
]
for _label, _edits, _says in KERNEL_MUTANTS:
    LESSON.edit_mutant("s_tile", _label, _edits, _says)


# -- 6: where dS comes from ----------------------------------------------------------------------
@mutant("ds_source", "the warp holds dS TRANSPOSED")
def ds_no_transpose(lane, i):
    """looks dS[query, key] up as if the C fragments had queries as rows"""
    g, t = lane // 4, lane % 4
    query, key = g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)
    return key // 8, 4 * (query % 8) + (key % 8) // 2, key % 2 + 2 * (query // 8)


@mutant("ds_source", "the C index is wrong")
def ds_c_index_transposed(lane, i):
    """c = 2 * (column % 2) + row // 8: c1 taken for the row 8 below"""
    n, L, c = SOLUTIONS["ds_source"](lane, i)
    return n, L, 2 * (c % 2) + c // 2


@mutant("ds_source", "A's registers are in the wrong order")
def ds_a_registers_swapped(lane, i):
    """reads a2, a3 as the keys 8 further right and a4..a7 as the rows 8 further down"""
    return SOLUTIONS["ds_source"](lane, {2: 4, 3: 5, 4: 2, 5: 3}.get(i, i))


@mutant("ds_source", "is not a place in the C fragments")
def ds_returns_the_matrix_position(lane, i):
    """returns (0, key, query): a position in dS^T, not (n_tile, lane, c)"""
    g, t = lane // 4, lane % 4
    return 0, 2 * t + i % 2 + 8 * (i // 4), g + 8 * ((i // 2) % 2)


@mutant("ds_source", "g and t swapped")
def ds_source_lane_g_t_swapped(lane, i):
    """the holder of C's (row, column) taken as lane 4 * (column // 2) + row"""
    n, L, c = SOLUTIONS["ds_source"](lane, i)
    return n, 4 * (L % 4) + L // 4, c


@mutant("ds_source", "your lane's (g, t) is wrong")
def ds_source_own_g_t_swapped(lane, i):
    """g, t = lane % 4, lane // 4 for the A fragment's lane"""
    g, t = lane % 4, lane // 4
    query, key = g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)
    col = query % 8
    return query // 8, 4 * (key % 8) + col // 2, col % 2 + 2 * (key // 8)


# -- 7: the backward tile's shared memory -------------------------------------------------------------
@mutant("backward_tile_bytes", "return bytes")
def tile_words_not_bytes(d, block_q, block_k, stages, v_shared, wide):
    """the sum in 32-bit words, never multiplied by 4"""
    return SOLUTIONS["backward_tile_bytes"](d, block_q, block_k, stages, v_shared, wide) // 4


@mutant("backward_tile_bytes", "rows are not padded")
def tile_without_padding(d, block_q, block_k, stages, v_shared, wide):
    """rows of d values (and of block_q) without the 4 words of padding"""
    row, ds_row = (d if wide else d // 2), (block_q if wide else block_q // 2)
    return 4 * ((2 if v_shared else 1) * block_k * row + 2 * stages * block_q * row + block_k * ds_row
                + 2 * stages * block_q)


@mutant("backward_tile_bytes", "a copy per stage")
def tile_statistics_once(d, block_q, block_k, stages, v_shared, wide):
    """lse and D counted once, not per stage"""
    return SOLUTIONS["backward_tile_bytes"](d, block_q, block_k, stages, v_shared, wide) - 8 * (stages - 1) * block_q


@mutant("backward_tile_bytes", "only when v_shared")
def tile_always_v(d, block_q, block_k, stages, v_shared, wide):
    """V_j counted in shared memory whether or not v_shared"""
    return SOLUTIONS["backward_tile_bytes"](d, block_q, block_k, stages, True, wide)


@mutant("backward_tile_bytes", "two to a 32-bit word")
def tile_16_bit_as_words(d, block_q, block_k, stages, v_shared, wide):
    """16-bit inputs counted a word per value (dS^T still packed)"""
    extra = 0 if wide else (2 if v_shared else 1) * block_k * (d // 2) + 2 * stages * block_q * (d // 2)
    return SOLUTIONS["backward_tile_bytes"](d, block_q, block_k, stages, v_shared, wide) + 4 * extra


def test_the_tile_checkers_formula_is_the_kernels():
    """The checker's count of shared memory is BackwardTile.shared_words, for every build the kernel has."""
    from flashlab.grading.l15_tensor_cores import tile_words
    from flashlab.kernels.tensor_backward import BackwardTile

    for d in (16, 32, 64, 128):
        for precision, wide in (("f16", False), ("bf16", False), ("3xtf32", True), ("tf32", True)):
            for warps in (1, 2, 4, 8):
                for bq in (16, 32, 64):
                    for stages in (1, 2):
                        for v_shared in (False, True):
                            tile = BackwardTile(warps, bq, stages, v_shared)
                            assert tile_words(d, bq, tile.block_k, stages, v_shared, wide) == \
                                tile.shared_words(d, precision), (d, precision, tile)


# -- 8: the forward's K/V copies ----------------------------------------------------------------------
_plan = SOLUTIONS["copy_plan"]


@mutant("copy_plan", "padded by 4 words")
def plan_unpadded(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """shared rows W words apart instead of W + 4"""
    W = d if wide else d // 2
    return [((s // (W + 4)) * W + s % (W + 4), src, n) for s, src, n in _plan(tid, threads, d, block_k, k0, n_k,
                                                                              row_stride, wide)]


@mutant("copy_plan", "row_stride words apart")
def plan_contiguous_source(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """the source's rows taken as W words apart, whatever row_stride says"""
    return _plan(tid, threads, d, block_k, k0, n_k, d if wide else d // 2, wide)


@mutant("copy_plan", "consecutive 16-byte chunks of one row")
def plan_rows_first(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """consecutive threads on consecutive rows (column = tid // rows per step): uncoalesced"""
    W = d if wide else d // 2
    rows = threads // (W // 4)
    out, row, col = [], tid % rows, 4 * (tid // rows)
    while row < block_k:
        ok = k0 + row < n_k
        out.append((row * (W + 4) + col, (k0 + row) * row_stride + col if ok else k0 * row_stride + col,
                    16 if ok else 0))
        row += rows
    return out


@mutant("copy_plan", "0 bytes")
def plan_copies_past_the_end(tid, threads, d, block_k, k0, n_k, row_stride, wide):
    """rows past n_k read 16 bytes from past the end"""
    W = d if wide else d // 2
    return [(s, src if n else src + (s // (W + 4)) * row_stride, 16) for s, src, n in
            _plan(tid, threads, d, block_k, k0, n_k, row_stride, wide)]


def test_the_copy_checkers_plan_is_the_kernels(rng, monkeypatch):
    """The checker's copy_plan is what the tensor forward copies: every cp_async16_flat call of a simulated launch
    (two K/V tiles, the second past the keys) is a (shared word, source word, bytes) of the plan, K's at the
    tile's stage and V's block_k padded rows further on."""
    if has_gpu():
        pytest.skip("records the simulator's copies")
    from flashlab.grading.l15_tensor_cores import copy_plan
    from flashlab.kernels import flash_attention, mma, tensor

    d, block_k, n_k, tile = 16, 16, 20, tensor.TensorTile(1, 16)
    W = d // 2
    stage, vo = 2 * block_k * (W + 4), block_k * (W + 4)
    seen, copy = [], mma.cp_async16_flat

    def recording(dst, dst_index, src, base, offset, src_bytes):
        seen.append((int(dst_index), int(base) + int(offset), int(src_bytes)))
        return copy(dst, dst_index, src, base, offset, src_bytes)

    monkeypatch.setattr(mma, "cp_async16_flat", recording)
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float16) for n in (16, n_k, n_k))
    flash_attention(q, k, v, variant="tensor", block_q=16, block_k=block_k)
    want = []
    for j, k0 in enumerate(range(0, n_k, block_k)):
        for tid in range(tile.threads):
            for s, src, n in copy_plan(tid, tile.threads, d, block_k, k0, n_k, W, False):
                want += [((j % 2) * stage + s, src, n), ((j % 2) * stage + vo + s, src, n)]
    assert sorted(seen) == sorted(want)
    assert any(n == 0 for _, _, n in want) and any(n == 16 for _, _, n in want)


def test_the_ds_checkers_map_is_the_lessons():
    from flashlab.grading.l15_tensor_cores import RIGHT_DS, ds_sources
    from flashlab.viz.tensor import ds_sources as lesson_map

    np.testing.assert_array_equal(ds_sources(**RIGHT_DS), lesson_map())


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


@pytest.mark.skipif(has_gpu(), reason="the simulator's check; on a GPU a skipped warp instruction is undefined")
def test_s_tile_that_skips_the_mma_on_some_lanes_fails_with_a_message():
    edits = [("        for ks in range(q.shape[1] // 8):  # k-steps of 16 dims = 8 words\n",
              "        for ks in range(q.shape[1] // 8 if lane else 0):  # k-steps of 16 dims = 8 words\n")]
    result = check("s_tile", LESSON.with_edits("s_tile", edits), seed=1, quiet=True)
    assert result.status == "failed" and "all 32 lanes" in str(result), str(result)
