# %% [markdown]
# # Exercises 09: register tiling
#
# Goes with lesson [09 register-resident FA2](../notebooks/09_register_fa2.ipynb). First a register-tiled
# score tile, the product at the heart of the fast kernel; then a short quiz on which local arrays stay in
# registers.

# %%
import math

import numpy as np
from numba import float32

import flashlab
from flashlab.device import get_cuda

cuda = get_cuda()

# %% [markdown]
# ## 1. A register-tiled micro-tile of S
#
# `S = scale * Q Kᵀ` for `Q` of shape `(n_q, d)` and `K` of shape `(n_k, d)`, one `block_q x block_k` tile
# of S per block (grid `(ceil(n_q / block_q), ceil(n_k / block_k))`). The block has `tr x tc` threads in a
# 1-D launch: thread `t` is `(ty, tx) = (t // tc, t % tc)`, and it owns the micro-tile of
# `RM = block_q / tr` rows by `RN = block_k / tc` keys
#
# - rows `ty*RM + i` of the tile, `i < RM`, and keys `tx*RN + j`, `j < RN`.
#
# The given code loads the Q and K tiles into shared memory (zeros past the ends). Your part: compute the
# `RM x RN` products in a local array `acc` and write them (times `scale`) to `s`, skipping elements
# outside S. The point is *reuse*: for each `x < d`, copy your `RM` values `Qs[row, x]` into a local array
# `a` and your `RN` values `Ks[key, x]` into `b`, then do all `RM * RN` multiply-adds from registers. That
# is `RM + RN` shared-memory reads per `x` instead of `2 * RM * RN`; the checker counts them.
#
# Loops over `range(RM)`, `range(RN)` and `range(d)` have constant trip counts: Numba unrolls the small
# ones and `a`, `b`, `acc` stay in registers.

# %%
def build_scores_kernel(d, block_q, block_k, tr, tc):
    RM, RN = block_q // tr, block_k // tc
    nt = tr * tc

    @cuda.jit
    def scores(q, k, s, scale):
        Qs = cuda.shared.array((block_q, d), float32)
        Ks = cuda.shared.array((block_k, d), float32)
        t = cuda.threadIdx.x
        ty, tx = t // tc, t % tc
        q0, k0 = cuda.blockIdx.x * block_q, cuda.blockIdx.y * block_k
        for e in range(t, block_q * d, nt):  # coalesced: consecutive threads, consecutive x
            r, x = e // d, e % d
            Qs[r, x] = q[q0 + r, x] if q0 + r < q.shape[0] else float32(0.0)
        for e in range(t, block_k * d, nt):
            c, x = e // d, e % d
            Ks[c, x] = k[k0 + c, x] if k0 + c < k.shape[0] else float32(0.0)
        cuda.syncthreads()

        ### BEGIN SOLUTION
        acc = cuda.local.array((RM, RN), float32)
        a = cuda.local.array(RM, float32)
        b = cuda.local.array(RN, float32)
        for i in range(RM):
            for j in range(RN):
                acc[i, j] = 0.0
        for x in range(d):
            for i in range(RM):
                a[i] = Qs[ty * RM + i, x]
            for j in range(RN):
                b[j] = Ks[tx * RN + j, x]
            for i in range(RM):
                for j in range(RN):
                    acc[i, j] += a[i] * b[j]
        for i in range(RM):
            for j in range(RN):
                r, c = q0 + ty * RM + i, k0 + tx * RN + j
                if r < s.shape[0] and c < s.shape[1]:
                    s[r, c] = acc[i, j] * scale
        ### END SOLUTION

    return scores


# %%
rng = np.random.default_rng(0)
Q, K = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
S = np.zeros((8, 8), np.float32)
build_scores_kernel(8, 8, 8, 4, 4)[(1, 1), 16](Q, K, S, np.float32(1.0))
print("S error:", flashlab.relative_error(S, Q.astype(np.float64) @ K.T))

# %%
flashlab.check("scores_microtile", build_scores_kernel)

# %% [markdown]
# ## 2. Registers or local memory?
#
# In each snippet, `acc` is a `cuda.local.array`. Does it stay in registers (True), or does the compiler
# have to put it in local memory, which lives in DRAM behind the caches (False)? `t` is
# `cuda.threadIdx.x`, `n` a kernel argument, `R = 4` a Python constant captured when the kernel is built.
#
# ```python
# # A
# acc = cuda.local.array(4, float32)
# for j in range(4):
#     acc[j] = x[j]
#
# # B
# acc = cuda.local.array(4, float32)
# for j in range(n):
#     acc[j] += x[j]
#
# # C
# acc = cuda.local.array(4, float32)
# acc[t % 4] = 1.0
#
# # D
# acc = cuda.local.array(R, float32)
# for j in range(R):
#     acc[j] = x[j]
#
# # E: every element used, all indices constant
# acc = cuda.local.array(300, float32)
# ```

# %%
def in_registers():
    """{'A': bool, 'B': bool, 'C': bool, 'D': bool, 'E': bool}: True where acc stays in registers."""
    ### BEGIN SOLUTION
    return {"A": True, "B": False, "C": False, "D": True, "E": False}
    ### END SOLUTION


# %%
flashlab.check("in_registers", in_registers)
