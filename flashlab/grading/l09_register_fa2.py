"""Lesson 09: checkers of its kernel exercises."""
from __future__ import annotations

import math

import numpy as np

from .core import exercise
from .simcheck import kernel_of, launch, not_implemented

LESSON = "09_register_fa2"

@exercise("scores_microtile", lesson=LESSON, time_limit=45,
          hint="Per x: copy your RM values of Q (column x) and RN values of K into local arrays a and b, then "
               "do the RM x RN multiply-adds acc[i, j] += a[i] * b[j] from registers. That is RM + RN shared "
               "reads per x instead of 2 * RM * RN.")
def check_scores_microtile(t, fn):
    if not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    # label, d, block_q, block_k, tr, tc, Nq, Nk
    specs = [("one tile, 2 x 2 per thread", 8, 8, 8, 4, 4, 8, 8),
             ("ragged tails", 8, 8, 8, 4, 4, 13, 11),
             ("4 x 4 per thread", 4, 16, 8, 4, 2, 20, 5),
             ("4 x 2 per thread, ragged", 16, 8, 8, 2, 4, 7, 15)]
    for label, d, bq, bk, tr, tc, nq, nk in specs:
        rm, rn = bq // tr, bk // tc
        Q, K = t.normal((nq, d), np.float32), t.normal((nk, d), np.float32)
        grid = (-(-nq // bq), -(-nk // bk))
        t.case(label, "The last tiles are partial: write only the elements inside S." if nq % bq or nk % bk else None,
               Q=(nq, d), K=(nk, d), block_q=bq, block_k=bk, tr=tr, tc=tc, micro_tile=(rm, rn), grid=grid)
        kernel = kernel_of(t, fn, d, bq, bk, tr, tc)
        scale = np.float32(1 / math.sqrt(d))
        S = np.full((nq, nk), np.nan, np.float32)
        (got,) = launch(t, kernel, grid, tr * tc, [Q, K, S, scale], [2])
        ref = Q.astype(np.float64) @ K.astype(np.float64).T * float(scale)
        t.compare(got, ref, "S", dtype=np.float32)
        log = t.last_log
        if log.active:
            reads, want = log.max_reads_per_thread(), (rm + rn) * d
            if reads > want:
                raise t.fail(f"S is right, but a thread read shared memory {reads} times; with a {rm} x {rn} micro-tile "
                             f"register tiling needs (RM + RN) * d = {want} reads ({2 * rm * rn * d} without reuse)")


IN_REGISTERS = {  # snippet -> (stays in registers?, why)
    "A": (True, "the loop has a constant trip count, so it is unrolled and every index is a constant"),
    "B": (False, "n is a kernel argument: the loop cannot be unrolled, so acc[j] has a run-time index"),
    "C": (False, "t % 4 depends on threadIdx: an index known only at run time needs addressable (local) memory"),
    "D": (True, "R is a Python constant captured when the kernel is built: range(R) unrolls like range(4)"),
    "E": (False, "300 floats per thread exceed the 255 registers a thread can have: the rest spills"),
}


@exercise("in_registers", lesson=LESSON,
          hint="A local array stays in registers only when the compiler can resolve every index to a constant "
               "(loops of compile-time length, fully unrolled) and the array fits in the 255 registers a thread "
               "may use.")
def check_in_registers(t, fn):
    t.case("your answers")
    out = t.call(fn=fn)
    if not isinstance(out, dict):
        raise t.fail(f"return a dict like {{'A': True, 'B': False, ...}}; got {type(out).__name__}")
    missing = sorted(set(IN_REGISTERS) - set(out))
    if missing:
        raise t.fail(f"answer every snippet; missing {', '.join(missing)}")
    for key, (want, why) in IN_REGISTERS.items():
        if not isinstance(out[key], (bool, np.bool_)):
            raise t.fail(f"answer {key} with True or False; got {out[key]!r}")
        if bool(out[key]) != want:
            raise t.fail(f"snippet {key}: you said {bool(out[key])}", hint=f"snippet {key}: {why}.")


