"""Where do a kernel's issue slots go? Profile both forward kernels with Nsight Compute and save the result.

    python benchmarks/profiling/profile_issue_slots.py                 # needs ncu on PATH and a GPU; ~1 minute
    python benchmarks/profiling/profile_issue_slots.py --out flashlab/data/issue_profile.csv

For each variant ("shared", "register") at B = 1, H = 16, N = 4096, d = 64, float32, ncu measures one launch
(clocks not locked, so the time matches an ordinary run) and this script records:
- executed warp instructions, split by kind (FFMA, other FP32, index arithmetic, shared / global memory,
  exp2 on the MUFU unit, uniform and control);
- how often a scheduler issued an instruction (issue slots busy) and how many warps it had;
- why warps waited (ncu's stall reasons, in warps per issued instruction).
Lesson 10 plots the saved CSV ("Inside the SM"). The identity it checks: a kernel whose useful work is all
FFMA (2 FLOPs each) runs at  FP32 peak x (issue slots busy) x (FFMA share of the issued instructions).
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "wait",
          "not_selected", "selected", "dispatch_stall", "no_instruction", "branch_resolving", "lg_throttle",
          "drain", "membar", "misc", "sleeping", "tex_throttle", "imc_miss")
METRICS = {  # our name -> ncu metric
    "time_ns": "gpu__time_duration.sum",
    "inst": "smsp__inst_executed.sum",
    "ffma_threads": "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum",
    "fadd_threads": "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum",
    "fmul_threads": "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "pipe_fma": "smsp__inst_executed_pipe_fma.sum",
    "pipe_alu": "smsp__inst_executed_pipe_alu.sum",
    "pipe_xu": "smsp__inst_executed_pipe_xu.sum",
    "pipe_uniform": "smsp__inst_executed_pipe_uniform.sum",
    "pipe_cbu": "smsp__inst_executed_pipe_cbu.sum",
    "shared_ld": "smsp__sass_inst_executed_op_shared_ld.sum",
    "shared_st": "smsp__sass_inst_executed_op_shared_st.sum",
    "global_ld": "smsp__sass_inst_executed_op_global_ld.sum",
    "global_st": "smsp__sass_inst_executed_op_global_st.sum",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps_per_scheduler": "smsp__warps_active.avg.per_cycle_active",
    **{f"stall_{s}": f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS},
}


def run_ncu(variant: str, metrics: dict, n: int, d: int) -> dict:
    """One ncu run; metrics ncu does not know are dropped (and reported) rather than failing the run."""
    metrics = dict(metrics)
    for _ in range(3):
        with tempfile.NamedTemporaryFile("r", suffix=".csv") as log:
            cmd = ["ncu", "--clock-control", "none", "--kernel-name", "regex:flash_fwd", "--launch-skip", "1",
                   "--launch-count", "1", "--csv", "--page", "raw", "--log-file", log.name,
                   "--metrics", ",".join(metrics.values()),
                   sys.executable, str(ROOT / "benchmarks" / "profile_forward.py"), variant, str(d), "--n", str(n)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            text = log.read()
        unknown = set(re.findall(r"Failed to find metric (\S+)", text + proc.stdout + proc.stderr))
        if unknown:
            print(f"  ncu does not know {sorted(unknown)}; dropped", file=sys.stderr)
            metrics = {k: v for k, v in metrics.items() if v.strip('"') not in unknown}
            continue
        rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
        if len(rows) < 3:
            raise RuntimeError(f"ncu returned no measurement for {variant}:\n{text[-2000:]}\n{proc.stderr[-2000:]}")
        header, values = rows[0], rows[-1]  # rows[1] holds the units
        by_metric = dict(zip(header, values))
        return {k: float(by_metric[m].replace(",", "")) for k, m in metrics.items() if m in by_metric}
    raise RuntimeError("ncu kept rejecting metrics")


def kinds(m: dict) -> dict:
    """Executed warp instructions by kind (thread counts of FP32 ops divided by 32: all lanes are active)."""
    ffma, fadd_fmul = m["ffma_threads"] / 32, (m["fadd_threads"] + m["fmul_threads"]) / 32
    out = {
        "FFMA": ffma,
        "FADD/FMUL": fadd_fmul,
        "IMAD (index math)": max(m["pipe_fma"] - ffma - fadd_fmul, 0.0),
        "ALU: integer/compare/max": m["pipe_alu"],
        "shared memory": m["shared_ld"] + m["shared_st"],
        "global memory": m["global_ld"] + m["global_st"],
        "MUFU: exp2/convert": m["pipe_xu"],
        "uniform/branch/barrier": m["pipe_uniform"] + m["pipe_cbu"],
    }
    out["other (moves etc.)"] = max(m["inst"] - sum(out.values()), 0.0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "flashlab" / "data" / "issue_profile.csv"))
    a = ap.parse_args()
    if shutil.which("ncu") is None:
        sys.exit("ncu (Nsight Compute) is not on PATH: install the CUDA toolkit's Nsight Compute, or add its "
                 "folder to PATH (often /usr/local/cuda/bin)")
    sys.path.insert(0, str(ROOT))
    from flashlab.device import device_limits

    gpu = device_limits()["name"]
    rows = []
    for variant in ("shared", "register"):
        print(f"profiling {variant} (N={a.n}, d={a.d}) ...", flush=True)
        m = run_ncu(variant, METRICS, a.n, a.d)
        flops = 4 * 16 * a.n * a.n * a.d
        record = {"tflops": flops / m["time_ns"] / 1e3, **m, **{f"kind:{k}": v for k, v in kinds(m).items()}}
        rows += [{"gpu": gpu, "variant": variant, "N": a.n, "d": a.d, "key": k, "value": f"{v:.6g}"}
                 for k, v in record.items()]
        share = record["kind:FFMA"] / m["inst"]
        print(f"  {record['tflops']:.2f} TFLOP/s, issue slots busy {m['issue_active_pct']:.1f}%, "
              f"FFMA share {share:.1%}, warps/scheduler {m['warps_per_scheduler']:.2f}")
        top = sorted(((v, k[6:]) for k, v in m.items() if k.startswith("stall_")), reverse=True)[:4]
        print("  top stalls (warps per issue): " + ", ".join(f"{k} {v:.2f}" for v, k in top))
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["gpu", "variant", "N", "d", "key", "value"])
        w.writeheader()
        w.writerows(rows)
    print("saved", a.out)


if __name__ == "__main__":
    main()
