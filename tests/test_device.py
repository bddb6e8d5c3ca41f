"""Backend choice (GPU or CUDA simulator), flashlab.doctor() and the GPU timing helpers."""
import io
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import flashlab
from flashlab import bench, checkup, device


def test_backend_is_chosen_and_consistent():
    assert device.backend() in ("gpu", "simulator")
    assert device.has_gpu() == (device.backend() == "gpu")
    cuda = device.get_cuda()
    assert hasattr(cuda, "jit") and hasattr(cuda, "to_device")
    if not device.has_gpu():
        from numba import config

        assert config.ENABLE_CUDASIM


def test_doctor_reports_and_runs_the_smoke_kernel():
    out = io.StringIO()
    facts = flashlab.doctor(file=out)
    text = out.getvalue()
    for key in ("backend", "python", "numpy", "numba", "numba-cuda", "smoke kernel"):
        assert key in text
    assert facts["backend"] == device.backend()
    assert facts["smoke kernel"].startswith("ok"), text
    assert facts["ok"] and facts["fixes"] == []


def test_doctor_never_raises_and_names_the_fix(monkeypatch):
    def broken():
        raise ImportError("numba.cuda could not be imported (No module named 'numba_cuda')")

    monkeypatch.setattr(device, "get_cuda", broken)
    out = io.StringIO()
    facts = checkup.doctor(file=out)
    assert not facts["ok"]
    assert "pip install numba-cuda" in out.getvalue()


@pytest.mark.parametrize("message,fix", [
    ("module 'numpy' has no attribute 'row_stack'", "numpy<2.5"),
    ("[CUDA_ERROR_UNSUPPORTED_PTX_VERSION] Call to cuLinkAddData results in CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
     "driver"),
    ("libNVVM cannot be found. Do `conda install cudatoolkit`", "numba-cuda[cu12]"),
])
def test_known_breakages_have_fixes(message, fix):
    assert fix in checkup._fix_for(RuntimeError(message))
    assert checkup._fix_for(RuntimeError("something new")) == ""


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)


@pytest.mark.skipif(device.has_gpu(), reason="checks the no-GPU path")
def test_fresh_interpreter_without_gpu_gets_the_simulator():
    code = ("import os, flashlab.device as d; b = d.backend(); from numba import cuda, config; "
            "print(b, os.environ.get('NUMBA_ENABLE_CUDASIM'), config.ENABLE_CUDASIM)")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["simulator", "1", "1"]


@pytest.mark.skipif(device.has_gpu(), reason="checks the no-GPU path")
def test_numba_cuda_imported_too_early_warns_with_the_fix():
    code = "import numba.cuda, flashlab.device as d; print(d.backend())"
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "unavailable"
    assert "restart the Python kernel" in res.stderr and "NUMBA_ENABLE_CUDASIM=1" in res.stderr


def test_explicit_simulator_request_is_honoured():
    res = _run("import flashlab.device as d; print(d.backend())", NUMBA_ENABLE_CUDASIM="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "simulator"


def test_flop_counts():
    f = bench.attention_flops(1, 16, 4096, 4096, 64)
    assert f == 4 * 16 * 4096 * 4096 * 64
    assert bench.attention_flops(1, 16, 4096, 4096, 64, causal=True) == f / 2
    assert bench.attention_flops(2, 1, 10, 30, 16, backward=True) == 2.5 * 4 * 2 * 10 * 30 * 16
    assert bench.tflops(2e12, 1000.0) == pytest.approx(2.0)


@pytest.mark.skipif(device.has_gpu(), reason="checks the no-GPU message")
def test_gpu_timing_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.time_cuda(lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not device.has_gpu(), reason="needs a CUDA GPU")
def test_gpu_timing_excludes_warmup_and_is_positive():
    cuda = device.get_cuda()
    import numpy as np

    @cuda.jit
    def add_one(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += 1

    x = cuda.to_device(np.zeros(1 << 20, np.float32) + 1)
    t = bench.time_cuda(lambda: add_one[(1 << 20) // 256, 256](x), warmup=2, reps=20)
    assert len(t["samples_ms"]) == 20 and 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]
    assert t["median_ms"] < 50  # the first (compiling) call took far longer and was not timed


def test_kernel_size_is_small_in_the_simulator_and_full_on_a_gpu(monkeypatch):
    monkeypatch.delenv("FLASHLAB_FAST", raising=False)
    assert device.kernel_size(1000, 16) == (1000 if device.has_gpu() else 16)
    monkeypatch.setattr(device, "has_gpu", lambda: True)
    assert device.kernel_size(1000, 16) == 1000
    monkeypatch.setenv("FLASHLAB_FAST", "1")
    assert device.kernel_size(1000, 16) == 16  # the fast mode wins on a GPU too
    monkeypatch.setattr(device, "has_gpu", lambda: False)
    monkeypatch.delenv("FLASHLAB_FAST")
    assert device.kernel_size(1000, 16) == 16


# ----------------------------------------------------------------------------------- the simulator's threads
sim_only = pytest.mark.skipif(device.has_gpu(), reason="checks how flashlab arranges the CUDA simulator's threads")
cuda = device.get_cuda()  # a module global: the simulator swaps it for its own inside a kernel


@cuda.jit
def record_switch_interval(out):
    out[cuda.threadIdx.x] = sys.getswitchinterval()


@cuda.jit
def fail_in_one_thread(out):
    if cuda.threadIdx.x == 5:
        raise ValueError("thread 5 fails")
    cuda.syncthreads()
    out[cuda.threadIdx.x] = 1


@cuda.jit
def one_slow_thread(out, seconds):
    if cuda.threadIdx.x == 0:
        time.sleep(seconds)  # the other threads wait at the barrier meanwhile
    cuda.syncthreads()
    out[cuda.threadIdx.x] = 1


@cuda.jit
def neighbours_after_barriers(out, count):
    shared = cuda.shared.array(64, np.float32)
    i = cuda.threadIdx.x
    for step in range(3):
        shared[i] = i + step
        cuda.syncthreads()
        out[step, i] = shared[(i + 1) % 64]
        cuda.syncthreads()
    if i >= 48:
        return  # these threads leave: the barrier below waits for the 48 others only
    count[i] = cuda.syncthreads_count(i % 2)




@sim_only
def test_switch_interval_is_set_while_a_simulated_kernel_runs_and_restored_after():
    record, fail = record_switch_interval, fail_in_one_thread
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.0123)  # a value no one else uses: the launch must give it back, not a default
        out = np.zeros(32)
        record[1, 32](out)
        assert np.all(out == device.SIM_SWITCH_INTERVAL)
        assert sys.getswitchinterval() == pytest.approx(0.0123)
        with pytest.raises(ValueError, match="thread 5 fails"):  # a failing kernel restores it too
            fail[1, 32](np.zeros(32))
        assert sys.getswitchinterval() == pytest.approx(0.0123)
    finally:
        sys.setswitchinterval(before)


@sim_only
def test_simulated_block_waits_at_a_barrier_without_polling():
    """While one thread sleeps and 63 wait at cuda.syncthreads(), the launching thread sleeps too (Numba's own
    block loop polls them and burns a core for as long as the barrier lasts)."""
    slow = one_slow_thread
    out = np.zeros(64)
    slow[1, 64](out, 0.01)  # the first launch of a kernel does one-time work: not measured
    start_cpu, start = time.thread_time(), time.perf_counter()
    slow[1, 64](out, 0.5)
    cpu, wall = time.thread_time() - start_cpu, time.perf_counter() - start
    assert np.all(out == 1) and wall >= 0.5
    assert cpu < 0.2, f"the launching thread used {cpu:.2f} s of CPU in a {wall:.2f} s launch"


@sim_only
def test_simulated_barriers_keep_their_meaning():
    """Each barrier holds every running thread until all arrive; threads that returned no longer count (as in
    Numba's simulator); syncthreads_count sees every value; a failing thread stops its block with its error."""
    fail, neighbours = fail_in_one_thread, neighbours_after_barriers
    out, count = np.zeros((3, 64)), np.zeros(64)
    neighbours[2, 64](out, count)
    want = (np.arange(64)[None, :] + 1) % 64 + np.arange(3)[:, None]
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(count[:48], 24)  # 48 threads reach it, half of them with 1
    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\].*thread 5 fails"):
        fail[2, 32](np.zeros(32))


@sim_only
def test_doctor_reports_the_simulator_arrangement():
    out = io.StringIO()
    facts = checkup.doctor(file=out)
    assert "switch interval" in facts["simulator"] and "while a kernel runs" in facts["simulator"]
    assert f"{device.SIM_SWITCH_INTERVAL * 1e3:g} ms" in out.getvalue()


@sim_only
def test_numba_simulator_threads_can_be_kept():
    code = ("import sys, io, flashlab.checkup as d; b = sys.getswitchinterval(); f = d.doctor(file=io.StringIO()); "
            "print(f['simulator'].split(' (')[0], f['smoke kernel'][:2], sys.getswitchinterval() == b)")
    res = _run(code, NUMBA_ENABLE_CUDASIM="1", FLASHLAB_SIM_THREADS="numba")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["Numba's", "own", "ok", "True"]
    res = _run(code, NUMBA_ENABLE_CUDASIM="1", FLASHLAB_SIM_THREADS="")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[:1] == ["flashlab's:"] and res.stdout.split()[-2:] == ["ok", "True"]


class _FakeDriver:
    """cuda.bindings.driver's cuCtxGetDevice and CUresult, answering with a fixed device or error."""

    class CUresult:
        CUDA_SUCCESS, CUDA_ERROR_INVALID_CONTEXT = 0, 201

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def cuCtxGetDevice(self):
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer,want", [((0, 3), 3), ((201, 0), None), (OSError("no libcuda"), None)])
def test_current_device_id_asks_the_driver_once(monkeypatch, answer, want):
    fake = _FakeDriver(answer)
    monkeypatch.setitem(device._DRIVER, "module", fake)
    assert device._current_device_id() == want
    assert fake.calls == 1


def test_device_limits_known_device_skips_numbas_lookup(monkeypatch):
    """On a GPU, limits already read for the current device come back from one driver call; an unknown device (or
    no current context) goes through numba's lookup, which reads them."""
    limits = {"name": "fake GPU", "cc": (9, 0), "sms": 132}
    monkeypatch.setattr(device, "has_gpu", lambda: True)
    monkeypatch.setitem(device._DRIVER, "module", _FakeDriver((0, 5)))
    monkeypatch.setitem(device._LIMITS, 5, limits)

    def numba_lookup():
        raise AssertionError("numba's current-device lookup ran for a device whose limits are known")

    monkeypatch.setattr(device, "get_cuda", numba_lookup)
    got = device.device_limits()
    assert got == limits and got is not limits  # a copy: callers may edit theirs
    monkeypatch.setitem(device._DRIVER, "module", _FakeDriver((201, 0)))
    with pytest.raises(AssertionError, match="numba's current-device lookup"):
        device.device_limits()
