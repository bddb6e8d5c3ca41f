# %% [markdown]
# # Exercises 15: tensor cores, the instruction
#
# Goes with lesson [15 tensor cores: the instruction](../notebooks/15_tensor_cores.ipynb). From the layout of
# one instruction to the number formats:
#
# 1. the fragment map: which (row, column) each lane's element is;
# 2. a warp's `mma` in NumPy, from the lanes' packed 32-bit registers;
# 3. the tf32 split of a float32 number, on its bits;
# 4. a 3xTF32 matrix product from a tf32 tensor core, and its error;
# 5. one k-step of a tensor core's truncating accumulation, bit for bit, and what it does to 3xTF32;
# 6. the row address each lane gives `ldmatrix.x4` to load an A operand.
#
# `flashlab.fragments` holds the library's versions of 1 to 3 (`fragment_map`, `warp_mma`, `split_tf32`):
# don't call them in your answers, the point is to build them yourself.

# %%
import numpy as np

import flashlab
from flashlab import fragments as F

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. The fragment map
#
# Write `fragment_position(layout, operand, lane, i)`: the (row, column) of element `i` of `lane`'s
# fragment of `operand` ("A", "B" or "C"), for
#
# - `layout = "f16"`: `mma.m16n8k16` with float16/bfloat16 inputs. A is 16 x 16 (8 elements per lane),
#   B is 16 x 8 (4 per lane), C is 16 x 8 (4 per lane);
# - `layout = "tf32"`: `mma.m16n8k8` with tf32 inputs. A is 16 x 8 (4 per lane), B is 8 x 8 (2 per lane),
#   C is 16 x 8 (4 per lane).
#
# Elements are numbered in PTX's order (`a0`, `a1`, ... in the lesson's figures); for 16-bit operands
# elements 2r and 2r+1 share register r. Write each position as a formula in g = lane // 4 and t = lane % 4,
# and check it against the figures: `flashlab.viz.tensor.plot_fragments("f16", lane=5)` draws lane 5's.

# %%
def fragment_position(layout, operand, lane, i):
    """(row, col) of element i of this lane's fragment of operand "A", "B" or "C" (layout "f16" or "tf32")."""
    ### BEGIN SOLUTION
    g, t = lane // 4, lane % 4
    if operand == "C":  # c0, c1: row g; c2, c3: row g + 8; columns 2t, 2t + 1
        return g + 8 * (i // 2), 2 * t + i % 2
    if layout == "f16":
        if operand == "A":  # pairs along a row; then the +8 rows; then the +8 columns
            return g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)
        return 2 * t + i % 2 + 8 * (i // 2), g  # B: pairs down column g
    if operand == "A":  # tf32: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
        return g + 8 * (i % 2), t + 4 * (i // 2)
    return t + 4 * i, g  # B: b0 (t, g), b1 (t + 4, g)
    ### END SOLUTION


# %%
print([fragment_position("f16", "A", 13, i) for i in range(8)])  # lane 13 is g = 3, t = 1

# %%
flashlab.check("fragment_position", fragment_position)

# %% [markdown]
# ## 2. A warp's mma in NumPy
#
# The hardware never sees a matrix, only 32 lanes' registers. Write what one `mma.m16n8k16` with float16
# inputs and float32 accumulation computes, from those registers:
#
# - `a`: (32, 4) uint32, lane L's four A registers; each holds two float16 values, the lower-numbered
#   element (a0 in register 0, a2 in register 1, ...) in the low 16 bits;
# - `b`: (32, 2) uint32, the B registers, packed the same way;
# - `c`: (32, 4) float32, the accumulator fragments c0..c3.
#
# Return `d`, (32, 4) float32: each lane's D = A B + C fragment, laid out like C. Use your
# `fragment_position` (or `F.fragment_map`) for the layouts; `np.ndarray.view` turns 16-bit patterns into
# float16 values.

# %%
def warp_mma(a, b, c):
    """Each lane's fragment of D = A @ B + C, from the lanes' packed A and B registers and C fragments."""
    ### BEGIN SOLUTION
    def elements(regs):  # (32, r) uint32 -> (32, 2r) float values, element 2j in the low half of register j
        halves = np.stack([regs & 0xFFFF, regs >> 16], axis=-1).astype(np.uint16)
        return halves.view(np.float16).reshape(32, -1).astype(np.float64)

    def place(frags, operand, shape):
        m = np.zeros(shape)
        for lane in range(32):
            for i, value in enumerate(frags[lane]):
                m[fragment_position("f16", operand, lane, i)] = value
        return m

    A, B = place(elements(a), "A", (16, 16)), place(elements(b), "B", (16, 8))
    D = A @ B + place(c, "C", (16, 8))
    return np.array([[D[fragment_position("f16", "C", lane, i)] for i in range(4)] for lane in range(32)],
                    dtype=np.float32)
    ### END SOLUTION


# %%
A = rng.standard_normal((16, 16)).astype(np.float16)
B = rng.standard_normal((16, 8)).astype(np.float16)
C = np.zeros((16, 8), np.float32)
bits = lambda x: x.astype(np.float16).view(np.uint16).astype(np.uint32)  # noqa: E731
a_elems, b_elems = F.to_fragments(A, "m16n8k16", "A"), F.to_fragments(B, "m16n8k16", "B")
a = bits(a_elems[:, 0::2]) | (bits(a_elems[:, 1::2]) << 16)  # pack pairs: even element low, odd element high
b = bits(b_elems[:, 0::2]) | (bits(b_elems[:, 1::2]) << 16)
d = warp_mma(a, b, F.to_fragments(C, "m16n8k16", "C"))
print("lane 0's d:", d[0], " A @ B at (0, 0), (0, 1), (8, 0), (8, 1):",
      (A.astype(np.float32) @ B.astype(np.float32))[[0, 0, 8, 8], [0, 1, 0, 1]])

# %%
flashlab.check("warp_mma", warp_mma)

# %% [markdown]
# ## 3. Splitting float32 into tf32 parts
#
# A float32 has 23 stored mantissa bits, tf32 keeps the top 10, so a tf32 value is a float32 whose low 13
# bits are zero. `cvt.rna.tf32.f32` rounds to the **nearest** tf32 value, and a tie (low 13 bits exactly
# `0x1000`) goes **away from zero**. Write `split_tf32(x)` for a float32 array x, returning float32 arrays
# `(big, small)`:
#
# - `big`: x rounded to tf32 that way;
# - `small`: x - big, rounded to tf32 the same way (so the tensor core can use it too).
#
# Work on the bits: `x.view(np.uint32)` gives them, `.view(np.float32)` turns bits back into numbers.
# Rounding up may carry into the exponent (a mantissa of all ones becomes the next power of two): that is
# the right answer.

# %%
def split_tf32(x):
    """(big, small): x rounded to tf32 (nearest, ties away from zero), and the remainder rounded to tf32."""
    ### BEGIN SOLUTION
    def round_tf32(v):
        bits = np.asarray(v, np.float32).view(np.uint32)
        return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)

    big = round_tf32(x)
    return big, round_tf32(x - big)
    ### END SOLUTION


# %%
x = np.float32([1.0 + 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20, -3.14159265, 0.1])
big, small = split_tf32(x)
for xi, bi, si in zip(x, big, small):
    print(f"x = {xi:.9g}: big = {bi:.9g}, small = {si:.3g}, big + small - x = {float(bi) + float(si) - float(xi):.1e}")

# %%
flashlab.check("split_tf32", split_tf32)

# %% [markdown]
# ## 4. A 3xTF32 matrix product
#
# `mma(a, b, c)` below stands for a tf32 tensor core: it returns `a @ b + c` in float32, reading a and b as
# tf32 (any mantissa bits below tf32's are dropped) and multiplying exactly. Write `matmul_3xtf32(A, B, mma)`
# that computes the float32 product A @ B to about float32's accuracy with it: split both inputs with your
# `split_tf32` and let `mma` do the products that matter. Pass `mma` only tf32 values (the checker makes
# sure), and don't multiply outside it.

# %%
def tensor_core(a, b, c):
    """A tf32 mma: a @ b + c with a and b read as tf32 (low 13 mantissa bits dropped), exact products."""
    ta, tb = (F.truncate_tf32(np.asarray(m, np.float32)).astype(np.float64) for m in (a, b))
    return (ta @ tb + c).astype(np.float32)


def matmul_3xtf32(A, B, mma):
    """A @ B for float32 A (m, k) and B (k, n), from tf32 products on the tensor core `mma`."""
    ### BEGIN SOLUTION
    (Ab, As), (Bb, Bs) = split_tf32(A), split_tf32(B)
    C = np.zeros((A.shape[0], B.shape[1]), np.float32)
    C = mma(As, Bb, C)  # the small corrections first, then the big product
    C = mma(Ab, Bs, C)
    return mma(Ab, Bb, C)
    ### END SOLUTION


# %% [markdown]
# Now report the error, as the lesson's figure did: against float64, for one product with each method.
# Which is 1xTF32's error, which 3xTF32's, and how do they compare with float32 arithmetic (`A @ B` in
# NumPy float32)? How many tensor-core products did 3xTF32 cost?

# %%
A = rng.standard_normal((64, 1024)).astype(np.float32)
B = rng.standard_normal((1024, 64)).astype(np.float32)
exact = A.astype(np.float64) @ B.astype(np.float64)
zero = np.zeros((64, 64), np.float32)
one_pass = tensor_core(split_tf32(A)[0], split_tf32(B)[0], zero)
for name, C in (("1xTF32", one_pass), ("3xTF32", matmul_3xtf32(A, B, tensor_core)), ("float32", A @ B)):
    print(f"{name:8s} relative error {flashlab.relative_error(C, exact):.1e}")

# %%
flashlab.check("matmul_3xtf32", matmul_3xtf32)

# %% [markdown]
# ## 5. How a tensor core adds
#
# Exercise 4's `tensor_core` adds in float64 and rounds once. A tensor core does not: Fasi, Higham, Mikaitis and
# Pranesh ("Numerical behavior of NVIDIA tensor cores", PeerJ Computer Science, 2021) found the products exact,
# but the terms aligned to the largest one with the bits that fall off **cut** (no guard bits), and the sum cut
# again (lesson section 5). The details vary between GPU generations, so here is one simple model, stated
# exactly so that it can be graded bit for bit. Each D[i, j] of one k-step D = A B + C is formed thus:
#
# 1. the terms are C[i, j] and the k products A[i, l] B[l, j], each exact (A and B hold tf32 values, so a
#    product has at most 22 significant bits, which a float64 holds);
# 2. e is the exponent of the largest |term|: 2**e <= |term| < 2**(e + 1) (if every term is 0, D[i, j] = 0);
# 3. each term is cut toward zero to a multiple of 2**(e - 23), the last bit of a 24-bit significand aligned
#    with the largest term (what lies below is lost, for either sign);
# 4. the cut terms are added exactly;
# 5. the sum s is cut toward zero to 24 significant bits: to a multiple of 2**(f - 23), where
#    2**f <= |s| < 2**(f + 1) (0 stays 0).
#
# Write `tc_accumulate(a, b, c)` for a (m, k) and b (k, n) float32 arrays of tf32 values and c (m, n) float32:
# D, (m, n) float32, as the model forms it. Nothing in the checks overflows or leaves float32's normal range.
# `np.frexp(x)` gives (mantissa in [0.5, 1), exponent), so e = exponent - 1; `np.ldexp(1.0, n)` is 2.0 ** n
# elementwise; `np.trunc` cuts toward zero.

# %%
def tc_accumulate(a, b, c):
    """One k-step D = A B + C on the model's truncating tensor core: float32 (m, n)."""
    ### BEGIN SOLUTION
    a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
    terms = np.concatenate([c[:, None, :], a[:, :, None] * b[None, :, :]], axis=1)  # (m, 1 + k, n), exact

    def exponent(x):  # 2**e <= |x| < 2**(e + 1)
        return np.frexp(x)[1] - 1

    def cut(x, e):  # toward zero, to a multiple of 2**(e - 23)
        q = np.ldexp(1.0, e - 23)
        return np.trunc(x / q) * q

    e = exponent(np.abs(terms).max(axis=1))[:, None, :]
    s = cut(terms, e).sum(axis=1)
    return cut(s, exponent(s)).astype(np.float32)
    ### END SOLUTION


# %%
x = np.float32([[1.0, 1.0]])
y = np.float32([[0.75 * 2.0 ** -23], [0.75 * 2.0 ** -23]])  # two products worth 3/4 of 1.0's last bit each
for c in (1.0, -1.0):
    d = tc_accumulate(x, y * np.float32(c), np.float32([[c]]))[0, 0]
    rounded = np.float32(c * (1 + 1.5 * 2.0 ** -23))
    print(f"C = {c:+.0f}: the model gives {d!r}, the exact sum rounded to nearest {rounded!r}")

# %%
flashlab.check("tc_accumulate", tc_accumulate)

# %% [markdown]
# Now the reason why 3xTF32 keeps long sums out of the tensor core's accumulator. Every cut errs toward zero, so
# along a chain of k-steps the errors add up instead of cancelling, and what gets cut are the low bits of the
# small correction products, the very part 3xTF32 pays for. Below, 3xTF32 on your model two ways: every k-step
# of all of K into one accumulator; and 64 columns of K at a time from zero, each sum added to a float32
# accumulator with an ordinary add that rounds to nearest, as Ootomo and Yokota (2022) do and as this course's
# kernel does for O = PV. (CUTLASS's `OpMultiplyAddFastF32` keeps the accumulator in the tensor core, with the
# two small products issued before the big one.) How does each error grow with K?

# %%
def three_tf32(A, B, block=None, k_step=8):
    """3xTF32 A @ B with tc_accumulate: per k-step small x big, big x small, big x big into one accumulator;
    block: start that accumulator from zero every `block` columns of K and add its sum in float32."""
    (Ab, As), (Bb, Bs) = split_tf32(A), split_tf32(B)
    out = np.zeros((A.shape[0], B.shape[1]), np.float32)
    block = block or A.shape[1]
    for b0 in range(0, A.shape[1], block):
        acc = np.zeros_like(out)
        for k0 in range(b0, b0 + block, k_step):
            s = slice(k0, k0 + k_step)
            for a_part, b_part in ((As, Bb), (Ab, Bs), (Ab, Bb)):
                acc = tc_accumulate(a_part[:, s], b_part[s], acc)
        out = (out.astype(np.float64) + acc).astype(np.float32)  # a float32 add, rounded to nearest
    return out


# %%
for K in flashlab.size((256, 1024, 4096), (256, 1024)):
    A = rng.standard_normal((16, K)).astype(np.float32)
    B = rng.standard_normal((K, 8)).astype(np.float32)
    exact = A.astype(np.float64) @ B.astype(np.float64)
    print(f"K = {K:4d}: all in the tensor core {flashlab.relative_error(three_tf32(A, B), exact):.1e}, "
          f"64 columns at a time {flashlab.relative_error(three_tf32(A, B, block=64), exact):.1e}, "
          f"float32 arithmetic {flashlab.relative_error(A @ B, exact):.1e}")

# %% [markdown]
# ## 6. Where does each lane point? `ldmatrix.x4`'s addresses
#
# A kernel keeps a 16 x 16 tile of 16-bit values in shared memory, row-major, rows `row_stride` bytes apart, and
# loads it as an A operand with one `ldmatrix.sync.aligned.m8n8.x4.b16`. The instruction loads four 8 x 8
# matrices; each lane gives the address of one 16-byte row: lanes 8i to 8i + 7 give the 8 rows of matrix i, in
# order. Every lane then receives, in its register i, two neighbouring values of matrix i: those of row
# lane // 4, columns 2 (lane % 4) and 2 (lane % 4) + 1 (PTX ISA, "Warp-level matrix load instruction:
# ldmatrix"). For the registers to be the A fragment of exercise 1, in order a0 a1 | a2 a3 | a4 a5 | a6 a7,
# which 8 x 8 block of the tile must matrix i be?
#
# Write `ldmatrix_address(lane, row_stride)`: the byte offset, from the tile's first value, that `lane` passes.

# %%
def ldmatrix_address(lane, row_stride):
    """Byte offset of the 16-byte row lane `lane` gives ldmatrix.x4 for a 16 x 16 A operand (16-bit values)."""
    ### BEGIN SOLUTION
    matrix, r = lane // 8, lane % 8
    row, col = r + 8 * (matrix % 2), 8 * (matrix // 2)  # a2, a3 are rows 8-15; a4 .. a7 the next 8 columns
    return row * row_stride + 2 * col
    ### END SOLUTION


# %%
print("row addresses of lanes 0, 7, 8, 16, 31 with 144-byte rows:",
      [ldmatrix_address(lane, 144) for lane in (0, 7, 8, 16, 31)])

# %%
flashlab.check("ldmatrix_address", ldmatrix_address)

# %% [markdown]
# ## 7. Think about it
#
# - 3xTF32 costs three tensor-core products per product. At the measured mma ceilings of the lesson, is that
#   still faster than the FP32 units' peak on an H100? On a GPU where tf32 runs at the same rate as FP32
#   (some consumer cards), would 3xTF32 make sense?
# - In exercise 2, read every register's halves the wrong way round, for A *and* for B: D comes out right.
#   Why? (Which columns of A and which rows of B trade places?) And why does it go wrong for A alone?
# - In exercise 1, C's layout and the f16 A layout line up so that P can stay in registers. Does the same
#   hold between C and the f16 **B** layout? What would the kernel have to do to compute Oᵀ = Vᵀ Pᵀ instead?
