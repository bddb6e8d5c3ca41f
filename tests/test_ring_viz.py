"""Lesson 19's figures and explorer (flashlab.viz.ring): what they draw is checked against flashlab.ring's
layouts and model; the explorer is driven as a live kernel would, and its static fallback is drawn too."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flashlab.ring import causal_work, model  # noqa: E402
from flashlab.viz import ring as rviz  # noqa: E402
from test_explorers import drive  # noqa: E402,F401  (the fixture that runs an explorer's widget callback)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _compute_bars(ax):
    return [p for p in ax.patches if p.get_height() == pytest.approx(0.5)]


@pytest.mark.parametrize("world_size,N,link,layout,causal", [
    (4, 131072, "NVLink 4 (450 GB/s)", "zigzag", True), (8, 8192, "PCIe 4 (32 GB/s)", "zigzag", True),
    (4, 32768, "InfiniBand NDR (50 GB/s)", "contiguous", True), (2, 8192, "NVLink 4 (450 GB/s)", "zigzag", False),
])
def test_explorer_draws_the_model_timeline(drive, world_size, N, link, layout, causal):
    sliders, callback = drive(rviz.ring_explorer)
    assert {"world_size", "N", "d", "link", "layout", "causal"} <= set(sliders)
    fig = callback(world_size=world_size, N=N, link=link, layout=layout, causal=causal, d=128)
    ax = fig.axes[0]
    tl = model.timeline(world_size, N, 128, 32, 8, 2, model.H100_ATTENTION_FLOPS, rviz.BANDWIDTHS[link], layout,
                        causal)
    scale = 1e3 if tl.total >= 1e-3 else 1e6
    widths = sorted(p.get_width() for p in _compute_bars(ax))
    want = sorted(x * scale for x in tl.compute.ravel() if x > 0)  # skipped blocks draw no bar
    assert np.allclose(widths, want)
    compute = model.step_flops(N / world_size, 128, 32, 0.5 if causal else 1.0) / model.H100_ATTENTION_FLOPS
    assert ("compute-bound" if compute >= tl.transfer else "link-bound") in ax.get_title()


def test_explorer_static_fallback():
    fig = rviz.ring_explorer(interactive=False)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 4 and any("link-bound" in t for t in titles) and any("compute-bound" in t for t in titles)


def test_ring_steps_label_the_shard_each_rank_holds():
    fig = rviz.plot_ring_steps(4, "contiguous", causal=True)
    texts = [t.get_text() for t in fig.axes[0].texts]
    held = [t for t in texts if t.startswith("K/V")]
    assert held[:4] == ["K/V 0", "K/V 3", "K/V 2", "K/V 1"]  # rank 0 at steps 0..3: (0 - t) mod 4
    assert texts.count("skip") == int((causal_work(4, "contiguous") == 0).sum()) == 6


def test_causal_work_bars():
    fig = rviz.plot_causal_work(8)
    bars = [p.get_height() for p in fig.axes[0].patches]
    assert np.allclose(bars[:8], np.arange(8) + 0.5) and np.allclose(bars[8:], 4.0)


def test_cpu_measurement_and_scale_figures():
    data = rviz.load_cpu_measurement()
    assert data["date"] and "CPU, gloo, no GPU" in data["machine"]
    assert {r["W"] for r in data["rows"]} == {1, 2, 4} and len({r["N"] for r in data["rows"]}) >= 2
    fig = rviz.plot_cpu_measurement(data)
    lines = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("ring, N =")]
    assert len(lines) == len({r["N"] for r in data["rows"]})
    fig = rviz.plot_at_scale()
    assert len(fig.axes) == 2
    fig = rviz.plot_crossover()
    dots = [line for line in fig.axes[0].get_lines() if line.get_marker() == "o"]
    assert len(dots) == len(rviz.LINKS)
    fig = rviz.plot_score_owners(16, 4, "zigzag")
    assert fig.axes[0].images


# -- a multi-GPU run (benchmarks/timing/bench_ring_gpus.py): drawn from a made-up file in a temporary folder ---
@pytest.fixture
def gpu_run(tmp_path):
    """A small result file in bench_ring_gpus.py's layout, with invented numbers (not a measurement)."""
    rows = []
    for series in ("total", "per_gpu"):
        for layout in ("zigzag", "contiguous"):
            for w in (1, 2, 4):
                n = 4096 if series == "total" else 1024 * w
                compute = [1.0 + (r if layout == "contiguous" else 0.1 * r) for r in range(w)]
                rows.append(dict(series=series, layout=layout, causal=True, W=w, N=n, tokens_per_rank=n // w,
                                 step_ms=2.0 / w + 0.1, model_step_ms=2.0 / w, model_step_ms_datasheet=1.0 / w,
                                 efficiency_forward=1.0 - 0.1 * (w - 1), efficiency_forward_backward=0.9 - 0.1 * w,
                                 compute_ms_per_rank=compute, wait_ms_per_rank=[0.1] * w, wait_fraction=0.05,
                                 balance_compute=(max(compute) - min(compute)) / np.mean(compute)))
    data = dict(date="2000-01-01 00:00 UTC", gpu="Made-up GPU", world_size=4, worlds=[1, 2, 4],
                setup=dict(B=1, heads=8, d=64, dtypes=["bfloat16"]), scaling=rows)
    path = tmp_path / "ring_gpus.json"
    path.write_text(json.dumps(data))
    return path


def test_gpu_measurement_absent_is_none(tmp_path):
    assert rviz.load_gpu_measurement(tmp_path / "missing.json") is None


def test_gpu_measurement_figure(gpu_run):
    data = rviz.load_gpu_measurement(gpu_run)
    fig = rviz.plot_gpu_measurement(data)
    assert "Made-up GPU" in fig._suptitle.get_text() and "2000-01-01" in fig._suptitle.get_text()
    steps, eff, ranks = fig.axes
    measured = {line.get_label(): line for line in steps.get_lines() if line.get_label().startswith("measured")}
    total = measured["measured, N = 4,096"]
    assert list(total.get_xdata()) == [1, 2, 4] and np.allclose(total.get_ydata(), [2.1, 1.1, 0.6])
    model_lines = [line for line in steps.get_lines() if line.get_label() == "model, this run's rates"]
    assert len(model_lines) == 2 and np.allclose(model_lines[0].get_ydata(), [2.0, 1.0, 0.5])
    forward = [line for line in eff.get_lines() if line.get_label() == "fixed total N: forward"][0]
    assert np.allclose(forward.get_ydata(), [1.0, 0.9, 0.7])
    heights = [p.get_height() for p in ranks.patches]
    assert len(heights) == 2 * 2 * 4  # zigzag and contiguous, compute and wait, 4 ranks
    assert np.allclose(heights[0:8:2], [1.0, 1.1, 1.2, 1.3]) and np.allclose(heights[8::2], [1, 2, 3, 4])
    assert any("spread" in t.get_text() for t in ranks.get_legend().get_texts())
