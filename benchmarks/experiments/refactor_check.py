"""Before/after timing of a kernel refactor, in one run on one GPU: the register backward with options
(kernels/backward.py) and the Flash-Decoding split kernel (kernels/decoding.py) against copies of the modules
from an earlier commit (GPU; CUDA events, median of 20, the two interleaved three times):

    git show REV:flashlab/kernels/backward.py > flashlab/kernels/_old_backward.py
    git show REV:flashlab/kernels/decoding.py > flashlab/kernels/_old_decoding.py
    python benchmarks/experiments/refactor_check.py          # then delete the two _old_ files

Both versions run through the same public call (kernels.flash_attention_backward(variant="register") and
kernels.flash_decoding); only the module's kernel factory is swapped. Prints ms for each and new / old.
"""
from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    import numpy as np
    import torch

    from flashlab.bench import time_cuda
    from flashlab.kernels import backward, decoding, flash_attention, flash_attention_backward, flash_decoding

    old_bwd = importlib.import_module("flashlab.kernels._old_backward")
    old_dec = importlib.import_module("flashlab.kernels._old_decoding")
    H, N, d = 16, 4096, 64
    q, k, v, do = (torch.randn(1, H, N, d, device="cuda") for _ in range(4))
    slopes = np.linspace(0.05, 0.5, H)
    cases = {"softcap 30": dict(softcap=30.0),
             "causal window alibi softcap": dict(causal=True, window_size=(1024, 0), alibi_slopes=slopes,
                                                 softcap=30.0)}
    rows = []
    for name, opts in cases.items():
        o, lse = flash_attention(q, k, v, variant="register", **opts)
        run = lambda: flash_attention_backward(q, k, v, o, lse, do, variant="register", **opts)  # noqa: E731
        rows.append((f"register backward fp32 {name}", _pair(run, backward, "make_kernels", old_bwd, time_cuda)))
    qd = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.float16)
    kd, vd = (torch.randn(8, 32, 16384, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    rows.append(("flash_decoding fp16 B8 H32 N16k d128", _pair(lambda: flash_decoding(qd, kd, vd), decoding, "build",
                                                               old_dec, time_cuda)))
    for name, (new, old) in rows:
        print(f"{name:48s} new {new:8.3f} ms  old {old:8.3f} ms  new/old {new / old:5.3f}")
    print(torch.cuda.get_device_name())


def _pair(run, module, factory, old_module, time_cuda):
    """(new ms, old ms): the median of three interleaved medians, the old module's factory swapped in for the
    second."""
    new, old = [], []
    current = getattr(module, factory)
    for _ in range(3):
        new.append(time_cuda(run)["median_ms"])
        setattr(module, factory, getattr(old_module, factory))
        try:
            old.append(time_cuda(run)["median_ms"])
        finally:
            setattr(module, factory, current)
    return statistics.median(new), statistics.median(old)


if __name__ == "__main__":
    main()
