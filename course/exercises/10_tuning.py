# %% [markdown]
# # Exercises 10: budgets and benchmarks
#
# Goes with lesson [10 tuning and benchmarking](../notebooks/10_tuning.ipynb). Four tools a kernel tuner
# needs: a quick test of whether a tile shape fits the GPU's budgets at all, a timing function that
# measures the kernel rather than the compiler or a hiccup of the machine, the arithmetic that turns
# a profile of issue slots into the speed it predicts, and the count of waves that says when a grid is too
# small for the GPU.

# %%
import math
import statistics

import numpy as np

import flashlab

# %% [markdown]
# ## 1. Does a tile fit?
#
# A configuration of flashlab's register kernel is `(block_q, block_k, tr, tc)` for head dimension `d`:
# `tr x tc` threads, each owning `RM = block_q / tr` rows, `RN = block_k / tc` keys of S and
# `RD = d / tc` dims of O. It can be launched only if
#
# 1. the threads divide the tile evenly: `tr` divides `block_q`, `tc` divides `block_k` and `d`;
# 2. `tr * tc <= 1024` threads per block;
# 3. its shared memory fits (`<=`) in `shared_limit` bytes (48 KB: static shared memory, which this kernel uses), where it
#    needs, in float32 (4 bytes) units,
#    `d*(block_q+4) + max(d*(block_k+4), block_k*(block_q+4)) + block_k*(d+8) + tc*(block_q+4)`
#    (Q tile, K tile that is later reused for P, V tile, the row-reduction buffer; the +4 and +8 pad rows
#    so that threads reading a column hit different memory banks);
# 4. its registers fit: a thread keeps about
#    `RM*RD + RM*RN + 3*RM + RN + RD + 24` registers (O and S micro-tiles, m, l and a row operand, the
#    operand vectors, and ~24 for addresses and counters), and a thread may have at most `max_regs`
#    (255 on every GPU since compute capability 3.5). Past that, the compiler spills to local memory.

# %%
def tile_fits(d, block_q, block_k, tr, tc, shared_limit=48 * 1024, max_regs=255):
    """True when the tile can run without spilling, under the rules above."""
    ### BEGIN SOLUTION
    if block_q % tr or block_k % tc or d % tc:
        return False
    if tr * tc > 1024:
        return False
    floats = d * (block_q + 4) + max(d * (block_k + 4), block_k * (block_q + 4)) + block_k * (d + 8) + tc * (block_q + 4)
    if 4 * floats > shared_limit:
        return False
    rm, rn, rd = block_q // tr, block_k // tc, d // tc
    return rm * rd + rm * rn + 3 * rm + rn + rd + 24 <= max_regs
    ### END SOLUTION


# %%
print(tile_fits(64, 64, 32, 16, 8), tile_fits(128, 64, 64, 16, 8))  # True False

# %%
flashlab.check("tile_fits", tile_fits)

# %% [markdown]
# ## 2. Timing a kernel honestly
#
# `median_time(fn, clock, warmup, reps)`: call `fn()` `warmup` times without timing (the first call of a
# Numba kernel compiles it, which takes seconds), then `reps` times, reading `clock()` just before and just
# after each call; return the **median** of the `reps` durations. On a GPU `clock` would be a CUDA event
# pair and `fn` would synchronise (lesson 10); here the checker hands you a fake GPU whose first call is
# slow and some of whose samples are spikes, so the mean, the total, or timing the warm-up all give
# the wrong number.

# %%
def median_time(fn, clock, warmup=3, reps=20):
    """Median seconds of `reps` timed calls of fn() after `warmup` untimed ones."""
    ### BEGIN SOLUTION
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)
    ### END SOLUTION


# %%
import time  # noqa: E402

print(f"{median_time(lambda: np.linalg.inv(np.eye(64)), time.perf_counter) * 1e6:.1f} µs for a 64 x 64 inverse")

# %%
flashlab.check("median_time", median_time)

# %% [markdown]
# ## 3. From an issue profile to TFLOP/s
#
# Lesson 10's "Inside the SM" section: each SM has 4 schedulers, each issues at most one warp instruction
# per cycle, and an FFMA instruction does a multiply-add (2 FLOPs) on each of a warp's 32 threads. A
# profiler reports, for one launch, `ffma` FFMA instructions out of `issued` warp instructions, and that
# the schedulers issued on `issue_busy_pct` percent of the cycles. Write `predicted_tflops`: the TFLOP/s
# of a kernel whose useful work is its FFMAs, on a GPU with `sms` SMs running at `clock_ghz` GHz.
# (With the H100's 132 SMs at 1.98 GHz, 100% busy and only FFMAs, you get its FP32 peak, about 67.)

# %%
def predicted_tflops(ffma, issued, issue_busy_pct, sms, clock_ghz):
    """Predicted TFLOP/s = FP32 peak x (fraction of cycles issuing) x (FFMA share of the issued)."""
    ### BEGIN SOLUTION
    peak = sms * 4 * 32 * 2 * clock_ghz * 1e9  # FLOP/s: schedulers x lanes x FLOPs per FFMA x cycles/s
    return peak * (issue_busy_pct / 100) * (ffma / issued) / 1e12
    ### END SOLUTION


# %%
from flashlab.viz import gpu as gviz  # noqa: E402

profile = gviz.load_issue_profile().get("register")
if profile:  # the register kernel, profiled on an H100 (flashlab/data/issue_profile.csv)
    guess = predicted_tflops(profile["kind:FFMA"], profile["inst"], profile["issue_active_pct"], 132, 1.98)
    print(f"predicted {guess:.1f} TFLOP/s; measured {profile['tflops']:.1f} under the profiler")

# %%
flashlab.check("predicted_tflops", predicted_tflops)

# %% [markdown]
# ## 4. Waves, occupancy, and when to split
#
# `waves_and_split(B, H, N, block_q, threads, registers, shared_bytes, gpu)` describes one launch of a
# forward kernel: ceil(N / block_q) query blocks per head, B x H heads, blocks of `threads` threads that use
# `registers` registers per thread and `shared_bytes` of shared memory, on the GPU `gpu`, a dict with
# `sms`, `max_threads_per_sm`, `max_blocks_per_sm`, `regs_per_sm`, `shared_per_sm` and
# `reserved_shared_per_block`. Return a dict with
#
# - `blocks_per_sm` (int): the blocks one SM holds at once. Each resource allows some number and the
#   smallest wins: the SM's warps (32 threads each, `max_threads_per_sm / 32` of them), its block limit, its
#   registers and its shared memory. Registers go to a warp in units of 256, so a warp takes
#   `registers x 32` rounded *up* to a multiple of 256; the number of warps the registers hold is then
#   rounded *down* to a multiple of 4. Every block takes its `shared_bytes` plus the reserved bytes.
# - `occupancy`: the resident warps as a fraction of the SM's maximum;
# - `waves`: the grid's blocks over the GPU's slots (SMs x blocks per SM), as a fraction;
# - `efficiency`: the busy share of the slots' time if every block takes the same time;
# - `splits` (int): how many chunks to cut the keys into. 1 when the grid fills 2 waves or more. Otherwise
#   try s = 2, 3, ... up to 32, as long as a chunk keeps at least 256 keys (N // s >= 256): with s chunks the
#   grid has s times as many blocks. Take the fewest s whose efficiency reaches 0.9 or, if none does, the s
#   with the best efficiency (the fewest on ties); keep it only if its efficiency beats no split by at least
#   0.05 (a split costs a merge), else 1.
#
# (These are the rules of flashlab's planner, `flashlab/kernels/plan.py`, for grids of equal blocks; the
# planner also weighs causal blocks by their work and rounds chunks to whole key tiles.)

# %%
def waves_and_split(B, H, N, block_q, threads, registers, shared_bytes, gpu):
    """blocks_per_sm, occupancy, waves, efficiency and splits of one launch (the rules above)."""
    ### BEGIN SOLUTION
    warps = -(-threads // 32)
    max_warps = gpu["max_threads_per_sm"] // 32
    reg_warps = gpu["regs_per_sm"] // (-(-registers * 32 // 256) * 256) // 4 * 4
    blocks_per_sm = min(max_warps // warps, gpu["max_blocks_per_sm"], reg_warps // warps,
                        gpu["shared_per_sm"] // (shared_bytes + gpu["reserved_shared_per_block"]))
    slots = gpu["sms"] * blocks_per_sm
    blocks = -(-N // block_q) * B * H

    def efficiency(s):
        w = s * blocks / slots
        return w / math.ceil(w)

    splits = 1
    if blocks / slots < 2:
        options = [s for s in range(2, 33) if N // s >= 256]
        good = [s for s in options if efficiency(s) >= 0.9]
        best = min(good) if good else max(options, key=lambda s: (efficiency(s), -s), default=1)
        if best > 1 and efficiency(best) >= efficiency(1) + 0.05:
            splits = best
    return {"blocks_per_sm": blocks_per_sm, "occupancy": blocks_per_sm * warps / max_warps,
            "waves": blocks / slots, "efficiency": efficiency(1), "splits": splits}
    ### END SOLUTION


# %%
# the register kernel's launch on an H100 as lesson 10 plans it, and your numbers for it
from flashlab.kernels.plan import H100, plan  # noqa: E402

p = plan((1, 16, 1024, 1024, 64), device=H100)  # the register kernel's plan on an H100 (lesson 10)
gpu = {**H100.limits, "sms": H100.sms}
mine = waves_and_split(1, 16, 1024, p.block_q, p.threads, p.registers, p.shared_bytes, gpu)
print(mine)
print(f"the planner: {p.blocks_per_sm} blocks per SM, {p.unsplit[0]:.3f} waves, {p.splits} chunks")

# %%
flashlab.check("waves_and_split", waves_and_split)
