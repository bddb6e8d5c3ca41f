"""Hopper's instructions (sm_90a) as device functions, for FlashAttention-3 from pure-Python Numba kernels.

FlashAttention-3 feeds the tensor cores of an H100 with three things Ampere lacks: `wgmma` (a matrix multiply of
a whole warpgroup, 128 threads, reading its operands from shared memory), TMA (`cp.async.bulk.tensor`: one
thread copies a 2-D box of a matrix into shared memory) and `mbarrier` (a barrier in shared memory that counts
arrivals and bytes, so that threads wait for a copy to land). As in mma.py, each function is a Numba
`@intrinsic` that emits the PTX instruction on a GPU, and an exact emulation in the CUDA simulator:

    a = smem_address(tile, i)                            # the 32-bit shared address of tile[i]
    desc = make_descriptor(a, lbo, sbo, swizzle)         # wgmma's 64-bit matrix descriptor (swizzle 0/32/64/128)
    desc_later = descriptor_plus(desc, nbytes)           # the same for a + nbytes (a constant: one add, in a loop)
    mma = wgmma_ss(128, "float16")                       # at module level: m64n128k16, A and B by descriptor
    mma(acc, desc_a, desc_b, scale_d)                    # acc: cuda.local.array(64, float32); scale_d 0: acc = A @ B
    mma = wgmma_rs(64, "bfloat16", b_major="MN")         # A from 4 registers (P of P @ V), B row-major (V)
    mma(acc, a0, a1, a2, a3, desc_b, scale_d)
    wgmma_fence(); wgmma_commit(); wgmma_wait(0)         # before the first wgmma; close a group; wait for all but n
    mbarrier_init(bar, i, count)                         # bar: cuda.shared.array(k, uint64); count arrivals a phase
    mbarrier_arrive(bar, i); mbarrier_arrive_expect_tx(bar, i, nbytes)
    done = mbarrier_try_wait_parity(bar, i, parity); mbarrier_wait_parity(bar, i, parity)
    tma_load_2d(tile, i, tmap, col, row, bar, j)         # tmap = tensor_map_2d(matrix, box_rows, box_cols, swizzle)
    tma_load_4d(tile, i, tmap, col, row, head, batch, bar, j)   # tmap = tensor_map_4d(x, box_rows, box_cols, swizzle):
                                                         # a box of rows of x[batch, head] (any strides: a view of
                                                         # (B, N, H, d) memory as (B, H, N, d) is read in place)
    bulk_copy(tile, i, src, k, nbytes, bar, j)           # nbytes contiguous bytes from src[k:], completing on bar[j]
    bulk_reduce_add(dst, k, tile, i, nbytes)             # dst[k:] += nbytes of float32s from shared memory
    bulk_commit(); bulk_wait_read(0); bulk_wait(0)       # close the thread's group; wait until all but the newest n
                                                         # have read their source / completed
    fence_proxy_async()                                  # after threads write shared memory that wgmma/TMA reads
    fence_proxy_async_global()                           # between the async proxy's and threads' global accesses
    t = globaltimer()                                    # nanoseconds (uint64), the same clock for every SM
    setmaxnreg_inc(240); setmaxnreg_dec(40)              # a warpgroup's register budget (literal counts; the
                                                         # kernel needs cuda.jit(max_registers=...), or ptxas
                                                         # ignores them: "unable to determine register count")
    named_barrier_sync(id, count); named_barrier_arrive(id, count)   # bar.sync / bar.arrive, count threads

The layouts (which thread holds which element of D, where a swizzled tile puts (row, col), what a descriptor
reads) are modelled in NumPy by flashlab.fragments (wgmma_fragment_map, tile_offsets, operand_addresses, ...).
tests/test_hopper_intrinsics.py holds both the emulation and (on an H100/H200: scripts/gpu_check_hopper.py) the
hardware to that model.

The simulator:
- Shared memory has addresses: the first time a shared array's address is asked for (smem_address, a TMA or bulk
  destination), the block's *window* places it at the next 1024-byte boundary, and descriptors, TMA and the
  swizzle work on those addresses. On a GPU, give tiles that are swizzled `alignment=TILE_ALIGN` (1024; None in
  the simulator, whose shared arrays take no alignment).
- wgmma is warpgroup-collective: the 128 threads meet, the last one reads A and B through the descriptors,
  computes D with fragments.wgmma_mma (products exact, summed in float64 in order k = 0..15 onto C, rounded once
  to float32) and each thread gets its registers. The result is asynchronous, as on the GPU: it reaches `acc`
  at the wgmma_wait that retires its group, and a later wgmma on the same `acc` before then accumulates onto it.
  A wgmma before any wgmma_fence is refused.
- mbarrier keeps (phase, pending arrivals, expected arrivals, transaction bytes) per barrier word; a phase
  completes when no arrival is pending and the byte count is back to zero. TMA and bulk copies happen at once
  (zero fill past the matrix and the swizzle included) and then complete their bytes on the barrier. A bulk
  reduce reads its source and adds when a bulk wait retires its group (the latest moment the GPU may read it).
- A wait on an mbarrier or a named barrier that can never end (every thread of the block waiting) is reported.
- fence_proxy_async and fence_proxy_async_global are no-ops (copies and reads happen in program order here);
  setmaxnreg checks its count and that the whole warpgroup executes it; named barriers count threads.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref

import numpy as np
from numba import uint64

from .. import fragments as F
from ..device import device_limits, get_cuda, in_simulator
from .mma import SIMULATOR, WAIT_LIMIT, WarpDivergence, _address, _Warp, requires_cc

cuda = get_cuda()
TILE_ALIGN = None if SIMULATOR else 1024  # alignment= of swizzled shared tiles (the 128-byte pattern repeats at 1 KB)
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
MAJORS = ("K", "MN")
CC = (9, 0)  # every instruction here is sm_90 (wgmma and setmaxnreg need sm_90a, which numba-cuda targets)


def runs_on(cc) -> bool:
    """Whether the kernels built on these instructions run on a GPU of compute capability cc: on 9.0 alone. Per the
    PTX ISA, code for an "a" target such as sm_90a uses features of that architecture only and does not run on later
    GPUs, as code for plain sm_90 would."""
    return cc is not None and tuple(cc) == CC


def run_here_or_simulated(fn, *args):
    """fn(*args) where this process can run the Hopper kernels (Numba's CUDA simulator, or a GPU of compute
    capability 9.0); on any other GPU (Colab's T4, say), fn(*args) in a fresh Python on the simulator, through
    flashlab.device.in_simulator (whose rules fn follows: it imports what it uses, args are literals)."""
    cc = device_limits()["cc"]
    if cc is None or runs_on(cc):
        return fn(*args)
    print(f"This GPU (compute capability {cc[0]}.{cc[1]}) cannot run sm_90a code: {fn.__name__} runs in Numba's "
          f"CUDA simulator, in a separate Python.")
    return in_simulator(fn, *args)


FENCE = "wgmma.fence.sync.aligned;"
COMMIT = "wgmma.commit_group.sync.aligned;"
WAIT = "wgmma.wait_group.sync.aligned %d;"
FENCE_PROXY_ASYNC = "fence.proxy.async.shared::cta;"
FENCE_PROXY_ASYNC_GLOBAL = "fence.proxy.async.global;"  # the same between the proxies' global accesses
SETMAXNREG_INC, SETMAXNREG_DEC = "setmaxnreg.inc.sync.aligned.u32 %d;", "setmaxnreg.dec.sync.aligned.u32 %d;"
MBAR_INIT = "mbarrier.init.shared::cta.b64 [$0], $1;"
MBAR_ARRIVE = "mbarrier.arrive.shared::cta.b64 _, [$0];"
MBAR_EXPECT_TX = "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"
MBAR_TRY_WAIT = ("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                 "selp.u32 $0, 1, 0, p; }")
MBAR_WAIT = ("{ .reg .pred p; WAIT${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
             "@!p bra WAIT${:uid}; }")
TMA_LOAD_2D = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
               "[$0], [$1, {$2, $3}], [$4];")
TMA_LOAD_4D = ("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
               "[$0], [$1, {$2, $3, $4, $5}], [$6];")
BULK_COPY = ("{ .reg .u64 g; cvta.to.global.u64 g, $1; "
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [g], $2, [$3]; }")
# shared -> global, adding float32s (atomically, element by element), completing in a bulk group of the thread's
BULK_REDUCE_ADD = ("{ .reg .u64 g; cvta.to.global.u64 g, $0; "
                   "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [g], [$1], $2; }")
BULK_COMMIT = "cp.async.bulk.commit_group;"
BULK_WAIT_READ = "cp.async.bulk.wait_group.read %d;"  # the sources of all but the newest n groups were read
BULK_WAIT = "cp.async.bulk.wait_group %d;"  # all but the newest n groups are complete (their writes visible)
BAR_SYNC, BAR_ARRIVE = "bar.sync $0, $1;", "bar.arrive $0, $1;"
GLOBALTIMER = "mov.u64 $0, %globaltimer;"


def wgmma_ptx(n, dtype, a_major="K", b_major="K", a_in_registers=False) -> str:
    """The PTX of one wgmma m64nNk16 with fp32 accumulators; operands $0.. are D's n/2 registers, then A
    (a descriptor, or 4 registers), B's descriptor and scale_d (0: D = A @ B, else D = A @ B + D)."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"n must be a multiple of 8 in [8, 256]; got {n}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}; got {dtype!r}")
    for name, major in (("a_major", a_major), ("b_major", b_major)):
        if major not in MAJORS:
            raise ValueError(f"{name} must be 'K' (the default: A row-major, B column-major) or 'MN'; got {major!r}")
    if a_in_registers and a_major != "K":
        raise ValueError("A from registers has the K-major fragment layout; a_major must be 'K'")
    t, acc = DTYPES[dtype], n // 2
    d = ",".join(f"${i}" for i in range(acc))
    if a_in_registers:
        a = "{" + ",".join(f"${acc + i}" for i in range(4)) + "}"
        b, p, imm = f"${acc + 4}", f"${acc + 5}", f"{int(b_major == 'MN')}"
    else:
        a, b, p = f"${acc}", f"${acc + 1}", f"${acc + 2}"
        imm = f"{int(a_major == 'MN')}, {int(b_major == 'MN')}"
    # the immediates after the predicate: scale A by +1, scale B by +1, then the transpose bits
    return (f"{{ .reg .pred p; setp.ne.b32 p, {p}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} "
            f"{{{d}}}, {a}, {b}, p, 1, 1, {imm}; }}")


def _wgmma_name(n, dtype, a_major, b_major, a_in_registers):
    return f"wgmma_m64n{n}k16_{dtype}_{'rs' if a_in_registers else 'ss'}_{a_major}{b_major}"


# ------------------------------------------------------------------------------------------- GPU
def _gpu_functions():
    from llvmlite import ir
    from numba import types

    try:
        from numba.cuda.extending import intrinsic
    except ImportError:  # older numba-cuda
        from numba.core.extending import intrinsic

    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)

    def asm(builder, ret, args, text, cons):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), args)

    def shared(context, builder, array_type, array, index):
        """The 32-bit shared-window address of element `index` of a shared array (as mma.py's ldmatrix)."""
        ptr = builder.gep(context.make_array(array_type)(context, builder, array).data, [index])
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=3)), i32)

    def pointer(context, builder, array_type, array, index=None):
        data = context.make_array(array_type)(context, builder, array).data
        return builder.ptrtoint(data if index is None else builder.gep(data, [index]), i64)

    @intrinsic
    def smem_address(typingctx, array, index):
        def codegen(context, builder, sig, args):
            return shared(context, builder, sig.args[0], args[0], args[1])
        return types.uint32(array, types.intp), codegen

    def statement(ptx):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                asm(builder, ir.VoidType(), [], ptx, "~{memory}")
                return context.get_dummy_value()
            return types.void(), codegen
        return intrinsic(typer)

    def literal_statement(ptx, check):
        """An instruction with one immediate operand: the argument must be a literal integer."""
        def typer(typingctx, n):
            if not isinstance(n, types.IntegerLiteral):
                return None
            check(n.literal_value)
            text = ptx % n.literal_value

            def codegen(context, builder, sig, args):
                asm(builder, ir.VoidType(), [], text, "~{memory}")
                return context.get_dummy_value()
            return types.void(n), codegen
        return intrinsic(typer)

    def wgmma(n, dtype, a_major, b_major, a_in_registers):
        ptx, acc = wgmma_ptx(n, dtype, a_major, b_major, a_in_registers), n // 2
        operands = ["r"] * 4 + ["l", "r"] if a_in_registers else ["l", "l", "r"]
        cons = ",".join(["=f"] * acc + operands + [str(i) for i in range(acc)]) + ",~{memory}"

        def codegen(context, builder, sig, args):
            # acc's registers go in and come out of the instruction; a local array indexed by constants stays
            # in registers
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            slots = [builder.gep(data, [ir.Constant(i64, i)]) for i in range(acc)]
            res = asm(builder, ir.LiteralStructType([f32] * acc), list(args[1:]) + [builder.load(s) for s in slots],
                      ptx, cons)
            for i, s in enumerate(slots):
                builder.store(builder.extract_value(res, i), s)
            return context.get_dummy_value()

        def accumulator(acc_type):
            return isinstance(acc_type, types.Array) and acc_type.dtype == types.float32 and acc_type.ndim == 1

        if a_in_registers:
            def typer(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
                if not accumulator(acc):
                    return None
                return types.void(acc, *[types.uint32] * 4, types.uint64, types.int32), codegen
        else:
            def typer(typingctx, acc, desc_a, desc_b, scale_d):
                if not accumulator(acc):
                    return None
                return types.void(acc, types.uint64, types.uint64, types.int32), codegen
        typer.__name__ = _wgmma_name(n, dtype, a_major, b_major, a_in_registers)
        return intrinsic(typer)

    def barrier_op(ptx, n_values):
        """An mbarrier instruction on bar[index] with n_values 32-bit operands after the address."""
        if n_values == 0:
            def typer(typingctx, bar, index):
                def codegen(context, builder, sig, args):
                    asm(builder, ir.VoidType(), [shared(context, builder, sig.args[0], args[0], args[1])], ptx,
                        "r,~{memory}")
                    return context.get_dummy_value()
                return types.void(bar, types.intp), codegen
        else:
            def typer(typingctx, bar, index, value):
                def codegen(context, builder, sig, args):
                    asm(builder, ir.VoidType(), [shared(context, builder, sig.args[0], args[0], args[1]), args[2]],
                        ptx, "r,r,~{memory}")
                    return context.get_dummy_value()
                return types.void(bar, types.intp, types.int32), codegen
        return intrinsic(typer)

    @intrinsic
    def mbarrier_try_wait_parity(typingctx, bar, index, parity):
        def codegen(context, builder, sig, args):
            got = asm(builder, i32, [shared(context, builder, sig.args[0], args[0], args[1]), args[2]],
                      MBAR_TRY_WAIT, "=r,r,r,~{memory}")
            return builder.icmp_unsigned("!=", got, ir.Constant(i32, 0))
        return types.boolean(bar, types.intp, types.int32), codegen

    @intrinsic
    def globaltimer(typingctx):
        def codegen(context, builder, sig, args):
            return asm(builder, i64, [], GLOBALTIMER, "=l,~{memory}")
        return types.uint64(), codegen

    @intrinsic
    def tma_load_2d(typingctx, dst, dst_index, tmap, col, row, bar, bar_index):
        def codegen(context, builder, sig, args):
            a = sig.args
            ins = [shared(context, builder, a[0], args[0], args[1]), pointer(context, builder, a[2], args[2]),
                   args[3], args[4], shared(context, builder, a[5], args[5], args[6])]
            asm(builder, ir.VoidType(), ins, TMA_LOAD_2D, "r,l,r,r,r,~{memory}")
            return context.get_dummy_value()
        return types.void(dst, types.intp, tmap, types.int32, types.int32, bar, types.intp), codegen

    @intrinsic
    def tma_load_4d(typingctx, dst, dst_index, tmap, col, row, head, batch, bar, bar_index):
        def codegen(context, builder, sig, args):
            a = sig.args
            ins = [shared(context, builder, a[0], args[0], args[1]), pointer(context, builder, a[2], args[2]),
                   *args[3:7], shared(context, builder, a[7], args[7], args[8])]
            asm(builder, ir.VoidType(), ins, TMA_LOAD_4D, "r,l,r,r,r,r,r,~{memory}")
            return context.get_dummy_value()
        return types.void(dst, types.intp, tmap, types.int32, types.int32, types.int32, types.int32, bar,
                          types.intp), codegen

    @intrinsic
    def bulk_copy(typingctx, dst, dst_index, src, src_index, nbytes, bar, bar_index):
        def codegen(context, builder, sig, args):
            a = sig.args
            ins = [shared(context, builder, a[0], args[0], args[1]), pointer(context, builder, a[2], args[2], args[3]),
                   args[4], shared(context, builder, a[5], args[5], args[6])]
            asm(builder, ir.VoidType(), ins, BULK_COPY, "r,l,r,r,~{memory}")
            return context.get_dummy_value()
        return types.void(dst, types.intp, src, types.intp, types.int32, bar, types.intp), codegen

    @intrinsic
    def bulk_reduce_add(typingctx, dst, dst_index, src, src_index, nbytes):
        def codegen(context, builder, sig, args):
            a = sig.args
            ins = [pointer(context, builder, a[0], args[0], args[1]), shared(context, builder, a[2], args[2], args[3]),
                   args[4]]
            asm(builder, ir.VoidType(), ins, BULK_REDUCE_ADD, "l,r,r,~{memory}")
            return context.get_dummy_value()
        return types.void(dst, types.intp, src, types.intp, types.int32), codegen

    def named_barrier(ptx):
        def typer(typingctx, barrier_id, count):
            def codegen(context, builder, sig, args):
                asm(builder, ir.VoidType(), list(args), ptx, "r,r,~{memory}")
                return context.get_dummy_value()
            return types.void(types.int32, types.int32), codegen
        return intrinsic(typer)

    fns = dict(smem_address=smem_address, wgmma_fence=statement(FENCE), wgmma_commit=statement(COMMIT),
               wgmma_wait=literal_statement(WAIT, _check_pending),
               fence_proxy_async=statement(FENCE_PROXY_ASYNC),
               fence_proxy_async_global=statement(FENCE_PROXY_ASYNC_GLOBAL), globaltimer=globaltimer,
               setmaxnreg_inc=literal_statement(SETMAXNREG_INC, _check_registers),
               setmaxnreg_dec=literal_statement(SETMAXNREG_DEC, _check_registers),
               mbarrier_init=barrier_op(MBAR_INIT, 1), mbarrier_arrive=barrier_op(MBAR_ARRIVE, 0),
               mbarrier_arrive_expect_tx=barrier_op(MBAR_EXPECT_TX, 1),
               mbarrier_try_wait_parity=mbarrier_try_wait_parity, mbarrier_wait_parity=barrier_op(MBAR_WAIT, 1),
               tma_load_2d=tma_load_2d, tma_load_4d=tma_load_4d, bulk_copy=bulk_copy,
               bulk_reduce_add=bulk_reduce_add,
               bulk_commit=statement(BULK_COMMIT), bulk_wait_read=literal_statement(BULK_WAIT_READ, _check_pending),
               bulk_wait=literal_statement(BULK_WAIT, _check_pending),
               named_barrier_sync=named_barrier(BAR_SYNC), named_barrier_arrive=named_barrier(BAR_ARRIVE))
    return fns, wgmma


def _check_pending(n):
    if not 0 <= n <= 7:
        raise ValueError(f"wgmma_wait: n (groups left pending) must be in [0, 7]; got {n}")


def _check_registers(n):
    if not 24 <= n <= 256 or n % 8:
        raise ValueError(f"setmaxnreg: the register count must be a multiple of 8 in [24, 256]; got {n}")


# ------------------------------------------------------------------------------------- simulator
class BarrierDeadlock(RuntimeError):
    """Every thread of a simulated block waits, and the barrier a thread waits on can no longer complete."""


STUCK_GRACE = 0.3  # seconds every thread of the block must stay waiting before the simulator calls it a deadlock
# a waiting thread looks for a deadlock after POLL seconds, then ever less often, up to every POLL_MAX (each look
# wakes the thread, and a block has hundreds waiting)
POLL, POLL_MAX = 0.02, 0.16


class _Window:
    """A block's shared memory as addresses: each shared array gets a 1024-byte-aligned range when first asked
    for, in the order asked (a GPU lays arrays out its own way; only their alignment matters to the swizzle)."""

    START, LIMIT = 1024, 227 * 1024  # the H100's largest shared memory per block

    def __init__(self):
        self.lock = threading.Lock()
        self.bases, self.roots, self.views = [], [], {}
        self.by_root = {}  # root array's host address -> window address
        self.next = self.START

    def address(self, array, index, op) -> int:
        view = getattr(array, "_ary", array)
        root = view
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not root.flags.c_contiguous:
            raise ValueError(f"{op}: expected a shared array (cuda.shared.array); got a {type(array).__name__}")
        host = _address(root)
        with self.lock:
            base = self.by_root.get(host)
            if base is None:
                base = -(-self.next // 1024) * 1024
                if base + root.nbytes > self.START + self.LIMIT:
                    raise MemoryError(f"{op}: this block's shared arrays take more than {self.LIMIT // 1024} KB")
                self.by_root[host], self.next = base, base + root.nbytes
                self.bases.append(base)
                self.roots.append(root.reshape(-1).view(np.uint8))
        offset = _address(view) - host + int(index) * view.itemsize
        if not 0 <= offset < root.nbytes:
            raise IndexError(f"{op}: index {int(index)} is outside the shared array ({view.size} elements)")
        return base + offset

    def _locate(self, addresses, itemsize, op):
        flat = np.asarray(addresses, np.int64).ravel()
        if (flat % itemsize).any():
            raise ValueError(f"{op}: shared address 0x{int(flat[flat % itemsize != 0][0]):x} is not "
                             f"{itemsize}-byte aligned")
        with self.lock:
            bases, roots = np.array(self.bases, np.int64), list(self.roots)
        which = np.searchsorted(bases, flat, side="right") - 1
        sizes = np.array([r.size for r in roots], np.int64)
        inside = (which >= 0) & (flat + itemsize <= bases[which] + sizes[which])
        if not inside.all():
            bad = int(flat[~inside][0])
            raise ValueError(f"{op}: shared address 0x{bad:x} is in no shared array of this block (a wrong "
                             "descriptor, or an array whose address was never taken with smem_address)")
        return flat, which, bases, roots

    def read(self, addresses, itemsize, op):
        flat, which, bases, roots = self._locate(addresses, itemsize, op)
        out = np.empty(flat.shape, f"u{itemsize}")
        for j in np.unique(which):
            m = which == j
            out[m] = roots[j].view(f"u{itemsize}")[(flat[m] - bases[j]) // itemsize]
        return out.reshape(np.shape(addresses))

    def write(self, addresses, values, op):
        values = np.ascontiguousarray(values)
        itemsize = values.dtype.itemsize
        flat, which, bases, roots = self._locate(addresses, itemsize, op)
        values = values.reshape(-1).view(f"u{itemsize}")
        for j in np.unique(which):
            m = which == j
            roots[j].view(f"u{itemsize}")[(flat[m] - bases[j]) // itemsize] = values[m]

    def operand(self, desc, rows, major, dtype, op):
        """The (rows, 16) values wgmma reads through a descriptor."""
        f = F.decode_descriptor(desc)
        sw = f["swizzle"]
        if sw and (f["start"] >> 7) & (sw // 16 - 1):
            raise ValueError(f"{op}: descriptor start 0x{f['start']:x} is {f['start'] % (8 * sw)} bytes past a "
                             f"{8 * sw}-byte boundary; a {sw}-byte swizzled tile starts on one (a step along K "
                             "may add up to 112 bytes)")
        return F.from_bits16(self.read(F.operand_addresses(desc, rows, major, 2), 2, op), dtype)


class _MBarrier:
    def __init__(self, count):
        self.phase, self.pending, self.expected, self.tx = 0, count, count, 0

    def settle(self) -> bool:
        """Complete the phase if nothing is pending; True if it did (the only change a waiter waits for)."""
        if self.pending == 0 and self.tx == 0:  # the phase completes: the next begins with every arrival due
            self.phase ^= 1
            self.pending = self.expected
            return True
        return False

    def describe(self):
        return (f"phase {self.phase} (parity {self.phase}) with {self.pending} of {self.expected} arrivals pending "
                f"and {self.tx} transaction bytes outstanding")


class _Block:
    """What the Hopper emulation keeps per simulated block: the window, barriers, warpgroups."""

    def __init__(self):
        self.cond = threading.Condition()
        self.window = _Window()
        self.mbarriers, self.named, self.groups = {}, {}, {}
        self.waits = {}  # thread -> done() of the mbarrier or named-barrier wait it is in


_BLOCK_LOCK = threading.Lock()


def _block(op):
    me = threading.current_thread()
    manager = getattr(me, "_manager", None)
    if manager is None:
        raise RuntimeError(f"{op} is a device instruction: call it inside a kernel launched on the simulator")
    block = manager.__dict__.get("_flashlab_hopper")
    if block is None:
        with _BLOCK_LOCK:
            block = manager.__dict__.setdefault("_flashlab_hopper", _Block())
    return me, manager, block


def every_thread_waits(manager, block) -> bool:
    """Whether each thread of the block is in a wait that is not done, at cuda.syncthreads(), or finished (flashlab's
    block loop counts its threads: device.py)."""
    count = getattr(manager, "count", None)
    if count is None or len(block.waits) + manager.waiting + manager.finished < count:
        return False  # the cheap test first: each waiting thread polls this (POLL, then less often)
    return sum(not done() for done in block.waits.values()) + manager.waiting + manager.finished >= count


def _wait(me, manager, block, done, what):
    """Wait, holding block.cond, until done(); raise BarrierDeadlock when every thread of the block is waiting
    (here on a wait that is not done, at cuda.syncthreads() or finished) for STUCK_GRACE seconds, or after
    WAIT_LIMIT seconds. A thread whose wait is done but that has not run again yet (a busy machine can leave it
    unscheduled for longer than the grace) is not stuck."""
    if done():
        return
    block.waits[me] = done
    try:
        start, stuck, poll = time.monotonic(), None, POLL
        while not done():
            block.cond.wait(poll)
            poll = min(2 * poll, POLL_MAX)  # its barrier wakes a wait; the poll only looks for a deadlock
            if getattr(me, "abort", False):
                raise RuntimeError("another thread of this block failed")
            if done():
                break
            now = time.monotonic()
            if every_thread_waits(manager, block):
                stuck = stuck or now
                if now - stuck > STUCK_GRACE:
                    raise BarrierDeadlock(f"{what()}, and every thread of the block is waiting: it can never end")
            else:
                stuck = None
            if now - start > WAIT_LIMIT:
                raise BarrierDeadlock(f"{what()}, after {WAIT_LIMIT:.0f} s")
    finally:
        del block.waits[me]


class _Warpgroup(_Warp):
    """The meeting point of one warpgroup's 128 threads (mma._Warp's, for 4 warps)."""

    def __init__(self, wg):
        super().__init__(F.WG_THREADS, 4 * wg)  # _Warp._lanes_gone counts its threads from 32 * warp
        self.wg = wg

    def diverged(self, ops) -> str:
        return (f"threads of warpgroup {self.wg} reached different warpgroup instructions at once "
                f"({', '.join(sorted(ops))})")

    def missing(self, op, rank) -> str:
        return (f"{op}: thread {rank} of warpgroup {self.wg} waited for the others, but only {self.count} of 128 "
                "arrived. A warpgroup instruction is executed by all 128 threads (4 warps) together: no thread may "
                "return early or skip it inside an `if`.")


def _warpgroup(op):
    me, manager, block = _block(op)
    threads = int(np.prod(manager._block_dim))
    wg, rank = divmod(int(me.thread_id), F.WG_THREADS)
    if (wg + 1) * F.WG_THREADS > threads:  # a block may end in a partial warpgroup that never runs one
        raise WarpDivergence(f"{op} needs a whole warpgroup of 128 threads; thread {int(me.thread_id)} is in "
                             f"warpgroup {wg}, which this block of {threads} threads leaves incomplete")
    with block.cond:
        group = block.groups.get(wg) or block.groups.setdefault(wg, _Warpgroup(wg))
    return me, block, rank, group


class _Async:
    """One thread's wgmma in flight: issued but not committed, committed groups, the latest value of each acc."""

    def __init__(self):
        self.fenced = False
        self.uncommitted, self.groups, self.latest = [], [], {}


class _Bulk:
    """One thread's bulk copies to global memory: issued but not committed, and committed groups."""

    def __init__(self):
        self.uncommitted, self.groups = [], []


_REDUCE_LOCK = threading.Lock()


def _bulk(me):
    state = me.__dict__.get("_flashlab_bulk")
    if state is None:
        state = me._flashlab_bulk = _Bulk()
    return state


def _async(me):
    state = me.__dict__.get("_flashlab_wgmma")
    if state is None:
        state = me._flashlab_wgmma = _Async()
    return state


def _sim_wgmma(n, dtype, a_major, b_major, a_in_registers):
    wgmma_ptx(n, dtype, a_major, b_major, a_in_registers)  # checks the arguments
    name = _wgmma_name(n, dtype, a_major, b_major, a_in_registers)

    def combine(block, values):
        shared_args = {v[:2] for v in values}
        if len(shared_args) > 1:
            raise ValueError(f"{name}: the 128 threads gave different descriptors or scale_d; wgmma takes one")
        desc_b, scale_d = shared_args.pop()
        if a_in_registers:
            lo, hi = F.unpack16(np.array([v[3] for v in values], np.uint32))
            a = F.wgmma_from_fragments(F.from_bits16(np.stack([lo, hi], -1).reshape(F.WG_THREADS, 8), dtype),
                                       operand="A")
        else:
            descs = {v[3] for v in values}
            if len(descs) > 1:
                raise ValueError(f"{name}: the 128 threads gave different descriptors for A")
            a = block.window.operand(descs.pop(), F.WGMMA_M, a_major, dtype, name)
        b = block.window.operand(desc_b, n, b_major, dtype, name).T
        c = F.wgmma_from_fragments(np.stack([v[2] for v in values]), n)
        return list(F.wgmma_to_fragments(F.wgmma_mma(a, b, c, scale_d), n))

    def issue(acc, *args):
        me, block, rank, group = _warpgroup(name)
        if len(acc) != n // 2:
            raise ValueError(f"{name}: acc must hold n / 2 = {n // 2} float32 registers; got {len(acc)}")
        state = _async(me)
        if not state.fenced:
            raise RuntimeError(f"{name}: call wgmma_fence() before the warpgroup's first wgmma (it orders the "
                               "registers the threads wrote before it)")
        c = np.array(state.latest.get(id(acc), (acc, acc))[1], np.float32)
        if a_in_registers:
            *a, desc_b, scale_d = args
            value = (int(desc_b), bool(scale_d), c, tuple(int(x) for x in a))
        else:
            desc_a, desc_b, scale_d = args
            value = (int(desc_b), bool(scale_d), c, int(desc_a))
        d = np.array(group.collective(rank, name, value, lambda values: combine(block, values)), np.float32)
        state.uncommitted.append((acc, d))
        state.latest[id(acc)] = (acc, d)

    issue.__name__ = name
    return issue


def _sim_functions():
    def smem_address(array, index):
        _, _, block = _block("smem_address")
        return np.uint32(block.window.address(array, index, "smem_address"))

    def wgmma_fence():
        _async(threading.current_thread()).fenced = True

    def wgmma_commit():
        state = _async(threading.current_thread())
        state.groups.append(state.uncommitted)  # an empty group counts too, as in PTX
        state.uncommitted = []

    def wgmma_wait(n):
        _check_pending(int(n))
        state = _async(threading.current_thread())
        while len(state.groups) > int(n):
            for acc, d in state.groups.pop(0):  # oldest first: a later result for the same acc lands last
                acc[:] = d
                if state.latest.get(id(acc), (None, None))[1] is d:
                    del state.latest[id(acc)]

    def fence_proxy_async():
        pass

    def fence_proxy_async_global():
        pass

    def globaltimer():
        return np.uint64(time.perf_counter_ns())

    def setmaxnreg(kind):
        def set_registers(n):
            _check_registers(int(n))
            me, block, rank, group = _warpgroup(f"setmaxnreg_{kind}")
            group.collective(rank, f"setmaxnreg_{kind}({int(n)})", None, lambda values: [None] * len(values))
        set_registers.__name__ = f"setmaxnreg_{kind}"
        return set_registers

    def word(bar, index, op):
        view = getattr(bar, "_ary", bar)
        if view.itemsize != 8:
            raise TypeError(f"{op}: an mbarrier is one 64-bit word; pass a uint64 shared array, not {view.dtype}")
        if not 0 <= int(index) < view.size:
            raise IndexError(f"{op}: barrier index {int(index)} is outside the array of {view.size}")
        return _address(view) + 8 * int(index)

    def barrier(block, bar, index, op):
        b = block.mbarriers.get(word(bar, index, op))
        if b is None:
            raise RuntimeError(f"{op}: mbarrier {int(index)} was never initialised in this block (mbarrier_init by "
                               "one thread, then cuda.syncthreads() before others use it)")
        return b

    def mbarrier_init(bar, index, count):
        _, _, block = _block("mbarrier_init")
        if not 1 <= int(count) < 2**20:
            raise ValueError(f"mbarrier_init: count must be in [1, 2**20); got {int(count)}")
        with block.cond:
            block.mbarriers[word(bar, index, "mbarrier_init")] = _MBarrier(int(count))
            block.cond.notify_all()

    def arrive(block, bar, index, nbytes, op):
        with block.cond:
            b = barrier(block, bar, index, op)
            if b.pending == 0:
                raise RuntimeError(f"{op}: mbarrier {int(index)} got more arrivals than its count ({b.expected}) "
                                   "in one phase")
            b.tx += nbytes
            b.pending -= 1
            if b.settle():  # wake the waiters only when the phase completes (256 consumers arrive on one barrier)
                block.cond.notify_all()

    def mbarrier_arrive(bar, index):
        arrive(_block("mbarrier_arrive")[2], bar, index, 0, "mbarrier_arrive")

    def mbarrier_arrive_expect_tx(bar, index, nbytes):
        if not 0 <= int(nbytes) < 2**20:
            raise ValueError(f"mbarrier_arrive_expect_tx: nbytes must be in [0, 2**20); got {int(nbytes)}")
        arrive(_block("mbarrier_arrive_expect_tx")[2], bar, index, int(nbytes), "mbarrier_arrive_expect_tx")

    def complete_tx(block, bar, index, nbytes, op):
        with block.cond:
            b = barrier(block, bar, index, op)
            b.tx -= nbytes
            if b.settle():
                block.cond.notify_all()

    def mbarrier_try_wait_parity(bar, index, parity):
        _, _, block = _block("mbarrier_try_wait_parity")
        with block.cond:
            b = barrier(block, bar, index, "mbarrier_try_wait_parity")
            if b.phase == int(parity) & 1:  # as the hardware, wait a little before answering no
                block.cond.wait(0.001)
            return b.phase != int(parity) & 1

    def mbarrier_wait_parity(bar, index, parity):
        me, manager, block = _block("mbarrier_wait_parity")
        with block.cond:
            b = barrier(block, bar, index, "mbarrier_wait_parity")
            _wait(me, manager, block, lambda: b.phase != int(parity) & 1,
                  lambda: f"thread {me.thread_id} waits for the phase of parity {int(parity) & 1} of mbarrier "
                          f"{int(index)} to complete; it is in {b.describe()}")

    def tma_load(op, dst, dst_index, tmap, rank, col, row, head, batch, bar, bar_index):
        _, _, block = _block(op)
        src, box_rows, box_cols, swizzle = _source(tmap, rank, op)
        if 0 <= head < src.shape[1] and 0 <= batch < src.shape[0]:
            box = F.tma_box(src[batch, head], int(row), int(col), box_rows, box_cols)
        else:  # the box lies outside the tensor: zeros, as on the GPU
            box = np.zeros((box_rows, box_cols), src.dtype)
        start = block.window.address(dst, dst_index, op)
        boundary = 8 * swizzle if swizzle else 128
        if start % boundary:
            raise ValueError(f"{op}: the destination (shared address 0x{start:x}) must start on a "
                             f"{boundary}-byte boundary" + (f" for {swizzle}-byte swizzle" if swizzle else ""))
        block.window.write(start + F.box_offsets(box_rows, box_cols, box.itemsize, swizzle), box, op)
        complete_tx(block, bar, bar_index, box.nbytes, op)

    def tma_load_2d(dst, dst_index, tmap, col, row, bar, bar_index):
        tma_load("tma_load_2d", dst, dst_index, tmap, 2, col, row, 0, 0, bar, bar_index)

    def tma_load_4d(dst, dst_index, tmap, col, row, head, batch, bar, bar_index):
        tma_load("tma_load_4d", dst, dst_index, tmap, 4, col, row, int(head), int(batch), bar, bar_index)

    def bulk_operands(op, block, memory, index, role, shared, shared_index, nbytes):
        """A bulk copy's checks: nbytes a positive multiple of 16, the global `role` (source or destination)
        memory[index:] contiguous, 16-byte aligned and inside its array, the shared side 16-byte aligned.
        Returns (the global array, flat; its first byte; the shared address)."""
        if nbytes <= 0 or nbytes % 16:
            raise ValueError(f"{op}: nbytes must be a positive multiple of 16; got {nbytes}")
        if not memory.flags.c_contiguous:
            raise ValueError(f"{op}: the {role} must be a contiguous array")
        first = int(index) * memory.itemsize
        if (_address(memory) + first) % 16 or first + nbytes > memory.nbytes or first < 0:
            raise ValueError(f"{op}: {role} bytes [{first}, {first + nbytes}) must be 16-byte aligned and inside the "
                             f"array ({memory.nbytes} bytes)")
        start = block.window.address(shared, shared_index, op)
        if start % 16:
            other = "destination" if role == "source" else "source"
            raise ValueError(f"{op}: the {other} (shared address 0x{start:x}) must be 16-byte aligned")
        return memory.reshape(-1), first, start

    def bulk_copy(dst, dst_index, src, src_index, nbytes, bar, bar_index):
        _, _, block = _block("bulk_copy")
        nbytes = int(nbytes)
        source, first, start = bulk_operands("bulk_copy", block, getattr(src, "_ary", src), src_index, "source", dst,
                                             dst_index, nbytes)
        data = source.view(np.uint8)[first:first + nbytes]
        block.window.write(start + np.arange(nbytes), data, "bulk_copy")
        complete_tx(block, bar, bar_index, nbytes, "bulk_copy")

    def bulk_reduce_add(dst, dst_index, src, src_index, nbytes):
        """Checked now; performed (shared memory read, float32s added) when a bulk wait retires its group, the
        latest moment the hardware may read the source: a kernel that rewrites the source before waiting, or never
        waits, gets wrong sums here."""
        me, _, block = _block("bulk_reduce_add")
        target = getattr(dst, "_ary", dst)
        if target.dtype != np.float32:
            raise ValueError(f"bulk_reduce_add: the destination must be a float32 array; got {target.dtype}")
        target, first, start = bulk_operands("bulk_reduce_add", block, target, dst_index, "destination", src,
                                             src_index, int(nbytes))
        _bulk(me).uncommitted.append((block, target, first // 4, start, int(nbytes) // 4))

    def bulk_commit():
        state = _bulk(threading.current_thread())
        state.groups.append(state.uncommitted)
        state.uncommitted = []

    def bulk_retire(n, op):
        _check_pending(int(n))
        state = _bulk(threading.current_thread())
        while len(state.groups) > int(n):
            for block, target, first, start, count in state.groups.pop(0):
                values = block.window.read(start + 4 * np.arange(count), 4, op).view(np.float32)
                with _REDUCE_LOCK:
                    target[first:first + count] += values

    def bulk_wait_read(n):
        bulk_retire(n, "bulk_wait_read")

    def bulk_wait(n):
        bulk_retire(n, "bulk_wait")

    def named_barrier(wait):
        op = "named_barrier_sync" if wait else "named_barrier_arrive"

        def bar(barrier_id, count):
            me, manager, block = _block(op)
            barrier_id, count = int(barrier_id), int(count)
            threads = int(np.prod(manager._block_dim))
            if not 0 <= barrier_id < 16:
                raise ValueError(f"{op}: barrier id must be in [0, 16); got {barrier_id}")
            if count <= 0 or count % 32 or count > threads:
                raise ValueError(f"{op}: count must be a multiple of 32 threads, at most the block's {threads}; "
                                 f"got {count}")
            with block.cond:
                state = block.named.setdefault(barrier_id, [count, 0, 0])  # count, arrived, generation
                if state[1] and state[0] != count:
                    raise ValueError(f"{op}: barrier {barrier_id} is in use with count {state[0]}; got {count}")
                state[0], state[1] = count, state[1] + 1
                gen = state[2]
                if state[1] == count:
                    state[1], state[2] = 0, gen + 1
                    block.cond.notify_all()
                elif wait:
                    _wait(me, manager, block, lambda: state[2] != gen,
                          lambda: f"thread {me.thread_id} waits at named barrier {barrier_id} for {count} threads; "
                                  f"{state[1]} arrived")
        bar.__name__ = op
        return bar

    fns = dict(smem_address=smem_address, wgmma_fence=wgmma_fence, wgmma_commit=wgmma_commit, wgmma_wait=wgmma_wait,
               fence_proxy_async=fence_proxy_async, fence_proxy_async_global=fence_proxy_async_global,
               globaltimer=globaltimer, setmaxnreg_inc=setmaxnreg("inc"),
               setmaxnreg_dec=setmaxnreg("dec"), mbarrier_init=mbarrier_init, mbarrier_arrive=mbarrier_arrive,
               mbarrier_arrive_expect_tx=mbarrier_arrive_expect_tx,
               mbarrier_try_wait_parity=mbarrier_try_wait_parity, mbarrier_wait_parity=mbarrier_wait_parity,
               tma_load_2d=tma_load_2d, tma_load_4d=tma_load_4d, bulk_copy=bulk_copy,
               bulk_reduce_add=bulk_reduce_add,
               bulk_commit=bulk_commit, bulk_wait_read=bulk_wait_read, bulk_wait=bulk_wait,
               named_barrier_sync=named_barrier(True), named_barrier_arrive=named_barrier(False))
    return {name: _hopper_only(fn) for name, fn in fns.items()}, lambda *key: _hopper_only(_sim_wgmma(*key))


def _hopper_only(fn):
    """fn, refused where the simulator stands in for a GPU older than Hopper (FLASHLAB_SIMULATE_GPU)."""
    return requires_cc(fn, CC, f"{fn.__name__} is a Hopper instruction (compute capability 9.0)")


# ------------------------------------------------------------------------------------- tensor maps
_TMAP_MAGIC = 0x464C5F544D4150  # the simulator's record: "FL_TMAP"
_SOURCES = {}  # simulator: host address of a tensor map's matrix -> (weak reference to its array, its address)


def _matrix_facts(matrix):
    """(address, (rows, cols), row stride in bytes, itemsize) of a 2-D matrix on the device (or, in the
    simulator, a NumPy array)."""
    if SIMULATOR:
        ary = getattr(matrix, "_ary", matrix)
        if not isinstance(ary, np.ndarray):
            raise TypeError(f"matrix must be a device array or a NumPy array; got {type(matrix).__name__}")
        return _address(ary), ary.shape, ary.strides, ary.itemsize
    cai = matrix.__cuda_array_interface__
    itemsize = np.dtype(cai["typestr"]).itemsize
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
    return cai["data"][0], shape, tuple(strides), itemsize


def tensor_map_2d(matrix, box_rows, box_cols, swizzle=128):
    """A TMA tensor map of a 2-D device matrix (rows contiguous), for tma_load_2d: boxes of box_rows x box_cols
    elements, stored into shared memory with a swizzle of 0 (none), 32, 64 or 128 bytes; elements outside the
    matrix read as zeros. Returns a device array of 16 uint64 (the 128-byte map) to pass to the kernel.

    On a GPU the map is cuTensorMapEncodeTiled's (cuda-bindings). In the simulator it is a record of the matrix's
    address, shape, row stride, box and swizzle; the matrix must stay alive while the map is used (as on a GPU).
    A swizzled box here has rows of exactly `swizzle` bytes (the layout fragments.box_offsets models)."""
    address, shape, strides, itemsize = _matrix_facts(matrix)
    if len(shape) != 2:
        raise ValueError(f"matrix must be 2-D; got shape {shape}")
    rows, cols = shape
    given, strides = strides, tma_strides(shape, strides, address, itemsize)
    if strides is None:
        raise ValueError(f"matrix must have contiguous rows, a row stride that is a positive multiple of 16 bytes "
                         f"and a 16-byte aligned start; got strides {tuple(given)} (bytes), address 0x{address:x}")
    return _tensor_map(matrix, address, (rows, 1, 1), (strides[0], 0, 0), cols, itemsize, box_rows, box_cols,
                       swizzle, 2)


def tensor_map_4d(array, box_rows, box_cols, swizzle=128):
    """A TMA tensor map of a 4-D device array (B, H, rows, cols), for tma_load_4d: boxes of box_rows x box_cols
    elements of one x[batch, head] matrix, swizzled as tensor_map_2d's; elements outside it (past its rows or
    columns, or of a batch or head outside the array) read as zeros. The last axis must be contiguous; the other
    strides are any multiples of 16 bytes, so a (B, N, H, d) tensor's (B, H, N, d) view (x.transpose(1, 2)) is
    read where it lies, with no copy."""
    address, shape, strides, itemsize = _matrix_facts(array)
    if len(shape) != 4:
        raise ValueError(f"array must be 4-D (B, H, rows, cols); got shape {shape}")
    B, H, rows, cols = shape
    given, strides = strides, tma_strides(shape, strides, address, itemsize)
    if strides is None:
        raise ValueError(f"array must have a contiguous last axis, other strides that are positive multiples of 16 "
                         f"bytes and a 16-byte aligned start; got strides {tuple(given)} (bytes), address "
                         f"0x{address:x}")
    return _tensor_map(array, address, (rows, H, B), (strides[2], strides[1], strides[0]), cols, itemsize, box_rows,
                       box_cols, swizzle, 4)


def tma_strides(shape, strides, address, itemsize):
    """The strides (bytes) a tensor map is encoded with for an array of this shape, strides (bytes), start and
    itemsize, or None where TMA cannot read it in place: the last axis must be contiguous, the start 16-byte
    aligned, and every other stride a positive multiple of 16 bytes, except along an axis of length 1, which is
    never stepped (its stride, whatever the array says, becomes the array's extent)."""
    extent = max([16] + [st * n for st, n in zip(strides, shape)])
    extent += -extent % 16
    out = tuple(st if n > 1 else extent for st, n in zip(strides[:-1], shape[:-1])) + (strides[-1],)
    if (shape[-1] > 1 and strides[-1] != itemsize) or address % 16 or any(st <= 0 or st % 16 for st in out[:-1]):
        return None
    return out


def _tensor_map(x, address, dims, strides, cols, itemsize, box_rows, box_cols, swizzle, rank):
    """The map of the array tensor_map_2d or _4d checked: dims (rows, heads, batches) and their strides in bytes."""
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"elements must be 1, 2, 4 or 8 bytes; got {itemsize}")
    for name, value in (("box_rows", box_rows), ("box_cols", box_cols)):
        if not 1 <= value <= 256:
            raise ValueError(f"{name} must be in [1, 256]; got {value}")
    F.box_offsets(box_rows, box_cols, itemsize, swizzle)  # checks the box's row against the swizzle
    if SIMULATOR:  # a record of the array, kept alive by the caller as on a GPU
        ary = getattr(x, "_ary", x)
        root = ary
        while isinstance(root.base, np.ndarray):
            root = root.base
        _SOURCES[address] = (weakref.ref(root), _address(root))
        words = [_TMAP_MAGIC, address, cols, dims[0], strides[0], box_cols, box_rows, itemsize, swizzle, rank,
                 dims[1], strides[1], dims[2], strides[2]]
        return cuda.to_device(np.array(words + [0] * (16 - len(words)), np.uint64))
    return cuda.to_device(_encode_tiled(address, (cols, *dims[:rank - 1]), strides[:rank - 1], itemsize, box_rows,
                                        box_cols, swizzle))


def _encode_tiled(address, dims, strides, itemsize, box_rows, box_cols, swizzle):
    """cuTensorMapEncodeTiled's 128 bytes: dims from the innermost (columns, rows[, heads, batches]), strides in
    bytes of every dimension but the first, a box of box_rows x box_cols (one of every outer dimension)."""
    from cuda.bindings import driver as cu

    rank = len(dims)
    kind = {1: "UINT8", 2: "UINT16", 4: "UINT32", 8: "UINT64"}[itemsize]  # TMA copies bits; the type sets the size
    mode = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}[swizzle]
    box = [box_cols, box_rows] + [1] * (rank - 2)
    err, tmap = cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kind}"), cu.cuuint32_t(rank), address,
        [cu.cuuint64_t(x) for x in dims], [cu.cuuint64_t(x) for x in strides],
        [cu.cuuint32_t(x) for x in box], [cu.cuuint32_t(1)] * rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{mode}"),
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err} (dims {tuple(dims)} from the innermost, strides "
                           f"{tuple(strides)} bytes, box {box_rows} x {box_cols}, swizzle {swizzle})")
    try:
        return np.array([int(x) for x in tmap.opaque], dtype=np.uint64)
    except (AttributeError, TypeError):  # a cuda-bindings whose CUtensorMap exposes only its address
        import ctypes
        return np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), dtype=np.uint64).copy()


def _source(tmap, rank, op):
    """Simulator: (the array as raw bits, (batches, heads, rows, cols), box_rows, box_cols, swizzle) of a tensor map
    record made for a load of this rank."""
    words = [int(x) for x in getattr(tmap, "_ary", tmap)[:14]]
    magic, address, cols, rows, stride, box_cols, box_rows, itemsize, swizzle, made, heads, head_stride, batches, \
        batch_stride = words
    if magic != _TMAP_MAGIC:
        raise ValueError(f"{op}: tmap is not a tensor map made by tensor_map_2d or tensor_map_4d")
    if made != rank:
        raise ValueError(f"{op}: tmap was made by tensor_map_{made}d; {op} takes tensor_map_{rank}d's")
    ref, root_address = _SOURCES.get(address, (lambda: None, 0))
    root = ref()
    if root is None:
        raise RuntimeError(f"{op}: the tensor map's array no longer exists (keep it alive while the map is used)")
    flat = root.reshape(-1).view(np.uint8)
    array = np.ndarray((batches, heads, rows, cols), f"u{itemsize}", buffer=flat, offset=address - root_address,
                       strides=(batch_stride, head_stride, stride, itemsize))
    return array, box_rows, box_cols, swizzle


# ----------------------------------------------------------------------------------------- exports
_FNS, _wgmma = _sim_functions() if SIMULATOR else _gpu_functions()


@functools.lru_cache(maxsize=None)
def wgmma_ss(n, dtype="float16", a_major="K", b_major="K"):
    """wgmma m64nNk16 (fp32 accumulators) with A and B from shared memory: fn(acc, desc_a, desc_b, scale_d).
    Build it at module level (or outside the kernel) and call it in the kernel; acc is a float32 local array
    of n // 2. a_major / b_major "K" (default) or "MN": which dimension of the operand is contiguous."""
    return _wgmma(n, dtype, a_major, b_major, False)


@functools.lru_cache(maxsize=None)
def wgmma_rs(n, dtype="float16", b_major="K"):
    """wgmma m64nNk16 with A from registers: fn(acc, a0, a1, a2, a3, desc_b, scale_d); a0..a3 are uint32
    registers of two 16-bit values each, laid out as fragments.wgmma_fragment_map(16, "A")."""
    return _wgmma(n, dtype, "K", b_major, True)


@cuda.jit(device=True, inline="always")
def make_descriptor(address, lbo, sbo, swizzle):
    """wgmma's matrix descriptor (fragments.matrix_descriptor) from a shared address, LBO, SBO (bytes, multiples
    of 16) and the swizzle in bytes (0, 32, 64, 128)."""
    mode = 1 if swizzle == 128 else (2 if swizzle == 64 else (3 if swizzle == 32 else 0))
    return (uint64((address & 0x3FFFF) >> 4) | (uint64((lbo & 0x3FFFF) >> 4) << uint64(16))
            | (uint64((sbo & 0x3FFFF) >> 4) << uint64(32)) | (uint64(mode) << uint64(62)))


@cuda.jit(device=True, inline="always")
def descriptor_plus(desc, nbytes):
    """make_descriptor(address + nbytes, ...) from make_descriptor(address, ...): the address field holds
    address / 16 in its low 14 bits, and shared memory (at most 228 KB) stays below 256 KB, so the field never
    carries into the next. With nbytes a constant, an add, where make_descriptor masks, shifts and ors."""
    return uint64(desc + uint64(nbytes >> 4))


smem_address = _FNS["smem_address"]
wgmma_fence, wgmma_commit, wgmma_wait = _FNS["wgmma_fence"], _FNS["wgmma_commit"], _FNS["wgmma_wait"]
fence_proxy_async, fence_proxy_async_global = _FNS["fence_proxy_async"], _FNS["fence_proxy_async_global"]
globaltimer = _FNS["globaltimer"]
setmaxnreg_inc, setmaxnreg_dec = _FNS["setmaxnreg_inc"], _FNS["setmaxnreg_dec"]
mbarrier_init, mbarrier_arrive = _FNS["mbarrier_init"], _FNS["mbarrier_arrive"]
mbarrier_arrive_expect_tx = _FNS["mbarrier_arrive_expect_tx"]
mbarrier_try_wait_parity, mbarrier_wait_parity = _FNS["mbarrier_try_wait_parity"], _FNS["mbarrier_wait_parity"]
tma_load_2d, tma_load_4d, bulk_copy = _FNS["tma_load_2d"], _FNS["tma_load_4d"], _FNS["bulk_copy"]
bulk_reduce_add, bulk_commit = _FNS["bulk_reduce_add"], _FNS["bulk_commit"]
bulk_wait_read, bulk_wait = _FNS["bulk_wait_read"], _FNS["bulk_wait"]
named_barrier_sync, named_barrier_arrive = _FNS["named_barrier_sync"], _FNS["named_barrier_arrive"]
