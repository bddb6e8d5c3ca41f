"""The Tenstorrent reader/compute/writer model (lesson 12)."""
import itertools

import pytest

from flashlab import tenstorrent as tt


@pytest.mark.parametrize("t_read, t_compute", [(1.0, 2.0), (3.0, 2.0), (2.0, 2.0), (0.5, 4.0)])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_pipeline_time_matches_the_closed_form(t_read, t_compute, n):
    assert tt.pipeline_time(t_read, t_compute, n, 1) == pytest.approx(n * (t_read + t_compute))
    two = t_read + t_compute + (n - 1) * max(t_read, t_compute)
    assert tt.pipeline_time(t_read, t_compute, n, 2) == pytest.approx(two)
    assert tt.pipeline_time(t_read, t_compute, n, 3) == pytest.approx(two)  # a third slot adds nothing here


@pytest.mark.parametrize("t_read, t_compute, t_write", [(1.0, 2.0, 0.5), (3.0, 1.0, 2.0), (1.0, 1.0, 4.0),
                                                         (2.0, 2.0, 2.0)])
@pytest.mark.parametrize("n", [1, 2, 6])
def test_three_program_pipeline_time(t_read, t_compute, t_write, n):
    # One slot: reading chunk j+1 overlaps writing chunk j, and neither overlaps compute.
    one = t_read + t_compute + t_write + (n - 1) * (t_compute + max(t_read, t_write))
    assert tt.pipeline_time(t_read, t_compute, n, 1, t_write=t_write) == pytest.approx(one)
    # Two slots: fill, the slowest program's pace, drain; a third slot adds nothing.
    two = t_read + t_compute + t_write + (n - 1) * max(t_read, t_compute, t_write)
    assert tt.pipeline_time(t_read, t_compute, n, 2, t_write=t_write) == pytest.approx(two)
    assert tt.pipeline_time(t_read, t_compute, n, 3, t_write=t_write) == pytest.approx(two)


def test_simulate_reports_deadlock():
    with pytest.raises(RuntimeError, match="deadlock"):
        tt.simulate({"a": [("wait", "cb")]}, {"cb": 1})


@pytest.mark.parametrize("n_heads, n_chunks, n_cores", [(1, 16, 8), (3, 10, 4), (2, 7, 3), (1, 4, 8)])
@pytest.mark.parametrize("balanced", [False, True])
def test_assignment_is_a_partition(n_heads, n_chunks, n_cores, balanced):
    parts = tt.assign_q_chunks(n_heads, n_chunks, n_cores, balanced)
    assert len(parts) == n_cores
    flat = sorted(itertools.chain.from_iterable(parts))
    assert flat == [(h, i) for h in range(n_heads) for i in range(n_chunks)]


def test_balanced_assignment_pairs_low_and_high():
    parts = tt.assign_q_chunks(1, 16, 8, balanced=True)
    assert parts[0] == [(0, 0), (0, 15)] and parts[1] == [(0, 1), (0, 14)]
    work = [sum(i + 1 for _, i in p) for p in parts]
    assert len(set(work)) == 1  # every core sees 17 key chunks
    naive = [sum(i + 1 for _, i in p) for p in tt.assign_q_chunks(1, 16, 8, balanced=False)]
    assert max(naive) == 15 + 16 and min(naive) == 1 + 2


def test_load_balancing_and_double_buffering_help():
    kw = dict(seq_len=8192, d=128, n_heads=16, batch=1, hw=tt.Wormhole())
    fa = tt.flash_attention_grid(**kw)
    naive = tt.flash_attention_grid(**kw, balanced=False)
    single = tt.flash_attention_grid(**kw, q_chunk=128, double_buffer=False)
    double = tt.flash_attention_grid(**kw, q_chunk=128)
    assert 1.3 < naive.makespan_ns / fa.makespan_ns < 2.0  # the report measured 1.6x
    assert fa.utilisation > 0.95 > naive.utilisation
    assert double.makespan_ns < single.makespan_ns
    assert fa.core_end_ns.shape == (8, 8)


def test_non_causal_needs_no_balancing():
    kw = dict(seq_len=4096, d=64, n_heads=8, causal=False)
    a = tt.flash_attention_grid(**kw, balanced=False).makespan_ns
    b = tt.flash_attention_grid(**kw, balanced=True).makespan_ns
    assert a == pytest.approx(b)


def test_fused_beats_unfused_baseline():
    for n in (1024, 8192):
        fa = tt.flash_attention_grid(n, 128, 16, 16384 // n).makespan_ns
        assert tt.unfused_baseline_ns(n, 128, 16, 16384 // n) > 2 * fa


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of q_chunk"):
        tt.flash_attention_grid(1000, 64, 1)
    with pytest.raises(ValueError, match="d must be a positive integer"):
        tt.flash_attention_grid(1024, 0, 1)


@pytest.mark.parametrize("q_chunk, k_chunk", [(256, 256), (128, 256), (256, 128), (96, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_core_traffic_counts_what_the_reader_and_writer_move(q_chunk, k_chunk, causal):
    seq, d = 768, 32
    chunks = list(range(seq // q_chunk))[::2]
    progs = tt.core_programs([(0, i) for i in chunks], seq // k_chunk, q_chunk, k_chunk, d, causal, tt.Wormhole())
    reads = [op[2] for op in progs["reader"] if op[0] == "work"]
    moved = sum(q_chunk * d if r.startswith("Q") else k_chunk * d for r in reads)
    writes = sum(q_chunk * d for op in progs["writer"] if op[0] == "work")
    assert tt.core_traffic(chunks, seq, d, q_chunk, k_chunk, causal) == (moved, writes)
    if causal:  # the last chunk sees every key, the first only those up to its last row
        assert tt.k_chunks_needed(seq // q_chunk - 1, seq // k_chunk, q_chunk, k_chunk, True) == seq // k_chunk
        assert tt.k_chunks_needed(0, seq // k_chunk, q_chunk, k_chunk, True) == -(-q_chunk // k_chunk)
