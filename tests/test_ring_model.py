"""The ring in NumPy (flashlab.ring.simulate) against the float64 reference, and the model of a ring step
(flashlab.ring.model): its formulas against direct counts and against each other. No processes."""
import numpy as np
import pytest

import flashlab
from flashlab import ring
from flashlab.ring import model, simulate


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_numpy_is_attention(rng, layout, world_size, causal):
    n = 2 * world_size * 3
    q, k, v = (rng.standard_normal((2, n, 8)) for _ in range(3))
    o, lse = simulate.ring_numpy(q, k, v, world_size, layout, causal)
    ref_o, ref_lse = flashlab.reference_attention(q, k, v, causal=causal)
    assert flashlab.relative_error(o, ref_o) < 1e-12 and flashlab.relative_error(lse, ref_lse) < 1e-12


def test_partials_of_a_skipped_block_are_empty(rng):
    q, k, v = (rng.standard_normal((1, 8, 4)) for _ in range(3))
    parts = simulate.rank_partials(q, k, v, 0, 2, "contiguous", causal=True)
    o1, lse1 = parts[1]  # rank 0 holds the first half: the second half's keys all come later
    assert np.isneginf(lse1).all() and not o1.any()


def test_crossover_balances_compute_and_transfer():
    for causal, heads, kv_heads in ((False, 8, 8), (True, 32, 8)):
        n = model.hiding_length(4, heads, kv_heads, 2, 989e12, 450e9, causal)
        c = n / 4
        compute = model.step_flops(c, 128, heads, 0.5 if causal else 1.0) / 989e12
        transfer = model.step_bytes(c, 128, kv_heads, 2) / 450e9
        assert compute == pytest.approx(transfer, rel=1e-12)
        assert model.step_flops(2 * c, 128, heads) / model.step_bytes(2 * c, 128, kv_heads, 2) > 989e12 / 450e9


def test_timeline():
    # A fast link: every step waits only for compute; a slow one: every step after the first waits for the shard.
    fast = model.timeline(4, 4096, 64, causal=False, bandwidth=1e18)
    assert fast.total == pytest.approx(fast.compute.sum(axis=1).max())
    slow = model.timeline(4, 4096, 64, causal=False, bandwidth=1e6)
    assert slow.total == pytest.approx(3 * slow.transfer + slow.compute[0, 3], rel=1e-9)  # transfers back to back
    # causal, contiguous: the last rank has the most work and finishes last; zigzag evens it out
    cont = model.timeline(4, 4096, 64, layout="contiguous", bandwidth=1e18)
    zig = model.timeline(4, 4096, 64, layout="zigzag", bandwidth=1e18)
    assert cont.end[:, -1].argmax() == 3 and zig.total < 0.6 * cont.total


def test_at_scale():
    rows = model.at_scale(2**20)
    assert [r["W"] for r in rows][0] == 8 and rows[0]["link"].startswith("NVLink")
    assert all(r["link"].startswith("InfiniBand") for r in rows[1:])
    for r in rows:
        assert (r["bound"] == "compute") == (r["tokens"] >= r["crossover_tokens"] * (1 - 1e-12))
    assert rows[0]["fits"] and model.tokens_per_gpu(1, **model.LLAMA_7B) < rows[0]["max_tokens"]


def test_ring_bytes_by_hand():
    assert model.ring_bytes(1024, 1, 1, 8, 64, 2) == (0.0, 0.0)
    shard = 2 * 8 * 256 * 64  # K and V of one shard: N/W = 256 tokens, 8 KV heads, d = 64
    assert model.ring_bytes(1024, 4, 1, 8, 64, 2, 4) == (3 * shard * 2, 3 * shard * 2 + 4 * shard * 4)
