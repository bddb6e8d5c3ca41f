"""Registers and spills of the kernels built with the library's options (window, softcap, ALiBi, dropout), which
the planner's table (benchmarks/generators/kernel_resources.py) does not hold: compiled without a GPU, with ptxas.

    export CUDA_HOME=/path/to/cuda PATH=$CUDA_HOME/bin:$PATH     # NVVM for numba, ptxas
    python benchmarks/experiments/option_resources.py new.csv [--cc 9.0] [--jobs 2]
    PYTHONPATH=/path/to/old/checkout python benchmarks/experiments/option_resources.py old.csv
    python benchmarks/generators/kernel_resources.py --compare old.csv new.csv

Works on checkouts whose builds take the options as compile-time values (`extras=options.Extras(...)`) and on
those that compile only their presence (`features=options.Features(...)`, the values being arguments), so that
the two can be compared: each configuration is the same option set, with values a model would use (a window of
256 keys to the left, causal; softcap 30; one ALiBi slope per head; dropout 0.1).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an old checkout there wins
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks" / "generators"))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import kernel_resources as R  # noqa: E402

OPTION_SETS = {
    "window": dict(left=256, right=-1),
    "softcap": dict(softcap=30.0),
    "alibi": dict(slopes=tuple(2.0 ** (-8.0 * h / 16) for h in range(1, 17))),
    "dropout": dict(dropout_p=0.1),
    "all": dict(left=256, right=-1, softcap=30.0, slopes=tuple(2.0 ** (-8.0 * h / 16) for h in range(1, 17)),
                dropout_p=0.1),
}
# (variant, direction, d, dtype, precision, causal): the configurations the options run on most
CONFIGS = [("tensor", "forward", 64, "float16", "f16", True), ("tensor", "forward", 128, "float16", "f16", True),
           ("register", "forward", 64, "float32", None, True), ("register", "forward", 128, "float32", None, True),
           ("tensor", "backward", 64, "float16", "f16", True), ("tensor", "backward", 128, "float16", "f16", True),
           ("register", "backward", 64, "float32", None, True)]


def kernel_and_signature(variant, direction, d, dtype, precision, causal, option_set):
    """The build with these options, in whichever form this checkout takes them, and its argument types."""
    import inspect

    from flashlab.kernels import options, plan, register, register_backward, tensor, tensor_backward

    extras = options.Extras(**OPTION_SETS[option_set])
    new = "features" in inspect.signature(tensor.build).parameters
    o = OPTION_SETS[option_set]
    weight = tensor.options_weight("left" in o, "softcap" in o, "slopes" in o, "dropout_p" in o)
    if direction == "backward":
        config = tensor_backward.choose_tile(d, precision) if variant == "tensor" else register_backward.default_config(d)
    else:  # the planner's tile for a call with these options
        config = tensor.choose_tile(d, precision, causal=causal, extras=weight) if variant == "tensor" else \
            register.choose_tile(d)
    if new:
        kernel, sig = plan.kernel_and_signature(variant, direction, d, dtype, precision, config, causal, False, False,
                                                features=extras.features())
        return kernel, sig, config
    kw = dict(extras=extras)
    if direction == "backward" and variant == "tensor":
        kernel = tensor_backward.build(d, config, causal, precision, **kw)[1]
    elif direction == "backward":
        kernel = register_backward.make_kernels(d, *config, **kw)[1]
    elif variant == "register":
        kernel = register.build(d, config, causal, **kw)
    else:
        kernel = tensor.build(d, config, causal, precision, **kw)
    _, sig = plan.kernel_and_signature(variant, direction, d, dtype, precision, config, causal, False, False)
    return kernel, sig, config


def compile_one(key):
    from flashlab.kernels import plan

    (variant, direction, d, dtype, precision, causal), option_set, cc = key
    kernel, sig, config = kernel_and_signature(variant, direction, d, dtype, precision, causal, option_set)
    registers, spill_bytes, _ = R.ptxas_resources(kernel, sig, cc)
    return {"variant": variant, "direction": direction, "d": d, "dtype": dtype, "precision": precision or "",
            "tile": f"{plan.config_text(variant, direction, config)} {option_set}", "causal": int(causal), "split": 0,
            "heavy_first": 0, "cc": f"{cc[0]}.{cc[1]}", "registers": registers, "spill_bytes": spill_bytes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="comma-separated option sets (default: all)")
    ap.add_argument("--configs", default="", help="comma-separated 'variant direction d' such as 'tensor forward 64' "
                    "(default: all)")
    args = ap.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))
    sets = args.only.split(",") if args.only else list(OPTION_SETS)
    configs = [c for c in CONFIGS if not args.configs or " ".join(map(str, c[:3])) in args.configs.split(",")]
    keys = [(c, s, cc) for c in configs for s in sets]
    with ProcessPoolExecutor(args.jobs, initializer=R._compile_only, max_tasks_per_child=1) as pool:
        rows = list(pool.map(compile_one, keys))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r["variant"], r["direction"], r["d"], r["tile"], r["registers"], r["spill_bytes"], flush=True)


if __name__ == "__main__":
    main()
