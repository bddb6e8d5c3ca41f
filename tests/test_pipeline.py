"""flashlab.pipeline: the ring's parities, the rules of a consumer's schedule (each one able to fail, and the
kernel's order passing them all), and the measured timeline's reading."""
import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flashlab import pipeline as P  # noqa: E402


def test_ring_fill_walks_the_slots_and_flips_each_slots_parity_per_fill():
    assert [P.ring_fill(j, 2) for j in range(6)] == [(0, 0, None), (1, 0, None), (0, 1, 0), (1, 1, 0), (0, 0, 1),
                                                     (1, 0, 1)]
    assert [P.ring_fill(j, 1) for j in range(3)] == [(0, 0, None), (0, 1, 0), (0, 0, 1)]
    for stages in (2, 3, 4):  # the producer waits for the phase the consumers completed one fill earlier
        for j in range(stages, 5 * stages):
            assert P.ring_fill(j, stages)[2] == P.ring_fill(j - stages, stages)[1]
    with pytest.raises(ValueError, match="stages"):
        P.ring_fill(3, 0)


def test_the_kernels_order_breaks_no_rule():
    assert P.schedule_slips(P.KERNEL_ORDER) == []
    assert set(P.KERNEL_ORDER) == set(P.STEPS)


@pytest.mark.parametrize("rule", [name for name, _, _ in P.RULES])
def test_every_rule_can_fail_alone(rule):
    """Some order of the steps breaks this rule: moving one step of the kernel's order somewhere else."""
    holds = dict((name, h) for name, h, _ in P.RULES)[rule]
    base = list(P.KERNEL_ORDER)
    for step in base:
        for i in range(len(base)):
            order = [s for s in base if s != step]
            order.insert(i, step)
            if not holds(order):
                assert dict((n, w) for n, _, w in P.RULES)[rule] in P.schedule_slips(order)
                return
    pytest.fail(f"no single move breaks rule {rule!r}")


def test_schedule_slips_names_missing_and_unknown_steps():
    assert "missing ['softmax']" in P.schedule_slips([s for s in P.KERNEL_ORDER if s != "softmax"])[0]
    assert "unknown" in P.schedule_slips(list(P.KERNEL_ORDER) + ["sleep"])[0]


@pytest.mark.parametrize("d", [64, 128])
def test_measured_timeline_reads_the_committed_run(d):
    run = P.measured_timeline(d)
    assert run["d"] == d and run["gpu"] and set(run["rows"]) == {"producer"} | {f"consumer {w}" for w in
                                                                               range(1, run["consumers"] + 1)}
    spans = [(a, b) for rows in run["rows"].values() for _, _, a, b in rows]
    assert all(b >= a >= 0 for a, b in spans)
    means = P.phase_means(run)
    assert all(np.isfinite(t) and t > 0 for t in means.values())
    assert means["softmax"] > means["S on the tensor cores"]  # what lesson 20 says the stamps show
    ax = P.plot_measured_timeline(run, until=10)
    assert len(ax.patches) > 20
    with pytest.raises(ValueError, match="no timeline for d = 32"):
        P.measured_timeline(32)
