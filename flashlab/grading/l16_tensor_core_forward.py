"""Lesson 16, the tensor-core forward: the S = Q K^T step of one warp as a Numba kernel; the inner loop of one warp
of 16 query rows (float16, m16n8k16): the online softmax on S's C fragments, two C n-tiles of P packed into one A
fragment, O += P V with V's B fragments through ldmatrix.trans, and the one-warp forward assembled from them,
against float64 attention; the smallest row padding that keeps ldmatrix free of bank conflicts; and which 16-byte
chunks of a K tile each thread of the forward copies.

The kernels and device functions run inside small kernels of one warp (in the CUDA simulator without a GPU), on
fragments laid out with flashlab.fragments, and are compared with NumPy models of the same fragments. The models
take the usual slips as keyword arguments: a wrong answer that equals one of them is told which slip it is.
"""
from __future__ import annotations

import math

import numpy as np

from .. import fragments as F
from .core import NotImplementedYet, exercise, fail_on_slip, int_answers, judge_answers
from .simcheck import kernel_of, launch, not_implemented, require_kernel

LESSON = "16_tensor_core_forward"


# --------------------------------------------------------------------------- one warp's S = Q K^T
def _a1_a2_swapped(Q):
    """The A operand the tensor core sees when a kernel passes registers a1 and a2 in each other's place: in every
    16-column k-step, the 8 x 8 block of rows 8-15, columns 0-7 and that of rows 0-7, columns 8-15 trade places."""
    A = Q.copy()
    for c in range(0, Q.shape[1], 16):
        A[8:16, c:c + 8], A[0:8, c + 8:c + 16] = Q[0:8, c + 8:c + 16], Q[8:16, c:c + 8]
    return A


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
        if np.abs(S - _a1_a2_swapped(Q64) @ K64.T).max() <= tol * scale:
            return [], ("the A registers are in the wrong order: you passed Q's words as (row g, w), (g, w + 4), "
                        "(g + 8, w), (g + 8, w + 4). PTX's order is a0 a1 = row g, a2 a3 = row g + 8 (a register "
                        "each), then the same rows 8 columns on: (g, w), (g + 8, w), (g, w + 4), (g + 8, w + 4).")
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
          hint="Use the positions of lesson 15's exercise 1, counted in 32-bit words: a register holds columns 2w "
               "and 2w + 1 of a row, which is word w. A is Q: its rows are query rows, and k-step ks is words 8ks "
               "to 8ks + 7. B is "
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


# ------------------------------------------------------------------------- the inner loop of one warp
NEG = -1.0e30  # flashlab.kernels.common.NEG (a test keeps them equal): imported here, it would load numba
LOG2E = 1.4426950408889634
NAN16 = 0x7E00  # a float16 NaN: shared memory the kernel should not read holds it
QUAD = "lanes 4g to 4g+3 (the quad) share rows g and g + 8"


cuda = None  # numba.cuda, set when a check first runs: a module global, which the simulator swaps for its fake


def _cuda():
    global cuda
    from ..device import get_cuda

    cuda = get_cuda()
    return cuda


def _require_device_function(t, fn):
    if not_implemented(fn):
        raise NotImplementedYet()
    if not (hasattr(fn, "py_func") or type(fn).__name__ in ("FakeCUDAKernel", "CUDADispatcher")):
        raise t.fail(f"pass the device function itself (decorated with @cuda.jit(device=True)); got "
                     f"{type(fn).__name__}")
    if getattr(fn, "_device", True) is False:  # the simulator's wrapper of a kernel (a GPU would refuse to compile)
        raise t.fail("this is a kernel: decorate it with @cuda.jit(device=True), a function a kernel calls")


def _close(got, want, rtol=1e-4):
    """Equal within rtol of want's largest finite entry, NaN where want has NaN, inf where it has inf."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return False
    finite = np.isfinite(want)
    scale = float(np.abs(want[finite]).max()) if finite.any() else 1.0
    with np.errstate(all="ignore"):
        return bool(np.allclose(got, want, rtol=rtol, atol=rtol * max(scale, 1e-30), equal_nan=True))


def _c_fragments(M):
    """(32, n-tiles, 4): the C fragments of each 8-column n-tile of the 16-row matrix M."""
    return np.ascontiguousarray(np.stack([F.to_fragments(M[:, 8 * n:8 * n + 8], "m16n8k16", "C")
                                          for n in range(M.shape[1] // 8)], axis=1))


def _from_c(frags):
    """The 16-row matrix whose n-tiles' C fragments are frags (32, n-tiles, 4)."""
    return np.concatenate([F.from_fragments(frags[:, n], "m16n8k16", "C") for n in range(frags.shape[1])], axis=1)


def _lane_rows(per_row):
    """(32, 2): the values of rows g and g + 8 for each lane, from one value per row (16,)."""
    g = np.arange(32) // 4
    return np.stack([per_row[g], per_row[g + 8]], axis=1)


def _quad_sum(x):
    lane = np.arange(32)
    x = x + x[lane ^ 1]
    return x + x[lane ^ 2]


# ----------------------------------------------------------------------------------- the online softmax
def softmax_model(s, m, l, acc, k0, row0, n_keys, causal, scale_log2, *, butterfly=(1, 2), mask_first=True,
                  mask_tail=True, mask_causal=True, diagonal=False, l_quad=None, rescale_l=True, rescale_o=True,
                  alpha_inverted=False, p_old_max=False):
    """What softmax_step leaves in each lane: {s: P (32, n-tiles, 4), m (32, 2), l (32, 2), acc (32, d/8, 4)}, from
    the lanes' registers before the step. The keyword arguments replay one slip each: the butterfly's xor masks,
    the max before the mask, a mask without the ragged tail, without causal or with the diagonal hidden, l summed
    over the quad every tile ("row_sum": the tile's sums; "l": the new l), l or O not rescaled, alpha inverted,
    P computed with the previous max."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    nt = s.shape[1]
    n = np.arange(nt)[None, :, None]
    j = np.arange(4)[None, None, :]
    rows = row0 + g[:, None, None] + 8 * (j // 2)
    keys = k0 + 8 * n + 2 * t[:, None, None] + j % 2
    hidden = np.zeros(s.shape, bool)
    if mask_tail:
        hidden |= keys >= n_keys
    if causal and mask_causal:
        hidden |= keys >= rows if diagonal else keys > rows
    s64, m64 = s.astype(np.float64), m.astype(np.float64)
    masked = np.where(hidden, NEG, s64)
    seen = masked if mask_first else s64
    mx = np.stack([seen[:, :, 0:2].max(axis=(1, 2)), seen[:, :, 2:4].max(axis=(1, 2))], axis=1)
    for b in butterfly:
        mx = np.maximum(mx, mx[lane ^ b])
    m_new = np.maximum(m64, mx)
    with np.errstate(all="ignore"):
        alpha = np.exp2((m_new - m64 if alpha_inverted else m64 - m_new) * float(scale_log2))
        base = (m64 if p_old_max else m_new)[:, None, [0, 0, 1, 1]]
        p = np.exp2((masked - base) * float(scale_log2))
        row_sum = np.stack([p[:, :, 0:2].sum(axis=(1, 2)), p[:, :, 2:4].sum(axis=(1, 2))], axis=1)
        if l_quad == "row_sum":
            row_sum = _quad_sum(row_sum)
        l_new = (l * alpha if rescale_l else l.astype(np.float64)) + row_sum
        if l_quad == "l":
            l_new = _quad_sum(l_new)
        acc_new = acc * alpha[:, None, [0, 0, 1, 1]] if rescale_o else acc.astype(np.float64)
    return {"s": p, "m": m_new, "l": l_new, "acc": acc_new}


L_QUAD = ("l is summed across the quad every tile: each lane keeps its OWN partial sum of the p it holds (l[r] = "
          "alpha * l[r] + the sum of your own p), and the 4 partial sums of a row are added once, at the end of the "
          "kernel. Only the max must agree in every tile (P = exp(S - m) uses it); shuffling l costs two shfl_xor "
          "per row per tile for nothing")
BUTTERFLY = ("a butterfly step is missing: " + QUAD + ", so a row's max needs TWO exchanges, mx = max(mx, "
             "shfl_xor(mx, 1)) and then mx = max(mx, shfl_xor(mx, 2)); after one, only pairs of lanes agree")
SOFTMAX_SLIPS = [
    (dict(butterfly=(1,)), BUTTERFLY),
    (dict(butterfly=(2,)), BUTTERFLY),
    (dict(butterfly=()), "the row max is this lane's own: " + QUAD + ", each with 2 of the row's 8 columns of "
                         "every n-tile. Exchange it with shfl_xor(mx, 1), then shfl_xor(mx, 2)"),
    (dict(mask_first=False), "the max was taken before masking: a hidden key's score (past n_keys, or after the row "
                             "when causal) must not count, or m can exceed every visible score and exp(s - m) "
                             "underflows to 0. Set hidden scores to NEG first, then take the max"),
    (dict(l_quad="row_sum"), L_QUAD),
    (dict(l_quad="l"), L_QUAD),
    (dict(rescale_o=False), "O's fragments are not rescaled: when a row's max grows from m_old to m_new, every "
                            "acc[n, 2r] and acc[n, 2r + 1] of that row is multiplied by alpha = exp2((m_old - "
                            "m_new) * scale_log2)"),
    (dict(rescale_l=False), "l is not rescaled: l[r] = alpha * l[r] + this tile's sum, with alpha = exp2((m_old - "
                            "m_new) * scale_log2), since the old sum was taken against the old max"),
    (dict(alpha_inverted=True), "alpha is inverted: the old sums were taken against the smaller m_old, so they "
                                "shrink by alpha = exp2((m_old - m_new) * scale_log2) <= 1"),
    (dict(p_old_max=True), "P is computed with the old max: first m_new = max(m_old, the tile's row max), then p = "
                           "exp2((s - m_new) * scale_log2)"),
    (dict(diagonal=True), "the causal mask hides the diagonal: row i sees keys j <= i, its own key included (hide "
                          "key > row)"),
    (dict(mask_causal=False), "with causal=True, keys after the row (key > row) are hidden too"),
    (dict(mask_tail=False), "keys past the end (key >= n_keys) are not hidden: the last tile is ragged, and its "
                            "rows of K are zeros, whose scores (0) must not count"),
]


def _softmax_harness(fn, nt, nd):
    _cuda()
    from numba import float32

    @cuda.jit
    def run_softmax_step(s_in, m_in, l_in, acc_in, k0, row0, n_keys, causal, scale_log2, s_out, m_out, l_out,
                         acc_out):
        lane = cuda.threadIdx.x
        s = cuda.local.array((nt, 4), float32)
        acc = cuda.local.array((nd, 4), float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        for j in range(4):
            for n in range(nt):
                s[n, j] = s_in[lane, n, j]
            for n in range(nd):
                acc[n, j] = acc_in[lane, n, j]
        for r in range(2):
            m[r] = m_in[lane, r]
            l[r] = l_in[lane, r]
        fn(s, m, l, acc, k0, row0, n_keys, causal, scale_log2, lane)
        for j in range(4):
            for n in range(nt):
                s_out[lane, n, j] = s[n, j]
            for n in range(nd):
                acc_out[lane, n, j] = acc[n, j]
        for r in range(2):
            m_out[lane, r] = m[r]
            l_out[lane, r] = l[r]

    return run_softmax_step


def _softmax_cases(rng):
    """(label, n-tiles of S, of O, k0, row0, n_keys, causal, score scale, first tile)."""
    nt, nd = int(rng.choice([2, 4])), int(rng.choice([2, 4]))
    k0 = 8 * nt * int(rng.integers(0, 3))
    causal = bool(rng.integers(0, 2))
    return [("a later tile: some rows' max grows, some rows' does not", 2, 4, 64, 0, 1000, False, 3.0, False),
            ("the first tile: m = NEG, l = 0, O = 0; no key hidden", 4, 2, 0, 0, 1000, False, 3.0, True),
            ("causal, the diagonal crosses the tile", 4, 2, 32, 32, 1000, True, 3.0, False),
            ("the last tile: keys past n_keys", 4, 2, 64, 80, 77, False, 3.0, False),
            ("large logits, causal and past n_keys at once", 4, 4, 0, 16, 20, True, 40.0, False),
            ("random", nt, nd, k0, k0 + int(rng.integers(0, 8 * nt)), k0 + int(rng.integers(1, 8 * nt + 8)), causal,
             float(rng.choice([1.0, 10.0])), False)]


def _hidden(k0, row0, n_keys, causal, bk):
    rows = row0 + np.arange(16)[:, None]
    keys = k0 + np.arange(bk)[None, :]
    return (keys >= n_keys) | (causal & (keys > rows))


@exercise("softmax_step", lesson=LESSON, time_limit=30,
          hint="Per row r (row0 + g + 8r, values c[2r] and c[2r+1] of every n-tile): hide first (key >= n_keys, or "
               "causal and key > row: s = NEG), then take the max of your values, then mx = max(mx, shfl_xor(mx, 1)) "
               "and mx = max(mx, shfl_xor(mx, 2)), so that the quad's 4 lanes agree. m_new = max(m[r], mx); alpha = "
               "exp2((m[r] - m_new) * scale_log2); s = p = exp2((s - m_new) * scale_log2); l[r] = alpha * l[r] + the "
               "sum of your own p (no shuffle); every acc[n, 2r] and acc[n, 2r + 1] times alpha.")
def check_softmax_step(t, fn):
    _require_device_function(t, fn)
    for label, nt, nd, k0, row0, n_keys, causal, scale, first in _softmax_cases(t.rng):
        bk, d = 8 * nt, 8 * nd
        hidden = _hidden(k0, row0, n_keys, causal, bk)
        S = t.normal((16, bk), np.float32, scale)
        S[hidden] = np.abs(S[hidden]) + 2 * scale  # hidden keys score highest: a max before the mask shows
        visible_max = np.where(hidden, -np.inf, S).max(axis=1)
        if first:
            m_row, l_in, acc = np.full(16, NEG, np.float32), np.zeros((32, 2), np.float32), np.zeros((32, nd, 4))
        else:  # as if earlier tiles were seen: some rows' max is larger than this tile's, some smaller
            m_row = (visible_max + t.normal(16, np.float64, 0.5 * scale)).astype(np.float32)
            l_in = t.rng.uniform(0.5, 4.0, (32, 2)).astype(np.float32)
            acc = t.normal((32, nd, 4))
        args = (_c_fragments(S), _lane_rows(m_row), l_in, np.ascontiguousarray(acc, np.float32), k0, row0, n_keys,
                causal, np.float32(LOG2E / math.sqrt(d)))
        t.case(label, n_tiles_of_S=nt, d=d, k0=k0, row0=row0, n_keys=n_keys, causal=causal,
               scores=f"N(0, {scale:g}^2)", m="NEG" if first else "random per row", launch="[1, 32]")
        outs = [np.full(a.shape, np.nan, np.float32) for a in args[:4]]
        got = dict(zip(("s", "m", "l", "acc"), launch(t, _softmax_harness(fn, nt, nd), 1, 32, [*args, *outs],
                                                     [9, 10, 11, 12])))
        want = softmax_model(*args)
        if not all(_close(got[x], want[x], 1e-5) for x in want):
            for slip, why in SOFTMAX_SLIPS:
                v = softmax_model(*args, **slip)
                if not all(_close(v[x], want[x], 1e-5) for x in want) and all(_close(got[x], v[x]) for x in want):
                    raise t.fail(why)
            _softmax_structure(t, got, want)
        for key, name in (("m", "m (each row's running max)"), ("s", "P (s after the step)"),
                          ("l", "l (this lane's partial sums)"), ("acc", "O's fragments (acc)")):
            t.compare(got[key], want[key], name, dtype=np.float32, tol=3e-5, floor=1e-6,
                      explain=_where_wrong(key, want[key], args[4], args[5]))


def _softmax_structure(t, got, want):
    """Verdicts on the quad's agreement, for answers that match no single slip."""
    quads = lambda x: np.asarray(x, np.float64).reshape(8, 4, 2)  # noqa: E731
    m = quads(got["m"])
    if not np.isnan(m).any() and not np.array_equal(m, np.broadcast_to(m[:, :1], m.shape)):
        raise t.fail("the 4 lanes of a quad disagree on a row's max: " + QUAD + "; after max(mx, shfl_xor(mx, 1)) "
                     "and max(mx, shfl_xor(mx, 2)) every one of them holds the row's max")
    lq, lw = quads(got["l"]), quads(want["l"])
    if (not np.isnan(lq).any() and np.allclose(lq, lq[:, :1], rtol=1e-6)
            and not np.allclose(lw, lw[:, :1], rtol=1e-6)):
        raise t.fail(L_QUAD)


def _where_wrong(key, want, k0, row0):
    """explain(got): the first wrong value, with its lane and, for P, its row and key."""
    def explain(got):
        got = np.asarray(got, np.float64)
        with np.errstate(all="ignore"):
            bad = np.argwhere(~np.isclose(got, want, rtol=3e-5, atol=3e-5 * np.abs(want).max()))
        if not len(bad):
            return [], None
        where = tuple(int(i) for i in bad[0])
        lane = where[0]
        g, t = lane // 4, lane % 4
        if key == "s":
            n, j = where[1:]
            what = f"row {row0 + g + 8 * (j // 2)}, key {k0 + 8 * n + 2 * t + j % 2} (n-tile {n}, c{j})"
        elif key == "acc":
            what = f"O's n-tile {where[1]}, c{where[2]} (row {row0 + g + 8 * (where[2] // 2)})"
        else:
            what = f"row {row0 + g + 8 * where[1]}"
        return [f"{len(bad)} wrong values; e.g. lane {lane} (g = {g}, t = {t}), {what}: you have {got[where]:.6g}, "
                f"expected {want[where]:.6g}"], None

    return explain


# ------------------------------------------------------------------------------------- P into A registers
def pack_model(s, *, order=(0, 1, 2, 3), swap=False, tile=lambda kk: 2 * kk, pairs=((0, 1), (2, 3)),
               dtype="float16"):
    """(32, k-steps, 4) uint32: the A fragment registers of each k-step of P V, from P's C fragments s (32, n-tiles,
    4). Register r of k-step kk = pack(c[i], c[j]) of n-tile tile(kk) + r // 2, (i, j) = pairs[r % 2]; keywords
    replay slips: the registers' order, the halves swapped, the n-tiles, the pairs, the 16-bit type."""
    nt = s.shape[1]
    out = np.zeros((32, nt // 2, 4), np.uint32)
    for kk in range(nt // 2):
        regs = []
        for r in range(4):
            n = tile(kk) + r // 2
            if n >= nt:
                return None
            lo, hi = (F.to_bits16(s[:, n, i], dtype) for i in pairs[r % 2])
            regs.append(F.pack16(hi, lo) if swap else F.pack16(lo, hi))
        out[:, kk] = np.stack(regs, axis=1)[:, list(order)]
    return out


PACK_SLIPS = [
    (dict(order=(0, 2, 1, 3)), "the A registers are in the wrong order: a0..a7 are, in pairs, row g with keys 2t, "
                               "2t+1 (register 0), row g + 8 with the same keys (register 1), then the same for keys "
                               "2t+8, 2t+9 (registers 2, 3). So registers 0, 1 are c0c1 and c2c3 of n-tile 2kk, and "
                               "registers 2, 3 those of n-tile 2kk + 1"),
    (dict(order=(2, 3, 0, 1)), "the two n-tiles are swapped: keys 16kk..16kk+7 (n-tile 2kk) are A's first 8 columns, "
                               "registers 0 and 1; n-tile 2kk + 1 gives registers 2 and 3"),
    (dict(swap=True), "the halves of each register are swapped: pack_f16x2(lo, hi) puts its first argument in the "
                      "low 16 bits, which hold the lower-numbered element (c0 before c1, c2 before c3)"),
    (dict(tile=lambda kk: kk), "k-step kk is keys 16kk to 16kk + 15, n-tiles 2kk and 2kk + 1 of S (8 keys each), "
                               "not kk and kk + 1"),
    (dict(pairs=((0, 2), (1, 3))), "a register holds two neighbours of one row (c0 and c1: row g, keys 2t and "
                                   "2t + 1), not two rows of one key (c0 and c2)"),
    (dict(dtype="bfloat16"), "P is packed as bfloat16: this mma is .f16, pack_f16x2"),
]


def _pack_harness(fn, nt):
    _cuda()
    from numba import float32

    @cuda.jit
    def run_pack_p(s_in, out):
        lane = cuda.threadIdx.x
        s = cuda.local.array((nt, 4), float32)
        for n in range(nt):
            for j in range(4):
                s[n, j] = s_in[lane, n, j]
        for kk in range(nt // 2):
            a0, a1, a2, a3 = fn(s, kk)
            out[lane, kk, 0] = a0
            out[lane, kk, 1] = a1
            out[lane, kk, 2] = a2
            out[lane, kk, 3] = a3

    return run_pack_p


def _halves(regs):
    lo, hi = F.unpack16(regs)
    return F.from_bits16(lo, "float16"), F.from_bits16(hi, "float16")


@exercise("pack_p", lesson=LESSON, time_limit=30,
          hint="Section 4 of the lesson: the C fragments of n-tiles 2kk and 2kk + 1 ARE the A fragment of k-step kk. "
               "Register 0 = pack_f16x2(c0, c1) of n-tile 2kk (row g), register 1 = pack_f16x2(c2, c3) (row g + 8), "
               "registers 2 and 3 the same of n-tile 2kk + 1.")
def check_pack_p(t, fn):
    _require_device_function(t, fn)
    specs = [("one k-step (16 keys)", 2), ("two k-steps (32 keys)", 4), ("three k-steps (48 keys)", 6)]
    for label, nt in specs:
        P = t.rng.uniform(0.0, 1.0, (16, 8 * nt)).astype(np.float32)
        P[t.rng.random(P.shape) < 0.2] = 0.0  # hidden keys
        P[t.rng.random(P.shape) < 0.05] = 1.0  # each row's max
        s = _c_fragments(P)
        t.case(label, n_tiles_of_P=nt, k_steps=nt // 2, P="uniform in [0, 1], some 0 and 1", launch="[1, 32]")
        (got,) = launch(t, _pack_harness(fn, nt), 1, 32, [s, np.zeros((32, nt // 2, 4), np.uint32)], [1])
        want = pack_model(s)
        if np.array_equal(got, want):
            continue
        for slip, why in PACK_SLIPS:
            v = pack_model(s, **slip)
            if v is not None and np.array_equal(got, v):
                raise t.fail(why)
        lane, kk, r = (int(i) for i in np.argwhere(got != want)[0])
        (glo, ghi), (wlo, whi) = (map(float, _halves(x[lane, kk, r])) for x in (got, want))
        raise t.fail(f"{int((got != want).sum())} of {got.size} registers are wrong; e.g. lane {lane}, k-step {kk}, "
                     f"register {r} holds ({glo:.4g}, {ghi:.4g}) (low half, high half); the A fragment needs "
                     f"({wlo:.4g}, {whi:.4g})")


# -------------------------------------------------------------------------------------------- O += P V
def pv_model(a, acc, V, *, trans=True, key_offset=True, b_pairs=((0, 1), (2, 3)), accumulate=True, pairs=None,
             a_order=(0, 1, 2, 3)):
    """O's fragments (32, d/8, 4) after O += P V for one k-step: P from the lanes' A registers a (32, 4), V (16, d)
    float16 values, O's fragments acc. The keywords replay slips: V's 8x8 blocks read without .trans, keys 8-15
    read as keys 0-7, the ldmatrix matrices given to the wrong n-tile or b register (b_pairs: which of matrices
    0-3 = (keys 0-7 | keys 8-15) x (dims 16n2.. | 16n2+8..) become (b0, b1) of n-tiles 2n2 and 2n2 + 1), the
    accumulator restarted, only the first `pairs` n-tile pairs, the A registers in another order."""
    lo, hi = F.unpack16(a[:, list(a_order)])
    P = F.from_fragments(F.from_bits16(np.stack([lo, hi], axis=-1).reshape(32, 8), "float16"), "m16n8k16", "A")
    d = V.shape[1]
    W = V.astype(np.float64)
    if not key_offset:
        W = np.concatenate([W[:8], W[:8]])
    blocks = [[W[8 * kb:8 * kb + 8, 8 * db:8 * db + 8] for db in range(d // 8)] for kb in range(2)]
    if not trans:
        blocks = [[b.T for b in row] for row in blocks]
    out = np.asarray(acc, np.float64).copy()
    for n2 in range(d // 16 if pairs is None else pairs):
        mats = [blocks[i % 2][2 * n2 + i // 2] for i in range(4)]  # matrix i: keys 8(i % 2).., dims 16n2 + 8(i // 2)
        for half in range(2):
            i0, i1 = b_pairs[half]
            B = np.concatenate([mats[i0], mats[i1]])  # b0: B's rows 0-7, b1: rows 8-15
            C = out[:, 2 * n2 + half] if accumulate else np.zeros((32, 4))
            out[:, 2 * n2 + half] = F.to_fragments(P @ B + F.from_fragments(C, "m16n8k16", "C"), "m16n8k16", "C")
    return out


PV_SLIPS = [
    (dict(trans=False), "V was read without .trans: B = V holds keys down its rows, so a lane's b register needs "
                        "keys 2t and 2t+1 of dim g, two ROWS of V in shared memory; ldmatrix_x4_trans transposes "
                        "each 8x8 matrix on the way and delivers exactly that (plain ldmatrix gives one row's two "
                        "neighbours, which is what K needs for S = Q K^T)"),
    (dict(b_pairs=((0, 2), (1, 3))), "the four matrices went to the wrong registers: for O's n-tile 2n2 (dims "
                                     "16n2..16n2+7), b0 is keys 0-7 and b1 keys 8-15 of those dims; the n-tile "
                                     "2n2 + 1 takes the two matrices of the next 8 dims"),
    (dict(key_offset=False), "keys 8-15 are read as keys 0-7: the lanes that address the matrices of b1 (keys 8-15) "
                             "must point 8 rows further down"),
    (dict(accumulate=False), "O's accumulators restart at 0: pass acc[n, 0..3] as the mma's C so that O += P V "
                             "adds to what earlier keys gave"),
    (dict(pairs=1), "only O's first two n-tiles (dims 0-15) are computed: one ldmatrix_x4_trans and two mma for "
                    "every 16 dims, d/16 of them"),
    (dict(a_order=(0, 2, 1, 3)), "the A registers go to the mma in the wrong order: a0, a1, a2, a3 as given"),
]


def _pv_harness(fn, nd, words):
    _cuda()
    from numba import float32, uint32

    @cuda.jit
    def run_pv_kstep(a_in, acc_in, sh_in, base, rs, acc_out):
        sh = cuda.shared.array(words, uint32)
        lane = cuda.threadIdx.x
        for i in range(lane, words, 32):
            sh[i] = sh_in[i]
        cuda.syncthreads()
        acc = cuda.local.array((nd, 4), float32)
        for n in range(nd):
            for j in range(4):
                acc[n, j] = acc_in[lane, n, j]
        fn(a_in[lane, 0], a_in[lane, 1], a_in[lane, 2], a_in[lane, 3], acc, sh, base, rs, lane)
        for n in range(nd):
            for j in range(4):
                acc_out[lane, n, j] = acc[n, j]

    return run_pv_kstep


def _pack_rows(M):
    """uint32 words of a float16 matrix (rows, cols): two neighbours of a row per word, the lower column low."""
    bits = F.to_bits16(M, "float16")
    return F.pack16(bits[:, 0::2], bits[:, 1::2])


@exercise("pv_kstep", lesson=LESSON, time_limit=30,
          hint="B = V: a lane's b0 of O's n-tile n is keys 2t, 2t+1 of dim 8n + g, two rows of V. ldmatrix_x4_trans "
               "reads 4 matrices of 8 rows x 8 values (lane 8i + r gives the word address of row r of matrix i) and "
               "transposes each: matrix (keys 0-7, dims 8n..) is then exactly b0, (keys 8-15, same dims) b1. One "
               "ldmatrix_x4_trans per 16 dims (two n-tiles), then two MMA16 accumulating into acc.")
def check_pv_kstep(t, fn):
    _require_device_function(t, fn)
    specs = [("d = 16, O = 0 before", 16, 4, 0, True), ("d = 32, V after a K tile in shared memory", 32, 4, 48, False),
             ("d = 32, rows padded by 12 words", 32, 12, 16, False),
             ("random", int(t.rng.choice([16, 32, 48])), 4 * int(t.rng.integers(1, 4)), int(t.rng.integers(0, 40)),
              False)]
    for label, d, pad, base_rows, zero in specs:
        W, nd = d // 2, d // 8
        rs = W + pad
        base = base_rows * rs
        words = base + 16 * rs
        V = F.round_f16(t.normal((16, d), np.float32))
        P = F.round_f16(t.rng.uniform(0.0, 1.0, (16, 16)).astype(np.float32))
        a = _registers(F.to_fragments(P, "m16n8k16", "A"))
        acc = np.zeros((32, nd, 4), np.float32) if zero else t.normal((32, nd, 4), np.float32)
        sh = np.full(words, NAN16 | (NAN16 << 16), np.uint32)  # padding and other rows: NaN
        for key in range(16):
            sh[base + key * rs:base + key * rs + W] = _pack_rows(V[key:key + 1])[0]
        t.case(label, d=d, rs=rs, base=base, V="16 rows (keys) of d float16 values", P="A fragment, values in [0, 1]",
               launch="[1, 32]")
        (got,) = launch(t, _pv_harness(fn, nd, words), 1, 32, [a, acc, sh, base, rs, np.full(acc.shape, np.nan,
                                                                                             np.float32)], [5])
        want = pv_model(a, acc, V)

        if np.isnan(got).any():
            raise t.fail("O has NaN: your ldmatrix read words outside V's rows (the checker fills the rest of shared "
                         "memory, the padding included, with NaN). Row r of this k-step's V starts at word "
                         f"base + r * rs (here {base} + r * {rs}), and its d values are its first d/2 words")
        if not _close(got, want, 1e-5):
            for slip, why in PV_SLIPS:
                v = pv_model(a, acc, V, **slip)
                if not _close(v, want, 1e-5) and _close(got, v):
                    raise t.fail(why)
            if _close(got, acc):
                raise t.fail("acc is unchanged: write the mma's results back into acc[n, 0..3]")
        t.compare(got, want, "O's fragments (acc)", dtype=np.float32, tol=1e-5, explain=_where_wrong("acc", want, 0, 0))


def _registers(frags16):
    bits = F.to_bits16(frags16, "float16")
    return np.ascontiguousarray(F.pack16(bits[:, 0::2], bits[:, 1::2]))


# ------------------------------------------------------------------------------------ the assembled forward
def forward_model(Q, K, V, causal, scale, slip=None, block_k=32):
    """float64 attention of float16 Q, K, V (their values), or what a slip in the assembled kernel gives:
    "partial_l" (O divided by the lane's partial sum: keys whose column 2t, 2t+1 mod 8 is the column's), "first_kstep"
    (only keys 0-15 of each tile in P V), "unnormalised" (O not divided by l), "v_is_k" (P K instead of P V),
    "not_causal" (no causal mask, over the tiles a causal block visits: those up to its last row)."""
    Q, K, V = (x.astype(np.float64) for x in (Q, K, V))
    S = Q @ K.T * scale
    i, j = np.arange(S.shape[0])[:, None], np.arange(S.shape[1])[None, :]
    if causal:
        last = -(-(16 * (i // 16) + 16) // block_k) * block_k  # the end of the tiles the row's block visits
        S = np.where(j >= last if slip == "not_causal" else j > i, -np.inf, S)
    P = np.exp(S - S.max(axis=1, keepdims=True))
    l = P.sum(axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        if slip == "partial_l":
            parts = np.stack([P[:, (np.arange(S.shape[1]) % 8) // 2 == t].sum(axis=1) for t in range(4)], axis=1)
            return P @ V / parts[:, (np.arange(V.shape[1]) % 8) // 2]
    if slip == "first_kstep":
        return (P * (j % block_k < 16)) @ V / l
    if slip == "unnormalised":
        return P @ V
    if slip == "v_is_k":
        return P @ K / l
    return P @ V / l


FORWARD_SLIPS = [
    ("partial_l", "O is divided by this lane's partial l: l[r] holds the sum of the p this lane held (keys 2t, 2t+1 "
                  "of every 8), so at the end add the quad's 4 partial sums, total = l[r] + shfl_xor ... (masks 1, "
                  "then 2, in every lane), and divide by the total"),
    ("first_kstep", "only the first 16 keys of each tile reach O: a tile of BLOCK_K = 32 keys is two k-steps of P V "
                    "(pack_p(s, 0) and pack_p(s, 1), with V's rows 16kk.. for k-step kk)"),
    ("unnormalised", "O is not divided by l: the loop leaves acc = sum of p v with p = exp(S - m); divide by each "
                     "row's sum of p at the end"),
    ("v_is_k", "P was multiplied with K, not V: V's tile starts VO words after K's in shared memory (base VO + 16 kk "
               "RS for k-step kk)"),
    ("not_causal", "with causal=True keys after the row must be hidden: pass causal (and row0) to softmax_step"),
]


@exercise("forward_warp", lesson=LESSON, time_limit=60,
          hint="After scores(...): softmax_step(s, m, l, acc, k0, row0, n_k, causal, scale_log2, lane), then for each "
               "of the tile's BLOCK_K // 16 k-steps kk, pack_p(s, kk) and pv_kstep(..., acc, sh, VO + 16 * kk * RS, "
               "RS, lane). After the loop, for r = 0, 1: total = l[r] plus the quad's other partial sums (shfl_xor "
               "1, then 2, in every lane, outside any if), then for rows < n_q, o[row, 8n + 2t + c] = acc[n, 2r + c] "
               "/ total. Pass the checks of softmax_step, pack_p and pv_kstep first.")
def check_forward_warp(t, fn):
    if not_implemented(fn):
        raise NotImplementedYet()
    nq, nk = int(t.rng.integers(16, 33)), int(t.rng.integers(40, 81))
    specs = [("one block, d = 16", 16, 40, 16, False, 1.0), ("two blocks, causal, d = 32", 32, 48, 32, True, 1.0),
             ("large logits (scores up to about 100), rows past Nq", 20, 72, 32, False, 30.0),
             ("random", nq, nk, int(t.rng.choice([16, 32])), bool(t.rng.integers(0, 2)), 1.0)]
    for label, nq, nk, d, causal, logit in specs:
        Q = F.round_f16(t.normal((nq, d), np.float32, logit))  # scores Q K^T / sqrt(d) of spread `logit`
        K, V = (F.round_f16(t.normal((nk, d), np.float32)) for _ in range(2))
        scale = 1 / math.sqrt(d)
        blocks = -(-nq // 16)
        t.case(label, Nq=nq, Nk=nk, d=d, causal=causal, grid=blocks, block=32, block_k=32,
               q=f"({nq}, {d // 2}) uint32", o=f"({nq}, {d}) float32")
        kernel = kernel_of(t, fn, d)
        words = [np.ascontiguousarray(F.to_bits16(x, "float16")).view(np.uint32) for x in (Q, K, V)]
        o = np.full((nq, d), np.nan, np.float32)
        (got,) = launch(t, kernel, blocks, 32, [*words, o, nq, nk, causal, np.float32(scale * LOG2E)], [3])
        ref = forward_model(Q, K, V, causal, scale)

        for slip, why in FORWARD_SLIPS:
            v = forward_model(Q, K, V, causal, scale, slip)
            if not _close(got, ref, 2e-3) and not _close(v, ref, 1e-2) and _close(got, v, 2e-3):
                raise t.fail(why)
        if np.isnan(got).any():
            rows = sorted({int(r) for r in np.argwhere(np.isnan(got))[:, 0]})
            raise t.fail(f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of O are NaN or never written: every row < "
                         "n_q gets d values, lane (g, t) writing columns 8n + 2t and 8n + 2t + 1 of rows row0 + g "
                         "(acc[n, 0], acc[n, 1]) and row0 + g + 8 (acc[n, 2], acc[n, 3])")

        def explain(got, ref=ref):
            wrong = np.abs(np.asarray(got, np.float64) - ref) > 1e-2 * np.abs(ref).max()
            rows = sorted({int(r) for r in np.argwhere(wrong)[:, 0]})
            return [f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of O are wrong"], None

        t.compare(got, ref, "O", dtype=np.float32, tol=2e-3, explain=explain)


# ------------------------------------------------------------------------------------- row padding
def row_padding(row_words, rows=8, group=4, banks=32):
    """The fewest 4-byte words of padding, a multiple of `group` (rows stay 16-byte aligned), after which the first
    16 bytes of `rows` consecutive rows fall in `rows` different groups of `group` banks."""
    for pad in range(0, banks + 1, group):
        if len({(r * (row_words + pad)) % banks // group for r in range(rows)}) == rows:
            return pad
    raise AssertionError("some multiple of the group size below the bank count works")


_PADDING_SLIPS = [
    (dict(group=1), "the padding must be a multiple of 4 words: cp.async and ldmatrix move 16-byte chunks, so every "
                    "row must start on a 16-byte boundary"),
    (dict(rows=2), "all 8 rows of a phase must start in different bank groups, not just two neighbouring rows"),
]


@exercise("row_padding", lesson=LESSON,
          hint="Row r of the tile starts at word r * (W + p), in bank (r * (W + p)) % 32; a 16-byte chunk covers 4 "
               "banks, so the chunk's bank group is that // 4. Try p = 0, 4, 8, ... and keep the first p for which "
               "the 8 rows of a phase give 8 different groups.")
def check_row_padding(t, fn):
    widths = sorted({4 * w for w in range(1, 65)} | {4 * int(w) for w in t.rng.integers(65, 200, 4)})
    t.case(f"rows of W = {widths[0]} to {widths[-1]} words, every multiple of 4 up to 256 and a few above")
    got = []
    for W in widths:
        p = t.call(W)
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise t.fail(f"return the padding as an int number of 4-byte words; for W={W} you returned {p!r:.60}")
        got.append(int(p))
    want = [row_padding(W) for W in widths]
    if got == want:
        return
    if all(g == 4 * w for g, w in zip(got, want)):
        raise t.fail("count the padding in 4-byte words (banks are 4 bytes wide), not in bytes")
    if all(g == 4 for g in got):
        raise t.fail("4 words is right whenever W / 4 is even (every d the kernel takes), but when W / 4 is odd the "
                     f"rows already start in 8 different groups: W={widths[0]} needs {want[0]}")
    for keywords, why in _PADDING_SLIPS:
        if got == [row_padding(W, **keywords) for W in widths]:
            raise t.fail(why)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    starts = [(r * (widths[i] + got[i])) % 32 // 4 for r in range(8)]
    raise t.fail(f"W={widths[i]}: you said {got[i]}; with that padding the 8 rows of a phase start in bank groups "
                 f"{starts}, and the smallest padding that makes them all different is {want[i]}")


# ------------------------------------------------------------------------------------- swizzle
def swizzled_offset(row, col, row_bytes, *, key=lambda row, col: row % 8, unit=16, keep_inside=True):
    """Byte offset of value (row, col) of a tile of 16-bit values stored with the XOR swizzle: rows row_bytes apart,
    and the 16-byte chunk c of row r stored at chunk c ^ (r % 8) of its row. Keywords replay slips."""
    byte = 2 * col
    chunk, inside = divmod(byte, unit)
    return row * row_bytes + (chunk ^ key(row, col)) * unit + (inside if keep_inside else 0)


_SWIZZLE_SLIPS = [
    (dict(key=lambda row, col: (2 * col // 16) % 8), "the chunk is XORed with the ROW (row % 8): XORing it with "
                                                    "itself or the column does not move one row against the next"),
    (dict(key=lambda row, col: row), "XOR with row % 8, not the row: for rows 8 and on, chunk ^ row leaves the row's "
                                     "8 chunks (and the tile)"),
    (dict(unit=4), "the swizzle moves whole 16-byte chunks (what one lane of ldmatrix or cp.async reads), not "
                   "4-byte words"),
    (dict(keep_inside=False), "keep the value's place inside its 16-byte chunk: add (2 * col) % 16"),
]


@exercise("swizzled_offset", lesson=LESSON,
          hint="The value's byte in its row is 2 * col: chunk c = (2 * col) // 16, and (2 * col) % 16 bytes into it. "
               "The chunk moves to c ^ (row % 8), the bytes inside it stay: row * row_bytes + 16 * (c ^ (row % 8)) "
               "+ (2 * col) % 16.")
def check_swizzled_offset(t, fn):
    shapes = [(16, 64, 128), (8, 64, 128), (24, 64, 128), (8, 128, 256)]
    t.case(f"every value of tiles (rows, columns, row bytes) {shapes}")
    where = [(r, c, row_bytes) for rows, cols, row_bytes in shapes for r in range(rows) for c in range(cols)]
    got = int_answers(t, where)
    judge_answers(t, got, lambda **slip: [swizzled_offset(*w, **slip) for w in where], _SWIZZLE_SLIPS,
                  lambda i, want: f"row {where[i][0]}, col {where[i][1]}, {where[i][2]}-byte rows: you said byte "
                                  f"{got[i]}, the swizzled layout puts it at {want}")


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
          hint="Number the tile's 16-byte chunks row by row: a row of W words has W/4 of them. For a warp's reads to "
               "be consecutive, thread tid takes chunk tid first; all threads together then move on by `threads` "
               "chunks, a whole number of rows, so each thread keeps its column. Turn a chunk number into (row, "
               "column word), then into the shared word (rows W + 4 apart) and the source word (rows row_stride "
               "apart, from row k0). A row past n_k copies 0 bytes, from the same column of row k0.")
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
    fail_on_slip(t, got, lambda **slip: [copy_plan(*w, **slip) for w in where], _COPY_SLIPS)
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    tid, threads, d, block_k, k0, n_k, row_stride, wide = where[i]
    raise t.fail(f"{sum(g != w for g, w in zip(got, want))} of {len(got)} threads' plans are wrong; e.g. tid={tid} of "
                 f"{threads}, d={d}, block_k={block_k}, k0={k0}, n_k={n_k}, row_stride={row_stride}, wide={wide}: you "
                 f"said {got[i][:3]}{'...' if len(got[i]) > 3 else ''}, the kernel copies {want[i][:3]}"
                 f"{'...' if len(want[i]) > 3 else ''}")
