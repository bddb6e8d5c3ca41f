#!/usr/bin/env bash
# The GPU check of the forward kernels in one command (results: docs/runs/forward-fp32.md, benchmarks/results/):
#   bash benchmarks/check_forward_gpu.sh [OUTDIR [BENCH_ARGS...]]
# 1. flashlab.doctor()  2. the GPU tests  3. compute-sanitizer memcheck + racecheck on small shapes (every variant)
# 4. benchmarks/timing/bench_kernels.py BENCH_ARGS (default: everything). Results land in OUTDIR (benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
BENCH_ARGS=("${@:2}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

# memcheck runs with --report-api-errors no: cuda-bindings probes driver entry points at import with
# cuGetProcAddress, which fails (harmlessly) 34 times and would otherwise be counted as errors.
sanitize() {  # sanitize TOOL VARIANT ARGS...
  local tool=$1 variant=$2 res api=()
  shift 2
  [ "$tool" = memcheck ] && api=(--report-api-errors no)
  res=$(timeout 300 compute-sanitizer --tool "$tool" "${api[@]}" --error-exitcode 9 $PY benchmarks/profiling/profile_forward.py "$variant" 64 "$@" --launches 1 2>&1)
  echo "$tool $variant $*: exit $? | $(echo "$res" | grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|relative error' | tr '\n' ' ')"
}

{
  echo "## doctor"; $PY -c "import flashlab; flashlab.doctor()"
  echo "## gpu tests: pytest -m gpu tests/test_kernels.py tests/test_device.py tests/test_tensor_kernel.py tests/test_plan.py"
  timeout 500 $PY -m pytest -q -m gpu -p no:cacheprovider -W ignore tests/test_kernels.py tests/test_device.py \
    tests/test_tensor_kernel.py tests/test_plan.py 2>&1 | tail -3
  echo "## compute-sanitizer (d=64, small shapes; the script also checks the result against float64)"
  sanitize memcheck register --n 200 --heads 2 --causal
  sanitize memcheck register --n 77 --heads 1 --dtype float16
  sanitize memcheck shared --n 200 --heads 2 --causal
  sanitize racecheck register --n 200 --heads 2 --causal
  sanitize racecheck shared --n 200 --heads 2 --causal
  for dt in float16 bfloat16 float32; do
    sanitize memcheck tensor --n 200 --heads 2 --causal --dtype $dt
    sanitize racecheck tensor --n 200 --heads 2 --causal --dtype $dt
  done
} 2>&1 | tee "$OUT/gpu_check.log"
echo "## benchmark"
$PY benchmarks/timing/bench_kernels.py --out "$OUT" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench.log" | grep -v "^|"
