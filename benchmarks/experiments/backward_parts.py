"""Where the tensor backward's time goes, launch by launch, and how steady its ratio to SDPA is (GPU):

    python benchmarks/experiments/backward_parts.py                      # B1 H16 N4096, d 64 and 128, fp16 and fp32
    python benchmarks/experiments/backward_parts.py --rounds 7           # also: ours and SDPA's fp32 backward, alternated

Part 1 times each of the three launches of one prepared call (preprocess: D = rowsum(dO o O) and dQ's
accumulator zeroed; main; cast: dQ to 16 bits) on their own, and the whole call, with CUDA events (median).
Part 2 alternates flashlab's 3xTF32 backward and torch SDPA's float32 backward at d = 64, `--rounds` times, and
prints each round's ratio and their median: the fp32 bar sits within a few per cent of 1.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "timing"))

from bench_backward import _inputs, _torch, bench_sdpa, bench_tensor, cuda_time_ms  # noqa: E402

NO_OPTIONS = dict(causal=False, scale=None, precision=None, block_q=None, block_k=None, seed=0, window_size=(-1, -1),
                  align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0)


def parts(d, dtype, n=4096, heads=16, repeats=20):
    """{launch name: median ms} for one prepared tensor-backward call, plus "whole call"."""
    from flashlab.kernels import flash_attention, flash_attention_backward, prepared
    from flashlab.kernels import tensor_backward as tb

    torch = _torch()
    q, k, v, do = _inputs(1, heads, n, d, getattr(torch, dtype))
    o, lse = flash_attention(q, k, v, variant="tensor")
    call = tb.PreparedBackward(q, k, v, o, lse, do, **NO_OPTIONS)
    stream = prepared.current_stream(q)
    new = lambda shape, dt: torch.empty(shape, dtype=dt, device=q.device)  # noqa: E731
    D = new(call.q_shape[:3], torch.float32)
    dq = new(call.q_shape, call.dtype)
    dq_acc = dq if call.wide else new(call.q_shape, torch.float32)
    dk, dv = new(call.k_shape, call.dtype), new(call.k_shape, call.dtype)
    pre, main = call.kernels[:2]
    out = {"preprocess": cuda_time_ms(lambda: pre.launch(stream, [o.data_ptr(), do.data_ptr(), D.data_ptr(),
                                                                  dq_acc.data_ptr()]), repeats),
           "main": cuda_time_ms(lambda: main.launch(stream, [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(),
                                                             lse.data_ptr(), D.data_ptr(), dq_acc.data_ptr(),
                                                             dk.data_ptr(), dv.data_ptr()], 0), repeats)}
    if not call.wide:
        out["cast"] = cuda_time_ms(lambda: call.kernels[2].launch(stream, [dq_acc.data_ptr(), dq.data_ptr()]),
                                   repeats)
    out["whole call"] = cuda_time_ms(lambda: flash_attention_backward(q, k, v, o, lse, do, variant="tensor"), repeats)
    return out


def alternate(rounds, d=64, n=4096, heads=16, repeats=20):
    """[(ours ms, SDPA ms)] for the float32 backward, alternated round by round on the same inputs."""
    torch = _torch()
    q, k, v, do = _inputs(1, heads, n, d, torch.float32)
    return [(bench_tensor(q, k, v, do, False, repeats)["ms"], bench_sdpa(q, k, v, do, False, repeats)["ms"])
            for _ in range(rounds)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    ap.add_argument("--rounds", type=int, default=0, help="part 2: rounds of ours against SDPA in fp32 at d64")
    args = ap.parse_args(argv)
    torch = _torch()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for d in args.d:
        for dt in args.dtypes:
            p = parts(d, dt)
            total = sum(v for key, v in p.items() if key != "whole call")
            print(f"d={d:3d} {dt:8s} " + "  ".join(f"{key} {v:.3f} ms ({v / p['whole call']:.0%})"
                                                    for key, v in p.items()) + f"  launches sum {total:.3f} ms")
    if args.rounds:
        pairs = alternate(args.rounds)
        for i, (ours, sdpa) in enumerate(pairs):
            print(f"round {i}: flashlab 3xTF32 {ours:.3f} ms, SDPA fp32 {sdpa:.3f} ms, SDPA / ours {sdpa / ours:.3f}")
        print(f"median SDPA / ours: {statistics.median(s / o for o, s in pairs):.3f} over {len(pairs)} rounds")


if __name__ == "__main__":
    main()
