"""Lesson 05, FlashAttention-2: causal block skipping, and the FA2 forward with delayed normalisation."""
from __future__ import annotations

import math

from ..iomodel import visited_k_blocks
from .attention import CAUSAL, attention_cases, check_forward, poison_unvisited
from .core import exercise

LESSON = "05_fa2"
SKIP = ("Here the keys after the last query (in blocks no query can see) hold NaN. A causal FA2 never "
        "loads a key block that starts after the last row of the query block.")


@exercise("kv_blocks_to_visit", lesson=LESSON,
          hint="Key block j starts at key j * block_k. Under causal masking it is needed by query block i "
               "as long as some row of block i can see its first key; the last query block may be shorter.")
def check_kv_blocks_to_visit(t, fn):
    cases = [("the example", 16, 16, 4, 4, True), ("not causal", 10, 13, 4, 3, False),
             ("ragged tails", 13, 11, 4, 3, True), ("a short last query block", 10, 20, 4, 2, True),
             ("Nq < Nk", 5, 29, 2, 8, True), ("Nq > Nk", 37, 6, 8, 4, True),
             ("different block sizes", 40, 40, 16, 4, True), ("blocks of one row", 7, 9, 1, 1, True)]
    cases += [("random", *(int(v) for v in t.rng.integers(1, 200, 2)), *(int(v) for v in t.rng.integers(1, 33, 2)),
               True) for _ in range(5)]
    for label, nq, nk, bq, bk, causal in cases:
        want = visited_k_blocks(nq, nk, bq, bk, causal)
        for i in range(math.ceil(nq / bq)):
            t.case(label, CAUSAL if causal else None, i=i, Nq=nq, Nk=nk, block_q=bq, block_k=bk, causal=causal)
            out = t.call(i, nq, nk, bq, bk, causal)
            if isinstance(out, bool) or not isinstance(out, int) and not hasattr(out, "__index__"):
                raise t.fail(f"return an int; got {type(out).__name__} {out!r:.40}")
            if out != want[i]:
                raise t.fail(f"you said {out} key blocks; query block {i} needs {want[i]}")


@exercise("fa2_forward", lesson=LESSON, time_limit=30,
          hint="Outer loop over query blocks, inner over key blocks; keep O_i unnormalised (rescale it by "
               "exp(m_old - m_new) when the max grows) and divide by l_i once, after the inner loop.")
def check_fa2_forward(t, fn):
    for Q, K, V, causal, bq, bk in attention_cases(t, causal=True):
        out = t.call(Q, K, V, causal=causal, block_q=bq, block_k=bk)
        check_forward(t, out, Q, K, V, causal, bq, bk,
                      rerun=lambda Kp, Vp: t.call(Q, Kp, Vp, causal=causal, block_q=bq, block_k=bk))
    # Causal block skipping: keys no query can see hold NaN; they must never reach the output.
    Q, K, V = t.normal((10, 8)), t.normal((27, 8)), t.normal((27, 8))
    K_bad, V_bad, _ = poison_unvisited(K, V, 10, 4)
    t.case("causal block skipping", SKIP, Q=Q.shape, K=K.shape, V=V.shape, dtype="float64", causal=True,
           block_q=4, block_k=4)
    out = t.call(Q, K_bad, V_bad, causal=True, block_q=4, block_k=4)
    check_forward(t, out, Q, K, V, True, 4, 4)
