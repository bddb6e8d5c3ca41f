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
# speed: benchmarks/timing/ab_tensor.py, old and new alternating, three rounds each.
# Default: all three. Results go to OUT_DIR (default: ./out). PTX_ARGS='--cc 9.0 --d 64 128' limits the
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
    speed)
      for round in 1 2; do
        old python3 benchmarks/timing/ab_tensor.py old | tee -a "$OUT/ab.txt"
        python3 benchmarks/timing/ab_tensor.py new | tee -a "$OUT/ab.txt"
      done ;;
    *) echo "unknown step $step (ptx, bits or speed)"; exit 2 ;;
  esac
done
exit $status
