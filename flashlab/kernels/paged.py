"""Split-KV decoding over a paged KV cache, as a Numba-CUDA kernel (lessons 14 and 18).

The NumPy version, with the semantics, is `flashlab.decoding.paged_attention`: the keys of sequence b are
pages block_table[b, 0], block_table[b, 1], ... of k_cache (num_pages, page_size, H_kv, d), cache_seqlens[b]
keys in all, and the Nq queries are the sequence's last Nq positions (bottom-right alignment).

variant="register" runs kernels/decoding.py's split kernel (a K tile in shared memory, one score per thread, tree
reductions, O in registers), built with `paged=True` and `group` = H / H_kv, which change two of its steps:
- every key is found through the block table: key j of sequence b lives in page block_table[b, j // page_size],
  slot j % page_size;
- grid (n_splits, H_kv, B): under grouped-query attention one block serves all H / H_kv query heads of its K/V
  head, packed as rows (head g, query i) -> row g * Nq + i, so each K/V page is read once per K/V head, not once
  per query head. That is what makes GQA decoding cost about as much as decoding with H_kv heads.
Chunks past a sequence's end, and rows that see no key of a chunk (causal), leave an empty partial state
(m = -inf, l = 0); split_kv.py's merge kernel folds the chunks, and gives o = 0, lse = +inf to a row that saw
no key at all (the FA library's convention).

variant="tensor" (float16, the default on a GPU) runs the tensor-core forward kernel (kernels/tensor.py) in its
paged build instead. Under GQA the G query heads of a K/V head are G rows of one (batch, K/V head): a pure
reshape of q (B, H, Nq, d) -> (B, H_kv, G * Nq, d), so one 16-row mma tile holds the whole group, and the
tensor cores make the G rows cost what one row costs. This is how the FA library decodes under GQA. It runs
without causal masking, so it takes Nq = 1 (where causal changes nothing) or causal=False.
"""
from __future__ import annotations

import numpy as np

from .._inputs import check_block, check_options
from ..decoding import check_num_splits, check_paged, chunk_bounds, default_num_splits
from ..device import device_limits, get_cuda, has_gpu
from . import decoding, prepared, tensor
from ._launch import all_to_device_words, empty, like_input, run_all, to_device, to_host
from .decoding import default_threads

MAX_ROWS = 64  # (query heads per K/V head) x Nq rows per block


def _tensor_launches(B: int, H_kv: int, rows: int, d: int, page: int, pages: int, max_pages: int, scale,
                     num_splits):
    """The tensor variant's launches (tensor.paged_launches: the paged build, then the merge), for the general and
    the prepared path. One warp per 16 rows of the packed group; chunks from tensor_splits."""
    precision = tensor.resolve_precision("float16", None, device_limits()["cc"])
    # 16 keys a tile on sm_75 ("k8"), which copies through registers: 32 would spill
    tile = tensor.TensorTile(warps=-(-rows // 16), block_k=16 if precision == "k8" else 32).check(d, precision)
    splits = tensor_splits(num_splits, B * H_kv, max_pages * page)
    return tensor.paged_launches(B, H_kv, rows, d, page, pages, max_pages, splits, scale, tile, precision)


def _tensor(q, k_cache, v_cache, bt_host, sl_host, scale, num_splits):
    """The tensor-core paged build (kernels/tensor.py) on q viewed as (B, H_kv, G * Nq, d): one block per
    (16 * warps rows, batch, K/V head, key chunk); the merge kernel always runs (empty rows: o = 0, lse = inf).
    Returns (run, o, lse, kind): run() launches both kernels on the prepared arrays, again when called again
    (benchmarks time it apart from the checks and copies of a call, as forward.prepare does)."""
    (q_w, k_w, v_w), kind, _ = all_to_device_words((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
    B, H, Nq, W = q_w.shape
    pages, page, H_kv, _ = k_w.shape
    described = _tensor_launches(B, H_kv, H // H_kv * Nq, 2 * W, page, pages, bt_host.shape[1], scale, num_splits)
    meta = np.zeros((B, 1 + bt_host.shape[1]), np.int32)  # the kernel's n_k: seqlens, then the block table
    meta[:, 0], meta[:, 1:] = sl_host, bt_host
    new = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    o, lse = new((B, H, Nq, 2 * W), np.float16), new((B, H, Nq), np.float32)
    cuda = get_cuda()
    arrays = {"q": q_w, "k_cache": k_w, "v_cache": v_w, "o": o, "lse": lse, "meta": cuda.to_device(meta)}
    arrays.update({name: cuda.to_device(x) for name, x in described.host.items()})
    # each chunk's normalised output and lse, allocated once for every run()
    arrays.update({name: new(shape, dt) for name, (shape, dt) in described.temporaries.items()})

    def run():
        run_all(described.launches, arrays)

    return run, o, lse, kind


def tensor_splits(num_splits, batch_heads: int, capacity: int) -> int:
    """The tensor variant's key chunks per (batch, K/V head). Each block cuts its own sequence's cache_seqlens[b]
    keys into that many chunks, so the count depends only on shapes: capacity = max_pages * page_size (what the
    block table can hold), never on the lengths, which stay on the GPU in a decoding loop."""
    if num_splits is None:  # one warp per block: about 4 blocks per SM keep enough bytes in flight (H100 sweep)
        num_splits = max(1, min(-(-4 * device_limits()["sms"] // batch_heads), capacity // 256))
    return check_num_splits(num_splits, max(capacity, 1))


def register_chunks(num_splits, batch_heads: int, capacity: int) -> tuple:
    """(n_splits, chunk) of the register variant: fixed chunks of the capacity, as tensor_splits; a chunk past a
    sequence's end is empty (the merge gives it no weight)."""
    capacity = max(capacity, 1)
    if num_splits is None:
        num_splits = default_num_splits(batch_heads, capacity, n_sm=device_limits()["sms"])
    bounds = chunk_bounds(capacity, check_num_splits(num_splits, capacity))
    return len(bounds), bounds[0][1] - bounds[0][0]


def prepare(q, k_cache, v_cache, block_table, cache_seqlens, *, scale=None, num_splits=None):
    """Everything paged_decoding(..., variant="tensor") does before its launches: checks, copies, buffers.
    Returns (run, o, lse): run() launches the kernels and fills o and lse (device arrays; torch tensors for
    torch inputs). For benchmarks: timing run() leaves out the host work of a call."""
    _, _, bt_host, sl_host, opt, _ = _check(q, k_cache, v_cache, block_table, cache_seqlens, False, scale, "tensor")
    run, o, lse, kind = _tensor(q, k_cache, v_cache, bt_host, sl_host, opt.scale, num_splits)
    return run, *((like_input(x, kind) if kind == "torch" else x) for x in (o, lse))


def _shell(x):
    """An empty NumPy array of x's shape and dtype, for the shape checks (nothing is copied)."""
    return np.empty(tuple(x.shape), np.dtype(str(x.dtype).replace("torch.", "")))


def _check(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, variant):
    """The checks of paged_decoding: (q's shape, G, block_table and cache_seqlens on the host, options,
    the variant that will run)."""
    shells = [_shell(x) for x in (q, k_cache, v_cache)]
    qs, ks, _, bt_host, sl_host = check_paged(*shells, to_host(block_table), to_host(cache_seqlens))
    B, H, Nq, d = qs.shape
    H_kv = ks.shape[2]
    if H % H_kv:
        raise ValueError(f"q has H = {H} heads and the caches H_kv = {H_kv}: H_kv must divide H")
    if v_cache.shape[-1] != d or d not in (16, 32, 64, 128):
        raise ValueError(f"the paged kernel needs d in (16, 32, 64, 128) for q and both caches; got q d = {d}, "
                         f"v_cache d = {v_cache.shape[-1]}")
    G = H // H_kv
    if variant not in (None, "register", "tensor"):
        raise ValueError(f"variant must be None, 'register' or 'tensor'; got {variant!r}"
                         + (" (the wgmma kernel has no paged build: variant='tensor' reads a paged cache on tensor "
                            "cores)" if variant == "wgmma" else ""))
    tensor_ok = str(qs.dtype) == "float16" and (Nq == 1 or not causal)
    if variant == "tensor" and not tensor_ok:
        raise ValueError(f"variant='tensor' takes float16 inputs with Nq = 1 or causal=False; got {qs.dtype}, "
                         f"Nq = {Nq}, causal={causal}")
    if G * Nq > MAX_ROWS:
        raise ValueError(f"(H / H_kv) * Nq = {G} * {Nq} = {G * Nq} rows; the paged kernel takes at most {MAX_ROWS}")
    opt = check_options(qs.shape, causal=causal, scale=scale)
    variant = variant or ("tensor" if tensor_ok and has_gpu() else "register")
    return qs.shape, G, bt_host, sl_host, opt, variant


def paged_decoding(q, k_cache, v_cache, block_table, cache_seqlens, *, causal=False, scale=None, num_splits=None,
                   threads=None, variant=None, check_tables=True):
    """`flashlab.decoding.paged_attention` on the GPU (or the simulator). Returns (o, lse).

    q: (B, H, Nq, d); k_cache, v_cache: (num_pages, page_size, H_kv, d) with H_kv dividing H; float32 or
    float16, d in (16, 32, 64, 128); block_table (B, max_pages) and cache_seqlens (B,) integers. NumPy arrays,
    numba device arrays or torch CUDA tensors. (H / H_kv) * Nq must be at most MAX_ROWS. num_splits: key chunks
    per (batch, K/V head), by default enough to fill the GPU for max_pages * page_size keys (the lengths are not
    read on the host). threads: the register kernel's block size. variant: "register" (the split kernel above),
    "tensor" (float16 only; Nq = 1 or causal=False) or None: "tensor" where it applies on a GPU, else "register".
    The NumPy version's window_size, alibi_slopes and softcap are not in these kernels yet.

    Torch CUDA tensors (q and the caches contiguous) take a prepared path after the first call with their
    shapes, as the forward does (kernels/prepared.py): the block table and the lengths stay on the GPU. check_tables
    then checks their values there (cache_seqlens in range, the pages in use in [0, num_pages)) with one
    synchronisation, and on a bad value raises the same error as the host check. check_tables=False skips it,
    as the FA library does: a decoding loop then never waits for the GPU, and a bad page index reads the wrong
    memory.
    """
    key = _prepared_key(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, num_splits, threads, variant)
    if key is not None:
        call = prepared.lookup(key)
        if call is None:
            checked = _check(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, variant)
            call = prepared.store(key, PreparedPaged(q, k_cache, v_cache, block_table, checked, num_splits, threads))
        elif check_tables and not call.tables_ok(block_table, cache_seqlens):
            _check(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, variant)  # raises, naming the value
            raise AssertionError("the device check of the tables disagrees with the host's")
        return call(q, k_cache, v_cache, block_table, cache_seqlens)

    (B, H, Nq, d), G, bt_host, sl_host, opt, variant = _check(q, k_cache, v_cache, block_table, cache_seqlens,
                                                              causal, scale, variant)
    H_kv = H // G
    if variant == "tensor":
        if threads is not None:
            raise ValueError("threads sets the register kernel's block; the tensor variant chooses its own")
        run, o, lse, kind = _tensor(q, k_cache, v_cache, bt_host, sl_host, opt.scale, num_splits)
        run()
        return like_input(o, kind), like_input(lse, kind)
    threads = register_threads(threads, G * Nq)
    n_splits, chunk = register_chunks(num_splits, B * H_kv, bt_host.shape[1] * k_cache.shape[1])

    (q_d, kind), (k_d, _), (v_d, _) = to_device(q, "q"), to_device(k_cache, "k_cache"), to_device(v_cache, "v_cache")
    new = lambda shape, dt: empty(shape, dt, kind, like=q)  # noqa: E731
    o, lse = new((B, H, Nq, d), q_d.dtype), new((B, H, Nq), np.float32)
    described = decoding.launches(decoding.build(d, Nq, threads, group=G, paged=True), B, H, H_kv, Nq, d, n_splits,
                                  chunk, threads, opt.scale, paged=True, causal=opt.causal)
    tables = {"block_table": np.ascontiguousarray(bt_host, dtype=np.int32),
              "seqlens": np.ascontiguousarray(sl_host, dtype=np.int32)}
    described._replace(host=tables).run(dict(q=q_d, k=k_d, v=v_d, o=o, lse=lse), new)
    return like_input(o, kind), like_input(lse, kind)


def register_threads(threads, rows: int) -> int:
    """The register kernel's block size: `threads`, or the default, checked against the block's rows."""
    threads = check_block(threads, "threads") or default_threads()
    rows_pow2 = 1 << (rows - 1).bit_length()
    if not rows_pow2 <= threads <= 1024:
        raise ValueError(f"threads must be between {rows_pow2} ((H / H_kv) * Nq rounded up to a power of two) "
                         f"and 1024; got {threads}")
    return threads


def _prepared_key(q, k_cache, v_cache, block_table, cache_seqlens, *parts):
    """The prepared call's key (shapes, strides, dtypes and options; not the tables' values), or None for the
    general path: inputs that are not all torch CUDA tensors, or non-contiguous q or caches."""
    key = prepared.prepared_key("paged", (q, k_cache, v_cache, block_table, cache_seqlens), *parts, options={})
    if key is None or not all(x.is_contiguous() for x in (q, k_cache, v_cache, block_table)):
        return None
    return key


class PreparedPaged:
    """paged_decoding for torch CUDA tensors of one key: the variant's launch description (tensor.paged_launches or
    decoding.launches) prepared once (prepared.PreparedLaunches.of); a call allocates the outputs with torch and
    launches. The block table and the
    lengths are read where they are, on the GPU: the tensor variant gets them as one int32 array (lengths, then
    the table: two small copies on the GPU), the register variant as int32 arrays."""

    def __init__(self, q, k_cache, v_cache, block_table, checked, num_splits, threads):
        import torch  # optional: only torch tensors come here

        S = prepared.Spec.contiguous
        (B, H, Nq, d), G, _, _, opt, self.variant = checked
        pages, page, H_kv, _ = k_cache.shape
        max_pages, rows = block_table.shape[1], G * Nq
        self.dtype, self.pages, self.page, self.capacity = q.dtype, pages, page, max_pages * page
        self.cols = torch.arange(max_pages, device=q.device)
        self.shapes = (B, H, Nq, d), (B, H, Nq)
        if self.variant == "tensor":
            if threads is not None:
                raise ValueError("threads sets the register kernel's block; the tensor variant chooses its own")
            all_to_device_words((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))  # its dtype checks
            described = _tensor_launches(B, H_kv, rows, d, page, pages, max_pages, opt.scale, num_splits)
            self.meta_shape = (B, 1 + max_pages)
            specs = {name: prepared.torch_spec(x) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))}
            specs.update(o=S((B, H, Nq, d), np.float16), lse=S((B, H, Nq), np.float32))
            specs["meta"] = S(self.meta_shape, np.int32)
            self.launches = prepared.PreparedLaunches.of(described, specs, ("q", "k_cache", "v_cache", "o", "lse",
                                                                            "meta"), q.device)
        else:
            threads = register_threads(threads, rows)
            n_splits, chunk = register_chunks(num_splits, B * H_kv, self.capacity)
            described = decoding.launches(decoding.build(d, Nq, threads, group=G, paged=True), B, H, H_kv, Nq, d,
                                          n_splits, chunk, threads, opt.scale, paged=True, causal=opt.causal)
            specs = {name: prepared.torch_spec(x) for name, x in (("q", q), ("k", k_cache), ("v", v_cache))}
            specs.update(o=S((B, H, Nq, d), specs["q"].dtype), lse=S((B, H, Nq), np.float32),
                         block_table=S((B, max_pages), np.int32), seqlens=S((B,), np.int32))
            self.launches = prepared.PreparedLaunches.of(described, specs, ("q", "k", "v", "o", "lse", "block_table",
                                                                            "seqlens"), q.device)

    def tables_ok(self, block_table, cache_seqlens) -> bool:
        """check_paged's value checks, on the GPU: one synchronisation (.item()) and no copy of the tables."""
        import torch  # optional: only torch tensors come here

        sl = cache_seqlens.to(torch.int64)
        used = self.cols < ((sl + self.page - 1) // self.page)[:, None]  # the pages that hold keys
        bad = ((sl < 0) | (sl > self.capacity)).any() | (used & ((block_table < 0) | (block_table >= self.pages))).any()
        return not bad.item()

    def __call__(self, q, k_cache, v_cache, block_table, cache_seqlens):
        import torch  # optional: only torch tensors come here

        stream, dev = prepared.current_stream(q), q.device
        new = lambda shape, dt=torch.float32: torch.empty(shape, dtype=dt, device=dev)  # noqa: E731
        o, lse = new(self.shapes[0], self.dtype), new(self.shapes[1])
        if self.variant == "tensor":
            meta = new(self.meta_shape, torch.int32)
            meta[:, 0], meta[:, 1:] = cache_seqlens, block_table
            self.launches(stream, (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                   meta.data_ptr()), dev)
        else:
            bt, sl = (x.to(torch.int32).contiguous() for x in (block_table, cache_seqlens))
            self.launches(stream, (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                   bt.data_ptr(), sl.data_ptr()), dev)
        return o, lse
