"""Split-KV attention for decoding ("Flash-Decoding", lesson 14), in NumPy.

When a model generates text it attends with one new query (or a few) to a long KV cache: Nq is 1 to a
handful, Nk is thousands. FlashAttention-2 parallelises over query blocks, so with one query it has one
block per (batch, head) and most of a GPU sits idle. Split-KV attention parallelises over the keys:

1. split the Nk keys into chunks c = 0 .. n_splits-1 (the last chunk may be shorter);
2. for each chunk, independently, compute the partial state of every query row
       m_c = max_j S_j,   l_c = sum_j exp(S_j - m_c),   O_c = sum_j exp(S_j - m_c) V_j   (j in chunk c)
   with O_c left unnormalised, as FA2 keeps O_i inside its loop;
3. merge the partial states: the (m, l) half is `softmax.merge_softmax_states`, and O is rescaled by the
   same factor exp(m_c - m) as l. At the end o = O / l and lse = m + log(l).

The same three steps run as a Numba kernel in `flashlab.kernels.decoding` (one thread block per chunk,
then a merge kernel). `default_num_splits` picks the number of chunks for both; `split_waves` and
`model_time_us` are lesson 14's bandwidth model of what a split count costs on a GPU.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._inputs import as_float_array, check_attention_inputs, check_options, compute_dtype
from .iomodel import NO_IO
from .softmax import merge_softmax_states
from .tiled import _group, _Masking

MIN_CHUNK = 64  # fewer keys per chunk than this and the merge costs more than the extra parallelism saves


def check_num_splits(num_splits, nk: int, batch_heads: int = 1) -> int:
    """None -> default_num_splits(batch_heads, Nk); else an int in 1..Nk (a chunk needs at least one key)."""
    if num_splits is None:
        return default_num_splits(batch_heads, nk)
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be a positive integer or None; got {num_splits!r} "
                        f"of type {type(num_splits).__name__}")
    if not 1 <= num_splits <= nk:
        raise ValueError(f"num_splits must be between 1 and Nk = {nk} (each chunk needs a key); got {num_splits}")
    return int(num_splits)


def chunk_bounds(nk: int, num_splits: int):
    """[(start, stop)] of the key chunks: ceil(Nk / num_splits) keys each, the last one possibly shorter.

    There are ceil(Nk / chunk) chunks, which can be fewer than num_splits (Nk=9, num_splits=4 -> chunks of
    3: three chunks), so no chunk is ever empty.
    """
    chunk = math.ceil(nk / num_splits)
    return [(s, min(s + chunk, nk)) for s in range(0, nk, chunk)]


def default_num_splits(batch_heads: int, nk: int, n_sm: int = 132, min_chunk: int = MIN_CHUNK) -> int:
    """Enough chunks that batch*heads*chunks thread blocks fill every SM about twice, but chunks of at
    least `min_chunk` keys. (The Flash-Decoding post describes the same trade-off; this rule is ours.)"""
    want = math.ceil(2 * n_sm / max(batch_heads, 1))
    return max(1, min(want, nk // min_chunk))


def split_waves(batch_heads, splits, n_sm=132, blocks_per_sm=1):
    """(blocks, waves): the split kernel's grid has batch_heads * splits blocks; the GPU runs at most
    n_sm * blocks_per_sm of them at once, so they go through in ceil(blocks / (n_sm * blocks_per_sm)) waves.
    Works elementwise on arrays of split counts."""
    blocks = batch_heads * np.asarray(splits)
    return blocks, -(-blocks // (n_sm * blocks_per_sm))


def model_time_us(batch_heads, nk, d, splits, n_sm=132, bandwidth=3.35e12, itemsize=2, blocks_per_sm=1):
    """Lesson 14's model of the split-KV time (µs), for one query per head: a sketch, not a measurement.

    Every resident block streams its chunk's K and V rows (2 * d * itemsize bytes per key) at an equal share
    of the bandwidth, bandwidth / (n_sm * blocks_per_sm); blocks run in waves (split_waves); then the merge
    writes and reads every chunk's state (d + 2 float32 numbers). Chunks are sized as in chunk_bounds.
    Ignores launch overhead, latency and caches. Works elementwise on arrays of split counts.
    """
    splits = np.asarray(splits)
    chunk = -(-nk // splits)
    n_chunks = -(-nk // chunk)  # chunk_bounds may need fewer chunks than asked for
    _, waves = split_waves(batch_heads, n_chunks, n_sm, blocks_per_sm)
    stream = waves * chunk * 2 * d * itemsize / (bandwidth / (n_sm * blocks_per_sm))
    merge = batch_heads * n_chunks * (d + 2) * 4 * 2 / bandwidth
    return (stream + merge) * 1e6


def chunk_partial(q, k_c, v_c, scale):
    """Step 2 for one chunk: (m, l, O) of every query row over the keys k_c, v_c, in q's compute dtype.

    q: (..., Nq, d), k_c: (..., n, d), v_c: (..., n, dv). m, l: (..., Nq); O: (..., Nq, dv), unnormalised.
    """
    ct = compute_dtype(q.dtype)
    S = (q.astype(ct) @ np.swapaxes(k_c.astype(ct), -1, -2)) * ct.type(scale)
    m = S.max(axis=-1)
    P = np.exp(S - m[..., None])
    return m, P.sum(axis=-1), P @ v_c.astype(ct)


def merge_states(m_a, l_a, O_a, m_b, l_b, O_b):
    """Merge the (m, l, O) states of two disjoint key chunks into the state of their union.

    (m, l) merge as in `merge_softmax_states`; O is rescaled by the same factors exp(m_a - m), exp(m_b - m).
    An empty chunk (m = -inf, l = 0, O = 0) merges as the identity.
    """
    m, l = merge_softmax_states(m_a, l_a, m_b, l_b)
    m_safe = np.where(np.isneginf(m), 0, m)
    O = np.exp(m_a - m_safe)[..., None] * O_a + np.exp(m_b - m_safe)[..., None] * O_b
    return m, l, O


def merge_partials(m, l, O):
    """Step 3: fold the per-chunk states into (o, lse).

    m, l: (..., n_splits, Nq); O: (..., n_splits, Nq, dv) (the chunk axis is the one before Nq).
    Returns o = O / l (..., Nq, dv) and lse = m + log(l) (..., Nq).
    """
    m, l, O = np.asarray(m), np.asarray(l), np.asarray(O)
    if m.ndim < 2 or m.shape != l.shape or O.shape[:-1] != m.shape:
        raise ValueError(f"expected m, l of shape (..., n_splits, Nq) and O of shape (..., n_splits, Nq, dv); "
                         f"got m {m.shape}, l {l.shape}, O {O.shape}")
    state = (m[..., 0, :], l[..., 0, :], O[..., 0, :, :])
    for c in range(1, m.shape[-2]):
        state = merge_states(*state, m[..., c, :], l[..., c, :], O[..., c, :, :])
    m_all, l_all, O_all = state
    return O_all / l_all[..., None], m_all + np.log(l_all)


def _batch_heads(q) -> int:
    return int(np.prod(q.shape[:-2], dtype=np.int64))


def split_kv_partials(q, k, v, *, scale=None, num_splits=None):
    """Steps 1 and 2: (m, l, O) for every chunk, stacked on an axis before Nq (see merge_partials)."""
    q, k, v, _, scale = check_attention_inputs(q, k, v, scale=scale)
    parts = [chunk_partial(q, k[..., a:b, :], v[..., a:b, :], scale)
             for a, b in chunk_bounds(k.shape[-2], check_num_splits(num_splits, k.shape[-2], _batch_heads(q)))]
    return tuple(np.stack(x, axis=-2 if i < 2 else -3) for i, x in enumerate(zip(*parts)))


def flash_decoding(q, k, v, *, scale=None, num_splits=None):
    """Split-KV attention: every query sees every key (a KV cache holds only past tokens, so decoding needs
    no causal mask). q: (..., Nq, d), k: (..., Nk, d), v: (..., Nk, dv). Returns (o, lse) like
    `flash_attention_v2`: o in q's dtype, lse in the compute dtype. num_splits: chunks of keys (default: default_num_splits).
    """
    q, k, v, _, scale = check_attention_inputs(q, k, v, scale=scale)
    o, lse = merge_partials(*split_kv_partials(q, k, v, scale=scale, num_splits=num_splits))
    return o.astype(q.dtype), lse


def check_paged(q, k_cache, v_cache, block_table, cache_seqlens):
    """Shapes of paged attention: q (B, H, Nq, d); caches (num_pages, page_size, H_kv, d); block_table
    (B, max_pages) integers in [0, num_pages); cache_seqlens (B,) integers in [0, max_pages * page_size]."""
    q, k_cache, v_cache = as_float_array(q, "q"), as_float_array(k_cache, "k_cache"), as_float_array(v_cache, "v_cache")
    if q.ndim != 4:
        raise ValueError(f"q must have shape (B, H, Nq, d); got {q.shape}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 4:
            raise ValueError(f"{name} must have shape (num_pages, page_size, H_kv, d); got {c.shape}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must share (num_pages, page_size, H_kv); got {k_cache.shape}, {v_cache.shape}")
    bt, sl = np.asarray(block_table), np.asarray(cache_seqlens)
    num_pages, page = k_cache.shape[:2]
    if bt.ndim != 2 or bt.shape[0] != q.shape[0] or bt.dtype.kind not in "iu":
        raise ValueError(f"block_table must be an integer array of shape (B, max_pages) with B = {q.shape[0]}; "
                         f"got {bt.dtype} array of shape {bt.shape}")
    if sl.shape != (q.shape[0],) or sl.dtype.kind not in "iu":
        raise ValueError(f"cache_seqlens must be an integer array of shape ({q.shape[0]},); got {sl.dtype} {sl.shape}")
    if np.any(sl < 0) or np.any(sl > bt.shape[1] * page):
        raise ValueError(f"cache_seqlens must be in [0, max_pages * page_size = {bt.shape[1] * page}]; got {sl.tolist()}")
    for b in range(bt.shape[0]):
        used = bt[b, :-(-int(sl[b]) // page)]
        if np.any((used < 0) | (used >= num_pages)):
            raise ValueError(f"block_table[{b}] has entries {used.tolist()} for its {int(sl[b])} cached keys; "
                             f"expected page indices in [0, {num_pages})")
    return q, k_cache, v_cache, bt.astype(np.int64), sl.astype(np.int64)


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, causal=False, scale=None, num_splits=None,
                    window_size=(-1, -1), alibi_slopes=None, softcap=0.0):
    """Decoding attention over a paged KV cache (vLLM's PagedAttention layout, the FA library's block_table).

    The keys of sequence b are pages block_table[b, 0], block_table[b, 1], ... of k_cache (num_pages,
    page_size, H_kv, d), cache_seqlens[b] of them in all. q: (B, H, Nq, d), H_kv dividing H (GQA). The Nq
    queries are the last Nq positions of the sequence (bottom-right alignment), so causal hides from query i
    the keys after position cache_seqlens[b] - Nq + i. Split-KV as in flash_decoding: each chunk of keys is
    read page by page (here: gathered) and gives a partial (m, l, O); the partials merge with merge_states.
    Returns (o, lse) like flash_decoding; a row with no visible key gets o = 0 and lse = +inf.
    """
    q, k_cache, v_cache, bt, sl = check_paged(q, k_cache, v_cache, block_table, cache_seqlens)
    B, H, nq, d = q.shape
    page, dv = k_cache.shape[1], v_cache.shape[-1]
    shell = lambda c: np.empty((B, c.shape[2], 1, c.shape[3]), c.dtype)  # noqa: E731  heads/d/dtype check only
    _, _, _, causal, scale = check_attention_inputs(q, shell(k_cache), shell(v_cache), causal=causal, scale=scale, gqa=True)
    opt = check_options(q.shape, causal=causal, scale=scale, window_size=window_size, align="bottom_right",
                        alibi_slopes=alibi_slopes, softcap=softcap)
    ct = compute_dtype(q.dtype)
    o = np.zeros(q.shape[:-1] + (dv,), q.dtype)
    lse = np.full(q.shape[:-1], np.inf, ct)
    for b in range(B):
        nk = int(sl[b])
        if nk == 0:
            continue
        slopes = None if opt.alibi is None else np.broadcast_to(opt.alibi, (B, H))[b:b + 1]
        opt_b = opt._replace(alibi=slopes)
        q_b = q[b:b + 1].astype(ct)
        grouped_lead = _group(q_b, shell(k_cache)[:1], shell(v_cache)[:1])[0].shape[:-2]
        masking = _Masking(opt_b, q_b.shape[:-2], grouped_lead, nq, nk)
        state = None
        for a, e in chunk_bounds(nk, check_num_splits(num_splits, nk, H)):
            keys = np.arange(a, e)
            pages, slots = bt[b, keys // page], keys % page  # where each key of the chunk lives in the cache
            k_c = k_cache[pages, slots].transpose(1, 0, 2)[None].astype(ct)  # (1, H_kv, n, d)
            v_c = v_cache[pages, slots].transpose(1, 0, 2)[None].astype(ct)
            qg, kg, vg, _ = _group(q_b, k_c, v_c)
            S, _ = masking.scores(qg, kg, 0, a, NO_IO)
            m = S.max(axis=-1)
            P = np.exp(S - np.where(np.isneginf(m), 0, m)[..., None])
            part = (m, P.sum(axis=-1), P @ vg)
            state = part if state is None else merge_states(*state, *part)
        m, l, O = state
        seen = l > 0
        l_safe = np.where(seen, l, 1)
        o[b] = (O / l_safe[..., None]).reshape(H, nq, dv)
        lse[b] = np.where(seen, m + np.log(l_safe), np.inf).reshape(H, nq)
    return o, lse
