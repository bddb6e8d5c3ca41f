"""The bf16 training comparison of lesson 13 on the CPU: the text, the loss-gap metric and its tolerance (which a
broken backward must fail), benchmarks/generators/gpt_bf16.py's smoke mode and file layout, and the figure.

tests/test_gpt_bf16_gpu.py runs the comparison itself in bf16 on a GPU.
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from flashlab import gpt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Seconds on a 2-core CPU, and the model learns to copy within it: attention matters by the last steps.
SMALL = {**gpt.BF16_SETUP, "n_layer": 2, "n_head": 1, "n_embd": 64, "block_size": 64, "batch_size": 16,
         "steps": 150, "lr": 3e-3, "warmup": 2, "text_chars": 20_000}


def manual_attention(q, k, v, is_causal=False):
    """matmul, softmax in float32, matmul: correct, with its own roundings in bf16."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def without_dq_dk(q, k, v, is_causal=False):
    """Exact forward; the backward returns dQ = dK = 0 (q and k detached)."""
    return F.scaled_dot_product_attention(q.detach(), k.detach(), v, is_causal=is_causal)


def returns_v(q, k, v, is_causal=False):
    """No attention at all: every query gets its own value row."""
    return v


def test_copy_text_is_deterministic_and_in_the_tiny_vocabulary():
    text = gpt.copy_text(5000, seed=3)
    assert len(text) == 5000 and text == gpt.copy_text(5000, seed=3) and text != gpt.copy_text(5000, seed=4)
    assert set(text) <= set(gpt.TINY_TEXT)
    for line in text.splitlines()[:-1]:  # the last line may be cut
        first, second = line[:len(line) // 2], line[len(line) // 2 + 1:]
        assert line.endswith(".") and first == second, line
    with pytest.raises(ValueError, match="n_chars"):
        gpt.copy_text(0)


def test_loss_gap_measures_the_smoothed_difference():
    a = [2.0 + 0.3 * ((i * 7919) % 13) / 13 for i in range(60)]  # batch-to-batch noise, common to both runs
    assert gpt.loss_gap(a, a) == 0
    assert gpt.loss_gap([x + 0.07 for x in a], a) == pytest.approx(0.07)
    spike = list(a)
    spike[30] += 0.5  # one bad step: averaged over the window
    assert gpt.loss_gap(spike, a, window=10) == pytest.approx(0.05)
    drift = [x + 0.002 * i for i, x in enumerate(a)]  # a trend: the average keeps it
    assert gpt.loss_gap(drift, a, window=10) == pytest.approx(0.002 * 54.5)
    assert gpt.loss_gap(a[:-1] + [float("nan")], a) == math.inf
    with pytest.raises(ValueError, match="same length"):
        gpt.loss_gap(a, a[:-1])
    with pytest.raises(ValueError, match="window"):
        gpt.loss_gap(a[:5], a[:5], window=10)
    assert gpt.moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]


def test_train_keeps_the_cpu_path_and_takes_bf16_autocast():
    tok = gpt.CharTokenizer(gpt.TINY_TEXT)
    data = tok.encode(gpt.TINY_TEXT)
    cfg = gpt.GPTConfig(tok.vocab_size, 16, 1, 1, 16)
    torch.manual_seed(0)
    start = gpt.GPT(cfg).state_dict()

    def model():
        m = gpt.GPT(cfg)
        m.load_state_dict(start)
        return m

    steps_seen = []
    plain = gpt.train(model(), data, 5, batch_size=4, seed=1, progress=False, on_step=steps_seen.append)
    assert steps_seen == list(range(5)) and all(type(v) is float for v in plain)
    m = model()  # the lesson's loop before this option existed: .item() after every step
    gen, opt, by_hand = torch.Generator().manual_seed(1), torch.optim.AdamW(m.parameters(), lr=1e-2), []
    for _ in range(5):
        x, y = gpt.get_batch(data, 16, 4, gen)
        loss = m(x, y)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        by_hand.append(loss.item())
    assert plain == by_hand
    bf16 = gpt.train(model(), data, 5, batch_size=4, seed=1, progress=False, autocast_dtype=torch.bfloat16,
                     grad_clip=1.0)
    assert bf16[0] != plain[0] and abs(bf16[0] - plain[0]) < 0.05 and all(map(math.isfinite, bf16))


@pytest.fixture(scope="module")
def small_runs():
    """One bf16 (CPU autocast) run of SMALL per attention: torch's, a correct other one, two broken ones."""
    return gpt.compare_attention({"torch": F.scaled_dot_product_attention, "manual": manual_attention,
                                  "without dQ, dK": without_dq_dk, "returns v": returns_v}, SMALL,
                                 autocast_dtype=torch.bfloat16, progress=False)["runs"]


def test_the_tolerance_passes_a_correct_attention_and_fails_broken_ones(small_runs):
    ref = small_runs["torch"]["losses"]
    assert small_runs["manual"]["losses"] != ref  # bf16: another correct attention rounds differently ...
    assert gpt.loss_gap(small_runs["manual"]["losses"], ref) < gpt.BF16_LOSS_TOLERANCE / 4  # ... and stays close
    for name in ("without dQ, dK", "returns v"):
        assert gpt.loss_gap(small_runs[name]["losses"], ref) > 2 * gpt.BF16_LOSS_TOLERANCE, name
    assert small_runs["without dQ, dK"]["losses"][0] == ref[0]  # its forward is exact: only training reveals it
    assert sum(ref[-20:]) / 20 < math.log(30) - 1.0  # the model learned (vocabulary of 30 characters)


def test_compare_attention_checks_its_setup():
    with pytest.raises(ValueError, match="missing.*'lr'"):
        gpt.compare_attention({}, {k: v for k, v in SMALL.items() if k != "lr"})
    with pytest.raises(ValueError, match="warmup"):
        gpt.compare_attention({}, {**SMALL, "warmup": SMALL["steps"]})
    with pytest.raises(ValueError, match="too short for block_size"):
        gpt.compare_attention({}, {**SMALL, "text_chars": 50})


def _script():
    spec = importlib.util.spec_from_file_location("gpt_bf16_script", ROOT / "benchmarks" / "generators" / "gpt_bf16.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_smoke_run_on_the_cpu_writes_a_valid_file(tmp_path, capsys):
    out = tmp_path / "gpt_bf16.json"
    assert _script().main(["--device", "cpu", "--steps", "3", "--tiny", "--out", str(out), "--no-progress"]) == 0
    record = gpt.load_bf16_run(out)
    assert record["dtype"] == "float32" and record["training"]["steps"] == 3
    assert set(record["runs"]) == {"torch", "flashlab", "torch_again"}
    assert record["runs"]["flashlab"]["losses"] == pytest.approx(record["runs"]["torch"]["losses"], abs=1e-4)
    assert record["tolerance"] == {"max_smoothed_gap": gpt.BF16_LOSS_TOLERANCE, "window": gpt.BF16_LOSS_WINDOW}
    text = out.read_text()
    assert '"losses": [' in text and len(text.splitlines()) < 80  # one line per loss curve
    assert "tokens/s" in capsys.readouterr().out


def test_the_gpu_bound_setup_is_its_own(capsys):
    """--gpu-bound trains a GPT whose step the GPU bounds (head dim 128, N 4096), a setup of the same keys as
    lesson 13's; the script refuses --tiny beside it."""
    script = _script()
    setup = gpt.BF16_GPU_BOUND_SETUP
    assert set(setup) == set(gpt.BF16_SETUP)
    assert setup["n_embd"] // setup["n_head"] == 128 and setup["block_size"] == 4096
    with pytest.raises(SystemExit):
        script.main(["--tiny", "--gpu-bound", "--device", "cpu"])
    assert "give one" in capsys.readouterr().err


def test_check_bf16_run_names_the_problem(tmp_path):
    assert gpt.load_bf16_run(tmp_path / "absent.json") is None
    record = json.loads(json.dumps(_fake_record()))
    gpt.check_bf16_run(record)
    del record["runs"]["flashlab"]
    with pytest.raises(ValueError, match="'torch' and 'flashlab'"):
        gpt.check_bf16_run(record)
    record = _fake_record()
    record["runs"]["torch"]["losses"].pop()
    with pytest.raises(ValueError, match="training.steps = 40"):
        gpt.check_bf16_run(record)
    record = _fake_record()
    record["runs"]["torch"]["tokens_per_s"] = 0
    with pytest.raises(ValueError, match="tokens_per_s"):
        gpt.check_bf16_run(record)
    with pytest.raises(ValueError, match="top-level keys"):
        gpt.check_bf16_run({"runs": {}})


def test_the_committed_run_if_any_has_the_layout():
    record = gpt.load_bf16_run()
    if record is not None:  # written by benchmarks/generators/gpt_bf16.py on a GPU
        assert record["dtype"] == "bfloat16" and record["device"].startswith("cuda")
        assert record["config"]["head_dim"] == 64
        runs = record["runs"]  # what lesson 13 says of it: the curves match within the tolerance
        assert gpt.loss_gap(runs["flashlab"]["losses"], runs["torch"]["losses"]) <= gpt.BF16_LOSS_TOLERANCE


def _fake_record(steps=40):
    losses = [3.0 - 0.02 * i for i in range(steps)]
    return {"source": "test", "date": "2026-01-01", "gpu": "a test GPU", "versions": {"torch": "x"}, "device": "cuda",
            "dtype": "bfloat16", "config": {"vocab_size": 30, "block_size": 1024, "n_layer": 4, "n_head": 4,
                                            "n_embd": 256, "head_dim": 64},
            "training": {"steps": steps, "warmup": 10, "batch_size": 8, "lr": 2e-3, "grad_clip": 1.0, "seed": 0,
                         "text_chars": 1000},
            "tolerance": {"max_smoothed_gap": 0.05, "window": 10},
            "runs": {"torch": {"label": "torch SDPA", "losses": losses, "tokens_per_s": 9.0e5, "first_step_s": 1.0},
                     "flashlab": {"label": "flashlab", "losses": [v + 0.01 for v in losses], "tokens_per_s": 6.0e5,
                                  "first_step_s": 30.0}}}


def test_plot_bf16_run_draws_curves_gaps_and_speeds():
    from flashlab.viz import to_png
    from flashlab.viz.training import plot_bf16_run

    fig = plot_bf16_run(_fake_record())
    assert len(fig.axes) == 3 and "a test GPU" in fig._suptitle.get_text()
    assert [round(b.get_height()) for b in fig.axes[2].patches] == [900000, 600000]
    gap_line = fig.axes[1].lines[0].get_ydata()
    assert max(abs(v - 0.01) for v in gap_line) < 1e-9  # flashlab minus torch, averaged
    assert to_png(fig)
    assert len(plot_bf16_run(_fake_record(), speed=False).axes) == 2
    record = _fake_record()
    del record["runs"]["torch"]
    with pytest.raises(ValueError, match="'torch' run"):
        plot_bf16_run(record)
