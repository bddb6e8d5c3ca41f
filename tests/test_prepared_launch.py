"""The prepared path's argument lists (kernels/prepared.py), without a GPU: the compile step and the driver's
cuLaunchKernel are stood in for, and each launch's kernelParams array is read back through its addresses, as the
driver reads it. Every data pointer must sit where the launch description names its array: the caller's, the host
arrays kept on the device, and each call's temporaries (distinct, alive until the last kernel is enqueued); scalars
as marshalled once; the dropout seed in the seeded launch's last argument only. The GPU tests (tests/test_plan.py,
tests/test_torch_integration.py) run the same path on real kernels."""
import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

from flashlab.kernels import forward, prepared
from flashlab.kernels._launch import Arg, Launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "profiling"))
from prepared_call_host import install_stubs  # noqa: E402 (the stubs the host-time benchmark times with)

torch = pytest.importorskip("torch")


@pytest.fixture
def launched(monkeypatch):
    """The launches made, as (grid, block, shared, [every parameter's 8 bytes], the _DirectLaunch); its template holds
    each argument as marshalled (ctypes scalars, ints), its slots where the data pointers go."""
    records = []

    def record(direct, params):
        addresses = (ctypes.c_void_p * len(direct.values)).from_address(params)
        words = [ctypes.c_uint64.from_address(a).value for a in addresses]
        records.append((direct.grid, direct.block, direct.shared, words, direct))

    install_stubs(monkeypatch.setattr, record)
    return records


def _bytes(x) -> tuple:
    """(value, size): an argument's bytes as an unsigned number, as the driver reads them."""
    if isinstance(x, ctypes._SimpleCData):
        size = ctypes.sizeof(x)
        return int.from_bytes(bytes(x), "little"), size
    return ctypes.c_uint64(int(x)).value, 8


def _check_scalars(record):
    """Every parameter but the data pointers (and the seed, checked apart) is what marshal made once."""
    _, _, _, words, direct = record
    for i, x in enumerate(direct.template):
        if i not in direct.slots and i != len(direct.template) - 1:
            want, size = _bytes(x)
            assert words[i] & ((1 << 8 * size) - 1) == want, (i, x, words[i])


def _pointers(record) -> list:
    _, _, _, words, direct = record
    return [words[i] for i in direct.slots]


def _rows(n, dtype=np.float32):
    return prepared.Spec.contiguous((n, 1), dtype)


def test_each_launch_reads_its_arrays_by_name(launched, monkeypatch):
    # a kernel then a merge: caller arrays, a kept host array and a temporary, in an order unlike the inputs'
    first = Launch(None, (2, 1, 1), 64, ("x", "table", Arg("part", (8, 1)), np.float32(0.5), np.int64(0)))
    merge = Launch(None, (1,), 32, (Arg("part", (4, 2)), "out", "x", np.int64(3)))
    specs = {"x": _rows(8), "out": _rows(4), "table": prepared.Spec.contiguous((3,), np.int32)}
    call = prepared.PreparedLaunches([first, merge], specs, ("out", "x"), {"part": ((8, 1), np.float32)},
                                     seeded=0, known={"table": 0xAB00})
    allocated = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        allocated.append(real_empty(*args, **kwargs))
        return allocated[-1]

    monkeypatch.setattr(torch, "empty", empty)
    call(5, (0x1000, 0x2000), "cpu", seed=2 ** 40 + 3)
    assert len(launched) == 2 and len(allocated) == 1
    part = allocated[0].data_ptr()
    assert _pointers(launched[0]) == [0x2000, 0xAB00, part]
    assert _pointers(launched[1]) == [part, 0x1000, 0x2000]
    assert launched[0][3][-1] == 2 ** 40 + 3  # the seed, in the seeded launch alone
    assert launched[1][3][-1] == 3
    assert launched[0][:3] == ((2, 1, 1), 64, 0) and launched[1][:3] == ((1, 1, 1), 32, 0)
    for record in launched:
        _check_scalars(record)


def test_a_call_passes_exactly_the_prepared_inputs(launched):
    launch = Launch(None, (1,), 32, ("x", "out"))
    with pytest.raises(ValueError, match=r"does not pass: \['out'\]"):
        prepared.PreparedLaunches([launch], {"x": _rows(4), "out": _rows(4)}, ("x",))
    call = prepared.PreparedLaunches([launch], {"x": _rows(4), "out": _rows(4)}, ("x", "out"))
    with pytest.raises(ValueError, match="expected 2 data pointers"):
        call(0, (0x10,), "cpu")
    call(0, (0x10, 0x20), "cpu")
    assert _pointers(launched[0]) == [0x10, 0x20]


@pytest.mark.parametrize("variant, dtype, extras", [
    ("tensor", np.float16, {}),
    ("register", np.float32, {"splits": 2}),  # split-KV: the partial outputs are temporaries, then the merge
    ("tensor", np.float32, {"softcap": 2.0, "alibi_slopes": np.array([0.25, 0.5])}),  # slopes: a kept host array
])
def test_prepared_forward_passes_the_callers_tensors(launched, rng, variant, dtype, extras):
    library = {n: extras.pop(n) for n in ("softcap", "alibi_slopes") if n in extras}
    q = rng.standard_normal((1, 2, 40, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 2, 50, 64)).astype(dtype) for _ in range(2))
    plan, scale, _ = forward.setup(q, k, v, True, None, variant, None, None, None, None, extras.get("splits"), None,
                                   extras=bool(library))
    ex = None
    if library:
        from flashlab._inputs import check_options
        from flashlab.kernels.options import Extras

        ex = Extras.from_options(check_options((1, 2, 40, 64), causal=True, scale=scale, **library), 1, 2)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    call = forward.PreparedForward(plan, scale, tq, tk, tv, ex)
    o, lse = call(tq, tk, tv, 11 if ex is not None else None)
    assert o.shape == (1, 2, 40, 64) and lse.shape == (1, 2, 40)
    assert len(launched) == (2 if plan.splits > 1 else 1)
    main = _pointers(launched[0])
    ptrs = [t.data_ptr() for t in (tq, tk, tv)]
    assert main[:3] == ptrs
    if plan.splits > 1:  # the chunks' partial outputs, then the merge into o and lse
        assert len(set(main[3:5])) == 2 and not set(main[3:5]) & {o.data_ptr(), lse.data_ptr(), *ptrs}
        assert set(main[3:5]) <= set(_pointers(launched[1]))
        assert {o.data_ptr(), lse.data_ptr()} <= set(_pointers(launched[1]))
    else:
        assert main[3:5] == [o.data_ptr(), lse.data_ptr()]
    if library:
        assert main[5] == call.launches.kept["slopes"].data_ptr()
        assert launched[0][3][-1] == 11
    for record in launched:
        _check_scalars(record)


def test_prepared_register_backward_passes_the_callers_tensors(launched, rng):
    from flashlab.kernels import backward

    q, o, do = (rng.standard_normal((1, 2, 33, 32)).astype(np.float32) for _ in range(3))
    k, v = (rng.standard_normal((1, 2, 45, 32)).astype(np.float32) for _ in range(2))
    lse = rng.standard_normal((1, 2, 33)).astype(np.float32)
    plan, scale, rows, _, _ = backward._register_setup(q, k, v, o, lse, do, True, None, None, None, None)
    tensors = [torch.from_numpy(x) for x in (q, k, v, o, lse, do)]
    call = backward.PreparedRegisterBackward(plan, scale, rows, *tensors)
    dq, dk, dv = call(*tensors)
    named = dict(zip(backward.GRADIENT_INPUTS, [t.data_ptr() for t in (*tensors, dq, dk, dv)]))
    by_pointer = {p: n for n, p in named.items()}
    seen = set()
    assert len(launched) == len(call.launches.arrays)
    for record, names in zip(launched, call.launches.arrays):
        for name, ptr in zip(names, _pointers(record), strict=True):
            seen.add(name)
            assert by_pointer.get(ptr, "a temporary") == (name if name in named else "a temporary"), name
        _check_scalars(record)
    assert {"q", "k", "v", "do", "dq", "dk", "dv", "lse"} <= seen

