"""Lesson 19, ring attention: merging a rank's partial results in ring order, the zigzag index map, the bytes a
rank sends, and the sequence length at which a link keeps up. The checkers play every rank themselves
(flashlab.ring.simulate), in NumPy: no processes, no torch."""
from __future__ import annotations

import numpy as np

from ..reference import reference_attention
from ..ring import model
from ..ring.layout import shard_indices
from ..ring.simulate import rank_partials
from .core import exercise

LESSON = "19_beyond_one_gpu"

HUGE = ("The log-sum-exps are near 1e3 here, and exp(1e3) overflows: subtract the largest lse_t first, "
        "w_t = exp(lse_t - m).")
EMPTY = ("Some steps give a row the empty state (o_t = 0, lse_t = -inf: every key of that shard comes after "
         "the query). It must change nothing, and produce no NaN.")


@exercise("ring_merge", lesson=LESSON,
          hint="m = the max of the lse_t; w_t = exp(lse_t - m); o = sum of w_t o_t divided by sum of w_t; "
               "lse = m + log(sum of w_t). Each o_t is already normalised: weigh it, do not just add it.")
def check_ring_merge(t, fn):
    specs = [("2 ranks, no mask", 2, "zigzag", False, (1, 8, 4), np.float64, 1.0, None),
             ("4 ranks, causal, zigzag", 4, "zigzag", True, (2, 16, 8), np.float64, 1.0, EMPTY),
             ("3 ranks, causal, contiguous", 3, "contiguous", True, (2, 12, 6), np.float64, 1.0, EMPTY),
             ("one rank", 1, "zigzag", True, (1, 6, 4), np.float64, 1.0, None),
             ("huge scores", 4, "zigzag", False, (2, 16, 8), np.float64, 400.0, HUGE),
             ("float32", 4, "contiguous", True, (3, 8, 16), np.float32, 1.0, EMPTY),
             ("8 ranks, causal, zigzag", 8, "zigzag", True, (1, 32, 8), np.float64, 3.0, EMPTY)]
    for label, w, layout, causal, (heads, n, d), dtype, size, hint in specs:
        q = t.normal((heads, n, d), np.float64, size)
        k, v = t.normal((heads, n, d)), t.normal((heads, n, d))
        rank = int(t.rng.integers(0, w))
        parts = rank_partials(q, k, v, rank, w, layout, causal)
        o_parts = np.stack([p[0] for p in parts]).astype(dtype)
        lse_parts = np.stack([p[1] for p in parts]).astype(dtype)
        t.case(label, hint, world_size=w, rank=rank, layout=layout, causal=causal, heads=heads, N=n, d=d,
               dtype=dtype)
        out = t.call(o_parts, lse_parts)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (o, lse); got {type(out).__name__}")
        ref_o, ref_lse = reference_attention(q, k, v, causal=causal)
        rows = shard_indices(n, rank, w, layout)
        tol = 1e-10 if dtype == np.float64 else 1e-5
        t.compare(out[0], ref_o[:, rows], "o", min_dtype=dtype, tol=tol)
        t.compare(out[1], ref_lse[:, rows], "lse", min_dtype=dtype, tol=tol)


@exercise("zigzag_indices", lesson=LESSON,
          hint="Chunks of c = N // (2 * world_size) tokens; rank r holds chunk r, positions r*c .. (r+1)*c - 1, "
               "and chunk 2*world_size - 1 - r, in that order (the first chunk comes first in the sequence).")
def check_zigzag_indices(t, fn):
    specs = [("the example", 16, 0, 4), ("the example, last rank", 16, 3, 4), ("one rank", 6, 0, 1),
             ("two ranks", 8, 1, 2), ("chunks of one token", 10, 2, 5), ("8 ranks", 64, 5, 8)]
    for _ in range(4):
        w = int(t.rng.integers(1, 9))
        specs.append(("random", 2 * w * int(t.rng.integers(1, 7)), int(t.rng.integers(0, w)), w))
    for label, n, rank, w in specs:
        t.case(label, N=n, rank=rank, world_size=w)
        out = t.call(n, rank, w)
        want = shard_indices(n, rank, w, "zigzag")
        if not isinstance(out, np.ndarray):
            out = np.asarray(out) if isinstance(out, (list, tuple)) else out
        if not isinstance(out, np.ndarray) or out.dtype.kind not in "iu":
            raise t.fail(f"return a NumPy array of integers; got {type(out).__name__}"
                         + (f" of dtype {out.dtype}" if isinstance(out, np.ndarray) else ""),
                         hint="np.arange gives integers; np.concatenate joins two ranges")
        if out.shape != want.shape:
            raise t.fail(f"rank {rank} should hold {len(want)} tokens (two chunks of {n // (2 * w)}); got "
                         f"{out.shape[0] if out.ndim == 1 else out.shape}")
        if not np.array_equal(out, want):
            c = n // (2 * w)
            got_chunks = sorted({int(x) // c for x in out.ravel()}) if c else []
            raise t.fail(f"rank {rank} of {w} should hold positions {want.tolist()}; got {out.tolist()}",
                         details=[f"your positions fall in chunks {got_chunks}; the rank holds chunks "
                                  f"{rank} and {2 * w - 1 - rank}"])


@exercise("ring_bytes", lesson=LESSON,
          hint="One shard of K and V holds 2 * batch * kv_heads * (N / W) * d numbers. Forward: it is sent W - 1 "
               "times, itemsize bytes each. Backward: K and V W - 1 times again, plus the dK/dV buffer W times "
               "at grad_itemsize bytes. W = 1 sends nothing.")
def check_ring_bytes(t, fn):
    specs = [("the example", 131072, 8, 1, 8, 128, 2, 4), ("one rank", 4096, 1, 2, 8, 64, 2, 4),
             ("two ranks, float32", 1024, 2, 1, 4, 64, 4, 4), ("MHA, a batch of 4", 8192, 4, 4, 32, 128, 2, 4),
             ("bfloat16 gradients", 65536, 16, 1, 8, 128, 2, 2)]
    for _ in range(3):
        w = int(2 ** t.rng.integers(1, 8))
        specs.append(("random", w * int(t.rng.integers(1, 4096)), w, int(t.rng.integers(1, 5)),
                      int(2 ** t.rng.integers(0, 6)), int(t.rng.choice([64, 96, 128, 256])), 2, 4))
    for label, n, w, b, hkv, d, size, gsize in specs:
        t.case(label, N=n, world_size=w, batch=b, kv_heads=hkv, d=d, itemsize=size, grad_itemsize=gsize)
        out = t.call(n, w, b, hkv, d, size, gsize)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise t.fail(f"return a pair (forward bytes, backward bytes); got {out!r:.80}")
        fwd, bwd = model.ring_bytes(n, w, b, hkv, d, size, gsize)
        shard = 2 * b * hkv * (n // w) * d
        t.scalar(out[0], fwd, "the forward's bytes", tol=1e-12, slips=[
            (w * shard * size, "The forward sends at every step but the last: W - 1 times, not W."),
            (fwd / 2, "K and V both travel: 2 numbers per token, head and dimension."),
            (fwd * w, "A shard holds N / W tokens, not N."),
            ((w - 1) * shard, "Bytes, not numbers: multiply by itemsize.")])
        home = w * shard * gsize if w > 1 else 0
        t.scalar(out[1], bwd, "the backward's bytes", tol=1e-12, slips=[
            (fwd + (w - 1) * shard * gsize, "The dK/dV buffer is sent W times: the last send brings it home."),
            (fwd + w * shard * size, "dK and dV travel in grad_itemsize bytes per number, not itemsize."),
            (home, "The backward sends K and V around the ring again (W - 1 times), besides the dK/dV buffer."),
            (fwd + home / 2, "dK and dV are both sent: as many numbers as K and V together."),
            (2 * fwd, "Besides K and V, the backward sends the dK/dV buffer (grad_itemsize bytes per number), "
                      "W times."),
            (w * shard * gsize + w * shard * size if w > 1 else 0,
             "K and V travel W - 1 times in the backward, as in the forward; only dK/dV go W times.")])


@exercise("hiding_length", lesson=LESSON,
          hint="With c = N / W: compute 4 c^2 d H w / peak_flops (w = 1/2 causal), transfer 2 c d kv_heads itemsize / "
               "bandwidth. Set them equal and solve for c (d cancels), then N = W c.")
def check_hiding_length(t, fn):
    specs = [("MHA, NVLink, no mask", 8, 32, 32, 2, 989e12, 450e9, False),
             ("GQA 32:8, causal", 8, 32, 8, 2, 989e12, 450e9, True),
             ("InfiniBand, causal", 64, 32, 32, 2, 989e12, 50e9, True),
             ("one rank, float32", 1, 8, 8, 4, 67e12, 32e9, False),
             ("MQA over PCIe", 4, 16, 1, 2, 312e12, 64e9, False)]
    for _ in range(3):
        h = int(2 ** t.rng.integers(0, 7))
        specs.append(("random", int(2 ** t.rng.integers(0, 11)), h, int(2 ** t.rng.integers(0, 7)) % h or h,
                      int(t.rng.choice([2, 4])), float(t.rng.uniform(50e12, 2000e12)),
                      float(t.rng.uniform(10e9, 900e9)), bool(t.rng.integers(0, 2))))
    for label, w, h, hkv, size, peak, bw, causal in specs:
        t.case(label, world_size=w, heads=h, kv_heads=hkv, itemsize=size, peak_flops=peak, bandwidth=bw,
               causal=causal)
        out = t.call(w, h, hkv, size, peak, bw, causal)
        want = model.hiding_length(w, h, hkv, size, peak, bw, causal)
        slips = [(want / w, "That is N / W, the tokens per rank: the question asks for the whole sequence, N = W c."),
                 (want * w, "c = N / W: the tokens per rank are N divided by W, so N = W c, not W^2 c.")]
        if causal:
            slips.append((want / 2, "Under the causal mask (zigzag) a step computes half the FLOPs, so it takes "
                                    "twice the tokens to cover the same transfer."))
        else:
            slips.append((want * 2, "Count both products: Q K^T and P V, 2 c^2 d FLOPs each; and with no mask every "
                                    "step computes the whole block: 4 c^2 d FLOPs per head, no factor 1/2."))
        if h != hkv:
            slips.append((want * h / hkv, "K and V have kv_heads heads, not heads: GQA sends fewer bytes."))
        slips += [(want / 2, "K and V both travel: 2 c d numbers per KV head."),
                  (want * 2, "Count both products: Q K^T and P V, 2 c^2 d FLOPs each, 4 c^2 d per head."),
                  (want * 8, "bandwidth is in bytes per second and itemsize in bytes: no factor of 8.")]
        t.scalar(out, want, "N", tol=1e-9, slips=slips)
