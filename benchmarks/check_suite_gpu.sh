#!/usr/bin/env bash
# The launch planner, host overhead and the shape suite ("fast at every shape") on a GPU, in parts that each fit
# in 10 minutes on an H100:
#   bash benchmarks/check_suite_gpu.sh tests       # GPU tests of the planner's paths, the prepared calls, the kernels
#   bash benchmarks/check_suite_gpu.sh host        # host time of one call -> benchmarks/results/host.csv
#   bash benchmarks/check_suite_gpu.sh suite [S]   # the shape suite, resumed from suite.csv, stopping after S seconds
#                                              # (default 480); run it again until it says "suite complete"
#   bash benchmarks/check_suite_gpu.sh resources   # kernel_resources.csv compiled with this machine's toolchain
# The suite writes benchmarks/results/suite.csv, suite_alternatives.csv (split / order / d128-redesign
# timed the other way), suite.png, suite.md (minimum and geometric mean: for docs/performance.md) and suite_env.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
case "${1:-}" in
  tests)
    $PY -c "import flashlab; flashlab.doctor()"
    timeout "${2:-580}" $PY -m pytest -q -m gpu -p no:cacheprovider -W ignore tests/test_plan.py tests/test_kernels.py \
      tests/test_tensor_kernel.py tests/test_kernels_backward.py tests/test_torch_integration.py 2>&1 | tail -15
    $PY -c "from flashlab.kernels.plan import plan
for shape, causal in [((1, 16, 1024, 64), False), ((1, 16, 1024, 64), True), ((4, 16, 16384, 128), True)]:
    print(plan(shape, causal=causal).explain(), end='\n\n')" ;;
  host) $PY benchmarks/timing/bench_kernels.py --parts host ;;
  suite)
    $PY benchmarks/timing/bench_kernels.py --suite --resume --deadline "${2:-480}" 2>&1 | grep -v "it/s]$"
    $PY - <<'PY'
import csv, sys
sys.path.insert(0, "benchmarks/timing")
import suite
have = sum(1 for _ in csv.DictReader(open("benchmarks/results/suite.csv")))
want = len(suite.SUITE_BH) * len(suite.SUITE_N) * len(suite.SUITE_D) * 2 * len(suite.SUITE_RUNS)
print("suite complete" if have >= want else f"suite: {have} of {want} rows; run again to resume")
PY
    ;;
  resources) $PY benchmarks/generators/kernel_resources.py --out benchmarks/results/kernel_resources_gpu_machine.csv ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
