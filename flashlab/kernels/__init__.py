"""Numba-CUDA FlashAttention kernels (run on a GPU, or in Numba's CUDA simulator without one).

    o, lse = flash_attention(q, k, v, causal=False, variant="register")
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do)
    dq, dk, dv = flash_attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k)  # packed batch
    o = flash_decoding(q, k, v)                # split-KV attention for a few queries (lesson 14)
    o, lse = paged_decoding(q, k_cache, v_cache, block_table, cache_seqlens)   # the same over a paged KV cache
    o, lse = flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)       # a packed batch, one launch
    kernel_info(q.shape, variant="register")   # registers, spills, shared memory, occupancy, PTX/SASS
    print(plan.plan((B, H, N, d), causal=True).explain())   # how a call is launched (kernels/plan.py)

Inputs are (B, H, N, d) NumPy arrays, numba device arrays or torch CUDA tensors (no copies); outputs come
back in the same kind. Variants: "shared" (lesson 08: one thread per query row, K/V tiles in shared
memory), "register" (lesson 09: FA2 with register tiling), "tensor" (lessons 15-17: mma.sync tensor cores,
forward in tensor.py, backward in tensor_backward.py) and "wgmma" (lesson 20: FlashAttention-3 on Hopper, forward
in wgmma.py, backward in wgmma_backward.py; docs/design-wgmma-kernels.md).

The modules, in layers; each imports only from its own layer or those below (tests/test_kernel_layers.py):
- entry points: forward.py, backward.py, varlen.py, varlen_backward.py, paged.py, info.py, demo.py (checks, the
  plan, and a prepared call per entry point for torch tensors; demo.py: lessons 07 and 09's small kernels);
- prepared.py: the generic prepared launch (argument lists built once, pointers filled in per call);
- planning: devices.py (what a GPU has, occupancy) and plan.py (tile, split-KV, block order, explain(), and the
  library's kernel choice: forward_variant, wgmma_backward_fits);
- kernels that build and launch: shared.py, register.py, register_backward.py, tensor.py, tensor_backward.py,
  wgmma.py, wgmma_backward.py (FlashAttention-3's forward and backward on wgmma, both run on an H200:
  docs/runs/wgmma-forward.md, docs/runs/wgmma-backward.md), decoding.py;
- device functions shared by the kernels: options.py (the library's options), split_kv.py (key chunks, the
  grid, the merge kernel);
- at the bottom: common.py (constants), mma.py (PTX intrinsics, emulated in the simulator), hopper.py (Hopper's
  wgmma, TMA, mbarrier, bulk reduces, named barriers and setmaxnreg as intrinsics, emulated in the simulator),
  _launch.py (host arrays, input checks, launch descriptions).

How a kernel module reads (register.py, tensor.py, register_backward.py, tensor_backward.py): a frozen Traits holds
a build's tile constants; the build binds each step once (a device function inlined into the kernel, with its
fastmath flags), picking a precision's or an option's variant there, so the kernel body is a short list of step
calls with no branch on a build flag (tests/test_forward_steps.py). shared.py's textbook kernel is written out;
decoding.py's split kernel too, with where a key lives and which query a row is bound as steps. Each module
describes a call's launches once: `launches(...)` returns a _launch.Launches (kernels, grids, arguments by name,
temporaries, host arrays, the launch that takes the seed), run by Launches.run on the general path and prepared by
prepared.PreparedLaunches.of for torch tensors.

The library's options live in options.py: their presence is compiled in (Features, part of a build's key), their
values are kernel arguments (OptionArgs: window bounds, softcap, ALiBi slopes), so a new window or slope set
compiles nothing; the dropout probability is compiled in, its seed an argument.
"""
from ._launch import SUPPORTED_D
from .backward import flash_attention_backward
from .decoding import flash_decoding
from .forward import VARIANTS, flash_attention
from .info import kernel_info
from .paged import paged_decoding
from .varlen import flash_attention_varlen
from .varlen_backward import flash_attention_varlen_backward

__all__ = ["flash_attention", "flash_attention_backward", "flash_decoding", "paged_decoding", "flash_attention_varlen",
           "flash_attention_varlen_backward", "kernel_info", "VARIANTS", "SUPPORTED_D"]
