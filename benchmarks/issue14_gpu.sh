#!/usr/bin/env bash
# Issue 14 (the library's options) on a GPU, in parts that each fit in 10 minutes on an H100:
#   bash benchmarks/issue14_gpu.sh tests     # GPU tests: paged decoding, GQA kernels, flashlab.torch options
#   bash benchmarks/issue14_gpu.sh sanitize  # compute-sanitizer memcheck and racecheck on the paged kernel
#   bash benchmarks/issue14_gpu.sh bench     # GQA-decoding, sliding-window and varlen bars -> benchmarks/results/*.json
# Set OUT to a folder to keep the logs (default: benchmarks/results/logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/logs}
mkdir -p "$OUT"
case "${1:-}" in
  tests)
    timeout "${2:-500}" $PY -m pytest -q -m gpu -p no:cacheprovider -W ignore -rf tests/test_paged_kernel.py \
      tests/test_register_options.py tests/test_gqa_kernels.py tests/test_torch_integration.py tests/test_varlen_kernels.py \
      tests/test_varlen_kernels_backward.py tests/test_torch_varlen.py tests/test_kernel_dropout.py tests/test_tensor_options.py \
      tests/test_tensor_backward_options.py 2>&1 | tee "$OUT/tests14.txt" | tail -15 ;;
  sanitize)
    for tool in memcheck racecheck; do
      api=(); [ "$tool" = memcheck ] && api=(--report-api-errors no)
      timeout "${2:-250}" compute-sanitizer --tool $tool "${api[@]}" --print-limit 5 $PY -m pytest -q -p no:cacheprovider \
        -W ignore tests/test_paged_kernel.py -k "(numpy or float16 or tensor) and not gpu" 2>&1 | tee "$OUT/sanitizer14_$tool.txt" | tail -3
    done ;;
  bench) $PY benchmarks/bench_paged.py --sweep 16 66 132 --json benchmarks/results/paged_decoding.json 2>&1 | tee "$OUT/bench14.txt" | tail -24
    $PY benchmarks/bench_window.py --json benchmarks/results/window.json 2>&1 | tee -a "$OUT/bench14.txt" | tail -6
    for args in "" "--causal" "--variant register" "--seqs 256 --min 32 --max 1024"; do
      $PY benchmarks/bench_varlen.py $args --json benchmarks/results/varlen.json 2>&1 | tee -a "$OUT/bench14.txt" | tail -9
    done ;;
  *) sed -n 2,6p "$0"; exit 2 ;;
esac
