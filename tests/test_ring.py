"""Ring attention (flashlab.ring): layouts and the merge rule in one process; the ring itself on 2 and 4 CPU
processes joined by gloo, forward and backward against float64 autograd on the full tensors; a rank that
raises ends the run with its error instead of a hang; the GPU path (NCCL, world size 1) where there is a GPU.

The spawned runs gather every case of a world size into one run (starting processes is the slow part).
"""
import math
import re
import tempfile
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import flashlab  # noqa: E402
from flashlab import ring  # noqa: E402
from flashlab.ring import RankFailed, run_ranks  # noqa: E402
from flashlab.ring.processes import _attention64  # noqa: E402

gpu = pytest.mark.skipif(not flashlab.device.has_gpu(), reason="needs a CUDA GPU")
TIMEOUT = 90  # seconds a spawned run may take; a hang fails the test instead of stalling CI


# -- layouts, in one process ---------------------------------------------------------------------------------
def test_zigzag_indices_by_hand():
    assert ring.shard_indices(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert ring.shard_indices(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert ring.shard_indices(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    assert ring.rank_chunks(1, 4, "zigzag") == (1, 6)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(rng, layout, world_size):
    n = 2 * world_size * 3
    x = rng.standard_normal((2, 3, n, 5))
    shards = [ring.shard(x, r, world_size, layout) for r in range(world_size)]
    held = np.sort(np.concatenate([ring.shard_indices(n, r, world_size, layout) for r in range(world_size)]))
    assert held.tolist() == list(range(n))  # every token on exactly one rank
    assert np.array_equal(ring.unshard(shards, layout), x)
    t = torch.from_numpy(x).requires_grad_()
    t_shards = [ring.shard(t, r, world_size, layout) for r in range(world_size)]
    assert torch.equal(ring.unshard(t_shards, layout), t)
    t_shards[world_size - 1].sum().backward()  # sharding is differentiable: the gradient lands on its tokens
    mask = np.zeros(n, bool)
    mask[ring.shard_indices(n, world_size - 1, world_size, layout)] = True
    assert (t.grad[..., mask, :] == 1).all() and (t.grad[..., ~mask, :] == 0).all()


def test_layout_errors_name_the_rule():
    x = np.zeros((1, 1, 12, 4))
    with pytest.raises(ValueError, match="N divisible by 2 \\* world_size"):
        ring.shard(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="N divisible by world_size"):
        ring.shard(x, 0, 5, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring.shard(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        ring.shard(x, 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        ring.unshard([x[..., :6, :], x[..., :4, :]])


def test_zigzag_balances_causal_work():
    for w in (2, 4, 8):
        zig, cont = ring.causal_work(w, "zigzag"), ring.causal_work(w, "contiguous")
        assert np.allclose(zig.sum(1), w / 2)  # every rank the same total: half of W full blocks
        assert np.allclose(cont.sum(1), np.arange(w) + 0.5)  # rank r: r full blocks and its diagonal
        assert np.isclose(zig.sum(), cont.sum())  # the same total work, spread differently
        assert np.allclose(ring.causal_work(w, "zigzag", causal=False), 1)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_block_plan_visits_exactly_the_causal_pairs(layout, world_size):
    """Over the W steps, the blocks each rank computes cover each (query, key) pair of the causal mask once."""
    n = 2 * world_size * 2
    per = ring.num_chunks(world_size, layout) // world_size
    size = n // ring.num_chunks(world_size, layout)
    for causal in (False, True):
        for r in range(world_size):
            seen = np.zeros((n, n), int)
            rows = ring.shard_indices(n, r, world_size, layout)
            for t in range(world_size):
                s = (r - t) % world_size
                cols = ring.shard_indices(n, s, world_size, layout)
                for q_chunks, k_chunks, masked in ring.block_plan(r, s, world_size, layout, causal):
                    qi = np.concatenate([rows[c * size:(c + 1) * size] for c in q_chunks])
                    ki = np.concatenate([cols[c * size:(c + 1) * size] for c in k_chunks])
                    seen[np.ix_(qi, ki)] += np.tril(np.ones((len(qi), len(ki)), int)) if masked else 1
            want = np.zeros((n, n), int)
            want[rows] = np.tril(np.ones((n, n), int))[rows] if causal else 1
            assert np.array_equal(seen, want), (r, causal)
            assert per in (1, 2)


def test_merge_is_the_course_rule(rng):
    """merge of two (o, lse) halves of the keys equals attention over all of them; an empty state is neutral."""
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((3, 5, 8), (3, 11, 8), (3, 11, 6)))
    o_ref, lse_ref = flashlab.reference_attention(q.numpy(), k.numpy(), v.numpy())
    a = flashlab.reference_attention(q.numpy(), k[:, :4].numpy(), v[:, :4].numpy())
    b = flashlab.reference_attention(q.numpy(), k[:, 4:].numpy(), v[:, 4:].numpy())
    o, lse = ring.merge(*(torch.from_numpy(x) for x in a + b))
    assert flashlab.relative_error(o, o_ref) < 1e-12 and flashlab.relative_error(lse, lse_ref) < 1e-12
    empty = (torch.zeros_like(o), torch.full_like(lse, -math.inf))
    o2, lse2 = ring.merge(*empty, o, lse)
    assert torch.equal(o2, o) and torch.allclose(lse2, lse)
    o3, lse3 = ring.merge(*empty, *empty)
    assert not torch.isnan(o3).any() and torch.isneginf(lse3).all()


def test_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    x = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring.ring_attention(x, x, x)


@pytest.fixture
def world_of_one():
    """A gloo group of one rank in this process (a file in a temporary folder is the meeting point)."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/meeting", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_world_of_one_is_attention(world_of_one, rng):
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).requires_grad_() for s in ((1, 4, 16, 8), (1, 2, 16, 8),
                                                                                    (1, 2, 16, 8)))
    do = torch.from_numpy(rng.standard_normal((1, 4, 16, 8)))
    for layout in ring.LAYOUTS:
        o = ring.ring_attention(q, k, v, causal=True, layout=layout)
        o.backward(do)
        qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
        ref = _attention64(qr, kr, vr, causal=True)
        ref.backward(do)
        for got, want in ((o, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
            assert flashlab.relative_error(got.detach(), want.detach()) < 1e-12
        for x in (q, k, v):
            x.grad = None


def test_bad_shards_get_clear_errors(world_of_one):
    x = torch.zeros(1, 2, 6, 8)
    with pytest.raises(ValueError, match="N divisible by 2 \\* world_size"):
        ring.ring_attention(x[..., :5, :], x[..., :5, :], x[..., :5, :])
    with pytest.raises(ValueError, match="heads, which must divide"):
        ring.ring_attention(torch.zeros(1, 3, 6, 8), x, x)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring.ring_attention(x, x, x, layout="striped")
    with pytest.raises(ValueError, match="B, H, N/W, d"):
        ring.ring_attention(x[0], x[0], x[0])
    with pytest.raises(TypeError, match="dtype"):
        ring.ring_attention(x.int(), x.int(), x.int())


# -- the ring on several processes ---------------------------------------------------------------------------
# (name, B, H, H_kv, N per rank, d, dv, causal, layout, dtype): causal and not, both layouts, GQA, ragged head dims
CASES = [
    ("zigzag causal", 1, 2, 2, 8, 8, 8, True, "zigzag", "float64"),
    ("zigzag", 2, 2, 2, 8, 8, 8, False, "zigzag", "float64"),
    ("contiguous causal", 1, 2, 2, 8, 8, 8, True, "contiguous", "float64"),
    ("contiguous", 1, 2, 2, 6, 8, 8, False, "contiguous", "float64"),
    ("GQA 4:1 zigzag causal", 1, 4, 1, 8, 8, 8, True, "zigzag", "float64"),
    ("GQA 4:2 contiguous causal", 1, 4, 2, 6, 16, 16, True, "contiguous", "float64"),
    ("ragged d = 12, dv = 5", 1, 2, 2, 8, 12, 5, True, "zigzag", "float64"),
    ("float32", 1, 2, 1, 8, 16, 16, True, "zigzag", "float32"),
]
TOL = {"float64": 1e-10, "float32": 1e-5}


def check_cases(rank, world_size, cases):
    """Every rank: shard the same random inputs, run ring attention forward and backward, gather; rank 0
    compares with float64 autograd on the full tensors. Returns {case: {o, dq, dk, dv errors}} (rank 0)."""
    errors = {}
    for name, B, H, H_kv, n_local, d, dv, causal, layout, dtype in cases:
        n = n_local * world_size
        g = torch.Generator().manual_seed(len(errors))
        full = [torch.randn(B, h, n, e, generator=g, dtype=torch.float64) for h, e in ((H, d), (H_kv, d), (H_kv, dv))]
        dout = torch.randn(B, H, n, dv, generator=g, dtype=torch.float64)
        mine = [ring.shard(x, rank, world_size, layout).to(getattr(torch, dtype)).requires_grad_() for x in full]
        o = ring.ring_attention(*mine, causal=causal, layout=layout)
        o.backward(ring.shard(dout, rank, world_size, layout).to(o.dtype))
        got = []
        for x in (o.detach(), *(m.grad for m in mine)):
            parts = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(parts, x.contiguous())
            got.append(ring.unshard([p.double() for p in parts], layout))
        if rank == 0:
            ref_in = [x.clone().requires_grad_() for x in full]
            ref = _attention64(*ref_in, causal=causal)
            ref.backward(dout)
            want = [ref.detach()] + [x.grad for x in ref_in]
            errors[name] = {k: flashlab.relative_error(a, b) for k, a, b in zip(("o", "dq", "dk", "dv"), got, want)}
        else:
            errors[name] = None
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_matches_float64_autograd(world_size):
    start = time.monotonic()
    errors = run_ranks(check_cases, world_size, CASES, timeout=TIMEOUT)[0]
    for name, *_, dtype in CASES:
        bad = {k: e for k, e in errors[name].items() if not e < TOL[dtype]}
        assert not bad, f"W={world_size}, {name}: relative errors {bad} above {TOL[dtype]:g}"
    print(f"W={world_size}: {len(CASES)} cases in {time.monotonic() - start:.1f} s")


def test_a_wrong_answer_is_caught():
    """The comparison can fail: a ring that skips its last step (rank r never meets one shard's keys) is wrong."""
    errors = run_ranks(check_broken, 2, CASES[:1], timeout=TIMEOUT)[0]
    assert errors[CASES[0][0]]["o"] > 1e-2


def check_broken(rank, world_size, cases):
    from flashlab.ring import attention

    real = attention.block_plan
    attention.block_plan = lambda r, s, w, layout, causal: real(r, s, w, layout, causal) if s == r else []
    return check_cases(rank, world_size, cases)


def raise_on_rank_one(rank, world_size):
    x = torch.randn(1, 1, 8, 8)
    if rank == 1:
        raise ValueError("rank one gives up")
    return ring.ring_attention(x, x, x, check=False)  # waits for rank 1's shard, which never comes


def mismatched_shards(rank, world_size):
    x = torch.randn(1, 1, 8 if rank == 0 else 4, 8)
    return ring.ring_attention(x, x, x)


def test_a_raising_rank_does_not_hang_the_others():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank one gives up") as info:
        run_ranks(raise_on_rank_one, 2, timeout=TIMEOUT)
    assert info.value.rank == 1
    assert time.monotonic() - start < TIMEOUT / 2


def test_mismatched_shards_are_named():
    with pytest.raises(RankFailed, match="they differ:\n.*rank 0: q \\(1, 1, 8, 8\\).*\n.*rank 1: q \\(1, 1, 4, 8\\)"):
        run_ranks(mismatched_shards, 2, timeout=TIMEOUT)


def test_a_hang_is_stopped():
    with pytest.raises(RankFailed, match="still running after"):
        run_ranks(sleep_forever, 1, timeout=3)


def sleep_forever(rank, world_size):
    time.sleep(3600)


# -- the GPU path: flashlab's kernels for the local blocks, NCCL ----------------------------------------------
def check_cuda(rank, world_size):
    out = {}
    for dtype, tol in (("float32", 1e-4), ("float16", 2e-2)):
        for layout in ring.LAYOUTS:
            out[dtype, layout] = (flashlab.ring.processes.demo(rank, world_size, H=4, H_kv=2, N=256, d=64,
                                                               layout=layout, steps=1, dtype=dtype,
                                                               device="cuda")["errors"], tol)
    return out


@pytest.mark.gpu
@gpu
def test_ring_on_gpu_world_of_one():
    for (dtype, layout), (errors, tol) in run_ranks(check_cuda, 1, backend="nccl", timeout=300)[0].items():
        assert max(errors.values()) < tol, (dtype, layout, errors)


def test_the_example_runs(capsys):
    from flashlab.ring.__main__ import main

    assert main(["--world-size", "2", "--seq-len", "32", "--head-dim", "8", "--heads", "2", "--kv-heads", "1",
                 "--steps", "1"]) == 0
    text = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"d?[oqkv] (\d\.\de[-+]\d+)", text)]
    assert len(errors) == 4 and max(errors) < 1e-5, text
    assert "ms per ring step" in text


def count_sent(rank, world_size):
    """Bytes this rank hands to isend in a forward and in a backward (float16 K/V, float32 dK/dV)."""
    from flashlab.ring import attention

    sent = [0]
    real = attention._Ring.rotate

    def counting(self, tensors, tag):
        sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        return real(self, tensors, tag)

    attention._Ring.rotate = counting
    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    k, v = (x[:, :2].detach().requires_grad_() for x in (k, v))  # GQA: 2 KV heads
    o = ring.ring_attention(q, k, v, causal=True)
    forward = sent[0]
    o.backward(torch.randn_like(o))
    return forward, sent[0] - forward


def test_bytes_sent_match_the_model():
    from flashlab.ring.model import ring_bytes

    for forward, backward in run_ranks(count_sent, 3, timeout=TIMEOUT):
        assert (forward, backward) == ring_bytes(24, 3, 1, 2, 16, 2, grad_itemsize=4)
