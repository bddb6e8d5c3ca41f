#!/usr/bin/env bash
# The prepared (fast) launch path on Colab's numba and numba-cuda, on a GPU machine without network, in one command:
#   python scripts/colab_gpu_bundle.py          # here, with PyPI: builds .colab-gpu/site.tar.xz (carry .colab-gpu)
#   bash scripts/gpu_check_colab_fast_path.sh [OUTDIR]      # there (OUTDIR default: $OUT, else /tmp/colab-fast-path)
# Unpacks the bundle (numba 0.61.2, numba-cuda 0.22.2, numpy 2.1.3, llvmlite, cuda-core < 1: versions.toml's GPU
# image) to /tmp and puts it first on PYTHONPATH over the machine's own packages (its cuda-bindings, torch and
# pytest stay), then
# 1. prints the versions in use and where they load from, and stops if numba.cuda is not numba-cuda 0.22's;
# 2. flashlab.doctor() as it is (the fast path should say off) and with FLASHLAB_FAST_LAUNCH=direct (on);
# 3. tests/marshal_check.py and tests/test_fast_launch.py (no GPU needed, on this stack);
# 4. benchmarks/timing/bench_kernels.py --parts host with FLASHLAB_FAST_LAUNCH=direct: host time per call, the
#    prepared call (cuLaunchKernel alone) against the general path -> host_colab.csv;
# 5. the GPU tests that compare the prepared path with the general one, with FLASHLAB_FAST_LAUNCH=direct
#    (tests/test_plan.py, test_varlen_kernels.py, test_prepared_options.py, test_paged_kernel.py,
#    test_torch_integration.py; not the wgmma kernels, which Colab's T4 never runs) -> pytest_gpu.log;
# 6. the same host timing without the bundle, the machine's own numba-cuda and the default path -> host_image.csv;
# and summary.md. Steps share a deadline (BUDGET_S, default 470 s) so the whole ends within 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-/tmp/colab-fast-path}}
BUNDLE=${BUNDLE:-.colab-gpu/site.tar.xz}
SITE=${SITE:-/tmp/colab-site}
BUDGET_S=${BUDGET_S:-470}
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
START=$SECONDS
left() { echo $(( BUDGET_S - (SECONDS - START) )); }
limit() { local want=$1 reserve=${2:-0} have; have=$(( $(left) - reserve )); [ "$have" -lt "$want" ] && want=$have
          [ "$want" -lt 5 ] && want=5; echo "$want"; }
LOG="$OUTDIR/check.log"
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }

say "## bundle: $BUNDLE -> $SITE"
rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf "$BUNDLE" || { say "could not unpack $BUNDLE"; exit 1; }
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda  # where 0.22 looks for NVVM
COLAB=(env PYTHONPATH="$SITE:$PWD" BUNDLE_SITE="$SITE")
unset NUMBA_ENABLE_CUDASIM FLASHLAB_FAST_LAUNCH FLASHLAB_DIRECT_LAUNCH

say "## versions (the bundle first on PYTHONPATH)"
"${COLAB[@]}" timeout "$(limit 90)" $PY - <<'EOF' 2>&1 | tee -a "$LOG"
import os, sys, importlib.metadata as md
site = os.environ["BUNDLE_SITE"]
print("python", sys.version.split()[0], sys.executable)
import numpy, numba, llvmlite, numba_cuda
from numba import cuda as ncuda
from numba.cuda import dispatcher
for name, m in (("numpy", numpy), ("numba", numba), ("llvmlite", llvmlite), ("numba-cuda", numba_cuda)):
    print(f"{name:14s} {m.__version__:12s} {os.path.dirname(m.__file__)}")
print(f"{'numba.cuda':14s} {ncuda.implementation:12s} {dispatcher.__file__}")
for dist in ("cuda-bindings", "cuda-core", "cuda-pathfinder", "torch", "pytest"):
    try:
        print(f"{dist:14s} {md.version(dist):12s}")
    except md.PackageNotFoundError:
        print(f"{dist:14s} not installed")
import cuda.core, cuda.bindings
print(f"{'cuda.core':14s} {cuda.core.__version__:12s} {os.path.dirname(cuda.core.__file__)}")
print(f"{'cuda.bindings':14s} {cuda.bindings.__version__:12s} {os.path.dirname(cuda.bindings.__file__)}")
from numba.cuda.cuda_paths import get_cuda_paths
print("nvvm", get_cuda_paths()["nvvm"])
print("dispatcher has _Kernel", hasattr(dispatcher, "_Kernel"), "| cuda.core launch",
      all(hasattr(dispatcher, n) for n in ("launch", "LaunchConfig", "CUDA_CORE_GE_1_0")))
try:
    import torch
    print("torch sees", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
except ImportError as exc:
    print("torch:", exc)
ok = (numba.__version__ == "0.61.2" and numba_cuda.__version__ == "0.22.2" and ncuda.implementation == "NVIDIA"
      and dispatcher.__file__.startswith(site) and numpy.__version__ == "2.1.3")
print("STACK", "ok: Colab's numba and numba-cuda" if ok else "NOT the bundle's numba / numba-cuda")
sys.exit(0 if ok else 3)
EOF
if [ "${PIPESTATUS[0]}" != 0 ]; then say "stopped: the bundle's stack did not load (see above)"; exit 1; fi

say "## doctor, as it is (FLASHLAB_FAST_LAUNCH unset)"
"${COLAB[@]}" timeout "$(limit 120)" $PY -c "import flashlab; flashlab.doctor()" 2>&1 | tee -a "$LOG"
say "## doctor, FLASHLAB_FAST_LAUNCH=direct"
"${COLAB[@]}" FLASHLAB_FAST_LAUNCH=direct timeout "$(limit 120)" $PY -c "import flashlab; flashlab.doctor()" 2>&1 \
  | tee -a "$LOG"

say "## no-GPU checks on this stack: tests/marshal_check.py, tests/test_fast_launch.py"
"${COLAB[@]}" timeout "$(limit 60)" $PY tests/marshal_check.py 2>&1 | tee -a "$LOG"
"${COLAB[@]}" timeout "$(limit 60)" $PY -m pytest -q -p no:cacheprovider tests/test_fast_launch.py 2>&1 \
  | tail -3 | tee -a "$LOG"

say "## host time per call, FLASHLAB_FAST_LAUNCH=direct (bench_kernels.py --parts host)"
rm -rf /tmp/colab-host && "${COLAB[@]}" FLASHLAB_FAST_LAUNCH=direct timeout "$(limit 120 150)" \
  $PY benchmarks/timing/bench_kernels.py --parts host --out /tmp/colab-host 2>&1 | tee -a "$LOG"
cp /tmp/colab-host/host.csv "$OUTDIR/host_colab.csv" 2>/dev/null

say "## GPU tests, FLASHLAB_FAST_LAUNCH=direct (full output: pytest_gpu.log)"
PLUGINS=()  # pytest-xdist (compiles in parallel) and pytest-timeout, where the machine has them
$PY -c "import xdist" 2>/dev/null && PLUGINS+=(-n 8)
$PY -c "import pytest_timeout" 2>/dev/null && PLUGINS+=(--timeout 240)
"${COLAB[@]}" FLASHLAB_FAST_LAUNCH=direct timeout "$(limit 400 70)" $PY -m pytest -p no:cacheprovider -m gpu \
  "${PLUGINS[@]}" -v -rA -W ignore tests/test_plan.py tests/test_varlen_kernels.py \
  tests/test_prepared_options.py tests/test_paged_kernel.py tests/test_torch_integration.py \
  -k "(prepared or direct_launch or torch_integration) and not wgmma and not long_sequences" \
  > "$OUTDIR/pytest_gpu.log" 2>&1
say "pytest exit $? (124: cut at its time limit)"
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$OUTDIR/pytest_gpu.log" | tail -40 | tee -a "$LOG"
grep -cE " PASSED" "$OUTDIR/pytest_gpu.log" | sed 's/^/PASSED lines: /' | tee -a "$LOG"

say "## host time per call, the machine's own numba-cuda and the default path (for scale)"
rm -rf /tmp/image-host && timeout "$(limit 120 5)" $PY benchmarks/timing/bench_kernels.py --parts host \
  --out /tmp/image-host 2>&1 | tee -a "$LOG"
cp /tmp/image-host/host.csv "$OUTDIR/host_image.csv" 2>/dev/null

$PY - "$OUTDIR" <<'EOF' 2>&1 | tee "$OUTDIR/summary.md"
import csv, re, sys
from pathlib import Path
out = Path(sys.argv[1])
print("# Colab's numba-cuda 0.22.2 with FLASHLAB_FAST_LAUNCH=direct\n")
log = (out / "pytest_gpu.log").read_text() if (out / "pytest_gpu.log").exists() else ""
last = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed)", l)]
print("GPU tests:", last[-1].strip("= ") if last else "no result (see check.log)")
for name, title in (("host_colab.csv", "numba-cuda 0.22.2 (bundle), FLASHLAB_FAST_LAUNCH=direct"),
                    ("host_image.csv", "the machine's own numba-cuda, default")):
    path = out / name
    print(f"\n## host µs per call: {title}\n")
    if not path.exists():
        print("not measured (see check.log)")
        continue
    print("| call | host µs |\n| --- | --- |")
    for r in csv.DictReader(path.open()):
        print(f"| {r['call']} | {r['host_us']} |")
EOF
say "done in $((SECONDS - START)) s; logs in $OUTDIR"
