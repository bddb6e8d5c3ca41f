"""Lesson 17's exercises (the tensor-core backward: where dS comes from, the backward tile's shared memory): each
checker passes the solution, grades the blank "not implemented", and rejects kept wrong solutions for several seeds,
naming the slip. The checker's statement of dS's sources and of the tile's shared memory is checked against the
lesson's figure and the kernel.
"""
import numpy as np

from conftest import load_exercise
from exercise_harness import Lesson

LESSON = Lesson("17_tensor_core_backward")
STEM = LESSON.stem
SOLUTIONS = load_exercise(STEM)
mutant = LESSON.mutant

# -- 1: where dS comes from ----------------------------------------------------------------------
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


# -- 2: the backward tile's shared memory -------------------------------------------------------------
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
    from flashlab.grading.l17_tensor_core_backward import tile_words
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


def test_the_ds_checkers_map_is_the_lessons():
    from flashlab.grading.l17_tensor_core_backward import RIGHT_DS, ds_sources
    from flashlab.viz.tensor import ds_sources as lesson_map

    np.testing.assert_array_equal(ds_sources(**RIGHT_DS), lesson_map())


globals().update(LESSON.standard_tests())
