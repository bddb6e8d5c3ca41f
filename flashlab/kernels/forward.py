"""flash_attention: check the inputs, pick the tile shape, launch a forward kernel, return (o, lse)."""
from __future__ import annotations

import numpy as np

from .._inputs import check_options, check_seed
from ..device import device_limits
from . import plan as planner
from . import hopper, prepared, register, shared, tensor, wgmma
from ._launch import (Launches, all_to_device_words, check_dropout_variant, check_kernel_inputs, empty, empty_words,
                      like_input, to_device)
from .common import LOG2E
from .options import Extras

VARIANTS = planner.VARIANTS["forward"] + ("wgmma",)


def flash_attention(q, k, v, *, causal=False, scale=None, variant="register", block_q=None, block_k=None,
                    tile=None, precision=None, splits=None, plan=None, window_size=(-1, -1), align="top_left",
                    alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
    """FlashAttention forward on the GPU (or the CUDA simulator). Returns (o, lse).

    q: (B, H, Nq, d), k and v: (B, H, Nk, d), float32 or float16, d in (16, 32, 64, 128); NumPy arrays,
    numba device arrays or torch CUDA tensors (no copies). o has q's dtype, lse is float32 (B, H, Nq);
    both come back as the kind of array q was. causal: query i sees keys j <= i (top-left aligned).
    scale defaults to 1/sqrt(d). variant: "register" (FP32 units), "shared" (textbook) or "tensor" (tensor
    cores: float16, bfloat16 (torch tensors) and float32, see kernels/tensor.py; `precision` picks "3xtf32"
    (default, fp32 accuracy) or "tf32" for float32 inputs, and "k8" builds float16 from the sm_75 mma shape)
    or "wgmma" (FlashAttention-3 on Hopper: 16-bit inputs, d 64 or 128, contiguous, causal or not, GQA; block_k
    alone overrides its tile; see kernels/wgmma.py).

    How the kernel is launched (tile, split-KV, block order) is decided by kernels/plan.py for this GPU;
    block_q / block_k override the tile shape, `tile` (a register.Tile) sets the register kernel's thread
    layout as well (used by the tile sweep), splits=n forces n key chunks (1: no split), and plan= launches a
    plan made beforehand with flashlab.kernels.plan.plan (then no overrides). Torch tensors on a GPU take
    the prepared path (kernels/prepared.py) after the first call with their shapes.

    window_size, align, alibi_slopes, softcap, dropout_p, seed: the FlashAttention library's options, as in
    flashlab.reference_attention (lesson 18); the register and tensor variants compile them in (options.Extras;
    the dropout seed is a kernel argument, so a new seed needs no new compile), and key tiles outside a block's
    causal/window band are skipped. A row that sees no key gets o = 0, lse = +inf. lse is dropout-free, as in the
    library; both variants draw flashlab.dropout's mask, the NumPy one for the same seed.
    """
    options = (causal, scale, variant, block_q, block_k, tile, precision, splits, plan)
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p, seed=seed)
    plain = alibi_slopes is None and align == "top_left" and not softcap and not dropout_p \
        and tuple(window_size) == (-1, -1) if isinstance(window_size, (tuple, list)) else False
    if variant == "wgmma":
        if not plain:
            raise NotImplementedError("window_size, align, alibi_slopes, softcap and dropout_p run on variant="
                                      "'register' or 'tensor'; variant='wgmma' has causal masking only so far")
        return _wgmma_forward(q, k, v, *options)
    check_dropout_variant(dropout_p, plan.variant if isinstance(plan, planner.Plan) else variant,
                          allowed=("register", "tensor"))
    if not plain:
        return _with_extras(q, k, v, options, library)
    if prepared.available():
        key = _plain_key(q, k, v, options)
        if key is not None:
            call = prepared.lookup(key)
            if call is None:
                plan_, scale_, _ = setup(q, k, v, *options)
                call = prepared.store(key, PreparedForward(plan_, scale_, q, k, v))
            return call(q, k, v)
    plan, scale, (q_d, k_d, v_d, kind, o, lse, o_words) = setup(q, k, v, *options)
    arrays = {"q": q_d, "k": k_d, "v": v_d, "o": o if o_words is None else o_words, "lse": lse}
    describe(plan, scale, q_d.shape, k_d.shape).run(arrays, lambda shape, dt: empty(shape, dt, kind, like=q))
    return like_input(o, kind), like_input(lse, kind)


def _plain_key(q, k, v, options):
    """The key of a prepared call without the library's options (options: flash_attention's other arguments)."""
    key = prepared.torch_key(q, k, v)
    return None if key is None else ("forward", key, options)


def _wgmma_key(q, k, v, causal, scale, block_k):
    key = prepared.torch_key(q, k, v) if prepared.available() else None
    return None if key is None else ("wgmma", key, causal, scale, block_k)


def prepared_call(q, k, v, causal: bool, scale, variant: str):
    """The prepared call, (o, lse) = call(q, k, v), that flash_attention(q, k, v, causal=causal, scale=scale,
    variant=variant) made for torch tensors of this key (shapes, strides, dtypes, device), or None: not made yet,
    or a call that goes the general way. flashlab.torch keeps it, so that its next call skips the checks and the
    key's assembly here."""
    if not prepared.available():
        return None
    if variant == "wgmma":
        key = _wgmma_key(q, k, v, causal, scale, None)
    else:
        key = _plain_key(q, k, v, (causal, scale, variant, None, None, None, None, None, None))
    return None if key is None else prepared.lookup(key)


def _wgmma_forward(q, k, v, causal, scale, variant, block_q, block_k, tile, precision, splits, plan):
    """variant="wgmma" (kernels/wgmma.py): FlashAttention-3's forward, 16-bit inputs on Hopper."""
    for name, value in (("block_q", block_q), ("tile", tile), ("precision", precision), ("splits", splits),
                        ("plan", plan)):
        if value is not None:
            raise ValueError(f"variant='wgmma' takes block_k alone (its block_q is 64 rows per consumer warpgroup); "
                             f"got {name}={value!r}")
    key = _wgmma_key(q, k, v, causal, scale, block_k)
    if key is not None:
        call = prepared.lookup(key)
        if call is not None:
            return call(q, k, v)
    (q_d, k_d, v_d), kind, dtype = all_to_device_words((("q", q), ("k", k), ("v", v)))
    if dtype not in wgmma.DTYPES:
        raise TypeError(f"variant='wgmma' takes float16 or bfloat16 inputs (wgmma's 16-bit operands); got {dtype}. "
                        "Use variant='tensor' for float32")
    cc = device_limits()["cc"]
    if cc is not None and not hopper.runs_on(cc):
        raise RuntimeError(f"variant='wgmma' needs a Hopper GPU (compute capability 9.0: its sm_90a code runs on no "
                           f"other); this one has {cc[0]}.{cc[1]}. Use variant='tensor'")
    for name, x in (("q", q_d), ("k", k_d), ("v", v_d)):
        wgmma.check_tma_strides(name, x)
    B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale, words=True,
                                                         gqa=True)
    tile_ = wgmma.choose_tile(d, causal, block_k)
    if key is not None:  # checked: prepare this key's launch once
        return prepared.store(key, PreparedWgmma(q, k, v, causal, scale, dtype, tile_))(q, k, v)
    o, o_words = empty_words((B, H, Nq, d), dtype, kind, like=q)
    lse = empty_words((B, H, Nq), "float32", kind, like=q)[0]
    wgmma.forward(q_d, k_d, v_d, o_words, lse, scale, causal, dtype, tile_)
    return like_input(o, kind), like_input(lse, kind)


def _with_extras(q, k, v, options, library):
    """flash_attention with window / align / ALiBi / softcap / dropout: the register or tensor kernel with those
    compiled in."""
    key = prepared.prepared_key("forward", (q, k, v), options, options=library)
    call = prepared.lookup(key) if key is not None else None
    if call is not None:
        return call(q, k, v, check_seed(library["seed"]))
    weight = tensor.library_weight(library)
    plan, scale, (q_d, k_d, v_d, kind, o, lse, o_words) = setup(q, k, v, *options, extras=weight)
    B, H, Nq, d = plan.problem.B, plan.problem.H, plan.problem.Nq, plan.problem.d
    opt = check_options((B, H, Nq, d), causal=plan.problem.causal, scale=scale, **library)
    extras = Extras.from_options(opt, B, H)
    if plan.variant not in ("register", "tensor"):
        raise NotImplementedError(f"window_size, align, alibi_slopes, softcap and dropout_p run on variant="
                                  f"'register' or 'tensor' so far; got variant={plan.variant!r}")
    if key is not None:  # checked: prepare this key's launch once, as plain calls do
        return prepared.store(key, PreparedForward(plan, scale, q, k, v, extras))(q, k, v, opt.seed)
    arrays = {"q": q_d, "k": k_d, "v": v_d, "o": o if o_words is None else o_words, "lse": lse}
    describe(plan, scale, q_d.shape, k_d.shape, extras).run(arrays, lambda shape, dt: empty(shape, dt, kind, like=q),
                                                            np.int64(opt.seed))
    return like_input(o, kind), like_input(lse, kind)


def describe(plan, scale, q_shape, k_shape, extras=None) -> Launches:
    """The launches of a forward plan for q (B, H, Nq, ·) and k (B, H_kv, Nk, ·) (the last axis is not read: d is
    the plan's), described by the kernel module (register.py, tensor.py, shared.py); extras: the library's
    options."""
    p = plan.problem
    q_shape, k_shape = (*q_shape[:3], p.d), (*k_shape[:3], p.d)
    if plan.variant == "register":
        return register.launches(q_shape, k_shape, scale, p.causal, plan.config, splits=plan.splits,
                                 heavy_first=plan.heavy_first, section=plan.section, extras=extras)
    if plan.variant == "tensor":
        return tensor.launches(q_shape, k_shape, scale, p.causal, plan.config, plan.precision, splits=plan.splits,
                               heavy_first=plan.heavy_first, section=plan.section, extras=extras)
    return shared.launches(q_shape, k_shape, scale, p.causal, *plan.config)


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
        if tile is not None:
            raise ValueError("tile= configures the register kernel; for variant='tensor' use block_q / block_k")
        (q_d, k_d, v_d), kind, dtype = all_to_device_words((("q", q), ("k", k), ("v", v)))
        if plan is None:
            precision = tensor.resolve_precision(dtype, precision, device_limits()["cc"])
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


def prepare(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None, precision=None, splits=None,
            plan=None):
    """Everything flash_attention(..., variant="tensor") does before the launch: check the inputs, pack
    16-bit ones as uint32 pairs (no copy), allocate o and lse, make the plan (kernels/plan.py: precision,
    tile, split-KV, block order).

    Returns (run, o, lse, kind): run() launches the kernel(s) on the prepared arrays and can be called again
    (benchmarks time it, so that Python's work per call is not counted as kernel time); kind says how the
    inputs came ("numpy", "numba" or "torch") for _launch.like_input."""
    p, scale, (q_d, k_d, v_d, kind, o, lse, o_words) = setup(q, k, v, causal, scale, "tensor", block_q, block_k,
                                                             None, precision, splits, plan)
    described = describe(p, scale, q_d.shape, k_d.shape)
    alloc = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731 (partial results of split-KV)
    arrays = {"q": q_d, "k": k_d, "v": v_d, "o": o_words, "lse": lse}

    def run():
        described.run(arrays, alloc)

    return run, o, lse, kind


class PreparedForward:
    """flash_attention for torch tensors of one key: the kernel module's launch description (describe), prepared
    once (prepared.PreparedLaunches); a call allocates the outputs with torch and launches (one kernel, or the
    split kernel and the merge). k and v may have fewer heads (GQA: the build that maps query heads to K/V heads).
    extras: the library's options (options.Extras), or None; call(q, k, v, seed) passes the dropout seed."""

    def __init__(self, plan, scale, q, k, v, extras=None):
        p = plan.problem
        self.out_dtype = q.dtype
        self.shapes = ((p.B, p.H, p.Nq, p.d), (p.B, p.H, p.Nq))
        described = describe(plan, scale, tuple(q.shape), tuple(k.shape), extras)
        specs = {name: prepared.torch_spec(x) for name, x in (("q", q), ("k", k), ("v", v))}
        specs["o"] = prepared.Spec.contiguous(self.shapes[0], specs["q"].dtype)
        specs["lse"] = prepared.Spec.contiguous(self.shapes[1], np.float32)
        self.launches = prepared.PreparedLaunches.of(described, specs, ("q", "k", "v", "o", "lse"), q.device)

    def __call__(self, q, k, v, seed=None):
        import torch  # optional: only torch tensors come here

        o = torch.empty(self.shapes[0], dtype=self.out_dtype, device=q.device)
        lse = torch.empty(self.shapes[1], dtype=torch.float32, device=q.device)
        self.launches(prepared.current_stream(q), (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                                   lse.data_ptr()), q.device, seed)
        return o, lse


class PreparedWgmma:
    """flash_attention(..., variant="wgmma") for torch tensors of one key, as kernels/prepared.py prepares the other
    variants: the kernel and its argument list once; a call allocates O (in q's layout: wgmma.output_strides) and
    lse with torch, finds the tensor maps of its Q, K and V (wgmma.torch_map: made once per buffer, with the
    tensors' own strides) and launches."""

    def __init__(self, q, k, v, causal: bool, scale: float, dtype: str, tile: wgmma.WgmmaTile):
        B, H, Nq, d = q.shape
        H_kv = k.shape[1]
        self.block_q, self.block_k = tile.block_q, tile.block_k
        self.lse_shape = (B, H, Nq)
        maps = prepared.Spec((16,), (8,), np.dtype(np.uint64))
        self.o_strides = wgmma.output_strides(q)  # O's layout is the key's, decided once
        self.dtype = q.dtype
        o = prepared.Spec(tuple(q.shape), tuple(2 * st for st in self.o_strides), np.dtype(np.uint16)).words()
        args = [maps, maps, maps, o, prepared.Spec.contiguous(self.lse_shape, np.float32), np.int64(Nq),
                np.int64(k.shape[2]), np.int64(H // H_kv), np.float32(scale * LOG2E),
                prepared.Spec.contiguous((1, 1, len(wgmma.EVENTS)), np.uint64)]
        self.no_stamps = wgmma.no_stamps().device_ctypes_pointer.value  # the build without a timeline ignores it
        self.kernel = prepared.PreparedKernel(wgmma.build(d, dtype, causal, tile), wgmma.grid(B, H, Nq, tile),
                                              tile.threads, args, tile.shared_bytes(d))

    def __call__(self, q, k, v):
        import torch  # optional: only torch tensors come here

        o = torch.empty_strided(q.shape, self.o_strides, dtype=self.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        pointers = [wgmma.torch_map(q, self.block_q), wgmma.torch_map(k, self.block_k),
                    wgmma.torch_map(v, self.block_k), o.data_ptr(), lse.data_ptr(), self.no_stamps]
        self.kernel.launch(prepared.current_stream(q), pointers)
        return o, lse
