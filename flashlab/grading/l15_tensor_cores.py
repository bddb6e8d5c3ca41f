"""Lesson 15, tensor cores from Python: the fragment map, a warp's mma from packed registers, the tf32 split,
a 3xTF32 product, the S = Q K^T step of one warp as a Numba kernel (graded in the simulator), where the
backward's dS comes from when dQ needs it as an A fragment, the backward tile's shared memory, and which 16-byte
chunks of a K tile each thread of the forward copies."""
from __future__ import annotations

import numpy as np

from .. import fragments as F
from .core import exercise
from .simcheck import launch, require_kernel

LESSON = "15_tensor_cores"
LAYOUTS = {"f16": ("m16n8k16", "float16"), "tf32": ("m16n8k8", "tf32")}


# ------------------------------------------------------------------------------------- fragment map
def positions(layout, operand, g, t):
    """(32, elements, 2) (row, col) of each lane's elements, from the PTX formulas in g (group) and t
    (lane in the group): the checker's own statement of flashlab.fragments.fragment_map (a test keeps them
    equal), written so that a slip such as swapping g and t can be replayed."""
    g, t = np.asarray(g)[:, None], np.asarray(t)[:, None]
    if operand == "C":
        i = np.arange(4)[None]
        return _stack(g + 8 * (i >= 2), 2 * t + (i & 1))
    if layout == "f16":
        if operand == "A":
            i = np.arange(8)[None]
            return _stack(g + 8 * ((i // 2) % 2), 2 * t + (i & 1) + 8 * (i >= 4))
        i = np.arange(4)[None]
        return _stack(2 * t + (i & 1) + 8 * (i >= 2), g + 0 * i)
    if operand == "A":
        i = np.arange(4)[None]
        return _stack(g + 8 * (i & 1), t + 4 * (i >= 2))
    i = np.arange(2)[None]
    return _stack(t + 4 * i, g + 0 * i)


def _stack(rows, cols):
    rows, cols = np.broadcast_arrays(rows, cols)
    return np.stack([rows, cols], axis=-1).astype(np.int64)


def _position_slips(layout, operand, want):
    lane = np.arange(32)
    slips = [(want[..., ::-1], "row and column are swapped: " + (
        "B is K x N and a lane's B values run down a column (fixed column g, rows from t)" if operand == "B" else
        "the row comes from g (groups of 4 lanes share rows), the column from t"))]
    slips.append((positions(layout, operand, lane % 4, lane // 4),
                  "g and t are swapped: g = lane // 4 is the group (quad) of 4 lanes, t = lane % 4 the place in it"))
    return slips


@exercise("fragment_position", lesson=LESSON,
          hint="g = lane // 4, t = lane % 4. C: c0, c1 at row g, columns 2t and 2t+1; c2, c3 the same 8 rows "
               "lower. Read the rest off the lesson's figures: which cells a lane holds, and in what order.")
def check_fragment_position(t, fn):
    cases = [(layout, op) for layout in ("f16", "tf32") for op in ("C", "A", "B")]
    for layout, operand in cases:
        shape, dtype = LAYOUTS[layout]
        want = F.fragment_map(shape, operand, dtype)
        rows, cols = F.operand_shape(shape, operand)
        n = want.shape[1]
        t.case(f"operand {operand} of mma.{shape}", layout=layout, operand=operand, elements_per_lane=n,
               matrix=f"{rows} x {cols}")
        got = np.full(want.shape, -1, np.int64)
        for lane, i in t.rng.permutation([(L, i) for L in range(32) for i in range(n)]):
            out = t.call(layout, operand, int(lane), int(i))
            if (not isinstance(out, (tuple, list, np.ndarray)) or len(out) != 2
                    or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in out)):
                raise t.fail(f"return a pair of ints (row, col); for lane {lane}, element {i} you returned {out!r:.60}")
            got[lane, i] = [int(x) for x in out]
        if np.array_equal(got, want):
            continue
        outside = np.argwhere((got[..., 0] < 0) | (got[..., 0] >= rows) | (got[..., 1] < 0) | (got[..., 1] >= cols))
        for slip, why in _position_slips(layout, operand, want):
            if np.array_equal(got, slip):
                raise t.fail(f"operand {operand} ({layout}): {why}")
        if len(outside):
            L, i = outside[0]
            raise t.fail(f"lane {L}, element {i}: {_pairs(got[L, i:i + 1])[0]} is outside the {rows} x {cols} "
                         f"matrix {operand}")
        flat = got[..., 0] * cols + got[..., 1]
        values, counts = np.unique(flat, return_counts=True)
        if len(values) < flat.size:
            r, c = divmod(int(values[counts > 1][0]), cols)
            holders = [f"lane {L} element {i}" for L, i in np.argwhere(flat == r * cols + c)[:3]]
            raise t.fail(f"operand {operand} ({layout}): element ({r}, {c}) is held by {' and '.join(holders)}; "
                         f"each element of {operand} is held by exactly one lane")
        if all(set(map(tuple, got[L])) == set(map(tuple, want[L])) for L in range(32)):
            L = next(L for L in range(32) if not np.array_equal(got[L], want[L]))
            raise t.fail(f"operand {operand} ({layout}): every lane holds the right elements, in the wrong order: "
                         f"lane {L} gives {_pairs(got[L])}, PTX's order is {_pairs(want[L])}",
                         hint="The order is the register order: for 16-bit A, elements 2r and 2r+1 share register r "
                              "(neighbours in a row); the +8 rows come before the +8 columns.")
        L, i = np.argwhere(np.any(got != want, axis=-1))[0]
        raise t.fail(f"operand {operand} ({layout}): lane {L} (g = {L // 4}, t = {L % 4}), element {i} is at "
                     f"{_pairs(want[L, i:i + 1])[0]}; you said {_pairs(got[L, i:i + 1])[0]}")


def _pairs(rc):
    return [(int(r), int(c)) for r, c in rc]


# -------------------------------------------------------------------------------------- warp mma
def _registers16(values):
    bits = F.to_bits16(values, "float16")
    return np.ascontiguousarray(F.pack16(bits[:, 0::2], bits[:, 1::2]))


def _exact(a_vals, b_vals, c):
    return F.warp_mma(a_vals, b_vals, c, "m16n8k16", "float16")


@exercise("warp_mma", lesson=LESSON,
          hint="Unpack each register: element 2r is its low 16 bits, 2r+1 its high 16 bits (view uint16 pairs as "
               "float16). Scatter the lanes' elements into A (16 x 16), B (16 x 8) and C (16 x 8) with the fragment "
               "map, compute D = A B + C in float32 or better, and gather D's fragments with C's map.")
def check_warp_mma(t, fn):
    specs = [("C = 0", 1.0, 0.0), ("random A, B, C", 1.0, 1.0), ("C much larger than A B", 1.0, 100.0),
             ("entries up to 100 (float16 holds them)", 30.0, 1.0), ("random again", 1.0, 1.0)]
    for label, scale, c_scale in specs:
        A = F.round_f16(t.normal((16, 16), np.float32, scale))
        B = F.round_f16(t.normal((16, 8), np.float32))
        C = t.normal((16, 8), np.float32, c_scale) if c_scale else np.zeros((16, 8), np.float32)
        a_vals, b_vals = F.to_fragments(A, "m16n8k16", "A"), F.to_fragments(B, "m16n8k16", "B")
        c = np.ascontiguousarray(F.to_fragments(C, "m16n8k16", "C"))
        a, b = _registers16(a_vals), _registers16(b_vals)
        t.case(label, a="(32, 4) uint32", b="(32, 2) uint32", c="(32, 4) float32")
        out = t.call(a, b, c)
        want = _exact(a_vals, b_vals, c).astype(np.float64)

        def explain(got, A=A, B=B, C=C, a_vals=a_vals, b_vals=b_vals, c=c, want=want):
            got = np.asarray(got, np.float64)
            swap = lambda v: v.reshape(32, -1, 2)[..., ::-1].reshape(v.shape)  # noqa: E731
            near = lambda x: np.linalg.norm(got - x) <= 1e-5 * np.linalg.norm(x)  # noqa: E731
            if near(_exact(swap(a_vals), b_vals, c)) or near(_exact(a_vals, swap(b_vals), c)):
                return [], ("The halves of each register are swapped: the lower-indexed element (a0, a2, ...) is in "
                            "the low 16 bits (reg & 0xFFFF), the next one in the high 16 bits (reg >> 16).")
            if near(_exact(a_vals, b_vals, np.zeros_like(c))):
                return [], "D = A B + C: the accumulator C is added (mma's last four operands)."
            if np.allclose(np.sort(got.ravel()), np.sort(want.ravel()), rtol=1e-5, atol=1e-6):
                return [], ("The right numbers in the wrong places: write each lane's d0..d3 from the elements of D "
                            "its C/D fragment holds (rows g and g+8, columns 2t and 2t+1).")
            d16 = F.round_f16(F.round_f16(A) @ F.round_f16(B) + F.round_f16(C)).astype(np.float64)
            if np.linalg.norm(got - F.to_fragments(d16, "m16n8k16", "C")) <= 1e-2 * np.linalg.norm(want):
                return [], ("Close, but rounded like float16: the instruction's accumulator is float32 (the .f32 in "
                            "its name); compute A B + C in float32 or float64.")
            return [], None

        t.compare(out, want, "d (D's fragments)", min_dtype=np.float32, tol=1e-6, explain=explain)


# ------------------------------------------------------------------------------------ the tf32 split
def _tie_values(rng, n):
    """float32 values exactly halfway between two tf32 values (low 13 bits = 0x1000), both signs, plus
    values whose rounding carries into the exponent (mantissa bits all ones)."""
    exp = rng.integers(100, 150, n).astype(np.uint32) << np.uint32(23)
    mant = (rng.integers(0, 1 << 10, n).astype(np.uint32) << np.uint32(13)) | np.uint32(0x1000)
    sign = (rng.integers(0, 2, n).astype(np.uint32) << np.uint32(31))
    ties = (sign | exp | mant).view(np.float32)
    carry = (sign | exp | np.uint32(0x7FFFFF)).view(np.float32)
    return np.concatenate([ties, carry])


def _truncate(x, bits=13):
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32((0xFFFFFFFF << bits) & 0xFFFFFFFF)).view(np.float32)


def _round_even(x):
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = (b + 0xFFF + ((b >> 13) & 1)) & 0xFFFFE000
    return r.astype(np.uint32).view(np.float32)


def _round_bits(x, bits):
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = (b + (1 << (bits - 1))) & ((0xFFFFFFFF << bits) & 0xFFFFFFFF)
    return r.astype(np.uint32).view(np.float32)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    bits = [np.asarray(x).astype(np.float32).view(np.uint32) for x in (a, b)]
    return a.shape == b.shape and np.array_equal(*bits)


@exercise("split_tf32", lesson=LESSON,
          hint="Work on x.view(np.uint32). tf32 keeps the top 10 of float32's 23 stored mantissa bits: the low 13 "
               "go. Rounding to nearest with ties away from zero is 'add half of the dropped range, then clear the "
               "dropped bits' (the sign bit is apart, so negative numbers need no special case). small is x - big, "
               "rounded the same way.")
def check_split_tf32(t, fn):
    specs = [("N(0, 1) values", t.normal(64, np.float32)), ("exact ties and carries into the exponent",
                                                            _tie_values(t.rng, 16)),
             ("tf32 values already (small = 0)", F.round_tf32(t.normal(16, np.float32))),
             ("tiny and huge", np.concatenate([t.normal(8, np.float32, 1e-30), t.normal(8, np.float32, 1e30),
                                               np.zeros(2, np.float32)])),
             ("a matrix", t.normal((5, 7), np.float32, 100.0))]
    for label, x in specs:
        x = np.asarray(x, np.float32)
        t.case(label, x=f"float32 array of shape {x.shape}")
        out = t.call(x.copy())
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise t.fail(f"return a pair (big, small); got {type(out).__name__}")
        big, small = (t.array(o, x.shape, np.float32, name) for o, name in zip(out, ("big", "small")))
        want_big = F.round_tf32(x)
        if not _same(big, want_big):
            if _same(big, _truncate(x)):
                raise t.fail("big is x with its low 13 bits cleared: that truncates (rounds toward zero); "
                             "cvt.rna rounds to the nearest tf32 value")
            if _same(big, _round_even(x)):
                raise t.fail("big rounds ties to even; cvt.rna.tf32 rounds ties away from zero (the 'a' of rna)")
            for bits in (12, 14, 16):
                if _same(big, _round_bits(x, bits)) or _same(big, _truncate(x, bits)):
                    raise t.fail(f"big keeps {23 - bits} of float32's 23 stored mantissa bits; tf32 keeps 10 "
                                 "(drop the low 13)")
            bad = np.flatnonzero(big.view(np.uint32).ravel() != want_big.view(np.uint32).ravel())[0]
            raise t.fail(f"big is wrong: for x = {x.ravel()[bad]!r} (bits {x.view(np.uint32).ravel()[bad]:#010x}) "
                         f"you gave {big.ravel()[bad]!r}, the nearest tf32 value is {want_big.ravel()[bad]!r}")
        want_small = F.round_tf32(x - want_big)
        if not _same(small, want_small):
            if _same(small, x - want_big):
                raise t.fail("small = x - big still has bits below tf32's precision: round it to tf32 as well "
                             "(the tensor core would not see them)")
            if _same(small, _truncate(x - want_big)):
                raise t.fail("small is truncated; round it to nearest, ties away, as big")
            if _same(small, _round_even(x - want_big)):
                raise t.fail("small rounds ties to even (x - big is often exactly halfway: it has only a few more "
                             "bits than tf32); cvt.rna rounds ties away from zero, as for big")
            raise t.fail("small is wrong: it should be x - big, rounded to tf32")


# ------------------------------------------------------------------------------------- 3xTF32 product
class _TensorCore:
    """The mma a learner is given: a @ b + c with a and b read as tf32 (low 13 mantissa bits dropped, as
    flashlab.fragments.warp_mma models the instruction), exact products, one rounding to float32. It records
    whether every operand it was given was a tf32 value already."""

    def __init__(self):
        self.calls, self.not_tf32 = 0, None

    def __call__(self, a, b, c):
        a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
            raise ValueError(f"mma(a, b, c) needs a (m, k), b (k, n), c (m, n); got a {a.shape}, b {b.shape}, "
                             f"c {c.shape}")
        self.calls += 1
        for name, x in (("a", a), ("b", b)):
            x32 = x.astype(np.float32)
            if self.not_tf32 is None and not (np.array_equal(x32, x) and _same(x32, F.truncate_tf32(x32))):
                self.not_tf32 = name
        A, B = (F.truncate_tf32(x.astype(np.float32)).astype(np.float64) for x in (a, b))
        return (A @ B + c.astype(np.float64)).astype(np.float32)


@exercise("matmul_3xtf32", lesson=LESSON,
          hint="Split A and B into tf32 parts (big, small) with your split_tf32, then accumulate the three "
               "products that matter with mma: small x big, big x small, big x big (small x small is below "
               "float32's precision).")
def check_matmul_3xtf32(t, fn):
    specs = [("square", 16, 16, 16, 1.0), ("the inner dimension long", 8, 512, 8, 1.0), ("rectangular", 24, 40, 8, 1.0),
             ("entries around 1e4", 16, 64, 16, 1e4), ("random shape", int(t.rng.integers(1, 33)),
                                                       int(t.rng.integers(1, 200)), int(t.rng.integers(1, 33)), 1.0)]
    for label, m, k, n, scale in specs:
        A, B = t.normal((m, k), np.float32, scale), t.normal((k, n), np.float32)
        t.case(label, A=(m, k), B=(k, n), dtype=np.float32)
        core = _TensorCore()
        out = t.call(A, B, core)
        ref = A.astype(np.float64) @ B.astype(np.float64)
        if core.calls == 0:
            raise t.fail("your function never called mma: compute the products with the tensor core you are given")
        if core.not_tf32:
            raise t.fail(f"mma was given an operand {core.not_tf32} that is not a tf32 value: the tensor core reads "
                         "only tf32's 10 mantissa bits and would drop the rest. Pass big and small parts from "
                         "split_tf32 (both are tf32 values).")

        def explain(got, A=A, B=B):
            (Ab, As), (Bb, Bs) = F.split_tf32(A), F.split_tf32(B)
            f = lambda X, Y: X.astype(np.float64) @ Y.astype(np.float64)  # noqa: E731
            got = np.asarray(got, np.float64)
            named = [(f(Ab, Bb), "only big x big: that is 1xTF32, a single tf32 product (about float16's accuracy)"),
                     (f(Ab, Bb) + f(Ab, Bs), "small(A) x big(B) is missing: both cross terms are needed"),
                     (f(Ab, Bb) + f(As, Bb), "big(A) x small(B) is missing: both cross terms are needed"),
                     (f(Ab, Bb) + f(As, Bs), "you have big x big and small x small; the two cross terms are the ones "
                                              "that matter (small x small is below float32's precision)")]
            errs = [np.linalg.norm(got - x) / np.linalg.norm(x) for x, _ in named]
            best = int(np.argmin(errs))
            return [], (named[best][1] if errs[best] < 1e-6 else None)

        t.compare(out, ref, "A @ B", min_dtype=np.float32, tol=2e-6, explain=explain)


# --------------------------------------------------------------------------- one warp's S = Q K^T
def _s_tile_explain(Q, K, tol):
    """explain(S) for the kernel check: which usual slip the wrong S looks like."""
    Q64, K64 = Q.astype(np.float64), K.astype(np.float64)
    ref = Q64 @ K64.T
    d = Q.shape[1]

    def explain(S):
        S = np.asarray(S, np.float64)
        scale = np.abs(ref).max()
        if np.isnan(S).any():
            rows, cols = np.nonzero(np.isnan(S))
            return [f"S[{r}, {c}] was never written" for r, c in zip(rows[:3], cols[:3])] + [
                "every lane stores its four results c0..c3 of every 8-key n-tile, at the places C's layout gives "
                "them: together the 32 lanes cover all 16 x 8 entries of each n-tile"], None
        if d > 16:
            for ks, what in ((d // 16 - 1, "the last"), (0, "the first")):
                part = Q64[:, 16 * ks:16 * ks + 16] @ K64[:, 16 * ks:16 * ks + 16].T
                if np.abs(S - part).max() <= tol * scale:
                    return [], (f"S holds only {what} k-step's 16 dims: the accumulators c0..c3 must start at 0 once "
                                "per n-tile and carry over all d / 16 k-steps (pass the previous c into each mma).")
        wrong = np.abs(S - ref) > tol * scale
        details = []
        top, bottom = wrong[:8].any(), wrong[8:].any()
        if top != bottom:
            details.append(f"only rows {'0-7' if top else '8-15'} are wrong: look at the registers of rows "
                           f"{'g' if top else 'g + 8'} (a0/a2 or a1/a3, and c0/c1 or c2/c3)")
        even, odd = wrong[:, 0::2].any(), wrong[:, 1::2].any()
        if even != odd:
            details.append(f"only {'even' if even else 'odd'} columns are wrong: c{'0' if even else '1'} and "
                           f"c{'2' if even else '3'} go to columns {'2t' if even else '2t + 1'} of each n-tile")
        tiles = [bool(wrong[:, 8 * n:8 * n + 8].any()) for n in range(S.shape[1] // 8)]
        if any(tiles) and not all(tiles):
            details.append(f"n-tiles {[n for n, w in enumerate(tiles) if w]} (keys 8n to 8n + 7) are wrong, "
                           f"{[n for n, w in enumerate(tiles) if not w]} right")
        if wrong.all():
            details.append("every entry is wrong: check the B registers (K[key 8n + g], words 8ks + t and "
                           "8ks + t + 4) and the A registers (Q rows g and g + 8, words 8ks + t and 8ks + t + 4)")
        return details, None

    return explain


@exercise("s_tile", lesson=LESSON, time_limit=30,
          hint="Use exercise 1's positions, counted in 32-bit words: a register holds columns 2w and 2w + 1 of a "
               "row, which is word w. A is Q: its rows are query rows, and k-step ks is words 8ks to 8ks + 7. B is "
               "Kᵀ: B's columns are the n-tile's 8 keys and B's rows are dims, so a lane's B register is a word of "
               "one row of K. Accumulate c0..c3 over all k-steps of an n-tile, then store them where C's layout "
               "puts them.")
def check_s_tile(t, fn):
    require_kernel(t, fn)
    d_rand, nk_rand = int(t.rng.choice([16, 32, 64])), 8 * int(t.rng.integers(1, 5))
    specs = [("one k-step, one n-tile", 16, 8), ("two k-steps", 32, 16), ("four n-tiles", 16, 32),
             ("d = 64, two n-tiles", 64, 16), ("random", d_rand, nk_rand)]
    for label, d, nk in specs:
        Q = F.round_f16(t.normal((16, d), np.float32))
        K = F.round_f16(t.normal((nk, d), np.float32))
        q = np.ascontiguousarray(F.to_bits16(Q, "float16")).view(np.uint32)
        k = np.ascontiguousarray(F.to_bits16(K, "float16")).view(np.uint32)
        s = np.full((16, nk), np.nan, np.float32)
        t.case(label, d=d, n_keys=nk, q=f"(16, {d // 2}) uint32", k=f"({nk}, {d // 2}) uint32", launch="[1, 32]")
        (got,) = launch(t, fn, 1, 32, [q, k, s], [2])
        ref = Q.astype(np.float64) @ K.astype(np.float64).T
        t.compare(got, ref, "S", dtype=np.float32, tol=1e-5, explain=_s_tile_explain(Q, K, 1e-4))


# ------------------------------------------------------------------------------- the dS transpose
def ds_sources(query_of, key_of, c_of, lane_of=lambda key, col: 4 * (key % 8) + col // 2, gt=lambda L: divmod(L, 4)):
    """(32, 8, 3) (n-tile, lane, c) of every A element of dS, from formulas for the A element's query and key
    (of g, t, i) and for C's register index (of the column within the n-tile and the key): the checker's
    statement of flashlab.viz.tensor.ds_sources (a test keeps them equal), replayable with a slip (lane_of: the
    C holder's lane from its row and column in the n-tile; gt: (g, t) of the A lane)."""
    out = np.zeros((32, 8, 3), np.int64)
    for lane in range(32):
        g, t = gt(lane)
        for i in range(8):
            query, key = query_of(g, t, i), key_of(g, t, i)
            col = query % 8
            out[lane, i] = (query // 8, lane_of(key, col), c_of(col, key))
    return out


RIGHT_DS = dict(query_of=lambda g, t, i: g + 8 * ((i // 2) % 2), key_of=lambda g, t, i: 2 * t + i % 2 + 8 * (i // 4),
                c_of=lambda col, key: col % 2 + 2 * (key // 8))


def _ds_slips(want):
    no_transpose = np.zeros_like(want)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):  # dS[query, key] looked up as if the stored tile were dS itself (rows = queries)
            query, key = RIGHT_DS["query_of"](g, t, i), RIGHT_DS["key_of"](g, t, i)
            no_transpose[lane, i] = (key // 8, 4 * (query % 8) + (key % 8) // 2, key % 2 + 2 * (query // 8))
    return [
        (no_transpose, "you located dS[query, key] in C fragments whose rows are queries: the warp holds dS "
                       "TRANSPOSED (rows = keys), so dS[query, key] is dS^T[key, query]: row = key, column = query"),
        (ds_sources(RIGHT_DS["query_of"], RIGHT_DS["key_of"], lambda col, key: 2 * (col % 2) + key // 8),
         "the C index is wrong: c0 and c1 are neighbouring columns of one row, c2 and c3 the same columns 8 rows "
         "lower"),
        (ds_sources(lambda g, t, i: g + 8 * (i // 4), lambda g, t, i: 2 * t + i % 2 + 8 * ((i // 2) % 2),
                    RIGHT_DS["c_of"]),
         "A's registers are in the wrong order: a2, a3 (register 1) are the rows 8 further down, a4..a7 the keys "
         "8 further right"),
        (ds_sources(**dict(RIGHT_DS, lane_of=lambda key, col: 4 * (col // 2) + key % 8)),
         "the source lane has g and t swapped: the C value at (row, column) of an n-tile is held by lane 4 g + t "
         "with g = row (here the key % 8) and t = column // 2 (here (query % 8) // 2)"),
        (ds_sources(**dict(RIGHT_DS, gt=lambda L: (L % 4, L // 4))),
         "your lane's (g, t) is wrong: g = lane // 4 (the group of 4 lanes sharing a row), t = lane % 4 (its "
         "place in the group)"),
    ]


@exercise("ds_source", lesson=LESSON,
          hint="First say which element of dS lane (g, t) holds as A element i (the A layout of exercise 1: row = "
               "query, column = key). That value is dS^T[key, query]; the warp holds dS^T as two 8-column C "
               "n-tiles: which n-tile is the query in, and which lane and c hold (row = key, column = query % 8)?")
def check_ds_source(t, fn):
    want = ds_sources(**RIGHT_DS)
    t.case("every element of every lane, in random order", lanes=32, elements_per_lane=8)
    got = np.full(want.shape, -1, np.int64)
    for lane, i in t.rng.permutation([(L, i) for L in range(32) for i in range(8)]):
        out = t.call(int(lane), int(i))
        if (not isinstance(out, (tuple, list, np.ndarray)) or len(out) != 3
                or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in out)):
            raise t.fail(f"return three ints (n_tile, source_lane, c); for lane {lane}, element {i} you returned "
                         f"{out!r:.60}")
        got[lane, i] = [max(min(int(x), 2**40), -2**40) for x in out]
    for slip, why in _ds_slips(want):  # before the range check: some slips leave the C fragments
        if np.array_equal(got, slip):
            raise t.fail(why)
    for lane, i in np.ndindex(32, 8):
        n, L, c = got[lane, i]
        if not (0 <= n < 2 and 0 <= L < 32 and 0 <= c < 4):
            raise t.fail(f"lane {lane}, element {i}: ({n}, {L}, {c}) is not a place in the C fragments: n_tile is "
                         "0 or 1, source_lane 0-31, c 0-3")
    if np.array_equal(got, want):
        # and with values: gathering a random dS^T's C fragments by these places gives dS's A fragment
        dS_T = t.normal((16, 16))
        C = np.stack([F.to_fragments(dS_T[:, 8 * n:8 * n + 8], "m16n8k16", "C") for n in range(2)])
        gathered = C[want[..., 0], want[..., 1], want[..., 2]]
        assert np.array_equal(gathered, F.to_fragments(dS_T.T, "m16n8k16", "A")), "the checker's own map is wrong"
        return
    bad = np.argwhere((got != want).any(-1))
    L, i = bad[0]
    raise t.fail(f"{len(bad)} of the 256 places are wrong; e.g. lane {L}, element {i}: you said "
                 f"{tuple(int(x) for x in got[L, i])}, the value is at {tuple(int(x) for x in want[L, i])} "
                 "(n_tile, source_lane, c)")


def _fail_on_slip(t, got, answers, slips):
    """Fail with the diagnosis of the first (keywords, why) slip whose answers(**keywords) are the learner's on
    every case; return when none is."""
    for slip, why in slips:
        if got == answers(**slip):
            raise t.fail(why)


# ------------------------------------------------------------------------------------- backward tile bytes
def tile_words(d, block_q, block_k, stages, v_shared, wide, pad=4, pack_ds=True, stage_stats=True, v_rows=None,
               pack=True):
    """32-bit words of the tensor backward's shared memory (kernels/tensor_backward.BackwardTile.shared_words);
    the keyword arguments turn on one slip each, for the checker's verdicts."""
    row = (d if wide or not pack else d // 2) + pad  # a padded row of K, V, Q or dO
    ds_row = (block_q if wide or not pack_ds else block_q // 2) + pad  # a padded row of dS^T (rows = keys)
    v = v_shared if v_rows is None else v_rows
    return ((2 if v else 1) * block_k * row + 2 * stages * block_q * row + block_k * ds_row
            + 2 * (stages if stage_stats else 1) * block_q)


def _tile_cases(rng):
    """(d, block_q, block_k, stages, v_shared, wide): every combination of the flags, random sizes."""
    cases = []
    for wide in (False, True):
        for v_shared in (False, True):
            for stages in (1, 2):
                for _ in range(3):
                    cases.append((int(rng.choice([16, 32, 64, 128])), 16 * int(rng.integers(1, 5)),
                                  16 * int(rng.integers(1, 9)), stages, v_shared, wide))
    return cases


_TILE_SLIPS = [
    (dict(pad=0), "rows are not padded: every row of K, V, Q, dO and dS^T takes 4 more words (16 bytes), so that "
                  "the 8 rows one ldmatrix reads start in different banks"),
    (dict(pack=False), "16-bit values go two to a 32-bit word: a row of K, V, Q or dO is d / 2 words in 16 bits, d "
                       "words in float32"),
    (dict(pack_ds=False), "dS^T is stored like the inputs: in 16 bits two queries share a word (block_q / 2 words a "
                          "row), in float32 one"),
    (dict(stage_stats=False), "lse_i and D_i have a copy per stage, like Q_i and dO_i: the next tile's are copied "
                              "while this one's are used"),
    (dict(v_rows=True), "V_j is in shared memory only when v_shared; otherwise its fragments stay in registers"),
    (dict(v_rows=False), "with v_shared, V_j takes block_k padded rows in shared memory, like K_j"),
]


@exercise("backward_tile_bytes", lesson=LESSON,
          hint="Add up the regions in 32-bit words, then multiply by 4. A row of K, V, Q or dO holds d values: d / 2 "
               "words in 16 bits, d in float32, plus 4 words of padding. K_j (and V_j with v_shared) has block_k "
               "rows; Q_i and dO_i have block_q rows per stage; dS^T has block_k rows of block_q values (packed "
               "like the inputs) plus 4; lse_i and D_i are block_q floats each, per stage.")
def check_backward_tile_bytes(t, fn):
    cases = _tile_cases(t.rng)
    t.case(f"{len(cases)} tiles: d 16-128, block_q 16-64, block_k 16-128, 1 or 2 stages, V in shared memory or "
           "not, 16-bit or float32")
    got = []
    for d, bq, bk, stages, v_shared, wide in cases:
        out = t.call(d, bq, bk, stages, v_shared, wide)
        if isinstance(out, bool) or not isinstance(out, (int, np.integer)):
            raise t.fail(f"return the bytes as an int; for d={d}, block_q={bq}, block_k={bk} you returned {out!r:.60}")
        got.append(int(out))
    want = [4 * tile_words(*c) for c in cases]
    if got == want:
        return
    if got == [w // 4 for w in want]:
        raise t.fail("you returned 32-bit words; return bytes (4 per word)")
    _fail_on_slip(t, got, lambda **slip: [4 * tile_words(*c, **slip) for c in cases], _TILE_SLIPS)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    d, bq, bk, stages, v_shared, wide = cases[i]
    raise t.fail(f"{sum(g != w for g, w in zip(got, want))} of {len(cases)} tiles are wrong; e.g. d={d}, "
                 f"block_q={bq}, block_k={bk}, stages={stages}, v_shared={v_shared}, wide={wide}: you said {got[i]} "
                 f"bytes, the kernel takes {want[i]}")


# ------------------------------------------------------------------------------------- copy plan
def copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide, pad=4, pack=True, stride=True, chunks_first=True,
              clamp=True):
    """(shared word, source word, bytes) of each 16-byte copy thread `tid` makes of one K tile in the tensor
    forward (kernels/tensor.py, the LINEAR copies); the keyword arguments turn on one slip each."""
    W = d if wide or not pack else d // 2  # 32-bit words in a row of K
    cpr = W // 4  # 16-byte chunks in a row
    if chunks_first:  # consecutive threads take consecutive chunks of a row
        row0, col, step = tid // cpr, 4 * (tid % cpr), threads // cpr
    else:  # consecutive threads take consecutive rows
        rows = threads // cpr
        row0, col, step = tid % rows, 4 * (tid // rows), rows
    out, rs = [], row_stride if stride else W
    for row in range(row0, block_k, step):
        ok = k0 + row < n_k
        out.append((row * (W + pad) + col, (k0 + row) * rs + col if ok or not clamp else k0 * rs + col, 16 if ok else 0))
    return out


def _copy_cases(rng):
    """(threads, d, block_k, k0, n_k, row_stride, wide): contiguous and packed (varlen-like) rows, tiles that
    end inside and past the keys."""
    cases = []
    for wide in (False, True):
        for packed in (False, True):
            for _ in range(4):
                d = int(rng.choice([16, 32, 64, 128]))
                W = d if wide else d // 2
                threads = int(rng.choice([t for t in (32, 64, 128, 256) if t % (W // 4) == 0]))
                block_k = int(rng.choice([16, 32, 64]))
                k0 = block_k * int(rng.integers(0, 4))
                n_k = k0 + int(rng.integers(1, 2 * block_k))
                row_stride = W * (int(rng.integers(2, 9)) if packed else 1)
                cases.append((threads, d, block_k, k0, n_k, row_stride, wide))
    return cases


_COPY_SLIPS = [
    (dict(pad=0), "rows in shared memory are padded by 4 words (16 bytes), so that the 8 rows one ldmatrix reads "
                  "start in different banks: a row starts every d/2 + 4 words (16-bit) or d + 4 (float32)"),
    (dict(pack=False), "16-bit values go two to a 32-bit word: a row of K is d / 2 words in 16 bits, d in float32"),
    (dict(stride=False), "the source's rows are row_stride words apart, not d/2 (or d): in a packed varlen batch the "
                         "other heads' values sit between two rows of this head"),
    (dict(chunks_first=False), "consecutive threads take consecutive 16-byte chunks of one row (so a warp reads "
                               "whole rows, coalesced), then the next rows: row tid // chunks, chunk tid % chunks"),
    (dict(clamp=False), "a row past n_k copies 0 bytes (cp.async writes 16 zero bytes), and its source address "
                        "must still be valid: use the same column of the tile's first row k0, which always exists "
                        "(source word k0 * row_stride + column)"),
]


@exercise("copy_plan", lesson=LESSON,
          hint="A row of K is W = d/2 words (d in float32), so it has W/4 chunks of 16 bytes. Thread tid starts at "
               "row tid // (W/4) and column 4 * (tid % (W/4)), and moves down threads // (W/4) rows per copy while "
               "row < block_k. Shared word: row * (W + 4) + column. Source word: (k0 + row) * row_stride + column "
               "with 16 bytes, or k0 * row_stride + column (the tile's first row) with 0 bytes when k0 + row >= n_k.")
def check_copy_plan(t, fn):
    cases = _copy_cases(t.rng)
    t.case(f"{len(cases)} tiles (d 16-128, 32-256 threads, block_k 16-64, contiguous and packed rows, tiles that "
           "end past n_k), every thread of each")
    got, want, where = [], [], []
    for threads, d, block_k, k0, n_k, row_stride, wide in cases:
        for tid in range(threads):
            out = t.call(tid, threads, d, block_k, k0, n_k, row_stride, wide)
            try:
                out = [tuple(int(x) for x in c) for c in out]
                if any(len(c) != 3 for c in out):
                    raise ValueError
            except (TypeError, ValueError):
                raise t.fail(f"return a list of (shared word, source word, bytes) tuples; for tid={tid} you "
                             f"returned {out!r:.80}") from None
            got.append(out)
            want.append(copy_plan(tid, threads, d, block_k, k0, n_k, row_stride, wide))
            where.append((tid, threads, d, block_k, k0, n_k, row_stride, wide))
    if got == want:
        return
    _fail_on_slip(t, got, lambda **slip: [copy_plan(*w, **slip) for w in where], _COPY_SLIPS)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    tid, threads, d, block_k, k0, n_k, row_stride, wide = where[i]
    raise t.fail(f"{sum(g != w for g, w in zip(got, want))} of {len(got)} threads' plans are wrong; e.g. tid={tid} of "
                 f"{threads}, d={d}, block_k={block_k}, k0={k0}, n_k={n_k}, row_stride={row_stride}, wide={wide}: you "
                 f"said {got[i][:3]}{'...' if len(got[i]) > 3 else ''}, the kernel copies {want[i][:3]}"
                 f"{'...' if len(want[i]) > 3 else ''}")
