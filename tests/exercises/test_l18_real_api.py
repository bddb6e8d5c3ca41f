"""Lesson 18's exercises (the real API: visited key blocks, an ALiBi tile, ALiBi's two causal forms, softcap's
backward factor, a varlen batch looped over cu_seqlens, FA2's varlen grid, a K tile through a block table): each
checker passes the solution, grades the blank "not implemented", and rejects kept wrong solutions for several
seeds, naming the slip; a learner function that raises gets a verdict, never a crash of the grader. The lesson's
figures render; the checkers' answers agree with flashlab's FA2 (visited blocks, softcap's dq), its packed varlen
table and its paged attention.
"""
import math

import numpy as np
import pytest

from exercise_harness import Lesson
from flashlab.grading import check

LESSON = Lesson("18_real_api")
NAMES = LESSON.exercises()
mutant = LESSON.mutant


# -- 1: visited key blocks -------------------------------------------------------------------------
def _blocks(i_block, bq, bk, nq, nk, window, offset, last=None, hi_exclusive=False):
    left, right = window
    first = i_block * bq
    last = min((i_block + 1) * bq, nq) - 1 if last is None else last
    lo = 0 if left < 0 else max(0, first + offset - left)
    hi = nk - 1 if right < 0 else min(nk - 1, last + offset + right)
    if hi < lo:
        return []
    return list(range(lo // bk, (hi // bk if hi_exclusive else hi // bk + 1)))


@mutant("visited_key_blocks", "align='top_left'")
def blocks_alignment_ignored(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """always top-left: query i at position i"""
    return _blocks(i_block, block_q, block_k, Nq, Nk, window_size, 0)


@mutant("visited_key_blocks", "i + (Nk - Nq), not i + (Nq - Nk)")
def blocks_offset_sign(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """bottom-right offset Nq - Nk instead of Nk - Nq"""
    return _blocks(i_block, block_q, block_k, Nq, Nk, window_size, Nq - Nk if align == "bottom_right" else 0)


@mutant("visited_key_blocks", "its rows stop at Nq - 1")
def blocks_last_block_full(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """the last query block taken as block_q rows, past Nq"""
    off = Nk - Nq if align == "bottom_right" else 0
    return _blocks(i_block, block_q, block_k, Nq, Nk, window_size, off, last=(i_block + 1) * block_q - 1)


@mutant("visited_key_blocks", "Missing")
def blocks_last_one_dropped(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """range(lo // bk, hi // bk): the block of the last key left out"""
    off = Nk - Nq if align == "bottom_right" else 0
    return _blocks(i_block, block_q, block_k, Nq, Nk, window_size, off, hi_exclusive=True)


@mutant("visited_key_blocks", "Extra")
def blocks_not_clipped(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """every block from the left edge of the window to the end: the right bound forgotten"""
    left = window_size[0]
    off = Nk - Nq if align == "bottom_right" else 0
    lo = 0 if left < 0 else max(0, i_block * block_q + off - left)
    return list(range(min(lo, Nk - 1) // block_k, math.ceil(Nk / block_k)))


@mutant("visited_key_blocks", "your function raised")
def blocks_raises(i_block, block_q, block_k, Nq, Nk, window_size, align):
    """crashes on an empty range"""
    r = _blocks(i_block, block_q, block_k, Nq, Nk, window_size, Nk - Nq if align == "bottom_right" else 0)
    return list(range(r[0], r[-1] + 1))


# -- 2: alibi_tile -------------------------------------------------------------------------------------
def _alibi(slope, i0, j0, bq, bk, nq, nk, offset, sign=-1.0, absolute=True, local=False):
    i = np.arange(i0, min(i0 + bq, nq))[:, None]
    j = np.arange(j0, min(j0 + bk, nk))[None, :]
    if local:
        i, j = i - i0, j - j0
    dist = (i + (0 if local else offset)) - j
    return sign * slope * (np.abs(dist) if absolute else dist).astype(np.float64)


@mutant("alibi_tile", "align='top_left'")
def alibi_alignment_swapped(slope, i0, j0, bq, bk, nq, nk, align):
    """offset applied for top_left instead of bottom_right"""
    return _alibi(slope, i0, j0, bq, bk, nq, nk, nk - nq if align == "top_left" else 0)


@mutant("alibi_tile", "never positive")
def alibi_plus(slope, i0, j0, bq, bk, nq, nk, align):
    """+slope * |i - j|"""
    return _alibi(slope, i0, j0, bq, bk, nq, nk, nk - nq if align == "bottom_right" else 0, sign=1.0)


@mutant("alibi_tile", "absolute distance")
def alibi_no_abs(slope, i0, j0, bq, bk, nq, nk, align):
    """-slope * (pos_i - j), without the absolute value"""
    return _alibi(slope, i0, j0, bq, bk, nq, nk, nk - nq if align == "bottom_right" else 0, absolute=False)


@mutant("alibi_tile", "global indices")
def alibi_local(slope, i0, j0, bq, bk, nq, nk, align):
    """indices inside the tile"""
    return _alibi(slope, i0, j0, bq, bk, nq, nk, 0, local=True)


@mutant("alibi_tile", "only the rows < Nq")
def alibi_full_tile(slope, i0, j0, bq, bk, nq, nk, align):
    """always block_q x block_k, past the edges"""
    off = nk - nq if align == "bottom_right" else 0
    pos = np.arange(i0, i0 + bq)[:, None] + off
    return -slope * np.abs(pos - np.arange(j0, j0 + bk)[None, :]).astype(np.float64)


# -- 3: alibi_causal_forms ---------------------------------------------------------------------------
def _attention(Q, K, V, bias, visible):
    """(O, lse) of softmax(Q K^T / sqrt(d) + bias) V over the visible keys; O = 0, lse = +inf where none is."""
    S = np.where(visible, Q @ K.T / math.sqrt(Q.shape[1]) + bias, -np.inf)
    m = S.max(axis=1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    return (P @ V) / np.where(l > 0, l, 1), np.where(l[:, 0] > 0, m[:, 0] + np.log(np.where(l[:, 0] > 0, l[:, 0], 1)),
                                                     np.inf)


def _forms(Q, K, V, slope, offset=None, lin_sign=1.0, bias_scale=1.0):
    """Both forms with query i at position i + offset (Nk - Nq unless given); the slips change one thing."""
    i, j = np.arange(len(Q))[:, None], np.arange(len(K))[None, :]
    pos = i + (len(K) - len(Q) if offset is None else offset)
    s = slope * bias_scale
    return (_attention(Q, K, V, -s * np.abs(pos - j), j <= pos),
            _attention(Q, K, V, lin_sign * s * j + 0 * pos, j <= pos))


@mutant("alibi_causal_forms", "aligns causal bottom-right")
def forms_top_left(Q, K, V, slope):
    """query i at position i (PyTorch's causal alignment)"""
    return _forms(Q, K, V, slope, offset=0)


@mutant("alibi_causal_forms", "a key nearer the query")
def forms_lin_sign(Q, K, V, slope):
    """-slope * j for the library's form"""
    return _forms(Q, K, V, slope, lin_sign=-1.0)


@mutant("alibi_causal_forms", "the lse keeps it")
def forms_lse_copied(Q, K, V, slope):
    """the lin form's lse taken to be the abs form's (the softmax cancels the shift, so the lse too?)"""
    (o, lse), _ = _forms(Q, K, V, slope)
    return (o, lse), (o.copy(), lse.copy())


@mutant("alibi_causal_forms", "not minus")
def forms_shift_subtracted(Q, K, V, slope):
    """lse_lin = lse_abs - slope * pos_i"""
    (o, lse), _ = _forms(Q, K, V, slope)
    return (o, lse), (o, lse - slope * (np.arange(len(Q)) + len(K) - len(Q)))


@mutant("alibi_causal_forms", "unscaled")
def forms_bias_scaled(Q, K, V, slope):
    """the bias added to Q K^T before the scaling"""
    return _forms(Q, K, V, slope, bias_scale=1 / math.sqrt(Q.shape[1]))


@mutant("alibi_causal_forms", "first Nq - Nk rows see no key")
def forms_empty_rows_nan(Q, K, V, slope):
    """no care for rows that see no key: their max is -inf and exp(-inf - (-inf)) is NaN"""
    i, j = np.arange(len(Q))[:, None], np.arange(len(K))[None, :]
    pos = i + len(K) - len(Q)
    out = []
    for bias in (-slope * np.abs(pos - j), slope * j + 0 * pos):
        S = np.where(j <= pos, Q @ K.T / math.sqrt(Q.shape[1]) + bias, -np.inf)
        m = S.max(axis=1, keepdims=True)
        P = np.exp(S - m)
        out.append((P @ V / P.sum(axis=1, keepdims=True), m[:, 0] + np.log(P.sum(axis=1))))
    return tuple(out)


@LESSON.alternative("alibi_causal_forms")
def forms_from_fa2_and_the_shift(Q, K, V, slope):
    """flashlab's FA2 for the abs form; the lin form from the fact itself: same O, lse shifted by slope * pos_i."""
    import flashlab

    o, lse = flashlab.flash_attention_v2(Q, K, V, causal=True, align="bottom_right", alibi_slopes=slope, block_q=3,
                                         block_k=5)
    return (o, lse), (o, lse + slope * (np.arange(len(Q)) + len(K) - len(Q)))


# -- 4: softcap_dS ------------------------------------------------------------------------------------
def _factor_times(S_capped, dS_capped, factor):
    visible = np.isfinite(S_capped)
    return np.where(visible, dS_capped * factor(np.where(visible, S_capped, 0)), 0).astype(S_capped.dtype)


@mutant("softcap_dS", "go through the cap")
def softcap_no_factor(S_capped, dS_capped, softcap):
    """dS = dS': the cap forgotten"""
    return _factor_times(S_capped, dS_capped, lambda s: 1.0)


@mutant("softcap_dS", "applies the cap a second time")
def softcap_tanh_of_capped(S_capped, dS_capped, softcap):
    """1 - tanh(S' / softcap)^2: the capped score taken for S"""
    return _factor_times(S_capped, dS_capped, lambda s: 1 - np.tanh(s / softcap) ** 2)


@mutant("softcap_dS", "the softcap cancels")
def softcap_times_cap(S_capped, dS_capped, softcap):
    """softcap * (1 - (S' / softcap)^2)"""
    return _factor_times(S_capped, dS_capped, lambda s: softcap * (1 - (s / softcap) ** 2))


@mutant("softcap_dS", "0 * (-inf) = NaN")
def softcap_masked_nan(S_capped, dS_capped, softcap):
    """the factor taken at the masked entries too"""
    return dS_capped * (1 - (S_capped / softcap) ** 2)


@mutant("softcap_dS", "square tanh")
def softcap_not_squared(S_capped, dS_capped, softcap):
    """1 - |S'| / softcap"""
    return _factor_times(S_capped, dS_capped, lambda s: 1 - np.abs(s) / softcap)


@LESSON.alternative("softcap_dS")
def softcap_from_recomputed_scores(S_capped, dS_capped, softcap):
    """S recomputed from S' (arctanh), then the derivative 1 / cosh^2(S / softcap)."""
    visible = np.isfinite(S_capped)
    T = np.clip(np.where(visible, S_capped, 0) / softcap, -1, 1)
    S = softcap * np.arctanh(T)  # +-inf where tanh rounded to +-1: cosh is then inf and the factor 0
    return np.where(visible, dS_capped / np.cosh(S / softcap) ** 2, 0).astype(S_capped.dtype)


# -- 5: varlen_attention -----------------------------------------------------------------------------
def _loop(q, k, v, cu_q, cu_k, causal, bq, bk, align="bottom_right", keys_cu=None, lse_init=np.inf, skip_empty=True):
    import flashlab

    keys_cu = cu_k if keys_cu is None else keys_cu
    o = np.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), lse_init)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(keys_cu[b], keys_cu[b + 1])
        if skip_empty and (rows.stop == rows.start or len(k[keys]) == 0):
            continue
        seq = lambda x, r: x[r].transpose(1, 0, 2)[None]  # noqa: E731
        o_b, lse_b = flashlab.flash_attention_v2(seq(q, rows), seq(k, keys), seq(v, keys), causal=causal, align=align,
                                                 block_q=bq, block_k=bk)
        o[rows], lse[:, rows] = o_b[0].transpose(1, 0, 2), lse_b[0]
    return o, lse


@mutant("varlen_attention", "aligned bottom-right within each sequence")
def varlen_top_left(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """flash_attention_v2's default alignment, top-left"""
    return _loop(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k, align="top_left")


@mutant("varlen_attention", "its own keys only")
def varlen_whole_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """one call over all the packed rows"""
    return _loop(q, k, v, np.array([0, len(q)]), np.array([0, len(k)]), causal, block_q, block_k)


@mutant("varlen_attention", "cu_seqlens_k, not cu_seqlens_q")
def varlen_keys_by_query_offsets(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """the keys sliced with cu_seqlens_q"""
    return _loop(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k, keys_cu=cu_seqlens_q)


@mutant("varlen_attention", "o = 0 and lse = +inf there")
def varlen_lse_zero(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """lse starts at 0: a sequence without keys keeps it"""
    return _loop(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k, lse_init=0.0)


@mutant("varlen_attention", "refuses Nq = 0")
def varlen_no_skip(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """every sequence passed to flash_attention_v2, empty or not"""
    return _loop(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k, skip_empty=False)


@mutant("varlen_attention", "heads first")
def varlen_lse_rows_first(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """lse as (total_q, H), like o"""
    o, lse = _loop(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k)
    return o, lse.T


@LESSON.alternative("varlen_attention")
def varlen_block_diagonal_mask(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, block_q, block_k):
    """No loop: one float64 attention over the packed rows with a block-diagonal (and causal) mask."""
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    seq_q = np.repeat(np.arange(len(cu_q) - 1), np.diff(cu_q))  # the sequence of each query row
    seq_k = np.repeat(np.arange(len(cu_k) - 1), np.diff(cu_k))
    pos = np.arange(len(q)) - cu_q[seq_q] + (np.diff(cu_k) - np.diff(cu_q))[seq_q]  # bottom-right, per sequence
    j = np.arange(len(k)) - cu_k[seq_k]
    visible = seq_q[:, None] == seq_k[None, :]
    if causal:
        visible &= j[None, :] <= pos[:, None]
    G = q.shape[1] // k.shape[1]
    o = np.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = np.empty((q.shape[1], len(q)), np.float64)
    for h in range(q.shape[1]):
        Q, K, V = (x.astype(np.float64) for x in (q[:, h], k[:, h // G], v[:, h // G]))
        o_h, lse[h] = _attention(Q, K, V, 0.0, visible)
        o[:, h] = o_h
    return o, lse.astype(q.dtype)


# -- 6: fa2_varlen_grid ------------------------------------------------------------------------------
def _grid_counts(cu, max_q, bq, heads, per_sequence=None):
    lengths = np.diff(np.asarray(cu))
    launched = -(-max_q // bq) * len(lengths) * heads
    working = sum((per_sequence or (lambda n: -(-n // bq)))(int(n)) for n in lengths) * heads
    return working, launched - working


@mutant("fa2_varlen_grid", "as the caller passes it")
def grid_of_the_longest(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """the grid sized by the longest sequence, not by max_seqlen_q"""
    return _grid_counts(cu_seqlens_q, int(np.diff(cu_seqlens_q).max()), block_q, heads)


@mutant("fa2_varlen_grid", "ceil(n / block_q) working blocks")
def grid_floor(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """n // block_q working blocks: the short last block forgotten"""
    return _grid_counts(cu_seqlens_q, max_seqlen_q, block_q, heads, per_sequence=lambda n: n // block_q)


@mutant("fa2_varlen_grid", "multiply by heads")
def grid_one_head(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """the heads forgotten"""
    return _grid_counts(cu_seqlens_q, max_seqlen_q, block_q, 1)


@mutant("fa2_varlen_grid", "has no working block")
def grid_empty_works(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """an empty sequence's first block counted as working"""
    return _grid_counts(cu_seqlens_q, max_seqlen_q, block_q, heads, per_sequence=lambda n: max(1, -(-n // block_q)))


@mutant("fa2_varlen_grid", "never holds rows of two sequences")
def grid_packed_rows(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """working blocks counted over the packed rows"""
    launched = -(-max_seqlen_q // block_q) * (len(cu_seqlens_q) - 1) * heads
    working = -(-int(cu_seqlens_q[-1]) // block_q) * heads
    return working, launched - working


@mutant("fa2_varlen_grid", "in that order")
def grid_swapped(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """(idle, working)"""
    return _grid_counts(cu_seqlens_q, max_seqlen_q, block_q, heads)[::-1]


@LESSON.alternative("fa2_varlen_grid")
def grid_by_mask(cu_seqlens_q, max_seqlen_q, block_q, heads):
    """Every block's first row against its sequence's length, as one boolean array (m, b)."""
    first_rows = np.arange(0, max_seqlen_q, block_q)[:, None]
    works = first_rows < np.diff(cu_seqlens_q)[None, :]
    return int(works.sum()) * heads, int((~works).sum()) * heads


# -- 7: paged_k_tile ---------------------------------------------------------------------------------
def _gather(k_cache, block_table, b, positions, rows):
    page = k_cache.shape[1]
    tile = np.zeros((rows, k_cache.shape[2]), k_cache.dtype)
    tile[:len(positions)] = k_cache[block_table[b, positions // page], positions % page]
    return tile


@mutant("paged_k_tile", "logical page")
def tile_logical_pages(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """pos // page_size read as the physical page"""
    page = k_cache.shape[1]
    pos = np.arange(k0, min(k0 + block_k, cache_seqlens[b]))
    tile = np.zeros((block_k, k_cache.shape[2]))
    tile[:len(pos)] = k_cache.reshape(-1, k_cache.shape[2])[(pos // page) * page + pos % page]
    return tile


@mutant("paged_k_tile", "spans more than one page")
def tile_one_page(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """FA2's read: block_k consecutive rows from the tile's first page and offset, as if the pages were adjacent"""
    page, flat = k_cache.shape[1], k_cache.reshape(-1, k_cache.shape[2])
    n = max(0, min(k0 + block_k, cache_seqlens[b]) - k0)
    tile = np.zeros((block_k, k_cache.shape[2]))
    if n:
        start = block_table[b, k0 // page] * page + k0 % page
        tile[:n] = flat[start:start + n] if start + n <= len(flat) else 0
    return tile


@mutant("paged_k_tile", "stale keys")
def tile_not_zeroed(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """every row read through the table, past the sequence's end too (while the table lasts)"""
    page = k_cache.shape[1]
    return _gather(k_cache, block_table, b, np.arange(k0, min(k0 + block_k, block_table.shape[1] * page)), block_k)


@mutant("paged_k_tile", "already past its end")
def tile_one_row_too_many(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """positions up to cache_seqlens[b] included"""
    page = k_cache.shape[1]
    last = min(k0 + block_k, cache_seqlens[b] + 1, block_table.shape[1] * page)
    return _gather(k_cache, block_table, b, np.arange(k0, last), block_k)


@mutant("paged_k_tile", "has a fixed size")
def tile_only_the_keys(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """only the rows the sequence has, no padding"""
    pos = np.arange(k0, min(k0 + block_k, cache_seqlens[b]))
    return _gather(k_cache, block_table, b, pos, len(pos))


@mutant("paged_k_tile", "must not be looked up")
def tile_unchecked_lookup(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """every row looked up in the table first, then the rows past the end zeroed: past the table it raises"""
    page = k_cache.shape[1]
    pos = np.arange(k0, k0 + block_k)
    tile = k_cache[block_table[b, pos // page], pos % page]
    return np.where((pos < cache_seqlens[b])[:, None], tile, 0.0)


@LESSON.alternative("paged_k_tile")
def tile_row_by_row(k_cache, block_table, cache_seqlens, b, k0, block_k):
    """A Python loop over the rows, one table lookup each."""
    page = k_cache.shape[1]
    tile = np.zeros((block_k, k_cache.shape[2]))
    for r in range(block_k):
        pos = k0 + r
        if pos < cache_seqlens[b]:
            tile[r] = k_cache[block_table[b][pos // page]][pos % page]
    return tile


globals().update(LESSON.standard_tests())


def test_the_visited_blocks_are_those_flash_attention_v2_visits():
    """The checker's answer (from the reference mask) is the set of key blocks flashlab's FA2 loads."""
    from flashlab.grading.l18_real_api import _visited
    from flashlab.viz.tiles import TileTracer

    rng = np.random.default_rng(0)
    for nq, nk, bq, bk, window, align in [(13, 29, 4, 8, (3, 2), "bottom_right"), (20, 7, 4, 2, (-1, 0), "bottom_right"),
                                          (16, 16, 4, 4, (5, 0), "top_left"), (9, 30, 2, 4, (0, 0), "top_left")]:
        q, k, v = rng.standard_normal((nq, 8)), rng.standard_normal((nk, 8)), rng.standard_normal((nk, 8))
        tracer = TileTracer(q, k)
        from flashlab import flash_attention_v2
        flash_attention_v2(q, k, v, window_size=window, align=align, block_q=bq, block_k=bk, io=tracer)
        seen = {}
        for q0, k0 in tracer.visits:
            seen.setdefault(q0 // bq, []).append(k0 // bk)
        for i in range(math.ceil(nq / bq)):
            assert sorted(seen.get(i, [])) == _visited(i, bq, bk, nq, nk, window, align), (nq, nk, window, align, i)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [lambda *a: 1 / 0, lambda *a: None, lambda *a: "blocks"], ids=["raises", "None", "str"])
def test_a_raising_or_wrong_typed_function_gets_a_verdict(name, bad):
    result = check(name, bad, seed=1, quiet=True)
    assert result.status == "failed" and result.message
    assert "could not check" not in result.message  # the checker itself names the problem


def test_the_lesson_figures_render():
    import matplotlib

    matplotlib.use("Agg")
    from flashlab.viz import real_api as R
    from flashlab.viz import to_png

    figs = [R.plot_tile_grid(20, 40, 4, 8, causal=True, align="bottom_right"), R.plot_gqa_map(8, 2),
            R.plot_alibi(0.25, 12, 24, (4, 8, 4, 8), align="bottom_right"), R.plot_softcap(5.0),
            R.plot_dropout_tiles(3, 0.3, 16, 24, 4, 8), R.plot_varlen_mask([0, 5, 12], [0, 6, 13], causal=True),
            R.plot_block_table(np.array([[5, 1], [2, 0]]), [6, 3], 4, 8)]
    assert all(len(to_png(f)) > 1000 for f in figs)
    assert "identical" in figs[4].axes[1].get_title()
    cls = R.tile_classes(20, 40, 4, 8, window_size=(6, 0), align="bottom_right")
    assert cls.shape == (5, 5) and set(np.unique(cls)) <= {R.SKIPPED, R.PARTIAL, R.FULL}


def test_the_varlen_figure_draws_the_committed_timings(tmp_path):
    import json

    import matplotlib

    matplotlib.use("Agg")
    from flashlab.viz import real_api as R

    raw = [r for r in json.loads(R.VARLEN_JSON.read_text()) if r["variant"] == "tensor"]
    runs = R.load_varlen_results()
    assert runs == raw and len(runs) >= 2
    ax = R.plot_varlen_speed(runs).axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    want = sorted(round(r["ms"][name], 6) for r in raw for name in R.VARLEN_PATHS if name in r["ms"])
    assert heights == want  # one bar per measured path and batch, at its time
    assert [t.get_text() for t in ax.get_xticklabels()] == [R.varlen_batch_name(r) for r in raw]
    assert R.load_varlen_results(tmp_path / "none.json") == []
    ax = R.plot_varlen_speed([]).axes[0]
    assert any("no varlen benchmark" in t.get_text() for t in ax.texts)


def test_launch_model_counts_launches_and_idle_sms():
    """Lesson 18's two-line model: by hand on made-up batches, then the committed runs' ordering (the batch of short
    sequences gains most from packing, in the model as in the measurement)."""
    from flashlab.bench import attention_flops
    from flashlab.viz import real_api as R

    rate, t_launch = 1e14, 20e-6
    one = R.launch_model([128], H=1, d=64, causal=False, rate=rate, t_launch=t_launch, sms=4)  # 1 block of 4 SMs
    t = attention_flops(1, 1, 128, 128, 64) / rate
    assert one["loop_ms"] == pytest.approx(1e3 * max(t_launch, 4 * t))
    assert one["packed_ms"] == pytest.approx(1e3 * (t_launch + t))
    big = R.launch_model([4096] * 2, H=16, d=64, causal=True, rate=rate, t_launch=t_launch, sms=4)
    t = attention_flops(1, 16, 4096, 4096, 64, causal=True) / rate
    assert big["loop_ms"] == pytest.approx(2e3 * t) and big["packed_ms"] == pytest.approx(1e3 * (t_launch + 2 * t))
    runs = {R.varlen_batch_name(r): r for r in R.load_varlen_results()}
    short, mixed = runs["256 x 32..1024"], runs["64 x 129..4096"]
    measured = {k: r["ms"]["flashlab loop"] / r["ms"]["flashlab varlen"]
                for k, r in (("short", short), ("mixed", mixed))}
    model = {}
    for key, r in (("short", short), ("mixed", mixed)):
        m = R.launch_model(r["lens"], r["H"], r["d"], r["causal"], rate=2.25e14, t_launch=25e-6, sms=132)
        model[key] = m["loop_ms"] / m["packed_ms"]
    assert measured["short"] > 2 * measured["mixed"] and model["short"] > 2 * model["mixed"]


def test_the_checkers_lin_form_is_the_library_bias_computed_directly():
    """The checker derives the +slope * j form from the reference by the per-row shift; computed directly, it is the
    same, rows that see no key included."""
    from flashlab.grading.l18_real_api import _alibi_forms

    rng = np.random.default_rng(0)
    for nq, nk, slope in [(5, 12, 0.25), (9, 4, 0.5), (1, 7, 2.0), (6, 6, 0.125)]:
        Q, K, V = rng.standard_normal((nq, 8)), rng.standard_normal((nk, 8)), rng.standard_normal((nk, 5))
        o_abs, lse_abs, o_lin, lse_lin = _alibi_forms(Q, K, V, slope)
        (o1, lse1), (o2, lse2) = _forms(Q, K, V, slope)
        assert np.allclose(o_abs, o1, rtol=0, atol=1e-12) and np.allclose(lse_abs, lse1, rtol=1e-12)
        assert np.allclose(o_lin, o2, rtol=0, atol=1e-12) and np.allclose(lse_lin, lse2, rtol=1e-12)
        assert not np.allclose(lse1[np.isfinite(lse1)], lse2[np.isfinite(lse2)])  # the lse does differ


def test_the_softcap_factor_is_the_one_fa2s_backward_applies():
    """The solution's dS, on the whole score matrix as one tile, gives flashlab's FA2 backward's dq under softcap."""
    import flashlab

    softcap_dS = LESSON.solution("softcap_dS")
    rng = np.random.default_rng(1)
    cap, nq, nk, d = 2.0, 9, 12, 8
    q, k, v = 3 * rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
    do = rng.standard_normal((nq, d))
    opts = dict(causal=True, align="bottom_right", softcap=cap, block_q=4, block_k=4)
    o, lse = flashlab.flash_attention_v2(q, k, v, **opts)
    scale = 1 / math.sqrt(d)
    visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq
    S_capped = np.where(visible, cap * np.tanh(scale * q @ k.T / cap), -np.inf)
    P = np.exp(S_capped - lse[:, None])
    dS_capped = P * (do @ v.T - (do * o).sum(axis=1, keepdims=True))
    dq = scale * softcap_dS(S_capped, dS_capped, cap) @ k
    want = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do, **opts)[0]
    assert np.abs(dq - want).max() < 1e-10 * np.abs(want).max()


def test_the_working_blocks_are_flashlabs_packed_launch():
    """FA2's working blocks are the entries of flashlab's packed varlen table, times the heads: the same blocks,
    without the idle ones."""
    from flashlab.grading.l18_real_api import _grid
    from flashlab.kernels.varlen import block_table

    for lengths, bq in [([5, 7, 8], 4), ([0, 129, 3, 0, 64], 64), ([4096] + [32] * 7, 128)]:
        cu = np.concatenate([[0], np.cumsum(lengths)])
        for heads, extra in ((1, 0), (3, 5)):
            working, idle = _grid(cu, max(lengths) + extra, bq, heads)
            assert working == len(block_table(cu, cu, bq, bq, causal=True, bottom_right=True)) * heads
            assert working + idle == -(-(max(lengths) + extra) // bq) * len(lengths) * heads


def test_the_paged_tiles_rebuild_paged_attention():
    """Keys and values gathered tile by tile (tiles across page boundaries) give decoding.paged_attention's output."""
    import flashlab
    from flashlab import decoding
    from flashlab.grading.l18_real_api import _tile

    rng = np.random.default_rng(2)
    page, bk = 4, 6
    k_cache, v_cache = rng.standard_normal((2, 9, page, 1, 8))
    table, seqlens = np.array([[5, 1, 7], [2, 8, 3]]), np.array([10, 12])
    q = rng.standard_normal((2, 1, 1, 8))
    o, _ = decoding.paged_attention(q, k_cache, v_cache, table, seqlens)
    for b in range(2):
        n = int(seqlens[b])
        K, V = (np.concatenate([_tile(c[:, :, 0], table, seqlens, b, k0, bk) for k0 in range(0, n, bk)])[:n]
                for c in (k_cache, v_cache))
        o_ref, _ = flashlab.reference_attention(q[b, 0], K, V)
        assert np.allclose(o[b, 0], o_ref, rtol=0, atol=1e-12)
