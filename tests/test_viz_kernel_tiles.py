"""The figures of flashlab.viz.kernel_tiles, and the models they draw: bank groups under padding and swizzling,
ldmatrix.x4's row addresses against the A fragment's layout, and FA2's varlen grid against flashlab's block table."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flashlab import fragments as F  # noqa: E402
from flashlab.memory_access import bank_conflict_degree  # noqa: E402
from flashlab.viz import kernel_tiles as kt  # noqa: E402


@pytest.mark.parametrize("row_bytes", [64, 128, 256])
def test_padding_and_swizzle_free_the_phase(row_bytes):
    plain = kt.bank_groups(row_bytes)[:, 0]
    padded = kt.bank_groups(row_bytes, pad_bytes=16)[:, 0]
    swizzled = kt.bank_groups(row_bytes, swizzle=True)[:, 0]
    assert kt.conflict_degree(padded) == 1 and kt.conflict_degree(swizzled) == 1
    assert kt.conflict_degree(plain) == {64: 4, 128: 8, 256: 8}[row_bytes]  # rows 2 or 1 bank sweep apart
    # the same count from the course's 4-byte bank model: each chunk is 4 words
    words = row_bytes // 4
    phase = [r * (words + 4) + w for r in range(8) for w in range(4)]
    assert bank_conflict_degree(phase) == kt.conflict_degree(padded)


def test_swizzle_is_a_permutation_of_each_row():
    for r in range(8):
        assert sorted(c ^ (r % 8) for c in range(8)) == list(range(8))
    groups = kt.bank_groups(128, swizzle=True)
    assert all(sorted(row) == list(range(8)) for row in groups)  # every row still covers every bank group once


def test_ldmatrix_rows_make_the_a_fragment():
    """Lane L of matrix i receives row g = L % 8... of matrix i: the values it gets (columns 2t, 2t+1 of row g of
    each matrix) must be the A fragment's elements 2i, 2i+1 of that lane (flashlab.fragments)."""
    rows = kt.ldmatrix_x4_rows()
    A = F.fragment_map("m16n8k16", "A")  # (32 lanes, 8 elements, (row, col))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            matrix, row, col = rows[8 * i + g]  # the lane that points at row g of matrix i
            assert matrix == i
            got = [(row, col + 2 * t), (row, col + 2 * t + 1)]
            assert [tuple(x) for x in A[lane, 2 * i:2 * i + 2]] == got


def test_varlen_grid_counts():
    assert kt.varlen_blocks([300, 10, 128], 128) == (9, 3 + 1 + 1)
    assert kt.varlen_blocks([0, 5], 64) == (2, 1)


def test_varlen_working_blocks_are_flashlabs_table():
    from flashlab.kernels import varlen

    lens = [700, 33, 128, 1, 260]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = varlen.block_table(cu, cu, 128, 64, causal=False)
    assert len(table) == kt.varlen_blocks(lens, 128)[1]


@pytest.mark.parametrize("draw", [lambda: kt.plot_tile_hierarchy(), lambda: kt.plot_ldmatrix_x4_addresses(),
                                  lambda: kt.plot_swizzle_vs_padding(), lambda: kt.plot_varlen_grid([700, 33, 128, 1]),
                                  lambda: kt.plot_warp_partition()])
def test_figures_draw(draw):
    fig = draw()
    assert fig.axes and sum(len(ax.patches) for ax in fig.axes) > 0
    fig.canvas.draw()
    plt.close(fig)


def test_swizzle_figure_titles_say_the_passes():
    fig = kt.plot_swizzle_vs_padding(128)
    titles = [ax.get_title() for ax in fig.axes]
    assert "needs 8 passes" in titles[0] and "needs 1 pass" in titles[1] and "needs 1 pass" in titles[2]
    plt.close(fig)


def test_warp_partition_covers_the_tile_once_per_panel():
    fig = kt.plot_warp_partition(block_q=64, block_k=32, warps=4)
    for ax in fig.axes:
        assert sum(p.get_width() * p.get_height() for p in ax.patches) == 64 * 32
    plt.close(fig)
