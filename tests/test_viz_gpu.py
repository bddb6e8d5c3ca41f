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


def test_tile_sweep_labels_are_readable_on_their_cells():
    from flashlab.viz._base import relative_luminance

    rows = [r for r in sweep_rows() if r["d"] == 64 and r["tr"] == 8]
    for r, v in zip(rows, (100, 100, 100, 100, 70, 0)):  # skewed: 70 is below the mean yet light in viridis
        r["tflops"] = v
    fig = gviz.plot_tile_sweep(rows, d=64)
    ax = fig.axes[0]
    im = ax.get_images()[0]
    for t in ax.texts:
        j, i = (int(round(v)) for v in t.get_position())
        lum = sorted((relative_luminance(matplotlib.colors.to_rgba(t.get_color())),
                      relative_luminance(im.cmap(im.norm(im.get_array()[i, j])))), reverse=True)
        assert (lum[0] + 0.05) / (lum[1] + 0.05) > 4.5, (t.get_text(), t.get_color())  # WCAG AA contrast


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


def write_issue_profile(path, variants):
    """A profile CSV in benchmarks/profiling/profile_issue_slots.py's long format: {variant: {key: value}}."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["gpu", "variant", "N", "d", "key", "value"])
        w.writeheader()
        for variant, rec in variants.items():
            w.writerows({"gpu": "Fake GPU", "variant": variant, "N": 4096, "d": 64, "key": k, "value": v}
                        for k, v in rec.items())


def test_issue_summary_is_busy_times_ffma_share(tmp_path):
    rec = {"tflops": 20.0, "inst": 200.0, "kind:FFMA": 120.0, "kind:shared memory": 30.0,
           "kind:other (moves etc.)": 50.0, "issue_active_pct": 80.0, "warps_per_scheduler": 3.5,
           "stall_selected": 1.0, "stall_wait": 0.4, "stall_barrier": 0.9}
    write_issue_profile(tmp_path / "p.csv", {"register": rec})
    profile = gviz.load_issue_profile(tmp_path / "p.csv")
    s = gviz.issue_summary(profile["register"])
    assert s["ffma_share"] == pytest.approx(0.6) and s["issue_busy"] == pytest.approx(0.8)
    assert s["predicted_peak_fraction"] == pytest.approx(0.48) and s["per_ffma"] == pytest.approx(200 / 120)
    assert list(s["stalls"]) == ["barrier", "wait"]  # largest first; "selected" is not a stall
    assert profile["register"]["gpu"] == "Fake GPU" and profile["register"]["N"] == 4096
    assert gviz.load_issue_profile(tmp_path / "missing.csv") == {}
    with pytest.raises(ValueError, match="profile_issue_slots.py"):
        gviz.plot_issue_profile({})


def test_recorded_issue_profile_is_consistent():
    profile = gviz.load_issue_profile()
    assert set(profile) == {"shared", "register"}
    for rec in profile.values():
        kinds = sum(v for k, v in rec.items() if k.startswith("kind:"))
        assert kinds == pytest.approx(rec["inst"], rel=1e-3)  # the kinds partition the instructions
        # 2 FLOPs per FFMA lane: the FFMAs executed are the algorithm's 4 B H N^2 d FLOPs (B = 1, H = 16)
        assert 64 * rec["kind:FFMA"] == pytest.approx(4 * 16 * rec["N"] ** 2 * rec["d"], rel=0.02)
        s = gviz.issue_summary(rec)
        assert s["predicted_peak_fraction"] == pytest.approx(s["tflops"] / 67, abs=0.03)  # H100 FP32 peak
    fig = gviz.plot_issue_profile(profile, peak_tflops=67)
    assert len(fig.axes) == 2
    to_png(fig)
