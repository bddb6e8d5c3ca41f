"""A T4's code paths without a T4: FLASHLAB_SIMULATE_GPU=T4 makes the simulator report a cc 7.5 GPU.

Colab's free GPU is a T4 (compute capability 7.5). There the planner and the kernels take paths no other GPU of the
project's runs takes: float16 through two m16n8k8 per k16 step (precision "k8"), copies through registers with no
cp.async, and no tensor-core path for bfloat16 or float32 (tf32). These tests run those paths in the simulator,
with every instruction a T4 lacks replaced by one that fails the test if a kernel calls it.
"""
import numpy as np
import pytest

import flashlab
from flashlab.device import SIMULATE_GPU, device_limits, has_gpu, simulated_gpu

pytestmark = pytest.mark.skipif(has_gpu(), reason="the switch acts on the simulator; a real GPU reports itself")

# What a cc 7.5 GPU does not have (kernels/mma.py's MIN_CC of 8.0): the simulated kernels must not call them.
SM80_ONLY = ("mma_f16_m16n8k16", "mma_bf16_m16n8k16", "mma_tf32_m16n8k8", "cp_async16", "cp_async16_flat",
             "cp_async_commit", "cp_async_wait", "pack_bf16x2", "round_tf32")


@pytest.fixture
def t4(monkeypatch):
    """The simulator as a T4, with the sm_80 instructions made to fail when called."""
    from flashlab.kernels import mma

    monkeypatch.setenv(SIMULATE_GPU, "T4")
    called = []
    for name in SM80_ONLY:
        def refuse(*args, _name=name):
            called.append(_name)
            raise AssertionError(f"{_name} is an sm_80 instruction, called on a simulated T4 (cc 7.5)")
        monkeypatch.setattr(mma, name, refuse)
    yield called
    assert not called, f"sm_80 instructions called on a simulated T4: {sorted(set(called))}"


def test_the_switch_reports_the_t4s_facts(t4):
    from flashlab.kernels.devices import T4, current_device

    lim = device_limits()
    assert simulated_gpu() == "T4"
    assert lim["cc"] == (7, 5) and lim["sms"] == T4.sms and lim["shared_per_sm"] == T4.shared_per_sm
    assert lim["max_threads_per_sm"] == T4.max_threads_per_sm and lim["shared_optin"] == T4.shared_optin
    dev = current_device()
    assert dev.cc == (7, 5) and dev.simulated and dev.sms == 40 and dev.reserved_shared_per_block == 0
    assert "T4" in dev.label and "cc 7.5" in dev.label


def test_without_the_switch_the_simulator_has_no_compute_capability(monkeypatch):
    from flashlab.kernels.devices import current_device

    monkeypatch.delenv(SIMULATE_GPU, raising=False)
    assert simulated_gpu() is None and device_limits()["cc"] is None and current_device().cc is None


def test_an_unknown_gpu_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(SIMULATE_GPU, "P100")
    with pytest.raises(ValueError, match=r"FLASHLAB_SIMULATE_GPU='P100'.*'A100', 'H100', 'T4'"):
        device_limits()


def test_the_planner_picks_k8_and_one_stage_on_a_t4(t4):
    from flashlab.kernels import plan, tensor

    assert tensor.resolve_precision("float16", None, device_limits()["cc"]) == "k8"
    assert tensor.stages("k8") == 1  # copies through registers between two barriers: no cp.async
    text = plan.plan((1, 2, 64, 32), dtype="float16", variant="tensor").explain()
    assert "tensor (k8)" in text and "cc 7.5" in text, text


@pytest.mark.parametrize("causal", [False, True])
def test_float16_forward_runs_the_k8_path_on_a_t4(t4, rng, causal):
    from flashlab.kernels import flash_attention

    q, k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float16) for _ in range(3))  # 40: a ragged tile
    o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
    ref, ref_lse = flashlab.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    assert flashlab.relative_error(o, ref) < 2e-3 and flashlab.relative_error(lse, ref_lse) < 1e-5


def test_float16_backward_runs_the_k8_path_on_a_t4(t4, rng):
    from flashlab.kernels import flash_attention, flash_attention_backward

    q, k, v, do = (rng.standard_normal((1, 1, 40, 32)).astype(np.float16) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=True, variant="tensor")
    grads = flash_attention_backward(q, k, v, o, lse, do, causal=True, variant="tensor")
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    want = flashlab.naive_attention_backward(q64, k64, v64, do64, causal=True)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert flashlab.relative_error(got, ref) < 1e-2, name


def test_float32_has_no_tensor_core_path_on_a_t4(t4, rng):
    from flashlab.kernels import flash_attention

    q = rng.standard_normal((1, 1, 32, 32)).astype(np.float32)
    with pytest.raises(ValueError, match=r"compute capability 8\.0; this GPU has 7\.5"):
        flash_attention(q, q, q, variant="tensor")


def test_the_bfloat16_message_names_what_works_on_a_t4(t4):
    from flashlab.kernels import tensor

    with pytest.raises(ValueError) as info:
        tensor.resolve_precision("bfloat16", None, device_limits()["cc"])
    text = str(info.value)
    assert "7.5" in text and "float16" in text and "variant='register'" not in text


def test_the_simulator_refuses_an_instruction_the_simulated_gpu_lacks(monkeypatch):
    """Without any patching: as a T4, an sm_80 instruction raises, naming itself and both compute capabilities;
    the sm_75 ones and the plain simulator run it."""
    from flashlab.kernels import mma

    monkeypatch.setenv(SIMULATE_GPU, "T4")
    with pytest.raises(RuntimeError, match=r"round_tf32 needs compute capability 8\.0.*7\.5"):
        mma.round_tf32(np.float32(1.0))
    assert mma.unpack_f16x2(np.uint32(0x3C003C00)) == (1.0, 1.0)  # sm_75 has it
    monkeypatch.delenv(SIMULATE_GPU)
    assert mma.round_tf32(np.float32(1.0)) == np.float32(1.0)


def test_hopper_code_runs_in_a_simulator_process_on_a_t4(t4, capsys):
    """On a GPU other than Hopper (a T4: compute capability 7.5), lesson 20's kernel cells run in a fresh Python on
    the simulator, which reports no GPU of its own, and their output is printed here."""
    from flashlab.kernels import hopper

    def where_it_runs(tag):
        from flashlab.device import device_limits

        print(tag, "ran with cc", device_limits()["cc"])

    assert hopper.run_here_or_simulated(where_it_runs, "cell") is None
    out = capsys.readouterr().out
    assert "This GPU (compute capability 7.5) cannot run sm_90a code: where_it_runs runs in" in out, out
    assert "cell ran with cc None" in out, out


def test_hopper_code_runs_here_in_the_simulator():
    from flashlab.kernels import hopper

    assert hopper.run_here_or_simulated(lambda x: x + 1, 41) == 42  # no second process: a lambda has no source


def test_a_failure_in_the_simulator_process_names_the_call_and_the_error():
    from flashlab.device import in_simulator

    def fails(n):
        raise ValueError(f"boom {n}")

    with pytest.raises(RuntimeError, match=r"fails\(3\) failed in the simulator:[\s\S]*ValueError: boom 3"):
        in_simulator(fails, 3)
