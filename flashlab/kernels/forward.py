"""flash_attention: check the inputs, pick the tile shape, launch a forward kernel, return (o, lse)."""
from __future__ import annotations

import numpy as np

from .._inputs import check_block
from ..device import device_limits
from . import plan as planner
from ._launch import check_kernel_inputs, empty, like_input, to_device

VARIANTS = ("shared", "register", "tensor")


def resolve_config(variant: str, d: int, block_q=None, block_k=None, precision=None):
    """The launch configuration a call would use: a register.Tile, a tensor.TensorTile, or (block_q, block_k)
    for "shared"."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    block_q, block_k = check_block(block_q, "block_q"), check_block(block_k, "block_k")
    if variant == "tensor":
        from .tensor import choose_tile as choose_tensor_tile

        return choose_tensor_tile(d, precision or "f16", block_q, block_k)
    limits = device_limits()
    limit = limits["shared_per_block"]
    if variant == "register":
        from .register import choose_tile

        return choose_tile(d, block_q, block_k, limit, limits["shared_per_sm"])
    from .shared import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, check_blocks

    bq, bk = block_q or DEFAULT_BLOCK_Q, block_k or DEFAULT_BLOCK_K
    check_blocks(d, bq, bk, limit)
    return bq, bk


def flash_attention(q, k, v, *, causal=False, scale=None, variant="register", block_q=None, block_k=None,
                    tile=None, precision=None, splits=None, plan=None):
    """FlashAttention forward on the GPU (or the CUDA simulator). Returns (o, lse).

    q: (B, H, Nq, d), k and v: (B, H, Nk, d), float32 or float16, d in (16, 32, 64, 128); NumPy arrays,
    numba device arrays or torch CUDA tensors (no copies). o has q's dtype, lse is float32 (B, H, Nq);
    both come back as the kind of array q was. causal: query i sees keys j <= i (top-left aligned).
    scale defaults to 1/sqrt(d). variant: "register" (FP32 units), "shared" (textbook) or "tensor" (tensor
    cores: float16, bfloat16 (torch tensors) and float32, see kernels/tensor.py; `precision` picks "3xtf32"
    (default, fp32 accuracy) or "tf32" for float32 inputs, and "k8" builds float16 from the sm_75 mma shape).

    How the kernel is launched (tile, split-KV, block order) is decided by kernels/plan.py for this GPU;
    block_q / block_k override the tile shape, `tile` (a register.Tile) sets the register kernel's thread
    layout as well (used by the tile sweep), splits=n forces n key chunks (1: no split), and plan= launches a
    plan made beforehand with flashlab.kernels.plan.plan (then no overrides).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    if plan is not None:
        if any(x is not None for x in (block_q, block_k, tile, precision, splits)):
            raise ValueError("plan= already fixes the tile, precision and splits; pass either plan= or the overrides")
        variant = plan.variant
    if variant == "tensor":
        from .tensor import forward

        if tile is not None:
            raise ValueError("tile= configures the register kernel; for variant='tensor' use block_q / block_k")
        return forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k, precision=precision,
                       splits=splits, plan=plan)
    if precision is not None:
        raise ValueError(f"precision applies to variant='tensor' only; got precision={precision!r} with "
                         f"variant={variant!r}")
    (q_d, kind), (k_d, _), (v_d, _) = to_device(q, "q"), to_device(k, "k"), to_device(v, "v")
    B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale)
    dtype = np.dtype(q_d.dtype).name
    if plan is None:
        plan = planner.plan((B, H, Nq, Nk, d), causal=causal, dtype=dtype,
                            variant="register" if tile is not None else variant, block_q=block_q, block_k=block_k,
                            tile=tile, splits=splits)
    else:
        plan.check_inputs(B, H, Nq, Nk, d, causal, dtype)

    o = empty((B, H, Nq, d), q_d.dtype, kind, like=q)
    lse = empty((B, H, Nq), np.float32, kind, like=q)
    if plan.variant == "register":
        from .register import launch

        launch(q_d, k_d, v_d, o, lse, H, scale, causal, plan.config, splits=plan.splits,
               heavy_first=plan.heavy_first, alloc=lambda shape, dt: empty(shape, dt, kind, like=q))
    else:
        from .shared import launch

        launch(q_d, k_d, v_d, o, lse, H, scale, causal, *plan.config)
    return like_input(o, kind), like_input(lse, kind)
