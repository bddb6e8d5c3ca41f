# %% [markdown]
# # Exercises 08: the inner loop of a shared-memory flash kernel
#
# Goes with lesson [08 a first flash kernel](../notebooks/08_first_flash_kernel.ipynb). The kernel below is
# the lesson's textbook kernel for one head: a block of `block_q` threads owns `block_q` query rows, one
# row per thread; the block walks over the keys in tiles of `block_k` rows of K and V, copied into shared
# memory. Everything is written except the part that makes it attention: the online softmax over the keys
# of one tile (lesson 03), done by each thread for its own row.
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
# ## The online update, one key at a time
#
# Thread `t` holds in registers its query row `q_row` (already multiplied by `scale`), the unnormalised
# output row `acc` (d floats), the running max `m` and the running sum `l`. For each key `c` of the tile
# in shared memory (`Ks[c]`, `Vs[c]`) that its row may see:
#
# - the key exists: `k0 + c < n_k` (the last tile is padded with zeros: a zero key still scores 0 and
#   would get a share of the softmax if you let it in);
# - with `causal`, the key is not in the future: `k0 + c <= row`;
#
# it does
#
# ```
# s     = q_row · Ks[c]                 (d multiply-adds)
# m_new = max(m, s)
# alpha = exp(m - m_new)                (rescales what was accumulated under the old max)
# p     = exp(s - m_new)
# l     = l * alpha + p
# acc   = acc * alpha + p * Vs[c]
# m     = m_new
# ```
#
# Rows past `n_q` compute garbage that is never written; leave them be. Use `math.exp`.

# %%
def build_flash_shared(d, block_q, block_k, causal):
    """A kernel computing (O, lse) of one head: launch with grid = ceil(n_q / block_q), block = block_q."""

    @cuda.jit
    def flash_shared(q, k, v, o, lse, scale):
        Ks = cuda.shared.array((block_k, d), float32)
        Vs = cuda.shared.array((block_k, d), float32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x * block_q + t
        n_q, n_k = q.shape[0], k.shape[0]

        q_row = cuda.local.array(d, float32)
        acc = cuda.local.array(d, float32)
        for x in range(d):
            q_row[x] = q[row, x] * scale if row < n_q else float32(0.0)
            acc[x] = 0.0
        m = float32(-math.inf)
        l = float32(0.0)

        for k0 in range(0, n_k, block_k):
            for c in range(t, block_k, block_q):  # thread t copies tile rows t, t + block_q, ...
                for x in range(d):
                    inside = k0 + c < n_k
                    Ks[c, x] = k[k0 + c, x] if inside else float32(0.0)
                    Vs[c, x] = v[k0 + c, x] if inside else float32(0.0)
            cuda.syncthreads()  # the whole tile is in shared memory

            ### BEGIN SOLUTION
            for c in range(block_k):
                key = k0 + c
                if key < n_k and (not causal or key <= row):
                    s = float32(0.0)
                    for x in range(d):
                        s += q_row[x] * Ks[c, x]
                    m_new = max(m, s)
                    alpha = math.exp(m - m_new)
                    p = math.exp(s - m_new)
                    l = l * alpha + p
                    for x in range(d):
                        acc[x] = acc[x] * alpha + p * Vs[c, x]
                    m = m_new
            ### END SOLUTION

            cuda.syncthreads()  # nobody reads this tile any more: the next one may overwrite it

        if row < n_q:
            for x in range(d):
                o[row, x] = acc[x] / l
            lse[row] = m + math.log(l)

    return flash_shared


# %%
rng = np.random.default_rng(0)
Q, K, V = (rng.standard_normal((n, 8)).astype(np.float32) for n in (10, 13, 13))
O, lse = np.zeros((10, 8), np.float32), np.zeros(10, np.float32)
kernel = build_flash_shared(8, block_q=8, block_k=4, causal=True)
kernel[2, 8](Q, K, V, O, lse, np.float32(1 / math.sqrt(8)))
print("O error:", flashlab.relative_error(O, flashlab.reference_attention(Q, K, V, causal=True)[0]))

# %%
flashlab.check("flash_shared_kernel", build_flash_shared)

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
