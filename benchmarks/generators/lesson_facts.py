"""Measure the numbers lessons 07, 09 and 14 quote when they run without a GPU, and save them (GPU, < 1 min).

    python benchmarks/generators/lesson_facts.py                      # writes flashlab/data/lesson_facts.json
    python benchmarks/generators/lesson_facts.py --out /tmp/lesson_facts.json

launch        flashlab.kernels.demo.empty[1, 32] with one float32 device array, as lesson 07 times it:
              CUDA events around one launch (median of 200) and host wall time per launch over 2000
              back-to-back launches; the same kernel given a torch tensor instead (host time); and, for the
              cost of a launch from C++, torch's Tensor.zero_ on a 1-element CUDA tensor (events and host).
local_memory  flashlab.kernels.demo.sums_unrolled / sums_dynamic at lesson 09's full size (4096 steps,
              65536 threads in blocks of 32): registers and local memory per thread from the compiler, and
              the CUDA-event median of 20 launches after warm-up.

The file is package data, so lessons find it in a pip-installed flashlab (Colab) too; flashlab.bench
.check_lesson_facts validates its layout before it is written. Commit the new file after a run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "timing"))

import flashlab  # noqa: E402,F401  (chooses the backend before numba.cuda is imported)
from flashlab.bench import FACTS_JSON, check_lesson_facts  # noqa: E402
from flashlab.device import has_gpu  # noqa: E402

REPS, LOOP = 200, 2000


def measure_launch() -> dict:
    from flashlab.kernels import demo

    numba = demo.launch_cost(reps=REPS, loop=LOOP)
    torch_ = demo.torch_launch_cost(reps=REPS, loop=LOOP)
    return {"kernel": "flashlab.kernels.demo.empty[1, 32](one float32 device array)", "reps": REPS, "loop": LOOP,
            "numba_event_us": round(numba["event_us"], 2), "numba_host_us": round(numba["host_us"], 2),
            "numba_torch_arg_host_us": round(torch_["numba_torch_arg_host_us"], 2),
            "torch_op": "torch.Tensor.zero_ on a 1-element CUDA tensor",
            "torch_event_us": round(torch_["torch_event_us"], 2), "torch_host_us": round(torch_["torch_host_us"], 2)}


def measure_local_memory(n_steps=4096, threads=65536) -> dict:
    from flashlab.kernels import demo

    kernels = demo.local_memory_cost(n_steps=n_steps, threads=threads)
    for rec in kernels.values():
        rec["ms"] = round(rec["ms"], 4)
    return {"n_steps": n_steps, "threads": threads, "R": demo.R, **kernels}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FACTS_JSON, help=f"JSON file to write (default {FACTS_JSON})")
    args = parser.parse_args(argv)
    if not has_gpu():
        sys.exit("lesson_facts.py measures a real GPU; none found (flashlab.doctor() says why)")
    from bench_kernels import environment

    env = environment()
    facts = {
        "source": f"benchmarks/generators/lesson_facts.py, {datetime.date.today().isoformat()}",
        "gpu": env["gpu"],
        "date": datetime.date.today().isoformat(),
        "versions": {k: env[k] for k in ("compute_capability", "nvidia_driver", "driver_cuda", "python", "numpy",
                                         "numba", "numba_cuda", "torch")},
        "launch": measure_launch(),
        "local_memory": measure_local_memory(),
    }
    check_lesson_facts(facts)
    args.out.write_text(json.dumps(facts, indent=2) + "\n")
    print(json.dumps(facts, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
