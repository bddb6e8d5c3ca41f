"""The launch planner (flashlab/kernels/plan.py), every launch path it can choose, and its explorer.

Simulator tests (CI) run the split-KV, heaviest-first and d128-redesign paths of the kernels on tiny shapes
against float64 attention, check the planner's choices for hand-passed devices (a T4 from the committed
kernel_resources.csv), its model, the prepared-call marshalling against numba-cuda's own and the waves
explorer. GPU tests (marked gpu) check the suite's edge shapes, the prepared (fast) path against the general
one, and the compiled registers. Lesson 10's waves exercise, whose checker gives the planner's answers, is
tested in tests/exercises/test_l10_tuning.py.
"""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_LAUNCH_ON

import flashlab as fl
from flashlab.device import get_cuda, has_gpu
from flashlab.kernels import flash_attention, prepared, register, tensor
from flashlab.kernels import plan as P
from flashlab.kernels.plan import A100, H100, T4, plan

ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")


def rand(rng, B, H, n, d, dtype=np.float32):
    return rng.standard_normal((B, H, n, d)).astype(dtype)


def check_attention(q, k, v, causal, o, lse, tol=1e-5):
    ro, rl = fl.reference_attention(q, k, v, causal=causal)
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse)), "unwritten or non-finite outputs"
    assert fl.relative_error(o, ro) < tol, f"o: relative error {fl.relative_error(o, ro):.2e}"
    assert fl.relative_error(lse, rl) < 1e-5, f"lse: relative error {fl.relative_error(lse, rl):.2e}"


# ------------------------------------------------------------------------- kernels: every planned path
# (B, H, Nq, Nk, causal, tile, splits, heavy_first, section)
REGISTER_PATHS = [
    (1, 2, 21, 37, False, register.Tile(16, 8, 4, 4), 3, False, None),  # split, ragged chunks and tails
    (1, 2, 37, 37, True, register.Tile(16, 8, 4, 4), 3, True, None),  # causal split, heaviest first
    (2, 2, 33, 40, True, register.Tile(16, 8, 4, 4, prefetch=True), 4, True, 2),  # sections of 2 heads, prefetch
    (1, 3, 20, 20, True, register.Tile(8, 8, 2, 4), 1, True, 1),  # heaviest first without split, 1-head sections
    (1, 1, 40, 9, True, register.Tile(8, 8, 2, 4), 2, False, None),  # Nq > Nk: rows that see no key of a chunk
]


@pytest.mark.parametrize("B,H,nq,nk,causal,tile,splits,heavy,section", REGISTER_PATHS)
def test_register_kernel_paths(rng, B, H, nq, nk, causal, tile, splits, heavy, section):
    cuda = get_cuda()
    q, k, v = rand(rng, B, H, nq, 16), rand(rng, B, H, nk, 16), rand(rng, B, H, nk, 16)
    o, lse = cuda.device_array((B, H, nq, 16), np.float32), cuda.device_array((B, H, nq), np.float32)
    register.launch(*(cuda.to_device(x) for x in (q, k, v)), o, lse, H, 0.25, causal, tile, splits=splits,
                    heavy_first=heavy, section=section)
    ro, rl = fl.reference_attention(q, k, v, causal=causal, scale=0.25)
    assert fl.relative_error(o.copy_to_host(), ro) < 1e-5 and fl.relative_error(lse.copy_to_host(), rl) < 1e-5


def test_d128_redesign_tile(rng):
    # the d = 64-like tile for d = 128 (64 threads, 4 rows x 2 keys x 32 dims each), split and causal too
    q, k, v = rand(rng, 1, 1, 40, 128), rand(rng, 1, 1, 45, 128), rand(rng, 1, 1, 45, 128)
    for causal, splits in ((False, 1), (True, 2)):
        o, lse = flash_attention(q, k, v, causal=causal, tile=register.D128_REDESIGN, splits=splits)
        check_attention(q, k, v, causal, o, lse)
    assert register.D128_REDESIGN.check(128).shared_bytes(128) <= 48 * 1024


@pytest.mark.parametrize("precision,causal,splits,heavy", [("3xtf32", True, 3, True), ("f16", True, 2, False),
                                                            ("f16", False, 3, True)])
def test_tensor_kernel_split_paths(rng, precision, causal, splits, heavy):
    from test_tensor_kernel import DT16, check as check_tensor
    from flashlab import fragments as F

    q, k, v = (rng.standard_normal((1, 1, n, 16)) for n in (40, 50, 50))
    if precision in DT16:
        bits = [F.to_bits16(x, DT16[precision]) for x in (q, k, v)]
        args = [np.ascontiguousarray(x).view(np.uint32) for x in bits]
        seen = [F.from_bits16(x, DT16[precision]).astype(np.float64) for x in bits]
        o = np.zeros((1, 1, 40, 8), np.uint32)
    else:
        args = [np.ascontiguousarray(x, np.float32) for x in (q, k, v)]
        seen = [x.astype(np.float64) for x in args]
        o = np.full((1, 1, 40, 16), np.nan, np.float32)
    lse = np.full((1, 1, 40), np.nan, np.float32)
    tensor.launch(*args, o, lse, 1, 0.25, causal, tensor.TensorTile(1, 16), precision, splits=splits,
                  heavy_first=heavy)
    if precision in DT16:
        o = F.from_bits16(o.view(np.uint16), DT16[precision])
    check_tensor(o, lse, seen, causal, precision)


def test_flash_attention_splits_through_the_planner(rng):
    q, k, v = rand(rng, 1, 2, 24, 16), rand(rng, 1, 2, 200, 16), rand(rng, 1, 2, 200, 16)
    p = plan((1, 2, 24, 200, 16), causal=True, splits=3, block_q=16, block_k=16)  # small blocks: quick simulation
    assert p.splits == 3 and p.chunk == 80 and p.heavy_first and p.grid == (2, 2, 3)
    check_attention(q, k, v, True, *flash_attention(q, k, v, causal=True, plan=p))
    check_attention(q, k, v, False, *flash_attention(q, k, v, splits=2, block_q=16))
    with pytest.raises(ValueError, match="plan= already fixes"):
        flash_attention(q, k, v, causal=True, plan=p, splits=2)
    with pytest.raises(ValueError, match="plan= was made for"):
        flash_attention(q, k, v, causal=False, plan=p)
    with pytest.raises(ValueError, match="textbook kernel does not split"):
        flash_attention(q, k, v, variant="shared", splits=2)


def test_backward_heaviest_first_in_sections(rng):
    from flashlab.kernels import register_backward as kb
    from flashlab.kernels.options import plain_arguments
    from test_kernels_backward import make_case

    cuda = get_cuda()
    (q, k, v, o, lse, do), want = make_case(rng, (2, 2, 23, 16), 30, True, np.float32)
    preprocess, dkdv, _ = kb.make_kernels(16, 8, 16, 32, heavy_first=True)
    D, dq = cuda.device_array((2, 2, 23), np.float32), cuda.device_array((2, 2, 23, 16), np.float32)
    dk, dv = (cuda.device_array((2, 2, 30, 16), np.float32) for _ in range(2))
    qd, kd, vd, od, lsed, dod = (cuda.to_device(x) for x in (q, k, v, o, lse, do))
    preprocess[(1, 2, 2), 32](od, dod, D, dq)
    left, right, cap, slopes = plain_arguments(True)
    dkdv[(2, 2, 2), 32](qd, kd, vd, dod, lsed, D, dq, dk, dv, np.float32(0.25), True, 0, 0, left, right, cap, slopes,
                        0)  # sections of 2 heads
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert fl.relative_error(got.copy_to_host(), w) < 1e-4, name


# ------------------------------------------------------------------------------------ the planner
def test_t4_every_chosen_kernel_fits():
    """T4: 40 SMs, 64 KB shared memory per SM, 48 KB per block, 65536 registers, 1024 threads, cc 7.5."""
    assert (T4.sms, T4.shared_per_sm, T4.shared_per_block, T4.regs_per_sm, T4.max_threads_per_sm, T4.cc) == \
        (40, 64 * 1024, 48 * 1024, 65536, 1024, (7, 5))
    seen = 0
    for d in (16, 32, 64, 128):
        for causal in (False, True):
            for direction, variant, dtype in [("forward", "register", "float32"), ("forward", "register", "float16"),
                                              ("forward", "shared", "float32"), ("forward", "tensor", "float16"),
                                              ("backward", "register", "float32"), ("backward", "register", "float16")]:
                for N in (64, 1024, 16384):
                    p = plan((1, 16, N, N, d), variant=variant, direction=direction, causal=causal, dtype=dtype,
                             device=T4)
                    assert p.registers is not None and "cc 7.5" in p.registers_from, p.registers_from
                    # the textbook kernel keeps its row of Q and of O in registers: 2 x 128 floats spill at d = 128
                    assert p.registers <= 255 and (p.spill_bytes == 0 or (variant, d) == ("shared", 128)), p.explain()
                    assert p.threads <= 1024 and p.registers * p.threads <= T4.regs_per_sm
                    assert p.shared_bytes <= T4.shared_per_block
                    assert p.shared_bytes + T4.reserved_shared_per_block <= T4.shared_per_sm
                    assert p.blocks_per_sm >= 1 and p.blocks_per_sm * p.threads <= T4.max_threads_per_sm
                    assert p.precision in (None, "k8")  # float16 mma on a T4 is m16n8k8
                    seen += 1
    assert seen == 4 * 2 * 6 * 3
    with pytest.raises(ValueError, match="compute capability 8.0"):
        plan((1, 16, 1024, 64), variant="tensor", dtype="bfloat16", device=T4)


def test_the_table_has_every_configuration_the_planner_chooses():
    table = P.resource_table()
    assert table, f"{P.RESOURCES_CSV} is missing: run benchmarks/generators/kernel_resources.py"
    sys.path.insert(0, str(ROOT / "benchmarks" / "generators"))
    import kernel_resources

    missing = [key for key in kernel_resources.all_keys()
               if P.resource_key(*key[:5], P.config_text(key[0], key[1], key[5]), *key[6:]) not in table]
    assert not missing, f"{len(missing)} configurations without a row, e.g. {missing[:3]}"
    import csv

    with open(P.RESOURCES_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert set(P.RESOURCE_COLUMNS) <= set(rows[0])
    assert all(0 < int(r["registers"]) <= 255 for r in rows)
    spills = {(r["variant"], r["direction"], r["d"], r["precision"], r["split"]) for r in rows
              if int(r["spill_bytes"])}
    # the textbook kernel at d = 128 (its rows of Q and O: 256 floats); 3xTF32 at d = 128 split, which the
    # planner never chooses on its own (the tensor-core kernel splits only when asked); the tensor backward at
    # d = 128 for k8 (no room for V in shared memory beside the sm_75 build's single stage: 12-112 bytes); the
    # 16-bit tensor backward at d = 128 (24-36 bytes, its 32x128 tile, which the H100 timed 1.37x the spill-free
    # 48 KB tiles; 12-16 bytes at 16x64): known, see DEFAULT_TILES
    known = {("shared", "forward", "128", "", "0"), ("tensor", "forward", "128", "3xtf32", "1"),
             ("tensor", "backward", "128", "k8", "0"),
             ("tensor", "backward", "128", "f16", "0"), ("tensor", "backward", "128", "bf16", "0")}
    assert spills <= known, spills - known
    for device in (A100, H100):
        p = plan((1, 4, 1024, 128), device=device, variant="tensor", causal=True)
        key = P.resource_key("tensor", "forward", 128, "float32", "3xtf32", P.config_text("tensor", "forward", p.config),
                             True, True, True, P._table_cc(device.cc))
        assert key in table and p.splits == 1, p.explain()


@pytest.mark.parametrize("device", [T4, A100, H100], ids=["T4", "A100", "H100"])
def test_unsplit_plans_keep_todays_tiles(device):
    from flashlab.kernels import register_backward, shared

    for d in (16, 32, 64, 128):
        p = plan((1, 16, 4096, d), device=device)
        assert p.config == register.choose_tile(d, None, None, device.shared_per_block, device.shared_per_sm)
        assert plan((1, 16, 4096, d), device=device, variant="shared").config == (shared.DEFAULT_BLOCK_Q,
                                                                                 shared.DEFAULT_BLOCK_K)
        assert plan((1, 16, 4096, d), device=device, direction="backward").config == register_backward.GPU_CONFIG[d]
        if device is not T4:
            assert plan((1, 16, 4096, d), device=device, variant="tensor", dtype="float16").config == \
                tensor.choose_tile(d, "f16")


def test_overrides_reach_the_plan():
    assert plan((1, 4, 256, 64), device=H100, block_q=32, block_k=32).config == register.Tile(32, 32, 8, 8)
    assert plan((1, 4, 256, 64), device=H100, tile=register.Tile(64, 32, 16, 8)).config == register.Tile(64, 32, 16, 8)
    assert plan((1, 4, 256, 64), device=H100, direction="backward", block_q=16, threads=32).config == (16, 32, 32)
    assert plan((1, 4, 4096, 64), device=H100, splits=4).splits == 4
    assert plan((1, 4, 4096, 64), device=H100, splits=1).splits == 1
    with pytest.raises(ValueError, match="threads= configures the register backward"):
        plan((1, 4, 256, 64), threads=64)
    with pytest.raises(ValueError, match="backward kernel does not split"):
        plan((1, 4, 256, 64), direction="backward", splits=2)
    with pytest.raises(ValueError, match=r"splits=2 does not apply to bfloat16.*pass splits=None or 1"):
        plan((1, 4, 256, 64), device=H100, variant="tensor", dtype="bfloat16", splits=2)
    assert plan((1, 4, 256, 64), device=H100, variant="tensor", dtype="bfloat16", splits=1).splits == 1
    with pytest.raises(ValueError, match="variant for the backward"):
        plan((1, 4, 256, 64), direction="backward", variant="shared")
    with pytest.raises(ValueError, match="d = 48 is not supported"):
        plan((1, 4, 256, 48))
    with pytest.raises(ValueError, match="Device sms must be a positive integer; got 0"):
        dataclasses.replace(H100, sms=0)
    with pytest.raises(ValueError, match="device must be a Device"):
        plan((1, 4, 256, 64), device="V100")


def test_split_decisions_on_an_h100():
    small = plan((1, 16, 1024, 64), device=H100)
    assert small.unsplit[0] < 1 and small.splits > 1 and small.chunk >= P.MIN_CHUNK
    assert small.efficiency >= P.SPLIT_TARGET > small.unsplit[1]
    assert small.grid == (-(-1024 // small.block_q), 16, small.splits)
    assert plan((1, 16, 16384, 64), device=H100).splits == 1  # many waves
    assert plan((1, 16, 256, 64), device=H100).splits == 1  # chunks would be shorter than MIN_CHUNK
    # the simulator runs one block at a time: no split unless asked
    assert plan((1, 16, 1024, 64)).splits == 1 and "simulator" in plan((1, 16, 1024, 64)).split_reason
    text = small.explain()
    for words in ("blocks per SM", "waves", "split-KV", f"{small.splits} chunks of {small.chunk} keys", "order"):
        assert words in text, text


def test_causal_order_and_sections():
    p = plan((4, 16, 16384, 16384, 64), device=H100, causal=True)
    per_head = 2 * 16384 * 64 * 4  # K and V of one head, float32
    assert p.heavy_first and p.section == 4 and p.section * per_head <= H100.l2_bytes < 8 * per_head
    assert p.grid == (4, 16384 // p.block_q, 64 // 4)
    assert p.predict(heavy_first=False)["efficiency"] < p.efficiency
    assert "heaviest first, in sections of 4 heads" in p.explain()
    assert not plan((4, 16, 4096, 64), device=H100).heavy_first  # not causal: every block the same


def test_model_against_whole_waves():
    works = np.ones(1000)
    for slots in (132, 528, 1000, 1001):
        makespan, eff = P.slot_efficiency(works, slots)
        waves = 1000 / slots
        assert makespan == math.ceil(waves) and eff == pytest.approx(waves / math.ceil(waves))
    slot, start, end = P.schedule(np.array([5.0, 1, 1, 1, 1, 1]), 2)
    assert list(slot) == [0, 1, 1, 1, 1, 1] and end.max() == 5 and list(start[1:]) == [0, 1, 2, 3, 4]


def test_dispatch_order_matches_the_grid():
    """Decode every grid position the way the kernels do and compare the work sequence with the model's."""
    for B, H, causal in ((1, 4, True), (2, 2, False)):
        p = plan((B, H, 300, 300, 64), device=H100, causal=causal, splits=3)
        gx, gy, gz = p.grid
        n_qb = -(-300 // p.block_q)
        work = P.block_work(p.problem, p.block_q, p.block_k, p.splits, p.chunk)
        seq = []
        for z in range(gz):
            for y in range(gy):
                for x in range(gx):
                    if p.heavy_first:  # z = part * sections + section
                        qb, part = n_qb - 1 - y, z // (B * H // gx)
                    else:
                        qb, part = n_qb - 1 - x, z
                    seq.append(work[qb, part])
        assert np.array_equal(seq, p.works())


def test_host_caches():
    from flashlab.kernels import _launch

    cuda = get_cuda()
    q = cuda.to_device(np.zeros((1, 2, 8, 16), np.float32))
    assert _launch.check_kernel_inputs(q, q, q) == (1, 2, 8, 8, 16, False, 0.25)
    assert plan((1, 2, 8, 16)) is plan((1, 2, 8, 16))
    with pytest.raises(TypeError, match="causal"):
        _launch.check_kernel_inputs(q, q, q, causal="yes")


def test_prepared_calls_marshal_like_numba():
    """kernels/prepared.py builds kernel arguments itself: each kernel parameter must get the bytes numba-cuda's own
    launch gives it (tests/marshal_check.py: numba-cuda's _Kernel._prepare_args against flashlab's direct and
    cuda.core launches, without a GPU; tests/test_colab.py runs it against Colab's numba-cuda too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "marshal_check.py")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("ok: "), out.stdout + out.stderr
    assert not prepared.available() or has_gpu()


# ------------------------------------------------------------------------------------ the explorer
def _lines(ax):
    return {ln.get_label(): ln for ln in ax.get_lines()}


def test_wave_explorer_callback(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from flashlab import viz
    from flashlab.viz import waves

    widgets = pytest.importorskip("ipywidgets")
    seen = {}
    monkeypatch.setattr(viz._base, "use_widgets", lambda interactive=None: True)
    monkeypatch.setattr(widgets, "interact", lambda fn, **s: seen.update(fn=fn, sliders=s) or "interact")
    monkeypatch.setattr(plt, "show", lambda: None)

    def run(**params):
        plt.close("all")
        for name, value in params.items():
            seen["sliders"][name].value = value
        seen["fn"](**{n: s.value for n, s in seen["sliders"].items()})
        return plt.gcf()

    # no suite.csv: no measured points
    assert waves.wave_explorer(suite_path=tmp_path / "missing.csv") == "interact"
    assert set(seen["sliders"]) == {"batch_heads", "N", "d", "gpu", "causal"}
    fig = run(batch_heads=16, N=1024, d=64, gpu="H100", causal=False)
    before, planned, curve = fig.axes[:3]  # (then the timelines' colorbars)
    p = plan((1, 16, 1024, 1024, 64), device=H100)
    assert f"{p.splits} chunks of {p.chunk} keys" in planned.get_title()
    assert f"{p.waves:.2f} waves" in planned.get_title() and f"{p.unsplit[0]:.2f} waves" in before.get_title()
    lines = _lines(curve)
    assert np.allclose(lines["the plan (split-KV, order)"].get_ydata(),
                       [plan((1, 16, n, n, 64), device=H100).efficiency for n in waves.SEQS])
    assert not [k for k in lines if k.startswith("measured")]
    img = before.images[0].get_array()
    assert img.shape[0] == H100.sms and np.isclose(img.max(), 1 / p.blocks_per_sm)  # one block per busy SM
    fig = run(gpu="T4", causal=True, d=128, batch_heads=32, N=4096)
    assert "Tesla T4" in fig._suptitle.get_text()
    # with a suite.csv: the measured ratios of the same B*H, d and causal
    csv_path = tmp_path / "suite.csv"
    rows = ["direction,variant,dtype,B,H,N,d,causal,flashlab_tflops,torch_tflops,ratio,plan"]
    rows += [f"forward,register,float32,1,16,{n},64,0,10,20,{r},x" for n, r in ((1024, 0.3), (4096, 0.8))]
    rows += ["forward,register,float32,1,16,1024,64,1,10,20,0.2,x", "backward,register,float32,1,16,1024,64,0,1,2,0.5,x"]
    csv_path.write_text("\n".join(rows) + "\n")
    waves.wave_explorer(suite_path=csv_path)
    fig = run(batch_heads=16, N=1024, d=64, gpu="H100", causal=False)
    measured = [ln for k, ln in _lines(fig.axes[2]).items() if k.startswith("measured")]
    assert len(measured) == 1 and list(measured[0].get_xdata()) == [1024, 4096]
    assert list(measured[0].get_ydata()) == [0.3, 0.8]
    fig = run(gpu="A100")  # measured on an H100: not drawn for another GPU
    assert not [k for k in _lines(fig.axes[2]) if k.startswith("measured")]


def test_wave_explorer_static_fallback(tmp_path):
    from flashlab import viz
    from flashlab.viz import waves

    fig = waves.wave_explorer(interactive=False, suite_path=tmp_path / "missing.csv")
    assert len(fig.axes) == 4
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["B·H 16, d 64", "B·H 16, d 64, causal",
                                                                 "B·H 16, d 128", "B·H 16, d 128, causal"]
    assert viz.to_png(fig)[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------ the suite files
def test_suite_summary_and_plot(tmp_path):
    from flashlab.bench import SUITE_COLUMNS, geometric_mean, suite_summary

    sys.path.insert(0, str(ROOT / "benchmarks" / "timing"))
    import suite

    rows = [{"direction": "forward", "variant": "register", "dtype": "float32", "B": 1, "H": 16, "N": n, "d": d,
             "causal": c, "flashlab_tflops": 1.0, "torch_tflops": 2.0, "ratio": r, "plan": "p"}
            for (n, d, c, r) in ((1024, 64, 0, 0.25), (4096, 64, 1, 1.0), (1024, 128, 0, 0.5))]
    assert tuple(rows[0]) == SUITE_COLUMNS
    summary = {s["d"]: s for s in suite_summary(rows)}
    assert summary["all d"]["min_ratio"] == 0.25 and summary["all d"]["min_at"] == "B1 H16 N1024 d64"
    assert summary["all d"]["geomean_ratio"] == pytest.approx(0.5) == geometric_mean([0.25, 1.0, 0.5])
    assert summary["all d"]["below_half"] == 1 and summary["d=64"]["shapes"] == 2
    text = suite.summary_text(rows, {"gpu": "X"})
    assert "| forward | register | float32 | all d | 3 | 25% | B1 H16 N1024 d64 | 50% | 1 |" in text
    suite.plot_suite(rows, tmp_path / "suite.png")
    assert (tmp_path / "suite.png").stat().st_size > 2000


# ------------------------------------------------------------------------------------------- GPU
def _torch_reference(q, k, v, causal, rows=None):
    """float64 attention of the last `rows` query rows (all by default), top-left causal."""
    import torch

    q = q.double() if rows is None else q[..., -rows:, :].double()
    s = q @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        r = torch.arange(k.shape[-2] - q.shape[-2], k.shape[-2], device=q.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > r, -torch.inf)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v.double(), lse


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,H,N", [(1, 16, 1024), (4, 16, 16384)])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_suite_edges(B, H, N, d, causal):
    """The suite's smallest and largest shapes with the planned launch (split at the small end, heaviest first
    under causal), the register variant in float32 and the tensor variant in float16."""
    import torch

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda") for _ in range(3))
    rows = None if N <= 4096 else 256
    ro, rl = _torch_reference(q[:1, :2], k[:1, :2], v[:1, :2], causal, rows)
    for variant, dtype, tol in (("register", torch.float32, 1e-5), ("tensor", torch.float16, 3e-3)):
        qq, kk, vv = (x.to(dtype) for x in (q, k, v))
        o, lse = flash_attention(qq, kk, vv, causal=causal, variant=variant)
        o, lse = o[:1, :2].double(), lse[:1, :2].double()
        if rows:
            o, lse = o[..., -rows:, :], lse[..., -rows:]
        if dtype != torch.float32:  # compare with attention on the rounded inputs
            ro, rl = _torch_reference(qq[:1, :2].float(), kk[:1, :2].float(), vv[:1, :2].float(), causal, rows)
        assert fl.relative_error(o.cpu().numpy(), ro.cpu().numpy()) < tol, (variant, B, H, N, d, causal)
        assert fl.relative_error(lse.cpu().numpy(), rl.cpu().numpy()) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant,dtype,splits", [("register", "float32", None), ("register", "float32", 4),
                                                  ("register", "float16", 3), ("shared", "float32", None),
                                                  ("tensor", "float16", 4), ("tensor", "bfloat16", None),
                                                  ("tensor", "float32", 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_prepared_path_matches_the_general_path(monkeypatch, variant, dtype, splits, causal):
    import torch

    torch.manual_seed(1)
    q, k, v, do = (torch.randn(1, 4, 700, 64, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", FAST_LAUNCH_ON)
    assert prepared.available() and prepared.state() == ("direct" if FAST_LAUNCH_ON == "direct" else "on")
    fast = [flash_attention(q, k, v, causal=causal, variant=variant, splits=splits) for _ in range(2)]
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "0")
    slow = flash_attention(q, k, v, causal=causal, variant=variant, splits=splits)
    for a, b in zip(fast[1], slow):
        assert torch.equal(a, b), variant
    if variant == "register":
        from flashlab.kernels import flash_attention_backward

        o, lse = slow
        slow_grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal)
        monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", FAST_LAUNCH_ON)
        for _ in range(2):
            fast_grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal)
        for a, b in zip(fast_grads, slow_grads):  # dq is summed with atomics: equal up to the order of adds
            assert fl.relative_error(a.double().cpu().numpy(), b.double().cpu().numpy()) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant, dtype", [("register", "float32"), ("tensor", "float16")])
def test_gpu_direct_launch_matches_cuda_core_launch(monkeypatch, variant, dtype):
    # prepared._DirectLaunch (cuLaunchKernel on a prebuilt kernelParams array) against cuda.core's launch
    import torch
    from numba.cuda import dispatcher

    if not prepared._core_launch(dispatcher):
        pytest.skip("this numba-cuda has no cuda.core launch to compare with (Colab's 0.22)")
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "1")  # =direct would not read FLASHLAB_DIRECT_LAUNCH
    q, k, v = (torch.randn(2, 3, 300, 64, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
    runs = []
    for direct in ("1", "0"):
        monkeypatch.setenv("FLASHLAB_DIRECT_LAUNCH", direct)
        prepared._CALLS.clear()
        call = [flash_attention(q, k, v, causal=True, variant=variant, splits=2) for _ in range(2)][1]
        assert all(isinstance(launch, prepared._DirectLaunch) == (direct == "1")
                   for launch, _, _ in next(iter(prepared._CALLS.values())).launches.kernels)
        runs.append(call)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    prepared._CALLS.clear()


@pytest.mark.gpu
@gpu
def test_gpu_plan_reads_the_compiled_kernel():
    p = plan((1, 16, 1024, 64), causal=True)
    assert p.registers_from == "the compiled kernel" and 0 < p.registers <= 255 and p.spill_bytes == 0
    assert p.device.sms >= 1 and p.device.l2_bytes > 0
    print(p.explain())


def test_automatic_split_switch_and_the_tensor_core_kernel(monkeypatch):
    # the same problem: split on "this GPU" (device=None) as on an H100 passed by hand; plan.AUTO_SPLIT = False
    # turns it off for this GPU only; splits= always splits. The tensor-core kernel splits only when asked.
    from flashlab.kernels import devices

    monkeypatch.setattr(devices, "current_device", lambda: H100)
    shape = (1, 16, 1024, 1024, 64)
    assert plan(shape, device=H100).splits > 1
    assert plan(shape).splits == plan(shape, device=H100).splits
    monkeypatch.setattr(P, "AUTO_SPLIT", False)
    live = plan(shape)
    assert live.splits == 1 and "AUTO_SPLIT" in live.split_reason
    assert plan(shape, splits=3).splits == 3
    for dtype in ("float16", "float32"):
        t = plan(shape, device=H100, variant="tensor", dtype=dtype)
        assert t.splits == 1 and "only when asked" in t.split_reason
        assert plan(shape, device=H100, variant="tensor", dtype=dtype, splits=3).splits == 3
