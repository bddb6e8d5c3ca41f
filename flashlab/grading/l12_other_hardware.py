"""Lesson 12, other hardware: causal load balancing on a grid of cores, and the double-buffered
reader/compute pipeline."""
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
