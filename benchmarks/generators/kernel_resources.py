"""Registers, spills and shared memory of every kernel configuration the planner can choose, for compute
capabilities 7.5 (T4), 8.0 (A100) and 9.0 (H100), compiled without a GPU:

    export LD_LIBRARY_PATH=/path/to/nvrtc/lib:$CUDA_HOME/lib CUDA_HOME=/usr/local/cuda NUMBA_ENABLE_CUDASIM=0
    python benchmarks/generators/kernel_resources.py            # writes flashlab/data/kernel_resources.csv
    python benchmarks/generators/kernel_resources.py --check    # compiles nothing: lists configurations without a row
    python benchmarks/generators/kernel_resources.py --missing  # compiles only those, and keeps the other rows as they are
    python benchmarks/generators/kernel_resources.py --variant tensor  # recompiles one variant's rows (after a change to it)
    python benchmarks/generators/kernel_resources.py --out new.csv && \
        PYTHONPATH=/path/to/old/checkout python benchmarks/generators/kernel_resources.py --out old.csv
    python benchmarks/generators/kernel_resources.py --compare old.csv new.csv   # registers and spills, old -> new

numba-cuda turns each kernel into PTX for the asked compute capability (numba.cuda.compile_ptx, which needs
NVRTC/NVVM but no driver) and NVIDIA's assembler `ptxas -v` reports what the compiled kernel uses. The
planner reads this table when it plans for a device passed by hand (flashlab.kernels.plan.T4, ...); on a GPU
it asks the compiled kernel itself. On a GPU machine run this script too: the driver may compile PTX with
a different assembler, and the rows say which one made them (`ptxas` column).

Configurations: flashlab.kernels.plan.planner_configs() (what the planner picks for a T4, an A100 and an
H100 at every d, dtype, causal and split, plus register.D128_REDESIGN), each for the three compute
capabilities where the instruction set allows (mma.m16n8k16 and tf32 need 8.0).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # after PYTHONPATH: an old checkout there wins
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

CCS = ((7, 5), (8, 0), (9, 0))


def _compile_only():
    """Let flashlab build GPU kernels (not simulator ones) on a machine without a driver."""
    import flashlab.device as dev

    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise SystemExit("NUMBA_ENABLE_CUDASIM is set: unset it (this script compiles for real GPUs)")
    dev._state["backend"] = "gpu"  # compile only: nothing is launched
    # Typing a call to a device function asks the current device for its compute capability; without a driver,
    # answer for the newest target (the inlined device functions' code is compiled for the kernel's own target).
    import numba.cuda.dispatcher as nd

    if not getattr(nd.get_current_device, "_compile_only", False):
        class _Target:
            compute_capability = (9, 0)

        def current_device():
            try:
                return current_device.real()
            except Exception:
                return _Target()

        current_device.real, current_device._compile_only = nd.get_current_device, True
        nd.get_current_device = current_device


def ptxas_version() -> str:
    out = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "?"


def ptxas_resources(kernel, sig, cc) -> tuple:
    """(registers, spill bytes, static shared bytes) of a numba kernel compiled for compute capability cc: numba
    makes the PTX, `ptxas -v` reports. Spill bytes: the larger of spill stores and the stack frame (local memory
    per thread: spills and local arrays)."""
    from numba.cuda import compile_ptx

    ptx, _ = compile_ptx(kernel.py_func, sig, cc=cc, fastmath=kernel.targetoptions.get("fastmath", False))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(["ptxas", f"-arch=sm_{cc[0]}{cc[1]}", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    spill = re.search(r"(\d+) bytes spill stores", out)
    stack = re.search(r"(\d+) bytes stack frame", out)
    smem = re.search(r"(\d+) bytes smem", out)
    return (int(re.search(r"Used (\d+) registers", out).group(1)),
            max(int(spill.group(1)) if spill else 0, int(stack.group(1)) if stack else 0),
            int(smem.group(1)) if smem else 0)


def compile_one(key):
    """One row: compile `key` (a planner_configs() tuple, with the target cc last) for its cc."""
    from flashlab.kernels import plan

    variant, direction, d, dtype, precision, config, causal, split, heavy, cc = key
    kernel, sig = plan.kernel_and_signature(variant, direction, d, dtype, precision, config, causal, split, heavy)
    regs, spill_bytes, static = ptxas_resources(kernel, sig, cc)
    threads = getattr(config, "threads", None) or (config[2] if direction == "backward" else config[0])
    if variant == "tensor" and direction == "backward":  # its shared memory is dynamic, sized at launch
        static += 4 * config.shared_words(d, precision)
    return {"variant": variant, "direction": direction, "d": d, "dtype": dtype, "precision": precision or "",
            "tile": plan.config_text(variant, direction, config), "causal": int(causal), "split": int(split),
            "heavy_first": int(heavy), "cc": f"{cc[0]}.{cc[1]}", "registers": regs,
            "spill_bytes": spill_bytes, "shared_bytes": static, "threads": threads}


def _init():
    _compile_only()


def all_keys():
    """planner_configs() with each configuration once per compute capability it can be built for."""
    from flashlab.kernels import plan

    keys = {}
    for variant, direction, d, dtype, precision, config, causal, split, heavy, _ in plan.planner_configs():
        for cc in CCS:
            if variant == "tensor" and precision != "k8" and cc < (8, 0):
                continue  # mma.m16n8k16 and tf32 mma need compute capability 8.0
            keys[(variant, direction, d, dtype, precision, config, causal, split, heavy, cc)] = None
    return list(keys)


def compare(old_csv, new_csv) -> int:
    """Registers and spill bytes of every configuration in both tables, old against new: a Markdown summary per
    (variant, direction, cc), then every configuration that got worse."""
    import csv

    key = ("variant", "direction", "d", "dtype", "precision", "tile", "causal", "split", "heavy_first", "cc")
    old, new = ({tuple(r[c] for c in key): r for r in csv.DictReader(open(p, newline=""))} for p in (old_csv, new_csv))
    common = sorted(set(old) & set(new))
    groups, worse = {}, []
    for k in common:
        o, n = old[k], new[k]
        dr, ds = int(n["registers"]) - int(o["registers"]), int(n["spill_bytes"]) - int(o["spill_bytes"])
        g = groups.setdefault((k[0], k[1], k[-1]), {"n": 0, "same": 0, "fewer": 0, "more": 0, "spill_more": 0,
                                                     "max_more": 0})
        g["n"] += 1
        g["same"] += dr == 0 and ds == 0
        g["fewer"] += dr < 0 or ds < 0
        g["more"] += dr > 0
        g["spill_more"] += ds > 0
        g["max_more"] = max(g["max_more"], dr)
        if dr > 0 or ds > 0:
            worse.append((k, o["registers"], n["registers"], o["spill_bytes"], n["spill_bytes"]))
    print(f"{len(old)} and {len(new)} configurations, {len(common)} in both")
    print("| variant | direction | cc | configurations | unchanged | fewer registers or spills | more registers | "
          "most registers added | more spills |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (variant, direction, cc), g in sorted(groups.items()):
        print(f"| {variant} | {direction} | {cc} | {g['n']} | {g['same']} | {g['fewer']} | {g['more']} | "
              f"{g['max_more']} | {g['spill_more']} |")
    for k, r0, r1, s0, s1 in worse:
        print("worse:", "|".join(k), f"registers {r0} -> {r1}, spill bytes {s0} -> {s1}")
    return 1 if worse else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "flashlab" / "data" / "kernel_resources.csv"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--check", action="store_true", help="list the configurations that have no row; compile nothing")
    ap.add_argument("--missing", action="store_true", help="compile only the configurations without a row")
    ap.add_argument("--variant", help="recompile only this variant's configurations; keep the other rows")
    ap.add_argument("--cc", nargs="*", default=None, help="only these compute capabilities, such as 9.0 (with --out)")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two tables: exit 1 if a configuration "
                    "uses more registers or spills more in NEW")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    _compile_only()
    from flashlab.bench import write_csv
    from flashlab.kernels import plan

    keys = all_keys()
    if args.cc:
        keys = [k for k in keys if f"{k[-1][0]}.{k[-1][1]}" in args.cc]
    table = plan.resource_table()
    missing = [k for k in keys if plan.resource_key(*k[:5], plan.config_text(k[0], k[1], k[5]), *k[6:]) not in table]
    if args.check:
        print(f"{len(keys)} configurations, {len(missing)} without a row in {plan.RESOURCES_CSV}")
        for k in missing[:20]:
            print("  missing:", k)
        return 1 if missing else 0
    version = ptxas_version()
    print(f"{len(keys)} configurations, ptxas {version}, {args.jobs} processes", flush=True)
    rows = []
    if args.missing or args.variant:  # keep the existing rows that are not recompiled
        import csv

        with open(plan.RESOURCES_CSV, newline="") as f:
            rows = list(csv.DictReader(f))
        if args.variant:
            rows = [r for r in rows if r["variant"] != args.variant]
            keys = [k for k in keys if k[0] == args.variant]
        else:
            keys = missing
    from tqdm.auto import tqdm

    with ProcessPoolExecutor(args.jobs, initializer=_init) as pool:
        for row in tqdm(pool.map(compile_one, keys, chunksize=4), total=len(keys), desc="compiling"):
            rows.append({**row, "ptxas": version})
    rows.sort(key=lambda r: tuple(str(r[c]) for c in plan.RESOURCE_COLUMNS))
    write_csv(args.out, rows)
    spills = [r for r in rows if int(r["spill_bytes"])]
    print(f"wrote {len(rows)} rows to {args.out}; {len(spills)} spill")
    for r in spills:
        print("  spills:", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
