# %% [markdown]
# # 17 · The tensor-core backward
#
# Lesson 06's backward has five matrix products per tile; lesson 16 ran the forward's two on tensor cores.
# This lesson runs all five on `mma.sync` (`flashlab/kernels/tensor_backward.py`). Most of lesson 15's and
# 16's tricks carry over; one layout does not, and that one decides how dQ is computed.
#
# **After this lesson you can**
# - say why each warp of the backward owns keys, not queries, and so computes the transposes Sᵀ and dPᵀ;
# - say which fragment layouts the five products use, and which operands come straight from registers;
# - show why dS must be transposed on its way to dQ, and do the transpose with a store and `ldmatrix.trans`;
# - say why dQ is accumulated with float32 atomics, and what that costs in reproducibility;
# - count the shared memory a backward tile needs, and say when a block needs the dynamic opt-in.
#
# Sources: FlashAttention-2 (Dao 2023, arXiv 2307.08691), Algorithm 2 and its `dq_accum`; PTX ISA, "Warp Level
# Matrix Multiply-Accumulate Instructions" (`mma`, `ldmatrix`) and "atom".

# %%
import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import device, fragments as F, reference_attention, relative_error
from flashlab.hardware import GPUS
from flashlab.kernels import mma
from flashlab.viz import tensor as tviz

cuda = device.get_cuda()
rng = np.random.default_rng(0)
print("running on:", device.device_limits()["name"], "" if device.has_gpu() else "(every warp instruction is emulated)")

# %% [markdown]
# ## 1. One block, five products
#
# Lesson 06's backward has five matrix products per tile. `flashlab/kernels/tensor_backward.py` runs them
# on `mma.sync` with the forward's tricks, and one new one. Its thread block owns a block of keys, and each
# warp owns 16 of them, so that dK and dV (one row per key) can sit in registers for the whole loop over
# query tiles, as O does in the forward. The figure shows one block (4 warps, a tile of 32 queries) and
# where each operand comes from.

# %%
tviz.plot_backward_block(warps=4, block_q=32, query=5)
plt.show()

# %% [markdown]
# What to see:
#
# - A warp's accumulators must have *keys* as rows, so every warp computes its band of the transposes,
#   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, instead of S and dP. Its rows are the warp's 16 keys, its columns the tile's
#   queries, and it comes out of the `mma` as C fragments (lesson 15's section 4, turned on its side).
# - Pᵀ and dSᵀ, computed from those C fragments, are exactly the A operands of dV += Pᵀ dO and
#   dK += dSᵀ Q: two 8-query n-tiles of C are one 16-query k-step of A, as P was in the forward. dK and
#   dV never leave the warp.
# - dQ is the odd one out. Its rows are queries, and one query's row of dS (outlined) is a *column* of dSᵀ
#   that crosses every warp's band, 16 keys in each. So dSᵀ goes through shared memory before the warps
#   split dQ's tile between them.
#
# The five products, with the operands each `mma` gets (16-bit inputs; lesson 15's section 3 for `ldmatrix`):
#
# | product | A operand (16 rows) | B operand | C / D |
# | --- | --- | --- | --- |
# | Sᵀ = K Qᵀ | K: `ldmatrix` from shared memory | Q: `ldmatrix` (stored row-major, read as B's columns) | Sᵀ, rows = keys |
# | dPᵀ = V dOᵀ | V: held in registers (or `ldmatrix` when the tile keeps V in shared memory) | dO: `ldmatrix` | dPᵀ, rows = keys |
# | dV += Pᵀ dO | Pᵀ: straight from Sᵀ's C fragments (lesson 15's section 4) | dO: `ldmatrix.trans` (like V in the forward) | dV in registers |
# | dK += dSᵀ Q | dSᵀ: straight from its C fragments | Q: `ldmatrix.trans` | dK in registers |
# | dQ += dS K | dS: `ldmatrix.trans` of dSᵀ, **after a trip through shared memory** | K: `ldmatrix.trans` | added to dQ with atomics |
#
# Between the products, Pᵀ = exp(scale·Sᵀ − lse) and dSᵀ = Pᵀ ∘ (dPᵀ − D) are computed in fp32 on the C
# fragments. lse and D belong to queries, so they now index *columns*. Pᵀ and dSᵀ are rounded to 16 bits
# before their products, as in FlashAttention-2. In float32 (1xTF32 and 3xTF32) the kernel reads every
# operand from shared memory with plain 32-bit loads instead of `ldmatrix`, and reuses C fragments as A
# fragments with lesson 15's renumbering of the k index (section 4).
#
# Even within one warp, dS's values sit in the wrong lanes for dQ: the figure colours every cell by the
# lane that holds it, as a C fragment of dSᵀ (left) and as the A fragment dQ's `mma` needs (right).

# %%
tviz.plot_ds_transpose(lane=5)
plt.show()
src = tviz.ds_sources()
moved = (src[:, :, 1] != np.arange(32)[:, None]).mean()
print(f"{moved:.1%} of the A fragment's values sit in another lane's C fragment")

# %% [markdown]
# So each warp stores its dSᵀ to shared memory, key-major: C's neighbours c0, c1 (columns 2t and 2t+1) are
# neighbouring queries of one key, so they go out as one packed 32-bit word. The block synchronises, and
# `ldmatrix.trans` reads the stored 8 x 8 blocks back transposed: query-major, which is exactly dS's A
# fragment, the same instruction that turns V around in the forward. Here is that round trip for one
# warp's 16 keys x 16 queries, with lesson 15's `ldmatrix_both` kernel doing the reading (the simulator's
# `ldmatrix`, or the real one on a GPU):

# %%
from flashlab.kernels.demo import ldmatrix_both  # lesson 15, section 3

dS_T = F.round_f16(rng.standard_normal((16, 16)))  # one warp's dSᵀ: 16 keys x 16 queries
c_tiles = [F.to_fragments(dS_T[:, 8 * n:8 * n + 8], "m16n8k16", "C") for n in range(2)]  # n-tile n: queries 8n..

# Store: lane (g, t) writes (c0, c1) to row g and (c2, c3) to row g + 8, word 4n + t (queries 8n + 2t, + 1).
lanes = np.arange(32)
g, t = lanes // 4, lanes % 4
stored = np.zeros((16, 8), np.uint32)  # rows = keys, 8 words = 16 queries
for n, c in enumerate(c_tiles):
    bits = F.to_bits16(c, "float16")
    stored[g, 4 * n + t] = F.pack16(bits[:, 0], bits[:, 1])
    stored[g + 8, 4 * n + t] = F.pack16(bits[:, 2], bits[:, 3])

# Read: ldmatrix.x4.trans, register r from the 8 x 8 block of keys 8 (r // 2).. and query words 4 (r % 2)..
blocks = np.concatenate([stored[8 * (r // 2):8 * (r // 2) + 8, 4 * (r % 2):4 * (r % 2) + 4] for r in range(4)])
plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
ldmatrix_both[1, 32](np.ascontiguousarray(blocks), plain, trans)
want = F.registers16(F.to_fragments(dS_T.T, "m16n8k16", "A"))  # dS (rows = queries) as dQ's A operand
print("ldmatrix.trans of the stored dSᵀ is dS's A fragment:", np.array_equal(trans, want))
print("plain ldmatrix of the same words is not:", not np.array_equal(plain, want))

# %% [markdown]
# ## 2. Why dQ needs atomics
#
# Each block holds one block of keys, so it sees only its share of a query's dQ;
# the other key blocks hold the rest. Two ways to add the shares up:
#
# - a second pass that loops over the key blocks of each query block. It must recompute Sᵀ and dPᵀ, two
#   more of the five products, and read K and V again. All five have the same size (Nq·Nk·d multiply-adds),
#   so that is 2/5 = 40% more FLOPs;
# - float32 `atomicAdd` into a dQ accumulator in global memory, then a cast to q's dtype. FlashAttention-2
#   does this (its `dq_accum`), and so does this kernel.
#
# The atomics' price: float32 additions happen in the order blocks finish, so dQ can change in its last
# bits from run to run, where dK and dV (written once, by one block) do not. The GPU test suite checks both
# (`tests/test_tensor_backward.py`). Under grouped-query attention (lesson 18's topic: fewer K/V heads than
# query heads), a block walks the query tiles of every query head that shares its K/V head, so dK and dV
# add up in registers and need no atomics either.
#
# The kernel runs in the simulator like the forward, every `mma` and `ldmatrix` emulated for the warp; on
# a small ragged, causal problem against float64 gradients:

# %%
from flashlab.kernels import flash_attention_backward

qb, kb, vb, dob = (rng.standard_normal((1, 1, n, 16)).astype(np.float16) for n in (19, 23, 23, 19))
f64 = [x.astype(np.float64) for x in (qb, kb, vb, dob)]
ob, lseb = reference_attention(*f64[:3], causal=True)
want_grads = flashlab.flash_attention_v2_backward(*f64[:3], ob, lseb, f64[3], causal=True)
got_grads = flash_attention_backward(qb, kb, vb, ob.astype(np.float16), lseb.astype(np.float32), dob, causal=True,
                                     variant="tensor", block_q=16, block_k=16)
for name, g, w in zip(("dQ", "dK", "dV"), got_grads, want_grads):
    print(f"{name}: relative error {relative_error(g.astype(np.float64), w):.1e} (float16 inputs and outputs)")

# %% [markdown]
# ## 3. How fast, and how much shared memory
#
# On a GPU this backward is the default for float16 and bfloat16 gradients (float32 keeps the FP32-unit
# kernel unless you ask for `variant="tensor"`, which runs 3xTF32). `bash benchmarks/check_tensor_backward_gpu.sh bench`
# times it against torch SDPA's backward in the same dtype and the same run (`flashlab/data/tensor_backward.json`);
# the dashed line is SDPA.

# %%
bwd = tviz.load_backward_results()
if bwd:
    tviz.plot_backward_speed(bwd)
    plt.show()
    for r in (r for r in bwd["rows"] if r["n"] == 4096):
        print(f"d={r['d']:3d} causal={str(r['causal']):5s} {r['dtype']:8s} tile {r['config']:18s} "
              f"{r['tflops']:5.1f} TFLOP/s, {r['vs_sdpa']:4.0%} of SDPA; {r['regs']} registers/thread, "
              f"{r['smem_bytes'] // 1024} KB shared")
    for dt, r in bwd["dq_run_to_run"].items():
        print(f"dQ run to run ({dt}): largest change {r['dq_max_rel']:.1e} of max |dQ|; "
              f"dK and dV identical: {r['dk_dv_identical']}")
else:
    print("no benchmark data found (flashlab/data/tensor_backward.json is missing from this install)")

# %% [markdown]
# Read the printed rows for this run's numbers. On the H100 the 16-bit backward runs at about a third of
# SDPA's speed at N = 4096 (more under causal masking), and 3xTF32 at d = 64 at about SDPA's own float32
# speed (less at d = 128). These are whole calls, host included: the checks, the plan and numba's typing of
# three kernels' arguments happen once per shape and options, and later calls only allocate the gradients
# and launch (`kernels/prepared.py`).
#
# **Bigger tiles need more than 48 KB.** The kernel's shared memory is one *dynamic* array (lesson 7), sized
# at launch, and the kernel opts in to more than 48 KB where the device allows it. That is what lets a block
# own 128 keys (8 warps) at d = 128: 78 KB, where a 48 KB tile holds 64 keys. Each block then streams Q_i and
# dO_i and adds its dQ atomics once for twice as many keys; at d = 128 the bigger tile measured 1.37x faster
# than the 48 KB one (`benchmarks/results/logs-tensor-backward/tiles_dynamic_h100.txt`). The registers tell the rest of the story:
# an SM has 64K of them, so a tile that needs close to 255 a thread fits 8 warps per SM, too few to hide all
# of the latency of the shared-memory loads between the `mma`. The atomics' price is visible too: dQ moves in
# its last bits between identical calls, while dK and dV come out bit for bit the same.
#
# How much shared memory each tile needs, against what a block may have (bars: `BackwardTile.shared_words`,
# the layout the kernel uses; lines: static shared memory, and the opt-in limits of a T4 and an H100):

# %%
from flashlab.kernels import tensor_backward as tb

tiles = [("16-bit d128, 16x64", 128, "f16", tb.BackwardTile(4, 16, 2)),
         ("16-bit d128, 32x128 (default)", 128, "f16", tb.BackwardTile(*tb.DEFAULT_TILES["16-bit"][128])),
         ("16-bit d64, 32x128", 64, "f16", tb.BackwardTile(8, 32, 2)),
         ("16-bit d64, 64x128 (default)", 64, "f16", tb.BackwardTile(*tb.DEFAULT_TILES["16-bit"][64])),
         ("3xTF32 d64, 32x64 V shared (default)", 64, "3xtf32", tb.BackwardTile(*tb.DEFAULT_TILES["float32"][64])),
         ("3xTF32 d128, 16x64 V shared (default)", 128, "3xtf32", tb.BackwardTile(*tb.DEFAULT_TILES["float32"][128]))]
kib = [4 * tile.shared_words(d, prec) / 1024 for _, d, prec, tile in tiles]
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.barh([name for name, *_ in tiles], kib, color="tab:blue")
for x, label, style in ((48, "48 KB: static shared memory", ":"), (64, "64 KB: a T4's opt-in limit", "--"),
                        (GPUS["H100"].shared_per_block / 1024, "227 KB: an H100's opt-in limit", "-")):
    ax.axvline(x, color="tab:red", linestyle=style, label=label)
ax.legend(loc="center right", fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("shared memory per block (KB)")
ax.set_title("The tensor backward's tiles (block_q x block_k)")
plt.tight_layout()
plt.show()
for (name, *_), k in zip(tiles, kib):
    print(f"{name:40s} {k:6.1f} KB {'fits 48 KB' if k <= 48 else 'needs the opt-in'}")

# %% [markdown]
# ## 4. Where this kernel differs from FlashAttention-2
#
# - **Work per warp.** This backward gives each warp 16 keys and all of a query tile, so a block of 128 keys needs
#   8 warps. FA2's d = 128 backward on sm80 also has 8 warps for 128 keys x 64 queries, but lays them out 4 x 2
#   over dK and dV's keys and dimensions (its `Flash_bwd_kernel_traits`), so each warp holds 32 keys x 64
#   dimensions of them, where ours holds 16 keys x 128. Ours keeps V's fragments in registers (16-bit) or in
#   shared memory (3xTF32), where FA2 tunes this per head dimension.
# - **Shared memory.** It takes the dynamic opt-in (up to 104 KB here); FA2 and FA3 also use the room for
#   deeper pipelines, and FA3 on Hopper runs the products on `wgmma` with TMA copies.
# - **dQ.** FA2 also adds dQ with float32 atomics into `dq_accum` and converts it in a separate kernel; FA3
#   keeps that scheme. A deterministic mode has to fix the order of the additions instead (the library's
#   `deterministic=True`).

# %% [markdown]
# ## 5. Where to go next: the same ideas in other tools
#
# Lessons 15 to 17 wrote every register by hand. Production kernels name the same objects one level up, and
# knowing which object is which makes their code readable. Three places to look next, each doing one thing this
# course did.
#
# **One warp-level product**, in three tools:
#
# | | what you write | who decides the fragments |
# | --- | --- | --- |
# | this course | `mma_f16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)` per warp, per (m-tile, n-tile, k-step) | you, from the PTX ISA's layouts (lesson 15) |
# | Triton | `acc = tl.dot(p, v, acc)` on whole blocks of a program | the compiler: it picks `mma.sync` on Ampere and `wgmma` on Hopper, and the register layouts that go with them |
# | CuTe (CUTLASS 3) | a `TiledMMA` built from an MMA atom (FA2 uses `SM80_16x8x16_F32F16F16F32_TN`) and a layout of warps; `partition_fragment_A/B/C` give each thread its fragments, `cute::gemm` issues the atoms | the atom's traits, which encode the same PTX tables as a layout function |
#
# - **Triton** (`triton.language.dot`, triton-lang.org) hides everything this course made explicit, and is
#   the fastest way to a working kernel. Its `input_precision="tf32x3"` for float32 inputs is lesson 15's
#   3xTF32: the two small products and then the big one chained in one tensor-core accumulator, the block's
#   result then added in fp32 (CUTLASS's order, the one lesson 15 contrasts with fp32 adds). Read its fused-attention
#   tutorial next to lesson 16: the loop is the same list of steps.
# - **CuTe** keeps the structure visible but computes it: an MMA atom is one instruction with its fragment
#   layouts, a `TiledMMA` repeats it over warps and m-/n-tiles (lesson 16's tile hierarchy), and copy atoms such
#   as `SM75_U32x4_LDSM_N` and `SM75_U16x8_LDSM_T` are `ldmatrix.x4` and its `.trans` form. FlashAttention-2's
#   `kernel_traits.h` is a short, readable example; CuTe's tutorial on MMA atoms (`0t_mma_atom.md` in CUTLASS's
#   documentation) draws the same fragment figures as lesson 15.
#
# **One rescale.** Lesson 16's kernel votes per warp and rescales O whenever some row's max grew.
# FlashAttention-4 (Zadouri et al. 2026, arXiv 2603.05451) does it per row, in `update_row_max` of its
# `flash_attn/cute/softmax.py`, on Blackwell where one thread owns a whole row of S, so no shuffle is needed:
#
# 1. the new max is the max of the old one and the tile's row;
# 2. the rescale factor in log2 units is (m_old − m_new) · scale_log2;
# 3. if that factor is above −threshold (the max grew by less than the threshold), the old max is kept and the
#    factor is 1: no rescale at all;
# 4. otherwise the max moves and O and l are multiplied by 2^factor, by separate "correction" warps.
#
# Step 3 is lesson 16's stale max: exact, because O, l and the final division share whichever max was used.
# The cell below runs that rule on one row of random scores, tile by tile, and counts how often it rescales
# against the course's rule (threshold 0).

# %%
row = rng.standard_normal(4096) * 2
tiles = row.reshape(-1, 64)
for threshold in (0.0, 8.0):
    m_used, rescales = -np.inf, 0
    for tile in tiles:
        m_new = max(m_used, tile.max())
        factor = (m_used - m_new) * np.log2(np.e)  # log2 units, as FA4 keeps them
        if np.isfinite(m_used) and factor < -threshold:
            rescales += 1
        if not np.isfinite(m_used) or factor < -threshold:
            m_used = m_new
    print(f"threshold {threshold:3.0f} (log2 units): {rescales} rescales over {len(tiles)} key tiles, "
          f"largest P = {np.exp(row.max() - m_used):.1f}")

# %% [markdown]
# **And on Hopper.** Lesson 11 told FlashAttention-3's ideas as a model: warp specialization, pingpong, `wgmma`
# and TMA; lesson 20 builds its forward from Python. The FA3 paper (Shah et al. 2024, arXiv 2407.08608) and its
# `hopper/` directory are the next read after these lessons; every object in them has a counterpart here (a
# warpgroup's `wgmma` fragment is four warps' worth of lesson 15's C fragments).

# %% [markdown]
# ## Summary
#
# - The backward keeps dK and dV in registers by giving each warp 16 keys, so it computes Sᵀ and dPᵀ.
# - Pᵀ and dSᵀ feed dV and dK straight from their C fragments, as P fed O in the forward.
# - dQ needs dS with queries as rows: a trip through shared memory and `ldmatrix.trans`, and float32 atomics to
#   sum the key blocks' shares, which makes dQ's last bits depend on the order blocks finish.
# - Bigger key blocks need more than 48 KB of shared memory: dynamic shared memory and the opt-in.
#
# **Exercises:** [17_tensor_core_backward](../exercises/17_tensor_core_backward.ipynb): find where each value
# of the backward's dS fragment sits in the warp's dSᵀ, and count the shared memory a backward tile needs
# (which tiles fit 48 KB, and which need the opt-in).
