"""benchmarks/timing/bench_ring_gpus.py in its CPU mode: two gloo processes with tiny sizes run every phase the
GPU run has (context_parallel records its failure on CPU), and the file holds what lesson 19's figure reads."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "timing" / "bench_ring_gpus.py"


def test_cpu_mode_end_to_end(tmp_path):
    out = tmp_path / "ring_gpus.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--world-size", "2", "--rounds", "1",
                          "--dtypes", "float32", "--out", str(out)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["worlds"] == [1, 2] and data["date"] and data["gpu"].startswith("none")
    assert all(p["status"] == "done" for p in data["phases"].values()), data["phases"]
    checks = data["correctness_float32"]
    assert len(checks) == 2 * 2 * 2 and all(r["pass"] for r in checks)  # mask x layout x W
    assert max(max(r["err_ring"].values()) for r in checks) < 1e-5
    rows = data["scaling"]
    assert {(r["series"], r["W"], r["causal"], r["layout"]) for r in rows} == {
        (s, w, c, lay) for s in ("per_gpu", "total") for w in (1, 2)
        for c, lay in ((True, "zigzag"), (True, "contiguous"), (False, "zigzag"))}
    for r in rows:  # what the lesson's figure draws
        assert r["step_ms"] > 0 and r["model_step_ms"] > 0 and r["efficiency_forward"] > 0
        assert len(r["compute_ms_per_step"]) == r["W"] and all(len(c) == r["W"] for c in r["compute_ms_per_step"])
    assert {x["W"] for x in data["links"]["p2p_ring"]} == {2}
    assert data["context_parallel"]["errors"]  # no SDPA sharding rule on CPU: recorded, not raised
    assert "| series |" in run.stdout and "correctness: 8 of 8 cases pass" in run.stdout
    import matplotlib

    matplotlib.use("Agg")
    from flashlab.viz import ring as rviz

    fig = rviz.plot_gpu_measurement(rviz.load_gpu_measurement(out))  # lesson 19's figure reads this layout
    assert len(fig.axes) == 3 and data["date"] in fig._suptitle.get_text()
    matplotlib.pyplot.close(fig)
