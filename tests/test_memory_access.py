"""The SM table, the warp-access model (sectors, bank conflicts) and its figures (lessons 07-08).

The model reproduces which word each lane of the kernels touches; the tests check that against the
kernels themselves, run in the CUDA simulator with every shared-memory access recorded.
"""
import threading
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlab import hardware  # noqa: E402
from flashlab import memory_access as ma  # noqa: E402
from flashlab.device import has_gpu  # noqa: E402
from flashlab.kernels.register import PREFERRED, Tile  # noqa: E402
from flashlab.viz import memory_access as maviz  # noqa: E402
from flashlab.viz import sm as smviz  # noqa: E402
from flashlab.viz import to_png  # noqa: E402

LANE = np.arange(32)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------------------------------ the model
def test_sectors_of_the_best_practices_guide_examples():
    """CUDA C++ Best Practices Guide, 'Coalesced Access to Global Memory': 4, 5 and 8 sectors, up to 32."""
    assert ma.coalescing(4 * LANE)["sectors"] == 4 and ma.coalescing(4 * LANE)["efficiency"] == 1
    assert ma.coalescing(4 * LANE + 4)["sectors"] == 5
    assert ma.coalescing(8 * LANE) == {"sectors": 8, "lines": 2, "bytes_used": 128, "bytes_fetched": 256,
                                       "efficiency": 0.5}
    assert ma.coalescing(4 * 64 * LANE)["sectors"] == 32
    assert ma.coalescing(16 * LANE, 16)["sectors"] == 16
    assert ma.sectors_per_request(np.full(32, 4096)) == 1
    assert ma.sectors_per_request([30], 4) == 2  # a (misaligned) access straddling a boundary counts both


def test_bank_degrees_of_the_programming_guide_examples():
    """Compute capability 5.x 'Shared Memory': strides 1 and 3 conflict-free, stride 2 two-way, broadcast free."""
    assert ma.bank_conflict_degree(LANE) == 1
    assert ma.bank_conflict_degree(2 * LANE) == 2
    assert ma.bank_conflict_degree(3 * LANE) == 1
    assert ma.bank_conflict_degree(np.zeros(32, int)) == 1
    assert ma.bank_conflict_degree(32 * LANE) == 32
    assert ma.bank_conflict_degree(33 * LANE) == 1
    table = ma.bank_table(32 * (LANE % 2))
    assert table[0] == [0, 32] and all(not b for b in table[1:])


@given(st.lists(st.integers(0, 4095), min_size=1, max_size=32), st.integers(0, 10_000))
def test_bank_degree_bounds_and_shift_invariance(words, shift):
    w = np.array(words)
    degree = ma.bank_conflict_degree(w)
    assert -(-np.unique(w).size // 32) <= degree <= np.unique(w).size
    assert ma.bank_conflict_degree(w + shift) == degree  # a common offset only renames the banks


@given(st.sampled_from([1, 2, 4, 8, 16]), st.lists(st.integers(0, 2000), min_size=1, max_size=32))
def test_sector_count_bounds(nbytes, elements):
    a = nbytes * np.array(elements)
    cost = ma.coalescing(a, nbytes)
    assert cost["sectors"] == ma.sectors_per_request(a, nbytes) == ma.sectors_touched(a, nbytes).size
    assert -(-cost["bytes_used"] // 32) <= cost["sectors"] <= np.unique(a).size
    assert cost["bytes_used"] == np.unique(a).size * nbytes  # aligned accesses never overlap


@pytest.mark.parametrize("call, words", [
    (lambda: ma.coalescing([], 4), "addresses"),
    (lambda: ma.coalescing(np.arange(33), 4), "1 to 32"),
    (lambda: ma.coalescing([-4, 0], 4), "non-negative"),
    (lambda: ma.coalescing([0.5], 4), "non-negative integers"),
    (lambda: ma.coalescing([0], 3), "nbytes"),
    (lambda: ma.bank_conflict_degree([[1, 2]]), "words"),
    (lambda: ma.tile_access(3, 64), "lanes_per_row"),
    (lambda: ma.tile_access(32, 16), "row_len"),
    (lambda: hardware.gpu("A100"), "H100"),
    (lambda: hardware.scheduler_timeline(0, 4, 8), "warps"),
    (lambda: maviz.warp_tile_copy(8, 0, 64, "diagonal", 0), "layout"),
    (lambda: maviz.warp_tile_copy(8, 0, 64, "row-major", -1), "pad"),
])
def test_bad_input_is_named(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_register_kernel_padding_makes_every_tile_copy_conflict_free():
    for d, tiles in PREFERRED.items():
        for tile in tiles:
            for it in range(2):
                padded = ma.register_kernel_stores(d, tile, it=it)
                assert all(ma.bank_conflict_degree(w) == 1 for w in padded.values()), (d, tile)
                bare = ma.register_kernel_stores(d, tile, it=it, pad={"Qt": 0, "Kt": 0, "V": 0})
                assert ma.bank_conflict_degree(bare["Qt"]) > 1 and ma.bank_conflict_degree(bare["V"]) > 1
                c, x = ma.register_kernel_copy(d, tile, it=it)
                assert ma.coalescing(4 * (c * d + x))["efficiency"] == 1  # runs of 8 lanes fill sectors


def test_register_kernel_inner_loads_ask_no_bank_for_two_words_at_d64():
    for tile in PREFERRED[64]:
        for name, instructions in ma.register_kernel_loads(64, tile, step=5).items():
            assert all(ma.bank_conflict_degree(w.ravel()) == 1 for w in instructions), (tile, name)


def test_scheduler_timeline_fills_the_issue_slots_with_enough_warps():
    for warps in (1, 2, 3, 4, 6):
        issued = hardware.scheduler_timeline(warps, 4, 400)
        busy = sum(w is not None for w in issued) / len(issued)
        assert busy == pytest.approx(min(1, warps / 4), abs=0.01)
        assert set(w for w in issued if w is not None) == set(range(warps))


def test_gpu_table_is_consistent():
    h100, t4 = hardware.GPUS["H100"], hardware.GPUS["T4"]
    assert (h100.sms, h100.max_warps_per_sm, h100.shared_per_block, h100.l2_bytes) == (132, 64, 227 * 1024, 50 << 20)
    assert (t4.sms, t4.max_warps_per_sm, t4.shared_per_sm, t4.l2_bytes) == (40, 32, 64 * 1024, 4 << 20)
    for g in hardware.GPUS.values():
        assert g.shared_per_block <= g.shared_per_sm <= g.l1_shared_per_sm
        assert g.per_partition(g.registers_per_sm) == 16384
        # FP32 peak = lanes x 2 FLOPs per FMA x clock: a boost clock between 1 and 2.5 GHz
        assert 1e9 < g.fp32_flops / (2 * g.sms * g.fp32_per_sm) < 2.5e9
    assert hardware.size_text(228 * 1024) == "228 KB" and hardware.size_text(50 << 20) == "50 MB"


# ------------------------------------------------------------------------- the model against the kernels
def _trace(run):
    """Run `run()` in the simulator and record every shared-memory store and load: (array, thread, epoch) ->
    flat indices in program order; the epoch counts the thread's cuda.syncthreads() calls."""
    from flashlab.grading import simcheck

    stores, loads = defaultdict(list), defaultdict(list)
    set_item, get_item = simcheck._Tracked.__setitem__, simcheck._Tracked.__getitem__

    def key(array):
        th = threading.current_thread()
        return array.name, getattr(th, "thread_id", 0), getattr(th, "_flashlab_epoch", 0)

    def spy_set(self, idx, value):
        stores[key(self)].append(int(self._where(idx)[0]))
        set_item(self, idx, value)

    def spy_get(self, idx):
        loads[key(self)].append(int(self._where(idx)[0]))
        return get_item(self, idx)

    simcheck._Tracked.__setitem__, simcheck._Tracked.__getitem__ = spy_set, spy_get
    try:
        with simcheck.racecheck():
            run()
    finally:
        simcheck._Tracked.__setitem__, simcheck._Tracked.__getitem__ = set_item, get_item
    return stores, loads


def _device(*arrays):
    from flashlab.device import get_cuda

    return [get_cuda().to_device(a) for a in arrays]


@pytest.mark.skipif(has_gpu(), reason="traces the CUDA simulator")
def test_model_matches_the_register_kernels_shared_memory_accesses():
    from flashlab.kernels import register

    d, tile = 16, Tile(16, 16, 4, 8)  # one block of one warp
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 16, d)).astype(np.float32) for _ in range(3))
    o, lse = np.zeros_like(q), np.zeros((1, 1, 16), np.float32)
    stores, loads = _trace(lambda: register.launch(*_device(q, k, v, o, lse), 1, 0.25, False, tile))
    qs, ks, vs = tile.block_q + 4, tile.block_k + 4, d + 8
    kp = d * qs  # where Kt (and later Pt) and V start in the kernel's one shared buffer
    vo = kp + max(d * ks, tile.block_k * qs)
    rm, rn, rd = tile.micro(d)
    for it in range(tile.block_q * d // tile.threads):
        model = ma.register_kernel_stores(d, tile, it=it)
        for lane in range(32):
            assert stores[("sh", lane, 0)][it] == model["Qt"][lane]  # epoch 0: Q tile, transposed
            assert stores[("sh", lane, 1)][2 * it: 2 * it + 2] == [kp + model["Kt"][lane], vo + model["V"][lane]]
    for step in range(d):  # epoch 2: the S = Q K^T loop; epoch 4: the O += P V loop
        model = {name: np.concatenate(runs, axis=1) for name, runs in ma.register_kernel_loads(d, tile, step).items()}
        for lane in range(32):
            s_loop = loads[("sh", lane, 2)][step * (rm + rn):(step + 1) * (rm + rn)]
            assert s_loop == list(model["Qt"][lane]) + list(kp + model["Kt"][lane])
            if step < tile.block_k:
                pv_loop = loads[("sh", lane, 4)][step * (rm + rd):(step + 1) * (rm + rd)]
                assert pv_loop == list(kp + model["Pt"][lane]) + list(vo + model["V"][lane])


@pytest.mark.skipif(has_gpu(), reason="traces the CUDA simulator")
def test_model_matches_the_shared_kernels_tile_copy():
    from flashlab.kernels import shared

    d, bq, bk = 16, 32, 16
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 20, d)).astype(np.float32) for _ in range(3))
    o, lse = np.zeros_like(q), np.zeros((1, 1, 20), np.float32)
    stores, _ = _trace(lambda: shared.launch(*_device(q, k, v, o, lse), 1, 0.25, False, bq, bk))
    for it in range(bk * d // bq):
        c, x = ma.shared_kernel_copy(d, bq, bk, it=it)
        for lane in range(32):
            # each element is zeroed, then written when its key exists: two stores per element
            assert stores[("Ks", lane, 1)][2 * it: 2 * it + 2] == [c[lane] * d + x[lane]] * 2


# ------------------------------------------------------------------------------------------ figures
def test_sm_figure_shows_the_tables_numbers():
    fig = smviz.plot_sm(("H100", "T4"))
    text = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    for needle in ("132 SMs", "40 SMs", "228 KB per SM", "227 KB per block", "50 MB", "4 MB", "3.35 TB/s",
                   "320 GB/s", "16,384 x 32-bit", "32 FP32 units", "16 FP32 units", "64 warps", "32 warps"):
        assert needle in text, needle
    to_png(fig)


def test_latency_hiding_figure_reports_the_busy_fraction():
    fig = smviz.plot_latency_hiding(warps=(1, 2, 4), latency=4, cycles=20)
    text = [t.get_text() for t in fig.axes[0].texts]
    assert "25% busy" in text and "50% busy" in text and "100% busy" in text
    to_png(fig)


def test_access_figures_count_what_the_model_counts():
    fig = maviz.plot_sectors(256 * LANE, 4)
    assert "32 sectors" in fig.axes[0].get_title() and "more lines" in " ".join(t.get_text() for t in fig.axes[0].texts)
    fig = maviz.plot_banks(32 * LANE)
    assert "32-way" in fig.axes[0].get_title()
    fig = maviz.plot_access_grid({"a": (4 * LANE, 4), "b": (8 * LANE, 4)}, "sectors")
    assert [a.get_title().split("\n")[1].split(":")[0] for a in fig.axes] == ["4 sectors", "8 sectors"]
    to_png(maviz.plot_access_grid({"stride 1": LANE, "stride 2": 2 * LANE, "one word": 0 * LANE}, "banks"))
    with pytest.raises(ValueError, match="kind"):
        maviz.plot_access_grid({}, "lines")


def test_explorer_falls_back_to_a_static_grid():
    fig = maviz.access_explorer()  # pytest is not a Jupyter kernel
    assert isinstance(fig, plt.Figure) and len(fig.axes) == 6  # 2 paddings x 3 patterns
    insets = [child for a in fig.axes for child in a.child_axes]  # each panel: HBM sectors and banks
    assert len(insets) == 12
    titles = [a.get_title() for a in insets]
    assert "banks: 8-way conflict" in titles and "banks: conflict-free" in titles and "HBM: 32 sectors" in titles
    to_png(fig)


def test_explorer_callback_redraws_for_each_setting(monkeypatch):
    widgets = pytest.importorskip("ipywidgets")
    from flashlab.viz import _base

    calls = {}

    def fake_interact(fn, **controls):
        calls.update(controls)
        fn(**{name: c.value for name, c in controls.items()})  # the first drawing, with the defaults
        fn(lanes_per_row=1, offset=0, d=64, layout="transposed", pad=4)  # a slider moved
        fn(lanes_per_row=32, offset=8, d=16, layout="row-major", pad=0)  # an impossible combination
        return "interact"

    drawn = []
    monkeypatch.setattr(_base, "use_widgets", lambda interactive=None: True)
    monkeypatch.setattr(widgets, "interact", fake_interact)
    monkeypatch.setattr(plt, "show", lambda: drawn.append(plt.gcf()))
    assert maviz.access_explorer() == "interact"
    assert set(calls) == {"lanes_per_row", "offset", "d", "layout", "pad"}
    assert all(isinstance(c, widgets.SelectionSlider) for c in calls.values())
    first, moved, impossible = drawn
    assert "4 sectors" in first.axes[0].get_title() and "8-way" in first.axes[1].get_title()
    assert "32 sectors" in moved.axes[0].get_title() and "conflict-free" in moved.axes[1].get_title()
    assert "not possible" in impossible.axes[0].texts[0].get_text()
