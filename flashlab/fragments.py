"""Who holds what in a tensor-core instruction: a NumPy model of PTX `mma.sync` fragments (lesson 15).

`mma.sync.m16n8kK` multiplies a 16 x K matrix A by a K x 8 matrix B and adds a 16 x 8 matrix C, as one
instruction of a whole warp. No lane holds a matrix: each of the 32 lanes holds a few elements of A, B and
C in its registers (its *fragments*), and the hardware gathers them. Which elements, is fixed by the PTX
ISA ("Matrix Fragments for mma.m16n8k16 / m16n8k8"). With groupID g = lane // 4 and t = lane % 4:

    C/D (16 x 8, fp32)   c0, c1: row g,   cols 2t, 2t+1      c2, c3: row g+8, same cols
    A, fp16/bf16 k16     a0..a7 (4 registers of 2): rows g / g+8, cols 2t, 2t+1 and 2t+8, 2t+9
    B, fp16/bf16 k16     b0..b3 (2 registers of 2): rows 2t, 2t+1 and 2t+8, 2t+9, col g
    A, tf32 k8           a0: (g, t)  a1: (g+8, t)  a2: (g, t+4)  a3: (g+8, t+4)
    B, tf32 k8           b0: (t, g)  b1: (t+4, g)

`fragment_map(shape, operand, dtype)` returns these maps as arrays, `to_fragments` / `from_fragments` move a
matrix in and out of per-lane fragments, and `warp_mma` computes what the instruction computes from the
lanes' fragments. The CUDA simulator runs flashlab's tensor-core kernels on this model (kernels/mma.py),
and a GPU test checks it against the hardware.

Rounding helpers for the operand types: `round_tf32` (cvt.rna: nearest, ties away from zero, to 10 mantissa
bits), `split_tf32` (x = big + small, the 3xTF32 trick), `round_bf16` / `round_f16` (nearest even), and the
bit packing of two 16-bit values into one 32-bit register (`pack16` / `unpack16`).

The second half models Hopper's instructions (kernels/hopper.py): wgmma's register fragments and the shared-memory
layouts its matrix descriptors read, the swizzle, and what a TMA load writes.
"""
from __future__ import annotations

import numpy as np

SHAPES = {"m16n8k16": (16, 8, 16), "m16n8k8": (16, 8, 8)}
DTYPES = ("float16", "bfloat16", "tf32")
OPERANDS = ("A", "B", "C")


def _check(shape, operand, dtype):
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {tuple(SHAPES)}; got {shape!r}")
    if operand not in OPERANDS:
        raise ValueError(f"operand must be one of {OPERANDS} (C also stands for D); got {operand!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
    if dtype == "tf32" and shape != "m16n8k8":
        raise ValueError("tf32 mma has shape m16n8k8 (and m16n8k4) only; got shape 'm16n8k16'")


def operand_shape(shape, operand):
    """(rows, cols) of A (M x K), B (K x N) or C/D (M x N)."""
    M, N, K = SHAPES[shape]
    return {"A": (M, K), "B": (K, N), "C": (M, N)}[operand]


def fragment_map(shape="m16n8k16", operand="A", dtype="float16") -> np.ndarray:
    """int array (32, elements, 2): [lane, i] = (row, col) of element i of that lane's fragment.

    Elements are in PTX order ("low to high"): for 16-bit types, elements 2r and 2r+1 share register r
    (2r in the low half). The C map is the same for every dtype (fp32 accumulators)."""
    _check(shape, operand, dtype)
    K = SHAPES[shape][2]
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    if operand == "C":
        i = np.arange(4)
        rows = g[:, None] + 8 * (i[None, :] >= 2)
        cols = 2 * t[:, None] + (i[None, :] & 1)
    elif dtype == "tf32":
        i = np.arange(4 if operand == "A" else 2)
        if operand == "A":  # a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
            rows = g[:, None] + 8 * (i[None, :] & 1)
            cols = t[:, None] + 4 * (i[None, :] >= 2)
        else:  # b0 (t, g), b1 (t+4, g)
            rows = t[:, None] + 4 * i[None, :]
            cols = np.broadcast_to(g[:, None], rows.shape)
    elif operand == "A":  # 16-bit: K // 2 elements per lane
        i = np.arange(K // 2)
        rows = g[:, None] + 8 * ((i[None, :] // 2) % 2)
        cols = 2 * t[:, None] + (i[None, :] & 1) + 8 * (i[None, :] >= 4)
    else:  # B, 16-bit: K // 4 elements per lane
        i = np.arange(K // 4)
        rows = 2 * t[:, None] + (i[None, :] & 1) + 8 * (i[None, :] >= 2)
        cols = np.broadcast_to(g[:, None], rows.shape)
    return np.stack([rows, cols], axis=-1).astype(np.int64)


def to_fragments(matrix, shape="m16n8k16", operand="A", dtype="float16") -> np.ndarray:
    """(32, elements): what each lane holds of `matrix` (of operand_shape(shape, operand))."""
    matrix = np.asarray(matrix)
    want = operand_shape(shape, operand)
    if matrix.shape != want:
        raise ValueError(f"matrix must have shape {want} for operand {operand} of {shape}; got {matrix.shape}")
    fmap = fragment_map(shape, operand, dtype)
    return matrix[fmap[..., 0], fmap[..., 1]]


def from_fragments(frags, shape="m16n8k16", operand="C", dtype="float16") -> np.ndarray:
    """The matrix whose fragments are `frags` (32, elements); raises if an element is never written."""
    fmap = fragment_map(shape, operand, dtype)
    frags = np.asarray(frags)
    if frags.shape != fmap.shape[:2]:
        raise ValueError(f"fragments of operand {operand} of {shape} ({dtype}) have shape {fmap.shape[:2]} "
                         f"(lanes, elements); got {frags.shape}")
    out = np.zeros(operand_shape(shape, operand), frags.dtype)
    seen = np.zeros(out.shape, bool)
    out[fmap[..., 0], fmap[..., 1]] = frags
    seen[fmap[..., 0], fmap[..., 1]] = True
    assert seen.all(), "a fragment map must cover its matrix"
    return out


def warp_mma(a_frags, b_frags, c_frags, shape="m16n8k16", dtype="float16") -> np.ndarray:
    """D fragments (32, 4) of D = A @ B + C, from the lanes' A, B and C fragments, as the instruction does.

    A and B elements are taken as the operand type holds them (tf32 keeps 10 mantissa bits: the lower bits
    of an fp32 input are dropped); products and sums are exact in float64, rounded once to float32.
    The tensor core's own summation order and rounding are not specified by PTX, so a GPU result may differ
    from this one in the last bits of fp32."""
    A = from_fragments(a_frags, shape, "A", dtype).astype(np.float64)
    B = from_fragments(b_frags, shape, "B", dtype).astype(np.float64)
    C = from_fragments(c_frags, shape, "C", dtype).astype(np.float64)
    if dtype == "tf32":
        A, B = truncate_tf32(A).astype(np.float64), truncate_tf32(B).astype(np.float64)
    D = (A @ B + C).astype(np.float32)
    return to_fragments(D, shape, "C", dtype)


# --------------------------------------------------------------------------------- number formats
def _bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def truncate_tf32(x):
    """x with the 13 low mantissa bits of its fp32 value cleared: what a tf32 mma reads of an fp32 register."""
    return (_bits(x) & np.uint32(0xFFFFE000)).view(np.float32)


def round_tf32(x):
    """x rounded to tf32 (10 mantissa bits), to nearest with ties away from zero, as PTX cvt.rna.tf32.f32."""
    b = _bits(x).astype(np.uint64)
    finite = (b & 0x7F800000) != 0x7F800000
    r = np.where(finite, (b + 0x1000) & 0xFFFFE000, b)  # a carry into the exponent rounds up correctly
    return r.astype(np.uint32).view(np.float32)


def split_tf32(x):
    """(big, small), both tf32, with big + small = x to about 21 mantissa bits: 3xTF32 computes
    a*b as big_a*big_b + big_a*small_b + small_a*big_b (the small*small term is below fp32's precision)."""
    x = np.asarray(x, dtype=np.float32)
    big = round_tf32(x)
    return big, round_tf32(x - big)


def round_bf16(x):
    """x rounded to bfloat16 (8 mantissa bits, nearest even), returned as float32 (cvt.rn.bf16.f32)."""
    b = _bits(x).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return np.where(nan, b | 0x400000, r).astype(np.uint32).view(np.float32)


def round_f16(x):
    """x rounded to float16 (nearest even), returned as float32 (cvt.rn.f16.f32)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def to_bits16(x, dtype):
    """uint16 bit patterns of x rounded to float16 or bfloat16."""
    if dtype == "float16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)
    if dtype == "bfloat16":
        return (_bits(round_bf16(x)) >> 16).astype(np.uint16)
    raise ValueError(f"dtype must be 'float16' or 'bfloat16'; got {dtype!r}")


def from_bits16(bits, dtype):
    """float32 values of float16 / bfloat16 bit patterns."""
    bits = np.asarray(bits, dtype=np.uint16)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"dtype must be 'float16' or 'bfloat16'; got {dtype!r}")


def pack16(lo_bits, hi_bits):
    """One 32-bit register holding two 16-bit values: `lo` in bits 0-15 (the lower-indexed element)."""
    return np.asarray(lo_bits, np.uint32) | (np.asarray(hi_bits, np.uint32) << np.uint32(16))


def registers16(values, dtype="float16"):
    """(threads, 2n) 16-bit values per thread -> (threads, n) uint32 registers, element 2r in the low half of
    register r: the registers mma.sync (and wgmma's A from registers) read."""
    bits = to_bits16(values, dtype)
    return np.ascontiguousarray(pack16(bits[..., 0::2], bits[..., 1::2]))


def unpack16(reg):
    """(lo, hi) 16-bit halves of 32-bit registers."""
    reg = np.asarray(reg, np.uint32)
    return (reg & np.uint32(0xFFFF)).astype(np.uint16), (reg >> np.uint32(16)).astype(np.uint16)


# =========================================================================================== Hopper (sm_90a)
# Hopper's warpgroup MMA (`wgmma.mma_async`, FlashAttention-3) is one instruction of 4 warps: 128 threads
# compute D (64 x N, fp32) = A (64 x 16) @ B (16 x N) + D. A and B are read from shared memory through
# 64-bit *matrix descriptors* (A may also come from registers); D lives in the threads' registers. TMA
# (`cp.async.bulk.tensor`) fills that shared memory, 128-byte swizzled so that wgmma reads it without bank
# conflicts. The functions below model, in NumPy, where each value lives (PTX ISA, "Asynchronous
# Warpgroup Level Matrix Multiply-Accumulate": register fragments, shared memory matrix layout, matrix
# descriptor; and "Tensor copy: swizzling modes"). kernels/hopper.py runs its simulator on this model.
WG_THREADS = 128  # a warpgroup: 4 consecutive warps, the first one's index a multiple of 4
WGMMA_M, WGMMA_K = 64, 16  # wgmma m64nNk16 for 16-bit inputs: M and K are fixed, N = 8, 16, ..., 256
SWIZZLES = (0, 32, 64, 128)  # bytes of one swizzled row; 0 = no swizzle ("interleave")
_SWIZZLE_CODE = {0: 0, 128: 1, 64: 2, 32: 3}  # descriptor bits 62-63


def _check_swizzle(swizzle):
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES} (bytes; 0 = none); got {swizzle!r}")


def swizzle_address(address, swizzle=128):
    """The shared-memory byte address where `address` lands under a swizzle mode (bytes 32, 64, 128; 0 = none).

    The 16-byte chunk bits (4, 5, 6) of the address are XORed with the row bits above them (7, 8, 9): with
    128-byte rows, chunk c of row r lands at chunk c ^ (r % 8), so the 8 rows of a column of 16-byte chunks
    fall in 8 different bank groups. 64 B uses bits 4-5 and 7-8, 32 B bit 4 and 7 (CuTe: Swizzle<3,4,3>,
    <2,4,3>, <1,4,3>). The pattern repeats every 8 * swizzle bytes, so a tile must start on such a boundary."""
    _check_swizzle(swizzle)
    address = np.asarray(address, dtype=np.int64)
    if swizzle == 0:
        return address
    bits = swizzle.bit_length() - 5  # 1, 2, 3 for 32, 64, 128
    mask = ((1 << bits) - 1) << 7
    return address ^ ((address & mask) >> 3)


def matrix_descriptor(start, lbo, sbo, swizzle=0, base_offset=0) -> int:
    """wgmma's 64-bit shared-memory matrix descriptor: bits 0-13 start address >> 4, 16-29 leading-dimension
    byte offset (LBO) >> 4, 32-45 stride-dimension byte offset (SBO) >> 4, 49-51 base offset, 62-63 the swizzle
    mode (0 none, 1 128 B, 2 64 B, 3 32 B). Addresses are shared-window byte addresses (18 bits, 16-aligned)."""
    _check_swizzle(swizzle)
    for name, value in (("start", start), ("lbo", lbo), ("sbo", sbo)):
        if not 0 <= int(value) < 1 << 18 or int(value) % 16:
            raise ValueError(f"{name} must be a multiple of 16 in [0, 2**18); got {value}")
    if not 0 <= base_offset < 8:
        raise ValueError(f"base_offset must be in [0, 8); got {base_offset}")
    return ((int(start) >> 4) | (int(lbo) >> 4) << 16 | (int(sbo) >> 4) << 32 | base_offset << 49
            | _SWIZZLE_CODE[swizzle] << 62)


def decode_descriptor(desc) -> dict:
    """The fields of a matrix descriptor: start, lbo, sbo (bytes), base_offset, swizzle (bytes, 0 = none)."""
    desc = int(desc)
    field = lambda lo: (desc >> lo) & 0x3FFF  # noqa: E731
    return {"start": field(0) << 4, "lbo": field(16) << 4, "sbo": field(32) << 4,
            "base_offset": (desc >> 49) & 7, "swizzle": {v: k for k, v in _SWIZZLE_CODE.items()}[desc >> 62 & 3]}


def operand_addresses(desc, rows, major="K", itemsize=2) -> np.ndarray:
    """int64 (rows, K): the shared byte address wgmma reads element (mn, k) of an operand from, K = 32 bytes of
    values (16 for 16-bit types). rows = 64 for A (m), N for B (n: B is addressed as its transpose, N x K).

    `major` is the operand's contiguous dimension: "K" (A row-major, B column-major: wgmma's default) or "MN"
    (the transpose bit set: A column-major, B row-major, as V is in P @ V). The layouts are the PTX ISA's
    canonical ones, built from "core matrices" of 8 rows of 16 bytes; with T = 16 // itemsize values per 16 B
    and W = swizzle // 16 (1 without swizzle):

        K-major, no swizzle    (mn, k) at (mn % 8) * 16 + (mn // 8) * SBO + (k % T) * itemsize + (k // T) * LBO
        K-major, swizzled      (mn, k) at (mn % 8) * 16W + (mn // 8) * SBO + k * itemsize          (LBO unused)
        MN-major, no swizzle   (mn, k) at (mn % T) * itemsize + (mn // T) * SBO + (k % 8) * 16 + (k // 8) * LBO
        MN-major, swizzled     (mn, k) at (mn % TW) * itemsize + (mn // TW) * LBO + (k % 8) * 16W + (k // 8) * SBO

    each added to the start address and then swizzled (swizzle_address): the swizzle acts on the address
    bits, which is why a descriptor may step through a swizzled tile by adding to its start (32 bytes per k16
    step of a 128-byte K-major row). The base-offset field (for tiles off the pattern's boundary) is not
    modelled: it must be 0."""
    f = decode_descriptor(desc)
    if f["base_offset"]:
        raise ValueError(f"descriptor base_offset {f['base_offset']} is not modelled; start swizzled tiles on "
                         "the swizzle pattern's boundary and leave it 0")
    if major not in ("K", "MN"):
        raise ValueError(f"major must be 'K' or 'MN'; got {major!r}")
    sw, T = f["swizzle"], 16 // itemsize
    W = max(sw // 16, 1)
    mn, k = np.arange(rows)[:, None], np.arange(2 * T)[None, :]
    lbo, sbo = f["lbo"], f["sbo"]
    if major == "K" and sw == 0:
        offset = (mn % 8) * 16 + (mn // 8) * sbo + (k % T) * itemsize + (k // T) * lbo
    elif major == "K":
        offset = (mn % 8) * 16 * W + (mn // 8) * sbo + k * itemsize
    elif sw == 0:
        offset = (mn % T) * itemsize + (mn // T) * sbo + (k % 8) * 16 + (k // 8) * lbo
    else:
        offset = (mn % (T * W)) * itemsize + (mn // (T * W)) * lbo + (k % 8) * 16 * W + (k // 8) * sbo
    return swizzle_address(f["start"] + offset, sw)


def tile_offsets(rows, cols, itemsize=2, swizzle=128) -> np.ndarray:
    """int64 (rows, cols): the byte offset of element (r, c) of a tile as TMA writes it into shared memory, from
    the tile's start (a multiple of 8 * swizzle bytes).

    The tile is stored as column boxes `span` bytes wide (span = swizzle, or 16 without swizzle), one after the
    other: box b holds columns b * span // itemsize onward, row-major, `rows` rows of `span` bytes, swizzled.
    A TMA box of span bytes per row writes one such box; a 64 x 128 fp16 tile with 128-byte swizzle is two.
    Both operands of wgmma can be read from this layout (operand_descriptor)."""
    _check_swizzle(swizzle)
    span = swizzle or 16
    per = span // itemsize
    if cols % per:
        raise ValueError(f"cols must be a multiple of {per} ({span} bytes of {itemsize}-byte values); got {cols}")
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return swizzle_address((c // per) * rows * span + r * span + (c % per) * itemsize, swizzle)


def operand_descriptor(tile_rows, tile_cols, major, k0, swizzle=128, itemsize=2, mn0=0):
    """(start offset, LBO, SBO) in bytes of the descriptor that reads a k16 step of a wgmma operand from a tile
    laid out as tile_offsets(tile_rows, tile_cols, itemsize, swizzle). start offset counts from the tile's start.

    major "K": the tile is the operand as (mn, k): its rows are M (or N), its columns K; the step is columns
    k0..k0+15, rows from mn0 (Q or K of S = Q @ K^T). major "MN": the tile is (k, mn): rows are K, columns N;
    the step is rows k0..k0+15, columns from mn0 (V of O = P @ V)."""
    _check_swizzle(swizzle)
    span = swizzle or 16
    per, box = span // itemsize, tile_rows * span
    if major == "K":
        if k0 % (32 // itemsize) or mn0 % 8:
            raise ValueError(f"K-major steps start at a multiple of {32 // itemsize} columns and 8 rows; "
                             f"got k0={k0}, mn0={mn0}")
        start = (k0 // per) * box + (k0 % per) * itemsize + mn0 * span
        return start, (box if swizzle == 0 else 16), 8 * span
    if major == "MN":
        if k0 % 8 or mn0 % per:
            raise ValueError(f"MN-major steps start at a multiple of 8 rows and {per} columns; got k0={k0}, mn0={mn0}")
        start = k0 * span + (mn0 // per) * box
        return (start, 8 * span, box) if swizzle == 0 else (start, box, 8 * span)
    raise ValueError(f"major must be 'K' or 'MN'; got {major!r}")


def wgmma_fragment_map(n, operand="D") -> np.ndarray:
    """int array (128, elements, 2): [thread, i] = (row, col) of element i held by a thread of the warpgroup.

    D (64 x n, fp32, n // 2 registers per thread): warp w = thread // 32 holds rows 16w..16w+15, and within it
    the lane's groupID g = lane // 4 and t = lane % 4 pick, as in mma.sync's C fragment repeated every 8
    columns: element i at row 16w + g + 8 * ((i // 2) % 2), column 8 * (i // 4) + 2t + i % 2.
    A (64 x 16, 16-bit, from registers: 4 registers of 2): the same formula with n = 16; elements 2r and 2r+1
    share register r, 2r in the low half."""
    if operand not in ("A", "D"):
        raise ValueError(f"operand must be 'A' or 'D' (C and D share a layout); got {operand!r}")
    if operand == "D" and (n % 8 or not 8 <= n <= 256):
        raise ValueError(f"n must be a multiple of 8 in [8, 256]; got {n}")
    cols = 16 if operand == "A" else n
    thread, i = np.arange(WG_THREADS)[:, None], np.arange(cols // 2)[None, :]
    w, g, t = thread // 32, thread % 32 // 4, thread % 4
    rows = 16 * w + g + 8 * ((i // 2) % 2)
    cols = 8 * (i // 4) + 2 * t + i % 2
    return np.stack(np.broadcast_arrays(rows, cols), axis=-1).astype(np.int64)


def wgmma_to_fragments(matrix, n=None, operand="D") -> np.ndarray:
    """(128, elements): what each thread of the warpgroup holds of `matrix` (64 x n for D, 64 x 16 for A)."""
    matrix = np.asarray(matrix)
    want = (WGMMA_M, WGMMA_K if operand == "A" else (n if n is not None else matrix.shape[-1]))
    if matrix.shape != want:
        raise ValueError(f"matrix must have shape {want} for operand {operand}; got {matrix.shape}")
    fmap = wgmma_fragment_map(want[1], operand)
    return matrix[fmap[..., 0], fmap[..., 1]]


def wgmma_from_fragments(frags, n=None, operand="D") -> np.ndarray:
    """The 64 x n (D) or 64 x 16 (A) matrix whose warpgroup fragments are `frags` (128, elements)."""
    frags = np.asarray(frags)
    cols = WGMMA_K if operand == "A" else (n if n is not None else 2 * frags.shape[-1])
    fmap = wgmma_fragment_map(cols, operand)
    if frags.shape != fmap.shape[:2]:
        raise ValueError(f"fragments of operand {operand} (64 x {cols}) have shape {fmap.shape[:2]} "
                         f"(threads, elements); got {frags.shape}")
    out = np.zeros((WGMMA_M, cols), frags.dtype)
    out[fmap[..., 0], fmap[..., 1]] = frags
    return out


def wgmma_mma(a, b, c=None, scale_d=True) -> np.ndarray:
    """D (64 x n, float32) = A (64 x 16) @ B (16 x n) + C, as one wgmma m64nNk16 with fp32 accumulators.

    a and b hold the 16-bit operands' values (exact in float32). The model: each product is exact; the sum
    starts from C (0 when scale_d is false or c is None) and adds the products in order k = 0, 1, ..., 15 in
    float64, then rounds once to float32. For 16-bit inputs of ordinary magnitudes the float64 sum is exact,
    so this is the correctly rounded result. PTX does not specify the tensor core's order or internal
    rounding: a GPU's D may differ from this in the last bits of fp32 (mma.sync's model, warp_mma, is the same)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != (WGMMA_M, WGMMA_K) or b.ndim != 2 or b.shape[0] != WGMMA_K:
        raise ValueError(f"a must be 64 x 16 and b 16 x n; got {a.shape} and {b.shape}")
    acc = np.zeros((WGMMA_M, b.shape[1])) if c is None or not scale_d else np.asarray(c, np.float32).astype(np.float64)
    for k in range(WGMMA_K):
        acc = acc + a[:, k, None] * b[None, k, :]
    return acc.astype(np.float32)


def tma_box(matrix, row, col, box_rows, box_cols) -> np.ndarray:
    """The box of `matrix` (2-D) whose corner is (row, col), as TMA loads it: elements outside the matrix
    (past its end, or at negative coordinates) are zeros."""
    matrix = np.asarray(matrix)
    out = np.zeros((box_rows, box_cols), matrix.dtype)
    r0, c0 = max(row, 0), max(col, 0)
    r1, c1 = min(row + box_rows, matrix.shape[0]), min(col + box_cols, matrix.shape[1])
    if r1 > r0 and c1 > c0:
        out[r0 - row:r1 - row, c0 - col:c1 - col] = matrix[r0:r1, c0:c1]
    return out


def box_offsets(rows, cols, itemsize=2, swizzle=128) -> np.ndarray:
    """int64 (rows, cols): the byte offset, from the destination's start, where one TMA load puts element (r, c)
    of its box: rows stored one after another, swizzled. A swizzled box's rows are exactly `swizzle` bytes (the
    case this model covers); without swizzle, any multiple of 16 bytes."""
    _check_swizzle(swizzle)
    if swizzle == 0:
        if cols * itemsize % 16:
            raise ValueError(f"a box row must be a multiple of 16 bytes; got {cols} columns of {itemsize} bytes")
        return (np.arange(rows)[:, None] * cols + np.arange(cols)[None, :]) * itemsize
    if cols * itemsize != swizzle:
        raise ValueError(f"a box with {swizzle}-byte swizzle has rows of {swizzle} bytes here; got {cols} columns "
                         f"of {itemsize} bytes")
    return tile_offsets(rows, cols, itemsize, swizzle)


def tma_image(box, swizzle=128) -> np.ndarray:
    """The shared-memory contents (1-D, the box's dtype) that a TMA load of `box` leaves in its destination."""
    box = np.asarray(box)
    image = np.zeros(box.size, box.dtype)
    image[box_offsets(*box.shape, box.dtype.itemsize, swizzle) // box.dtype.itemsize] = box
    return image
