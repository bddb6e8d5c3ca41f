# %% [markdown]
# # 00 · Setup: what runs where, and how you are graded
#
# **After this lesson you can**
# - say where each part of the course runs: NumPy on the CPU, kernels on a CUDA GPU, or the same kernels
#   in Numba's CUDA simulator;
# - read the report of `flashlab.doctor()` (the setup cell at the top ran it);
# - grade an exercise inside a notebook with `flashlab.check`, and a whole folder from a shell;
# - switch the fast mode on and off.

# %% [markdown]
# ## What runs where
#
# | part of the course | lessons | runs on | needs |
# | --- | --- | --- | --- |
# | NumPy algorithms (`flashlab.reference`, `flashlab.softmax`, `flashlab.tiled`) and the traffic model (`flashlab.iomodel`) | 01–06 | the CPU | nothing beyond NumPy |
# | Numba-CUDA kernels (`flashlab.kernels`) | 07 onwards | a CUDA GPU | an NVIDIA GPU and driver (Colab: *Runtime → Change runtime type → GPU*) |
# | the same kernels, simulated | 07 onwards | the CPU, one Python thread per GPU thread | nothing: chosen automatically without a GPU |
#
# In Colab: a CPU runtime runs everything, the kernels in the simulator (Colab's CPU runtime has no
# numba-cuda, so `numba.cuda` is numba's own older copy; flashlab fills in what the kernels need from it).
# A T4 runtime runs the kernels on the T4, a GPU of compute capability 7.5: float16 on its tensor cores,
# bfloat16 not at all (it has no bf16 tensor cores), float32 on its FP32 units. The report above says which
# applies (`tensor cores`), and whether calls take the fast launch path (`fast launch`).
#
# The simulator runs your kernel *exactly as written*, thread by thread, so it is good for finding
# bugs (you can even `print` inside a kernel) and hopeless for timing: each simulated thread costs from a
# tenth of a millisecond to a millisecond, depending on the kernel (lesson 07 measures it), so a launch a
# GPU finishes in microseconds can take minutes. Lessons 00–06 do not need a GPU at all.
#
# `flashlab.doctor()` in the setup cell at the top reported which backend was picked. The same facts are available
# from code:

# %%
import flashlab
from flashlab import device

print("backend:", device.backend())
print("GPU present:", device.has_gpu())

# %% [markdown]
# If the report ends with a line starting `FIX:`, do what it says before going on: it names the fix for
# the breakages seen in practice (for example restarting the kernel after something imported
# `numba.cuda` too early).

# %% [markdown]
# ## How grading works
#
# Each lesson has an exercise notebook in `exercises/`. You fill in functions, then call
#
# ```python
# flashlab.check("exercise_name", your_function)
# ```
#
# which runs your function on fresh random inputs, including cases you cannot see in the notebook
# (odd shapes, ragged tails, huge values, float16), and compares it with flashlab's reference. Here is
# the check for the first softmax exercise of lesson 03, given flashlab's own solution:

# %%
flashlab.check("safe_softmax", flashlab.safe_softmax)

# %% [markdown]
# It passes, of course: the package holds a working version of everything the course builds, so that later
# lessons can use the earlier ones. Submitting `flashlab.safe_softmax` (or any other flashlab function) to
# an exercise would pass too, and teach you nothing. The exercises are there for you to write your own;
# the package's versions are the answers, to read after you have tried.
#
# Here is the same check given the textbook formula `exp(x) / sum(exp(x))`, which lesson 03 shows
# breaking. A failed check says what went wrong, on which inputs, gives a hint that points at the idea, and
# prints the seed that reproduces the inputs:

# %%
flashlab.check("safe_softmax", flashlab.naive_softmax)

# %% [markdown]
# From a shell, one command grades every exercise notebook in a folder without opening Jupyter, prints
# one row per exercise (passed, failed or not implemented) and exits non-zero if anything failed:
#
# ```bash
# python -m flashlab grade exercises/            # or one notebook: exercises/03_softmax.ipynb
# python -m flashlab grade exercises/ --json results.json
# ```
#
# An untouched exercise reports *not implemented*, not a crash, so you can grade early and often.
#
# **In Colab** there is no `exercises/` folder: you open one exercise notebook at a time, and its
# `flashlab.check` cells grade it as you go. To grade a whole notebook from a cell, save it
# (*File → Download → .ipynb*), upload it in the Files pane and run `!python -m flashlab grade NAME.ipynb`.

# %% [markdown]
# ## Fast mode
#
# Setting the environment variable `FLASHLAB_FAST=1` shrinks every size the notebooks use, so the whole
# course runs on a small CPU in a few minutes (the test suite runs it this way). Every size in a lesson is
# written as `flashlab.size(full, fast)`:

# %%
print("fast mode:", flashlab.fast_mode())
N = flashlab.size(4096, 256)  # sequence length used below in a lesson
print("N =", N)

# %% [markdown]
# To turn it on for your own run, set it before starting Jupyter (`FLASHLAB_FAST=1 jupyter lab`), or in
# the first cell with `import os; os.environ["FLASHLAB_FAST"] = "1"` before anything else. In the fast
# mode the interactive explorers (the plots with sliders) show a static grid of small plots instead.
#
# ## Names
#
# flashlab uses the names of the FlashAttention papers (FlashAttention, arXiv 2205.14135;
# FlashAttention-2, arXiv 2307.08691): queries, keys and values `Q, K, V` of shape `(..., N, d)`,
# scores `S = QKᵀ/√d`, probabilities `P = softmax(S)`, output `O = PV`, row maxima `m`, row sums `l`,
# the log-sum-exp `lse = m + log l`, block sizes `block_q` (the papers' Br) and `block_k` (Bc), and the
# on-chip memory size `M`. Semantics match PyTorch's `scaled_dot_product_attention`.
#
# **Next:** lesson 01, the memory hierarchy. There is no exercise for this lesson; the first is
# [01_memory_hierarchy](../exercises/01_memory_hierarchy.ipynb).
