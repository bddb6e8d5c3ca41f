#!/usr/bin/env bash
# The tensor-core backward on a GPU, in parts that each fit in 10 minutes on an H100:
#   bash benchmarks/check_tensor_backward_gpu.sh tests      # GPU tests of the tensor backward and the torch integration
#   bash benchmarks/check_tensor_backward_gpu.sh sanitize   # compute-sanitizer memcheck and racecheck on every tensor build
#   bash benchmarks/check_tensor_backward_gpu.sh tiles      # time the tensor backward's tiles at B1 H16 N4096
#   bash benchmarks/check_tensor_backward_gpu.sh bench      # the bars: B1 H16 N 1024/4096/16384, d 64/128, causal or not,
#                                             # float16 / bfloat16 / float32 against SDPA in the same dtype ->
#                                             # benchmarks/results/tensor_backward.csv, flashlab/data/tensor_backward.json
#   bash benchmarks/check_tensor_backward_gpu.sh parts      # each launch of a call timed alone, and 3xTF32 against SDPA fp32
#                                             # alternated 5 times at d64 (the fp32 bar's margin)
# Set OUT to a folder to keep the logs (default: benchmarks/results/logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/logs}
mkdir -p "$OUT"
case "${1:-}" in
  tests)
    timeout "${2:-400}" $PY -m pytest -q -m gpu -p no:cacheprovider -W ignore tests/test_tensor_backward.py \
      tests/test_torch_integration.py 2>&1 | tee "$OUT/tests_tensor_backward.txt" | tail -25 ;;
  sanitize)
    # memcheck skips API errors: cuda-bindings probes driver entry points at import (cuGetProcAddress), which
    # memcheck reports as errors although no kernel is involved (see check_forward_gpu.sh).
    timeout "${2:-280}" compute-sanitizer --tool memcheck --report-api-errors no --print-limit 5 $PY \
      benchmarks/timing/bench_backward.py --tensor --check --d 32 64 128 2>&1 | tee "$OUT/sanitizer_memcheck.txt" \
      | grep -v Warning | tail -4
    timeout "${2:-280}" compute-sanitizer --tool racecheck --print-limit 5 $PY benchmarks/timing/bench_backward.py --tensor \
      --check --d 32 64 2>&1 | tee "$OUT/sanitizer_racecheck.txt" | grep -v Warning | tail -4 ;;
  tiles) $PY benchmarks/timing/bench_backward.py --tensor --tiles --d 64 128 --dtypes float16 float32 --repeats 10 \
      2>&1 | tee "$OUT/tiles_tensor_backward.txt" | tail -30 ;;
  bench) $PY benchmarks/timing/bench_backward.py --tensor --causal --n ${2:-1024 4096 16384} --d 64 128 --repeats 20 \
      --csv benchmarks/results/tensor_backward.csv --json flashlab/data/tensor_backward.json \
      2>&1 | tee "$OUT/bench_tensor_backward.txt" | tail -40 ;;
  parts) $PY benchmarks/experiments/backward_parts.py --rounds 5 2>&1 | tee "$OUT/parts_tensor_backward.txt" | tail -12 ;;
  *) sed -n 2,11p "$0"; exit 2 ;;
esac
