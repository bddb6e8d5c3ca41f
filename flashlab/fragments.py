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


def unpack16(reg):
    """(lo, hi) 16-bit halves of 32-bit registers."""
    reg = np.asarray(reg, np.uint32)
    return (reg & np.uint32(0xFFFF)).astype(np.uint16), (reg >> np.uint32(16)).astype(np.uint16)
