"""flash_attention_backward: check the inputs, plan, and launch a backward kernel; return (dq, dk, dv).

Two variants: "register" (FP32 units, kernels/register_backward.py) and "tensor" (tensor cores,
kernels/tensor_backward.py); and, opt-in, "wgmma" (FlashAttention-3's backward on Hopper, kernels/wgmma_backward.py).
Each kernel module describes its launches once (`launches`): the general path runs
them on numba arrays (_launch.run_all), and torch CUDA tensors take the prepared path (kernels/prepared.py) after
the first call with their shapes: PreparedRegisterBackward and PreparedTensorBackward prepare the same
descriptions once (prepared.PreparedLaunches).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .._inputs import OPTION_DEFAULTS, check_options, check_seed
from ..device import device_limits, has_gpu
from . import hopper, prepared, register_backward, tensor, tensor_backward, wgmma, wgmma_backward
from ._launch import (all_to_device_words, check_kernel_backward_inputs, check_kernel_inputs, empty, empty_words,
                      is_gqa, like_input, to_device)
from .options import Extras, Features, plain_arguments
from .plan import plan as make_plan
from .register_backward import make_kernels


def flash_attention_backward(q, k, v, o, lse, do, *, causal=False, scale=None, variant=None, precision=None,
                             block_q=None, block_k=None, threads=None, window_size=(-1, -1), align="top_left",
                             alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, deterministic=False):
    """Gradients (dq, dk, dv) of attention, from the forward's o and lse and the output gradient do.

    q, o, do: (B, H, Nq, d); k, v: (B, H, Nk, d); lse: (B, H, Nq) float32, as returned by
    `flash_attention`. NumPy arrays, numba device arrays or torch CUDA tensors (no copies); the gradients
    come back in q's kind and dtype (float32 accumulation for 16-bit inputs).

    variant: "register" (this module, FP32 units; float32 and float16) or "tensor" (kernels/tensor_backward.py,
    tensor cores: float16, bfloat16 and float32 through 3xTF32, with `precision` as in the forward) or, opt-in,
    "wgmma" (kernels/wgmma_backward.py, FlashAttention-3's backward on Hopper: float16 and bfloat16, d 64 or 128,
    grouped-query attention, causal or not, the library's options; on an H200 1.30-1.55x the tensor backward,
    docs/runs/wgmma-backward.md). By default "tensor" for float16 / bfloat16 on a GPU that has their mma, else
    "register" (see default_variant).
    block_q / block_k override the tile; threads (register only) the threads per block; see GPU_CONFIG and
    tensor_backward.choose_tile. window_size, align, alibi_slopes, softcap, dropout_p, seed: as in the forward
    (pass the same values); both variants compile them in (the seed is a kernel argument), skip the query tiles
    outside each key block's band and regenerate the forward's dropout mask.
    deterministic (variant="wgmma" only so far): dQ's shares from the key blocks are added in a fixed order, so that
    two calls on the same inputs give the same bits; without it the order of the atomic adds varies from run to
    run, and so may dQ's last bits.
    """
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p, seed=seed)
    plain = alibi_slopes is None and align == "top_left" and not softcap and not dropout_p \
        and tuple(window_size) == (-1, -1) if isinstance(window_size, (tuple, list)) else False
    variant = default_variant(q) if variant is None else variant
    if deterministic and variant != "wgmma":
        raise NotImplementedError(f"deterministic=True runs on variant='wgmma' only so far (Hopper); got "
                                  f"variant={variant!r}, whose dQ is summed by atomics in no fixed order")
    if variant == "tensor":
        if threads is not None:
            raise ValueError("threads= configures the register backward; the tensor backward takes block_q / block_k")
        return _tensor_backward(q, k, v, o, lse, do, causal=causal, scale=scale, precision=precision, block_q=block_q,
                        block_k=block_k, **library)
    if variant == "wgmma":
        for name, value in (("precision", precision), ("block_q", block_q), ("block_k", block_k),
                            ("threads", threads)):
            if value is not None:
                raise ValueError(f"variant='wgmma' takes no {name} (its tile is fixed); got {name}={value!r}")
        return _wgmma_backward(q, k, v, o, lse, do, causal, scale, bool(deterministic), None if plain else library)
    if variant != "register":
        raise ValueError(f"variant must be 'register', 'tensor' or 'wgmma' for the backward; got {variant!r}")
    if precision is not None:
        raise ValueError(f"precision applies to variant='tensor' only; got precision={precision!r}")
    if _dtype_name(q) == "bfloat16":
        raise TypeError("q has dtype bfloat16; the register backward takes float32 or float16 "
                        "(bfloat16 runs on variant='tensor', which needs a GPU of compute capability 8.0 or newer)")
    if prepared.available() and not is_gqa(q, k) and plain:  # torch tensors: the prepared path (prepared.py)
        key = prepared.torch_key(q, k, v, o, lse, do)
        if key is not None:
            key = ("backward", key, causal, scale, block_q, block_k, threads)
            call = prepared.lookup(key)
            if call is None:
                p, scale_, rows = _register_setup(q, k, v, o, lse, do, causal, scale, block_q, block_k, threads)[:3]
                call = prepared.store(key, PreparedRegisterBackward(p, scale_, rows, q, k, v, o, lse, do))
            return call(q, k, v, o, lse, do)
    p, scale, rows, dev, kind = _register_setup(q, k, v, o, lse, do, causal, scale, block_q, block_k, threads)
    B, H, Nq, Nk, d = p.problem.B, p.problem.H, p.problem.Nq, p.problem.Nk, p.problem.d
    H_kv = dev["k"].shape[1]
    block_q, block_k, threads = p.config
    extras, seed = None, 0  # without dropout the seed is not used
    if not plain:
        opt = check_options((B, H, Nq, d), causal=p.problem.causal, scale=scale, **library)
        extras, seed = Extras.from_options(opt, B, H), opt.seed
    features = extras.features() if extras is not None else Features()
    args = extras.arguments(p.problem.causal, B, H, False) if extras is not None else plain_arguments(p.problem.causal)
    heavy = p.heavy_first and H_kv == H and extras is None  # GQA, options: the (key block, head) grid, in order
    kernels = make_kernels(d, block_q, block_k, threads, heavy_first=heavy, gqa=H_kv != H, features=features)
    grid = p.grid if H_kv == H and extras is None else (-(-Nk // block_k), H_kv, B)
    dtype = np.dtype(dev["q"].dtype)
    described = register_backward.launches(kernels, B, H, Nq, d, grid, threads, scale, p.problem.causal, args,
                                           dtype != np.float32, rows)
    new = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    dq = new((B, H, Nq, d), dtype)  # float16: the cast of dQ's float32 accumulator (atomics)
    dk, dv = new((B, H_kv, Nk, d), dtype), new((B, H_kv, Nk, d), dtype)
    described.run(dict(dev, dq=dq, dk=dk, dv=dv), new, seed=np.int64(seed))
    return tuple(like_input(x, kind) for x in (dq, dk, dv))


def _tensor_key(tensors, causal, scale, precision, block_q, block_k, library):
    return prepared.prepared_key("tensor backward", tensors, causal, scale, precision, block_q, block_k,
                                 options=library)


def _wgmma_key(tensors, causal, scale, deterministic):
    key = prepared.torch_key(*tensors) if prepared.available() else None
    return None if key is None else ("wgmma_backward", key, causal, scale, deterministic)


def prepared_call(q, k, v, o, lse, do, causal: bool, scale, variant: str):
    """The prepared call, (dq, dk, dv) = call(q, k, v, o, lse, do), that flash_attention_backward(q, k, v, o, lse,
    do, causal=causal, scale=scale, variant=variant) made for torch tensors of this key, without the library's
    options, or None (not made yet; the register backward's; the general path). flashlab.torch keeps it, so that
    its next call skips the checks and the key's assembly here."""
    tensors = (q, k, v, o, lse, do)
    if variant == "wgmma":
        key = _wgmma_key(tensors, causal, scale, False)
    elif variant == "tensor":
        key = _tensor_key(tensors, causal, scale, None, None, None, dict(OPTION_DEFAULTS))
    else:
        return None
    call = None if key is None else prepared.lookup(key)
    if call is None or variant == "wgmma":
        return call
    return lambda q, k, v, o, lse, do: call(q, k, v, o, lse, do, 0)  # no dropout: the seed is not read


def _wgmma_backward(q, k, v, o, lse, do, causal, scale, deterministic=False, library=None):
    """variant="wgmma" (kernels/wgmma_backward.py): opt-in, 16-bit inputs on Hopper (or the simulator), any strides
    TMA can read (wgmma.check_tma_strides: a (B, N, H, d) tensor's transpose(1, 2) is read in place), GQA, d 64 or
    128. library: the options (window_size, align, alibi_slopes, softcap, dropout_p, seed) or None.
    Torch CUDA tensors without options take the prepared path after the first call with their key
    (PreparedWgmmaBackward)."""
    key = _wgmma_key((q, k, v, o, lse, do), causal, scale, deterministic) if library is None else None
    if key is not None:
        call = prepared.lookup(key)
        if call is not None:
            return call(q, k, v, o, lse, do)
    (q_d, k_d, v_d, o_d, do_d), kind, dtype = all_to_device_words(
        (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)))
    if dtype not in wgmma_backward.DTYPES:
        raise TypeError(f"variant='wgmma' takes float16 or bfloat16 inputs; got {dtype}. Use variant='tensor'")
    cc = device_limits()["cc"]
    if cc is not None and not hopper.runs_on(cc):
        raise RuntimeError(f"variant='wgmma' needs a Hopper GPU (compute capability 9.0: its sm_90a code runs on no "
                           f"other); this one has {cc[0]}.{cc[1]}. Use variant='tensor'")
    for name, x in (("q", q_d), ("k", k_d), ("v", v_d), ("do", do_d)):
        wgmma.check_tma_strides(name, x)
    B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale, words=True,
                                                         gqa=True)
    if d not in (64, 128):
        raise ValueError(f"variant='wgmma' supports d in (64, 128); got d={d}")
    lse_d, _ = to_device(lse, "lse")
    if tuple(lse_d.shape) != (B, H, Nq) or np.dtype(lse_d.dtype) != np.float32:
        raise ValueError(f"lse must be float32 of shape {(B, H, Nq)} (the forward's); got {np.dtype(lse_d.dtype)} "
                         f"{tuple(lse_d.shape)}")
    if key is not None:  # checked: prepare this key's launches once
        tile = wgmma_backward.default_tile(d, bool(causal))
        described = wgmma_backward.launches(B, H, Nq, Nk, d, scale, causal, dtype, k_d.shape[1], tile,
                                            deterministic=deterministic)
        return prepared.store(key, PreparedWgmmaBackward(described, tile.map_rows(), q, k, v, o, lse, do))(
            q, k, v, o, lse, do)
    extras, seed = None, 0
    if library is not None:
        opt = check_options((B, H, Nq, d), causal=causal, scale=scale, **library)
        extras, seed = Extras.from_options(opt, B, H), opt.seed
    outs = [empty_words(x.shape[:3] + (d,), dtype, kind, like=q) for x in (q_d, k_d, v_d)]
    wgmma_backward.backward(q_d, k_d, v_d, o_d, lse_d, do_d, *(w for _, w in outs), scale, causal, dtype,
                            deterministic=deterministic, extras=extras, seed=seed)
    return tuple(like_input(x, kind) for x, _ in outs)


class PreparedWgmmaBackward:
    """The wgmma backward for torch CUDA tensors of one key: wgmma_backward.launches prepared once; a call
    allocates the gradients in their inputs' layout (torch.empty_like: dense, with the inputs' order of strides, so
    a GPT's transposed (B, N, H, d) heads get gradients that its transpose and view take back without a copy),
    finds the tensor maps of K, V, Q and dO (wgmma.torch_map: made once per buffer, with the tensors' own strides)
    and launches preprocess, main and the dQ cast."""

    def __init__(self, described, map_rows, q, k, v, o, lse, do):
        import torch  # optional: only torch tensors come here

        self.map_rows = map_rows  # the tensor maps' box rows (BackwardTile.map_rows of the launches' tile)

        grads = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
        specs = {n: prepared.torch_spec(x) for n, x in zip(("q", "k", "v", "o", "do"), (q, k, v, o, do))}
        specs.update({n: prepared.torch_spec(x) for n, x in grads.items()})
        specs = {n: x.words() for n, x in specs.items()}
        maps = prepared.Spec((16,), (8,), np.dtype(np.uint64))
        specs.update(lse=prepared.torch_spec(lse), **{name: maps for name in wgmma_backward.MAPS})
        self.launches = prepared.PreparedLaunches.of(described, specs, ("o", "lse", "dq", "dk", "dv", "do", "k_map",
                                                                        "v_map", "q_map", "do_map"), q.device)

    def __call__(self, q, k, v, o, lse, do):
        import torch  # optional: only torch tensors come here

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        maps = tuple(wgmma.torch_map(x, self.map_rows[name])
                     for name, x in (("k_map", k), ("v_map", v), ("q_map", q), ("do_map", do)))
        self.launches(prepared.current_stream(q), (o.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                                   dv.data_ptr(), do.data_ptr(), *maps), q.device)
        return dq, dk, dv


# The tensor backward is the default for 16-bit inputs on a GPU: its GPU tests passed on an H100
# (bash benchmarks/check_tensor_backward_gpu.sh tests, docs/runs/tensor-backward.md). Set False to fall back to the
# register kernel.
TENSOR_DEFAULT = True


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", "")).replace("torch.", "")


def default_variant(q) -> str:
    """"tensor" for float16 inputs on a GPU with their mma (sm_75) and for bfloat16 on any GPU while TENSOR_DEFAULT
    is on, else "register" (float32 keeps its FP32-unit kernel by default; variant="tensor" runs it through
    3xTF32). bfloat16 below sm_80 goes to the tensor backward too, which refuses it with the forward's error
    (tensor.resolve_precision), rather than to the register kernel, which would need it upcast."""
    dtype = _dtype_name(q)
    if not TENSOR_DEFAULT or dtype not in ("float16", "bfloat16") or not has_gpu():
        return "register"
    cc = device_limits()["cc"]
    return "tensor" if dtype == "bfloat16" or (cc is not None and cc >= (7, 5)) else "register"


def _register_setup(q, k, v, o, lse, do, causal, scale, block_q, block_k, threads):
    """Check the inputs and make the plan: (plan, scale, rows per preprocess block, device arrays, kind)."""
    args = dict(q=q, k=k, v=v, o=o, lse=lse, do=do)
    dev, kinds = {}, {}
    for name, x in args.items():
        dev[name], kinds[name] = to_device(x, name)
    B, H, Nq, Nk, d, causal, scale = check_kernel_backward_inputs(*dev.values(), causal=causal, scale=scale,
                                                                  gqa=True)
    p = make_plan((B, H, Nq, Nk, d), causal=causal, dtype=np.dtype(dev["q"].dtype).name, direction="backward",
             block_q=block_q, block_k=block_k, threads=threads)
    return p, scale, register_backward.PREPROCESS_ROWS["gpu" if has_gpu() else "simulator"], dev, kinds["q"]


# the arrays of a prepared backward call, in the order its pointers are passed
GRADIENT_INPUTS = ("q", "k", "v", "o", "lse", "do", "dq", "dk", "dv")


class PreparedRegisterBackward:
    """flash_attention_backward for torch tensors of one key (plain: no options): register_backward.launches,
    prepared once (kernels/prepared.py)."""

    def __init__(self, plan, scale, rows, q, k, v, o, lse, do):
        import torch  # optional: only torch tensors come here

        p = plan.problem
        bq, bk, threads = plan.config
        kernels = make_kernels(p.d, bq, bk, threads, heavy_first=plan.heavy_first)
        args = plain_arguments(p.causal)
        described = register_backward.launches(kernels, p.B, p.H, p.Nq, p.d, plan.grid, threads, scale, p.causal,
                                               args, q.dtype != torch.float32, rows)
        self.dtype, self.q_shape, self.k_shape = q.dtype, (p.B, p.H, p.Nq, p.d), (p.B, p.H, p.Nk, p.d)
        specs = {n: prepared.torch_spec(x) for n, x in zip(("q", "k", "v", "o", "lse", "do"), (q, k, v, o, lse, do))}
        dt = specs["q"].dtype
        specs.update(dq=prepared.Spec.contiguous(self.q_shape, dt), dk=prepared.Spec.contiguous(self.k_shape, dt),
                     dv=prepared.Spec.contiguous(self.k_shape, dt))
        self.launches = prepared.PreparedLaunches.of(described, specs, GRADIENT_INPUTS, q.device)

    def __call__(self, q, k, v, o, lse, do):
        import torch  # optional: only torch tensors come here

        new = lambda shape: torch.empty(shape, dtype=self.dtype, device=q.device)  # noqa: E731
        dq, dk, dv = new(self.q_shape), new(self.k_shape), new(self.k_shape)
        self.launches(prepared.current_stream(q), (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                                   do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), q.device)
        return dq, dk, dv


def _tensor_backward(q, k, v, o, lse, do, *, causal=False, scale=None, precision=None, block_q=None, block_k=None,
             plan=None, window_size=(-1, -1), align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0,
             seed=0):
    """flash_attention_backward(..., variant="tensor"): (dq, dk, dv) in q's dtype and kind of array. The library
    options as in the forward (pass the same values): checked by flashlab._inputs.check_options, compiled in.
    Torch CUDA tensors take a prepared path (PreparedTensorBackward) unless plan= is given."""
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p)
    key = None if plan is not None else _tensor_key((q, k, v, o, lse, do), causal, scale, precision, block_q,
                                                     block_k, library)
    if key is not None:
        call = prepared.lookup(key)
        if call is None:
            call = prepared.store(key, PreparedTensorBackward(q, k, v, o, lse, do, causal=causal, scale=scale,
                                                     precision=precision, block_q=block_q, block_k=block_k,
                                                     seed=seed, **library))
        return call(q, k, v, o, lse, do, check_seed(seed))
    s = _tensor_setup(q, k, v, o, lse, do, causal=causal, scale=scale, precision=precision, block_q=block_q,
               block_k=block_k, plan=plan, seed=seed, **library)
    B, H, Nq, Nk, d, H_kv, kind, dtype = s.B, s.H, s.Nq, s.Nk, s.d, s.H_kv, s.kind, s.dtype
    q_w, k_w, v_w, o_w, lse_d, do_w = s.arrays
    dq, dq_w = empty_words((B, H, Nq, d), dtype, kind, like=q)
    dk, dk_w = empty_words((B, H_kv, Nk, d), dtype, kind, like=q)
    dv, dv_w = empty_words((B, H_kv, Nk, d), dtype, kind, like=q)
    arrays = dict(q=q_w, k=k_w, v=v_w, o=o_w, lse=lse_d, do=do_w, dq=dq_w, dk=dk_w, dv=dv_w)
    _tensor_launches(s).run(arrays, lambda shape, dt: empty(shape, dt, kind, like=q), seed=np.int64(s.seed))
    return tuple(like_input(x, kind) for x in (dq, dk, dv))


def _tensor_launches(s):
    """tensor_backward.launches for a _tensor_setup."""
    kernels = tensor_backward.build(s.d, s.plan.config, s.causal, s.plan.precision, gqa=s.H_kv != s.H,
                                    features=s.features)
    return tensor_backward.launches(kernels, s.B, s.H, s.Nq, s.Nk, s.d, s.H_kv, s.scale, s.plan.config,
                                    s.plan.precision, s.args)


def _tensor_setup(q, k, v, o, lse, do, *, causal, scale, precision, block_q, block_k, plan, window_size, align,
           alibi_slopes, softcap, dropout_p, seed):
    """backward's checks and plan: a SimpleNamespace of the device arrays (q, k, v, o, lse, do; 16-bit ones as
    uint32 words), kind, dtype, B, H, Nq, Nk, d, H_kv, causal, scale, plan, features, args (the options' values,
    options.OptionArgs in log2 units) and seed."""
    (q_w, k_w, v_w, o_w, do_w), kind, dtype = all_to_device_words((("q", q), ("k", k), ("v", v), ("o", o),
                                                                    ("do", do)))
    lse_d, _ = to_device(lse, "lse")
    B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q_w, k_w, v_w, causal=causal, scale=scale,
                                                         words=dtype != "float32", gqa=True)
    for name, x, w in (("o", o, o_w), ("do", do, do_w)):
        if tuple(w.shape) != tuple(q_w.shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected q's shape {tuple(q.shape)}")
    if tuple(lse_d.shape) != (B, H, Nq) or np.dtype(lse_d.dtype) != np.float32:
        raise ValueError(f"lse must be float32 of shape {(B, H, Nq)} (as the forward returns it); got "
                         f"{np.dtype(lse_d.dtype).name} {tuple(lse_d.shape)}")
    opt = check_options((B, H, Nq, d), causal=causal, scale=scale, window_size=window_size, align=align,
                        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed)
    extras = Extras.from_options(opt, B, H)
    if plan is None:
        precision = tensor.resolve_precision(dtype, precision, device_limits()["cc"])
        plan = make_plan((B, H, Nq, Nk, d), variant="tensor", direction="backward", causal=causal, dtype=dtype,
                         block_q=block_q, block_k=block_k, precision=precision)
    features = extras.features() if extras is not None else Features()
    args = extras.arguments(causal, B, H, True) if extras is not None else plain_arguments(causal)
    return SimpleNamespace(arrays=(q_w, k_w, v_w, o_w, lse_d, do_w), kind=kind, dtype=dtype, B=B, H=H, Nq=Nq, Nk=Nk,
                           d=d, H_kv=k_w.shape[1], causal=causal, scale=scale, plan=plan, features=features,
                           args=args, seed=opt.seed)


class PreparedTensorBackward:
    """The tensor backward for torch CUDA tensors of one key (shapes, strides, dtypes, options but the seed): the
    checks, plan and tensor_backward.launches once, prepared (kernels/prepared.py); each call allocates the
    gradients and launches preprocess, main (with the call's dropout seed) and (16-bit) the dQ cast."""

    def __init__(self, q, k, v, o, lse, do, **options):
        s = _tensor_setup(q, k, v, o, lse, do, plan=None, **options)
        self.dtype, self.q_shape, self.k_shape = q.dtype, (s.B, s.H, s.Nq, s.d), (s.B, s.H_kv, s.Nk, s.d)
        specs = {n: prepared.torch_spec(x) for n, x in zip(("q", "k", "v", "o", "lse", "do"), (q, k, v, o, lse, do))}
        dt = specs["q"].dtype
        specs.update(dq=prepared.Spec.contiguous(self.q_shape, dt), dk=prepared.Spec.contiguous(self.k_shape, dt),
                     dv=prepared.Spec.contiguous(self.k_shape, dt))
        if s.dtype != "float32":  # 16-bit values as uint32 pairs (lse stays float32)
            specs = {n: x if n == "lse" else x.words() for n, x in specs.items()}
        self.launches = prepared.PreparedLaunches.of(_tensor_launches(s), specs, GRADIENT_INPUTS, q.device)

    def __call__(self, q, k, v, o, lse, do, seed=0):
        import torch  # optional: only torch tensors come here

        new = lambda shape: torch.empty(shape, dtype=self.dtype, device=q.device)  # noqa: E731
        dq, dk, dv = new(self.q_shape), new(self.k_shape), new(self.k_shape)
        self.launches(prepared.current_stream(q), (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                                   do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()), q.device,
                      seed)
        return dq, dk, dv
