"""The figures of lessons 15-17 (flashlab.viz.tensor): each is checked against the model it draws (flashlab.fragments,
the simulator's ldmatrix, the committed benchmark files), the explorer's callback is driven, and the code
sections the lesson prints from kernels/tensor.py are still found there."""
import csv
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flashlab import fragments as F  # noqa: E402
from flashlab import viz  # noqa: E402
from flashlab.device import get_cuda  # noqa: E402
from flashlab.kernels.demo import ldmatrix_both  # noqa: E402
from flashlab.viz import tensor as T  # noqa: E402
from test_explorers import drive  # noqa: E402,F401  (the fixture that runs an explorer's widget callback)

ROOT = Path(__file__).resolve().parent.parent
cuda = get_cuda()  # a module global: the simulator swaps it while a kernel runs


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _cells(ax, highlighted_only=False):
    """{(x, y): facecolor} of the unit cells drawn on ax (the highlighted ones: black edge)."""
    out = {}
    for p in ax.patches:
        if isinstance(p, plt.Rectangle) and p.get_width() == 1:
            if highlighted_only and tuple(p.get_edgecolor()[:3]) != (0, 0, 0):
                continue
            out[(p.get_x(), p.get_y())] = p.get_facecolor()
    return out


def _offsets(layout):
    """x offsets of A, B and C in plot_fragments (A, then B, then C, 2.5 cells apart)."""
    M, N, K = F.SHAPES[T.LAYOUTS[layout][0]]
    return {"A": 0, "B": K + 2.5, "C": K + 2.5 + N + 2.5}


@pytest.mark.parametrize("layout", ["f16", "tf32"])
def test_fragment_figure_colours_every_cell_by_the_lane_that_holds_it(layout):
    shape, dtype = T.LAYOUTS[layout]
    ax = T.plot_fragments(layout).axes[0]
    cells = _cells(ax)
    off = _offsets(layout)
    n = 0
    for op in ("A", "B", "C"):
        for lane, frag in enumerate(F.fragment_map(shape, op, dtype)):
            for r, c in frag:
                assert cells[(off[op] + c, r)][:3] == pytest.approx(T.lane_color(lane)[:3]), (op, lane, r, c)
                n += 1
    assert n == len(cells)


@pytest.mark.parametrize("layout,lane", [("f16", 13), ("tf32", 13), ("f16", 31), ("tf32", 0)])
def test_highlighted_lane_shows_exactly_its_fragment(layout, lane):
    shape, dtype = T.LAYOUTS[layout]
    ax = T.plot_fragments(layout, lane=lane).axes[0]
    off = _offsets(layout)
    want = {(off[op] + c, r) for op in "ABC" for r, c in F.fragment_map(shape, op, dtype)[lane]}
    assert set(_cells(ax, highlighted_only=True)) == want


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layout must be one of"):
        T.plot_fragments("bf16")
    with pytest.raises(ValueError, match="lane must be an integer in 0..31"):
        T.plot_fragments("f16", lane=32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        T.tensor_product(np.ones((2, 2)), np.ones((2, 2)), "fp8")


def test_fragment_explorer_callback_highlights_the_chosen_lane(drive):  # noqa: F811
    sliders, callback = drive(T.fragment_explorer)
    assert set(sliders) == {"lane", "layout"}
    for lane, layout in ((5, "tf32"), (30, "f16")):
        fig = callback(lane=lane, layout=layout)
        shape, dtype = T.LAYOUTS[layout]
        off = _offsets(layout)
        want = {(off[op] + c, r) for op in "ABC" for r, c in F.fragment_map(shape, op, dtype)[lane]}
        assert set(_cells(fig.axes[0], highlighted_only=True)) == want


def test_fragment_explorer_static_grid():
    fig = T.fragment_explorer(interactive=False)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"{layout}: lane {lane}" for layout in ("f16", "tf32") for lane in (0, 13, 31)]
    assert len(viz.to_png(fig)) > 2000


def test_p_stays_in_registers_for_16_bit_and_is_renumbered_for_tf32():
    np.testing.assert_array_equal(T.c_tiles_as_a("f16"), F.fragment_map("m16n8k16", "A", "float16"))
    c, a = T.c_tiles_as_a("tf32"), F.fragment_map("m16n8k8", "A", "tf32")
    assert np.array_equal(c[..., 0], a[..., 0]) and not np.array_equal(c[..., 1], a[..., 1])
    renumber = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # key 2t -> column t, key 2t + 1 -> column t + 4
    np.testing.assert_array_equal(renumber[c[..., 1]], a[..., 1])
    titles = [ax.get_title() for ax in T.plot_p_in_registers("f16").axes]
    assert "no data moves" in titles[1]
    assert "column t as key 2t" in T.plot_p_in_registers("tf32").axes[1].get_title()


def test_ldmatrix_figure_matches_the_instruction():
    """In the simulator: its emulation of ldmatrix; on a GPU (sm_75+): the hardware."""
    values = np.add.outer(10 * np.arange(32), np.arange(8)).astype(np.float32)  # row r, column j: 10 r + j
    words = F.registers16(values)
    plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    ldmatrix_both[1, 32](words, plain, trans)
    axes = T.plot_ldmatrix().axes
    for ax, regs in zip(axes, (plain, trans)):
        got = sorted(float(F.from_bits16(h, "float16")) for h in F.unpack16(regs[5, 0]))
        drawn = sorted(10 * y + x for x, y in _cells(ax, highlighted_only=True))  # x = dim, y = key
        assert got == drawn


def test_quad_reduction_ends_with_the_max_everywhere():
    values = (2.0, -1.0, 9.5, 4.0)
    ax = T.plot_quad_reduction(values).axes[0]
    last = [float(t.get_text()) for t in ax.texts if re.fullmatch(r"-?[\d.]+", t.get_text())][-4:]
    assert last == [max(values)] * 4


def _by_gid(ax):
    out = {}
    for p in ax.patches:
        if p.get_gid():
            out.setdefault(p.get_gid(), []).append(p)
    return out


@pytest.mark.parametrize("warps, block_q, query", [(4, 32, 5), (2, 16, 12), (1, 48, 47)])
def test_backward_block_gives_each_warp_16_keys_and_a_query_crosses_them_all(warps, block_q, query):
    ax = T.plot_backward_block(warps, block_q, query).axes[0]
    parts = _by_gid(ax)
    for w in range(warps):  # warp w: rows 16w..16w+15 of the key block, and the same rows of S^T and dS^T
        for name in (f"keys {w}", f"S^T {w}", f"dS^T {w}"):
            (band,) = parts[name]
            assert (band.get_y(), band.get_height()) == (16 * w, 16), name
        (st,) = parts[f"S^T {w}"]
        assert st.get_width() == block_q
        assert any(t.get_text().startswith(f"warp {w}\nkeys\n{16 * w}-{16 * w + 15}") for t in ax.texts)
    assert f"keys {warps}" not in parts
    s0, d0 = parts["S^T 0"][0].get_x(), parts["dS^T 0"][0].get_x()
    cols = sorted(parts["query column"], key=lambda p: p.get_x())
    assert [(p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in cols] == [
        (s0 + query, 0, 1, 16 * warps), (d0 + query, 0, 1, 16 * warps)]  # one column of dS^T, every warp's band
    (row,) = parts["query row"]
    (dq,) = parts["dQ"]
    assert (row.get_y(), row.get_height(), dq.get_height()) == (query, 1, block_q)  # dQ's rows are queries
    assert f"block_k = {16 * warps} keys" in ax.get_title()


def test_backward_block_names_bad_arguments():
    for kw, word in ((dict(warps=0), "warps"), (dict(warps=2.0), "warps"), (dict(block_q=24), "block_q"),
                     (dict(block_q=32, query=32), "query"), (dict(query=True), "query")):
        with pytest.raises(ValueError, match=word):
            T.plot_backward_block(**kw)


@pytest.mark.parametrize("lane", [0, 5, 31])
def test_ds_transpose_outlines_where_the_lanes_values_are(lane):
    src = T.ds_sources()[lane]
    A, C = F.fragment_map("m16n8k16", "A", "float16")[lane], F.fragment_map("m16n8k16", "C", "float16")
    dS_T = np.arange(256.0).reshape(16, 16)  # every cell its own value: C's n-tile n holds columns 8n..8n+7
    got = [dS_T[C[L, c][0], 8 * n + C[L, c][1]] for n, L, c in src]
    assert got == [dS_T[key, query] for query, key in A]  # the source of A's (query, key) is dS^T[key, query]
    left, right = T.plot_ds_transpose(lane).axes
    outlined = {(p.get_x(), p.get_y()) for p in left.patches if not p.get_fill()}
    assert outlined == {(8 * n + 0.3 * n + C[L, c][1], C[L, c][0]) for n, L, c in src}
    moved = int((src[:, 1] != lane).sum())
    assert f"lane {lane} needs {moved} of its 8" in right.get_title()


def test_tensor_product_model_is_a_chain_of_warp_mma(rng):
    A = rng.standard_normal((16, 24)).astype(np.float32)
    B = rng.standard_normal((24, 8)).astype(np.float32)
    c = np.zeros((32, 4), np.float32)
    Ar, Br = F.round_tf32(A), F.round_tf32(B)
    for k0 in range(0, 24, 8):  # three m16n8k8 tf32 mma accumulating in C, as the kernel chains them
        c = F.warp_mma(F.to_fragments(Ar[:, k0:k0 + 8], "m16n8k8", "A", "tf32"),
                       F.to_fragments(Br[k0:k0 + 8], "m16n8k8", "B", "tf32"), c, "m16n8k8", "tf32")
    np.testing.assert_array_equal(T.tensor_product(A, B, "tf32"), F.from_fragments(c, "m16n8k8", "C", "tf32"))


def test_format_errors_show_what_the_lesson_says():
    e = T.format_errors(sizes=(16, 256), scales=(1e-6, 1.0, 1e6), trials=1)
    size, scale = e["size"], e["scale"]
    for i in range(2):
        assert size["3xtf32"][i] < 1e-6 < 1e-4 < size["tf32"][i] < size["bf16"][i]
        assert size["tf32"][i] == pytest.approx(size["fp16"][i], rel=0.5)  # same 11 significand bits
    assert np.isinf(scale["fp16"][2]) and scale["fp16"][0] > 10 * scale["fp16"][1]  # overflow; subnormals
    assert all(np.isfinite(scale[f]).all() for f in ("tf32", "bf16", "3xtf32"))
    axes = T.plot_format_errors(e).axes
    assert len(axes[0].get_lines()) == len(T.FORMATS)
    # a truncating tensor-core sum over all of K falls behind fp32 as K grows; restarting it every 64 columns and
    # adding the pieces in fp32 keeps fp32's level
    e = T.format_errors(sizes=(64, 2048), scales=(1.0,), trials=1)["size"]
    assert e["3xtf32 tc"][1] > 3 * e["3xtf32 tc"][0] and e["3xtf32 tc"][1] > 3 * e["fp32"][1]
    assert e["3xtf32 tc, fp32 adds"][1] < 2 * e["fp32"][1]


def test_the_tensor_core_sum_truncates_without_guard_bits():
    """_tc_add (Fasi et al. 2021): terms aligned to the largest and cut toward zero at fp32's 24 bits."""
    big, small = 1.0, 2.0 ** -24 * 1.5  # small falls below the last bit of big's 24-bit significand, partly
    got = T._tc_add(np.zeros((1, 1)), np.array([big, small]).reshape(1, 2, 1))
    assert got[0, 0] == 1.0  # round to nearest would give 1 + 2**-23
    assert np.float32(big + small) == np.float32(1.0 + 2.0 ** -23)
    neg = T._tc_add(np.zeros((1, 1)), np.array([-big, -small]).reshape(1, 2, 1))
    assert neg[0, 0] == -1.0  # toward zero on both sides
    exact = T._tc_add(np.zeros((1, 1)), np.array([0.75, 0.125]).reshape(1, 2, 1))
    assert exact[0, 0] == 0.875


def test_the_lesson_prints_the_float16_path_step_by_step():
    """Lesson 16 prints the float16 build's body and its steps (tensor.float16_source), each of which exists and
    holds code; the body calls every step the lesson prints, and the mask is among them."""
    from flashlab.kernels import tensor

    lesson = (ROOT / "course" / "lessons" / "16_tensor_core_forward.py").read_text()
    assert "source_between" not in lesson
    shown = re.findall(r'tensor\.float16_source\("(\w+)"\)', lesson)
    assert shown[0] == "body" and {"load_q", "copy_tile", "scores", "mask", "softmax", "pv", "finish"} <= set(shown)
    body = tensor.float16_source("body")
    for step in shown[1:]:
        assert f"{step}(" in body, step
        assert len(tensor.float16_source(step).splitlines()) >= 3, step
    with pytest.raises(AttributeError):
        tensor.float16_source("no_such_step")


def test_benchmark_figures_draw_the_committed_numbers():
    with open(T.TENSOR_CSV, newline="") as f:
        raw = list(csv.DictReader(f))
    rows, ceiling = T.load_tensor_results(), T.load_mma_ceiling()
    assert len(rows) == len(raw) and ceiling and "gpu" in ceiling
    ax = T.plot_tensor_speed(rows, d=64).axes[0]
    f16 = next(line for line in ax.get_lines() if line.get_label() == "tensor f16")
    want = sorted((int(r["N"]), float(r["tflops"])) for r in raw
                  if r["impl"] == "flashlab tensor f16" and r["d"] == "64" and r["causal"] == "0")
    assert list(zip(f16.get_xdata(), f16.get_ydata())) == want
    shares = T.ceiling_shares(rows, ceiling, d=64)
    n_max = max(int(r["N"]) for r in raw)
    for impl, share in shares.items():
        r = next(r for r in raw if r["impl"] == impl and int(r["N"]) == n_max and r["d"] == "64" and r["causal"] == "0")
        assert share == pytest.approx(float(r["tflops"]) / ceiling[T.CEILING_OF[impl]])
    assert set(shares) == set(T.CEILING_OF)
    for fig in (T.plot_ceiling_shares(rows, ceiling), T.plot_mma_ceiling(ceiling, 67e12, 989e12)):
        assert len(viz.to_png(fig)) > 2000


def test_roofline_gets_the_tensor_points_and_the_mma_roofs():
    from flashlab.viz import gpu

    rows, ceiling = T.load_tensor_results(), T.load_mma_ceiling()
    roofs = T.mma_roofs(ceiling)
    assert [r.peak_flops for r in roofs] == [ceiling["fp16 m16n8k16"] * 1e12,
                                            ceiling["3xTF32 (3 tf32 mma per product)"] * 1e12]
    points = T.tensor_roofline_points(rows, N=4096, d=64)
    assert set(points) == {"flashlab tensor f16", "flashlab tensor 3xtf32"}
    inten16, inten32 = points["flashlab tensor f16"][0], points["flashlab tensor 3xtf32"][0]
    assert inten16 > inten32  # same FLOPs, half the bytes per element (and no smaller tile)
    ax = gpu.plot_kernel_roofline(points, roofs=roofs).axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert all(r.name in labels for r in roofs)


def test_missing_benchmark_files_give_empty_data_and_a_note(tmp_path):
    assert T.load_tensor_results(tmp_path / "none.csv") == [] and T.load_mma_ceiling(tmp_path / "none.csv") == {}
    assert T.mma_ceiling_file() in (T.MMA_CSV, T.H100_MMA_CSV) and T.mma_ceiling_file().exists()
    ax = T.plot_tensor_speed([], d=64).axes[0]
    assert any("no tensor benchmark" in t.get_text() for t in ax.texts)
    ax = T.plot_mma_ceiling({}).axes[0]
    assert any("no mma ceiling data" in t.get_text() for t in ax.texts)
    assert T.ceiling_shares([], {}) == {}


def test_ceiling_files_old_and_new_load_by_operands(tmp_path):
    """The older file (no operands column: constant operands) and the one mma_ceiling.py writes now (random and
    constant rows, the date and the clocks) load alike; random operands are preferred, the metadata says which."""
    old = tmp_path / "old.csv"
    old.write_text("instruction,tflops,gpu\nfp16 m16n8k16,500.0,Some GPU\nbf16 m16n8k16,450.0,Some GPU\n")
    c = T.load_mma_ceiling(old)
    assert c["fp16 m16n8k16"] == 500.0 and c["operands"] == T.CONSTANT_OPERANDS and c["gpu"] == "Some GPU"
    new = tmp_path / "new.csv"
    new.write_text("instruction,operands,tflops,tflops_min,tflops_max,sm_clock_mhz,power_w,gpu,date\n"
                   "fp16 m16n8k16,random,400.0,399.0,401.0,1755,690.5,Other GPU,2026-11-28\n"
                   f"fp16 m16n8k16,{T.CONSTANT_OPERANDS},520.0,519.0,521.0,1980,600.0,Other GPU,2026-11-28\n")
    c = T.load_mma_ceiling(new)
    assert c["fp16 m16n8k16"] == 400.0 and c["operands"] == "random" and c["date"] == "2026-11-28"
    assert c["sm_clock_mhz"] == 1755 and c["power_w"] == 690.5
    assert T.load_mma_ceiling(new, operands=T.CONSTANT_OPERANDS)["fp16 m16n8k16"] == 520.0
    ax = T.plot_mma_ceiling(c).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fp16 m16n8k16"]  # metadata is not a bar


def test_the_ceiling_script_measures_random_and_constant_operands():
    """benchmarks/timing/mma_ceiling.py's operands: random values of each format (different for every chain),
    or the 0/1-bit words of a kernel without data."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mma_ceiling", ROOT / "benchmarks" / "timing" / "mma_ceiling.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = np.random.default_rng(0)
    f16 = script.operands("float16", "random", rng)
    assert f16.dtype == np.uint32 and f16.shape == (32, script.CHAINS, script.WORDS)
    low = (f16 & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    assert 0.8 < low.std() < 1.2 and len(np.unique(f16)) > 0.9 * f16.size  # normal values, all different
    bf16 = script.operands("bfloat16", "random", rng)
    high = (bf16 & 0xFFFF0000).view(np.float32)
    assert 0.8 < high.std() < 1.2
    assert script.operands("tf32", "random", rng).dtype == np.float32
    const = script.operands("float16", "constant", rng)
    assert set(np.unique(const)) == {0, 1} and (const[0::2] == 1).all() and (const[1::2] == 0).all()
    assert (script.operands("tf32", "constant", rng) == np.float32(1e-3)).all()
    assert script.DEFAULT_OUT == T.MMA_CSV
    assert set(script.INSTRUCTIONS) | {script.THREE_TF32} >= set(T.CEILING_OF.values())


def test_the_ceiling_script_writes_a_file_the_lessons_read(tmp_path, monkeypatch):
    """mma_ceiling.py with the GPU replaced by fakes: one row per (instruction, operands), the medians of the
    rounds, the GPU and the date; load_mma_ceiling reads it back for either kind of operands."""
    import importlib.util
    import types

    import flashlab.device

    spec = importlib.util.spec_from_file_location("mma_ceiling_run", ROOT / "benchmarks" / "timing" / "mma_ceiling.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args: None

    fake_cuda = types.SimpleNamespace(device_array=lambda *a, **k: None, to_device=lambda x: x,
                                      synchronize=lambda: None,
                                      get_current_device=lambda: types.SimpleNamespace(id=0, uuid="GPU-fake"))
    monkeypatch.setattr(flashlab.device, "has_gpu", lambda: True)
    monkeypatch.setattr(flashlab.device, "get_cuda", lambda: fake_cuda)
    monkeypatch.setattr(flashlab.device, "device_limits", lambda: {"sms": 2, "name": "Fake GPU"})
    monkeypatch.setattr(script, "kernels", lambda: {name: Kernel() for name in script.INSTRUCTIONS})
    monkeypatch.setattr(script, "Sampler", lambda uuid: types.SimpleNamespace(window=lambda t0, t1: ("", ""),
                                                                              stop=lambda: None))
    rates = {"random": 400.0, "constant": 500.0}
    calls = []

    def fake_measure(kern, ops, out, blocks, threads, k, seconds, sync):
        kind = "constant" if np.unique(ops).size <= 2 else "random"
        calls.append(kind)
        return rates[kind] + len(calls) % 2, (0.0, 1.0)

    monkeypatch.setattr(script, "measure", fake_measure)
    out = tmp_path / "ceiling.csv"
    assert script.main(["--out", str(out), "--rounds", "2"]) == 0
    assert len(calls) == 2 * 2 * len(script.INSTRUCTIONS)  # both kinds, every instruction, every round
    random, constant = T.load_mma_ceiling(out), T.load_mma_ceiling(out, operands=T.CONSTANT_OPERANDS)
    assert random["operands"] == "random" and random["gpu"] == "Fake GPU" and random["date"]
    assert 400 <= random["fp16 m16n8k16"] <= 401 and 500 <= constant["fp16 m16n8k16"] <= 501
    assert random[script.THREE_TF32] == pytest.approx(random["tf32 m16n8k8"] / 3, abs=0.1)


def test_instruction_mix_groups_every_opcode_and_draws_the_committed_counts(tmp_path):
    import json

    raw = json.loads(T.SASS_MIX_JSON.read_text())
    data = T.load_sass_mix()
    labels = ("before", "after", "now")
    assert list(data["loop_body"]) == list(labels) and set(data["labels"]) == set(labels)
    for label, counts in data["loop_body"].items():
        groups = T.instruction_groups(counts)
        assert sum(groups.values()) == sum(counts.values())  # every opcode lands in exactly one group
        assert groups["tensor cores (HMMA)"] == counts["HMMA"] == raw["loop_body"][label]["HMMA"]
    before, after, now = (T.instruction_groups(data["loop_body"][x]) for x in labels)
    integer, softmax = "integer: addresses, indices, compares", "softmax arithmetic"
    assert after[integer] < before[integer] / 2  # what lesson 16 says: the integer work fell by more than half
    assert after["tensor cores (HMMA)"] == before["tensor cores (HMMA)"] == now["tensor cores (HMMA)"]
    assert after[softmax] == before[softmax]
    # ... and then: fewer integer instructions again, and the rescale's 64 multiplies in only part of the tiles
    assert now[integer] < after[integer] and after[softmax] - 64 < now[softmax] < after[softmax]
    ax = T.plot_instruction_mix(data)
    assert [t.get_text() for t in ax.get_yticklabels()] == [data["labels"][x] for x in labels]
    shown = " ".join(data["labels"].values())
    assert not re.search(r"\b[0-9a-f]{7,40}\b|old default|before|after", shown)  # what the bars say, not history
    totals = [t.get_text() for t in ax.texts if t.get_text().endswith("in all")]
    assert totals == [f"{sum(data['loop_body'][x].values())} in all" for x in labels]
    assert T.instruction_groups({"XYZ": 3})["other"] == 3
    assert T.load_sass_mix(tmp_path / "none.json") is None
    ax = T.plot_instruction_mix(None)
    assert any("no instruction counts" in t.get_text() for t in ax.texts)


def test_max_growth_marks_the_tiles_where_an_m_tiles_running_max_grows(rng):
    """Against a loop over rows and tiles, as the kernel's online softmax sees them (ragged last tile)."""
    S = rng.standard_normal((12, 23))
    grew = T.max_growth(S, rows=4, block_k=5)
    want = np.zeros((3, 5), bool)
    for i in range(12):
        m = -np.inf
        for j in range(5):
            new = max(m, S[i, 5 * j:5 * j + 5].max())
            want[i // 4, j] |= new > m
            m = new
    np.testing.assert_array_equal(grew, want)
    assert grew[:, 0].all()
    sink = S.copy()
    sink[:, 0] = 100.0  # key 0 beats every other: no m-tile rescales after tile 0
    assert not T.max_growth(sink, rows=4, block_k=5)[:, 1:].any()
    with pytest.raises(ValueError, match="multiple of rows=5"):
        T.max_growth(S, rows=5)


def test_max_growth_with_a_threshold_keeps_the_stale_max_and_the_output_exact(rng):
    """FlashAttention-4's rule: rescale only when a tile's max beats the max in use by more than the threshold;
    against a loop over rows and tiles, and the output of the online softmax with the stale max is exact."""
    S = 3 * rng.standard_normal((12, 23))
    for threshold in (0.0, 1.0, 2.5):
        want = np.zeros((3, 5), bool)
        for i in range(12):
            kept = S[i, :5].max()
            want[i // 4, 0] = True
            for j in range(1, 5):
                tile = S[i, 5 * j:5 * j + 5].max()
                if tile - kept > threshold:
                    want[i // 4, j] = True
                    kept = tile
        np.testing.assert_array_equal(T.max_growth(S, rows=4, block_k=5, threshold=threshold), want)
    assert T.max_growth(S, rows=4, block_k=5, threshold=0.0).sum() > T.max_growth(S, rows=4, block_k=5,
                                                                                  threshold=2.5).sum()
    ramp = np.tile(np.arange(25.0), (4, 1))  # every tile's max is 5 above the last one's
    assert T.max_growth(ramp, rows=4, block_k=5, threshold=4.9).all()
    # at 5.0 a tile's growth of 5 is not enough, but the max in use lags, so the next tile's 10 is
    assert T.max_growth(ramp, rows=4, block_k=5, threshold=5.0)[0].tolist() == [True, False, True, False, True]
    with pytest.raises(ValueError, match="threshold"):
        T.max_growth(S, rows=4, threshold=-1)
    V = rng.standard_normal((23, 3))
    P = np.exp(S - S.max(axis=1, keepdims=True))
    exact = P @ V / P.sum(axis=1, keepdims=True)
    for threshold in (0.0, 2.5):
        o, p_max = T.stale_max_output(S, V, block_k=5, threshold=threshold)
        np.testing.assert_allclose(o, exact, rtol=1e-12, atol=1e-12)
        assert p_max <= np.exp(threshold) + 1e-12
    assert T.stale_max_output(S, V, block_k=5, threshold=2.5)[1] > 1  # a stale max lets P pass 1


def test_the_measured_rescale_share_matches_random_scores_and_the_plot_draws_it(rng):
    """The kernel's counters (h100_sass_mix.json) and max_growth on random scores of the same shape agree."""
    q, k = rng.standard_normal((2, 4096, 64)).astype(np.float32)
    grew = T.max_growth(q @ k.T / 8)
    assert abs(grew.mean() - T.load_sass_mix()["rescale_share"]["now"]) < 0.02
    ax = T.plot_max_growth({"random": grew})
    assert len(ax.lines) == 2 and any(f"{grew.mean():.0%} of all" in t.get_text() for t in ax.get_legend().get_texts())
