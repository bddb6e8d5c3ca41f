"""Variable-length batches ("varlen"), as in the FlashAttention library's flash_attn_varlen_func.

Sequences of different lengths are packed one after another, without padding: q of shape (total_q, H, d)
holds sequence b in rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1, and likewise k and v (total_k, H_kv, d)
with cu_seqlens_k. Each sequence attends only to its own keys. This NumPy version loops over the sequences
and runs the same FA2 code (flashlab.tiled) on each, so the algorithm lives in one place; a GPU kernel
instead launches one grid over all sequences and reads cu_seqlens to find its rows.

lse has shape (H, total_q), the FA library's layout for varlen (its flash_attn_varlen_func returns
softmax_lse of shape (nheads, total_q)). The dropout key's batch index is the sequence index.
"""
from __future__ import annotations

import numpy as np

from ._inputs import as_float_array, check_attention_inputs, check_options
from .iomodel import NO_IO
from .tiled import _blocks, _fa2_backward, _fa2_forward


def check_cu_seqlens(cu, name: str, total: int) -> np.ndarray:
    """cu_seqlens: 1-D integers, starting at 0, non-decreasing, ending at the number of packed rows."""
    arr = np.asarray(cu)
    if arr.ndim != 1 or arr.size < 2 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array [0, ..., total] of length batch + 1; "
                         f"got {arr.dtype} array of shape {arr.shape}")
    if arr[0] != 0 or np.any(np.diff(arr) < 0) or arr[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at {total} (the packed length); "
                         f"got {arr.tolist()}")
    return arr.astype(np.int64)


def _check_max(value, name, lengths):
    if value is not None and (not isinstance(value, (int, np.integer)) or value < lengths.max(initial=0)):
        raise ValueError(f"{name} must be an int >= the longest sequence ({lengths.max(initial=0)}); got {value!r}")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                 scale=None, **options):
    """Check a packed batch once, for every implementation of varlen (this module; the kernels call it on
    zero-size stand-ins of their device arrays): shapes, dtypes, heads, cu_seqlens, max_seqlen_* and the options.
    Returns (q, k, v, cu_q, cu_k, opt): the arrays, cu_seqlens as int64 and the batch's checked AttentionOptions
    (alibi (H,) or (batch, H); the sequence index is the batch index). Its cost does not grow with the batch."""
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape (total, heads, d) for varlen; got shape {x.shape}")
    # check heads, d and dtypes on one sequence-shaped view (1, H, N, d)
    _, _, _, causal, scale = check_attention_inputs(*(x.transpose(1, 0, 2)[None] for x in (q, k, v)),
                                                    causal=causal, scale=scale, gqa=True)
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; "
                         f"got {cq.size - 1} and {ck.size - 1}")
    _check_max(max_seqlen_q, "max_seqlen_q", np.diff(cq))
    _check_max(max_seqlen_k, "max_seqlen_k", np.diff(ck))
    n_seq, heads = cq.size - 1, q.shape[1]
    slopes = options.get("alibi_slopes")
    if slopes is not None and np.shape(slopes) not in ((heads,), (n_seq, heads)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({heads},) or (batch, H) = ({n_seq}, {heads}) "
                         f"for varlen; got {np.shape(slopes)}")
    opt = check_options((n_seq, heads, 1, q.shape[-1]), causal=causal, scale=scale, **options)
    return q, k, v, cq, ck, opt


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kw):
    """check_varlen, then each sequence's rows, (1, heads, n_b, d) views and options (its own ALiBi slopes)."""
    q, k, v, cq, ck, opt = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        causal=causal, scale=scale, **kw)
    n_seq, heads = cq.size - 1, q.shape[1]
    slopes = None if opt.alibi is None else np.broadcast_to(opt.alibi, (n_seq, heads))
    seqs = []
    for b in range(n_seq):
        view = lambda x, c: x[c[b]:c[b + 1]].transpose(1, 0, 2)[None]  # noqa: E731  (1, heads, n_b, d), a view
        opt_b = opt._replace(alibi=None if slopes is None else slopes[b])
        seqs.append((slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]), view(q, cq), view(k, ck), view(v, ck), opt_b))
    return q, k, v, seqs


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, scale=None, window_size=(-1, -1), align="top_left", alibi_slopes=None,
                           softcap=0.0, dropout_p=0.0, seed=0, block_q=None, block_k=None):
    """Attention over packed sequences. q: (total_q, H, d); k, v: (total_k, H_kv, d), H_kv dividing H.
    Returns (o, lse): o of shape (total_q, H, dv), lse of shape (H, total_q). Options as in
    reference_attention; alibi_slopes (H,) or (batch, H). max_seqlen_*: optional, checked if given."""
    kw = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
              dropout_p=dropout_p, seed=seed)
    q, k, v, seqs = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kw)
    o = np.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), np.inf, np.float64 if q.dtype == np.float64 else np.float32)
    for b, (rq, rk, qs, ks, vs, opt) in enumerate(seqs):
        if qs.shape[-2] == 0:
            continue
        if ks.shape[-2] == 0:  # no keys: every row is empty (o = 0, lse = +inf)
            continue
        o_b, lse_b = _fa2_forward(qs, ks, vs, opt, *_blocks(qs, vs, block_q, block_k, NO_IO), batch_offset=b)
        o[rq] = o_b[0].transpose(1, 0, 2)
        lse[:, rq] = lse_b[0]
    return o, lse


def flash_attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                                    max_seqlen_k=None, causal=False, scale=None, window_size=(-1, -1),
                                    align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0,
                                    block_q=None, block_k=None):
    """Backward of flash_attention_varlen (same options). Returns (dq, dk, dv) in the packed layouts."""
    kw = dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes, softcap=softcap,
              dropout_p=dropout_p, seed=seed)
    q, k, v, seqs = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, kw)
    o, do, lse = as_float_array(o, "o"), as_float_array(do, "do"), as_float_array(lse, "lse")
    want = q.shape[:-1] + (v.shape[-1],)
    for name, x, shape in (("o", o, want), ("do", do, want), ("lse", lse, (q.shape[1], q.shape[0]))):
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}; got {x.shape}")
    if np.any(np.isnan(lse) | np.isneginf(lse)):
        raise ValueError("lse contains inf or NaN; pass the lse returned by the forward pass "
                         "(+inf is allowed: it marks a row that sees no key)")
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b, (rq, rk, qs, ks, vs, opt) in enumerate(seqs):
        if qs.shape[-2] == 0 or ks.shape[-2] == 0:
            continue
        seq = lambda x: x[rq].transpose(1, 0, 2)[None]  # noqa: E731
        grads = _fa2_backward(qs, ks, vs, seq(o), lse[:, rq][None], seq(do), opt,
                              *_blocks(qs, vs, block_q, block_k, NO_IO, backward=True), batch_offset=b)
        for out, g, r in zip((dq, dk, dv), grads, (rq, rk, rk)):
            out[r] = g[0].transpose(1, 0, 2)
    return dq, dk, dv
