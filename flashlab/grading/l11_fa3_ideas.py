"""Lesson 11, FA3 ideas: FP8 block scales, the Hadamard rotation, and the time of one warpgroup's loop
with and without GEMM-softmax overlap."""
from __future__ import annotations

import numpy as np

from .. import fp8, timeline
from .core import exercise

LESSON = "11_fa3_ideas"


@exercise("fp8_block_quantize", lesson=LESSON,
          hint="Dividing a block by its scale maps the block's largest |value|, amax, to amax / scale: nothing is "
               "clipped while that stays at most 448, and the codes are largest when it is exactly 448. Then "
               "codes = round_e4m3(block / scale). An all-zero block gets scale 1.")
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
    if np.shape(scales) != ref_scales.shape:
        raise t.fail(f"scales has shape {np.shape(scales)}; expected {ref_scales.shape}, one scale per block of "
                     f"{block} rows (the last block may be shorter)",
                     hint="There are ceil(N / block) blocks: the last one holds the leftover rows, and it needs a "
                          "scale too.")
    t.compare(scales, ref_scales, "scales", min_dtype=np.float64, tol=1e-12,
              explain=lambda s: _explain_scales(np.asarray(s, np.float64), x, ref_scales))
    rows = np.repeat(ref_scales, block)[: x.shape[0], None]  # each row's scale
    t.compare(codes, ref_codes, "codes", min_dtype=np.float32, tol=1e-12,
              explain=lambda c: _explain_codes(np.asarray(c, np.float64), x / rows, ref_codes, rows))


def _explain_scales(s, x, ref):
    bad = np.flatnonzero(~np.isclose(s, ref, rtol=1e-12, atol=0))
    details = [f"block {b}: scale {s[b]:.6g}, expected {ref[b]:.6g}" for b in bad[:3]]
    if np.allclose(s, ref * fp8.E4M3_MAX, rtol=1e-9):
        return details, ("Your scales map each block's largest |value| to 1, but e4m3 reaches 448: the scaled "
                         "values then sit far down the format, where small ones become subnormal or zero.")
    if np.allclose(s, np.abs(x).max() / fp8.E4M3_MAX, rtol=1e-9):
        return details, ("That is one scale for the whole tensor. Each block needs its own, from its own largest "
                         "value, or one outlier squeezes every other block towards zero.")
    if (s[bad] < ref[bad]).all():
        return details, ("These scales are too small: the block's largest value, divided by them, exceeds 448 "
                         "and saturates.")
    if (s[bad] > ref[bad]).all():
        return details, ("These scales are larger than needed: nothing saturates, but every code is smaller than "
                         "it could be, closer to e4m3's subnormals. Take the smallest scale that avoids saturation.")
    return details, None


def _explain_codes(c, scaled, ref, rows):
    if np.allclose(c, scaled, rtol=1e-12):
        return [], "These are the scaled values, not yet rounded: round them to the e4m3 grid with round_e4m3."
    if np.allclose(c, np.round(scaled), rtol=1e-12):
        return [], ("np.round rounds to integers; e4m3 has 8 values per power of two, so round with round_e4m3.")
    if np.allclose(c, ref * rows, rtol=1e-12):
        return [], "Return the codes themselves (the e4m3 values), not codes * scale: the caller keeps both."
    return [], None


@exercise("fp8_incoherent", lesson=LESSON,
          hint="Double H from [[1]] until it is d x d; its rows have length sqrt(d), so divide by sqrt(d) to make it "
               "orthogonal. Flipping coordinate i before mixing multiplies row i of H by signs[i]: "
               "M = signs[:, None] * H. Rotate q and k by the same M.")
def check_fp8_incoherent(t, fn):
    for label, nq, nk, d in [("the example", 4, 4, 4), ("Nq != Nk != d", 7, 5, 16), ("d = 1", 3, 2, 1),
                             ("d = 128", 9, 12, 128), ("random", int(t.rng.integers(1, 30)), int(t.rng.integers(1, 30)),
                                                       int(2 ** t.rng.integers(0, 8)))]:
        q, k = t.normal((nq, d)), t.normal((nk, d))
        signs = t.rng.choice([-1.0, 1.0], size=d)
        if d > 1:  # both signs present, or "the signs are missing" could not be told apart from all +1
            signs[:2] = t.rng.permutation([-1.0, 1.0])
        t.case(label, q=(nq, d), k=(nk, d), signs=(d,))
        out = t.call(q, k, signs)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (q_rotated, k_rotated); got {type(out).__name__}")
        h = fp8.hadamard(d)
        m = signs[:, None] * h
        qr, kr = t.array(out[0], (nq, d), name="q_rotated"), t.array(out[1], (nk, d), name="k_rotated")
        if d > 1 and np.allclose(qr @ kr.T, d * (q @ k.T)):
            raise t.fail("the scores came out d times too large: your M is not orthogonal",
                         hint="Every row of the doubled Hadamard matrix has length sqrt(d): divide it by sqrt(d).")
        t.compare(qr @ kr.T, q @ k.T, "(q_rotated) @ (k_rotated).T, which must equal q @ k.T", min_dtype=np.float64)
        if d > 1 and np.allclose(qr, q @ h) and not np.allclose(qr, q @ m):
            raise t.fail("q_rotated is q @ H: the random signs are missing",
                         hint="Multiply coordinate i by signs[i] before mixing: M = signs[:, None] * H.")
        if d > 1 and np.allclose(qr, q @ (h * signs[None, :])) and not np.allclose(qr, q @ m):
            raise t.fail("the signs flip the mixed coordinates (H @ diag(signs)); FA3 flips the input coordinates "
                         "before mixing", hint="Flipping coordinate i of the input multiplies row i of H: "
                         "signs[:, None] * H.")
        t.compare(qr, q @ m, "q_rotated", min_dtype=np.float64)
        t.compare(kr, k @ m, "k_rotated", min_dtype=np.float64)


@exercise("fa3_loop_time", lesson=LESSON,
          hint="In order, each block costs 2 t_gemm + t_softmax. Pipelined: before the loop QK_0 and softmax_0 run "
               "alone; each iteration j >= 1 runs QK_j, then softmax_j beside PV_{j-1} (the next QK waits for "
               "softmax_j); after the loop PV_{n-1} runs alone.")
def check_fa3_loop_time(t, fn):
    specs = [("the example, in order", 1.0, 2.0, 3, False), ("the example, pipelined", 1.0, 2.0, 3, True),
             ("equal costs", 1.0, 1.0, 4, True), ("softmax faster than a GEMM", 2.0, 0.5, 5, True),
             ("one block", 1.0, 3.0, 1, True), ("two blocks", 1.5, 1.0, 2, True)]
    for overlap in (False, True, True, True):
        g, s = (float(v) for v in t.rng.uniform(0.1, 4.0, 2))
        specs.append(("random", g, s, int(t.rng.integers(3, 40)), overlap))
    for label, g, s, n, overlap in specs:
        t.case(label, t_gemm=g, t_softmax=s, n_blocks=n, overlap=overlap)
        t.scalar(t.call(g, s, n, overlap), loop_time(g, s, n, overlap), "the time", tol=1e-9,
                 slips=_loop_slips(g, s, n, overlap))


def loop_time(t_gemm, t_softmax, n_blocks, overlap):
    """One consumer warpgroup, loads hidden by the producer: timeline's model without pingpong treats the two
    warpgroups as one doing twice the work per job, so halve the costs to get one warpgroup."""
    return timeline.fa3_schedule(n_blocks, t_load=0.0, t_gemm=t_gemm / 2, t_softmax=t_softmax / 2,
                                 warp_specialized=True, pingpong=False, intra_overlap=overlap).makespan


def _loop_slips(g, s, n, overlap):
    in_order = n * (2 * g + s)
    step = g + max(g, s)
    busiest = ("is the busiest unit's time, which only perfect overlap reaches (pingpong, with a second warpgroup). "
               "One warpgroup's softmax_j must wait for QK_j, and QK_{j+1} for softmax_j: see what each iteration "
               "waits for.")
    slips = []
    if overlap:  # first, as n * step equals the busiest unit's time whenever t_gemm >= t_softmax
        slips += [(in_order, "That is the in-order time: with overlap=True, softmax_j runs while the tensor cores "
                             "do PV_{j-1}."),
                  (n * step, "Before the loop, QK_0 and softmax_0 run with nothing beside them, and after it PV_{n-1} "
                             "runs alone: the first and last block cost more than the steady pace."),
                  (g + s + (n - 1) * step, "After the loop, PV_{n-1} still has to run.")]
    else:
        slips.append((2 * g + s + (n - 1) * step, "overlap=False runs each block in program order: QK_j, softmax_j, "
                                                  "PV_j, with nothing beside them."))
    slips += [(n * max(2 * g, s), "n * max(2 t_gemm, t_softmax) " + busiest),
              (2 * g + s + (n - 1) * max(2 * g, s), "(n - 1) * max(2 t_gemm, t_softmax) per block " + busiest),
              (in_order - (n - 1) * s, "softmax_j overlaps one GEMM (PV_{j-1}), not both: QK_j must finish before "
                                       "softmax_j can start.")]
    return slips
