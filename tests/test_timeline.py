"""The FA3 schedule model (lesson 11): dependencies respected, units never double-booked, known makespans."""
import pytest

from flashlab import timeline as tl


def schedule(**kw):
    base = dict(t_load=1.0, t_gemm=1.0, t_softmax=1.0)
    base.update(kw)
    return tl.fa3_schedule(6, **base)


@pytest.mark.parametrize("name", list(tl.CONFIGS))
@pytest.mark.parametrize("t_softmax", [0.0, 0.5, 2.0, 3.0])
def test_valid_schedule(name, t_softmax):
    t = schedule(t_softmax=t_softmax, **tl.CONFIGS[name])
    jobs = {j.name: j for j in t.jobs}
    for j in t.jobs:
        assert j.end == pytest.approx(j.start + j.dur)
        for d in j.deps:
            assert jobs[d].end <= j.start + 1e-12, f"{j.name} started before {d} ended"
    for unit in tl.UNITS:  # one job at a time per unit
        spans = sorted((j.start, j.end) for j in t.jobs if j.unit == unit and j.dur > 0)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert t.makespan == max(j.end for j in t.jobs)
    assert 0 < t.utilisation("tensor") <= 1


def test_nothing_overlapped_is_the_sum_of_all_steps():
    # Two Q tiles in lockstep: per block one load (1) + QK (2) + softmax (2 * 1.5) + PV (2).
    t = tl.fa3_schedule(5, t_load=1.0, t_gemm=1.0, t_softmax=1.5, **tl.CONFIGS["nothing overlapped"])
    assert t.makespan == pytest.approx(5 * (1 + 2 + 3 + 2))


def test_pingpong_hides_softmax_when_it_costs_as_much_as_the_matmuls():
    # softmax = QK + PV: in steady state the tensor cores never idle, so the time approaches 4 per block.
    n = 40
    t = tl.fa3_schedule(n, t_load=0.5, t_gemm=1.0, t_softmax=2.0, **tl.CONFIGS["+ both (FA3)"])
    assert t.makespan < 4 * n + 8
    assert t.utilisation("tensor") > 0.95


def test_overlap_never_hurts_and_pays_most_when_balanced():
    ratios = [0.05, 0.25, 1.0, 3.0]
    curves = tl.speedup_curve(ratios, n_blocks=12)
    for name, ys in curves.items():
        assert all(y >= 1 - 1e-9 for y in ys), name
    fa3 = curves["+ both (FA3)"]
    assert fa3[2] == max(fa3) and fa3[2] > 1.8  # softmax as costly as the matmuls: most to hide
    assert fa3[0] < 1.3  # softmax almost free: little to hide beyond the loads


def test_warp_specialisation_hides_loads():
    slow = schedule(t_load=1.0, **tl.CONFIGS["nothing overlapped"])
    fast = schedule(t_load=1.0, **tl.CONFIGS["warp specialisation"])
    assert fast.makespan < slow.makespan - 3  # most of the 6 loads disappear behind compute


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_blocks"):
        tl.fa3_schedule(0)
    with pytest.raises(ValueError, match="t_gemm"):
        tl.fa3_schedule(2, t_gemm=0)
    with pytest.raises(ValueError, match="t_softmax"):
        tl.fa3_schedule(2, t_softmax=-1)
    with pytest.raises(ValueError, match="stages"):
        tl.fa3_schedule(2, stages=0)


def test_intra_warpgroup_overlap_is_fa3s_two_stage_pipeline():
    # FA3 section 3.2: QK_j is issued after softmax_{j-1} and before PV_{j-1}, so softmax_j overlaps
    # PV_{j-1}; PV_j needs softmax_j's P and can never overlap it.
    t = schedule(**tl.CONFIGS["+ intra-warpgroup overlap"])
    jobs = {j.name: j for j in t.jobs}
    wg = "WG1+2"
    for j in range(1, 6):
        qk, sm, pv_prev, sm_prev = (jobs[f"{wg} QK{j}"], jobs[f"{wg} softmax{j}"], jobs[f"{wg} PV{j - 1}"],
                                    jobs[f"{wg} softmax{j - 1}"])
        assert sm_prev.end <= qk.start < pv_prev.start, f"QK{j} must come between softmax{j - 1} and PV{j - 1}"
        assert sm.start < pv_prev.end and pv_prev.start < sm.end, f"softmax{j} should overlap PV{j - 1}"
        assert jobs[f"{wg} PV{j}"].start >= sm.end
