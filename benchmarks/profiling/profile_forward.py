"""Launch one forward kernel at B=1, H=16, N=4096 (for `ncu` or `compute-sanitizer`): a few launches, no timing.

    ncu --kernel-name regex:flash_fwd --launch-skip 1 --launch-count 1 python benchmarks/profiling/profile_forward.py register 64
    compute-sanitizer --tool memcheck python benchmarks/profiling/profile_forward.py register 64 --n 200 --causal
    compute-sanitizer --tool racecheck python benchmarks/profiling/profile_forward.py tensor 64 --n 200 --dtype bfloat16
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import flashlab  # noqa: E402
from flashlab.kernels import flash_attention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("variant", choices=["register", "shared", "tensor"])
ap.add_argument("d", type=int)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--launches", type=int, default=2)
ap.add_argument("--precision", default=None, help="variant tensor: 3xtf32, tf32, f16, k8 (default: by dtype)")
a = ap.parse_args()
rng = np.random.default_rng(0)
base = [rng.standard_normal((1, a.heads, a.n, a.d)).astype(np.float32) for _ in range(3)]
if a.dtype == "bfloat16":  # NumPy has no bfloat16: torch tensors
    import torch

    args = [torch.tensor(x, device="cuda", dtype=torch.bfloat16) for x in base]
    q, k, v = (x.double().cpu().numpy() for x in args)
else:
    args = q, k, v = [x.astype(a.dtype) for x in base]
kw = {"precision": a.precision} if a.variant == "tensor" else {}
for _ in range(a.launches):
    o, lse = flash_attention(*args, causal=a.causal, variant=a.variant, **kw)
if a.dtype == "bfloat16":
    o = o.double().cpu().numpy()
if a.n <= 1024:  # small enough to check against the float64 reference
    ref, _ = flashlab.reference_attention(q, k, v, causal=a.causal)
    print(f"{a.variant} d={a.d} N={a.n} causal={a.causal} {a.dtype}: relative error {flashlab.relative_error(o, ref):.2e}")
