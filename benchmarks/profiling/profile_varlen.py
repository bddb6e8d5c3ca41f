"""The varlen tensor forward on the varlen benchmark's batch next to the plain one at N4096, for Nsight Compute (GPU):

    ncu --kernel-name regex:flash_fwd_tensor --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats python benchmarks/profiling/profile_varlen.py

Two launches each, prepared once (no host work between them): the varlen batch (64 sequences of 129..4096 tokens,
the lengths of bench_varlen.py, H16 d64 float16), then B1 H16 N4096 d64 float16. Why one gains from two m-tiles
per warp and the other does not is what the report is for.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    import torch

    from flashlab.kernels import forward, varlen

    rng = np.random.default_rng(0)  # bench_varlen.py's batch
    lens = np.exp(rng.uniform(np.log(128), np.log(4096), 64)).astype(int)
    lens[0] = 4096
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    q, k, v = (torch.randn(int(lens.sum()), 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    run = varlen.prepare(q, k, v, cu, cu)[0]
    qp, kp, vp = (torch.randn(1, 16, 4096, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    plain = forward.prepare(qp, kp, vp)[0]
    for fn in (run, run, plain, plain):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
