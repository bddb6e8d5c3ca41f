"""flash_attention: check the inputs, pick the tile shape, launch a forward kernel, return (o, lse)."""
from __future__ import annotations

import numpy as np

from .._inputs import check_block
from ..device import device_limits
from . import _fast
from . import plan as planner
from ._launch import check_dropout_variant, check_kernel_inputs, empty, like_input, to_device

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
                    tile=None, precision=None, splits=None, plan=None, window_size=(-1, -1), align="top_left",
                    alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
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
    plan made beforehand with flashlab.kernels.plan.plan (then no overrides). Torch tensors on a GPU take
    kernels/_fast.py's prepared path after the first call with their shapes.

    window_size, align, alibi_slopes, softcap, dropout_p, seed: the FlashAttention library's options, as in
    flashlab.reference_attention (lesson 16); the register and tensor variants compile them in (register.Extras;
    the dropout seed is a kernel argument, so a new seed needs no new compile), and key tiles outside a block's
    causal/window band are skipped. A row that sees no key gets o = 0, lse = +inf. lse is dropout-free, as in the
    library; both variants draw flashlab.dropout's mask, the NumPy one for the same seed.
    """
    options = (causal, scale, variant, block_q, block_k, tile, precision, splits, plan)
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p, seed=seed)
    plain = alibi_slopes is None and align == "top_left" and not softcap and not dropout_p \
        and tuple(window_size) == (-1, -1) if isinstance(window_size, (tuple, list)) else False
    check_dropout_variant(dropout_p, plan.variant if isinstance(plan, planner.Plan) else variant,
                          allowed=("register", "tensor"))
    if not plain:
        return _with_extras(q, k, v, options, library)
    if _fast.available():
        key = _fast.torch_key(q, k, v)
        if key is not None:
            key = ("forward", key, options)
            call = _fast.lookup(key)
            if call is None:
                plan_, scale_, _ = setup(q, k, v, *options)
                call = _fast.store(key, _fast.PreparedForward(plan_, scale_, q, k, v))
            return call(q, k, v)
    plan, scale, (q_d, k_d, v_d, kind, o, lse, o_words) = setup(q, k, v, *options)
    H, causal = plan.problem.H, plan.problem.causal
    alloc = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731 (partial results of split-KV)
    if plan.variant == "register":
        from .register import launch

        launch(q_d, k_d, v_d, o, lse, H, scale, causal, plan.config, splits=plan.splits,
               heavy_first=plan.heavy_first, section=plan.section, alloc=alloc)
    elif plan.variant == "tensor":
        from .tensor import launch

        launch(q_d, k_d, v_d, o_words, lse, H, scale, causal, plan.config, plan.precision, splits=plan.splits,
               heavy_first=plan.heavy_first, section=plan.section, alloc=alloc)
    else:
        from .shared import launch

        launch(q_d, k_d, v_d, o, lse, H, scale, causal, *plan.config)
    return like_input(o, kind), like_input(lse, kind)


def _with_extras(q, k, v, options, library):
    """flash_attention with window / align / ALiBi / softcap / dropout: the register or tensor kernel with those
    compiled in."""
    from .._inputs import check_options, check_seed
    from .register import Extras
    from .tensor import library_weight

    key = _fast.prepared_key("forward", (q, k, v), options, options=library)
    call = _fast.lookup(key) if key is not None else None
    if call is not None:
        return call(q, k, v, check_seed(library["seed"]))
    plan, scale, (q_d, k_d, v_d, kind, o, lse, o_words) = setup(q, k, v, *options, extras=library_weight(library))
    B, H, Nq, d = plan.problem.B, plan.problem.H, plan.problem.Nq, plan.problem.d
    opt = check_options((B, H, Nq, d), causal=plan.problem.causal, scale=scale, **library)
    extras = Extras.from_options(opt, B, H)
    if plan.variant not in ("register", "tensor"):
        raise NotImplementedError(f"window_size, align, alibi_slopes, softcap and dropout_p run on variant="
                                  f"'register' or 'tensor' so far; got variant={plan.variant!r}")
    if key is not None:  # checked: prepare this key's launch once, as plain calls do
        return _fast.store(key, _fast.PreparedForward(plan, scale, q, k, v, extras))(q, k, v, opt.seed)
    alloc = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    common = dict(splits=plan.splits, heavy_first=plan.heavy_first, section=plan.section, alloc=alloc, extras=extras,
                  seed=opt.seed)
    if plan.variant == "tensor":
        from .tensor import launch

        launch(q_d, k_d, v_d, o_words, lse, H, scale, plan.problem.causal, plan.config, plan.precision, **common)
    else:
        from .register import launch

        launch(q_d, k_d, v_d, o, lse, H, scale, plan.problem.causal, plan.config, **common)
    return like_input(o, kind), like_input(lse, kind)


def setup(q, k, v, causal, scale, variant, block_q, block_k, tile, precision, splits, plan, *, extras=False):
    """Check the arguments and inputs and make the plan: (plan, scale, (q, k, v as device arrays, kind,
    o, lse, o's 32-bit words (tensor kernel) or None)). extras: the library's options' weight (plan's)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    if plan is not None:
        if not isinstance(plan, planner.Plan) or plan.direction != "forward":
            raise TypeError(f"plan must be a forward flashlab.kernels.plan.Plan; got {plan!r:.80}")
        if any(x is not None for x in (block_q, block_k, tile, precision, splits)):
            raise ValueError("plan= already fixes the tile, precision and splits; pass either plan= or the overrides")
        variant = plan.variant
    if variant == "tensor":
        from ._launch import all_to_device_words, empty_words
        from .tensor import resolve_precision

        if tile is not None:
            raise ValueError("tile= configures the register kernel; for variant='tensor' use block_q / block_k")
        (q_d, k_d, v_d), kind, dtype = all_to_device_words((("q", q), ("k", k), ("v", v)))
        if plan is None:
            precision = resolve_precision(dtype, precision, device_limits()["cc"])
        B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale,
                                                             words=dtype != "float32", gqa=True)
    else:
        if precision is not None:
            raise ValueError(f"precision applies to variant='tensor' only; got precision={precision!r} with "
                             f"variant={variant!r}")
        (q_d, kind), (k_d, _), (v_d, _) = to_device(q, "q"), to_device(k, "k"), to_device(v, "v")
        B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale, gqa=True)
        dtype = np.dtype(q_d.dtype).name
    if plan is None:
        plan = planner.plan((B, H, Nq, Nk, d), causal=causal, dtype=dtype,
                            variant="register" if tile is not None else variant, block_q=block_q, block_k=block_k,
                            tile=tile, precision=precision, splits=splits, extras=extras)
    else:
        plan.check_inputs(B, H, Nq, Nk, d, causal, dtype)
    if variant == "tensor":
        o, o_words = empty_words((B, H, Nq, d), dtype, kind, like=q)
        lse = empty_words((B, H, Nq), "float32", kind, like=q)[0]
    else:
        o, o_words = empty((B, H, Nq, d), q_d.dtype, kind, like=q), None
        lse = empty((B, H, Nq), np.float32, kind, like=q)
    return plan, scale, (q_d, k_d, v_d, kind, o, lse, o_words)
