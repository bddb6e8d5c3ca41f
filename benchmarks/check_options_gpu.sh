#!/usr/bin/env bash
# The options, GQA, varlen, dropout and paged decoding on a GPU, in parts that each fit in 10 minutes on an H100:
#   bash benchmarks/check_options_gpu.sh tests     # GPU tests: paged decoding, GQA kernels, flashlab.torch options
#   bash benchmarks/check_options_gpu.sh sanitize memcheck|racecheck|backward  # paged and varlen tensor kernels; backward d128
#   bash benchmarks/check_options_gpu.sh bench     # GQA-decoding, sliding-window and varlen bars -> benchmarks/results/*.json
#   bash benchmarks/check_options_gpu.sh options   # each option's cost, tensor forward and backward -> results/options.json
#   bash benchmarks/check_options_gpu.sh paged     # paged decoding only: its GPU tests, then the GQA bar and call times
# Set OUT to a folder to keep the logs (default: benchmarks/results/logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/logs}
mkdir -p "$OUT"
# With pytest-xdist installed the tests compile their kernels in parallel: most of a GPU test's time is compiling.
XDIST=(); $PY -c "import xdist" 2>/dev/null && XDIST=(-n 8)
case "${1:-}" in
  tests)
    timeout "${2:-500}" $PY -m pytest -q -m gpu "${XDIST[@]}" -p no:cacheprovider -W ignore -rf tests/test_paged_kernel.py \
      tests/test_kernel_options.py tests/test_gqa_kernels.py tests/test_torch_integration.py tests/test_varlen_kernels.py \
      tests/test_varlen_kernels_backward.py tests/test_torch_varlen.py tests/test_kernel_dropout.py \
      tests/test_prepared_options.py tests/test_tensor_dropout.py tests/test_decoding.py 2>&1 | tee "$OUT/tests_options.txt" | tail -15 ;;
  sanitize)
    # sanitize memcheck|racecheck [timeout]: the paged kernel's GPU test (its tensor and register builds) and the varlen
    # tensor forward's; sanitize backward: the tensor backward at d = 128 under memcheck. Serial on purpose:
    # pytest-xdist's workers hang under compute-sanitizer.
    case "${2:-}" in
      memcheck|racecheck) api=(); [ "$2" = memcheck ] && api=(--report-api-errors no)
        timeout "${3:-280}" compute-sanitizer --tool "$2" "${api[@]}" --print-limit 5 $PY -m pytest -q -m gpu \
          -p no:cacheprovider -W ignore tests/test_paged_kernel.py tests/test_varlen_kernels.py \
          -k "test_paged_kernel_on_gpu and 32-4 or 64-float16-tensor or 64-float32-tensor" 2>&1 \
          | tee "$OUT/sanitizer_options_$2.txt" | grep -E "ERROR SUMMARY|passed|failed" ;;
      backward) timeout "${3:-280}" compute-sanitizer --tool memcheck --report-api-errors no --print-limit 5 \
          $PY benchmarks/timing/bench_backward.py --tensor --check --d 128 2>&1 | tee "$OUT/sanitizer_tensor_backward_memcheck_d128.txt" | tail -4 ;;
      *) echo "sanitize memcheck|racecheck|backward [timeout]"; exit 2 ;;
    esac ;;
  bench) $PY benchmarks/timing/bench_paged.py --sweep 16 66 132 --json benchmarks/results/paged_decoding.json 2>&1 | tee "$OUT/bench_options.txt" | tail -24
    $PY benchmarks/timing/bench_window.py --json benchmarks/results/window.json 2>&1 | tee -a "$OUT/bench_options.txt" | tail -6
    for args in "" "--causal" "--variant register" "--seqs 256 --min 32 --max 1024"; do
      $PY benchmarks/timing/bench_varlen.py $args --json benchmarks/results/varlen.json 2>&1 | tee -a "$OUT/bench_options.txt" | tail -9
    done ;;
  paged) timeout "${2:-300}" $PY -m pytest -q -m gpu "${XDIST[@]}" -p no:cacheprovider -W ignore -rf \
      tests/test_paged_kernel.py 2>&1 | tee "$OUT/paged_tests_options.txt" | tail -4
    $PY benchmarks/timing/bench_paged.py --sweep 16 66 132 --json benchmarks/results/paged_decoding.json 2>&1 \
      | tee "$OUT/paged_bench_options.txt" | tail -26 ;;
  options) $PY benchmarks/timing/bench_options.py --json benchmarks/results/options.json 2>&1 | tee "$OUT/options.txt" ;;
  *) sed -n 2,6p "$0"; exit 2 ;;
esac
