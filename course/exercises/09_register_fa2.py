# %% [markdown]
# # Exercises 09: register tiling
#
# Goes with lesson [09 register-resident FA2](../notebooks/09_register_fa2.ipynb). First a register-tiled
# score tile, the product at the heart of the fast kernel; then the row max and row sum that the threads
# of a row share; then a short quiz on which local arrays stay in registers.

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
# ## 2. Row statistics shared by the threads of a row
#
# In the register kernel a row of the S tile is split among the `tc` threads `(ty, 0), ..., (ty, tc-1)`:
# each holds `RN` of the row's `block_k` scores in registers. The online softmax needs the row's max `m`
# and the sum `l = sum_j exp(S_j - m)` over all of them, and every one of those threads needs both to
# turn its own scores into `P`. There are no warp shuffles here (the simulator has none, and the lesson's
# kernel does without): the threads of a row exchange their partial results through a small shared
# buffer `red`, one slot per (thread column `tx`, row of the tile).
#
# Layout as in section 1: thread `t` is `(ty, tx) = (t // tc, t % tc)` and holds, in `sc[i, j]`, the
# score of tile row `ty*RM + i` and key `tx*RN + j`; keys past `n_k` hold `-inf`. One tile of keys
# (`n_k <= block_k`), grid `ceil(n_q / block_q)`. Fill `m_row[i]` and `l_row[i]` for each of your `RM`
# rows, in every thread; the given code then writes `P = exp(sc - m_row) / l_row` for your keys, and
# threads with `tx == 0` write `m` and `l`. The checker runs the simulator's race check: mind the barriers.

# %%
def build_row_stats(block_q, block_k, tr, tc):
    RM, RN = block_q // tr, block_k // tc

    @cuda.jit
    def row_stats(s, p, m, l):
        red = cuda.shared.array((tc, block_q), float32)  # red[tx, row]: one partial per thread of the row
        t = cuda.threadIdx.x
        ty, tx = t // tc, t % tc
        q0 = cuda.blockIdx.x * block_q
        n_q, n_k = s.shape[0], s.shape[1]
        sc = cuda.local.array((RM, RN), float32)  # this thread's scores, as if just computed
        for i in range(RM):
            for j in range(RN):
                r, c = q0 + ty * RM + i, tx * RN + j
                sc[i, j] = -math.inf if c >= n_k else (s[r, c] if r < n_q else float32(0.0))
        m_row = cuda.local.array(RM, float32)  # max of each of your rows over all block_k keys
        l_row = cuda.local.array(RM, float32)  # sum of exp(score - m_row) over all block_k keys

        ### BEGIN SOLUTION
        for i in range(RM):
            mx = sc[i, 0]
            for j in range(1, RN):
                mx = max(mx, sc[i, j])
            red[tx, ty * RM + i] = mx
        cuda.syncthreads()  # every partial max is in red
        for i in range(RM):
            mx = red[0, ty * RM + i]
            for t2 in range(1, tc):
                mx = max(mx, red[t2, ty * RM + i])
            m_row[i] = mx
        cuda.syncthreads()  # every thread has read the maxima: red may be reused
        for i in range(RM):
            part = float32(0.0)
            for j in range(RN):
                part += math.exp(sc[i, j] - m_row[i])
            red[tx, ty * RM + i] = part
        cuda.syncthreads()  # every partial sum is in red
        for i in range(RM):
            total = float32(0.0)
            for t2 in range(tc):
                total += red[t2, ty * RM + i]
            l_row[i] = total
        ### END SOLUTION

        for i in range(RM):
            r = q0 + ty * RM + i
            if r < n_q:
                for j in range(RN):
                    if tx * RN + j < n_k:
                        p[r, tx * RN + j] = math.exp(sc[i, j] - m_row[i]) / l_row[i]
                if tx == 0:
                    m[r] = m_row[i]
                    l[r] = l_row[i]

    return row_stats


# %%
S = rng.standard_normal((8, 6)).astype(np.float32)
P, m, l = np.zeros_like(S), np.zeros(8, np.float32), np.zeros(8, np.float32)
build_row_stats(8, 8, 4, 2)[1, 8](S, P, m, l)
print("P error:", flashlab.relative_error(P, flashlab.safe_softmax(S.astype(np.float64))))

# %%
flashlab.check("row_stats", build_row_stats)

# %% [markdown]
# The register kernel does one thing differently: it combines the maxima every tile, but keeps each
# thread's share of `l` (rescaled like `O` whenever `m` grows) and adds the `tc` shares up only once,
# after the last tile. Sums can wait; the max cannot: P goes back to shared memory for the `P V`
# product, and all of its entries must be relative to the same m.

# %% [markdown]
# ## 3. Registers or local memory?
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
