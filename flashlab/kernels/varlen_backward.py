"""The register backward over a packed variable-length batch, in one launch (NumPy semantics in
flashlab/varlen.py).

The packed (total, H, d) arrays are handed to register_backward.make_kernels(..., varlen=True) as one batch, viewed
as (1, H, total, d) (strided views, no copies). The dkdv grid's x axis walks a host-built table of key blocks
over all sequences, heaviest first; each block finds its sequence's rows through cu_seqlens, so masking,
alignment and band skipping work per sequence. preprocess and cast run over the packed rows as they are.
"""
from __future__ import annotations

import numpy as np

from ..device import get_cuda, has_gpu
from ..varlen import check_varlen
from . import register_backward
from ._launch import check_kernel_backward_inputs, empty, like_input, shell, to_device, to_host
from .options import Extras, Features, plain_arguments, query_band, tile_band
from .register_backward import PREPROCESS_ROWS


def key_blocks(cu_q, cu_k, block_q: int, block_k: int, opt) -> np.ndarray:
    """int32 (n, 2) table of (sequence b, first key k0 within it), one row per key block, heaviest first.

    A block's weight is the number of query tiles dkdv visits for it: the tiles of block_q rows that overlap the
    band of rows that can see its keys (options.query_band, as in the kernel), so long sequences' diagonal blocks
    start early."""
    nq, nk = np.diff(cu_q), np.diff(cu_k)
    b = np.repeat(np.arange(nk.size), -(-nk // block_k))
    k0 = np.concatenate([np.arange(0, n, block_k) for n in nk]).astype(np.int64)
    nq_b = nq[b]
    off = nk[b] - nq_b if opt.align == "bottom_right" else 0  # query i sits at key position i + off
    extras = Extras(*opt.window, opt.align == "bottom_right")
    lo, hi = query_band(k0, k0 + block_k - 1, off, nq_b, extras.left, extras.right_bound(opt.causal))
    weight = tile_band(lo, hi, block_q)[2]
    order = np.argsort(-weight, kind="stable")
    return np.stack([b[order], k0[order]], axis=1).astype(np.int32)


def _strided(x, shape, strides):
    """A view of device array x with other shape and byte strides (no copy)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.lib.stride_tricks.as_strided(x._ary, shape, strides))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape, strides, x.dtype, stream=x.stream, gpu_data=x.gpu_data)


def heads_major(x):
    """(total, H, d) -> the kernels' (1, H, total, d); (H, total) lse -> (1, H, total)."""
    s = tuple(x.strides)
    if len(x.shape) == 2:
        return _strided(x, (1,) + tuple(x.shape), (s[0] * x.shape[0],) + s)
    t, h, d = x.shape
    return _strided(x, (1, h, t, d), (s[0] * t, s[1], s[0], s[2]))


def flash_attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                                    max_seqlen_k=None, causal=False, scale=None, window_size=(-1, -1),
                                    align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0,
                                    block_q=None, block_k=None, threads=None):
    """Gradients (dq, dk, dv) of flash_attention_varlen, packed like q, k, v, in one dkdv launch.

    q, o, do: (total_q, H, d); k, v: (total_k, H_kv, d), H_kv dividing H; lse: float32 (H, total_q) from the
    forward; cu_seqlens_*: (batch + 1,) integers (copied to the host to build the block table). NumPy arrays,
    numba device arrays or torch CUDA tensors, float32 or float16; the gradients come back in q's kind and
    dtype. Options as in flashlab.varlen (pass the forward's); block_q, block_k, threads: the register
    backward's tile (default: register_backward.default_config)."""
    library = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
                   dropout_p=dropout_p, seed=seed)
    dev, kinds = {}, {}
    for name, x in dict(q=q, k=k, v=v, o=o, lse=lse, do=do).items():
        dev[name], kinds[name] = to_device(x, name)
    shells = {n: shell(a, n) for n, a in dev.items()}
    cu_q, cu_k = to_host(cu_seqlens_q), to_host(cu_seqlens_k)
    # flashlab.varlen's checks, with its messages, on zero-size stand-ins (no device memory is read)
    _, _, _, cu_q, cu_k, opt = check_varlen(shells["q"], shells["k"], shells["v"], cu_q, cu_k, max_seqlen_q,
                                            max_seqlen_k, causal=causal, scale=scale, **library)
    Tq, H, d = shells["q"].shape
    want = shells["q"].shape[:-1] + shells["v"].shape[-1:]
    for name, shape in (("o", want), ("do", want), ("lse", (H, Tq))):
        if shells[name].shape != shape:
            raise ValueError(f"{name} must have shape {shape}; got {shells[name].shape}")
    view = {n: heads_major(a) for n, a in dev.items()}
    check_kernel_backward_inputs(*view.values(), causal=causal, scale=scale, gqa=True)  # dtypes, d
    n_seq = len(cu_q) - 1
    extras = Extras.from_options(opt, n_seq, H)
    features = extras.features() if extras is not None else Features()
    args = extras.arguments(opt.causal, n_seq, H, False) if extras is not None else plain_arguments(opt.causal)
    bq, bk, nt = register_backward.default_config(d, simulator=not has_gpu())
    bq, bk, nt = block_q or bq, block_k or bk, threads or nt
    Tk, H_kv = shells["k"].shape[:2]
    kernels = register_backward.make_kernels(d, bq, bk, nt, gqa=H_kv != H, features=features, varlen=True)

    kind, dtype = kinds["q"], np.dtype(dev["q"].dtype)
    new = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    half = dtype != np.float32
    dq_packed = new((Tq, H, d), np.float32)  # dQ's float32 accumulator (atomics), packed
    dq = new((Tq, H, d), dtype) if half else dq_packed
    dk, dv = new((Tk, H_kv, d), dtype), new((Tk, H_kv, d), dtype)
    table = key_blocks(cu_q, cu_k, bq, bk, opt)  # covers every key, so dk and dv are written everywhere
    described = register_backward.launches(kernels, 1, H, Tq, d, (len(table), H_kv, 1), nt, opt.scale, opt.causal,
                                            args, half, PREPROCESS_ROWS["gpu" if has_gpu() else "simulator"],
                                            tables=True)
    cuda = get_cuda()
    arrays = dict(view, dq=dq, dq_packed=dq_packed, dq_acc=heads_major(dq_packed), dk=heads_major(dk),
                  dv=heads_major(dv), D=new((1, H, Tq), np.float32), blocks=cuda.to_device(table),
                  cu=cuda.to_device(np.stack([cu_q, cu_k]).astype(np.int32)))
    if not half:
        arrays["dq"] = arrays["dq_acc"]  # float32: the accumulator is the result (heads-major for the kernels)
    # D and the accumulator are views made here (packed / heads-major), not the description's temporaries
    described._replace(temporaries={}).run(arrays, seed=np.int64(opt.seed))  # total_q, total_k >= 1
    return tuple(like_input(x, kind) for x in (dq, dk, dv))
