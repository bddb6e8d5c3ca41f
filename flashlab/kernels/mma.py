"""Tensor cores from pure-Python Numba kernels: warp-level PTX instructions as device functions (lesson 15).

numba-cuda has no tensor-core API, but a Numba `@intrinsic` can emit any PTX instruction as inline
assembly. Each function below is one such instruction (or a short fixed sequence), callable from a
`@cuda.jit` kernel like any device function:

    d0, d1, d2, d3 = mma_f16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)   # sm_80+
    d0, d1, d2, d3 = mma_bf16_m16n8k16(...)                                      # sm_80+
    d0, d1, d2, d3 = mma_f16_m16n8k8(a0, a1, b0, c0, c1, c2, c3)                  # sm_75+ (Colab's T4)
    d0, d1, d2, d3 = mma_f16_m16n8k8x2(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)   # k16 as two k8, sm_75+
    d0, d1, d2, d3 = mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)   # sm_80+
    r = pack_f16x2(lo, hi); r = pack_bf16x2(lo, hi)     # two fp32 -> one register of two 16-bit values
    lo, hi = unpack_f16x2(r); lo, hi = unpack_bf16x2(r) # and back: one register -> two fp32
    x = round_tf32(x)                                   # fp32 rounded to tf32 (cvt.rna), still an fp32
    x = shfl_xor(x, mask)                               # the value held by lane (lane ^ mask)
    any_lane = vote_any(flag)                           # True in every lane if flag is true in any lane of the warp
    r0, r1, r2, r3 = ldmatrix_x4(shared, i)             # four 8x8 16-bit matrices from shared memory
    r0, r1, r2, r3 = ldmatrix_x4_trans(shared, i)       # the same, each transposed (for V in P @ V)
    cp_async16(shared, i, array2d, row, col, nbytes)    # 16 bytes global -> shared, asynchronously (sm_80+)
    cp_async16_flat(shared, i, array2d, base, offset, nbytes)  # the same from element base + offset of its memory
    cp_async_commit(); cp_async_wait(1)                 # close a group of copies; wait for all but 1 group

All mma accumulate in fp32. a*/b* of the 16-bit forms are uint32 registers holding two values (the lower
index in the low half, as `pack_*` make them); tf32 operands are float32 values (the hardware reads their
top 19 bits). Which lane holds which element is the fragment layout of flashlab.fragments.

Without a GPU, Numba's CUDA simulator runs kernels as Python, one OS thread per CUDA thread. There, each
function here is an exact emulation of the warp-collective instruction: the 32 lanes of the warp meet,
exchange their fragments, the product is computed once by flashlab.fragments.warp_mma, and each lane gets
its own registers of the result. So the same kernel source runs, and is tested, on both.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
from numba import config

from .. import fragments as F
from ..device import SIMULATE_GPU, device_limits, get_cuda

get_cuda()  # choose the GPU or the simulator first: that choice decides which functions this module holds
SIMULATOR = bool(config.ENABLE_CUDASIM)

# PTX of each mma: d = a @ b + c; ${n} are the operands in order (outputs first).
_MMA = {
    "f16_m16n8k16": ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};", 4, 2),
    "bf16_m16n8k16": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                      "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};", 4, 2),
    "f16_m16n8k8": ("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                    "{$0,$1,$2,$3}, {$4,$5}, {$6}, {$7,$8,$9,$10};", 2, 1),
    "tf32_m16n8k8": ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                     "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};", 4, 2),
    # m16n8k16 as two m16n8k8 (columns 0-7 of A with rows 0-7 of B, then 8-15): the k16 step on sm_75
    "f16_m16n8k8x2": ("{ .reg .f32 x0, x1, x2, x3; "
                      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {x0,x1,x2,x3}, {$4,$5}, {$8}, {$10,$11,$12,$13}; "
                      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$6,$7}, {$9}, {x0,x1,x2,x3}; }",
                      4, 2),
}
# (shape, operand dtype) of each, for the emulation
_MODEL = {"f16_m16n8k16": ("m16n8k16", "float16"), "bf16_m16n8k16": ("m16n8k16", "bfloat16"),
          "f16_m16n8k8": ("m16n8k8", "float16"), "tf32_m16n8k8": ("m16n8k8", "tf32")}
# Minimum compute capability of each instruction (PTX ISA, "Warp-level matrix multiply-accumulate").
MIN_CC = {"f16_m16n8k16": (8, 0), "bf16_m16n8k16": (8, 0), "f16_m16n8k8": (7, 5), "f16_m16n8k8x2": (7, 5),
          "tf32_m16n8k8": (8, 0), "cp_async16": (8, 0), "cp_async16_flat": (8, 0),
          "pack_bf16x2": (8, 0), "round_tf32": (8, 0), "unpack_f16x2": (7, 5), "unpack_bf16x2": (7, 5)}

PACK_F16X2 = "{ .reg .b16 lo, hi; cvt.rn.f16.f32 lo, $1; cvt.rn.f16.f32 hi, $2; mov.b32 $0, {lo, hi}; }"
PACK_BF16X2 = "cvt.rn.bf16x2.f32 $0, $2, $1;"  # the first source goes to the upper half
ROUND_TF32 = "cvt.rna.tf32.f32 $0, $1;"
UNPACK_F16X2 = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }"
# a bfloat16 is the top half of a float32: shift the low value up, mask the high one
UNPACK_BF16X2 = "{ .reg .b32 lo, hi; shl.b32 lo, $2, 16; and.b32 hi, $2, 0xFFFF0000; mov.b32 $0, lo; mov.b32 $1, hi; }"
# ldmatrix reads four 8x8 matrices of 16-bit values from shared memory; lane 8*i + r gives the address of
# row r of matrix i (16 bytes, 16-byte aligned). Shared addresses are 32-bit offsets into the shared window;
# the intrinsics compute them in LLVM (an address-space cast, not a cvta inside the asm), so that ptxas sees
# base + constant and folds the constant into the instruction (LDSM [R+0x20]) instead of adding it each time.
_LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4%s.shared.b16 {$0,$1,$2,$3}, [$4];"
LDMATRIX_X4, LDMATRIX_X4_TRANS = _LDMATRIX % "", _LDMATRIX % ".trans"
# cp.async copies 16 bytes from global to shared memory without passing through registers; the copies of
# one thread form groups (commit_group), and wait_group n waits until at most n of its groups are pending.
# A source size of 0 writes 16 zero bytes (rows past the end of the input).
CP_ASYNC = "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.cg.shared.global [$0], [g], 16, $2; }"
# the same from a 64-bit tile pointer plus a 32-bit element offset: one mad.wide.u32 per address (ptxas for
# sm_90 made it a LEA / LEA.HI.X pair: docs/runs/options-varlen-paged.md, "2026-11-26 morning: copy addresses
# and the rescale skip")
CP_ASYNC_FLAT = ("{ .reg .u64 g; mad.wide.u32 g, $2, %d, $1; cvta.to.global.u64 g, g; "
                 "cp.async.cg.shared.global [$0], [g], 16, $3; }")
CP_ASYNC_COMMIT = "cp.async.commit_group;"
CP_ASYNC_WAIT = "cp.async.wait_group %d;"
SHFL_XOR = "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;"  # all 32 lanes take part
VOTE_ANY = "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 $0, 1, 0, q; }"


# ------------------------------------------------------------------------------------------- GPU
def _gpu_functions():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils

    try:
        from numba.cuda.extending import intrinsic
    except ImportError:  # older numba-cuda
        from numba.core.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)

    def shared_address(context, builder, array_type, array, index):
        """The 32-bit shared-window address of element `index` of a shared array: its generic pointer cast to
        the shared address space (LLVM's addrspace 3; NVPTX then uses the array's symbol directly)."""
        ptr = builder.gep(context.make_array(array_type)(context, builder, array).data, [index])
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=3)), i32)

    def mma_codegen(ptx, n_in, tf32):
        def codegen(context, builder, signature, llargs):
            ins = [builder.bitcast(x, i32) if tf32 else x for x in llargs[:n_in]] + list(llargs[n_in:])
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * n_in + [f32] * 4)
            cons = ",".join(["=f"] * 4 + ["r"] * n_in + ["f"] * 4)
            res = builder.call(ir.InlineAsm(fnty, ptx, cons), ins)
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(res, i) for i in range(4)])
        return codegen

    def mma_intrinsic(ptx, n_a, n_b, tf32):
        n_in = n_a + n_b
        operand = types.float32 if tf32 else types.uint32
        sig = types.UniTuple(types.float32, 4)(*([operand] * n_in + [types.float32] * 4))
        if n_in == 6:  # A in 4 registers, B in 2 (m16n8k16, and tf32 m16n8k8)
            def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
                return sig, mma_codegen(ptx, n_in, tf32)
        else:  # fp16 m16n8k8: A in 2 registers, B in 1
            def typer(typingctx, a0, a1, b0, c0, c1, c2, c3):
                return sig, mma_codegen(ptx, n_in, tf32)
        return intrinsic(typer)

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(i32, [f32, f32])
            return builder.call(ir.InlineAsm(fnty, PACK_F16X2, "=r,f,f"), args)
        return types.uint32(types.float32, types.float32), codegen

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(i32, [f32, f32])
            return builder.call(ir.InlineAsm(fnty, PACK_BF16X2, "=r,f,f"), args)
        return types.uint32(types.float32, types.float32), codegen

    def unpack_intrinsic(ptx):
        def typer(typingctx, reg):
            def codegen(context, builder, signature, args):
                res = builder.call(ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32, f32]), [i32]), ptx,
                                                "=f,=f,r"), args)
                return context.make_tuple(builder, signature.return_type, [builder.extract_value(res, i) for i in (0, 1)])
            return types.UniTuple(types.float32, 2)(types.uint32), codegen
        return intrinsic(typer)

    @intrinsic
    def round_tf32(typingctx, x):
        def codegen(context, builder, signature, args):
            bits = builder.call(ir.InlineAsm(ir.FunctionType(i32, [f32]), ROUND_TF32, "=r,f", side_effect=True), args)
            return builder.bitcast(bits, f32)
        return types.float32(types.float32), codegen

    @intrinsic
    def shfl_xor(typingctx, value, mask):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(f32, [f32, i32])
            return builder.call(ir.InlineAsm(fnty, SHFL_XOR, "=f,f,r"), [args[0], args[1]])
        return types.float32(types.float32, types.int32), codegen

    @intrinsic
    def vote_any(typingctx, flag):
        def codegen(context, builder, signature, args):
            word = builder.zext(args[0], i32)
            got = builder.call(ir.InlineAsm(ir.FunctionType(i32, [i32]), VOTE_ANY, "=r,r"), [word])
            return builder.icmp_unsigned("!=", got, ir.Constant(i32, 0))
        return types.boolean(types.boolean), codegen

    def ldmatrix_intrinsic(ptx):
        def typer(typingctx, array, index):
            def codegen(context, builder, signature, args):
                address = shared_address(context, builder, signature.args[0], args[0], args[1])
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                res = builder.call(ir.InlineAsm(fnty, ptx, "=r,=r,=r,=r,r,~{memory}", side_effect=True), [address])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(4)])
            return types.UniTuple(types.uint32, 4)(array, types.intp), codegen
        return intrinsic(typer)

    def copy16(builder, dst_address, src_ptr, src_bytes):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i64, i32])
        builder.call(ir.InlineAsm(fnty, CP_ASYNC, "r,l,r,~{memory}", side_effect=True),
                     [dst_address, builder.ptrtoint(src_ptr, i64), src_bytes])

    @intrinsic
    def cp_async16(typingctx, dst, dst_index, src, row, col, src_bytes):
        sig = types.void(dst, types.intp, src, types.intp, types.intp, types.int32)

        def codegen(context, builder, signature, args):
            src_ary = context.make_array(signature.args[2])(context, builder, args[2])
            src_ptr = cgutils.get_item_pointer(context, builder, signature.args[2], src_ary, [args[3], args[4]])
            copy16(builder, shared_address(context, builder, signature.args[0], args[0], args[1]), src_ptr, args[5])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cp_async16_flat(typingctx, dst, dst_index, src, base, offset, src_bytes):
        """src's element base + offset, counted from its first element in memory (row * row stride + col for a
        2-D view). base is 64-bit and offset 32-bit: a kernel passes its tile's first element as base, the
        same for all of a tile's copies, and each chunk's place in the tile as offset, so that each address is
        one 32-bit multiply-add onto a 64-bit pointer (where cp_async16 multiplies row by the stride in 64
        bits each time)."""
        sig = types.void(dst, types.intp, src, types.intp, types.uint32, types.int32)

        def codegen(context, builder, signature, args):
            # the tile's pointer goes into the assembly whole: LLVM would otherwise fold base + offset back into
            # one 64-bit sum per copy
            i64 = ir.IntType(64)
            tile = builder.gep(context.make_array(signature.args[2])(context, builder, args[2]).data, [args[3]])
            fnty = ir.FunctionType(ir.VoidType(), [i32, i64, i32, i32])
            asm = CP_ASYNC_FLAT % context.get_abi_sizeof(context.get_data_type(signature.args[2].dtype))
            builder.call(ir.InlineAsm(fnty, asm, "r,l,r,r,~{memory}", side_effect=True),
                         [shared_address(context, builder, signature.args[0], args[0], args[1]),
                          builder.ptrtoint(tile, i64), args[4], args[5]])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        def codegen(context, builder, signature, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), CP_ASYNC_COMMIT, "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def cp_async_wait(typingctx, pending):
        if not isinstance(pending, types.IntegerLiteral):
            return None  # n must be a literal integer: PTX takes it as an immediate
        n = pending.literal_value

        def codegen(context, builder, signature, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), CP_ASYNC_WAIT % n, "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()
        return types.void(types.int64), codegen

    fns = {f"mma_{name}": mma_intrinsic(ptx, n_a, n_b, name.startswith("tf32"))
           for name, (ptx, n_a, n_b) in _MMA.items()}
    fns.update(pack_f16x2=pack_f16x2, pack_bf16x2=pack_bf16x2, round_tf32=round_tf32, shfl_xor=shfl_xor,
               vote_any=vote_any, unpack_f16x2=unpack_intrinsic(UNPACK_F16X2),
               unpack_bf16x2=unpack_intrinsic(UNPACK_BF16X2),
               ldmatrix_x4=ldmatrix_intrinsic(LDMATRIX_X4), ldmatrix_x4_trans=ldmatrix_intrinsic(LDMATRIX_X4_TRANS),
               cp_async16=cp_async16, cp_async16_flat=cp_async16_flat, cp_async_commit=cp_async_commit,
               cp_async_wait=cp_async_wait)
    return fns


# ------------------------------------------------------------------------------------- simulator
WAIT_LIMIT = 60.0  # seconds a lane waits for the rest of its warp before the emulation reports a hang
CREATION_QUIET = 2.0  # seconds without a new thread in the block after which the simulator's start loop is over


class WarpDivergence(RuntimeError):
    """Lanes of one warp did not all reach the same warp-collective instruction."""


class _Warp:
    """The meeting point of one warp's lanes in the simulator: each collective call deposits a value; the
    last lane to arrive computes every lane's result once; all lanes leave with their own."""

    def __init__(self, n_lanes: int, warp: int):
        self.n, self.warp = n_lanes, warp
        self.cond = threading.Condition()
        self.slots = [None] * n_lanes
        self.count = self.gen = 0
        self.result = None
        self.seen = (-1, time.monotonic())  # (running threads of the block, when that count last changed)

    def _lanes_gone(self, me) -> bool:
        """True when a lane of this warp has finished its kernel: it can never arrive.

        A lane missing from the running threads may also not have started yet: the simulator starts a block's
        threads one by one, in np.ndindex order of (x, y, z), and on a busy CPU that takes seconds. So a missing
        lane counts as finished when a thread started after it is running, or when the block's running threads
        have not changed for CREATION_QUIET seconds (the start loop is over)."""
        dims = tuple(me._manager._block_dim) + (1, 1)
        bx, by, bz = (int(x) for x in dims[:3])

        def rank(tid):  # the position of thread `tid` in the start loop
            x, y, z = tid % bx, tid // bx % by, tid // (bx * by)
            return (x * by + y) * bz + z

        block = [int(t.thread_id) for t in threading.enumerate()
                 if getattr(t, "_manager", None) is me._manager and t.is_alive()]
        now = time.monotonic()
        if len(block) != self.seen[0]:
            self.seen = (len(block), now)
        running, latest = set(block), max(map(rank, block), default=-1)
        missing = [tid for tid in range(32 * self.warp, 32 * self.warp + self.n) if tid not in running]
        return bool(missing) and (any(rank(tid) < latest for tid in missing) or now - self.seen[1] > CREATION_QUIET)

    def diverged(self, ops) -> str:
        return (f"lanes of warp {self.warp} reached different warp instructions at once ({', '.join(sorted(ops))}): "
                "every lane must run the same ones")

    def missing(self, op, lane) -> str:
        return (f"{op}: lane {lane} of warp {self.warp} waited for the other lanes, but only {self.count} of "
                f"{self.n} arrived. A warp instruction must be executed by all 32 lanes together: no lane may "
                "return early or skip it inside an `if`.")

    def collective(self, lane, op, value, combine):
        """Deposit this lane's value for `op`; the last lane computes combine(values) -> every lane's result."""
        me = threading.current_thread()
        with self.cond:
            self.slots[lane] = (op, value)
            self.count += 1
            gen = self.gen
            if self.count == self.n:
                ops = {s[0] for s in self.slots}
                try:
                    if len(ops) > 1:
                        raise WarpDivergence(self.diverged(ops))
                    self.result = combine([s[1] for s in self.slots])
                except Exception as exc:  # every lane reports it, not only the one that computed
                    self.result = exc
                self.count, self.gen = 0, self.gen + 1
                self.cond.notify_all()
            else:
                start = time.monotonic()
                while self.gen == gen:
                    self.cond.wait(0.05)
                    if getattr(me, "abort", False):
                        raise RuntimeError("another thread of this block failed")
                    waited = time.monotonic() - start
                    if self.gen == gen and (waited > WAIT_LIMIT or (waited > 0.5 and self._lanes_gone(me))):
                        raise WarpDivergence(self.missing(op, lane))
            if isinstance(self.result, Exception):
                raise type(self.result)(str(self.result))
            return self.result[lane]


def _address(view) -> int:
    """The address of a simulator array view's first element (a NumPy array, or numba's fake device array)."""
    view = getattr(view, "_ary", view)
    return view.__array_interface__["data"][0]


def _lane_and_warp(op):
    me = threading.current_thread()
    manager = getattr(me, "_manager", None)
    if manager is None:
        raise RuntimeError(f"{op} is a warp instruction: call it inside a kernel launched on the simulator")
    threads = int(np.prod(manager._block_dim))
    w, lane = divmod(int(me.thread_id), 32)
    n = min(32, threads - 32 * w)
    if n < 32 and op.startswith("mma"):
        raise WarpDivergence(f"{op} needs a full warp of 32 lanes; warp {w} of this block has {n} threads "
                             "(use a multiple of 32 threads per block)")
    warps = manager.__dict__.setdefault("_flashlab_warps", {})
    warp = warps.get(w) or warps.setdefault(w, _Warp(n, w))
    return lane, warp


def _sim_mma(name):
    shape, dtype = _MODEL[name]
    _, n_a, n_b = _MMA[name]

    def lane_elements(regs):
        regs = np.asarray(regs, dtype=np.float32 if dtype == "tf32" else np.uint32)
        if dtype == "tf32":
            return regs
        lo, hi = F.unpack16(regs)
        return F.from_bits16(np.stack([lo, hi], axis=-1).reshape(-1), dtype)

    def combine(values):
        a = np.stack([lane_elements(v[0]) for v in values])
        b = np.stack([lane_elements(v[1]) for v in values])
        c = np.stack([np.asarray(v[2], np.float32) for v in values])
        d = F.warp_mma(a, b, c, shape, dtype)
        return [tuple(np.float32(x) for x in row) for row in d]

    def mma(*regs):
        if len(regs) != n_a + n_b + 4:
            raise TypeError(f"mma_{name} takes {n_a + n_b + 4} registers; got {len(regs)}")
        lane, warp = _lane_and_warp(f"mma_{name}")
        return warp.collective(lane, f"mma_{name}", (regs[:n_a], regs[n_a:n_a + n_b], regs[n_a + n_b:]), combine)

    mma.__name__ = f"mma_{name}"
    return mma


def _sim_functions():
    def pack_f16x2(lo, hi):
        return np.uint32(F.pack16(F.to_bits16(lo, "float16"), F.to_bits16(hi, "float16")))

    def pack_bf16x2(lo, hi):
        return np.uint32(F.pack16(F.to_bits16(lo, "bfloat16"), F.to_bits16(hi, "bfloat16")))

    def round_tf32(x):
        return np.float32(F.round_tf32(x))

    def unpack(dtype):
        def unpack16x2(reg):
            lo, hi = F.unpack16(np.uint32(reg))
            return np.float32(F.from_bits16(lo, dtype)), np.float32(F.from_bits16(hi, dtype))
        return unpack16x2

    def shfl_xor(value, mask):
        lane, warp = _lane_and_warp("shfl_xor")
        return warp.collective(lane, f"shfl_xor({int(mask)})", value,
                               lambda vals: [vals[i ^ int(mask)] for i in range(len(vals))])

    def vote_any(flag):
        lane, warp = _lane_and_warp("vote_any")
        return warp.collective(lane, "vote_any", bool(flag), lambda flags: [any(flags)] * len(flags))

    def ldmatrix(trans):
        def combine(values):  # values[lane] = (array, index of its row's first 32-bit word)
            rows = np.stack([np.asarray(a[int(i):int(i) + 4], np.uint32) for a, i in values])  # (32, 4 words)
            lo, hi = F.unpack16(rows)
            halves = np.stack([lo, hi], axis=-1).reshape(4, 8, 8)  # matrix, row, column (16-bit values)
            if trans:
                halves = halves.transpose(0, 2, 1)
            regs = F.pack16(halves[..., 0::2], halves[..., 1::2])  # (matrix, row, column pair)
            lane = np.arange(32)
            return [tuple(np.uint32(regs[m, L // 4, L % 4]) for m in range(4)) for L in lane]

        def load(array, index):
            lane, warp = _lane_and_warp("ldmatrix")
            return warp.collective(lane, "ldmatrix" + (".trans" if trans else ""), (array, index), combine)
        return load

    def cp_async16(dst, dst_index, src, row, col, src_bytes):
        """The copy happens at once: a kernel that waits and syncs before reading sees the same data. Both
        addresses must be 16-byte aligned, as on the GPU (which stops with a misaligned-address error)."""
        i, c = int(dst_index), int(col)
        source = src[int(row), c:c + 4]
        for name, where in (("shared", dst[i:i + 4]), ("global", source)):
            if _address(where) % 16:
                raise ValueError(f"cp_async16: the {name} address is not 16-byte aligned (shared index {i}, "
                                 f"source row {int(row)}, column {c})")
        dst[i:i + 4] = source if int(src_bytes) else 0

    def cp_async16_flat(dst, dst_index, src, base, offset, src_bytes):
        """As cp_async16, with the source given as element base + offset of a 2-D view with contiguous rows;
        offset must fit in 32 bits, as on the GPU."""
        if not 0 <= int(offset) < 2**32:
            raise ValueError(f"cp_async16_flat: offset {offset} does not fit in 32 bits (unsigned)")
        row, col = divmod(int(base) + int(offset), src.strides[0] // src.itemsize)
        if src.strides[1] != src.itemsize or col + 4 > src.shape[1]:
            raise ValueError(f"cp_async16_flat: element {int(base) + int(offset)} is not 4 elements inside one row "
                             f"of a view with strides {src.strides}, shape {src.shape}")
        cp_async16(dst, dst_index, src, row, col, src_bytes)

    def cp_async_commit():
        pass

    def cp_async_wait(pending):
        pass

    fns = {f"mma_{name}": _sim_mma(name) for name in _MMA if name != "f16_m16n8k8x2"}
    k8 = fns["mma_f16_m16n8k8"]

    def mma_f16_m16n8k8x2(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return k8(a2, a3, b1, *k8(a0, a1, b0, c0, c1, c2, c3))

    fns.update(mma_f16_m16n8k8x2=mma_f16_m16n8k8x2)
    fns.update(pack_f16x2=pack_f16x2, pack_bf16x2=pack_bf16x2, round_tf32=round_tf32, shfl_xor=shfl_xor,
               vote_any=vote_any, unpack_f16x2=unpack("float16"), unpack_bf16x2=unpack("bfloat16"),
               ldmatrix_x4=ldmatrix(False), ldmatrix_x4_trans=ldmatrix(True),
               cp_async16=cp_async16, cp_async16_flat=cp_async16_flat, cp_async_commit=cp_async_commit,
               cp_async_wait=cp_async_wait)
    return {name: _needs_cc(name, fn) if name in MIN_CC else fn for name, fn in fns.items()}


def requires_cc(fn, need, what):
    """fn, refusing to run where the simulator stands in for a GPU older than compute capability `need`
    (FLASHLAB_SIMULATE_GPU=T4, say), as compiling it for that GPU would; `what` starts the error's sentence."""
    def checked(*args):
        if os.environ.get(SIMULATE_GPU):
            cc = device_limits()["cc"]
            if cc is not None and cc < need:
                raise RuntimeError(f"{what}; the simulated GPU ({device_limits()['name']}) has {cc[0]}.{cc[1]}")
        return fn(*args)

    checked.__name__ = fn.__name__
    return checked


def _needs_cc(name, fn):
    """fn, refused on a simulated GPU that lacks the instruction (cc 7.5 has no m16n8k16, bf16, tf32 or cp.async)."""
    need = MIN_CC[name]
    return requires_cc(fn, need, f"{name} needs compute capability {need[0]}.{need[1]}")


_FNS = _sim_functions() if SIMULATOR else _gpu_functions()
mma_f16_m16n8k16 = _FNS["mma_f16_m16n8k16"]
mma_bf16_m16n8k16 = _FNS["mma_bf16_m16n8k16"]
mma_f16_m16n8k8 = _FNS["mma_f16_m16n8k8"]
mma_f16_m16n8k8x2 = _FNS["mma_f16_m16n8k8x2"]
mma_tf32_m16n8k8 = _FNS["mma_tf32_m16n8k8"]
pack_f16x2, pack_bf16x2 = _FNS["pack_f16x2"], _FNS["pack_bf16x2"]
unpack_f16x2, unpack_bf16x2 = _FNS["unpack_f16x2"], _FNS["unpack_bf16x2"]
round_tf32, shfl_xor, vote_any = _FNS["round_tf32"], _FNS["shfl_xor"], _FNS["vote_any"]
ldmatrix_x4, ldmatrix_x4_trans = _FNS["ldmatrix_x4"], _FNS["ldmatrix_x4_trans"]
cp_async16, cp_async16_flat = _FNS["cp_async16"], _FNS["cp_async16_flat"]
cp_async_commit, cp_async_wait = _FNS["cp_async_commit"], _FNS["cp_async_wait"]
