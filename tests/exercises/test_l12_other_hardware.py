"""Lesson 12's exercises (Tenstorrent: causal pairing of query chunks, the reader/compute/writer pipeline, a
core's reads): each checker passes the solution, grades the blank "not implemented", and rejects plausible
wrong solutions with a message and a hint that names the usual slips."""
from exercise_harness import Lesson

LESSON = Lesson("12_other_hardware")
mutant = LESSON.mutant


# -- tt_causal_pairing, tt_pipeline_time -------------------------------------------------------------
for _fn in [
    lambda n, p: [list(range(c * n // p, (c + 1) * n // p)) for c in range(p)],  # consecutive chunks
    lambda n, p: [list(range(c, n, p)) for c in range(p)],  # round robin: close, but not equal
    lambda n, p: [[i for m in range(n // (2 * p)) for i in (2 * (c + m * p), 2 * (c + m * p) + 1)] for c in range(p)],  # neighbours
    lambda n, p: [[i for m in range(n // (2 * p)) for i in (c + m * p, n - (c + m * p))] for c in range(p)],  # off by one
]:
    mutant("tt_causal_pairing")(_fn)

for _fn in [
    lambda tr, tc, tw, n, depth: n * (tr + tc + tw) if depth == 1 else tr + tc + tw + (n - 1) * max(tr, tc, tw),  # one slot: nothing overlaps
    lambda tr, tc, tw, n, depth: tr + tc + tw + (n - 1) * max(tr, tc, tw),  # ignores the depth
    lambda tr, tc, tw, n, depth: n * (tr + tc) if depth == 1 else tr + tc + (n - 1) * max(tr, tc),  # forgets the writer
    lambda tr, tc, tw, n, depth: (tr + tc + tw + (n - 1) * (tc + max(tr, tw)) if depth == 1
                                  else tr + tc + tw + (n - 1) * max(tr, tc)),  # writer never the slowest
    lambda tr, tc, tw, n, depth: (tr + tc + tw + (n - 1) * (tc + max(tr, tw)) if depth != 2
                                  else tr + tc + tw + (n - 1) * max(tr, tc, tw)),  # a third slot treated as one
]:
    mutant("tt_pipeline_time")(_fn)


# -- tt_core_reads -----------------------------------------------------------------------------------
def _reads(count_k, *, with_v=True, with_q=True):
    def reads(chunks, seq, d, q_chunk, k_chunk, causal):
        n_k = seq // k_chunk
        kv = sum(min(n_k, count_k(i, q_chunk, k_chunk)) if causal else n_k for i in chunks)
        return (len(chunks) * q_chunk * d * with_q + (1 + with_v) * kv * k_chunk * d, len(chunks) * q_chunk * d)
    return reads


_right = _reads(lambda i, q, k: ((i + 1) * q - 1) // k + 1)
mutant("tt_core_reads", hint="same length")(
    _reads(lambda i, q, k: i + 1))  # K chunks 0..i: right only when q_chunk == k_chunk
mutant("tt_core_reads")(_reads(lambda i, q, k: (i + 1) * q // k))  # rounds the partly masked K chunk down
mutant("tt_core_reads")(_reads(lambda i, q, k: i * q // k + 1))  # the first row's keys, not the last row's
mutant("tt_core_reads", hint="V_j")(_reads(lambda i, q, k: ((i + 1) * q - 1) // k + 1, with_v=False))  # forgets V
mutant("tt_core_reads")(_reads(lambda i, q, k: ((i + 1) * q - 1) // k + 1, with_q=False))  # forgets the Q chunk
mutant("tt_core_reads")(lambda chunks, seq, d, q, k, causal: (_right(chunks, seq, d, q, k, True)[0],
                                                              len(chunks) * q * d))  # always causal
mutant("tt_core_reads")(lambda chunks, seq, d, q, k, causal: (_right(chunks, seq, d, q, k, causal)[0],
                                                              seq * d))  # writes the whole O


globals().update(LESSON.standard_tests())
