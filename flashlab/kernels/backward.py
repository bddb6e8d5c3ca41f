"""flash_attention_backward: check the inputs, plan, and launch a backward kernel; return (dq, dk, dv).

Two variants: "register" (FP32 units, kernels/register_backward.py) and "tensor" (tensor cores,
kernels/tensor_backward.py). Torch CUDA tensors take the prepared path (kernels/prepared.py) after the first
call with their shapes: PreparedRegisterBackward and PreparedTensorBackward build the argument lists once.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .._inputs import check_options, check_seed
from ..device import device_limits, has_gpu
from . import prepared, tensor, tensor_backward
from ._launch import (all_to_device_words, check_kernel_backward_inputs, check_kernel_inputs, empty, empty_words,
                      is_gqa, like_input, to_device)
from .common import LOG2E
from .options import Extras
from .plan import plan as make_plan
from .register_backward import make_kernels


def flash_attention_backward(q, k, v, o, lse, do, *, causal=False, scale=None, variant=None, precision=None,
                             block_q=None, block_k=None, threads=None, window_size=(-1, -1), align="top_left",
                             alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
    """Gradients (dq, dk, dv) of attention, from the forward's o and lse and the output gradient do.

    q, o, do: (B, H, Nq, d); k, v: (B, H, Nk, d); lse: (B, H, Nq) float32, as returned by
    `flash_attention`. NumPy arrays, numba device arrays or torch CUDA tensors (no copies); the gradients
    come back in q's kind and dtype (float32 accumulation for 16-bit inputs).

    variant: "register" (this module, FP32 units; float32 and float16) or "tensor" (kernels/tensor_backward.py,
    tensor cores: float16, bfloat16 and float32 through 3xTF32, with `precision` as in the forward). By default
    "tensor" for float16 / bfloat16 on a GPU that has their mma, else "register" (see default_variant).
    block_q / block_k override the tile; threads (register only) the threads per block; see GPU_CONFIG and
    tensor_backward.choose_tile. window_size, align, alibi_slopes, softcap, dropout_p, seed: as in the forward
    (pass the same values); both variants compile them in (the seed is a kernel argument), skip the query tiles
    outside each key block's band and regenerate the forward's dropout mask.
    """
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p, seed=seed)
    plain = alibi_slopes is None and align == "top_left" and not softcap and not dropout_p \
        and tuple(window_size) == (-1, -1) if isinstance(window_size, (tuple, list)) else False
    variant = default_variant(q) if variant is None else variant
    if variant == "tensor":
        if threads is not None:
            raise ValueError("threads= configures the register backward; the tensor backward takes block_q / block_k")
        return _tensor_backward(q, k, v, o, lse, do, causal=causal, scale=scale, precision=precision, block_q=block_q,
                        block_k=block_k, **library)
    if variant != "register":
        raise ValueError(f"variant must be 'register' or 'tensor' for the backward; got {variant!r}")
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
    heavy = p.heavy_first and H_kv == H and extras is None  # GQA, options: the (key block, head) grid, in order
    preprocess, dkdv, cast = make_kernels(d, block_q, block_k, threads, heavy_first=heavy, gqa=H_kv != H,
                                          extras=extras)

    dtype = np.dtype(dev["q"].dtype)
    new = lambda shape, dt: empty(shape, dt, kind, like=q)
    D = new((B, H, Nq), np.float32)
    dq = new((B, H, Nq, d), np.float32)  # accumulated with atomics, so always float32
    dk, dv = new((B, H_kv, Nk, d), dtype), new((B, H_kv, Nk, d), dtype)

    preprocess[((Nq + rows - 1) // rows, H, B), rows](dev["o"], dev["do"], D, dq)
    grid = p.grid if H_kv == H and extras is None else (-(-Nk // block_k), H_kv, B)
    dkdv[grid, threads](dev["q"], dev["k"], dev["v"], dev["do"], dev["lse"], D, dq, dk, dv, np.float32(scale),
                        p.problem.causal, 0, 0, np.int64(seed))  # 0, 0: the varlen tables (unused)
    if dtype != np.float32:
        dq16 = new((B, H, Nq, d), dtype)
        n = B * H * Nq * d
        cast[(n + 255) // 256, 256](dq.reshape(n), dq16.reshape(n))
        dq = dq16
    return tuple(like_input(x, kind) for x in (dq, dk, dv))


# The tensor backward is the default for 16-bit inputs on a GPU: its GPU tests passed on an H100
# (bash benchmarks/check_tensor_backward_gpu.sh tests, docs/runs/tensor-backward.md). Set False to fall back to the
# register kernel.
TENSOR_DEFAULT = True


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", "")).replace("torch.", "")


def default_variant(q) -> str:
    """"tensor" for float16 / bfloat16 inputs on a GPU with their mma (float16: sm_75, bfloat16: sm_80) while
    TENSOR_DEFAULT is on, else "register" (float32 keeps its FP32-unit kernel by default; variant="tensor" runs
    it through 3xTF32)."""
    dtype = _dtype_name(q)
    if not TENSOR_DEFAULT or dtype not in ("float16", "bfloat16") or not has_gpu():
        return "register"
    cc = device_limits()["cc"]
    return "tensor" if cc is not None and cc >= ((7, 5) if dtype == "float16" else (8, 0)) else "register"


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
    return p, scale, 128 if has_gpu() else 32, dev, kinds["q"]


class PreparedRegisterBackward:
    """flash_attention_backward for torch tensors of one key: preprocess, dkdv (and cast for float16)."""

    def __init__(self, plan, scale, rows, q, k, v, o, lse, do):
        import torch  # optional: only torch tensors come here

        p = plan.problem
        bq, bk, threads = plan.config
        preprocess, dkdv, cast = make_kernels(p.d, bq, bk, threads, heavy_first=plan.heavy_first)
        self.dtype, self.half = q.dtype, q.dtype != torch.float32
        self.q_shape, self.k_shape = (p.B, p.H, p.Nq, p.d), (p.B, p.H, p.Nk, p.d)
        specs = {n: prepared.torch_spec(x) for n, x in zip(("q", "k", "v", "o", "lse", "do"), (q, k, v, o, lse, do))}
        dt = specs["q"].dtype
        D = prepared.Spec.contiguous((p.B, p.H, p.Nq), np.float32)
        dq = prepared.Spec.contiguous(self.q_shape, np.float32)
        dk = prepared.Spec.contiguous(self.k_shape, dt)
        self.kernels = [prepared.PreparedKernel(preprocess, ((p.Nq + rows - 1) // rows, p.H, p.B), rows,
                                       [specs["o"], specs["do"], D, dq]),
                        prepared.PreparedKernel(dkdv, plan.grid, threads,
                                       [specs["q"], specs["k"], specs["v"], specs["do"], specs["lse"], D, dq, dk, dk,
                                        np.float32(scale), bool(p.causal), 0, 0, 0])]  # unused: varlen tables, seed
        if self.half:
            n = int(np.prod(self.q_shape))
            self.kernels.append(prepared.PreparedKernel(cast, ((n + 255) // 256,), 256,
                                                        [prepared.Spec.contiguous((n,), np.float32),
                                                         prepared.Spec.contiguous((n,), dt)]))

    def __call__(self, q, k, v, o, lse, do):
        import torch  # optional: only torch tensors come here

        stream = prepared.current_stream(q)
        new = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device)  # noqa: E731
        D, dq = new(self.q_shape[:3], torch.float32), new(self.q_shape, torch.float32)
        dk, dv = new(self.k_shape, self.dtype), new(self.k_shape, self.dtype)
        self.kernels[0].launch(stream, [o.data_ptr(), do.data_ptr(), D.data_ptr(), dq.data_ptr()])
        self.kernels[1].launch(stream, [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr(),
                                        D.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()])
        if self.half:
            dq16 = new(self.q_shape, self.dtype)
            self.kernels[2].launch(stream, [dq.data_ptr(), dq16.data_ptr()])
            dq = dq16
        return dq, dk, dv


def _tensor_backward(q, k, v, o, lse, do, *, causal=False, scale=None, precision=None, block_q=None, block_k=None,
             plan=None, window_size=(-1, -1), align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0,
             seed=0):
    """flash_attention_backward(..., variant="tensor"): (dq, dk, dv) in q's dtype and kind of array. The library
    options as in the forward (pass the same values): checked by flashlab._inputs.check_options, compiled in.
    Torch CUDA tensors take a prepared path (PreparedTensorBackward) unless plan= is given."""
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p)
    key = None if plan is not None else prepared.prepared_key("tensor backward", (q, k, v, o, lse, do), causal, scale,
                                                           precision, block_q, block_k, options=library)
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
    alloc = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    D = alloc((B, H, Nq), np.float32)
    dq, dq_w = empty_words((B, H, Nq, d), dtype, kind, like=q)
    dq_acc = dq_w if dtype == "float32" else alloc((B, H, Nq, d), np.float32)
    dk, dk_w = empty_words((B, H_kv, Nk, d), dtype, kind, like=q)
    dv, dv_w = empty_words((B, H_kv, Nk, d), dtype, kind, like=q)
    tensor_backward.launch(q_w, k_w, v_w, o_w, lse_d, do_w, dq_w, dk_w, dv_w, dq_acc, D, H, s.scale, s.causal,
                           s.plan.config, s.plan.precision, extras=s.extras, seed=s.seed)
    return tuple(like_input(x, kind) for x in (dq, dk, dv))


def _tensor_setup(q, k, v, o, lse, do, *, causal, scale, precision, block_q, block_k, plan, window_size, align,
           alibi_slopes, softcap, dropout_p, seed):
    """backward's checks and plan: a SimpleNamespace of the device arrays (q, k, v, o, lse, do; 16-bit ones as
    uint32 words), kind, dtype, B, H, Nq, Nk, d, H_kv, causal, scale, plan, extras and seed."""
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
    return SimpleNamespace(arrays=(q_w, k_w, v_w, o_w, lse_d, do_w), kind=kind, dtype=dtype, B=B, H=H, Nq=Nq, Nk=Nk,
                           d=d, H_kv=k_w.shape[1], causal=causal, scale=scale, plan=plan, extras=extras, seed=opt.seed)


class PreparedTensorBackward:
    """The tensor backward for torch CUDA tensors of one key (shapes, strides, dtypes, options but the seed): the
    checks, plan and argument lists once (kernels/prepared.py), then each call allocates the gradients and launches
    preprocess, main (with the call's dropout seed) and (16-bit) the dQ cast, as launch() does."""

    def __init__(self, q, k, v, o, lse, do, **options):
        s = _tensor_setup(q, k, v, o, lse, do, plan=None, **options)
        B, H, Nq, Nk, d, H_kv, tile = s.B, s.H, s.Nq, s.Nk, s.d, s.H_kv, s.plan.config
        preprocess, main, cast = tensor_backward.build(d, tile, s.causal, s.plan.precision, gqa=H_kv != H,
                                                       extras=s.extras)
        self.wide = s.dtype == "float32"
        ins = [prepared.torch_spec(x) for x in (q, k, v, o, lse, do)]
        if not self.wide:  # 16-bit values as uint32 pairs (lse stays float32)
            ins = [x if i == 4 else x.words() for i, x in enumerate(ins)]
        q_s, k_s, v_s, o_s, lse_s, do_s = ins
        self.dtype, self.q_shape, self.k_shape = q.dtype, (B, H, Nq, d), (B, H_kv, Nk, d)
        D = prepared.Spec.contiguous((B, H, Nq), np.float32)
        dq_acc = prepared.Spec.contiguous(self.q_shape, np.float32)
        grads = [prepared.Spec.contiguous(self.k_shape, prepared.torch_spec(q).dtype)] * 2  # dk, dv
        if not self.wide:
            grads = [x.words() for x in grads]
        rows = tensor_backward.PREPROCESS_ROWS
        self.kernels = [
            prepared.PreparedKernel(preprocess, (-(-Nq // rows), B * H), 32 * tensor_backward.PREPROCESS_WARPS,
                                 [o_s, do_s, D, dq_acc, H]),
            prepared.PreparedKernel(main, (-(-Nk // tile.block_k), B * H_kv), tile.threads,
                                 [q_s, k_s, v_s, do_s, lse_s, D, dq_acc, *grads, H, np.float32(s.scale),
                                  np.float32(s.scale * LOG2E), np.int64(0)],
                                 shared=4 * tile.shared_words(d, s.plan.precision))]
        if not self.wide:  # dQ, accumulated in float32, to the input's 16-bit type
            n = B * H * Nq * d
            self.kernels.append(prepared.PreparedKernel(cast, (-(-(n // 2) // 256),), 256,
                                                     [prepared.Spec.contiguous((n,), np.float32),
                                                      prepared.Spec.contiguous((n // 2,), np.uint32)]))

    def __call__(self, q, k, v, o, lse, do, seed=0):
        import torch  # optional: only torch tensors come here

        stream = prepared.current_stream(q)
        new = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device)  # noqa: E731
        D = new(self.q_shape[:3], torch.float32)
        dq = new(self.q_shape, self.dtype)
        dq_acc = dq if self.wide else new(self.q_shape, torch.float32)
        dk, dv = new(self.k_shape, self.dtype), new(self.k_shape, self.dtype)
        self.kernels[0].launch(stream, [o.data_ptr(), do.data_ptr(), D.data_ptr(), dq_acc.data_ptr()])
        self.kernels[1].launch(stream, [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr(),
                                        D.data_ptr(), dq_acc.data_ptr(), dk.data_ptr(), dv.data_ptr()], seed)
        if not self.wide:
            self.kernels[2].launch(stream, [dq_acc.data_ptr(), dq.data_ptr()])
        return dq, dk, dv
