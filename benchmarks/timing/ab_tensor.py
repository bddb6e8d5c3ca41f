"""Tensor-core kernels before and after a change, on one GPU: forward, backward and varlen at B1 H16 N4096.

    python benchmarks/timing/ab_tensor.py new                                   # this checkout
    PYTHONPATH=/path/to/old/checkout python benchmarks/timing/ab_tensor.py old  # another one (its flashlab first)

    python benchmarks/timing/ab_tensor.py new "d64,varlen,sdpa d64"             # some of the cases

Prints "TAG round case ms" for 3 rounds (median of 30 CUDA-event samples each, float16 unless named) with two
SDPA cases as a check on the GPU's state, so that two runs compare case by case
(benchmarks/results/logs-options/run24_ab_*.txt); and the largest error of two outputs against SDPA in float32.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an old checkout there wins


def cases(torch, only=None):
    """{case: function to time} (only: the names to keep; kernels compile at their first call), and checks."""
    from flashlab.kernels import flash_attention, flash_attention_backward, varlen

    H, N = 16, 4096
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def qkv(d, dt=torch.float16):
        return [torch.randn(1, H, N, d, device="cuda", dtype=dt) for _ in range(4)]

    t64, t128, tb, tf = qkv(64), qkv(128), qkv(64, torch.bfloat16), qkv(64, torch.float32)
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    out = {}
    for name, (q, k, v, do), kw in (
            ("d64", t64, {}), ("d64c", t64, dict(causal=True)), ("d128", t128, {}),
            ("d128c", t128, dict(causal=True)), ("bf16d64", tb, {}), ("f32d64", tf, {}),
            ("d64alibi", t64, dict(alibi_slopes=slopes)), ("d64win", t64, dict(causal=True, window_size=(1024, 0)))):
        out[name] = lambda q=q, k=k, v=v, kw=kw: flash_attention(q, k, v, variant="tensor", **kw)
    for name, (q, k, v, do), kw in (("bwd d64", t64, {}), ("bwd d128c", t128, dict(causal=True))):
        if only and name not in only:
            continue
        o, lse = flash_attention(q, k, v, variant="tensor", **kw)
        out[name] = lambda q=q, k=k, v=v, o=o, lse=lse, do=do, kw=kw: flash_attention_backward(
            q, k, v, o, lse, do, variant="tensor", **kw)
    rng = np.random.default_rng(0)  # bench_varlen.py's batch: 64 sequences of 128..4096 tokens
    lens = np.exp(rng.uniform(np.log(128), np.log(4096), 64)).astype(int)
    lens[0] = 4096
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    qv, kv, vv = (torch.randn(int(lens.sum()), H, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out["varlen"] = varlen.prepare(qv, kv, vv, cu, cu)[0]
    out["varlen c"] = varlen.prepare(qv, kv, vv, cu, cu, causal=True)[0]
    out["sdpa d64"] = lambda: sdpa(*t64[:3])
    out["sdpa d128c"] = lambda: sdpa(*t128[:3], is_causal=True)
    checks = {}
    for name, (q, k, v, _), causal in (("d64", t64, False), ("d128c", t128, True)):
        o, _ = flash_attention(q, k, v, variant="tensor", causal=causal)
        ref = sdpa(q.float(), k.float(), v.float(), is_causal=causal)
        checks[name] = float((o.float() - ref).abs().max())
    return {name: fn for name, fn in out.items() if not only or name in only}, checks


def main():
    import torch

    import flashlab
    from flashlab.bench import time_cuda

    tag = sys.argv[1] if len(sys.argv) > 1 else "run"
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # e.g. d64,varlen,"sdpa d64": these cases only
    print(tag, flashlab.__file__, torch.cuda.get_device_name(), flush=True)
    fns, checks = cases(torch, only)
    for name, err in checks.items():
        print(tag, "check", name, err, flush=True)
    for rnd in range(3):
        for name, fn in fns.items():
            print(tag, rnd, name, round(time_cuda(fn, warmup=3, reps=30)["median_ms"], 4), flush=True)


if __name__ == "__main__":
    main()
