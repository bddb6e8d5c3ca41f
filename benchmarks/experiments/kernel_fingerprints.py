"""Fingerprints of the compiled kernels: the PTX of every configuration the planner can choose, hashed, for
compute capabilities 7.5, 8.0 and 9.0. Two checkouts with the same fingerprints compile to the same machine
code, so they have the same registers, spills and speed: run it before and after a change that must not alter
a kernel (moving code between modules, renaming).

    python benchmarks/experiments/kernel_fingerprints.py --out new.json
    PYTHONPATH=/path/to/old/checkout python benchmarks/experiments/kernel_fingerprints.py --out old.json
    python benchmarks/experiments/kernel_fingerprints.py --compare old.json new.json

Needs NVIDIA's NVVM (numba-cuda's compile_ptx), not a GPU. Names in the PTX (the kernel's mangled Python
path, which a move between modules changes) are replaced by their order of appearance before hashing, and
each configuration compiles in a fresh process (numba's PTX for a kernel depends on what the same process
compiled before it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an old checkout there wins
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks" / "generators"))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")


def normalised(ptx: str) -> str:
    """The PTX with every mangled name (_Z...) numbered in order of appearance, comments and blank lines out."""
    names = {}
    ptx = re.sub(r"_Z\w+", lambda m: names.setdefault(m.group(0), f"NAME{len(names)}"), ptx)
    lines = [ln for ln in ptx.splitlines() if ln.strip() and not ln.lstrip().startswith("//")]
    return "\n".join(lines)


def compile_only():
    """Let flashlab build GPU kernels (not simulator ones) on a machine without a driver (kernel_resources.py's)."""
    import kernel_resources

    kernel_resources._compile_only()


def all_keys():
    """The planner's configurations, each once per compute capability it can be built for (kernel_resources.py's)."""
    import kernel_resources

    return kernel_resources.all_keys()


def fingerprint(key):
    from numba.cuda import compile_ptx

    from flashlab.kernels import plan

    variant, direction, d, dtype, precision, config, causal, split, heavy, cc = key
    kernel, sig = plan.kernel_and_signature(variant, direction, d, dtype, precision, config, causal, split, heavy)
    ptx, _ = compile_ptx(kernel.py_func, sig, cc=cc, fastmath=kernel.targetoptions.get("fastmath", False))
    label = "|".join(str(x) for x in (variant, direction, d, dtype, precision, plan.config_text(variant, direction, config),
                                      causal, split, heavy, f"{cc[0]}.{cc[1]}"))
    return label, hashlib.sha256(normalised(ptx).encode()).hexdigest()[:16]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--cc", nargs="*", default=["7.5", "8.0", "9.0"], help="compute capabilities (default: all three)")
    ap.add_argument("--d", nargs="*", type=int, help="head dims (default: every one the planner builds)")
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        differ = sorted(k for k in before if k in after and before[k] != after[k])
        only = sorted(set(before) ^ set(after))
        print(f"{len(before)} and {len(after)} configurations; {len(set(before) & set(after)) - len(differ)} identical, "
              f"{len(differ)} different, {len(only)} in one only")
        for k in differ[:20] + only[:20]:
            print("  ", k)
        return 1 if differ or only else 0
    compile_only()
    import flashlab

    ccs = {tuple(int(x) for x in c.split(".")) for c in args.cc}
    keys = [k for k in all_keys() if k[-1] in ccs and (not args.d or k[2] in args.d)]
    print(f"flashlab from {Path(flashlab.__file__).parent}")
    print(f"{len(keys)} configurations, {args.jobs} processes", flush=True)
    # One process per configuration: numba's PTX for a kernel depends on what the same process compiled before.
    with ProcessPoolExecutor(args.jobs, initializer=compile_only, max_tasks_per_child=1) as pool:
        prints = dict(pool.map(fingerprint, keys))
    Path(args.out).write_text(json.dumps(prints, indent=0, sort_keys=True))
    print(f"wrote {len(prints)} fingerprints to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
