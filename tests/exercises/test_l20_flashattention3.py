"""Lesson 20's exercises (FlashAttention-3 on Hopper: a wgmma descriptor, the ring's parities, a two-box swizzled
tile, a consumer's order of steps): each checker passes the solution, grades the blank "not implemented", and
rejects plausible wrong solutions by name; the schedule's model is held to the kernel's own order."""
import inspect

from exercise_harness import Lesson

from flashlab import pipeline as P
from flashlab.grading.l20_flashattention3 import _dq_model, box_offset, descriptor, ring

LESSON = Lesson("20_flashattention3", min_alternatives=1)
mutant, alternative = LESSON.mutant, LESSON.alternative


# -- wgmma_descriptor ----------------------------------------------------------------------------------------
mutant("wgmma_descriptor", says="units of 16 bytes")(lambda a, rows, major, k0: descriptor(a, rows, major, k0,
                                                                                            shift=False))
mutant("wgmma_descriptor", says="mode 1")(lambda a, rows, major, k0: descriptor(a, rows, major, k0, mode=3))
mutant("wgmma_descriptor", says="2 bytes per value")(lambda a, rows, major, k0: descriptor(a, rows, major, k0,
                                                                                           step_bytes=1))
mutant("wgmma_descriptor", says="second box")(lambda a, rows, major, k0: descriptor(a, rows, major, k0, boxes=False))
mutant("wgmma_descriptor", says="LBO is the distance")(lambda a, rows, major, k0: descriptor(a, rows, major, k0,
                                                                                             swap=True))
mutant("wgmma_descriptor", says="MN-major")(lambda a, rows, major, k0: descriptor(a, rows, major, k0, mn_as_k=True))


@mutant("wgmma_descriptor", says="expected")
def descriptor_with_the_k_step_in_the_wrong_box(address, rows, major, k0):  # a slip no replay names: fields listed
    if major == "K":
        return descriptor(address, rows, major, (k0 + 64) % 128)
    return descriptor(address, rows, major, k0)


@alternative("wgmma_descriptor")
def descriptor_from_fields(address, rows, major, k0):
    if major == "K":
        start, lbo, sbo = address + (k0 // 64) * rows * 128 + (k0 % 64) * 2, 16, 1024
    else:
        start, lbo, sbo = address + 128 * k0, 128 * rows, 1024
    return sum(field >> 4 << shift for field, shift in ((start, 0), (lbo, 16), (sbo, 32))) + (1 << 62)


# -- ring_parities -------------------------------------------------------------------------------------------
mutant("ring_parities", says="j % stages")(lambda j, s: ring(j, s, slot_fill=True))
mutant("ring_parities", says="one phase per fill")(lambda j, s: ring(j, s, parity_of_j=True))
mutant("ring_parities", says="deadlock")(lambda j, s: ring(j, s, empty_same=True))
mutant("ring_parities", says="wait for nothing")(lambda j, s: ring(j, s, empty_always=True))


@alternative("ring_parities")
def ring_by_counting(j, stages):
    fills = sum(1 for i in range(j) if i % stages == j % stages)  # earlier tiles in the same slot
    return j % stages, fills & 1, (fills - 1) & 1 if fills else None


# -- box_offset ----------------------------------------------------------------------------------------------
mutant("box_offset", says="chunk c ^ (r % 8)")(lambda r, c, rows: box_offset(r, c, rows, swizzle=False))
mutant("box_offset", says="second box")(lambda r, c, rows: box_offset(r, c, rows, boxes=False))
mutant("box_offset", says="r % 8")(lambda r, c, rows: box_offset(r, c, rows, key=lambda x: x))
mutant("box_offset", says="16-byte chunks")(lambda r, c, rows: box_offset(r, c, rows, unit=2))
mutant("box_offset", says="not after 64 rows")(lambda r, c, rows: box_offset(r, c, rows, box_rows=64))


@alternative("box_offset")
def box_offset_by_bits(r, c, rows):
    linear = (c >> 6) * rows * 128 + r * 128 + (c & 63) * 2
    return linear ^ ((linear >> 3) & 0x70)  # bits 7-9 (the row within 8) onto bits 4-6 (the chunk)


# -- consumer_iteration --------------------------------------------------------------------------------------
def _order(*moves):
    """The kernel's order with each (step, new index) move applied in turn."""
    order = list(P.KERNEL_ORDER)
    for step, index in moves:
        order.remove(step)
        order.insert(index, step)
    return lambda: order


mutant("consumer_iteration", says="no longer runs under it")(_order(("issue PV", 4)))  # P V committed first
mutant("consumer_iteration", says="take turns instead of overlapping")(_order(("softmax", 10)))  # after wait PV
mutant("consumer_iteration", says="may still be running")(_order(("rescale+pack", 9)))  # before wait PV
mutant("consumer_iteration", says="before wgmma.fence")(_order(("fence", 5)))  # between the issues
mutant("consumer_iteration", says="pingpong serialises")(_order(("your turn", 7)))  # after wait S
mutant("consumer_iteration", says="K_j is held")(_order(("release K", 10)))  # after the softmax
mutant("consumer_iteration", says="before K_j has landed")(_order(("wait K", 5)))
mutant("consumer_iteration", says="each step once")(lambda: [s for s in P.KERNEL_ORDER if s != "release V"])
mutant("consumer_iteration", says="unknown step")(lambda: list(P.KERNEL_ORDER) + ["sync"])


@alternative("consumer_iteration")
def iteration_with_the_waits_swapped():
    order = list(P.KERNEL_ORDER)
    order[0], order[1] = order[1], order[0]  # V_{j-1} before K_j: both land before the GEMMs are issued
    return order


# -- backward_operands ---------------------------------------------------------------------------------------
def _operands(**changes):
    out = dict(P.BACKWARD_OPERANDS)
    out.update(changes)
    return lambda: out


mutant("backward_operands", says="MN-major")(_operands(**{"dV += P^T dO": ("registers", "K", "shared", "K")}))
mutant("backward_operands", says="cannot transpose")(_operands(**{"dQ += dS K": ("registers", "K", "shared", "MN")}))
mutant("backward_operands", says="never goes to shared memory")(
    _operands(**{"dV += P^T dO": ("shared", "K", "shared", "MN")}))
mutant("backward_operands", says="both operands are K-major")(
    _operands(**{"S^T = K Q^T": ("shared", "K", "shared", "MN")}))
mutant("backward_operands", says="keys as rows")(_operands(**{"dQ += dS K": ("shared", "MN", "shared", "K")}))


@alternative("backward_operands")
def operands_built_by_rule():
    kept = {"S^T = K Q^T": ("shared", "K", "shared", "K"), "dP^T = V dO^T": ("shared", "K", "shared", "K")}
    for product in ("dV += P^T dO", "dK += dS^T Q"):  # an accumulator as A, a row-major input summed down its rows
        kept[product] = ("registers", "K", "shared", "MN")
    kept["dQ += dS K"] = ("shared", "MN", "shared", "MN")
    return kept


# -- dq_traffic ----------------------------------------------------------------------------------------------
mutant("dq_traffic", says="float32")(lambda *c: _dq_model(*c, acc_bytes=2))
mutant("dq_traffic", says="key *block*")(lambda *c: _dq_model(*c, per_key=True))
mutant("dq_traffic", says="needs V as well")(lambda *c: _dq_model(*c, k_only=True))
mutant("dq_traffic", says="query *block*")(lambda *c: _dq_model(*c, blocks_of=1))


@alternative("dq_traffic")
def dq_traffic_by_blocks(n_q, n_k, d, block_q, block_k, itemsize):
    import math
    return math.ceil(n_k / block_k) * (n_q * d * 4), math.ceil(n_q / block_q) * (2 * n_k * d * itemsize)


def test_the_kernel_body_follows_the_models_order():
    """kernels/wgmma.py's loop calls its steps in KERNEL_ORDER (the lines the lesson prints)."""
    from flashlab.kernels import wgmma

    source = inspect.getsource(wgmma._kernel)
    loop = source[source.index("for j in range(1, n_tiles)"):source.index("last = (n_tiles")]
    marks = {"wait K": "FULL_K + s", "wait V": "FULL_V + prev", "my turn": "my_turn(", "fence": "wgmma_fence()",
             "issue S": "issue_scores(", "issue PV": "issue_pv(", "your turn": "your_turn(", "wait S": "wgmma_wait(1)",
             "release K": "EMPTY_K + s", "softmax": "softmax(", "wait PV": "wgmma_wait(0)",
             "release V": "EMPTY_V + prev", "rescale+pack": "rescale_and_pack("}
    order = sorted(marks, key=lambda step: loop.index(marks[step]))
    assert tuple(order) == P.KERNEL_ORDER and P.schedule_slips(order) == []


globals().update(LESSON.standard_tests())
