"""Lesson 05, FlashAttention-2: causal block skipping, the FA2 forward with delayed normalisation, and the
work of FA2's grid."""
from __future__ import annotations

import math

import numpy as np

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
          hint="Follow one query block of a small case through its key blocks: after each block, its m_i, l_i and "
               "O_i should describe the softmax of the keys seen so far. The verdict names the first block where "
               "they stop doing so.")
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


def fa2_matmul_flops(Nq, Nk, d, block_q, block_k, causal):
    """Matmul FLOPs of one head's FA2 forward (dv = d): every visited tile, masked entries included, costs
    2 * rows * keys * d for S = Q_i K_j^T and as much for P V_j."""
    visits = visited_k_blocks(Nq, Nk, block_q, block_k, causal)
    return sum(4 * d * (min((i + 1) * block_q, Nq) - i * block_q) * min(v * block_k, Nk) for i, v in enumerate(visits))


@exercise("fa2_work", lesson=LESSON,
          hint="One thread block per (batch, head, query block). It computes every tile it visits in full, "
               "masked entries of the diagonal tiles included: rows of its block x keys of its visited key "
               "blocks, 2 * d FLOPs per score for S = Q K^T and 2 * d for P V.")
def check_fa2_work(t, fn):
    rand = lambda lo, hi: int(t.rng.integers(lo, hi))  # noqa: E731
    # label, B, H, Nq, Nk, d, block_q, block_k, causal
    cases = [("the example", 1, 16, 4096, 4096, 64, 128, 64, True), ("not causal", 2, 8, 1024, 1024, 64, 64, 64, False),
             ("ragged tails", 1, 3, 1000, 1000, 32, 64, 48, True), ("Nq < Nk", 2, 2, 100, 3000, 16, 32, 32, True),
             ("Nq > Nk", 1, 4, 3000, 100, 16, 32, 64, True), ("block_k > block_q", 3, 1, 500, 500, 8, 16, 128, True)]
    cases += [("random", rand(1, 9), rand(1, 33), rand(1, 5000), rand(1, 5000), rand(1, 257), rand(1, 257),
               rand(1, 257), bool(t.rng.random() < 0.75)) for _ in range(6)]
    for label, B, H, nq, nk, d, bq, bk, causal in cases:
        t.case(label, B=B, H=H, Nq=nq, Nk=nk, d=d, block_q=bq, block_k=bk, causal=causal)
        out = t.call(B, H, nq, nk, d, bq, bk, causal)
        if not isinstance(out, tuple) or len(out) != 2:
            raise t.fail(f"return a tuple (thread_blocks, matmul_flops); got {out!r:.80}")
        blocks, flops = out
        tr, tc = math.ceil(nq / bq), math.ceil(nk / bk)
        if isinstance(blocks, (bool, np.bool_)) or not isinstance(blocks, (int, np.integer)):
            raise t.fail(f"thread_blocks should be an int; got {type(blocks).__name__} {blocks!r:.40}")
        if blocks != B * H * tr:
            why = {B * H: "that is FA1's grid, one thread block per (batch, head); FA2 also splits the sequence",
                   B * H * tc: "that counts key blocks; FA2's thread blocks each own a block of queries",
                   tr: "that is for one head; every (batch, head) gets its own thread blocks"}.get(int(blocks))
            raise t.fail(f"thread_blocks is {blocks}; expected {B * H * tr}", **({"hint": why} if why else {}))
        heads = B * H
        ref = heads * fa2_matmul_flops(nq, nk, d, bq, bk, causal)
        visits = visited_k_blocks(nq, nk, bq, bk, causal)
        exact = 4 * d * sum(min(r + 1, nk) for r in range(nq)) if causal else 4 * d * nq * nk
        slips = [(ref / 2, "that counts one matmul; every tile also computes P V, another 2 * d FLOPs per score"),
                 (ref / heads, "that is for one head; multiply by B * H"),
                 (heads * 4 * d * sum(bq * min(v * bk, nk) for v in visits),
                  "that gives the last query block block_q rows; it has only the rows left before Nq"),
                 (heads * 4 * d * sum((min((i + 1) * bq, nq) - i * bq) * v * bk for i, v in enumerate(visits)),
                  "that counts block_k keys in the last key block; it holds only the keys left before Nk")]
        if causal:
            slips += [(heads * exact, "that counts only the scores the mask keeps; the tiles on the diagonal are "
                                      "computed in full, masked entries too"),
                      (heads * 2 * d * nq * nk, "that is half of the full count; FA2 computes the tiles it visits, "
                                                "and the diagonal ones are whole: more than half"),
                      (heads * fa2_matmul_flops(nq, nk, d, bq, bk, False),
                       "that computes every tile; under the causal mask FA2 skips the key blocks a query block "
                       "cannot see")]
        t.scalar(flops, ref, "matmul_flops", tol=1e-12, slips=slips)
