# %% [markdown]
# # 08 · A first flash kernel, in shared memory, and why it is slow
#
# **After this lesson you can**
# - map FlashAttention-2 onto the GPU the textbook way: one thread block per block of query rows, one
#   thread per row, K and V tiles copied into shared memory;
# - run flashlab's kernel (`variant="shared"`) and check it against the float64 reference;
# - count the bytes it moves from HBM and show that they are *not* what makes it slow;
# - tell when a warp's shared-memory accesses conflict in a bank, check the kernel's accesses with a model,
#   and say exactly why lesson 09's kernel pads the rows of its tiles;
# - read its resource use (threads, shared memory, registers) and its theoretical occupancy, and explain
#   the gap to PyTorch with them.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

import flashlab
from flashlab import device, reference_attention, relative_error
from flashlab.kernels import flash_attention, kernel_info
from flashlab.viz import gpu as gviz

ON_GPU = device.has_gpu()
rng = np.random.default_rng(0)

# %% [markdown]
# ## The mapping
#
# FA2's outer loop runs over query blocks, which are independent (lesson 05): each becomes a thread block.
# Inside, the simplest split is one thread per query row. The block walks over the keys in tiles; for each
# tile its threads copy `block_k` rows of K and V into shared memory together, wait at a barrier, and then
# each thread runs the online softmax of lesson 03 over the tile for its own row. Colours are thread
# blocks; the outlined tile is the one in shared memory at this moment:

# %%
gviz.plot_shared_kernel_map(nq=32, nk=48, block_q=8, block_k=16, current_tile=1);

# %% [markdown]
# Per thread, in registers: its row of Q (scaled), its unnormalised row of O (d floats), the running max m
# and sum l. Per block, in shared memory: one tile of K and one of V, `2 · block_k · d` floats. In outline:
#
# ```
# for each key tile k0:                      # the whole block together
#     copy K[k0 : k0+block_k], V[...] -> shared (zeros past N);  syncthreads()
#     for each key c of the tile:            # each thread, its own row
#         if the key exists (and is not in the future, if causal):
#             s = q_row · K[c];  m_new = max(m, s);  alpha = exp(m - m_new);  p = exp(s - m_new)
#             l = alpha·l + p;   o_row = alpha·o_row + p·V[c];  m = m_new
#     syncthreads()                          # before the next tile overwrites this one
# O[row] = o_row / l;  lse[row] = m + log l
# ```
#
# (flashlab's kernel, `flashlab/kernels/shared.py`, works in base-2 exponentials and skips key tiles a
# causal block cannot see; otherwise it is this.) It is correct for any N, causal or not:

# %%
size = device.kernel_size  # GPU sizes on a GPU; small ones in the simulator (it runs threads in Python)
B, H, d = 1, 2, size(64, 16)
for nq, nk, causal in [(size(1000, 37), size(1000, 21), False), (size(777, 30), size(1000, 30), True)]:
    q, k, v = (rng.standard_normal((B, H, n, d)).astype(np.float32) for n in (nq, nk, nk))
    o, lse = flash_attention(q, k, v, causal=causal, variant="shared", block_q=size(64, 16), block_k=size(32, 8))
    o_ref, lse_ref = reference_attention(q, k, v, causal=causal)
    print(f"Nq={nq:4d} Nk={nk:4d} causal={causal!s:5}: O error {relative_error(o, o_ref):.1e}, "
          f"lse error {relative_error(lse, lse_ref):.1e}")

# %% [markdown]
# ## How fast?
#
# On a GPU we time it at the size of the course's benchmark (B = 1, H = 16, N = 4096, d = 64, float32)
# next to PyTorch's `scaled_dot_product_attention`, with CUDA events, after a warm-up that compiles the
# kernel (lesson 10 has the details). Without a GPU, the numbers recorded on the project's H100.

# %%
N_BENCH, D_BENCH = 4096, 64
flops = 4 * 16 * N_BENCH**2 * D_BENCH  # two matrix products of 2·N·N·d per head
speeds = {}
if ON_GPU:
    import torch
    import torch.nn.functional as F

    from flashlab.bench import time_cuda

    qt, kt, vt = (torch.randn(1, 16, N_BENCH, D_BENCH, device="cuda") for _ in range(3))
    for name, fn in {"flashlab shared": lambda: flash_attention(qt, kt, vt, variant="shared"),
                     "torch SDPA fp32": lambda: F.scaled_dot_product_attention(qt, kt, vt)}.items():
        speeds[name] = flops / (time_cuda(fn, warmup=2, reps=20)["median_ms"] * 1e-3) / 1e12
else:
    recorded = {r["impl"]: r["tflops"] for r in gviz.RECORDED if (r["N"], r["d"]) == (N_BENCH, D_BENCH)}
    speeds = {"flashlab shared": recorded["flashlab shared fp32"], "torch SDPA fp32": recorded["torch SDPA fp32"]}
    print(f"no GPU: {gviz.RECORDED_SOURCE}")
for name, tf in speeds.items():
    print(f"{name:16s} {tf:6.1f} TFLOP/s")
print(f"the textbook kernel reaches {speeds['flashlab shared'] / speeds['torch SDPA fp32']:.0%} of SDPA")

# %% [markdown]
# On the project's H100, under a third of PyTorch; the line above gives the ratio on your GPU. Where does
# the time go?
#
# ## Suspect 1: bytes from HBM
#
# Per head, the kernel reads Q once and writes O (and lse) once; it reads all of K and V once per query
# block, `T_r = ceil(N / block_q)` times. Everything else happens on chip. So, in bytes (float32),
# `4 · (2·N·d + 2·N·d·T_r) + 4·N`, against `4·N²·d` FLOPs:

# %%
for block_q in (32, 64, 128):
    tr = math.ceil(N_BENCH / block_q)
    hbm = 4 * (2 * N_BENCH * D_BENCH + 2 * N_BENCH * D_BENCH * tr) + 4 * N_BENCH
    intensity = 4 * N_BENCH**2 * D_BENCH / hbm
    print(f"block_q = {block_q:3d}: {hbm / 2**20:6.1f} MiB per head, {intensity:5.1f} FLOP/byte "
          f"(≈ block_q / 2)")
print("H100 ridge point for FP32: 67 TFLOP/s / 3.35 TB/s = 20 FLOP/byte")
from flashlab.hardware import GPUS  # noqa: E402

t4 = GPUS["T4"]  # Colab's GPU
print(f"T4 ridge point for FP32: {t4.fp32_flops / 1e12:.1f} TFLOP/s / {t4.bandwidth / 1e9:.0f} GB/s = "
      f"{t4.fp32_flops / t4.bandwidth:.0f} FLOP/byte")

# %% [markdown]
# With `block_q = 64` the kernel does about 32 FLOPs per byte it moves, above the FP32 ridge point of an
# H100: by the roofline of lesson 01 it could run at the full FP32 rate, 67 TFLOP/s. At 9.4 TFLOP/s it
# moves about 0.3 TB/s of the 3.35 available. HBM is not the problem; the chip is. On a T4 the ridge point
# is a little higher (the second line), still below `block_q = 64`'s intensity, and the FP32 peak is an
# eighth of the H100's: expect single-digit TFLOP/s there from the kernel and from SDPA in float32 alike
# (Turing has no TF32 tensor cores), and the same reasoning.
#
# ## Suspect 2: how each warp touches memory
#
# Lesson 07 showed that a warp's load from HBM costs as many 32-byte sectors as its bytes fall in. Shared
# memory has a rule of its own. It is made of 32 **banks**, each delivering one 4-byte word per cycle, and
# successive words sit in successive banks: word `w` is in bank `w % 32` (CUDA C++ Programming Guide,
# "Shared Memory" of compute capability 5.x, which later GPUs keep; 32 banks on all of them, Table 27). A
# warp's access takes one pass when its threads ask each bank for at most one word. Threads that ask for the
# *same* word share it, a broadcast. Threads that ask one bank for *different* words are served one after
# the other: a k-way **bank conflict** takes k passes (CUDA C++ Best Practices Guide, "Shared Memory and
# Memory Banks"). Shared memory drawn as rows of 32 words, one column per bank, the word each thread asks
# for marked with its lane number; banks asked for several words are outlined in red:

# %%
from flashlab import memory_access as ma
from flashlab.kernels.register import PREFERRED, choose_tile
from flashlab.viz import memory_access as maviz

lane = np.arange(32)
maviz.plot_access_grid({
    "consecutive words": lane,
    "every other word": 2 * lane,
    "all threads read one word": np.zeros(32, int),
    "a column of a 32 x 32 float tile": 32 * lane,
    "the same column, rows padded to 33 words": 33 * lane,
    "every third word": 3 * lane,
}, "banks");

# %% [markdown]
# A column of a 32 x 32 tile is the worst case: all 32 words in bank 0, 32 passes. Give every row one
# unused word and row i starts i banks further on: the same column in one pass. An odd stride never
# conflicts, because it visits all 32 banks before it comes back to one.
#
# Now the textbook kernel. flashlab's version copies a tile with consecutive threads on consecutive
# elements (`e = it * block_q + t`, row `e // d`, column `e % d`), so its loads from HBM are coalesced and
# its stores to shared memory hit consecutive words. In the inner loop every thread reads the same
# `Ks[c, x]` at the same time: a broadcast. A copy where each thread copies a row of its own (`for c in
# range(t, block_k, block_q): for x in range(d): Ks[c, x] = k[k0 + c, x]`) would be the worst of both. For
# warp 0 at d = 64, block_q = 64, block_k = 32, by the model of the figures:

# %%
d_, bq, bk = 64, 64, 32
c, x = ma.shared_kernel_copy(d_, bq, bk)  # the rows and columns warp 0 copies, as in kernels/shared.py
own = np.arange(32)  # one row per thread: thread t copies row t, column 0 first
for name, rows, cols in (("flashlab's copy  ", c, x), ("one row per thread", own, 0 * own)):
    sectors = ma.coalescing(4 * (rows * d_ + cols))["sectors"]
    print(f"{name}: load from HBM {sectors:2d} sectors, store to Ks {ma.bank_conflict_degree(rows * d_ + cols):2d} "
          f"pass(es)")
print(f"inner loop, every thread reads Ks[c, x]: {ma.bank_conflict_degree(np.full(32, 5 * d_ + 7))} pass")

# %% [markdown]
# So the textbook kernel's memory accesses are as cheap as they get: neither suspect 1 nor this one is why
# it is slow.
#
# ### Why lesson 09's kernel pads its tiles
#
# Lesson 09's kernel has each thread read 4 adjacent keys of K from shared memory with one 16-byte load. The
# 4 keys must then be adjacent in shared memory, so it stores K **transposed**: row x of `Kt` holds dim x
# of every key of the tile. Its copy reads K the coalesced way of lesson 07 (runs of 8 threads read 8
# adjacent floats of one key, 4 keys per warp) and each thread writes its float to `Kt[x, c]`. A warp's
# 32 stores thus cover 8 rows of `Kt` (dims) and 4 columns (keys). If a row were exactly `block_k` words
# long (16 or 32), the 8 rows would start on one or two banks and pile up. The kernel adds 4 words to each
# row: a row is then 4 times an odd number of words long (20 or 36), so the 8 rows start on 8 different
# multiples of 4 banks, and each row's 4 keys fill the 4 banks from its start: 32 different banks. V is
# stored as it is (row c holds key c), and a warp writes 4 keys x 8 dims, so V's rows get 8 extra words: 8
# times an odd number, so the 4 keys start on 4 different multiples of 8 banks and their 8 dims fill the
# rest. The kernel's actual stores, for the tile it uses at d = 64:

# %%
tile = choose_tile(64)
print(f"d = 64: block_q = {tile.block_q}, block_k = {tile.block_k}, {tile.threads} threads")
maviz.plot_access_grid({
    f"K^T store, rows of {tile.block_k} words (no padding)": ma.register_kernel_stores(64, tile, pad={"Kt": 0})["Kt"],
    f"K^T store, rows of {tile.block_k} + 1": ma.register_kernel_stores(64, tile, pad={"Kt": 1})["Kt"],
    f"K^T store, rows of {tile.block_k} + 4 (the kernel)": ma.register_kernel_stores(64, tile)["Kt"],
    "V store, rows of 64 words (no padding)": ma.register_kernel_stores(64, tile, pad={"V": 0})["V"],
    "V store, rows of 64 + 4": ma.register_kernel_stores(64, tile, pad={"V": 4})["V"],
    "V store, rows of 64 + 8 (the kernel)": ma.register_kernel_stores(64, tile)["V"],
}, "banks");

# %% [markdown]
# Why 4 and not the classic one word? Two reasons. With one extra word, row x starts x banks further on,
# and its 4 adjacent keys still land on banks the next rows use: 2 passes for this tile. And the
# inner loop reads each row with 16-byte vector loads, whose address must be a multiple of 16 (PTX ISA,
# "Addresses as Operands": an address "must be naturally aligned to a multiple of the access size"); with
# rows of `block_k + 1` words, most rows would start off that grid. Padding by a multiple of 4 words keeps
# every row 16-byte aligned. Passes of each tile copy, for every tile the kernel prefers and several
# paddings (Qt, Q transposed, has the same shape of store as Kt):

# %%
for d_ in (32, 64, 128):
    for t_ in PREFERRED[d_]:
        line = []
        for pad in (0, 1, 4, 8):
            st = ma.register_kernel_stores(d_, t_, pad={"Qt": pad, "Kt": pad, "V": pad})
            line.append(f"pad {pad}: " + " ".join(f"{k} {ma.bank_conflict_degree(w)}" for k, w in st.items()))
        print(f"d = {d_:3d}, block_q = {t_.block_q:3d}, block_k = {t_.block_k}: " + " | ".join(line))
print("the kernel pads Qt and Kt by", ma.REGISTER_PAD["Kt"], "words and V by", ma.REGISTER_PAD["V"])

# %% [markdown]
# With the kernel's padding every tile copy takes one pass. The inner loops' 16-byte loads are another
# matter: the padding does not change them, since only the start of each row moves. For the tile above, at
# one step of each product loop, no load asks a bank for two different words:

# %%
for name, instructions in ma.register_kernel_loads(64, tile, step=3).items():
    print(f"{name}: {len(instructions)} load(s) per step, "
          + ", ".join(f"{np.unique(w).size} different words at most {ma.bank_conflict_degree(w.ravel())} per bank"
                      for w in instructions))

# %% [markdown]
# The CUDA guides state the bank rule for 4-byte accesses; for 8- and 16-byte ones what follows from 32
# banks of 4 bytes is a floor: one pass delivers at most 128 bytes, so a warp loading 512 different bytes
# needs at least 4 passes, however they are laid out.
#
# Where the real FlashAttention-2 differs: its CUDA kernels avoid bank conflicts by *swizzling* instead of
# padding (`csrc/flash_attn/src/kernel_traits.h` builds its shared-memory layouts with CuTe's `Swizzle`,
# which XORs the index of each 16-byte chunk of a row with the row number, modulo 8): no unused words, and
# the permutation suits the loads that feed its tensor cores. Padding is the simple way; it costs a few
# unused words per row (4 per row of Kt, 8 per row of V).
#
# Try other layouts: how many threads share a row, a misaligned start, the row length, how the tile is
# stored in shared memory and its padding. Each view shows the HBM sectors of the warp's load and the
# banks of its store:

# %%
maviz.access_explorer();

# %% [markdown]
# ## Suspect 3: the work inside the SM
#
# Every multiply-add of the inner loops needs one float of K or V from shared memory, and each thread does
# all `2d` multiply-adds per key alone; the d of the dot product form a chain where each step waits for
# the previous one (and loads take tens of cycles to arrive). An SM hides such waits by
# switching to another warp that is ready, if it has one. How many warps can an SM hold? That is the
# **occupancy**, limited by whichever runs out first: threads, registers or shared memory per SM
# (CUDA C++ Best Practices Guide, "Occupancy").

# %%
infos = {f"shared, block_q={bq}": kernel_info(D_BENCH, variant="shared", block_q=bq, block_k=32)
         for bq in (32, 64, 128)}
infos["register (lesson 09)"] = kernel_info(D_BENCH, variant="register")
for name, info in infos.items():
    print(f"{name:22s} threads {info['threads_per_block']:4d}, shared {info['shared_bytes_per_block']:6d} B, "
          f"registers {info['registers_per_thread']}, spill {info['local_bytes_per_thread']} B")
if not ON_GPU:
    print("\n" + infos["register (lesson 09)"]["note"])
gviz.plot_occupancy_bars(infos);

# %% [markdown]
# On a GPU the registers column is filled in: each thread of the textbook kernel keeps its row of Q and
# of O, `2d = 128` floats at d = 64, plus addresses and counters, so it needs more than 128 of the 255
# registers a thread may have; the bars then say which resource caps the warps per SM on your GPU. In the
# simulator they count threads and shared memory only (with the limits of a T4).
#
# A profiler confirms the suspects and ranks them. Nsight Compute on an H100 (lesson 10 shows the
# profile; N = 4096, d = 64) finds the SM's schedulers idle half the time and most of the rest busy with
# work other than FMAs. Three things, then, make it slow, and none is HBM traffic:
#
# 1. **few warps and long waits**: each scheduler has about 2 warps to choose from, and often both are
#    waiting, for the next K/V tile or for the previous multiply-add of the dot product (those tiles can
#    mostly be served by the L2 cache rather than HBM: the K and V of all 16 heads, 32 MiB, fit in an
#    H100's 50 MB of L2, and every query block of a head reads the same ones);
# 2. **bookkeeping per key**: the whole row of O is rescaled after every key (one extra multiply per
#    element), plus index arithmetic and loop control: about 2.9 instructions issued per useful FMA;
# 3. **a shared-memory read for every FMA**: the compiler fetches 4 adjacent floats per 16-byte load, so
#    this costs 0.28 load instructions per FMA, less than the other two, but it grows with every FMA.
#
# Lesson 09 fixes all three at once: several threads share a row, each thread computes a small tile of S
# and of O from values it loaded into registers once (one load feeds several FMAs, and the independent
# FMAs of a tile overlap), and the softmax bookkeeping happens once per tile instead of once per key.
#
# **Exercises:** [08_first_flash_kernel](../exercises/08_first_flash_kernel.ipynb): write a variant of
# this kernel with two query rows per thread (each shared read feeds both) that skips the key tiles a
# causal block cannot see, and count the passes of a warp's shared-memory access.
