"""The Python host work of one prepared call (kernels/prepared.py), on a CPU, with the compile step and the driver's
cuLaunchKernel stood in for: what a call costs before the driver, which is most of a small call's host time on a GPU
(a 1 x 16 x 1024 float16 forward spends about 25 us of host time per call on an H200; docs/runs/kernel-layers.md).

    python benchmarks/profiling/prepared_call_host.py                 # this checkout
    PYTHONPATH=/path/to/old/checkout python benchmarks/profiling/prepared_call_host.py   # another copy of flashlab

It prints microseconds per call (the minimum over many batches, which filters out other work on the machine) for the
prepared forward (tensor float16; register float32 with split-KV: two launches and two temporaries) and the register
backward (three launches), at small shapes (the Python work does not depend on them). torch.empty is timed as a
real CPU allocation of a few kilobytes, about what torch's caching allocator costs on a GPU; the stream lookup is
stubbed. Run old and new copies alternately, on an idle machine, and
compare their numbers: the absolute values depend on the CPU. tests/test_prepared_launch.py uses `install_stubs` to
check the argument lists the stubbed driver receives."""
from __future__ import annotations

import os
import sys
import timeit
import types
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an old checkout there wins
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # no GPU: the simulator's numba, only to build descriptions


class _Dispatcher:
    """What PreparedKernel asks of a numba dispatcher: compile(signature), then overloads[signature]."""

    def __init__(self):
        self.overloads = {}

    def compile(self, signature):
        function = types.SimpleNamespace(handle=7, kernel=None, device=types.SimpleNamespace(id=0))
        self.overloads[signature] = types.SimpleNamespace(
            debug=False, _codelibrary=types.SimpleNamespace(get_cufunc=lambda: function))


def install_stubs(setattr_, on_launch=None):
    """Stand in for the compile step, cuLaunchKernel and torch's stream in flashlab.kernels.prepared, through
    setattr_(obj, name, value) (pytest's monkeypatch.setattr, or setattr). on_launch(direct, params_address), if
    given, sees each launch; returns the list of _DirectLaunch objects made."""
    from flashlab.kernels import prepared

    made = []

    class Driver:
        class CUresult:
            CUDA_SUCCESS = 0

        CUfunction = staticmethod(int)

        @staticmethod
        def cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            if on_launch is not None:
                on_launch(next(d for d in made if d.address == params), params)
            return (0,)

    class Kernel(prepared.PreparedKernel):
        def __init__(self, dispatcher, grid, block, args, shared=0):
            super().__init__(_Dispatcher(), grid, block, args, shared)

    def make(cls, kernel, grid, block, template, slots, shared=0):
        direct = cls(Driver, 7, grid, block, template, slots, shared)
        direct.template, direct.slots = list(template), list(slots)
        made.append(direct)
        return direct

    setattr_(prepared, "PreparedKernel", Kernel)
    setattr_(prepared._DirectLaunch, "make", classmethod(make))
    setattr_(prepared, "_cu_stream", lambda handle: handle)
    setattr_(prepared, "current_stream", lambda t: 0)  # torch's raw stream getter needs a CUDA build
    return made


def calls():
    """(name, call, arguments) of the prepared calls timed, on CPU torch tensors."""
    import numpy as np
    import torch

    from flashlab.kernels import backward, forward

    rng = np.random.default_rng(0)
    out = []
    for name, variant, dtype, splits in (("forward tensor float16", "tensor", np.float16, None),
                                         ("forward register float32, split-KV", "register", np.float32, 2)):
        q, k, v = (rng.standard_normal((1, 2, 128, 64)).astype(dtype) for _ in range(3))
        plan, scale, _ = forward.setup(q, k, v, True, None, variant, None, None, None, None, splits, None)
        tensors = [torch.from_numpy(x) for x in (q, k, v)]
        out.append((name, forward.PreparedForward(plan, scale, *tensors), tensors))
    q, k, v, o, do = (rng.standard_normal((1, 2, 128, 32)).astype(np.float32) for _ in range(5))
    lse = rng.standard_normal((1, 2, 128)).astype(np.float32)
    plan, scale, rows, _, _ = backward._register_setup(q, k, v, o, lse, do, True, None, None, None, None)
    tensors = [torch.from_numpy(x) for x in (q, k, v, o, lse, do)]
    out.append(("backward register float32", backward.PreparedRegisterBackward(plan, scale, rows, *tensors), tensors))
    return out


def main():
    import flashlab

    from numba.cuda import dispatcher

    for name, value in (("CUDA_CORE_GE_1_0", True), ("LaunchConfig", lambda **options: options), ("launch", None)):
        if not hasattr(dispatcher, name):  # the simulator's numba has no cuda.core launch, whose config some copies of
            setattr(dispatcher, name, value)  # flashlab build even where the direct launch serves
    install_stubs(setattr)
    print(f"flashlab from {Path(flashlab.__file__).parent}")
    for name, call, args in calls():
        call(*args)
        best = min(timeit.repeat(lambda: call(*args), number=20, repeat=1500)) / 20 * 1e6
        print(f"{name:40s} {best:6.2f} us per call")


if __name__ == "__main__":
    main()
