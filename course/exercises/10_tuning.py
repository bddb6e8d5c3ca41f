# %% [markdown]
# # Exercises 10: budgets and benchmarks
#
# Goes with lesson [10 tuning and benchmarking](../notebooks/10_tuning.ipynb). Three tools a kernel tuner
# needs: a quick test of whether a tile shape fits the GPU's budgets at all, a timing function that
# measures the kernel rather than the compiler or a hiccup of the machine, and the arithmetic that turns
# a profile of issue slots into the speed it predicts.

# %%
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
# 3. its shared memory fits (`<=`) in `shared_limit` bytes (48 KB: all numba-cuda can ask for), where it
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
