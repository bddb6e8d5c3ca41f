"""One tensor-backward launch at B1 H16 N4096 (causal off), for Nsight Compute (GPU):

    ncu -k regex:main --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section ComputeWorkloadAnalysis python3 benchmarks/profiling/profile_tensor_backward.py 64 float16

The first call compiles and runs once (skipped by --launch-skip 1); the second is the one profiled.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from flashlab.kernels import flash_attention, flash_attention_backward  # noqa: E402

d = int(sys.argv[1]) if len(sys.argv) > 1 else 64
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float16")
q, k, v, do = (torch.randn(1, 16, 4096, d, device="cuda", dtype=dtype) for _ in range(4))
o, lse = flash_attention(q, k, v, variant="tensor")
for _ in range(2):
    flash_attention_backward(q, k, v, o, lse, do, variant="tensor")
torch.cuda.synchronize()
