#!/usr/bin/env bash
# After a change that must leave every kernel as it was (code moved between modules, names changed): compare
# this checkout with an old one on a GPU machine.
#
#   git archive OLD_REV flashlab | tar -x -C /tmp/old        # the old package, anywhere
#   bash benchmarks/check_kernels_unchanged_gpu.sh /tmp/old [OUT_DIR] [ptx|bits|speed ...]
#
# ptx:   the PTX of every planned configuration (cc 7.5, 8.0, 9.0), hashed, old against new
#        (benchmarks/experiments/kernel_fingerprints.py: same PTX, same registers, spills and speed);
# bits:  46 kernel calls' outputs, old (twice: the register backward's atomics make dQ vary) against new
#        (benchmarks/experiments/kernel_bits.py);
# resources: registers and spills of every planned configuration (cc 7.5, 8.0, 9.0) with ptxas, old against new
#        (benchmarks/generators/kernel_resources.py --compare: none may use more);
# speed: every shape of the suite, forward and backward, each variant, old and new in one process in alternating
#        rounds, with a same-bits column (benchmarks/timing/ab_kernels.py; AB_ARGS='--runs forward --deadline 500'
#        narrows or bounds a call, and --resume continues it).
# Default: ptx, bits and speed (resources takes long: ask for it). Results go to OUT_DIR (default: ./out). PTX_ARGS='--cc 9.0 --d 64 128' limits the
# configurations of the ptx step (all 526 take long: numba compiles each one).
set -uo pipefail
OLD=$(cd "$1" && pwd)
OUT=${2:-out}
shift $(( $# >= 2 ? 2 : 1 ))
STEPS=${*:-ptx bits speed}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0
BASE=${PYTHONPATH:-}
PTX_ARGS=${PTX_ARGS:-}
old() { PYTHONPATH="$OLD${BASE:+:$BASE}" "$@"; }
status=0
for step in $STEPS; do
  case $step in
    ptx)
      jobs=$(( $(nproc) / 2 ))
      old python3 benchmarks/experiments/kernel_fingerprints.py --out "$OUT/ptx_old.json" --jobs "$jobs" $PTX_ARGS &
      python3 benchmarks/experiments/kernel_fingerprints.py --out "$OUT/ptx_new.json" --jobs "$jobs" $PTX_ARGS
      wait
      python3 benchmarks/experiments/kernel_fingerprints.py --compare "$OUT/ptx_old.json" "$OUT/ptx_new.json" || status=1 ;;
    bits)
      old python3 benchmarks/experiments/kernel_bits.py "$OUT/bits_old.json" > "$OUT/bits_old.txt"
      old python3 benchmarks/experiments/kernel_bits.py "$OUT/bits_old_again.json" > /dev/null
      python3 benchmarks/experiments/kernel_bits.py "$OUT/bits_new.json" > "$OUT/bits_new.txt"
      python3 benchmarks/experiments/kernel_bits.py --compare "$OUT/bits_old.json" "$OUT/bits_new.json" \
        "$OUT/bits_old_again.json" || status=1 ;;
    resources)
      jobs=$(( $(nproc) / 2 ))
      old python3 benchmarks/generators/kernel_resources.py --out "$OUT/resources_old.csv" --jobs "$jobs" &
      python3 benchmarks/generators/kernel_resources.py --out "$OUT/resources_new.csv" --jobs "$jobs"
      wait
      python3 benchmarks/generators/kernel_resources.py --compare "$OUT/resources_old.csv" "$OUT/resources_new.csv" \
        | tee "$OUT/resources.md" || status=1 ;;
    speed)
      python3 benchmarks/timing/ab_kernels.py "$OLD" "$OUT/ab_kernels.csv" ${AB_ARGS:-} | tee -a "$OUT/ab_kernels.txt" ;;
    *) echo "unknown step $step (ptx, bits, resources or speed)"; exit 2 ;;
  esac
done
exit $status
