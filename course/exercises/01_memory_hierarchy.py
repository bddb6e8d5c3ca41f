# %% [markdown]
# # Exercises 01: the memory hierarchy
#
# Goes with lesson [01 memory hierarchy](../notebooks/01_memory_hierarchy.ipynb). You will compute
# **arithmetic intensity** (FLOPs done per byte moved between memory and the chip) and use a **roofline**
# to tell whether an operation is limited by memory bandwidth or by arithmetic.
#
# Each exercise: write the function where it says `# YOUR CODE HERE`, run the small example, then run the
# `flashlab.check(...)` cell. The check tries your function on fresh random inputs, including cases you do
# not see here, and tells you what is wrong if anything is.

# %%
import numpy as np

import flashlab

# %% [markdown]
# ## 1. Arithmetic intensity of a matrix product
#
# `C = A @ B` with `A` of shape (M, K) and `B` of shape (K, N) does one multiply and one add for every
# (i, j, k): **2·M·N·K FLOPs**. At best it reads `A` and `B` from memory once and writes `C` once.

# %%
def matmul_intensity(M, N, K, bytes_per_element):
    """FLOPs per byte of C = A @ B, A: (M, K), B: (K, N), each matrix read or written exactly once."""
    ### BEGIN SOLUTION
    flops = 2 * M * N * K
    nbytes = bytes_per_element * (M * K + K * N + M * N)
    return flops / nbytes
    ### END SOLUTION


# %%
print(matmul_intensity(1024, 1024, 1024, 4))  # a square float32 product: about 170 FLOPs per byte

# %%
flashlab.check("matmul_intensity", matmul_intensity)

# %% [markdown]
# ## 2. Arithmetic intensity of softmax
#
# A row-wise softmax over a (rows, cols) matrix does about **5 FLOPs per element** (max, subtract, exp,
# sum, divide). Written as one kernel, it reads every element once and writes every result once.

# %%
def softmax_intensity(rows, cols, bytes_per_element):
    """FLOPs per byte of a row-wise softmax over a (rows, cols) matrix: 5 FLOPs per element,
    each element read once and written once."""
    ### BEGIN SOLUTION
    flops = 5 * rows * cols
    nbytes = bytes_per_element * 2 * rows * cols
    return flops / nbytes
    ### END SOLUTION


# %%
print(softmax_intensity(1024, 1024, 4))  # compare with the matmul above

# %%
flashlab.check("softmax_intensity", softmax_intensity)

# %% [markdown]
# The answer does not grow with the size of the matrix: softmax stays near one FLOP per byte (0.625 in
# float32, 1.25 in float16), however large N gets. A matmul's intensity grows with its sizes.
#
# ## 3. The roofline
#
# A machine does at most `peak_flops` FLOP/s and moves at most `bandwidth` bytes/s. A kernel of intensity
# I can therefore reach at most `min(peak_flops, bandwidth * I)` FLOP/s. Below the **ridge point**
# `peak_flops / bandwidth` it is **memory-bound**; at or above it, **compute-bound**.

# %%
def roofline(intensity, peak_flops, bandwidth):
    """Return (attainable FLOP/s, bound) where bound is "memory" if intensity < peak_flops / bandwidth,
    else "compute"."""
    ### BEGIN SOLUTION
    attainable = min(peak_flops, bandwidth * intensity)
    bound = "memory" if intensity < peak_flops / bandwidth else "compute"
    return attainable, bound
    ### END SOLUTION


# %%
# An A100's datasheet: 312 TFLOP/s (FP16 tensor cores), 2.0 TB/s of HBM bandwidth.
for name, I in [("softmax, fp16", softmax_intensity(4096, 4096, 2)), ("matmul, fp16", matmul_intensity(4096, 4096, 4096, 2))]:
    flops, bound = roofline(I, 312e12, 2.039e12)
    print(f"{name:14s} intensity {I:8.1f} FLOP/B -> at most {flops / 1e12:6.1f} TFLOP/s, {bound}-bound")

# %%
flashlab.check("roofline", roofline)
