"""When calls with torch tensors take the prepared (fast) launch path and how it launches (kernels/prepared.py:
FLASHLAB_FAST_LAUNCH, available(), state(), PreparedKernel's choice of launch), and what flashlab.doctor() says
about it: decided with stand-ins for the GPU, numba-cuda's dispatcher and cuda.bindings, so no GPU is needed.
The argument layout itself is tests/marshal_check.py's (run by tests/test_plan.py)."""
from types import SimpleNamespace

import numpy as np
import pytest

from flashlab import checkup
from flashlab.kernels import prepared


def _launch(*args):
    raise AssertionError("recorded by the test instead")


class LaunchConfig(dict):
    def __init__(self, **kw):
        super().__init__(kw)


# numba-cuda's dispatcher module as each release has it
NEW = SimpleNamespace(_Kernel=object, launch=_launch, LaunchConfig=LaunchConfig, CUDA_CORE_GE_1_0=True)  # 0.30
OLD = SimpleNamespace(_Kernel=object)  # Colab's 0.22: _Kernel, no cuda.core launch
BARE = SimpleNamespace()  # a numba-cuda without _Kernel


@pytest.fixture
def world(monkeypatch):
    """world(mode, gpu=, dispatcher=, bindings=, direct_env=): FLASHLAB_FAST_LAUNCH=mode (None: unset),
    FLASHLAB_DIRECT_LAUNCH=direct_env (None: unset), and the stand-ins."""
    def arrange(mode, gpu=True, dispatcher=NEW, bindings=True, direct_env=None):
        for var, value in (("FLASHLAB_FAST_LAUNCH", mode), ("FLASHLAB_DIRECT_LAUNCH", direct_env)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        monkeypatch.setattr(prepared, "has_gpu", lambda: gpu)
        monkeypatch.setattr(checkup, "has_gpu", lambda: gpu)
        monkeypatch.setattr(prepared, "_numba_dispatcher", lambda: dispatcher)
        monkeypatch.setattr(prepared, "_bindings", lambda: bindings)
        prepared._supported.cache_clear()

    yield arrange
    prepared._supported.cache_clear()  # before the stand-ins go: no decision of theirs stays cached


# mode, dispatcher, cuda.bindings, FLASHLAB_DIRECT_LAUNCH -> state, launched with _DirectLaunch
CASES = [
    (None, NEW, True, None, "on", True),  # numba-cuda 0.30: the default, measured setup
    ("1", NEW, True, None, "on", True),
    ("1", NEW, True, "0", "on", False),  # cuda.core's launch instead
    ("1", NEW, False, None, "on", False),  # no cuda.bindings: cuda.core's launch
    (None, OLD, True, None, "no-core-launch", None),  # Colab's 0.22 by default: off
    ("1", OLD, True, "1", "no-core-launch", None),
    (None, OLD, False, None, "unsupported", None),
    ("direct", OLD, True, None, "direct", True),  # Colab's 0.22 with the switch: the direct launch alone
    (" Direct ", OLD, True, "0", "direct", True),  # FLASHLAB_DIRECT_LAUNCH is not read then
    ("direct", NEW, True, "0", "direct", True),
    ("direct", OLD, False, None, "no-bindings", None),
    ("direct", NEW, False, None, "no-bindings", None),  # direct means cuLaunchKernel, never cuda.core's launch
    ("0", NEW, True, None, "off", None),
    ("no", OLD, True, None, "off", None),
    (None, BARE, True, None, "unsupported", None),
    ("direct", BARE, True, None, "unsupported", None),
    ("direct", None, True, None, "unsupported", None),  # numba-cuda's dispatcher does not import
]


@pytest.mark.parametrize("mode, dispatcher, bindings, direct_env, state, direct", CASES)
def test_the_fast_path_is_on_where_its_launch_exists(world, monkeypatch, mode, dispatcher, bindings, direct_env,
                                                     state, direct):
    world(mode, dispatcher=dispatcher, bindings=bindings, direct_env=direct_env)
    assert prepared.state() == state
    assert prepared.available() == (state in ("on", "direct"))
    if direct is not None:  # the launch PreparedKernel picks (what _DirectLaunch.make consults)
        assert prepared._direct_launch_on() == direct


@pytest.mark.parametrize("mode", [None, "1", "direct"])
def test_without_a_gpu_every_call_goes_the_general_way(world, mode):
    world(mode, gpu=False, dispatcher=OLD)
    assert not prepared.available() and prepared.state() == ("no-gpu")


def test_the_decision_follows_the_variable_without_a_restart(world, monkeypatch):
    world(None, dispatcher=OLD)
    assert not prepared.available()
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "direct")
    assert prepared.available()
    monkeypatch.setenv("FLASHLAB_FAST_LAUNCH", "0")
    assert not prepared.available()


class Dispatcher:
    """A numba dispatcher with one compiled kernel (what PreparedKernel reads)."""

    def __init__(self):
        cufunc = SimpleNamespace(handle=1234, kernel="cuda.core kernel")
        self.kernel = SimpleNamespace(debug=False, _codelibrary=SimpleNamespace(get_cufunc=lambda: cufunc))
        self.overloads = {}

    def compile(self, types_):
        self.overloads[types_] = self.kernel


ARGS = [prepared.Spec.contiguous((2, 3, 4), np.float32), prepared.Spec.contiguous((5,), np.int32), 7,
        np.float32(0.5), True, 0]


@pytest.mark.parametrize("dispatcher", [OLD, NEW])
def test_direct_mode_prepares_the_direct_launch(world, dispatcher):
    pytest.importorskip("cuda.bindings")  # _DirectLaunch wraps the handle in a CUfunction (no driver call)
    world("direct", dispatcher=dispatcher)
    kernel = prepared.PreparedKernel(Dispatcher(), (4, 2), 128, ARGS)
    assert kernel.direct is not None and int(kernel.direct.handle) == 1234 and kernel.direct.grid == (4, 2, 1)
    assert list(kernel.direct.ptrs) == [0, 0]  # the data pointers, filled in at launch


def test_the_cuda_core_launch_gets_the_pointers_and_the_seed(world, monkeypatch):
    world("1", dispatcher=NEW, bindings=False)
    calls = []
    monkeypatch.setattr(NEW, "launch", lambda *a: calls.append(a))
    monkeypatch.setitem(prepared._STREAMS, 5, "stream 5")
    kernel = prepared.PreparedKernel(Dispatcher(), (4, 2), 128, ARGS)
    assert kernel.direct is None and kernel.config == {"grid": (4, 2), "block": 128, "shmem_size": 0,
                                                       "is_cooperative": False}
    kernel.launch(5, [111, 222], seed=99)
    stream, config, function, *args = calls[0]
    assert (stream, function) == ("stream 5", "cuda.core kernel")
    assert args[4] == 111 and args[5 + 2 * 3 + 4] == 222 and args[-1].value == 99


def test_without_any_launch_preparing_says_so(world):
    world("direct", dispatcher=OLD, bindings=False)  # available() is False here; a caller that asks anyway:
    with pytest.raises(RuntimeError, match="no cuda.core launch"):
        prepared.PreparedKernel(Dispatcher(), (1,), 32, ARGS)


@pytest.mark.parametrize("mode, dispatcher, bindings, words", [
    (None, NEW, True, ["on: repeated calls"]),
    (None, OLD, True, ["off (numba-cuda", "lacks cuda.core's launch", "FLASHLAB_FAST_LAUNCH=direct",
                       "not yet run on a GPU", "every call takes the general path"]),
    ("direct", OLD, True, ["on through FLASHLAB_FAST_LAUNCH=direct", "cuLaunchKernel alone"]),
    ("direct", OLD, False, ["off (FLASHLAB_FAST_LAUNCH=direct needs cuda.bindings"]),
    ("0", NEW, True, ["off (FLASHLAB_FAST_LAUNCH=0)"]),
    (None, BARE, True, ["lacks the launch internals it uses"]),
])
def test_the_doctor_says_which_path_calls_take(world, mode, dispatcher, bindings, words):
    world(mode, dispatcher=dispatcher, bindings=bindings)
    said = checkup._fast_launch()
    for w in words:
        assert w in said, said
    assert "µs" in said
