"""The demo kernels of lessons 07 and 09, and the recorded numbers they quote without a GPU.

flashlab/data/lesson_facts.json is written by benchmarks/generators/lesson_facts.py on a GPU; until then it holds the
numbers the lessons used to quote, marked as a placeholder. Either way its layout is the script's.
"""
import copy
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from flashlab import bench
from flashlab.device import get_cuda
from flashlab.kernels import demo

ROOT = Path(__file__).resolve().parent.parent


def test_sums_kernels_agree(rng):
    cuda = get_cuda()
    x = rng.standard_normal(5).astype(np.float32)
    w = rng.standard_normal(demo.R).astype(np.float32)
    outs = []
    for kernel, extra in ((demo.sums_unrolled, ()), (demo.sums_dynamic, (demo.R,))):
        out = cuda.device_array((40, demo.R), np.float32)  # 2 blocks of 32: the last 24 threads write nothing
        kernel[2, 32](cuda.to_device(x), cuda.to_device(w), out, *extra)
        outs.append(out.copy_to_host())
    np.testing.assert_allclose(outs[0], np.tile(x.sum() * w, (40, 1)), rtol=1e-5)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_kernel_source_is_printable():
    assert "for j in range(R):" in demo.kernel_source(demo.sums_unrolled)
    assert "for j in range(r):" in demo.kernel_source(demo.sums_dynamic)
    demo.empty[1, 32](get_cuda().device_array(1, np.float32))  # launches, does nothing


def test_recorded_facts_have_the_scripts_layout():
    facts = bench.load_lesson_facts()
    assert facts["local_memory"]["R"] == demo.R
    assert facts["launch"]["numba_event_us"] > 0
    for name in ("unrolled", "dynamic"):
        rec = facts["local_memory"][name]
        assert rec["registers"] > 0 and rec["ms"] > 0 and rec["local_bytes"] >= 0
    # what lesson 09 teaches: the run-time index puts the array in local memory, the constant one does not
    assert facts["local_memory"]["unrolled"]["local_bytes"] == 0 < facts["local_memory"]["dynamic"]["local_bytes"]


def test_bad_facts_are_named(tmp_path):
    facts = bench.load_lesson_facts()
    broken = copy.deepcopy(facts)
    del broken["launch"]["numba_event_us"]
    broken["local_memory"]["dynamic"].pop("ms")
    with pytest.raises(ValueError, match=r"'launch' has keys.*numba_event_us.*local_memory\['dynamic'\]"):
        bench.check_lesson_facts(broken)
    path = tmp_path / "facts.json"
    path.write_text(json.dumps({**facts, "extra": 1}))
    with pytest.raises(ValueError, match="top-level keys"):
        bench.load_lesson_facts(path)


def _layout(obj):
    return {k: _layout(v) for k, v in obj.items()} if isinstance(obj, dict) else None


def test_the_script_writes_the_committed_layout(tmp_path, monkeypatch):
    """benchmarks/generators/lesson_facts.py, with the GPU measurements replaced by fakes, writes a file of exactly the
    layout of the committed one (which lessons 07 and 09 read)."""
    spec = importlib.util.spec_from_file_location("lesson_facts_script", ROOT / "benchmarks" / "generators" / "lesson_facts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    env = {"gpu": "Fake GPU", "compute_capability": "9.0", "sms": 1, "driver_cuda": "13.0", "nvidia_driver": "1",
           "torch": "2", "torch_cuda": "13.0", "numba": "0.68", "numba_cuda": "0.30", "numpy": "2", "python": "3",
           "nvrtc": "13.0"}
    monkeypatch.setitem(sys.modules, "bench_kernels", types.SimpleNamespace(environment=lambda: env))
    monkeypatch.setattr(script, "has_gpu", lambda: True)
    monkeypatch.setattr(demo, "launch_cost", lambda **kw: {"event_us": 25.0, "host_us": 20.0})
    monkeypatch.setattr(demo, "torch_launch_cost", lambda **kw: {"torch_event_us": 6.0, "torch_host_us": 5.0,
                                                                 "numba_torch_arg_host_us": 40.0})
    kernel = {"registers": 40, "local_bytes": 0, "ms": 0.5}
    monkeypatch.setattr(demo, "local_memory_cost", lambda **kw: {"unrolled": dict(kernel),
                                                                 "dynamic": {**kernel, "local_bytes": 64}})
    out = tmp_path / "facts.json"
    script.main(["--out", str(out)])
    written = bench.load_lesson_facts(out)
    assert _layout(written) == _layout(bench.load_lesson_facts())
    assert written["gpu"] == "Fake GPU" and written["launch"]["numba_host_us"] == 20.0
    assert not written["source"].startswith("placeholder")
