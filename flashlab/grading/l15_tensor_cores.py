"""Lesson 15, tensor cores, the instruction: the fragment map, a warp's mma from packed registers, the tf32 split,
a 3xTF32 product, one k-step of a tensor core's truncating accumulation bit for bit (Fasi, Higham, Mikaitis and
Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ Computer Science 2021), and the row address each lane
gives ldmatrix.x4."""
from __future__ import annotations

import numpy as np

from .. import fragments as F
from .core import exercise, int_answers, judge_answers

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
        a, b = F.registers16(a_vals), F.registers16(b_vals)
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


# ------------------------------------------------------------------------------------- ldmatrix addresses
def ldmatrix_address(lane, row_stride, *, order="A", row_of=lambda lane: lane % 8, col_bytes=2, matrices=True):
    """Byte offset, from the tile's first element, of the 16-byte row lane `lane` gives ldmatrix.x4 so that its
    four 8 x 8 matrices are the A fragment of a 16 x 16 tile of 16-bit values stored row-major `row_stride` bytes
    apart: lanes 8i to 8i + 7 point at the rows of matrix i, and matrix i lands in register i (a_2i, a_2i+1), so
    matrix 1 is rows 8-15 of columns 0-7 and matrix 2 rows 0-7 of columns 8-15. Keywords replay slips."""
    matrix = lane // 8 if matrices else 0
    down, right = (matrix % 2, matrix // 2) if order == "A" else (matrix // 2, matrix % 2)
    return (row_of(lane) + 8 * down) * row_stride + 8 * right * col_bytes


_LDMATRIX_SLIPS = [
    (dict(order="rows first"), "matrices 1 and 2 are swapped: register 1 holds a2, a3, which are rows 8-15 of the "
                               "FIRST 8 columns, so matrix 1 (lanes 8-15) is rows 8-15, and matrix 2 (lanes 16-23) "
                               "rows 0-7 of columns 8-15"),
    (dict(col_bytes=1), "a column is a 16-bit value, 2 bytes: the second 8 columns start 16 bytes into the row"),
    (dict(row_of=lambda lane: lane // 4), "the lane numbers rows as in a fragment (g = lane // 4); for ldmatrix's "
                                          "addresses, lane 8i + r points at row r of matrix i"),
    (dict(matrices=False), "every lane points into matrix 0: lanes 8-31 must give the rows of matrices 1 to 3"),
]


@exercise("ldmatrix_address", lesson=LESSON,
          hint="Lane L points at row r = L % 8 of matrix i = L // 8. Matrix i becomes register i of every lane, which "
               "holds A elements 2i and 2i + 1; read off the A layout which 8 x 8 block of the tile those are, then "
               "turn (row, first column) into bytes: row * row_stride + column * 2.")
def check_ldmatrix_address(t, fn):
    strides = [32, 48, 144, 256, int(16 * t.rng.integers(3, 20))]
    t.case(f"every lane, row strides {strides} bytes")
    cases = [(lane, stride) for stride in strides for lane in range(32)]
    got = int_answers(t, cases)
    judge_answers(t, got, lambda **slip: [ldmatrix_address(*c, **slip) for c in cases], _LDMATRIX_SLIPS,
                  lambda i, want: f"lane {cases[i][0]}, row_stride {cases[i][1]}: you said byte {got[i]}; it must "
                                  f"point at row {cases[i][0] % 8 + 8 * (cases[i][0] // 8 % 2)}, column "
                                  f"{8 * (cases[i][0] // 16)}: byte {want}")


# ----------------------------------------------------------------------- a tensor core's truncating sum
def exponent(x):
    """e with 2**e <= |x| < 2**(e + 1), elementwise (exact, from frexp); 0 where x is 0."""
    m, e = np.frexp(np.asarray(x, np.float64))
    return np.where(m != 0, e - 1, 0)


def cut(x, e, bits=24, rounding=np.trunc):
    """x cut to a multiple of 2**(e - bits + 1): the bits a `bits`-bit significand whose leading bit has weight
    2**e keeps, the rest dropped toward zero (rounding=np.trunc)."""
    q = np.ldexp(1.0, np.asarray(e) - bits + 1)
    return rounding(np.asarray(x, np.float64) / q) * q


def tc_model(a, b, c, *, align="largest", cut_terms=True, final="cut", bits=24, rounding=np.trunc):
    """D = A B + C for one k-step as the model of the exercise forms each D[i, j]: the k exact products and c are
    the terms; each is cut toward zero to a multiple of 2**(e - 23), e the exponent of the largest term (no guard
    bits); the cut terms are added exactly; the sum is cut toward zero to 24 significant bits. The keywords
    replay one slip each: align ("c", "products", "sum"), cut_terms=False, final="nearest", bits,
    rounding."""
    a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
    products = a[:, :, None] * b[None, :, :]  # (m, k, n), exact for tf32 and 16-bit inputs
    terms = np.concatenate([c[:, None, :], products], axis=1)
    if align == "largest":
        e = exponent(np.abs(terms).max(axis=1))
    elif align == "c":
        e = exponent(c)
    elif align == "products":
        e = exponent(np.abs(products).max(axis=1))
    else:  # the exact sum's
        e = exponent(terms.sum(axis=1))
    total = (cut(terms, e[:, None, :], bits, rounding) if cut_terms else terms).sum(axis=1)
    if final == "nearest":
        return total.astype(np.float32)
    return cut(total, exponent(total), bits, rounding).astype(np.float32)


def _fp32_chain(a, b, c):
    """c plus each product in turn, one float32 rounding per add (the FP32 units' way)."""
    acc = np.asarray(c, np.float32).copy()
    for k in range(a.shape[1]):
        acc = (acc.astype(np.float64) + a[:, k:k + 1].astype(np.float64) * b[k:k + 1].astype(np.float64)
               ).astype(np.float32)
    return acc


_TC_SLIPS = [
    (lambda a, b, c: (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32),
     "that is the exact sum rounded once to nearest, as IEEE would; the model cuts toward zero, twice: each term "
     "at the largest term's last bit, then the sum"),
    (_fp32_chain, "you added the products one at a time in float32, rounding to nearest each time (the FP32 units' "
                  "way); the model adds all terms at once, cut toward zero"),
    (lambda a, b, c: tc_model(a, b, c, cut_terms=False),
     "you truncated only the final sum: first each term is cut at the largest term's 24-bit grid (the tensor core "
     "keeps no guard bits), then the sum"),
    (lambda a, b, c: tc_model(a, b, c, final="nearest"),
     "the terms are cut right, but the sum is rounded to nearest (astype(np.float32) rounds); cut it toward zero "
     "to 24 significant bits as well"),
    (lambda a, b, c: tc_model(a, b, c, align="c"),
     "you aligned the terms to c's exponent; align them to the largest of all the terms (c and the products)"),
    (lambda a, b, c: tc_model(a, b, c, align="products"),
     "you aligned the terms to the largest product; c is a term too: align to the largest of c and the products"),
    (lambda a, b, c: tc_model(a, b, c, align="sum"),
     "you aligned the terms to the sum's exponent; the hardware aligns them before it adds, to the largest term"),
    (lambda a, b, c: tc_model(a, b, c, rounding=np.floor),
     "negative values are cut toward minus infinity (floor); the model cuts toward zero (np.trunc) for both signs"),
    (lambda a, b, c: tc_model(a, b, c, rounding=np.rint),
     "you rounded each cut to nearest (np.rint or np.round); the model truncates: np.trunc, toward zero, for the "
     "terms and for the sum"),
    (lambda a, b, c: tc_model(a, b, c, bits=23),
     "you kept 23 significant bits; float32 has 24 (23 stored and the implicit leading 1): cut to multiples of "
     "2**(e - 23)"),
    (lambda a, b, c: tc_model(a, b, c, bits=25),
     "you kept 25 significant bits; float32 has 24: cut to multiples of 2**(e - 23)"),
]


def _tf32(x):
    return F.round_tf32(np.asarray(x, np.float32))


def _tc_cases(t):
    """(label, a, b, c): random, and inputs that tell the slips apart."""
    m, n, k = 16, 8, 8
    cases = [("random tf32 A, B and float32 C", _tf32(t.normal((m, k))), _tf32(t.normal((k, n))),
              t.normal((m, n), np.float32))]
    cases.append(("C much larger than the products (their low bits are cut)", _tf32(t.normal((m, k))),
                  _tf32(t.normal((k, n), scale=2.0 ** -8)), t.normal((m, n), np.float32, 2.0 ** 10)))
    cases.append(("products much larger than C", _tf32(t.normal((m, k), scale=64.0)), _tf32(t.normal((k, n))),
                  t.normal((m, n), np.float32, 2.0 ** -12)))
    a, b = _tf32(t.normal((m, k))), _tf32(t.normal((k, n)))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    cases.append(("C almost cancels A B (the result is small)", a, b,
                  (-exact + t.normal((m, n), scale=2.0 ** -16)).astype(np.float32)))
    cases.append(("all terms positive, near one power of two (the sum carries)",
                  _tf32(1.0 + t.rng.random((m, k))), _tf32(1.0 + t.rng.random((k, n))),
                  (1.0 + t.rng.random((m, n))).astype(np.float32)))
    cases.append(("all terms negative", _tf32(-(1.0 + t.rng.random((m, k)))), _tf32(1.0 + t.rng.random((k, n))),
                  (-(1.0 + t.rng.random((m, n)))).astype(np.float32)))
    spread = np.ldexp(1.0, t.rng.integers(-20, 21, (m, k)))
    cases.append(("entries from 2**-20 to 2**20", _tf32(t.normal((m, k)) * spread), _tf32(t.normal((k, n))),
                  t.normal((m, n), np.float32)))
    a = _tf32(t.normal((m, 16)))
    a[:4] = 0.0  # rows of zeros: a zero result where C is 0 too
    c = t.normal((m, n), np.float32)
    c[:2] = 0.0
    cases.append(("a k-step of 16 (as mma.m16n8k16), some terms and results zero", a, _tf32(t.normal((16, n))), c))
    return cases


@exercise("tc_accumulate", lesson=LESSON,
          hint="For each (i, j): the terms are C[i, j] and the k products A[i, l] B[l, j] (exact in float64). "
               "e = the exponent of the largest |term| (np.frexp(x)[1] - 1). Cut each term with "
               "np.trunc(term / q) * q, q = 2.0 ** (e - 23); add the cut terms; then cut the sum the same way with "
               "the sum's own exponent. np.ldexp(1.0, e - 23) is 2.0 ** (e - 23) for arrays of e.")
def check_tc_accumulate(t, fn):
    cases = _tc_cases(t)
    got = []
    for label, a, b, c in cases:
        t.case(label, A=f"{a.shape} tf32 values in float32", B=f"{b.shape} likewise", C=f"{c.shape} float32")
        out = t.call(a, b, c)
        got.append(t.array(out, c.shape, np.float32, "D"))
    wants = [tc_model(a, b, c) for _, a, b, c in cases]
    wrong = [i for i, (g, w) in enumerate(zip(got, wants)) if not np.array_equal(g, w)]
    if not wrong:
        return
    t.case(f"{len(cases)} k-steps: " + "; ".join(label for label, *_ in cases))
    for slip, why in _TC_SLIPS:
        if all(np.array_equal(g, slip(a, b, c)) for g, (_, a, b, c) in zip(got, cases)):
            raise t.fail(why)
    i = wrong[0]
    label, a, b, c = cases[i]
    r, s = (int(x) for x in np.argwhere(got[i] != wants[i])[0])
    mine, want = got[i][r, s], wants[i][r, s]
    terms = [float(c[r, s])] + [float(a[r, l]) * float(b[l, s]) for l in range(a.shape[1])]
    e = int(exponent(max(abs(x) for x in terms)))
    bigger = "larger" if abs(float(mine)) > abs(float(want)) else "smaller"
    advice = {"hint": "Nothing in the model ever rounds up: every step cuts toward zero"} if bigger == "larger" else {}
    raise t.fail(f"case '{label}': D[{r}, {s}] is {float(mine)!r}, the model gives {float(want)!r} (yours is "
                 f"{bigger} in magnitude); its terms are C = {terms[0]!r} and the products "
                 f"{', '.join(repr(x) for x in terms[1:4])}, ..., the largest term is in [2**{e}, 2**{e + 1}), so each "
                 f"is cut to a multiple of 2**{e - 23}", **advice)
