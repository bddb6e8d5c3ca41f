# %% [markdown]
# # Exercises 08: a shared-memory flash kernel with two rows per thread
#
# Goes with lesson [08 a first flash kernel](../notebooks/08_first_flash_kernel.ipynb). The lesson's
# kernel gives each thread one query row, and each thread reads one float from shared memory for every
# multiply-add it does. Here you write a variant that the lesson does not show: every thread owns **two**
# rows, so each K or V element it reads from shared memory feeds two multiply-adds, one per row. And under
# causal masking the block stops before key tiles that none of its rows can see (lesson 05).
#
# The kernel is built by a Python function, so `d`, `block_q`, `block_k` and `causal` are constants when
# Numba compiles it (a local array needs a constant size). `flashlab.check` builds it for several shapes.

# %%
import math

import numpy as np
from numba import float32

import flashlab
from flashlab.device import get_cuda

cuda = get_cuda()

# %% [markdown]
# ## The kernel
#
# A block owns the `block_q` query rows from `q0 = blockIdx.x * block_q` on and has `HALF = block_q // 2`
# threads: thread `t` owns rows `q0 + t` (index 0 in its arrays) and `q0 + t + HALF` (index 1). In
# registers it keeps, for each of its two rows `r`, the scaled query row `q_rows[r]`, the unnormalised
# output row `acc[r]`, the running max `m[r]` and sum `l[r]`. The tile copy into shared memory, the
# barriers and the final division are written. Your two parts:
#
# 1. `k_end`: the block walks over key tiles `k0 = 0, block_k, ...` while `k0 < k_end`. Without the
#    causal mask every key is needed. With it, stop as early as you can without losing a key that one
#    of the block's rows may see. The checker counts the tiles each block loads.
# 2. The online update of lesson 08 for the keys of one tile (`Ks[c]`, `Vs[c]`), done for both rows:
#    each row with its own masks (key `k0 + c` exists; with `causal`, it is not after that row) and its
#    own `m`, `l`, `acc`. Read every element of `Ks` and `Vs` at most once per thread and tile, and use it
#    for both rows: the checker counts your shared-memory reads.
#
# Rows past `n_q` compute garbage that is never written; leave them be. Use `math.exp`.

# %%
def build_flash_shared(d, block_q, block_k, causal):
    """A kernel computing (O, lse) of one head: grid = ceil(n_q / block_q), block = block_q // 2 threads."""
    HALF = block_q // 2

    @cuda.jit
    def flash_shared(q, k, v, o, lse, scale):
        Ks = cuda.shared.array((block_k, d), float32)
        Vs = cuda.shared.array((block_k, d), float32)
        t = cuda.threadIdx.x
        q0 = cuda.blockIdx.x * block_q
        n_q, n_k = q.shape[0], k.shape[0]

        q_rows = cuda.local.array((2, d), float32)
        acc = cuda.local.array((2, d), float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        for r in range(2):
            row = q0 + t + r * HALF
            for x in range(d):
                q_rows[r, x] = q[row, x] * scale if row < n_q else float32(0.0)
                acc[r, x] = 0.0
            m[r] = -math.inf
            l[r] = 0.0

        # Part 1: k_end, and any local arrays part 2 needs (allocate them here, outside the loops).
        ### BEGIN SOLUTION
        k_end = n_k
        if causal:
            k_end = min(n_k, q0 + block_q)  # the block's rows see no key from q0 + block_q on
        s = cuda.local.array(2, float32)
        p = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        ### END SOLUTION

        for k0 in range(0, k_end, block_k):
            for c in range(t, block_k, HALF):  # thread t copies tile rows t, t + HALF, ...
                for x in range(d):
                    inside = k0 + c < n_k
                    Ks[c, x] = k[k0 + c, x] if inside else float32(0.0)
                    Vs[c, x] = v[k0 + c, x] if inside else float32(0.0)
            cuda.syncthreads()  # the whole tile is in shared memory

            # Part 2: the online update of both rows for the keys of this tile.
            ### BEGIN SOLUTION
            for c in range(block_k):
                key = k0 + c
                for r in range(2):
                    s[r] = 0.0
                for x in range(d):
                    kx = Ks[c, x]  # one shared read, a multiply-add for each row
                    for r in range(2):
                        s[r] += q_rows[r, x] * kx
                for r in range(2):
                    p[r] = 0.0  # a masked key changes nothing: p = 0, alpha = 1
                    alpha[r] = 1.0
                    if key < n_k and (not causal or key <= q0 + t + r * HALF):
                        m_new = max(m[r], s[r])
                        alpha[r] = math.exp(m[r] - m_new)
                        p[r] = math.exp(s[r] - m_new)
                        l[r] = l[r] * alpha[r] + p[r]
                        m[r] = m_new
                for x in range(d):
                    vx = Vs[c, x]
                    for r in range(2):
                        acc[r, x] = acc[r, x] * alpha[r] + p[r] * vx
            ### END SOLUTION

            cuda.syncthreads()  # nobody reads this tile any more: the next one may overwrite it

        for r in range(2):
            row = q0 + t + r * HALF
            if row < n_q:
                for x in range(d):
                    o[row, x] = acc[r, x] / l[r]
                lse[row] = m[r] + math.log(l[r])

    return flash_shared


# %%
rng = np.random.default_rng(0)
Q, K, V = (rng.standard_normal((n, 8)).astype(np.float32) for n in (10, 13, 13))
O, lse = np.zeros((10, 8), np.float32), np.zeros(10, np.float32)
kernel = build_flash_shared(8, block_q=8, block_k=4, causal=True)
kernel[2, 4](Q, K, V, O, lse, np.float32(1 / math.sqrt(8)))
print("O error:", flashlab.relative_error(O, flashlab.reference_attention(Q, K, V, causal=True)[0]))

# %%
flashlab.check("flash_shared_kernel", build_flash_shared)

# %% [markdown]
# Two rows per thread halve the shared reads per multiply-add, and the two rows' dot products are
# independent, so one can proceed while the other waits. Lesson 09 takes the idea all the way: several
# threads share a row, and each thread owns a small tile of S and of O.

# %% [markdown]
# ## Bank conflicts
#
# Shared memory is 32 banks; 32-bit word `w` lives in bank `w % 32`, and each bank serves one word per
# pass. Threads of a warp that ask one bank for the *same* word share it; threads that ask one bank for
# *different* words are served one pass after another (lesson 08). Write `bank_conflict_degree(words)`:
#
# - `words`: a NumPy integer array, the 32-bit word index (byte address // 4) each active thread of a warp
#   reads or writes with a 4-byte access (1 to 32 entries, any order, repeats allowed);
#
# and return, as an `int`, the number of passes the access needs: 1 when it is conflict-free, k for a
# k-way conflict.
#
# Predict before you run the cell after it: a warp reading a column of a 32 x 32 float tile stored with
# rows of 33 words; a warp reading words `0, 3, 6, ..., 93`; and lesson 09's kernel writing its transposed K
# tile without padding (`flashlab.memory_access.register_kernel_stores` gives those words).

# %%
def bank_conflict_degree(words):
    ### BEGIN SOLUTION
    words = np.unique(np.asarray(words, dtype=np.int64))  # a word asked for twice is fetched once
    return int(np.bincount(words % 32, minlength=32).max())
    ### END SOLUTION


# %%
lane = np.arange(32)
from flashlab.kernels.register import choose_tile  # noqa: E402 (the tile lesson 09's kernel uses at d = 64)
from flashlab.memory_access import register_kernel_stores  # noqa: E402

print("a column, rows of 33 words:", bank_conflict_degree(33 * lane))
print("every third word:          ", bank_conflict_degree(3 * lane))
unpadded = register_kernel_stores(64, choose_tile(64), pad={"Kt": 0})["Kt"]
print("lesson 09's K^T, no padding:", bank_conflict_degree(unpadded))

# %%
flashlab.check("bank_conflict_degree", bank_conflict_degree)
