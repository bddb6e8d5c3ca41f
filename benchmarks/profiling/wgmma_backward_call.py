"""Two prepared calls of the wgmma backward on random inputs, for Nsight Compute to measure the second (GPU).

    ncu --clock-control none --kernel-name regex:flash_bwd_wgmma --launch-skip 1 --launch-count 1 --set full \
        -o bwd python benchmarks/profiling/wgmma_backward_call.py [--n 16384] [--d 64] [--causal] [--dtype float16]
    ncu -i bwd.ncu-rep --page details

B = 1, H = 16, the default tile (wgmma_backward.default_tile), inputs as scripts/gpu_check_wgmma_backward.py times
them. benchmarks/results/h200/wgmma_backward_ncu_d64.txt holds one such profile and what it says.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, choices=(64, 128), default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    a = ap.parse_args()
    import torch
    from gpu_check_wgmma_backward import prepared_backward, timed_inputs

    from flashlab.kernels import wgmma_backward

    q, k, v, do, o, lse, _, _ = timed_inputs(1, 16, a.n, a.d, a.causal, a.dtype)
    call = prepared_backward(q, k, v, o, lse, do, a.causal, wgmma_backward.default_tile(a.d, a.causal))
    for _ in range(2):
        call()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
