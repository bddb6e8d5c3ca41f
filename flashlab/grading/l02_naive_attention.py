"""Lesson 02, naive attention: the three steps, the HBM traffic they cause, the memory they hold."""
from __future__ import annotations

import numpy as np

from ..iomodel import formula_traffic
from ..reference import reference_attention
from .attention import attention_cases, forward_slips, matching_slip
from .core import exercise, tolerance

LESSON = "02_naive_attention"
FLOAT32_MATH = ("float16 keeps about 3 decimal digits, and every step computed in it (S, exp, the row sums, P V) "
                "rounds to that. Compute in float32 (Q.astype(np.float32), ...) and cast only O back to float16.")


@exercise("naive_attention", lesson=LESSON,
          hint="Three steps: scores S = Q K^T / sqrt(d), P = softmax of each row of S, O = P V.")
def check_naive_attention(t, fn):
    for Q, K, V, causal, _, _ in attention_cases(t, causal=True, blocks=False):
        out = t.call(Q, K, V, causal=causal)
        o_ref, _ = reference_attention(Q, K, V, causal=causal)
        slips = [(hint, lambda f=f: f()[:1]) for hint, f in forward_slips(Q, K, V, causal)]
        t.compare(out, o_ref, "O", dtype=Q.dtype,
                  explain=lambda o: ([], matching_slip((o,), (o_ref,), slips, tolerance(Q.dtype))))
    # float16 inputs computed in float16: with 1024 keys and scores of about 12, S, the exponentials, the row sums
    # and P V each keep 3 decimal digits, and O is 1.6e-3 to 4e-3 off. Computed in float32, O is off by its
    # last rounding to float16 alone, at most half a float16 ulp (4.9e-4); the tolerance sits between the two.
    Q, K, V = t.normal((32, 128), np.float16, 12), t.normal((1024, 128), np.float16), t.normal((1024, 128), np.float16)
    t.case("float16, 1024 keys, scores of about 12", FLOAT32_MATH, Q=Q.shape, K=K.shape, V=V.shape, dtype="float16")
    t.compare(t.call(Q, K, V, causal=False), reference_attention(Q, K, V)[0], "O", dtype=np.float16,
              tol=float(np.finfo(np.float16).eps))


@exercise("naive_hbm_bytes", lesson=LESSON,
          hint="Each of the three steps is its own kernel: it reads every input from HBM and writes its "
               "output back. S and P are Nq x Nk each.")
def check_naive_hbm_bytes(t, fn):
    cases = [("the example", 1024, 1024, 64, 2), ("Nq != Nk", 100, 3000, 32, 2)]
    cases += [("random sizes", *(int(v) for v in t.rng.integers(1, 5000, 2)), int(t.rng.integers(1, 256)),
               int(t.rng.choice([2, 4, 8]))) for _ in range(6)]
    for label, nq, nk, d, b in cases:
        t.case(label, Nq=nq, Nk=nk, d=d, bytes_per_element=b)
        traffic = formula_traffic("naive", nq, nk, d)
        t.scalar(t.call(nq, nk, d, b), b * (traffic["read"] + traffic["write"]), "the byte count")


def naive_peak_elements(Nq, Nk, d, dv):
    """Elements allocated at once, per head, at the busiest step of the three-kernel naive forward.

    Q, K, V stay allocated; step 2 (softmax) holds S and P, step 3 (P V) holds P and O, S freed.
    """
    return Nq * d + Nk * d + Nk * dv + Nq * Nk + max(Nq * Nk, Nq * dv)


@exercise("naive_peak_bytes", lesson=LESSON,
          hint="Write down what is allocated while each step runs: the inputs all along; S from step 1 to the end "
               "of step 2; P from step 2 to the end of step 3; O from step 3 on. The peak is the largest of the "
               "three totals, for all B * H heads, in bytes.")
def check_naive_peak_bytes(t, fn):
    f16, f32, f64 = (np.dtype(x) for x in ("float16", "float32", "float64"))
    cases = [("the lesson's example", 1, 1, 65536, 65536, 64, 64, f16), ("a batch of heads", 8, 16, 2048, 2048, 64, 64, f32),
             ("Nq != Nk", 2, 4, 100, 3000, 32, 32, f16), ("few keys, wide values (Nk < dv)", 4, 8, 512, 16, 64, 128, f32),
             ("one query, a long cache", 3, 5, 1, 4096, 128, 128, f64)]
    rand = lambda lo, hi: int(t.rng.integers(lo, hi))  # noqa: E731
    cases += [("random sizes", rand(1, 17), rand(1, 65), rand(1, 8193), rand(1, 8193), rand(1, 257), rand(1, 257),
               [f16, f32, f64][rand(0, 3)]) for _ in range(6)]
    for label, B, H, nq, nk, d, dv, dtype in cases:
        t.case(label, B=B, H=H, Nq=nq, Nk=nk, d=d, dv=dv, dtype=dtype)
        heads, b = B * H, dtype.itemsize
        inputs = nq * d + nk * d + nk * dv
        slips = [(heads * b * 2 * nq * nk, "that counts S and P alone; Q, K and V stay allocated all along (the "
                                           "caller holds them), and step 3 adds O"),
                 (heads * b * (inputs + 2 * nq * nk + nq * dv), "that keeps S, P and O alive together; S can be freed "
                                                                "as soon as step 2 has read it, before O exists"),
                 (heads * b * (inputs + 2 * nq * nk), "that is the total while step 2 runs; here Nk < dv, so step 3 "
                                                      "holds more: P and the output O (Nq x dv) outweigh S and P"),
                 (b * naive_peak_elements(nq, nk, d, dv), "that is for one head; the batch has B * H of them"),
                 (heads * naive_peak_elements(nq, nk, d, dv), "that counts elements; multiply by the bytes of one "
                                                              "element, dtype.itemsize"),
                 (heads * 4 * naive_peak_elements(nq, nk, d, dv), "that assumes 4-byte elements; use dtype.itemsize"),
                 (heads * b * naive_peak_elements(nq, nk, d, d), "that gives V and O width d; here they have width dv")]
        t.scalar(t.call(B, H, nq, nk, d, dv, dtype), heads * b * naive_peak_elements(nq, nk, d, dv), "the peak in bytes",
                 tol=1e-12, slips=slips)
