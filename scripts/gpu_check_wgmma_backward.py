"""The wgmma backward (kernels/wgmma_backward.py) on a Hopper GPU: gradients against float64 beside torch's own
error; whether deterministic=True repeats its bits (and the default does not); then its speed, with and without
deterministic=True, against torch's SDPA backward and flashlab's tensor (mma.sync) backward, in the same run.

    python scripts/gpu_check_wgmma_backward.py [--quick] [--csv flashlab/data/wgmma_backward.csv]
        [--only accuracy,repeatability,tiles,consumers,dqwarp,blockq,speed,short,layout]

consumers: one consumer warpgroup of 64 keys a block against two of 64 each (BackwardTile consumers=2, 128 keys
a block, setmaxnreg), each through a prepared call of its own: the gradients of both against float64 beside
torch's error, then both timed with torch's SDPA backward at the bar's shapes, and two consumers with a ring of
three stages (two3) beside them. dqwarp: the default tile against the same with dq_warp (the producer's
second warp reduces dQ's rows, as FlashAttention-3's does), checked and timed, with and without deterministic.
blockq: at d 64, the default tile with 64 and with 128 queries a tile (BackwardTile block_q), the same way.

short: the wgmma and tensor backwards at sequences shorter than the bar's (N 512 to 2048), where the library's
default (plan.WGMMA_BACKWARD_MIN_N) decides between them. layout: inputs laid out (B, N, H, d), as a GPT's heads
(x.view(B, N, H, d).transpose(1, 2)), which the wgmma kernels read in place through 4-D tensor maps: the forward's
O and lse and the backward's gradients must be the same bits as from contiguous copies, and the public calls
(flashlab.torch, autograd) are timed beside torch's SDPA on the same views.

Both run through flash_attention_backward with torch tensors (the prepared path, after a first call). Timing:
flashlab.bench.time_cuda, the median of 10 after two warm-ups; TFLOP/s count the backward as 2.5x the forward's
FLOPs (4 B H N^2 d, causal: half).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# B H = 16 and 64, N 4096 and 16384, d 64 and 128, causal and not: the shapes of the backward's bar
SHAPES = [(B, 16, N, d, causal) for B in (1, 4) for N in (4096, 16384) for d in (64, 128) for causal in (False, True)]


def accuracy():
    import torch
    import torch.nn.functional as Fn

    from flashlab.kernels import flash_attention, flash_attention_backward

    for B, H, Nq, Nk, d, causal, dtype in [(1, 2, 300, 250, 64, True, "float16"), (2, 2, 500, 777, 128, False,
                                                                                    "bfloat16"),
                                           (1, 4, 1024, 1024, 128, True, "float16"), (1, 1, 1, 1, 64, False,
                                                                                       "bfloat16"),
                                           (2, 3, 200, 200, 64, False, "float16")]:
        dt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(Nq)
        q, do = (torch.randn(B, H, Nq, d, device="cuda", generator=g).to(dt) for _ in range(2))
        k, v = (torch.randn(B, H, Nk, d, device="cuda", generator=g).to(dt) for _ in range(2))
        if (B, H) == (2, 3):
            q = q * 30  # huge logits
        o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
        got = flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant="wgmma")
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o64 = Fn.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        want = torch.autograd.grad(o64, (q64, k64, v64), do.double())
        qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
        ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        theirs = torch.autograd.grad(ot, (qt, kt, vt), do)
        line = []
        for name, a, b, c in zip(("dq", "dk", "dv"), got, want, theirs):
            e, et = ((x.double() - b).abs().max().item() for x in (a, c))
            line.append(f"{name} {e:.2e} (torch {et:.2e}, ratio {e / max(et, 1e-12):.2f})")
        print(f"B{B} H{H} Nq{Nq} Nk{Nk} d{d} {'causal' if causal else 'full'} {dtype}: " + "; ".join(line),
              flush=True)


def repeatability():
    """Two calls on the same inputs: deterministic=True must give the same bits; the default may not."""
    import torch

    from flashlab.kernels import flash_attention, flash_attention_backward

    for causal in (False, True):
        q, k, v, do = (torch.randn(2, 4, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
        first = {}
        for deterministic in (False, True):
            a, b = (flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant="wgmma",
                                             deterministic=deterministic)[0] for _ in range(2))
            same = torch.equal(a.view(torch.int16), b.view(torch.int16))
            first[deterministic] = a.float()
            print(f"repeatability, {'causal' if causal else 'full'}, deterministic={deterministic}: dq "
                  f"{'bit-identical' if same else 'differs'} across two calls", flush=True)
        print(f"   deterministic against default: dq max |difference| "
              f"{(first[True] - first[False]).abs().max().item():.2e}", flush=True)


def tiles():
    """The backward at d = 64 with ptxas's own register count and capped at 168 (two blocks an SM), N 4096 and
    16384, float16, B 1, H 16, each through a prepared call of its own (kernels/backward.PreparedWgmmaBackward)."""
    import torch

    from flashlab.kernels import flash_attention, wgmma_backward
    from flashlab.kernels.backward import PreparedWgmmaBackward
    from gpu_check_wgmma_forward import timed

    for N in (4096, 16384):
        for causal in (False, True):
            q, k, v, do = (torch.randn(1, 16, N, 64, device="cuda", dtype=torch.float16) for _ in range(4))
            o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
            flops = 2.5 * 4 * 16 * N * N * 64 / (2 if causal else 1)
            line = []
            for cap in (None, 168):
                tile = wgmma_backward.BackwardTile(max_registers=cap)
                described = wgmma_backward.launches(1, 16, N, N, 64, 64 ** -0.5, causal, "float16", tile=tile)
                call = PreparedWgmmaBackward(described, tile.map_rows(), q, k, v, o, lse, do)
                t = timed(lambda: call(q, k, v, o, lse, do), 10)
                line.append(f"registers {cap or 'ptxas'}: {flops / t / 1e12:4.0f}")
            print(f"tiles, N {N:5d} d 64 {'causal' if causal else 'full':6s} " + "  ".join(line), flush=True)


def prepared_backward(q, k, v, o, lse, do, causal, tile, deterministic=False):
    """A call of the wgmma backward with this tile (kernels/backward.PreparedWgmmaBackward): (dq, dk, dv)."""
    from flashlab.kernels import wgmma_backward
    from flashlab.kernels.backward import PreparedWgmmaBackward

    (B, H, Nq, d), (_, H_kv, Nk, _) = q.shape, k.shape
    tile = tile or wgmma_backward.default_tile(d, causal)
    described = wgmma_backward.launches(B, H, Nq, Nk, d, d ** -0.5, causal, str(q.dtype).replace("torch.", ""),
                                        H_kv, tile=tile, deterministic=deterministic)
    call = PreparedWgmmaBackward(described, tile.map_rows(), q, k, v, o, lse, do)
    return lambda: call(q, k, v, o, lse, do)


# (B, H, H_kv, Nq, Nk, d, causal, dtype) of the tile comparisons' accuracy checks: ragged, Nq != Nk, GQA, N = 1
TILE_CHECKS = [(1, 2, 2, 300, 250, 64, True, "float16"), (2, 2, 2, 500, 777, 128, False, "bfloat16"),
               (1, 4, 2, 1024, 1024, 128, True, "float16"), (1, 1, 1, 1, 1, 64, False, "bfloat16"),
               (2, 4, 1, 200, 333, 64, False, "float16")]


def checked_inputs(B, H, H_kv, Nq, Nk, d, causal, dtype):
    """Random inputs, the tensor forward's o and lse, and the float64 gradients and torch's own (dq, dk, dv):
    (q, k, v, do, o, lse, float64's, torch's)."""
    import torch
    import torch.nn.functional as Fn

    from flashlab.kernels import flash_attention

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(Nq)
    q, do = (torch.randn(B, H, Nq, d, device="cuda", generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(B, H_kv, Nk, d, device="cuda", generator=g).to(dt) for _ in range(2))
    o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o64 = Fn.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=H != H_kv)
    want = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != H_kv)
    return q, k, v, do, o, lse, want, torch.autograd.grad(ot, (qt, kt, vt), do)


def timed_inputs(B, H, N, d, causal, dtype):
    """Random inputs of a timed shape, the tensor forward's o and lse, the backward's FLOPs (2.5x the forward's
    4 B H N^2 d, causal half) and torch's SDPA backward as a call: (q, k, v, do, o, lse, flops, sdpa_backward)."""
    import torch
    import torch.nn.functional as Fn

    from flashlab.kernels import flash_attention

    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    ot = Fn.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return (q, k, v, do, o, lse, 2.5 * 4 * B * H * N * N * d / (2 if causal else 1),
            lambda: torch.autograd.grad(ot, (qt, kt, vt), do, retain_graph=True))


def consumers(quick):
    from flashlab.kernels import wgmma_backward
    from gpu_check_wgmma_forward import timed

    def tile(name, d):  # one consumer: capped at 168 registers at d 64 (two blocks an SM); two: 128 keys a block
        return {"one": wgmma_backward.BackwardTile(max_registers=168 if d == 64 else None),
                "two": wgmma_backward.BackwardTile(consumers=2),
                "two3": wgmma_backward.BackwardTile(stages=3, consumers=2)}[name]

    for B, H, H_kv, Nq, Nk, d, causal, dtype in TILE_CHECKS:
        q, k, v, do, o, lse, want, theirs = checked_inputs(B, H, H_kv, Nq, Nk, d, causal, dtype)
        for name in ("one", "two"):
            got = prepared_backward(q, k, v, o, lse, do, causal, tile(name, d))()
            line = []
            for grad, a, b, c in zip(("dq", "dk", "dv"), got, want, theirs):
                e, et = ((x.double() - b).abs().max().item() for x in (a, c))
                line.append(f"{grad} {e:.2e} (torch {et:.2e}, ratio {e / max(et, 1e-12):.2f})")
            print(f"consumers {name}: B{B} H{H} H_kv{H_kv} Nq{Nq} Nk{Nk} d{d} {'causal' if causal else 'full'} "
                  f"{dtype}: " + "; ".join(line), flush=True)
    print("backward TFLOP/s, one consumer (64 keys a block) and two (128 keys, setmaxnreg), prepared calls; sdpa "
          "through autograd", flush=True)
    for dtype in (("float16",) if quick else ("float16", "bfloat16")):
        for B, H, N, d, causal in SHAPES:
            q, k, v, do, o, lse, flops, sdpa_backward = timed_inputs(B, H, N, d, causal, dtype)
            t = {name: timed(prepared_backward(q, k, v, o, lse, do, causal, tile(name, d)), 10)
                 for name in ("one", "two", "two3")}
            t["sdpa"] = timed(sdpa_backward, 10)
            print(f"B{B} H{H:2d} N{N:5d} d{d:3d} {'causal' if causal else 'full':6s} {dtype:8s} " + "  ".join(
                f"{name} {flops / x / 1e12:4.0f}" for name, x in t.items()) +
                f"  two/one {t['one'] / t['two']:.2f}  two/sdpa {t['sdpa'] / t['two']:.2f}", flush=True)


def compare_tiles(label, tiles, checks, shapes, quick):
    """Tiles side by side: for each check of `checks` (TILE_CHECKS' layout), each tile's gradients against float64
    beside torch's error, and whether deterministic mode repeats its bits; then each tile timed at `shapes`
    (SHAPES' layout), with and without deterministic=True, beside torch's SDPA backward. tiles: {name: fn(d,
    causal) -> BackwardTile}, the first the reference of the ratios."""
    import torch

    from gpu_check_wgmma_forward import timed

    first, last = list(tiles)[0], list(tiles)[-1]
    for B, H, H_kv, Nq, Nk, d, causal, dtype in checks:
        q, k, v, do, o, lse, want, theirs = checked_inputs(B, H, H_kv, Nq, Nk, d, causal, dtype)
        torch_errors = " ".join(f"{(x.double() - w).abs().max().item():.2e}" for x, w in zip(theirs, want))
        for name, tile in tiles.items():
            errors = [(x.double() - w).abs().max().item() for x, w in
                      zip(prepared_backward(q, k, v, o, lse, do, causal, tile(d, causal))(), want)]
            det = prepared_backward(q, k, v, o, lse, do, causal, tile(d, causal), deterministic=True)
            runs = det(), det()
            same = all(torch.equal(a, b) for a, b in zip(*runs))
            det_errors = [(x.double() - w).abs().max().item() for x, w in zip(runs[0], want)]
            print(f"{label} check, {name}: B{B} H{H} H_kv{H_kv} Nq{Nq} Nk{Nk} d{d} {'causal' if causal else 'full'} "
                  f"{dtype}: errors dq dk dv " + " ".join(f"{e:.2e}" for e in errors) + f" (torch {torch_errors})"
                  "; deterministic " + " ".join(f"{e:.2e}" for e in det_errors) + f", repeats its bits {same}",
                  flush=True)
    print(f"backward TFLOP/s, {label}: " + ", ".join(tiles) + ", prepared calls (det: deterministic=True); sdpa "
          "through autograd", flush=True)
    for dtype in (("float16",) if quick else ("float16", "bfloat16")):
        for B, H, N, d, causal in shapes:
            q, k, v, do, o, lse, flops, sdpa_backward = timed_inputs(B, H, N, d, causal, dtype)
            t = {}
            for name, tile in tiles.items():
                t[name] = timed(prepared_backward(q, k, v, o, lse, do, causal, tile(d, causal)), 10)
                t[name + " det"] = timed(prepared_backward(q, k, v, o, lse, do, causal, tile(d, causal),
                                                           deterministic=True), 10)
            t["sdpa"] = timed(sdpa_backward, 10)
            print(f"B{B} H{H:2d} N{N:5d} d{d:3d} {'causal' if causal else 'full':6s} {dtype:8s} " + "  ".join(
                f"{name} {flops / x / 1e12:4.0f}" for name, x in t.items()) +
                f"  {last}/{first} {t[first] / t[last]:.2f}  det {t[first + ' det'] / t[last + ' det']:.2f}  "
                f"{last}/sdpa {t['sdpa'] / t[last]:.2f}", flush=True)


def dq_warp(quick):
    """The default tile with dq_warp off ("default": the consumers reduce dQ) and on ("dq warp": the producer's
    second warp does), compared as compare_tiles does."""
    import dataclasses

    from flashlab.kernels import wgmma_backward

    compare_tiles("dq warp", {name: (lambda d, causal, on=name == "dq warp": dataclasses.replace(
        wgmma_backward.default_tile(d, causal), dq_warp=on)) for name in ("default", "dq warp")},
        TILE_CHECKS, SHAPES, quick)


def block_q(quick):
    """At d 64, the default tile with 64 queries a tile ("bq64") and with 128 ("bq128": each consumer's S^T and
    dP^T are 64 keys x 128 queries, and it forms the dQ of its 64 queries), compared as compare_tiles does."""
    import dataclasses

    from flashlab.kernels import wgmma_backward

    compare_tiles("block_q", {f"bq{bq}": (lambda d, causal, bq=bq: dataclasses.replace(
        wgmma_backward.default_tile(d, causal), block_q=bq)) for bq in (64, 128)},
        [c for c in TILE_CHECKS + [(1, 2, 1, 777, 500, 64, True, "bfloat16")] if c[5] == 64],
        [s for s in SHAPES if s[3] == 64], quick)


def speed(quick, csv_path=None):
    import torch

    from flashlab.kernels import flash_attention_backward
    from gpu_check_wgmma_forward import timed  # flashlab.bench.time_cuda's median

    print("backward TFLOP/s; wgmma, det (wgmma, deterministic=True) and tensor through flash_attention_backward, "
          "sdpa through autograd", flush=True)
    rows, gpu, date = [], torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
    for dtype in (("float16",) if quick else ("float16", "bfloat16")):
        for B, H, N, d, causal in (SHAPES[:8] if quick else SHAPES):
            q, k, v, do, o, lse, flops, sdpa_backward = timed_inputs(B, H, N, d, causal, dtype)
            t = {name: timed(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant=name), 10)
                 for name in ("wgmma", "tensor")}
            t["det"] = timed(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant="wgmma",
                                                              deterministic=True), 10)
            t["sdpa"] = timed(sdpa_backward, 10)
            print(f"B{B} H{H:2d} N{N:5d} d{d:3d} {'causal' if causal else 'full':6s} {dtype:8s} " + "  ".join(
                f"{name} {flops / x / 1e12:4.0f}" for name, x in t.items()) +
                f"  wgmma/sdpa {t['sdpa'] / t['wgmma']:.2f}  wgmma/tensor {t['tensor'] / t['wgmma']:.2f}", flush=True)
            rows.append([gpu, date, B, H, N, d, int(causal), dtype] +
                        [round(flops / t[name] / 1e12) for name in ("wgmma", "tensor", "sdpa", "det")])
    if csv_path:  # flashlab/data/wgmma_backward.csv's layout (lesson 20's figure)
        import csv

        with open(csv_path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["gpu", "date", "B", "H", "N", "d", "causal", "dtype", "wgmma_tflops", "tensor_tflops",
                          "sdpa_tflops", "deterministic_tflops"])
            out.writerows(rows)
        print(f"wrote {csv_path}", flush=True)


def short(dtypes=("bfloat16", "float16")):
    import torch

    from flashlab.kernels import flash_attention, flash_attention_backward
    from gpu_check_wgmma_forward import timed

    print("backward at short sequences, us a call (host time included): wgmma and tensor", flush=True)
    for dtype in dtypes:
        for B, H in ((8, 4), (1, 16)):
            for N in (512, 1024, 2048):
                for d in (64, 128):
                    for causal in (True, False):
                        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=getattr(torch, dtype))
                                       for _ in range(4))
                        o, lse = flash_attention(q, k, v, causal=causal, variant="tensor")
                        t = {name: timed(lambda: flash_attention_backward(q, k, v, o, lse, do, causal=causal,
                                                                          variant=name), 20)
                             for name in ("wgmma", "tensor")}
                        print(f"B{B} H{H:2d} N{N:5d} d{d:3d} {'causal' if causal else 'full':6s} {dtype:8s} "
                              f"wgmma {t['wgmma'] * 1e6:7.1f}  tensor {t['tensor'] * 1e6:7.1f}  "
                              f"tensor/wgmma {t['tensor'] / t['wgmma']:.2f}", flush=True)


def layout():
    import torch
    import torch.nn.functional as Fn

    from flashlab.kernels import flash_attention, flash_attention_backward
    from flashlab.torch import scaled_dot_product_attention as flash_sdpa
    from gpu_check_wgmma_forward import timed

    for B, H, N, d, causal in ((8, 4, 1024, 64, True), (2, 8, 777, 128, False), (4, 16, 2048, 64, True)):
        x = torch.randn(B, N, 4 * H * d, device="cuda", dtype=torch.bfloat16)  # as a linear layer's output
        views = [t.view(B, N, H, d).transpose(1, 2) for t in x.split(H * d, dim=2)]
        q, k, v, do = views
        copies = [t.contiguous() for t in views]
        o, lse = flash_attention(q, k, v, causal=causal, variant="wgmma")
        o_c, lse_c = flash_attention(*copies[:3], causal=causal, variant="wgmma")
        same = torch.equal(o, o_c) and torch.equal(lse, lse_c)
        o_view = o.transpose(1, 2).is_contiguous()
        grads = flash_attention_backward(q, k, v, o, lse, do, causal=causal, variant="wgmma")
        grads_c = flash_attention_backward(*copies[:3], o_c.contiguous(), lse_c, copies[3], causal=causal,
                                           variant="wgmma")
        same_grads = all(torch.equal(a, b) for a, b in zip(grads, grads_c))  # dQ's atomics: within an ulp
        close = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, grads_c))
        print(f"layout B{B} H{H} N{N} d{d} {'causal' if causal else 'full'}: forward same bits {same}, O laid out "
              f"(B, N, H, d) {o_view}; backward same bits {same_grads} (max |difference| {close:.2e})", flush=True)
        leaf = x.detach().requires_grad_()

        def step(fn):  # as a GPT's layer: heads are views of one linear output, the gradient flows back into it
            q, k, v, _ = (t.view(B, N, H, d).transpose(1, 2) for t in leaf.split(H * d, dim=2))
            torch.autograd.grad(fn(q, k, v, is_causal=causal), leaf, do)

        t = {name: timed(lambda: step(fn), 20) for name, fn in (("flashlab", flash_sdpa),
                                                                ("sdpa", Fn.scaled_dot_product_attention))}
        t.update({f"{name} forward": timed(lambda: fn(*views[:3], is_causal=causal), 20)
                  for name, fn in (("flashlab", flash_sdpa), ("sdpa", Fn.scaled_dot_product_attention))})
        print("   us a call, forward + backward through autograd: " + "  ".join(
            f"{name} {x * 1e6:7.1f}" for name, x in t.items()), flush=True)


def main():
    import torch

    from flashlab.kernels import wgmma_backward

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="float16 and B = 1 only")
    ap.add_argument("--csv", help="speed: also write its rows here, as flashlab/data/wgmma_backward.csv")
    sections = {"accuracy": accuracy, "repeatability": repeatability, "tiles": tiles,
                "consumers": lambda: consumers(args.quick), "dqwarp": lambda: dq_warp(args.quick),
                "blockq": lambda: block_q(args.quick),
                "speed": lambda: speed(args.quick, args.csv),
                "short": lambda: short(("float16",) if args.quick else ("bfloat16", "float16")), "layout": layout}
    ap.add_argument("--only", default=",".join(sections),
                    help="the sections to run, comma-separated (default: all, in this order)")
    args = ap.parse_args()
    unknown = set(args.only.split(",")) - set(sections)
    if unknown:
        ap.error(f"--only takes {', '.join(sections)}; got {', '.join(sorted(unknown))}")
    print(torch.cuda.get_device_name(), time.strftime("%Y-%m-%d"), flush=True)
    for name in args.only.split(","):
        sections[name]()
    for key, kernel in sorted(wgmma_backward._BUILDS.items(), key=str):
        for compiled in kernel.overloads.values():
            print(f"build {key}: {compiled.regs_per_thread} registers, {compiled.local_mem_per_thread} local bytes")


if __name__ == "__main__":
    main()
