"""flash_attention_varlen on the GPU: one launch of the register or tensor-core kernel over a packed batch
(lesson 18).

The NumPy version, with the semantics, is `flashlab.varlen.flash_attention_varlen`: sequence b owns rows
cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q (total_q, H, d) and rows cu_seqlens_k[b] .. of k, v
(total_k, H_kv, d), and attends to its own keys only. Looping over the sequences would launch B small grids,
each too small to fill the GPU; padding to the longest would compute on padding. Here the host lists every
query block of every sequence in one table, (sequence, first row), heaviest first (the blocks that visit the
most key tiles start first, so long sequences do not finish last), and register.build(varlen=True) (or
tensor.build(varlen=True)) launches one block per entry and head: grid (table rows, H).
"""
from __future__ import annotations

import numpy as np

from .._inputs import check_seed
from ..device import device_limits, get_cuda
from ..varlen import check_varlen
from . import plan as planner
from . import prepared, register, tensor
from ._launch import all_to_device_words, empty, empty_words, like_input, run_all, shell, to_device, to_host
from .backward import default_variant
from .options import Extras, key_band, tile_band


def block_table(cu_q, cu_k, block_q: int, block_k: int, causal: bool, bottom_right: bool = False,
                window=(-1, -1)) -> np.ndarray:
    """int32 (n_blocks, 2): (sequence, first row) of every query block of every sequence, heaviest first.

    A block's weight is the number of key tiles it visits: those overlapping the band of its rows (options.key_band,
    as the kernels compute it: all keys, causal's triangle aligned top-left or bottom-right, or the window).
    Vectorised: it runs on every call, and batches can hold thousands of sequences."""
    cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    nq, nk = np.diff(cu_q), np.diff(cu_k)
    blocks = -(-nq // block_q)
    b = np.repeat(np.arange(nq.size), blocks)
    q0 = (np.arange(b.size) - np.repeat(np.cumsum(blocks) - blocks, blocks)) * block_q
    off = (nk - nq)[b] if bottom_right else 0
    ex = Extras(int(window[0]), int(window[1]))
    lo, hi = key_band(q0 + off, q0 + block_q - 1 + off, nk[b], ex.left, ex.right_bound(causal))
    weight = tile_band(lo, hi, block_k)[2]
    order = np.argsort(-weight, kind="stable")  # stable: equal weights keep sequence order
    return np.stack([b[order], q0[order]], axis=1).astype(np.int32).reshape(-1, 2)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """`flashlab.flash_attention_varlen` in one kernel launch. Returns (o, lse). See prepare for the arguments.

    Torch CUDA tensors take kernels/prepared.py's prepared path: the first call with given shapes, offsets and
    options (all but the dropout seed, which each launch takes) does the checks, plan, block table and its copy
    to the GPU and keeps them; a later call with the same ones only allocates the outputs and launches."""
    key = None
    if prepared.available():  # the prepared path's key holds the offsets themselves
        cu_q, cu_k = to_host(cu_seqlens_q), to_host(cu_seqlens_k)
        key = prepared.prepared_key("varlen", (q, k, v), cu_q.dtype.str, cu_q.tobytes(), cu_k.dtype.str, cu_k.tobytes(),
                                 options=options)
    if key is not None:
        call = prepared.lookup(key)
        if call is None:
            call = prepared.store(key, PreparedVarlen(q, k, v, cu_seqlens_q, cu_seqlens_k, options))
        return call(q, k, v, check_seed(options.get("seed", 0)))
    run, o, lse, kind = prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    run()
    return like_input(o, kind), like_input(lse, kind)


class PreparedVarlen:
    """One varlen launch for torch tensors of one key: the kernel module's launch description (register.py or
    tensor.py: varlen_launches), prepared once (prepared.PreparedLaunches), with the block table, offsets and
    option arrays kept on the GPU."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, options):
        _, described = _setup(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
        total_q, H, d = q.shape
        self.shapes, self.dtype, self.launches = ((total_q, H, d), (H, total_q)), q.dtype, None
        if described is None:  # no query rows
            return
        specs = {name: prepared.torch_spec(x) for name, x in (("q", q), ("k", k), ("v", v))}
        specs["o"] = prepared.Spec.contiguous((total_q, H, d), specs["q"].dtype)
        specs["lse"] = prepared.Spec.contiguous((H, total_q), np.float32)
        self.launches = prepared.PreparedLaunches.of(described, specs, ("q", "k", "v", "o", "lse"), q.device)

    def __call__(self, q, k, v, seed=0):
        import torch  # optional: only torch tensors come here

        o = torch.empty(self.shapes[0], dtype=self.dtype, device=q.device)
        lse = torch.empty(self.shapes[1], dtype=torch.float32, device=q.device)
        if self.launches is not None:  # no query rows: nothing to launch
            self.launches(prepared.current_stream(q), (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                                       lse.data_ptr()), q.device, seed)
        return o, lse


def prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Everything flash_attention_varlen does before the launch (checks, plan, the block table, copies of the
    tables to the device, the outputs): returns (run, o, lse, kind), where run() launches the kernel on them and
    can be called again (benchmarks time it alone, without the host's work per call), o and lse are device arrays
    and kind says how the inputs came, for _launch.like_input. The arguments are _setup's."""
    (q_d, k_d, v_d, o, o_words, lse, kind), described = _setup(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    run = lambda: None  # noqa: E731 (no query rows: nothing to launch)
    if described is not None:
        cuda = get_cuda()
        arrays = {"q": q_d, "k": k_d, "v": v_d, "o": o_words, "lse": lse}
        arrays.update({name: cuda.to_device(x) for name, x in described.host.items()})
        run = lambda: run_all(described.launches, arrays, seed=np.int64(options.get("seed", 0)))  # noqa: E731
    return run, o, lse, kind


def _setup(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None,
           window_size=(-1, -1), align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0,
           variant=None, precision=None, block_q=None, block_k=None):
    """The checks, plan and block table: ((q, k, v as device arrays, o, o's 32-bit words (tensor variant) or o,
    lse, kind), the kernel module's Launches, or None when there are no query rows).

    q: (total_q, H, d); k, v: (total_k, H_kv, d) with H_kv dividing H; NumPy arrays, numba device arrays or
    torch CUDA tensors (the outputs come back the same way). cu_seqlens_q, cu_seqlens_k: (batch + 1,) integers
    from 0 to the packed lengths. o: (total_q, H, d); lse: (H, total_q) float32, the FA library's varlen layout.
    Options as in flash_attention (alibi_slopes (H,) or (batch, H)). variant: "register" (float32, float16) or
    "tensor" (float16, bfloat16, float32 through 3xTF32, with `precision` as in flash_attention); by default
    "tensor" for 16-bit inputs on a GPU with their mma, as the backward's default_variant. block_q / block_k
    override the tile."""
    variant = default_variant(q) if variant is None else variant
    if variant not in ("register", "tensor"):
        raise ValueError(f"variant must be 'register' or 'tensor' for varlen; got {variant!r}"
                         + (" (the wgmma kernel reads whole (B, H, N, d) inputs through TMA and has no varlen build: "
                            "variant='tensor' runs 16-bit varlen batches on tensor cores)" if variant == "wgmma" else ""))
    if variant == "tensor":
        (q_d, k_d, v_d), kind, dtype = all_to_device_words((("q", q), ("k", k), ("v", v)), "(total, heads, d)")
        words = 1 if dtype == "float32" else 2  # values per 32-bit word of the last axis
    else:
        if precision is not None:
            raise ValueError(f"precision applies to variant='tensor' only; got precision={precision!r}")
        (q_d, kind), (k_d, _), (v_d, _) = to_device(q, "q"), to_device(k, "k"), to_device(v, "v")
        dtype, words = np.dtype(q_d.dtype).name, 1
        if dtype not in ("float32", "float16"):
            raise TypeError(f"q has dtype {dtype}; the register varlen kernel takes float32 or float16")
    for name, x in (("q", q_d), ("k", k_d), ("v", v_d)):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must have shape (total, heads, d) for varlen; got shape {tuple(x.shape)}")
    cu_q, cu_k = to_host(cu_seqlens_q), to_host(cu_seqlens_k)
    # the NumPy version's checks (shapes, dtypes, heads, lengths, options), on empty stand-ins of the inputs
    kw = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
              dropout_p=dropout_p, seed=seed)
    shells = [shell(x, n) for x, n in ((q_d, "q"), (k_d, "k"), (v_d, "v"))]
    if words == 2:  # 16-bit values as uint32 pairs: stand-ins with the values' last axis
        shells = [np.broadcast_to(np.float16(0), (*x.shape[:-1], 2 * x.shape[-1])) for x in shells]
    _, _, _, cu_q, cu_k, opt = check_varlen(*shells, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                            scale=scale, **kw)
    total_q, H, d = q_d.shape[0], q_d.shape[1], words * q_d.shape[2]
    n_seq, H_kv = len(cu_q) - 1, k_d.shape[1]
    if d not in (16, 32, 64, 128) or words * v_d.shape[2] != d:
        raise ValueError(f"the varlen kernels take d in (16, 32, 64, 128), the same for q, k and v; got q's d = {d}, "
                         f"v's d = {words * v_d.shape[2]}")
    longest_q, longest_k = int(np.diff(cu_q).max(initial=0)), int(np.diff(cu_k).max(initial=0))
    extras = Extras.from_options(opt, n_seq, H)
    if variant == "tensor":
        precision = tensor.resolve_precision(dtype, precision, device_limits()["cc"])
    p = planner.plan((n_seq, H, max(longest_q, 1), max(longest_k, 1), d), causal=opt.causal, dtype=dtype,
                     variant=variant, block_q=block_q, block_k=block_k, precision=precision,
                     extras=tensor.library_weight(dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes,
                                                    softcap=softcap, dropout_p=dropout_p)), varlen=True)
    tile = p.config
    table = block_table(cu_q, cu_k, tile.block_q, tile.block_k, opt.causal, opt.align == "bottom_right",
                        opt.window)
    if variant == "tensor":
        o, o_words = empty_words((total_q, H, d), dtype, kind, like=q)
    else:
        o = o_words = empty((total_q, H, d), q_d.dtype, kind, like=q)
    lse = empty((H, total_q), np.float32, kind, like=q)
    arrays, described = (q_d, k_d, v_d, o, o_words, lse, kind), None
    if len(table):
        cu = np.stack([cu_q, cu_k]).astype(np.int32)
        if variant == "tensor":
            described = tensor.varlen_launches(H, H_kv, d, table, cu, opt.scale, opt.causal, tile, p.precision, extras)
        else:
            described = register.varlen_launches(H, H_kv, d, table, cu, opt.scale, opt.causal, tile, extras)
    return arrays, described
