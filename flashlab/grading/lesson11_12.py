"""Lessons 11 (FA3 ideas) and 12 (other hardware): FP8 block scales, the Hadamard rotation, causal
load balancing on a grid of cores, and the double-buffered reader/compute pipeline."""
from __future__ import annotations

import numpy as np

from .. import fp8
from .. import tenstorrent as tt
from .core import exercise

L11, L12 = "11_fa3_ideas", "12_other_hardware"


@exercise("fp8_block_quantize", lesson=L11,
          hint="For each block of `block` rows: scale = (largest |value| in the block) / 448, codes = "
               "round_e4m3(rows / scale). The last block may be shorter; an all-zero block gets scale 1.")
def check_fp8_block_quantize(t, fn):
    specs = [("the example", 8, 4, 4, 1.0), ("ragged last block", 13, 8, 4, 1.0),
             ("one block bigger than x", 5, 3, 16, 1.0), ("blocks of one row", 6, 4, 1, 1.0),
             ("an outlier", 64, 16, 16, 1.0), ("tiny values", 20, 8, 8, 1e-4), ("huge values", 20, 8, 8, 1e4),
             ("random shape", int(t.rng.integers(1, 90)), int(t.rng.integers(1, 40)), int(t.rng.integers(1, 33)), 1.0)]
    for label, n, d, block, scale in specs:
        x = t.normal((n, d), scale=scale)
        if label == "an outlier":
            x[3, 5] = 300.0
        t.case(label, x=(n, d), block=block)
        _check_quantized(t, t.call(x, block), x, block)
    x = t.normal((12, 4))
    x[4:8] = 0.0
    t.case("an all-zero block", "An all-zero block has amax 0: use scale 1 there, or 0/0 gives NaN.",
           x=(12, 4), block=4)
    _check_quantized(t, t.call(x, 4), x, 4)


def _check_quantized(t, out, x, block):
    if not isinstance(out, tuple) or len(out) != 2:
        raise t.fail(f"return a tuple (codes, scales); got {type(out).__name__}")
    codes, scales = out
    ref_codes, ref_scales = fp8.quantize_e4m3(x, block)
    t.compare(scales, ref_scales, "scales", min_dtype=np.float64, tol=1e-12)
    t.compare(codes, ref_codes, "codes", min_dtype=np.float32, tol=1e-12)


@exercise("fp8_incoherent", lesson=L11,
          hint="M = diag(signs) @ H with H = flashlab.fp8.hadamard(d); return (q @ M, k @ M). "
               "diag(signs) @ H is the same as signs[:, None] * H.")
def check_fp8_incoherent(t, fn):
    for label, nq, nk, d in [("the example", 4, 4, 4), ("Nq != Nk != d", 7, 5, 16), ("d = 1", 3, 2, 1),
                             ("d = 128", 9, 12, 128), ("random", int(t.rng.integers(1, 30)), int(t.rng.integers(1, 30)),
                                                       int(2 ** t.rng.integers(0, 8)))]:
        q, k = t.normal((nq, d)), t.normal((nk, d))
        signs = t.rng.choice([-1.0, 1.0], size=d)
        t.case(label, q=(nq, d), k=(nk, d), signs=(d,))
        out = t.call(q, k, signs)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (q_rotated, k_rotated); got {type(out).__name__}")
        m = signs[:, None] * fp8.hadamard(d)
        qr, kr = t.array(out[0], (nq, d), name="q_rotated"), t.array(out[1], (nk, d), name="k_rotated")
        t.compare(qr @ kr.T, q @ k.T, "(q_rotated) @ (k_rotated).T, which must equal q @ k.T", min_dtype=np.float64)
        t.compare(qr, q @ m, "q_rotated", min_dtype=np.float64)
        t.compare(kr, k @ m, "k_rotated", min_dtype=np.float64)


@exercise("tt_causal_pairing", lesson=L12,
          hint="Core c gets pairs (i, n-1-i): together they see n+1 key chunks, whichever i it is. "
               "Give every core n / (2 * n_cores) such pairs.")
def check_tt_causal_pairing(t, fn):
    specs = [("the example", 16, 8), ("two cores", 8, 2), ("one core", 6, 1), ("one pair per core", 2, 1),
             ("many chunks per core", 48, 4)]
    p = int(t.rng.integers(1, 12))
    specs.append(("random", 2 * p * int(t.rng.integers(1, 6)), p))
    for label, n, cores in specs:
        t.case(label, n_chunks=n, n_cores=cores)
        out = t.call(n, cores)
        if not isinstance(out, (list, tuple)) or len(out) != cores:
            raise t.fail(f"return a list with one list of chunk indices per core ({cores}); got {out!r:.80}")
        try:
            parts = [sorted(int(i) for i in core) for core in out]
        except (TypeError, ValueError):
            raise t.fail(f"each core's entry should be a list of chunk indices; got {out!r:.80}") from None
        flat = sorted(i for core in parts for i in core)
        if flat != list(range(n)):
            missing = sorted(set(range(n)) - set(flat))
            raise t.fail(f"every chunk 0..{n - 1} must go to exactly one core; missing {missing[:5]}, "
                         f"duplicates or strays {sorted(set(i for i in flat if flat.count(i) > 1 or not 0 <= i < n))[:5]}")
        work = [sum(i + 1 for i in core) for core in parts]  # chunk i sees i+1 key chunks
        if len(set(work)) != 1:
            c = int(np.argmax(work))
            raise t.fail(f"the cores' work differs: core {c} sees {max(work)} key chunks, core "
                         f"{int(np.argmin(work))} only {min(work)}")
        for c, core in enumerate(parts):
            if sorted(n - 1 - i for i in core) != core:
                raise t.fail(f"core {c} holds {core}: its chunks should come in pairs (i, {n - 1} - i)")


@exercise("tt_pipeline_time", lesson=L12,
          hint="1 slot: the reader cannot fetch chunk j+1 until compute frees the slot, so nothing overlaps. "
               "2 slots: fill (one read), then the slower stage sets the pace, then drain (one compute).")
def check_tt_pipeline_time(t, fn):
    specs = [("the example", 1.0, 2.0, 5, 1), ("the example, double-buffered", 1.0, 2.0, 5, 2),
             ("reading is slower", 3.0, 2.0, 6, 2), ("equal stages", 2.0, 2.0, 4, 2), ("one chunk", 1.5, 0.5, 1, 2),
             ("one chunk, one slot", 1.5, 0.5, 1, 1), ("reading is slower, one slot", 3.0, 1.0, 4, 1)]
    for _ in range(4):
        tr, tc = (float(v) for v in t.rng.uniform(0.1, 5.0, 2))
        specs.append(("random", tr, tc, int(t.rng.integers(1, 20)), int(t.rng.integers(1, 3))))
    for label, tr, tc, n, depth in specs:
        t.case(label, t_read=tr, t_compute=tc, n_chunks=n, depth=depth)
        t.scalar(t.call(tr, tc, n, depth), tt.pipeline_time(tr, tc, n, depth), "the time", tol=1e-9)
