"""Lesson 08: checkers of its kernel exercises."""
from __future__ import annotations

import math

import numpy as np

from .core import exercise
from .simcheck import kernel_of, launch, not_implemented

LESSON = "08_first_flash_kernel"
SKIP = " A block's rows see no key after its last row: the tiles from there on need not be loaded at all."


def _attention_case_specs(t):
    # label, d, block_q, block_k, Nq, Nk, causal, q scale, hint
    from .attention import CAUSAL, HUGE, NQ_NK, RAGGED

    return [
        ("one tile", 8, 8, 8, 8, 8, False, 1, None),
        ("ragged tails", 8, 8, 4, 13, 11, False, 1, RAGGED),
        ("more keys than queries", 16, 4, 8, 5, 29, False, 1, NQ_NK),
        ("causal", 8, 8, 4, 13, 13, True, 1, CAUSAL),
        ("causal, Nq > Nk", 8, 8, 4, 20, 7, True, 1, CAUSAL),
        ("block_k > block_q, causal", 8, 4, 8, 6, 17, True, 1, CAUSAL),
        ("causal, Nq < Nk: tiles to skip", 8, 4, 4, 9, 30, True, 1, CAUSAL + SKIP),
        ("huge logits (scores ~ 1e4)", 8, 8, 4, 9, 10, False, 100, HUGE),
    ]


@exercise("flash_shared_kernel", lesson=LESSON, time_limit=45,
          hint="Loop over the keys c of the tile; per x, read Ks[c, x] once into a local and add its product "
               "with both query rows; then, for each row that may see the key (k0 + c < n_k, and k0 + c <= that "
               "row when causal), the online update of its own m, l and acc; then read each Vs[c, x] once for "
               "both rows. Under the causal mask the walk stops after the tile holding the block's last row.")
def check_flash_shared_kernel(t, fn):
    from .attention import check_forward

    if not_implemented(fn):
        from .core import NotImplementedYet

        raise NotImplementedYet()
    for label, d, bq, bk, nq, nk, causal, qs, hint in _attention_case_specs(t):
        Q, K, V = t.normal((nq, d), np.float32, qs), t.normal((nk, d), np.float32), t.normal((nk, d), np.float32)
        grid, threads = -(-nq // bq), bq // 2
        t.case(label, hint, Q=(nq, d), K=(nk, d), dtype="float32", causal=causal, block_q=bq, block_k=bk,
               grid=grid, threads=threads)
        kernel = kernel_of(t, fn, d, bq, bk, causal)
        scale = np.float32(1 / math.sqrt(d))

        def run(Kp, Vp, kernel=kernel, Q=Q, bq=bq):
            O = np.full(Q.shape, np.nan, np.float32)
            lse = np.full(Q.shape[0], np.nan, np.float32)
            return tuple(launch(t, kernel, -(-Q.shape[0] // bq), bq // 2, [Q, Kp, Vp, O, lse, scale], [3, 4]))

        out = run(K, V)
        log = t.last_log
        check_forward(t, out, Q, K, V, causal, bq, bk, rerun=run)
        if log.active:
            _check_tiles_and_reads(t, log, grid, d, bq, bk, nq, nk, causal)


def _check_tiles_and_reads(t, log, grid, d, bq, bk, nq, nk, causal):
    """Tiles each block loaded (from its shared writes) and shared reads per thread, against the bounds."""
    per_tile = 2 * bk * d  # the given copy writes every element of Ks and Vs once per tile
    for b in range(grid):
        writes = sum(n for (block, _), n in log.writes.items() if block[0] == b)
        tiles = writes // per_tile
        q0 = b * bq
        needed = math.ceil(min(nk, q0 + bq) / bk) if causal else math.ceil(nk / bk)
        if tiles > needed:  # (a block may also load the tiles its rows past n_q would see)
            seen = min(q0 + bq, nq, nk)  # keys 0..seen-1 are all its real rows can see
            raise t.fail(f"O and lse are right, but block {b} loaded {tiles} key tiles, while its rows see only "
                         f"keys 0..{seen - 1} under the causal mask: {math.ceil(seen / bk)} tile(s)",
                         hint="set k_end so that the walk stops after the tile holding the block's last row "
                              "(and never past n_k)")
        reads = [(n, tid) for (block, tid), n in log.reads.items() if block[0] == b]
        if reads:
            most, tid = max(reads)
            if most > tiles * per_tile:
                raise t.fail(f"O and lse are right, but thread {tid} of block {b} read shared memory {most} times "
                             f"for {tiles} tile(s): each element of Ks and Vs needs one read per thread and tile, "
                             f"{per_tile} per tile, used for both rows",
                             hint="read Ks[c, x] (and Vs[c, x]) into a local variable once, then do the "
                                  "multiply-add of each row with it")



# -------------------------------------------------------------------------------- bank conflicts
def _bank_slips(w):
    """(count, diagnosis) of the usual wrong ways to count a warp's shared-memory passes."""
    u = np.unique(w)
    return [
        (int(np.bincount(w % 32, minlength=32).max()), "threads asking for the same word share it (a broadcast): "
                                                       "count different words per bank, not threads"),
        (int(np.bincount(u // 32).max()), "banks interleave: word w is in bank w % 32, not w // 32"),
        (int(np.bincount(np.unique(4 * u) % 32, minlength=32).max()), "the indices are 4-byte words already: "
                                                                     "bank = word % 32, without a factor 4"),
        (int(np.bincount(u % 32, minlength=32).max()) - 1, "return the number of passes, 1 when nothing "
                                                           "conflicts, not the number of extra passes"),
        (int(np.unique(u % 32).size), "count the words asked of the busiest bank, not how many banks are used"),
        (-(-u.size // 32), "the passes depend on how the words fall into banks, not only on how many there are"),
    ]


def _bank_cases(t):
    from ..kernels.register import PREFERRED
    from ..memory_access import register_kernel_stores

    lane = np.arange(32)
    base = int(t.rng.integers(0, 4096))
    d = int(t.rng.choice([16, 32, 64, 128]))
    tile = PREFERRED[d][int(t.rng.integers(0, len(PREFERRED[d])))]
    it = int(t.rng.integers(0, 2))
    k = int(t.rng.integers(2, 31))
    cases = [
        ("consecutive words", base + lane, None),
        ("every other word", base + 2 * lane, None),
        ("every third word", base + 3 * lane, "An odd stride visits all 32 banks before it comes back."),
        ("a column of a 32 x 32 tile", base + 32 * lane, None),
        ("the same column, rows padded to 33 words", base + 33 * lane, None),
        ("all threads read one word", np.full(32, base), "Threads reading the same word share it: a broadcast."),
        ("two words of one bank, 16 threads each", base + 32 * (lane % 2),
         "Count different words per bank, not threads."),
        ("every fourth word", base + 4 * lane, None),
        (f"lesson 09's transposed K tile, no padding (d = {d})",
         base + register_kernel_stores(d, tile, it=it, pad={"Kt": 0})["Kt"], None),
        (f"lesson 09's transposed K tile, padded (d = {d})", base + register_kernel_stores(d, tile, it=it)["Kt"], None),
        ("a partial warp", base + 32 * np.arange(k), "A warp may have fewer than 32 active threads."),
        ("threads in shuffled order", base + 2 * t.rng.permutation(32), "The order of the threads does not matter."),
    ]
    for _ in range(4):
        span = int(t.rng.choice([64, 256, 2048]))
        cases.append(("random words", t.rng.integers(0, span, size=int(t.rng.integers(1, 33))), None))
    return cases


@exercise("bank_conflict_degree", lesson=LESSON,
          hint="Keep each different word once (np.unique), put it in its bank (word % 32), and return the "
               "largest number of words any one bank holds (np.bincount(...).max()).")
def check_bank_conflict_degree(t, fn):
    from ..memory_access import bank_conflict_degree

    cases = _bank_cases(t)
    args = [(np.asarray(w, dtype=np.int64),) for _, w, _ in cases]
    for k, ((label, _, hint), (words,)) in enumerate(zip(cases, args)):
        shown = ", ".join(str(int(x)) for x in words[:6]) + (", ..." if words.size > 6 else "")
        t.case(label, hint, words=f"[{shown}] ({words.size} threads)")
        out = t.call(words.copy())
        if isinstance(out, (bool, np.bool_)) or not isinstance(out, (int, np.integer)):
            raise t.fail(f"return the number of passes as an int; got {type(out).__name__} {out!r:.60}")
        want = bank_conflict_degree(words)
        if int(out) != want:
            why = t.which_slip(args, _bank_slips, k, int(out))
            raise t.fail(f"you returned {int(out)}; the access needs {want} pass{'es' if want > 1 else ''}"
                         + (f": {why}" if why else ""))
