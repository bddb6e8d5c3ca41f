"""Launch one forward kernel at B=1, H=16, N=4096 (for `ncu` or `compute-sanitizer`): a few launches, no timing.

    ncu --kernel-name regex:flash_fwd --launch-skip 1 --launch-count 1 python benchmarks/profile_forward.py register 64
    compute-sanitizer --tool memcheck python benchmarks/profile_forward.py register 64 --n 200 --causal
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashlab  # noqa: E402
from flashlab.kernels import flash_attention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("variant", choices=["register", "shared"])
ap.add_argument("d", type=int)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--launches", type=int, default=2)
a = ap.parse_args()
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, a.heads, a.n, a.d)).astype(a.dtype) for _ in range(3))
for _ in range(a.launches):
    o, lse = flash_attention(q, k, v, causal=a.causal, variant=a.variant)
if a.n <= 1024:  # small enough to check against the float64 reference
    ref, _ = flashlab.reference_attention(q, k, v, causal=a.causal)
    print(f"{a.variant} d={a.d} N={a.n} causal={a.causal} {a.dtype}: relative error {flashlab.relative_error(o, ref):.2e}")
