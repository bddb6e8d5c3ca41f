"""Lesson 18's exercises (the real API: visited key blocks, GQA heads, K/V bytes, ALiBi, dropout, paged KV):
each checker passes the solution, grades the blank "not implemented", and rejects kept wrong solutions for
several seeds, naming the slip; a learner function that raises gets a verdict, never a crash of the grader.
The lesson's figures render, and the visited-blocks checker agrees with flashlab's FA2.
"""
import math

import numpy as np
import pytest

from exercise_harness import Lesson
from flashlab import dropout
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


# -- 2: kv_head ---------------------------------------------------------------------------------------
@mutant("kv_head", "interleaved")
def head_modulo(h, H, H_kv):
    """h % H_kv: heads dealt out in turn"""
    return h % H_kv


@mutant("kv_head", "group size G = H // H_kv")
def head_divides_by_hkv(h, H, H_kv):
    """h // H_kv"""
    return h // H_kv


@mutant("kv_head", "as an int")
def head_float(h, H, H_kv):
    """h / G: a float"""
    return h / (H // H_kv)


@mutant("kv_head", "should read K/V head")
def head_ceil(h, H, H_kv):
    """rounds up"""
    return min(-(-h // (H // H_kv)), H_kv - 1)


# -- 3: kv_bytes_read ---------------------------------------------------------------------------------
@mutant("kv_bytes_read", "V as well as K")
def bytes_k_only(B, H, H_kv, seqlen, d, itemsize, packed):
    """K only"""
    return B * (H_kv if packed else H) * seqlen * d * itemsize


@mutant("kv_bytes_read", "share one read")
def bytes_packing_backwards(B, H, H_kv, seqlen, d, itemsize, packed):
    """packed and not packed swapped"""
    return 2 * B * (H if packed else H_kv) * seqlen * d * itemsize


@mutant("kv_bytes_read", "multiply by B")
def bytes_one_sequence(B, H, H_kv, seqlen, d, itemsize, packed):
    """forgets the batch"""
    return 2 * (H_kv if packed else H) * seqlen * d * itemsize


@mutant("kv_bytes_read", "multiply by itemsize")
def bytes_numbers(B, H, H_kv, seqlen, d, itemsize, packed):
    """counts numbers, not bytes"""
    return 2 * B * (H_kv if packed else H) * seqlen * d


# -- 4: alibi_tile -------------------------------------------------------------------------------------
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


# -- 5: dropout_keep ------------------------------------------------------------------------------------
def _keep(seed, b, h, r, c, p):
    return dropout.dropout_bits_array(seed, b, h, r, c) >= dropout.keep_threshold(p)


@mutant("dropout_keep", "Rows and columns are swapped")
def keep_row_col_swapped(seed, b, h, rows, cols, p):
    """(seed, b, h, col, row)"""
    return _keep(seed, b, h, cols[None, :], rows[:, None], p)


@mutant("dropout_keep", "Batch and head are swapped")
def keep_batch_head_swapped(seed, b, h, rows, cols, p):
    """(seed, h, b, row, col)"""
    return _keep(seed, h, b, rows[:, None], cols[None, :], p)


@mutant("dropout_keep", "not the offsets inside the tile")
def keep_tile_offsets(seed, b, h, rows, cols, p):
    """indices counted from the tile's corner"""
    return _keep(seed, b, h, np.arange(len(rows))[:, None], np.arange(len(cols))[None, :], p)


@mutant("dropout_keep", "probability 1 - p")
def keep_below_threshold(seed, b, h, rows, cols, p):
    """keeps where the hash is below the threshold: with probability p"""
    return ~_keep(seed, b, h, rows[:, None], cols[None, :], p)


@mutant("dropout_keep", "keep_threshold(p), the probability of dropping")
def keep_threshold_of_keep_probability(seed, b, h, rows, cols, p):
    """threshold of 1 - p"""
    return _keep(seed, b, h, rows[:, None], cols[None, :], 1 - p)


@mutant("dropout_keep", "return booleans")
def keep_scaled(seed, b, h, rows, cols, p):
    """returns Z / (1 - p) instead of the mask"""
    return _keep(seed, b, h, rows[:, None], cols[None, :], p) / (1 - p)


# -- 6: physical_slot -----------------------------------------------------------------------------------
@mutant("physical_slot", "LOGICAL page")
def slot_logical(block_table, cache_seqlens, b, pos, page_size):
    """the block table forgotten"""
    if not 0 <= pos < cache_seqlens[b]:
        return None
    return pos // page_size, pos % page_size


@mutant("physical_slot", "past its end")
def slot_off_by_one(block_table, cache_seqlens, b, pos, page_size):
    """pos <= cache_seqlens[b] accepted"""
    if not 0 <= pos <= cache_seqlens[b] or pos // page_size >= block_table.shape[1]:
        return None
    return int(block_table[b, pos // page_size]), pos % page_size


@mutant("physical_slot", "negative indexing")
def slot_no_lower_bound(block_table, cache_seqlens, b, pos, page_size):
    """no check that pos >= 0"""
    if pos >= cache_seqlens[b]:
        return None
    return int(block_table[b, pos // page_size]), pos % page_size


@mutant("physical_slot", "rounded down")
def slot_ceil(block_table, cache_seqlens, b, pos, page_size):
    """ceil(pos / page_size) for the page"""
    if not 0 <= pos < cache_seqlens[b]:
        return None
    return int(block_table[b, min(-(-pos // page_size), block_table.shape[1] - 1)]), pos % page_size


@mutant("physical_slot", "of sequence 0 is at")
def slot_transposed(block_table, cache_seqlens, b, pos, page_size):
    """block_table[page, b]: the table indexed the wrong way round"""
    if not 0 <= pos < cache_seqlens[b]:
        return None
    return int(block_table[pos // page_size, b]), pos % page_size


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
