"""The wgmma forward (variant="wgmma", kernels/wgmma.py) on a Hopper GPU: accuracy against float64 beside torch's
own, registers, and speed against torch in the same run.

    python scripts/gpu_check_wgmma_forward.py [--quick] [--out benchmarks/results/h200/wgmma_forward.csv]
    compute-sanitizer --tool racecheck python scripts/gpu_check_wgmma_forward.py --small --skip speed,tiles

1. Accuracy: ragged, Nq != Nk, causal, GQA, N = 1, huge logits, float16 and bfloat16: the largest error of O and
   lse against float64, beside torch's scaled_dot_product_attention's error on the same inputs (the bar: at most
   1.5x torch's).
2. Registers and local memory of each build, as the driver compiled it (setmaxnreg then gives the consumers 240).
3. Speed: public calls on torch tensors (host time included), CUDA events, the median of --repeats after two
   warm-ups, TFLOP/s = 4 B H N^2 d (causal: half). Columns: flashlab wgmma, torch SDPA as called (FA3-class on
   Hopper), torch's FlashAttention-2 backend, flashlab tensor (mma.sync), and the wgmma forward's prepared call
   made once and called directly (`prepared`: what the public call costs beyond it shows as the gap between the
   first and last columns). Writes the table as CSV.
"""
import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def sdpa(q, k, v, causal, backend=None):
    import torch.nn.functional as Fn

    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if backend is None:
        return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)


def reference(q, k, v, causal):
    """O and lse in float64 (top-left causal, as flashlab and torch)."""
    import torch

    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


def accuracy(log, small=False):
    import torch
    from flashlab.kernels.forward import flash_attention

    cases = [  # B, H, H_kv, Nq, Nk, d, causal, dtype, logit scale
        (1, 4, 2, 1000, 777, 64, True, "float16", 1), (2, 3, 3, 1, 1, 128, False, "bfloat16", 1),
        (1, 2, 1, 4096, 4096, 128, True, "bfloat16", 1), (1, 2, 2, 300, 2049, 64, False, "float16", 1),
        (1, 2, 2, 513, 513, 128, True, "float16", 30), (1, 16, 16, 2048, 2048, 64, False, "float16", 1),
        (1, 8, 1, 1500, 1500, 128, False, "bfloat16", 1), (1, 2, 2, 2048, 1024, 64, True, "bfloat16", 1)]
    if small:  # for compute-sanitizer, which runs kernels hundreds of times slower
        cases = [(1, 2, 1, 300, 250, 64, True, "float16", 1), (1, 1, 1, 200, 390, 128, False, "bfloat16", 1)]
    log(f"{'case':52s} {'o err':>9s} {'sdpa o':>9s} {'ratio':>6s} {'lse err':>9s}")
    worst = 0.0
    for B, H, Hk, Nq, Nk, d, causal, dtype, big in cases:
        dt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(Nq * 7 + Nk)
        q = (torch.randn(B, H, Nq, d, device="cuda", generator=g) * big).to(dt)
        k, v = (torch.randn(B, Hk, Nk, d, device="cuda", generator=g).to(dt) for _ in range(2))
        o, lse = flash_attention(q, k, v, causal=causal, variant="wgmma")
        o_ref, lse_ref = reference(q, k, v, causal)
        err = (o.double() - o_ref).abs().max().item()
        # under compute-sanitizer (small), torch's own attention kernel is left out: only flashlab's is checked
        ref_err = err if small else (sdpa(q, k, v, causal).double() - o_ref).abs().max().item()
        lerr = (lse.double() - lse_ref).abs().max().item()
        ratio = err / max(ref_err, 1e-12)
        worst = max(worst, ratio)
        name = f"B{B} H{H}/{Hk} Nq{Nq} Nk{Nk} d{d} {'causal' if causal else 'full'} {dtype} x{big}"
        log(f"{name:52s} {err:9.2e} {ref_err:9.2e} {ratio:6.2f} {lerr:9.2e}  {'ok' if ratio <= 1.5 else 'FAIL'}")
    log(f"worst error ratio to torch: {worst:.2f} (bar 1.5)")
    return worst


def registers(log):
    from flashlab.kernels import wgmma

    log(f"{'build':40s} {'registers':>9s} {'local bytes':>11s}")
    for key, kernel in sorted(wgmma._BUILDS.items(), key=str):
        for sig, compiled in kernel.overloads.items():
            log(f"{str(key[:3]) + ' ' + str(key[3].block_k):40s} {compiled.regs_per_thread:9d} "
                f"{compiled.local_mem_per_thread:11d}")


def timed(fn, repeats):
    """Median seconds of fn() between CUDA events after two warm-ups (flashlab.bench.time_cuda)."""
    from flashlab.bench import time_cuda

    return time_cuda(fn, warmup=2, reps=repeats)["median_ms"] / 1e3


def speed(log, out, quick, repeats):
    import torch
    from torch.nn.attention import SDPBackend

    from flashlab.kernels import wgmma
    from flashlab.kernels.forward import PreparedWgmma, flash_attention

    shapes = [(B, 16, N, d, causal, dtype) for dtype in ("float16", "bfloat16") for B in (1, 4)
              for N in (4096, 8192, 16384) for d in (64, 128) for causal in (False, True)]
    if quick:
        shapes = [s for s in shapes if s[0] == 1 and s[2] != 8192 and s[5] == "float16"]
    name = torch.cuda.get_device_name()
    log(f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    log(f"{'B':>2s} {'H':>3s} {'N':>6s} {'d':>4s} {'causal':>6s} {'dtype':>9s} | {'wgmma':>6s} {'sdpa':>6s} "
        f"{'fa2':>6s} {'tensor':>6s} {'prep':>6s} | {'/sdpa':>6s} {'/fa2':>6s}")
    rows = []
    for B, H, N, d, causal, dtype in shapes:
        dt = getattr(torch, dtype)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dt) for _ in range(3))
        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        direct = PreparedWgmma(q, k, v, causal, d ** -0.5, dtype, wgmma.choose_tile(d, causal, None))
        calls = {"wgmma": lambda: flash_attention(q, k, v, causal=causal, variant="wgmma"),
                 "sdpa": lambda: sdpa(q, k, v, causal),
                 "fa2": lambda: sdpa(q, k, v, causal, SDPBackend.FLASH_ATTENTION),
                 "tensor": lambda: flash_attention(q, k, v, causal=causal, variant="tensor"),
                 "prepared": lambda: direct(q, k, v)}
        tf = {}
        for key, fn in calls.items():
            try:
                tf[key] = flops / timed(fn, repeats) / 1e12
            except Exception as exc:  # noqa: BLE001 (a backend that refuses a shape: report and go on)
                log(f"  {key}: {type(exc).__name__}: {str(exc)[:120]}")
                tf[key] = float("nan")
        row = dict(gpu=name, date=time.strftime("%Y-%m-%d"), B=B, H=H, N=N, d=d, causal=int(causal), dtype=dtype,
                   **{f"{k}_tflops": round(x, 1) for k, x in tf.items()})
        rows.append(row)
        log(f"{B:2d} {H:3d} {N:6d} {d:4d} {str(causal):>6s} {dtype:>9s} | {tf['wgmma']:6.0f} {tf['sdpa']:6.0f} "
            f"{tf['fa2']:6.0f} {tf['tensor']:6.0f} {tf['prepared']:6.0f} | {tf['wgmma'] / tf['sdpa']:6.2f} {tf['wgmma'] / tf['fa2']:6.2f}")
    ratios = [r["wgmma_tflops"] / r["sdpa_tflops"] for r in rows]
    log(f"wgmma / torch SDPA: min {min(ratios):.2f}, median {np.median(ratios):.2f}, max {max(ratios):.2f} "
        f"(bar 0.85)")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        log(f"wrote {out}")


def tiles(log, repeats):
    """The kernel's schedule and tile choices side by side (prepared launches): block_k, stages, pingpong."""
    import torch

    from flashlab.kernels import wgmma
    from flashlab.kernels.forward import PreparedWgmma

    choices = {64: [(192, 2, True, 2), (128, 2, True, 3), (128, 3, True, 3), (128, 2, False, 3), (96, 3, True, 3)],
               128: [(128, 2, True, 2), (128, 3, True, 2), (176, 2, True, 2), (128, 2, False, 2), (64, 2, True, 3)]}
    log(f"{'N':>6s} {'d':>4s} {'causal':>6s} | " + "  ".join(f"{'bk/st/pp/wg':>14s}" for _ in range(5)))
    for N in (4096, 16384):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = (torch.randn(1, 16, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
                flops = 4 * 16 * N * N * d / (2 if causal else 1)
                cells = []
                for bk, st, pp, c in choices[d]:
                    tile = wgmma.WgmmaTile(bk, st, pp, c)
                    try:
                        tile.check(d)
                        call = PreparedWgmma(q, k, v, causal, d ** -0.5, "float16", tile)
                        cells.append(f"{bk}/{st}/{'p' if pp else '-'}/{c} {flops / timed(lambda: call(q, k, v), repeats) / 1e12:4.0f}")
                    except Exception as exc:  # noqa: BLE001
                        cells.append(f"{bk}/{st}/{c}: {type(exc).__name__}")
                log(f"{N:6d} {d:4d} {str(causal):>6s} | " + "  ".join(f"{c:>14s}" for c in cells))


def small(log, repeats):
    """Short sequences, where launch and host time weigh: wgmma against the tensor kernel and torch, and the host
    time of one call (the CPU time of 200 calls in a row, no synchronisation: the GPU keeps up at this size)."""
    import torch

    from flashlab.kernels.forward import flash_attention

    log(f"{'N':>6s} {'d':>4s} {'causal':>6s} | {'wgmma':>6s} {'tensor':>6s} {'sdpa':>6s}   (B 1, H 16, float16, TFLOP/s)")
    for N in (256, 512, 1024, 2048):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = (torch.randn(1, 16, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
                flops = 4 * 16 * N * N * d / (2 if causal else 1)
                tf = [flops / timed(fn, repeats) / 1e12 for fn in (
                    lambda: flash_attention(q, k, v, causal=causal, variant="wgmma"),
                    lambda: flash_attention(q, k, v, causal=causal, variant="tensor"),
                    lambda: sdpa(q, k, v, causal))]
                log(f"{N:6d} {d:4d} {str(causal):>6s} | {tf[0]:6.1f} {tf[1]:6.1f} {tf[2]:6.1f}")
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for name, fn in (("wgmma", lambda: flash_attention(q, k, v, variant="wgmma")),
                     ("tensor", lambda: flash_attention(q, k, v, variant="tensor")), ("sdpa", lambda: sdpa(q, k, v, False))):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t) / 200
        torch.cuda.synchronize()
        log(f"host time of one call, {name}: {host * 1e6:.1f} us")


def timeline(log, out_dir):
    """The timeline build on one shape per head dim: when each warpgroup of the grid's first block reaches each step
    of each tile (%globaltimer), written as JSON for lesson 20's figure, beside the plain build's time."""
    import json

    import torch

    from flashlab.device import get_cuda
    from flashlab.kernels import wgmma
    from flashlab.kernels.forward import PreparedWgmma

    cuda = get_cuda()
    record = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "events": wgmma.EVENTS,
              "runs": []}
    for d in (64, 128):
        N, causal = 4096, False
        q, k, v = (torch.randn(1, 16, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
        plain = wgmma.choose_tile(d, causal)
        tile = wgmma.WgmmaTile(plain.block_k, plain.stages, plain.pingpong, plain.consumers, timeline=True)
        n_tiles = -(-N // tile.block_k)
        stamps = cuda.to_device(np.zeros((1 + tile.consumers, n_tiles + 1, len(wgmma.EVENTS)), np.uint64))
        as_words = [cuda.as_cuda_array(x.view(torch.int32)).view(np.uint32) for x in (q, k, v)]
        o = cuda.device_array((1, 16, N, d // 2), np.uint32)
        lse = cuda.device_array((1, 16, N), np.float32)
        for _ in range(3):  # the last run's stamps are kept (compiled and warm)
            wgmma.forward(*as_words, o, lse, d ** -0.5, causal, "float16", tile, stamps)
        cuda.synchronize()
        st = stamps.copy_to_host().astype(np.int64)
        t0 = st[st > 0].min()
        call = PreparedWgmma(q, k, v, causal, d ** -0.5, "float16", plain)
        ms = timed(lambda: call(q, k, v), 10) * 1e3
        per_tile = np.diff(st[1, 1:n_tiles, 0]).mean() / 1e3
        log(f"d {d}: {tile.consumers} consumers, {n_tiles} tiles of {tile.block_k} keys; the first block took "
            f"{(st.max() - t0) / 1e3:.1f} us, {per_tile:.2f} us a tile; the whole call {ms:.3f} ms")
        record["runs"].append(dict(B=1, H=16, N=N, d=d, causal=causal, dtype="float16", block_q=tile.block_q,
                                   block_k=tile.block_k, stages=tile.stages, consumers=tile.consumers,
                                   call_ms=round(ms, 4), stamps_ns=np.where(st > 0, st - t0, -1).tolist()))
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "wgmma_timeline.json").write_text(json.dumps(record))
        log(f"wrote {out_dir / 'wgmma_timeline.json'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B = 1, N 4096 and 16384, float16 only")
    ap.add_argument("--small", action="store_true", help="two small accuracy cases (for compute-sanitizer)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="CSV of the speed table")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: accuracy, speed, small, tiles, timeline, registers")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    def log(line):
        print(line, flush=True)

    start = time.time()
    if "accuracy" not in skip:
        accuracy(log, args.small)
        log(f"[{time.time() - start:.0f} s]")
    if "speed" not in skip:
        speed(log, args.out, args.quick, args.repeats)
        log(f"[{time.time() - start:.0f} s]")
    if "small" not in skip:
        small(log, args.repeats)
        log(f"[{time.time() - start:.0f} s]")
    if "tiles" not in skip:
        tiles(log, args.repeats)
        log(f"[{time.time() - start:.0f} s]")
    if "timeline" not in skip:
        timeline(log, args.out.parent if args.out else None)
        log(f"[{time.time() - start:.0f} s]")
    if "registers" not in skip:
        registers(log)


if __name__ == "__main__":
    main()
