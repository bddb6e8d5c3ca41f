"""Lesson 02, naive attention: the three steps, and the HBM traffic they cause."""
from __future__ import annotations


from ..iomodel import formula_traffic
from ..reference import reference_attention
from .attention import attention_cases
from .core import exercise

LESSON = "02_naive_attention"


@exercise("naive_attention", lesson=LESSON,
          hint="Three steps: scores S = Q K^T / sqrt(d), P = softmax of each row of S, O = P V.")
def check_naive_attention(t, fn):
    for Q, K, V, causal, _, _ in attention_cases(t, causal=True, blocks=False):
        out = t.call(Q, K, V, causal=causal)
        o_ref, _ = reference_attention(Q, K, V, causal=causal)
        t.compare(out, o_ref, "O", dtype=Q.dtype)


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
