"""The explorers of lessons 01, 03, 11 and 14: each one's widget callback is driven with several settings and
the drawing is checked against numbers computed here; each static fallback is checked too."""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flashlab import decoding, fp8, reference_attention, roofline, viz  # noqa: E402
from flashlab.viz import decoding as dviz  # noqa: E402
from flashlab.viz import fp8 as fviz  # noqa: E402
from flashlab.viz import memory as mviz  # noqa: E402
from flashlab.viz import softmax as sviz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture
def drive(monkeypatch):
    """drive(explorer, *args) runs the explorer as in a live kernel, with ipywidgets.interact replaced by a
    recorder. Returns (sliders, callback): callback(**params) sets the sliders (so a value that is not one of
    a slider's options fails), calls interact's function as a slider move would, and returns the figure."""
    widgets = pytest.importorskip("ipywidgets")
    seen = {}

    def fake_interact(fn, **sliders):
        seen.update(fn=fn, sliders=sliders)
        fn(**{name: s.value for name, s in sliders.items()})  # what interact does when it is displayed
        return "interact"

    monkeypatch.setattr(viz._base, "use_widgets", lambda interactive=None: True)
    monkeypatch.setattr(widgets, "interact", fake_interact)
    monkeypatch.setattr(plt, "show", lambda: None)

    def run(explorer, *args, **kwargs):
        assert explorer(*args, **kwargs) == "interact"
        sliders = seen["sliders"]
        # sliders, and a checkbox for an on/off choice (explore() makes one for (False, True))
        assert all(isinstance(s, (widgets.SelectionSlider, widgets.Checkbox)) for s in sliders.values())

        def callback(**params):
            plt.close("all")
            for name, value in params.items():
                sliders[name].value = value  # raises for a value the slider does not offer
            seen["fn"](**{name: s.value for name, s in sliders.items()})
            return plt.gcf()

        return sliders, callback

    return run


def _line(ax, label):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def _bars(ax, label):
    return next(c for c in ax.containers if c.get_label() == label)


def _png_ok(fig):
    data = viz.to_png(fig)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


# --- lesson 01: roofline ------------------------------------------------------------------------------

@pytest.mark.parametrize("machine,intensity,N,d,e", [
    ("H100 FP16", 4.0, 4096, 64, 2), ("H100 FP16", 512.0, 1024, 128, 2), ("T4 FP32", 32.0, 8192, 64, 4),
    ("A100 FP32", 0.125, 512, 256, 4),
])
def test_roofline_explorer_puts_the_kernel_and_the_steps_on_the_roof(drive, machine, intensity, N, d, e):
    sliders, callback = drive(viz.roofline_explorer)
    assert {"machine", "intensity", "N", "d", "bytes_per_element"} <= set(sliders)
    fig = callback(machine=machine, intensity=intensity, N=N, d=d, bytes_per_element=e)
    m = mviz.roofline_machines()[machine]
    star = _line(fig.axes[0], "your kernel")
    assert star.get_xdata()[0] == intensity
    assert math.isclose(star.get_ydata()[0], min(m.peak_flops, m.bandwidth * intensity))
    bound = "memory" if intensity < m.ridge else "compute"
    assert f"{bound}-bound" in fig.axes[0].get_title()
    steps = roofline.example_kernels(N, d, e)
    want = {round(steps[k][0] / steps[k][1], 9) for k in ("S = QKᵀ", "softmax")}  # QKᵀ and PV coincide
    squares = {round(float(line.get_xdata()[0]), 9) for line in fig.axes[0].get_lines() if line.get_marker() == "s"}
    assert squares == want
    # right panel: each step's memory time, in µs, is its bytes over the machine's bandwidth
    mem = sorted(p.get_width() for p in fig.axes[1].patches[:3])
    assert np.allclose(mem, sorted(steps[k][1] / m.bandwidth * 1e6 for k in mviz.ATTENTION_STEPS))


def test_roofline_explorer_offers_measured_machines(drive):
    box = roofline.Machine("a measured box", 2e11, 1e10, measured=True)
    sliders, callback = drive(viz.roofline_explorer, measured=[box, None])
    assert "a measured box" in sliders["machine"].options
    fig = callback(machine="a measured box", intensity=64.0)
    assert math.isclose(_line(fig.axes[0], "your kernel").get_ydata()[0], 2e11)  # past its ridge of 20
    _png_ok(fig)


def test_lesson_01_claims_about_where_the_steps_sit():
    """Lesson 01's explorer text: the matmuls stay left of the H100's tensor-core ridge for every N and d the
    sliders offer, cross the FP32 ridges of the H100 and T4 from d = 64 with 4-byte elements; softmax never."""
    ms = mviz.roofline_machines()
    for N in mviz.SEQS:
        for d in (32, 64, 128, 256):
            k2, k4 = roofline.example_kernels(N, d, 2), roofline.example_kernels(N, d, 4)
            assert k2["S = QKᵀ"][0] / k2["S = QKᵀ"][1] < ms["H100 FP16"].ridge
            for name in ("H100 FP32", "T4 FP32"):
                assert (k4["O = PV"][0] / k4["O = PV"][1] > ms[name].ridge) == (d >= 64), (N, d, name)
            assert all(k[0] / k[1] < min(m.ridge for m in ms.values()) for k in (k2["softmax"], k4["softmax"]))


def test_roofline_static_grid_shows_the_ridge_moving():
    fig = viz.roofline_explorer()
    assert isinstance(fig, plt.Figure) and len(fig.axes) == 6
    bounds = ["memory" if "memory-bound" in ax.get_title() else "compute" for ax in fig.axes]
    # H100 tensor cores (ridge ~295) vs T4 FP32 units (ridge ~25) at I = 1, 32, 512
    assert bounds == ["memory", "memory", "compute", "memory", "compute", "compute"]
    _png_ok(fig)


# --- lesson 03: online softmax, step by step ------------------------------------------------------------

STREAM = np.array([0.5, 1.0, 0.2, 2.5, 1.8, -0.5, 1.0, 2.0, 4.0, 3.1, 0.0, 1.5])


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("x", [STREAM, np.random.default_rng(5).standard_normal(9) * 3])
def test_online_softmax_explorer_steps(drive, x):
    sliders, callback = drive(viz.online_softmax_explorer, x)
    assert list(sliders["j"].options) == list(range(len(x)))
    for j in sorted({0, 1, 3, 4, 8, len(x) - 1}):  # STREAM's max grows at 1, 3 and 8
        fig = callback(j=j)
        top, bottom = fig.axes
        assert np.allclose([b.get_height() for b in _bars(bottom, sviz.PREFIX_LABEL)], _softmax(x[: j + 1]))
        assert np.allclose([b.get_height() for b in _bars(bottom, sviz.FINAL_LABEL)], _softmax(x))
        m_j = x[: j + 1].max()
        running = _line(top, "running max $m$").get_ydata()
        assert np.isclose(running[-1], m_j) and len(running) == j + 2
        grew = j > 0 and x[j] > x[:j].max()
        title = bottom.get_title()
        assert f"m = {m_j:.2f}" in title and f"l = {np.exp(x[: j + 1] - m_j).sum():.3f}" in title
        assert ("rescale" in title) == grew
        if grew:
            assert f"×{np.exp(x[:j].max() - m_j):.2f}" in title
            assert f"{np.exp(x[:j].max() - m_j):.3f}" in top.texts[0].get_text()  # the factor in the box
    _png_ok(fig)


def test_online_softmax_static_grid_and_bad_input():
    fig = viz.online_softmax_explorer(STREAM)
    titles = [ax.get_title() for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == ["j = 0", "j = 3", "j = 8", "j = 11"]  # start, last rescales, end
    assert sum("rescale" in t for t in titles) == 2
    _png_ok(fig)
    for bad in ([1.0], [[1.0, 2.0]], [1.0, np.nan]):
        with pytest.raises(ValueError, match="x must be"):
            viz.online_softmax_explorer(np.array(bad))


# --- lesson 11: FP8 error against block size and outliers ---------------------------------------------

@pytest.mark.parametrize("p,std,block,incoherent", [(0.03, 10.0, 32, True), (1e-3, 100.0, 256, False)])
def test_fp8_explorer_draws_the_simulation(drive, p, std, block, incoherent):
    _, callback = drive(viz.fp8_explorer, N=256)
    n = 256
    fig = callback(N=n, p=p, outlier_std=std, block=block, incoherent=incoherent)
    left, right = fig.axes[0], fig.axes[1]
    blocks = fviz.sweep_blocks(n)
    want = fp8.error_vs_block(blocks, n=n, d=fviz.D, p=p, outlier_std=std)  # fresh, not the explorer's cache
    for inc in (False, True):
        line = _line(left, fviz.LABELS[inc])
        assert list(line.get_xdata()) == list(blocks) and np.allclose(line.get_ydata(), want[inc])
    star = _line(left, "your choice")
    assert np.isclose(star.get_ydata()[0], want[incoherent][blocks.index(min(block, n))])
    # right: the block of Q that shares one scale, rotated when incoherent
    q, k = (fp8.outlier_inputs((1, n, fviz.D), i, outlier_std=std, p=p) for i in range(2))
    if incoherent:
        q, _ = fp8.incoherent_transform(q, k, seed=0)
    assert np.allclose(right.images[0].get_array(), np.abs(q[0, :block]))
    assert ("after the rotation" in right.get_title()) == incoherent


def test_fp8_explorer_shows_what_the_lesson_says():
    errs = fviz.block_errors(256, 0.03, 10.0)
    assert np.all(errs[True] < 0.75 * errs[False])  # many std-10 outliers: the rotation wins at every block
    clean = fviz.block_errors(256, 0.0, 0.0)
    assert np.allclose(clean[True], clean[False], rtol=0.1)  # no outliers: nothing for the rotation to fix
    assert np.all(errs[False] > 1.5 * clean[False].mean())  # ... and the outliers cost accuracy


def test_fp8_explorer_reuses_the_simulation_when_only_the_block_moves(drive):
    _, callback = drive(viz.fp8_explorer, N=256)
    callback(N=256, p=3e-3, outlier_std=30.0, block=16)
    misses = fviz.block_errors.cache_info().misses
    for block in (32, 64, 128):
        fig = callback(block=block, incoherent=block == 64)
    assert fviz.block_errors.cache_info().misses == misses
    _png_ok(fig)


def test_fp8_static_grid():
    fig = viz.fp8_explorer(N=256)
    assert len(fig.axes) == 6 and "N = 256" in fig._suptitle.get_text()
    assert ["p = 0.001" in ax.get_title() for ax in fig.axes] == [True] * 3 + [False] * 3
    _png_ok(fig)


def test_error_vs_block_is_the_study():
    q, k, v = (fp8.outlier_inputs((1, 128, 32), i, outlier_std=10.0, p=0.01) for i in range(3))
    ref, _ = reference_attention(q, k, v)
    errs = fp8.error_vs_block([16, 128], n=128, d=32, p=0.01, metric="rmse")
    assert np.isclose(errs[False][1], fp8.rmse(fp8.fp8_attention(q, k, v, scaling="tensor"), ref))  # block N
    assert np.isclose(errs[True][0], fp8.rmse(fp8.fp8_attention(q, k, v, block=16, incoherent=True), ref))
    r = fp8.accuracy_study(n=128, d=32, block=16)
    assert r == fp8.accuracy_study(n=128, d=32, block=16, outlier_std=10.0, p=1e-3)  # the paper's defaults
    for kwargs, name in ((dict(p=2.0), "p"), (dict(outlier_std=-1.0), "outlier_std"), (dict(metric="max"), "metric")):
        with pytest.raises(ValueError, match=name):
            fp8.error_vs_block([16], n=64, d=16, **kwargs)
    with pytest.raises(ValueError, match="N must be one of"):
        viz.fp8_explorer(N=300)


# --- lesson 14: split count against KV length -------------------------------------------------------------

def test_split_model():
    blocks, waves = decoding.split_waves(16, np.array([8, 16, 17]), n_sm=132, blocks_per_sm=2)
    assert list(blocks) == [128, 256, 272] and list(waves) == [1, 1, 2]
    t = decoding.model_time_us(16, 65536, 128, np.arange(1, 9))  # one wave: time falls like 1 / splits
    assert np.allclose(t[0] / t, np.arange(1, 9), rtol=1e-3)
    t8, t9 = decoding.model_time_us(16, 65536, 128, np.array([8, 9]), n_sm=132)  # 128, then 144 blocks
    assert t9 > 1.5 * t8  # a second, nearly empty wave
    nbytes = 16 * 65536 * 2 * 128 * 2  # K and V of every head, float16
    t = decoding.model_time_us(16, 65536, 128, 33, n_sm=132)  # 528 blocks = 4 full waves
    assert np.isclose(t, nbytes / 3.35e12 * 1e6, rtol=0.01)  # full waves stream at the whole bandwidth


@pytest.mark.parametrize("nk,bh,gpu,splits,bps", [(16384, 16, "H100", 16, 1), (65536, 16, "H100", 32, 2),
                                                  (4096, 128, "T4", 4, 1), (1024, 1, "A100", 256, 4),
                                                  (131072, 1, "H100", 2, 1)])  # default 264 splits
def test_split_explorer_draws_the_model_and_the_grid(drive, nk, bh, gpu, splits, bps):
    sliders, callback = drive(viz.split_explorer)
    assert set(sliders) == {"Nk", "batch_heads", "gpu", "splits", "blocks_per_sm", "d"}
    fig = callback(Nk=nk, batch_heads=bh, gpu=gpu, splits=splits, blocks_per_sm=bps)
    times, speed, grid = fig.axes[:3]
    n_sm, bw = roofline.SMS[gpu], roofline.PUBLISHED[gpu].bandwidth
    default = decoding.default_num_splits(bh, nk, n_sm=n_sm)
    s = np.arange(1, min(max(256, default), nk) + 1)
    t = decoding.model_time_us(bh, nk, 128, s, n_sm=n_sm, bandwidth=bw, blocks_per_sm=bps)
    assert np.allclose(_line(times, "model").get_ydata(), t)
    assert _line(times, f"default_num_splits: {default}").get_xdata()[0] == default
    assert _line(times, f"model's best: {s[np.argmin(t)]}").get_ydata()[0] == t.min()
    assert np.allclose(_line(speed, "model").get_ydata(), t[0] / t)
    busy = grid.images[0].get_array()
    assert busy.shape == (math.ceil(bh * splits / (n_sm * bps)), n_sm * bps) and busy.sum() == bh * splits


def test_split_explorer_draws_the_measured_points(drive):
    rows, _ = dviz.load_measured()
    _, callback = drive(viz.split_explorer)
    fig = callback(Nk=65536, batch_heads=16, gpu="H100", d=128)
    speed = fig.axes[1]
    f16 = _line(speed, f"measured, float16 ({dviz.MEASURED_ON})")
    assert f16.get_xdata()[0] == 17 and np.isclose(f16.get_ydata()[0], 43186.2 / 3240.8)
    _png_ok(fig)
    fig = callback(gpu="T4")  # measured on 132 SMs: nothing to compare on a T4
    assert not [ln for ln in fig.axes[1].get_lines() if ln.get_label().startswith("measured")]
    assert any("no measurement" in t.get_text() for t in fig.axes[1].texts)
    fig = callback(gpu="H100", batch_heads=32, Nk=4096, d=64)
    assert np.isclose(_line(fig.axes[1], f"measured, float32 ({dviz.MEASURED_ON})").get_ydata()[0], 2274.3 / 858.5)


def test_recorded_decoding_matches_the_benchmark_file(tmp_path):
    if dviz.DECODING_MD.exists():
        rows, source = dviz.load_measured()
        assert source.endswith("decoding.md") and rows == dviz.RECORDED
    rows, source = dviz.load_measured(tmp_path / "missing.md")
    assert rows == dviz.RECORDED and "recorded" in source
    assert dviz.measured_speedups(rows, 16, 16384, 128) == {"float16": (17, 11018.7 / 1088.6),
                                                            "float32": (17, 11429.0 / 1241.8)}
    assert dviz.measured_speedups(rows, 16, 32768, 128) == {}


def test_split_static_grid():
    fig = viz.split_explorer()
    assert len(fig.axes) == 6
    titles = [ax.get_title() for ax in fig.axes]
    assert [t.split(",")[0] for t in titles] == ["H100"] * 3 + ["T4"] * 3
    want = [decoding.default_num_splits(bh, 16384, n_sm=roofline.SMS[g]) for g in ("H100", "T4") for bh in (4, 16, 128)]
    assert [int(t.split("default ")[1].split(",")[0]) for t in titles] == want
    _png_ok(fig)
