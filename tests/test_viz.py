"""The plotting functions and the roofline helpers, tested directly (no notebook needed)."""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import flashlab  # noqa: E402
from flashlab import HBMModel, formula_traffic, roofline, viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _png_ok(fig):
    data = viz.to_png(fig)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


# --- roofline ---------------------------------------------------------------------------------------

def test_published_machines_are_sane():
    for name, m in roofline.PUBLISHED.items():
        assert 50 < m.ridge < 500, name  # GPUs' ridge points sit at 100-300 FLOP/byte
        assert m.source.startswith("https://")
        assert m.attainable(1e6) == m.peak_flops
        assert math.isclose(float(m.attainable(1.0)), m.bandwidth)


def test_measure_cpu_is_quick_and_plausible(monkeypatch):
    monkeypatch.setenv("FLASHLAB_FAST", "1")
    m = roofline.measure_bandwidth(nbytes=8 << 20, repeats=2), roofline.measure_flops(n=128, repeats=2)
    assert 1e8 < m[0] < 1e13 and 1e7 < m[1] < 1e15


def test_measure_gpu_returns_none_without_a_gpu(monkeypatch):
    monkeypatch.setattr(roofline, "gpu_present", lambda: False)
    assert roofline.measure_gpu() is None


def test_example_kernels_are_memory_bound_except_square_matmul():
    a100 = roofline.PUBLISHED["A100"]
    for name, (f, b) in roofline.example_kernels(4096, 64, 2).items():
        assert (f / b > a100.ridge) == (name == "square matmul"), name


# --- static figures ---------------------------------------------------------------------------------

def test_roofline_plot_has_one_line_per_machine_and_the_points():
    machines = list(roofline.PUBLISHED.values())
    fig = viz.plot_roofline(machines, kernels={"softmax": 1.25, "a": 60, "b": 62}, points={"p": (0.5, 1e9)})
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    for m in machines:
        assert m.name in labels
        line = ax.get_lines()[labels.index(m.name)]
        assert np.isclose(line.get_ydata().max(), m.peak_flops)
    texts = [t.get_text() for t in ax.texts]
    assert any("a, b" in t for t in texts)  # kernels of nearly equal intensity share a label
    _png_ok(fig)


def test_memory_figures():
    _png_ok(viz.plot_memory_hierarchy())
    io = HBMModel()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((32, 8)).astype(np.float32) for _ in range(3))
    flashlab.naive_attention(q, k, v, io=io)
    fig = viz.plot_naive_traffic(io)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert math.isclose(sum(heights), io.hbm_bytes)  # read + write bars add up to the total
    _png_ok(fig)
    out, peak = viz.peak_memory(flashlab.naive_attention, q, k, v)
    assert out.shape == (32, 8) and peak >= 2 * 32 * 32 * 4
    _png_ok(viz.plot_memory_vs_n([64, 128], 8, measured={"m": ([64], [peak])}))
    _png_ok(viz.plot_step_times(roofline.PUBLISHED["A100"], roofline.example_kernels()))
    _png_ok(viz.plot_saved_for_backward([64, 128], 8))


def test_online_softmax_trace_matches_the_library():
    x = np.array([0.5, 2.0, 1.0, 3.0, -1.0])
    t = viz.online_softmax_trace(x)
    assert np.allclose(t["m"], np.maximum.accumulate(x))
    for j in range(len(x)):
        m, l = flashlab.online_softmax_stats(x[: j + 1])
        assert np.isclose(t["l"][j], l)
    assert list(np.flatnonzero(t["alpha"] < 1)) == [1, 3]  # the max grows at positions 1 and 3
    fig = viz.plot_online_softmax(x)
    assert len(fig.axes) == 2 and sum(t.get_text().startswith("×") for t in fig.axes[1].texts) == 2
    _png_ok(fig)


def test_softmax_figures():
    _png_ok(viz.plot_overflow())
    fig = viz.plot_merge(np.arange(9.0), [3, 6])
    assert "m=8.000" in fig.axes[0].get_title()
    _png_ok(fig)


# --- tiles ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nq,nk,bq,bk", [(64, 64, 16, 16), (50, 70, 16, 32)])
def test_trace_tiles_loop_orders(nq, nk, bq, bk):
    tr, tc = math.ceil(nq / bq), math.ceil(nk / bk)
    assert viz.trace_tiles("fa1", nq, nk, bq, bk) == [(i, j) for j in range(tc) for i in range(tr)]
    assert viz.trace_tiles("fa2", nq, nk, bq, bk) == [(i, j) for i in range(tr) for j in range(tc)]
    assert viz.trace_tiles("fa2_backward", nq, nk, bq, bk) == [(i, j) for j in range(tc) for i in range(tr)]


def test_trace_tiles_causal_skips_blocks_above_the_diagonal():
    visits = viz.trace_tiles("fa2", 64, 64, 16, 16, causal=True)
    assert sorted(visits) == [(i, j) for i in range(4) for j in range(i + 1)]
    with pytest.raises(ValueError):
        viz.trace_tiles("fa3", 8, 8, 4, 4)


def test_tile_figures():
    fig = viz.plot_tile_order("fa2", 64, 64, 16, 16, causal=True)
    numbers = sorted(int(t.get_text()) for t in fig.axes[0].texts if t.get_text().isdigit())
    assert numbers == list(range(10))  # 10 of 16 tiles visited, numbered in order
    _png_ok(fig)
    fig = viz.plot_causal_blocks(128, 128, 32, 32)
    assert "6 full, 4 masked inside, 6 skipped" in fig.axes[0].get_title()
    _png_ok(fig)
    fig = viz.plot_work_split(128, 128, 32, 32, causal=True)
    assert [p.get_width() for p in fig.axes[2].patches] == [1, 2, 3, 4]
    _png_ok(fig)
    _png_ok(viz.plot_occupancy(16))


def test_tile_order_says_where_its_arrows_stop():
    assert "steps 0–11 only" in viz.plot_tile_order("fa1", 128, 128, 32, 32).axes[0].get_xlabel()  # 16 tiles
    assert "only" not in viz.plot_tile_order("fa1", 64, 64, 32, 32).axes[0].get_xlabel()  # 4 tiles: all drawn


@pytest.mark.parametrize("causal", [False, True])
def test_backward_order_figure(causal):
    """The backward's loop-order figure draws, and its bars say what the loops do: dK, dV written once,
    dQ read and written once per key block that reaches it (plus the write that zeroes it)."""
    nq = nk = 128
    trips = viz.backward_round_trips(nq, nk, 32, 32, causal=causal)
    assert trips["dK"] == trips["dV"] == (0.0, 1.0)
    per_row = [len([j for (i, j) in viz.trace_tiles("fa2_backward", nq, nk, 32, 32, causal) if i == r]) for r in range(4)]
    assert trips["dQ"] == (sum(per_row) / 4, sum(per_row) / 4 + 1)  # (4, 5) in full, (2.5, 3.5) causal
    fig = viz.plot_backward_order(nq, nk, 32, 32, causal=causal)
    order, bars = fig.axes[:2]
    assert "outer j, inner i" in order.get_title()
    assert sorted(int(t.get_text()) for t in order.texts if t.get_text().isdigit()) == list(range(sum(per_row)))
    assert any("on chip" in t.get_text() for t in order.texts) and any("HBM" in t.get_text() for t in order.texts)
    assert [round(p.get_height(), 6) for p in bars.patches] == [trips["dQ"][0], 0, 0, trips["dQ"][1], 1, 1]
    _png_ok(fig)


# --- traffic ----------------------------------------------------------------------------------------

def test_fits_agrees_with_the_budget():
    assert viz.fits("fa1", 64, 64, 64, 16384) and not viz.fits("fa1", 64, 128, 64, 16384)
    assert not viz.fits("fa2_backward", 64, 64, 64, 16384) and viz.fits("fa2_backward", 32, 32, 64, 16384)


def test_traffic_curves_match_formula_and_an_instrumented_run():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((96, 16)).astype(np.float32) for _ in range(3))
    io = HBMModel(M=1024)
    flashlab.flash_attention_v1(q, k, v, io=io)
    assert viz.traffic_bytes("fa1", 96, 16, 1024) == io.hbm_bytes
    fig = viz.plot_traffic_vs_sram(96, 16, Ms=(512, 1024, 2048), algorithms=("naive", "fa1"))
    fa1 = next(line for line in fig.axes[0].get_lines() if line.get_label() == "FlashAttention-1")
    t = formula_traffic("fa1", 96, 96, 16, M=1024)
    assert fa1.get_ydata()[1] == (t["read"] + t["write"]) * 4
    _png_ok(fig)
    fig = viz.plot_traffic_vs_n(16, 1024, ns=(64, 128), causal=True)
    assert len(fig.axes[0].get_lines()) == 3
    _png_ok(fig)


def test_block_heatmap_marks_overflow_and_best():
    grid, ok = viz.block_traffic_grid("fa1", 1024, 64, 16384)
    assert ok[3, 3] and not ok[4, 4] and np.isnan(grid[4, 4])
    assert np.all(np.isclose(grid[:4, 3], grid[0, 3]))  # FA1: only block_k changes the traffic
    _png_ok(viz.plot_block_heatmap("fa1", 1024, 64, 16384, mark=(32, 64)))


def _contrast(c1, c2):
    lum = sorted((viz._base.relative_luminance(matplotlib.colors.to_rgba(c)) for c in (c1, c2)), reverse=True)
    return (lum[0] + 0.05) / (lum[1] + 0.05)


def test_text_color_on_picks_the_stronger_contrast():
    assert viz._base.text_color_on((1, 1, 0.2, 1)) == "black"  # yellow
    assert viz._base.text_color_on((0.27, 0.0, 0.33, 1)) == "white"  # viridis' dark purple
    cmap = matplotlib.colormaps["viridis"]
    for x in np.linspace(0, 1, 41):  # the worse of black and white still reaches sqrt(21) : 1 on any colour
        assert _contrast(viz._base.text_color_on(cmap(x)), cmap(x)) > 4.5


def test_block_heatmap_labels_are_readable_on_their_cells():
    fig = viz.plot_block_heatmap("fa1", 4096, 64, 65536)
    ax = fig.axes[0]
    im = ax.get_images()[-1]
    data = im.get_array()
    labels = [t for t in ax.texts if t.get_text() != "×"]
    assert len(labels) == np.count_nonzero(~np.ma.getmaskarray(data) & np.isfinite(np.ma.filled(data, np.nan)))
    colors = set()
    for t in labels:
        b, a = (int(round(v)) for v in t.get_position())
        cell = im.cmap(im.norm(data[a, b]))
        assert _contrast(t.get_color(), cell) > 4.5, (t.get_text(), t.get_color(), cell)
        colors.add(t.get_color())
    assert colors == {"black", "white"}  # viridis runs from dark to light: both are needed


def test_block_heatmap_when_nothing_fits_says_so_without_a_colour_bar():
    fig = viz.plot_block_heatmap("fa1", 4096, 128, 1024)
    assert len(fig.axes) == 1  # no colour bar for an empty scale
    msg = [t.get_text() for t in fig.axes[0].texts if "nothing fits" in t.get_text()]
    need = viz.traffic.sram_need("fa1", 8, 8, 128)
    assert msg and "M = 1024" in msg[0] and str(need) in msg[0] and need > 1024
    _png_ok(fig)
    fig = viz.plot_block_heatmap("fa1", 4096, 128, 1024, compact=True)  # a panel of the static grid
    assert any("nothing fits" in t.get_text() for t in fig.axes[0].texts)
    fig = viz.plot_block_heatmap("fa1", 4096, 64, 16384)
    assert len(fig.axes) == 2 and not any("nothing fits" in t.get_text() for t in fig.axes[0].texts)


def test_io_compare():
    ios = {}
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((64, 16)).astype(np.float32) for _ in range(3))
    for name, fn in (("FA1", flashlab.flash_attention_v1), ("FA2", flashlab.flash_attention_v2)):
        ios[name] = HBMModel()
        fn(q, k, v, io=ios[name], block_q=16, block_k=16)
    fig = viz.plot_io_compare(ios)
    bars = fig.axes[1].patches
    assert bars[0].get_height() > bars[1].get_height()  # FA2 does fewer non-matmul FLOPs
    _png_ok(fig)


# --- explorers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("explorer,shape", [(viz.sram_explorer, (2, 3)), (viz.fa_explorer, (2, 3))])
def test_explorers_fall_back_to_a_static_grid(explorer, shape):
    assert not viz.widgets_available()  # pytest is not a Jupyter kernel
    fig = explorer()
    assert isinstance(fig, plt.Figure) and len(fig.axes) == shape[0] * shape[1]
    _png_ok(fig)
    fig = explorer(interactive=True)  # asking for widgets outside a kernel still gives the grid
    assert isinstance(fig, plt.Figure)


def test_explorers_full_views_draw():
    fig = viz.traffic._draw_sram(N=1024, d=64, M=16384, block_q=128, block_k=128)  # does not fit: warned
    assert any("do not fit" in t.get_text() for t in fig.axes[0].texts)
    _png_ok(fig)
    fig = viz.traffic._draw_fa(N=1024, d=64, M=4096, block_q=64, block_k=64, causal=True)
    _png_ok(fig)
    ticks = [t.get_text() for t in fig.axes[1].get_yticklabels() if t.get_text()]
    assert ticks and all(t.endswith("B") for t in ticks)  # bytes in words, not a bare "1e8" offset


def test_fast_mode_forces_the_static_grid(monkeypatch):
    monkeypatch.setattr(viz._base, "widgets_available", lambda: True)
    monkeypatch.setenv("FLASHLAB_FAST", "1")
    assert not viz.use_widgets()
    monkeypatch.setenv("FLASHLAB_FAST", "0")
    assert viz.use_widgets()


def test_explore_uses_interact_when_widgets_are_there(monkeypatch):
    widgets = pytest.importorskip("ipywidgets")
    calls = {}

    def fake_interact(fn, **controls):
        calls.update(controls)
        fn(**{name: c.value for name, c in controls.items()})
        return "interact"

    monkeypatch.setattr(viz._base, "use_widgets", lambda interactive=None: True)
    monkeypatch.setattr(widgets, "interact", fake_interact)
    monkeypatch.setattr(plt, "show", lambda: None)
    assert viz.sram_explorer() == "interact"
    assert set(calls) == {"N", "d", "M", "block_q", "block_k"}
    assert all(isinstance(c, widgets.SelectionSlider) for c in calls.values())


def test_an_on_off_control_is_a_checkbox(monkeypatch):
    widgets = pytest.importorskip("ipywidgets")
    calls, drawn = {}, []

    def fake_interact(fn, **controls):
        calls.update(controls)
        for causal in (False, True):  # what ticking the box does: call back with the new value
            fn(**{**{name: c.value for name, c in controls.items()}, "causal": causal})
        return "interact"

    monkeypatch.setattr(viz._base, "use_widgets", lambda interactive=None: True)
    monkeypatch.setattr(widgets, "interact", fake_interact)
    monkeypatch.setattr(plt, "show", lambda: drawn.append(plt.gcf().axes[0].get_title()))
    assert viz.fa_explorer() == "interact"
    assert isinstance(calls["causal"], widgets.Checkbox) and calls["causal"].value is False
    assert all(isinstance(c, widgets.SelectionSlider) for name, c in calls.items() if name != "causal")
    assert len(drawn) == 2 and "causal" not in drawn[0] and "causal" in drawn[1]
    assert not viz._base._is_switch((0, 1)) and not viz._base._is_switch((False, True, None))


def test_import_flashlab_does_not_import_matplotlib():
    import subprocess
    import sys

    code = "import sys, flashlab, flashlab.roofline; print('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
