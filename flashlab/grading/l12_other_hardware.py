"""Lesson 12, other hardware: causal load balancing on a grid of cores, the time of a reader/compute/writer
pipeline, and the DRAM traffic of one core."""
from __future__ import annotations

import numpy as np

from .. import tenstorrent as tt
from .core import exercise

LESSON = "12_other_hardware"


@exercise("tt_causal_pairing", lesson=LESSON,
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


@exercise("tt_pipeline_time", lesson=LESSON,
          hint="Follow the slots. One slot per buffer: the reader may fetch chunk j+1 once compute pops chunk j, "
               "and compute may start chunk j+1 once the writer pops chunk j, so reading j+1 overlaps writing j "
               "but neither overlaps compute. Two or more slots: fill, the slowest program's pace, drain.")
def check_tt_pipeline_time(t, fn):
    specs = [("the example, one slot", 1.0, 2.0, 0.5, 5, 1), ("the example, two slots", 1.0, 2.0, 0.5, 5, 2),
             ("the writer is slowest, one slot", 1.0, 1.5, 3.0, 4, 1),
             ("the writer is slowest, two slots", 1.0, 1.5, 3.0, 4, 2),
             ("reading is slowest, two slots", 3.0, 1.0, 2.0, 6, 2), ("one chunk", 1.5, 0.5, 0.7, 1, 1),
             ("three slots", 1.0, 2.0, 0.5, 5, 3)]
    for depth in (1, 2, 1, 2, 3):
        tr, tc, tw = (float(v) for v in t.rng.uniform(0.1, 5.0, 3))
        specs.append(("random", tr, tc, tw, int(t.rng.integers(2, 20)), depth))
    for label, tr, tc, tw, n, depth in specs:
        t.case(label, t_read=tr, t_compute=tc, t_write=tw, n_chunks=n, depth=depth)
        ref = tt.pipeline_time(tr, tc, n, depth, t_write=tw)
        t.scalar(t.call(tr, tc, tw, n, depth), ref, "the time", tol=1e-9, slips=_pipeline_slips(tr, tc, tw, n, depth))


def _pipeline_slips(tr, tc, tw, n, depth):
    """The answers of the usual mistakes, each with what it overlooks."""
    one = tr + tc + tw + (n - 1) * (tc + max(tr, tw))
    two = tr + tc + tw + (n - 1) * max(tr, tc, tw)
    slips = [(n * (tr + tc + tw), "That is nothing overlapped. Even with one slot, the reader may fetch chunk j+1 as "
                                  "soon as compute pops chunk j, while the writer is still writing chunk j."),
             (n * (tr + tc) if depth == 1 else tr + tc + (n - 1) * max(tr, tc),
              "That is the two-program formula of the lesson: the writer is a third program with a buffer of its "
              "own, and it can be the slowest."),
             (n * max(tr, tc, tw), "Filling and draining the pipeline take time: the first chunk must be read and "
                                   "computed before anything is written, the last computed and written after the "
                                   "reader is done."),
             (tr + tc + tw + n * max(tr, tc, tw), "Fill and drain overlap with the steady pace: the first chunk's "
                                                  "slowest step is part of the fill, so the pace counts n - 1 chunks.")]
    if depth == 1:
        slips.append((two, "With one slot per buffer, compute cannot start chunk j+1 until the writer has popped "
                           "chunk j (its output slot is taken), and the reader cannot fetch j+1 until compute pops j."))
    else:
        slips.append((tr + tc + tw + (n - 1) * max(tr, tc), "The pace is set by the slowest of all three programs, "
                                                            "and here that is the writer."))
        slips.append((one, f"With {depth} slots the reader can fetch chunk j+1 while compute works on chunk j, and "
                           "compute can start chunk j+1 while the writer writes chunk j."))
    return slips


@exercise("tt_core_reads", lesson=LESSON,
          hint="For each of the core's Q chunks the reader fetches that Q chunk (q_chunk * d values), then K_j and "
               "V_j (k_chunk * d values each) for every K chunk j it needs. Causal: Q chunk i's last row is "
               "(i + 1) * q_chunk - 1, and it needs every K chunk holding a key at or before that row. The writer "
               "writes one O chunk (q_chunk * d values) per Q chunk.")
def check_tt_core_reads(t, fn):
    specs = [("the example", [0, 7], 2048, 128, 256, 256, True), ("not causal", [1, 2], 1024, 64, 128, 256, False),
             ("K chunks twice as long as Q chunks", [0, 1, 2, 5], 1024, 64, 128, 256, True),
             ("K chunks half as long as Q chunks", [0, 3], 1024, 64, 256, 128, True),
             ("chunk sizes that do not divide each other", [0, 1, 2, 3], 384, 32, 96, 64, True),
             ("one Q chunk of the whole sequence", [0], 512, 16, 512, 128, True)]
    for _ in range(3):
        q_chunk, k_chunk = (32 * int(x) for x in t.rng.integers(1, 9, 2))
        seq = int(np.lcm(q_chunk, k_chunk)) * int(t.rng.integers(1, 4))
        n_q = seq // q_chunk
        chunks = sorted(int(i) for i in t.rng.choice(n_q, size=int(t.rng.integers(1, n_q + 1)), replace=False))
        specs.append(("random", chunks, seq, int(2 ** t.rng.integers(4, 8)), q_chunk, k_chunk, bool(t.rng.random() < 0.8)))
    for label, chunks, seq, d, q_chunk, k_chunk, causal in specs:
        t.case(label, chunks=chunks, seq_len=seq, d=d, q_chunk=q_chunk, k_chunk=k_chunk, causal=causal)
        out = t.call(list(chunks), seq, d, q_chunk, k_chunk, causal)
        if not isinstance(out, (tuple, list, np.ndarray)) or len(out) != 2:
            raise t.fail(f"return a pair (values read, values written); got {out!r:.80}")
        read, written = tt.core_traffic(chunks, seq, d, q_chunk, k_chunk, causal)
        t.scalar(out[0], read, "the values read", tol=1e-12, slips=_reads_slips(chunks, seq, d, q_chunk, k_chunk, causal))
        t.scalar(out[1], written, "the values written", tol=1e-12,
                 slips=[(len(chunks) * (q_chunk + k_chunk) * d, "The writer writes only the output O, one chunk of "
                                                                 "q_chunk rows per Q chunk."),
                        (seq * d, "The writer writes only this core's O chunks, one per Q chunk it owns.")])


def _reads_slips(chunks, seq, d, q_chunk, k_chunk, causal):
    q_part, n_k = len(chunks) * q_chunk * d, seq // k_chunk
    kv = sum(tt.k_chunks_needed(i, n_k, q_chunk, k_chunk, causal) for i in chunks)

    def reads(count):
        return q_part + 2 * sum(min(n_k, max(count(i), 0)) for i in chunks) * k_chunk * d

    slips = [(q_part + kv * k_chunk * d, "Each K/V step reads two chunks: K_j for the scores and V_j for P V_j."),
             (2 * kv * k_chunk * d, "The reader also fetches each Q chunk once, before its K/V loop.")]
    if not causal:
        return slips + [(reads(lambda i: ((i + 1) * q_chunk - 1) // k_chunk + 1),
                         "Without the causal mask every Q chunk reads every K chunk.")]
    return [  # the chunk counts first: they are what this exercise is about
        (q_part + 2 * len(chunks) * n_k * k_chunk * d,
         "Under causal masking Q chunk i skips the K chunks that start after its last row."),
        (reads(lambda i: i + 1), "Q chunk i needs K chunks 0..i only when both have the same length: count the K "
                                 "chunks that hold a key at or before row (i + 1) * q_chunk - 1."),
        (reads(lambda i: (i + 1) * q_chunk // k_chunk), "A K chunk that the causal mask cuts in the middle is still "
                                                        "read whole: round the chunk count up."),
        (reads(lambda i: i * q_chunk // k_chunk + 1), "Q chunk i needs the keys of its LAST row, (i + 1) * q_chunk - 1, "
                                                      "not only those of its first.")] + slips
