"""Lesson 11, FA3 ideas: FP8 block scales and the Hadamard rotation."""
from __future__ import annotations

import numpy as np

from .. import fp8
from .core import exercise

LESSON = "11_fa3_ideas"


@exercise("fp8_block_quantize", lesson=LESSON,
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


@exercise("fp8_incoherent", lesson=LESSON,
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
