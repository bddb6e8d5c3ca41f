"""Lesson 20, FlashAttention-3 on Hopper: a wgmma matrix descriptor, the ring's mbarrier parities, where TMA puts
a value of a two-box swizzled tile, and a consumer's order of steps under pingpong and intra-warpgroup overlap.
The models are the kernel's own: flashlab.fragments (descriptors, TMA's layout) and flashlab.pipeline (the ring,
the schedule's rules), which tests/test_wgmma_forward.py and the simulator hold kernels/wgmma.py to."""
from __future__ import annotations

import numpy as np

from .. import fragments as F
from .. import pipeline as P
from .core import exercise, int_answers, judge_answers

LESSON = "20_flashattention3"


# ------------------------------------------------------------------------------------------------- descriptors
def descriptor(address, rows, major, k0, *, shift=True, mode=1, step_bytes=2, boxes=True, swap=False, mn_as_k=False):
    """wgmma's 64-bit descriptor of k16 step k0 of a 16-bit tile of `rows` rows laid out as 64-column TMA boxes
    with the 128-byte swizzle, starting at shared `address`; the keywords replay slips."""
    if major == "K" or mn_as_k:
        start = address + ((k0 // 64) * rows * 128 if boxes else 0) + (k0 % 64 if boxes else k0) * step_bytes
        lbo, sbo = 16, 1024
    else:
        start, lbo, sbo = address + k0 * 128, rows * 128, 1024
        if swap:
            lbo, sbo = sbo, lbo
    unit = 16 if shift else 1
    return (start // unit) | (lbo // unit) << 16 | (sbo // unit) << 32 | mode << 62


def _descriptor_model_agrees():
    """The replayable model is fragments' (operand_descriptor, matrix_descriptor): checked once at import."""
    for rows, major, k0 in ((128, "K", 80), (192, "K", 16), (128, "MN", 48), (176, "MN", 0)):
        start, lbo, sbo = F.operand_descriptor(rows, 128, major, k0, 128)
        assert descriptor(2048, rows, major, k0) == F.matrix_descriptor(2048 + start, lbo, sbo, 128)


_descriptor_model_agrees()

_DESCRIPTOR_SLIPS = [
    (dict(shift=False), "the address, LBO and SBO are stored in units of 16 bytes: each field is its byte count >> 4"),
    (dict(mode=3), "the 128-byte swizzle is mode 1 in bits 62-63 (3 is the 32-byte swizzle, 2 the 64-byte one)"),
    (dict(step_bytes=1), "k0 counts 16-bit values: a k16 step moves 2 bytes per value, 32 bytes per step"),
    (dict(boxes=False), "columns 64 to 127 are not further along a 128-byte row: they are TMA's second box, stored "
                        "after the first one's rows (rows * 128 bytes on)"),
    (dict(swap=True), "for the MN-major operand (V), LBO is the distance between the 64-column boxes along d "
                      "(rows * 128 bytes) and SBO the distance between groups of 8 rows (1024 bytes)"),
    (dict(mn_as_k=True), "V is read MN-major: its k16 step is 16 rows (keys) further down the tile, 16 * 128 bytes, "
                         "not 16 columns along a row"),
]


@exercise("wgmma_descriptor", lesson=LESSON,
          hint="Fields: bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 the swizzle mode (1 = 128 "
               "bytes). K-major (Q, K): start = address + (k0 // 64) * rows * 128 + (k0 % 64) * 2, LBO 16, SBO "
               "1024. MN-major (V): start = address + k0 * 128, LBO = rows * 128, SBO = 1024.")
def check_wgmma_descriptor(t, fn):
    cases = [(1024, 128, "K", 0), (1024, 128, "K", 16), (4096, 128, "K", 48), (1024, 128, "K", 64),
             (8192, 192, "K", 112), (1024, 128, "MN", 0), (1024, 128, "MN", 16), (16384, 176, "MN", 112),
             (2048, 64, "MN", 48)]
    for _ in range(4):
        rows = int(t.rng.choice([64, 128, 176, 192]))
        cases.append((1024 * int(t.rng.integers(1, 150)), rows, str(t.rng.choice(["K", "MN"])),
                      16 * int(t.rng.integers(0, 8))))
    t.case(f"{len(cases)} (address, rows, major, k0) of Q, K and V tiles, d = 128")
    got = int_answers(t, cases, "the descriptor")

    def mismatch(i, want):
        fields = lambda x: {**F.decode_descriptor(x & ~(7 << 49)), "mode bits": x >> 62}  # noqa: E731
        wrong = [f"{name}: yours decodes as {fields(got[i])[name]}, expected {value}"
                 for name, value in fields(want).items() if fields(got[i])[name] != value]
        return (f"for (address, rows, major, k0) = {cases[i]} the descriptor is 0x{want:016x}; you returned "
                f"0x{got[i]:016x} ({'; '.join(wrong)})")

    judge_answers(t, got, lambda **kw: [descriptor(*c, **kw) for c in cases], _DESCRIPTOR_SLIPS, mismatch)


# ----------------------------------------------------------------------------------------------------- the ring
def ring(j, stages, *, slot_fill=False, parity_of_j=False, empty_same=False, empty_always=False):
    """ring_fill with slips switched on."""
    fill = j // stages
    slot = fill if slot_fill else j % stages
    full = j % 2 if parity_of_j else fill % 2
    if empty_same:
        empty = full if fill else None
    else:
        empty = (fill - 1) % 2 if fill or empty_always else None
    return slot, full, empty


assert all(ring(j, s) == P.ring_fill(j, s) for j in range(12) for s in range(1, 5))

_RING_SLIPS = [
    (dict(slot_fill=True), "tile j goes to slot j % stages; j // stages counts how often that slot was filled before"),
    (dict(parity_of_j=True), "a slot's barrier moves one phase per fill of that slot: the parity is "
                             "(j // stages) % 2, not j % 2 (they agree only with one stage)"),
    (dict(empty_same=True), "the producer waits for the consumers' release of the slot's previous tile, parity "
                            "(j // stages - 1) % 2; the phase of tile j itself can never complete before tile j "
                            "is copied: a deadlock"),
    (dict(empty_always=True), "the first `stages` tiles go into slots nobody used yet: wait for nothing (None); a "
                              "wait on a phase that never ran never ends"),
]


@exercise("ring_parities", lesson=LESSON,
          hint="fill = j // stages: slot j % stages, the consumer's parity fill % 2, and the producer's "
               "(fill - 1) % 2 for the release of the slot's previous tile, or None when fill is 0.")
def check_ring_parities(t, fn):
    cases = [(j, s) for s in (1, 2, 3, 4) for j in range(3 * s + 2)]
    t.case("tiles j = 0 .. 3 * stages + 1 with 1, 2, 3 and 4 stages")
    got = []
    for j, s in cases:
        out = t.call(j, s)
        if not isinstance(out, tuple) or len(out) != 3 or not all(
                x is None or (isinstance(x, (int, np.integer)) and not isinstance(x, bool)) for x in out):
            raise t.fail(f"return a tuple (slot, full_parity, empty_parity) of ints (empty_parity may be None); for "
                         f"j={j}, stages={s} you returned {out!r:.60}")
        got.append(tuple(None if x is None else int(x) for x in out))
    judge_answers(t, got, lambda **kw: [ring(j, s, **kw) for j, s in cases], _RING_SLIPS,
                  lambda i, want: f"tile j={cases[i][0]} with {cases[i][1]} stages: (slot, full, empty) is {want}; "
                                  f"you returned {got[i]}")


# ---------------------------------------------------------------------------------------- a two-box tile
def box_offset(r, c, rows, *, swizzle=True, boxes=True, key=lambda r: r % 8, unit=16, box_rows=None):
    """Byte offset of value (r, c) of a (rows x 128) 16-bit tile that two TMA loads of 64-column boxes (128-byte
    swizzle) leave in shared memory; the keywords replay slips."""
    if boxes:
        linear = (c // 64) * (box_rows or rows) * 128 + r * 128 + (c % 64) * 2
    else:
        linear = r * 256 + c * 2
    if not swizzle:
        return linear
    row_start, byte = linear - linear % 128, linear % 128
    chunk, inside = divmod(byte, unit)  # unit 16: a 16-byte chunk; 2: one value (a slip)
    return row_start + (chunk ^ key(r)) * unit + inside


assert all(box_offset(r, c, rows) == F.tile_offsets(rows, 128, 2, 128)[r, c]
           for rows in (64, 176) for r in range(0, rows, 7) for c in range(0, 128, 5))

_BOX_SLIPS = [
    (dict(swizzle=False), "TMA's 128-byte swizzle moves each 16-byte chunk of a row: chunk c of row r is stored at "
                          "chunk c ^ (r % 8)"),
    (dict(boxes=False), "a 128-byte swizzled box is 64 values wide: columns 64-127 come from a second box, stored "
                        "after all rows of the first (rows * 128 bytes on), not in 256-byte rows"),
    (dict(key=lambda r: r), "XOR with r % 8: the pattern repeats every 8 rows (and chunk ^ r for r >= 8 is no "
                            "chunk of the row)"),
    (dict(unit=2), "the swizzle moves whole 16-byte chunks (8 values), not single values"),
    (dict(box_rows=64), "the second box starts after all `rows` rows of the first, rows * 128 bytes on, not after "
                        "64 rows"),
]


@exercise("box_offset", lesson=LESSON,
          hint="Box b = c // 64 starts at b * rows * 128; inside it row r is 128 bytes: byte (c % 64) * 2, chunk "
               "(c % 64) // 8. The chunk moves to chunk ^ (r % 8); the 2 * (c % 8) bytes inside it stay.")
def check_box_offset(t, fn):
    tiles = [64, 128, 176]
    t.case(f"every value of (rows x 128) tiles, rows in {tiles}")
    where = [(r, c, rows) for rows in tiles for r in range(rows) for c in range(0, 128, 3 if rows > 64 else 1)]
    got = int_answers(t, where)
    judge_answers(t, got, lambda **kw: [box_offset(*w, **kw) for w in where], _BOX_SLIPS,
                  lambda i, want: f"value (r, c) = {where[i][:2]} of a {where[i][2]}-row tile: TMA puts it at byte "
                                  f"{want}; you said {got[i]}")


# --------------------------------------------------------------------------------------- a consumer's iteration
@exercise("consumer_iteration", lesson=LESSON,
          hint="Data before it is read (wait K before issue S, wait V before issue PV); fence, then S before P V, "
               "between my turn and your turn; then wait S, release K, softmax while P V runs; then wait PV, "
               "release V, rescale+pack.")
def check_consumer_iteration(t, fn):
    t.case("one steady iteration of a consumer warpgroup")
    out = t.call()
    if not isinstance(out, (list, tuple)) or not all(isinstance(s, str) for s in out):
        raise t.fail(f"return a list of step names (strings); got {out!r:.80}")
    slips = P.schedule_slips(out)
    if slips:
        raise t.fail(slips[0], details=slips[1:4])


# ------------------------------------------------------------------------------------ the backward's operands
_PLACES, _MAJORS = ("shared", "registers"), ("K", "MN")
_OPERAND_SLIPS = {  # (product, wrong answer) -> why
    ("dV += P^T dO", ("registers", "K", "shared", "K")):
        "dO is stored with queries as rows, and dV's product sums over the queries: B runs down dO's rows, MN-major",
    ("dK += dS^T Q", ("registers", "K", "shared", "K")):
        "Q is stored with queries as rows, and dK's product sums over the queries: B runs down Q's rows, MN-major",
    ("dQ += dS K", ("registers", "K", "shared", "MN")):
        "dS^T's accumulator has keys as rows; dQ needs dS with queries as rows. Registers cannot transpose across "
        "threads: dS^T goes to shared memory, and wgmma reads it MN-major",
    ("dV += P^T dO", ("shared", "K", "shared", "MN")):
        "P^T is S^T's accumulator, already in registers in the A layout: it never goes to shared memory",
    ("dK += dS^T Q", ("shared", "K", "shared", "MN")):
        "dS^T is computed in registers in the A layout: dK's product takes it from there",
    ("S^T = K Q^T", ("shared", "K", "shared", "MN")):
        "S^T = K Q^T sums over d, and both K and Q are stored with d along their rows: both operands are K-major",
    ("dQ += dS K", ("shared", "MN", "shared", "K")):
        "dQ = dS K sums over the keys, and K is stored with keys as rows: B runs down K's rows, MN-major",
}


@exercise("backward_operands", lesson=LESSON,
          hint="For each product ask: which dimension is summed, and how is each operand stored? K, V, Q and dO are "
               "stored with d along their rows (keys or queries down). An operand is K-major when the summed "
               "dimension runs along its rows. An accumulator can be the next product's A from registers only "
               "if its rows are that product's rows.")
def check_backward_operands(t, fn):
    t.case("the five products of the backward")
    out = t.call()
    if not isinstance(out, dict) or set(out) != set(P.BACKWARD_OPERANDS):
        raise t.fail(f"return a dict with the keys {list(P.BACKWARD_OPERANDS)}; got "
                     f"{sorted(out) if isinstance(out, dict) else type(out).__name__}")
    for product, want in P.BACKWARD_OPERANDS.items():
        got = out[product]
        if not isinstance(got, tuple) or len(got) != 4 or got[0] not in _PLACES or got[2] not in _PLACES or \
                got[1] not in _MAJORS or got[3] not in _MAJORS:
            raise t.fail(f"{product}: give (A's place, A's major, B's place, B's major) with places in {_PLACES} "
                         f"and majors in {_MAJORS}; got {got!r:.80}")
        if got != want:
            why = _OPERAND_SLIPS.get((product, got))
            raise t.fail(why or f"{product}: ({', '.join(got)}) is not where the kernel finds these operands")


# ---------------------------------------------------------------------------------------- dQ's reduction
def _dq_model(n_q, n_k, d, bq, bk, itemsize, *, acc_bytes=4, per_key=False, k_only=False, blocks_of=None):
    atomics = (n_k if per_key else -(-n_k // bk)) * n_q * d * acc_bytes
    second = -(-n_q // (blocks_of or bq)) * n_k * d * (1 if k_only else 2) * itemsize
    return atomics, second


assert all(_dq_model(*c) == P.dq_traffic(*c) for c in ((4096, 4096, 64, 64, 128, 2), (1000, 300, 128, 64, 64, 2)))

_DQ_SLIPS = [
    (dict(acc_bytes=2), "dQ's shares are added in float32 (4 bytes a value), whatever the inputs' type: 16-bit sums "
                        "of many shares would lose the small ones"),
    (dict(per_key=True), "one share per key *block*: a block adds its block_k keys' contributions to each query "
                         "row at once"),
    (dict(k_only=True), "the second pass recomputes dS = P (dP - D), and dP = dO V^T needs V as well as K"),
    (dict(blocks_of=1), "the second pass re-reads K and V once per query *block* of block_q rows, not per row"),
]


@exercise("dq_traffic", lesson=LESSON,
          hint="Atomics: ceil(n_k / block_k) key blocks, each adding n_q x d float32 values (4 bytes). Second pass: "
               "ceil(n_q / block_q) query blocks, each reading all of K and V (n_k x d values each, itemsize bytes).")
def check_dq_traffic(t, fn):
    cases = [(4096, 4096, 64, 64, 128, 2), (16384, 16384, 128, 64, 128, 2), (1000, 300, 128, 64, 64, 2),
             (4096, 4096, 64, 128, 64, 4), (1, 1, 64, 64, 128, 2)]
    t.case("sequences of 1 to 16384, d 64 and 128, 16- and 32-bit inputs")
    got = []
    for c in cases:
        out = t.call(*c)
        if not isinstance(out, tuple) or len(out) != 2 or not all(
                isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in out):
            raise t.fail(f"return (atomic bytes, second-pass bytes) as two ints; for {c} you returned {out!r:.60}")
        got.append(tuple(int(x) for x in out))
    judge_answers(t, got, lambda **kw: [_dq_model(*c, **kw) for c in cases], _DQ_SLIPS,
                  lambda i, want: f"(n_q, n_k, d, block_q, block_k, itemsize) = {cases[i]}: expected {want}; you "
                                  f"returned {got[i]}")
