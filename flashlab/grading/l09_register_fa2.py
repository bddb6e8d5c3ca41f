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




ROW_STATS_HINT = ("Each thread sees only RN of its rows' block_k keys. Put your partial max of each row in "
                  "red[tx, row], pass a cuda.syncthreads(), and take the max of the tc partials of the row; then "
                  "the same for the partial sums of exp(s - m_row), after another barrier so no thread overwrites "
                  "a maximum that another thread has not read yet.")


def _thread_columns(bad_cols, rn, tc):
    """The thread columns tx whose keys hold a wrong entry of P."""
    return sorted({int(c) // rn for c in np.flatnonzero(bad_cols)} & set(range(tc)))


@exercise("row_stats", lesson=LESSON, time_limit=45, hint=ROW_STATS_HINT)
def check_row_stats(t, fn):
    if not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    # label, block_q, block_k, tr, tc, Nq, Nk, score scale, hint
    specs = [("one tile, 2 threads per row", 8, 8, 4, 2, 8, 8, 3, None),
             ("fewer keys than block_k, ragged rows", 8, 8, 4, 2, 13, 5, 3,
              "Keys past Nk hold -inf in sc: they must not count, and a thread may have none of its own."),
             ("4 threads per row", 8, 16, 2, 4, 10, 16, 3, None),
             ("threads with no keys at all", 4, 16, 2, 4, 6, 3, 3,
              "Here threads tx = 1, 2, 3 have no keys (all -inf): their partial sums are 0, and m_row must "
              "still be the row's max."),
             ("large scores (~100)", 8, 8, 2, 4, 9, 8, 40,
              "Scores near 100 overflow exp(): take exponents relative to the row's max.")]
    for label, bq, bk, tr, tc, nq, nk, scale, hint in specs:
        rm, rn = bq // tr, bk // tc
        S = t.normal((nq, nk), np.float32, scale, shift=-2.0)
        grid = -(-nq // bq)
        t.case(label, hint, S=(nq, nk), block_q=bq, block_k=bk, tr=tr, tc=tc, micro_tile=(rm, rn), grid=grid)
        kernel = kernel_of(t, fn, bq, bk, tr, tc)
        P, m, l = np.full((nq, nk), np.nan, np.float32), np.full(nq, np.nan, np.float32), np.full(nq, np.nan, np.float32)
        P, m, l = launch(t, kernel, grid, tr * tc, [S, P, m, l], [1, 2, 3])
        S64 = S.astype(np.float64)
        m_ref = S64.max(axis=1)
        E = np.exp(S64 - m_ref[:, None])
        l_ref = E.sum(axis=1)
        own = S64[:, :rn].max(axis=1)  # the max over thread tx = 0's keys alone

        def explain_m(_, own=own):
            if np.allclose(m, own, rtol=1e-5):
                return ["m equals the max over thread tx = 0's own keys (keys 0..RN-1)"], \
                    "every thread holds RN of the row's keys: combine the tc partial maxima of each row through red"
            return [], None

        t.compare(m, m_ref, "m", dtype=np.float32, explain=explain_m)
        t.compare(l, l_ref, "l", dtype=np.float32,
                  explain=lambda _: ([], "m is right; l must add the tc partial sums of the row, each taken "
                                         "relative to the row's m (not the thread's own max)"))

        def explain_p(_, P=P, ref=E / l_ref[:, None], rn=rn, tc=tc):
            bad = _thread_columns(~np.isclose(P, ref, rtol=1e-4, atol=1e-6).all(axis=0), rn, tc)
            good = sorted(set(range(tc)) - set(bad) - {c // rn for c in range(nk, tc * rn)})
            details = [f"P is wrong in the keys of thread column(s) tx = {', '.join(map(str, bad))}"
                       + (f", right in those of tx = {', '.join(map(str, good))}" if good else "")]
            return details, "m and l are right where thread tx = 0 writes them; every thread of the row needs them"

        t.compare(P, E / l_ref[:, None], "P", dtype=np.float32, explain=explain_p)
        log = t.last_log
        if log.active and not any(log.writes.values()):
            raise t.fail("P, m and l are right, but no thread wrote shared memory: in the register kernel the other "
                         "threads' scores are not in global memory; exchange the partial results through red")
