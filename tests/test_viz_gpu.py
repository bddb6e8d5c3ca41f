"""The GPU lessons' figures draw (to PNG) from synthetic, recorded or missing data."""
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from flashlab.viz import gpu as gviz  # noqa: E402
from flashlab.viz import to_png  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def sweep_rows():
    rows = []
    for d in (64, 128):
        for bq in (32, 64, 128):
            for bk in (16, 32):
                for tr, tc in ((8, 8), (16, 8)):
                    rows.append({"gpu": "Fake GPU", "N": 4096, "d": d, "block_q": bq, "block_k": bk, "tr": tr, "tc": tc,
                                 "registers": 64 + bq // 2, "local_bytes": 0, "occupancy": 0.25,
                                 "shared_bytes": 4 * bq * d, "limited_by": "registers", "tflops": bq / 8 + bk / 16 + tr / 16})
    return rows


def test_load_tile_sweep_reads_numbers(tmp_path):
    rows = sweep_rows()
    path = tmp_path / "sweep.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    back = gviz.load_tile_sweep(path)
    assert len(back) == len(rows) and back[0]["block_q"] == 32 and isinstance(back[0]["tflops"], float)
    assert gviz.load_tile_sweep(tmp_path / "missing.csv") == []


def test_tile_sweep_heatmap_marks_the_fastest():
    rows = sweep_rows()
    fig = gviz.plot_tile_sweep(rows, d=64)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sum("★" in t for t in texts) == 1
    best = max((r for r in rows if r["d"] == 64), key=lambda r: r["tflops"])
    assert any(t.startswith("★") and f"{best['tflops']:.1f}" in t for t in texts)
    to_png(fig)


def test_explorer_static_grid_and_no_data():
    fig = gviz.tile_explorer(sweep_rows(), interactive=False)
    assert len(fig.axes) >= 4
    to_png(fig)
    to_png(gviz.tile_explorer([], interactive=False))  # no data: a note, not a crash


def test_intensity_is_about_half_block_q():
    i = gviz.kernel_intensity(4096, 64, 64)
    assert 28 < i < 33
    assert gviz.kernel_intensity(4096, 64, 64, causal=True) > 0


def test_forward_results_fall_back_to_recorded(tmp_path):
    rows, source = gviz.load_forward_results(tmp_path / "none.csv")
    assert source == gviz.RECORDED_SOURCE and any(r["impl"] == "torch SDPA fp32" for r in rows)
    fig = gviz.plot_vs_torch(rows, N=4096, d=64)
    assert len(fig.axes[0].patches) == len([r for r in rows if r["N"] == 4096 and r["d"] == 64])
    to_png(fig)


def test_other_figures_draw():
    to_png(gviz.plot_thread_map(21, 8))
    fig = gviz.plot_reduction_tree([1, 2, 3, 4])
    assert any(t.get_text() == "10" for t in fig.axes[0].texts)  # the total
    to_png(fig)
    to_png(gviz.plot_launch_cost([8, 16, 32], [0.01, 0.02, 0.04]))
    to_png(gviz.plot_shared_kernel_map(32, 48, 8, 16, causal=True))
    fig = gviz.plot_micro_tiles(32, 16, 8, 4)
    assert len(fig.axes[0].patches) == 32
    to_png(fig)
    to_png(gviz.plot_reads_per_fma())
    info = {"occupancy": 0.5, "blocks_per_sm": 4, "threads_per_block": 128, "limited_by": "registers",
            "registers_per_thread": 96}
    to_png(gviz.plot_occupancy_bars({"a": info, "b": dict(info, occupancy=0.25)}))
    to_png(gviz.plot_kernel_roofline({"k": (30.0, 3e12)}))
