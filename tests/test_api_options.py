"""The FlashAttention library's options (GQA, window, align, ALiBi, softcap, dropout, varlen, paged KV)
in the NumPy reference and FA2, forward and backward, against explicit float64 ground truths."""
import itertools

import numpy as np
import pytest
import torch

import flashlab as fl
from flashlab import dropout as fd
from flashlab.decoding import paged_attention
from flashlab.reference import alibi_bias, attention_mask, dropout_scale


def random_case(rng, B=2, H=4, H_kv=2, nq=7, nk=11, d=5, dv=3):
    return (rng.standard_normal((B, H, nq, d)), rng.standard_normal((B, H_kv, nk, d)),
            rng.standard_normal((B, H_kv, nk, dv)))


def torch_reference(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), align="top_left",
                    alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
    """The explicit reference in torch (autograd), with K/V repeated per query head: an independent path."""
    nq, nk, H, d = q.shape[-2], k.shape[-2], q.shape[-3], q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    kt, vt = (x.repeat_interleave(H // x.shape[-3], dim=-3) for x in (k, v))
    s = (q @ kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + torch.from_numpy(alibi_bias(alibi_slopes, q.shape[:-2], nq, nk, align=align))
    mask = torch.from_numpy(attention_mask(nq, nk, causal=causal, window_size=window_size, align=align))
    s = torch.where(mask, s, torch.tensor(-torch.inf, dtype=s.dtype))
    m = s.detach().amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = p.sum(-1, keepdim=True)
    P = p / torch.where(l > 0, l, torch.ones_like(l))
    if dropout_p > 0:
        P = P * torch.from_numpy(dropout_scale(seed, dropout_p, q.shape[:-2], nq, nk))
    return P @ vt


def brute_mask(nq, nk, causal, window, align):
    off = nk - nq if align == "bottom_right" else 0
    out = np.zeros((nq, nk), bool)
    for i, j in itertools.product(range(nq), range(nk)):
        p = i + off
        out[i, j] = ((window[0] < 0 or j >= p - window[0]) and (window[1] < 0 or j <= p + window[1])
                     and (not causal or j <= p))
    return out


OPTION_GRID = [dict(causal=c, window_size=w, align=a, alibi=al, softcap=sc, dropout_p=dp)
               for c, w, a, al, sc, dp in itertools.product(
                   [False, True], [(-1, -1), (2, 1), (0, -1)], ["top_left", "bottom_right"],
                   [False, True], [0.0, 1.5], [0.0, 0.3])]


def make_kwargs(o, rng, H, B):
    kw = dict(causal=o["causal"], window_size=o["window_size"], align=o["align"], softcap=o["softcap"],
              dropout_p=o["dropout_p"], seed=int(rng.integers(2 ** 40)))
    if o["alibi"]:
        kw["alibi_slopes"] = rng.random(H) if rng.random() < 0.5 else rng.random((B, H))
    return kw


def test_explicit_mask_matches_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(40):
        nq, nk = rng.integers(1, 9, size=2)
        w = tuple(int(x) for x in rng.integers(-1, 4, size=2))
        c, a = bool(rng.random() < 0.5), ["top_left", "bottom_right"][rng.integers(2)]
        assert np.array_equal(attention_mask(nq, nk, causal=c, window_size=w, align=a), brute_mask(nq, nk, c, w, a))


def test_dropout_scalar_and_vector_agree_bit_for_bit():
    rng = np.random.default_rng(1)
    seed = int(rng.integers(2 ** 62))
    idx = rng.integers(0, 2 ** 31, size=(4, 50))
    vec = fd.dropout_bits_array(seed, *idx)
    assert vec.dtype == np.uint64 and vec.max() < 2 ** 32
    assert [fd.dropout_bits(seed, *map(int, col)) for col in idx.T] == vec.tolist()
    assert np.array_equal(fd.dropout_bits_array(seed, *idx), vec)  # deterministic
    assert not np.array_equal(fd.dropout_bits_array(seed + 1, *idx), vec)  # the seed matters


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_fraction(p):
    b, h = fd.batch_head_index((2, 3))
    z = fd.keep_scale(7, p, b, h, np.arange(64)[:, None], np.arange(64)[None, :])
    kept = z > 0
    n = kept.size
    assert abs(kept.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n)
    assert np.allclose(z[kept], 1 / (1 - p))
    # every (batch, head) and every row gets its own pattern
    flat = kept.reshape(6, 64, 64)
    assert len({x.tobytes() for x in flat}) == 6 and len({r.tobytes() for r in flat[0]}) == 64


def test_reference_matches_torch_explicit():
    rng = np.random.default_rng(2)
    for o in OPTION_GRID[::3]:
        q, k, v = random_case(rng)
        kw = make_kwargs(o, rng, 4, 2)
        out, lse = fl.reference_attention(q, k, v, **kw)
        ref = torch_reference(*(torch.from_numpy(x) for x in (q, k, v)), **kw).numpy()
        assert np.allclose(out, ref, atol=1e-12), kw


@pytest.mark.parametrize("shape", [(7, 11), (11, 7), (1, 9), (9, 1), (1, 1)])
def test_fa2_forward_every_combination(shape):
    rng = np.random.default_rng(sum(shape))
    nq, nk = shape
    for o in OPTION_GRID:
        q, k, v = random_case(rng, nq=nq, nk=nk, H_kv=[1, 2, 4][rng.integers(3)])
        kw = make_kwargs(o, rng, 4, 2)
        ref_o, ref_lse = fl.reference_attention(q, k, v, **kw)
        out, lse = fl.flash_attention_v2(q, k, v, block_q=int(rng.integers(1, 5)), block_k=int(rng.integers(1, 6)), **kw)
        assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
        assert np.allclose(out, ref_o, atol=1e-12), kw
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)) and np.all(lse[np.isinf(lse)] > 0), kw
        fin = np.isfinite(ref_lse)
        assert np.allclose(lse[fin], ref_lse[fin], atol=1e-12), kw


def test_empty_rows_give_zero_and_inf():
    rng = np.random.default_rng(3)
    q, k, v = random_case(rng, nq=9, nk=4)
    out, lse = fl.flash_attention_v2(q, k, v, causal=True, align="bottom_right", block_q=2, block_k=3)
    assert np.all(out[..., :5, :] == 0) and np.all(lse[..., :5] == np.inf) and np.all(np.isfinite(lse[..., 5:]))
    grads = fl.flash_attention_v2_backward(q, k, v, out, lse, rng.standard_normal(out.shape), causal=True,
                                           align="bottom_right", block_q=2, block_k=3)
    assert all(np.all(np.isfinite(g)) for g in grads) and np.all(grads[0][..., :5, :] == 0)


@pytest.mark.parametrize("shape", [(7, 11), (11, 7), (1, 6)])
def test_fa2_backward_matches_torch_autograd(shape):
    rng = np.random.default_rng(10 + sum(shape))
    nq, nk = shape
    for o in OPTION_GRID[::2]:
        q, k, v = random_case(rng, nq=nq, nk=nk, H_kv=[1, 2, 4][rng.integers(3)])
        kw = make_kwargs(o, rng, 4, 2)
        out, lse = fl.flash_attention_v2(q, k, v, **kw)
        do = rng.standard_normal(out.shape)
        grads = fl.flash_attention_v2_backward(q, k, v, out, lse, do, block_q=int(rng.integers(1, 5)),
                                               block_k=int(rng.integers(1, 6)), **kw)
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        torch_reference(tq, tk, tv, **kw).backward(torch.from_numpy(do))
        for name, g, t in zip("qkv", grads, (tq, tk, tv)):
            assert g.shape == t.shape and np.allclose(g, t.grad.numpy(), atol=1e-10), (name, kw)


def test_gqa_reads_kv_without_copies():
    rng = np.random.default_rng(4)
    q, k, v = random_case(rng, H=6, H_kv=2)
    out, _ = fl.flash_attention_v2(q, k, v)
    rep = lambda x: np.repeat(x, 3, axis=1)  # noqa: E731
    assert np.allclose(out, fl.reference_attention(q, rep(k), rep(v))[0], atol=1e-12)
    from flashlab.tiled import _group
    _, kg, vg, grouped = _group(q, k, v)
    assert grouped and np.shares_memory(kg, k) and np.shares_memory(vg, v)


def _varlen_case(rng, lens_q, lens_k, H=4, H_kv=2, d=5, dv=3):
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    return (rng.standard_normal((cq[-1], H, d)), rng.standard_normal((ck[-1], H_kv, d)),
            rng.standard_normal((ck[-1], H_kv, dv)), cq.astype(np.int32), ck.astype(np.int32))


def test_varlen_equals_a_loop_over_sequences():
    rng = np.random.default_rng(5)
    q, k, v, cq, ck = _varlen_case(rng, [3, 1, 6, 4], [5, 2, 6, 0])
    kw = dict(causal=True, align="bottom_right", window_size=(3, -1), alibi_slopes=rng.random((4, 4)),
              softcap=2.0, dropout_p=0.25, seed=11)
    out, lse = fl.flash_attention_varlen(q, k, v, cq, ck, max_seqlen_q=6, block_q=2, block_k=3, **kw)
    assert lse.shape == (4, cq[-1])
    do = rng.standard_normal(out.shape)
    dq, dk, dv = fl.flash_attention_varlen_backward(q, k, v, out, lse, do, cq, ck, block_q=3, block_k=2, **kw)
    for b in range(4):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rk.stop == rk.start:  # no keys: o = 0, lse = +inf, no gradient
            assert np.all(out[rq] == 0) and np.all(lse[:, rq] == np.inf) and np.all(dq[rq] == 0)
            continue
        # sequence b is batch entry b (the dropout key): repeat it b + 1 times and keep the last
        seq = lambda x, r: np.broadcast_to(x[r].transpose(1, 0, 2)[None], (b + 1, x.shape[1], r.stop - r.start, x.shape[2]))  # noqa: E731
        slopes = np.broadcast_to(kw["alibi_slopes"][b], (b + 1, 4))
        args = [torch.from_numpy(np.ascontiguousarray(seq(x, r))).requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
        ref = torch_reference(*args, **{**kw, "alibi_slopes": slopes})
        assert np.allclose(out[rq], ref.detach().numpy()[-1].transpose(1, 0, 2), atol=1e-12)
        g = np.zeros(ref.shape)
        g[-1] = do[rq].transpose(1, 0, 2)
        ref.backward(torch.from_numpy(g))
        for mine, t, r in ((dq, args[0], rq), (dk, args[1], rk), (dv, args[2], rk)):
            assert np.allclose(mine[r], t.grad.numpy()[-1].transpose(1, 0, 2), atol=1e-10)


@pytest.mark.parametrize("nq", [1, 3])
def test_paged_equals_contiguous_decoding(nq):
    rng = np.random.default_rng(6 + nq)
    B, H, H_kv, d, page, n_pages = 3, 4, 2, 5, 4, 14
    lens = np.array([9, 2, 13])
    kc, vc = rng.standard_normal((n_pages, page, H_kv, d)), rng.standard_normal((n_pages, page, H_kv, 3))
    table = rng.permutation(n_pages)[:B * 4].reshape(B, 4).astype(np.int32)
    q = rng.standard_normal((B, H, nq, d))
    for kw in (dict(), dict(causal=True), dict(causal=True, window_size=(4, 0), alibi_slopes=rng.random(H), softcap=1.5)):
        for splits in (1, 2):
            out, lse = paged_attention(q, kc, vc, table, lens, num_splits=splits, **kw)
            for b in range(B):
                keys = np.arange(lens[b])
                kb, vb = (c[table[b, keys // page], keys % page].transpose(1, 0, 2)[None] for c in (kc, vc))
                ro, rl = fl.reference_attention(q[b:b + 1], kb, vb, align="bottom_right", **kw)
                assert np.allclose(out[b], ro[0], atol=1e-12) and np.array_equal(np.isinf(lse[b]), np.isinf(rl[0]))
                assert np.allclose(lse[b][np.isfinite(rl[0])], rl[0][np.isfinite(rl[0])], atol=1e-12)


Q4, K4, V4 = random_case(np.random.default_rng(9))
ERRORS = [  # (id, kwargs for flash_attention_v2 on Q4, K4, V4 or other arrays, exception, message)
    ("heads", dict(k=np.concatenate([K4, K4[:, :1]], axis=1)), ValueError, r"H_kv = 3 heads .* must divide q's H = 4"),
    ("window not a pair", dict(window_size=3), TypeError, r"window_size must be a pair of integers .* got 3"),
    ("window too negative", dict(window_size=(-2, 1)), ValueError, r"window_size entries must be >= 0, or -1 .* \(-2, 1\)"),
    ("align", dict(align="bottom"), ValueError, r"align must be 'top_left' or 'bottom_right'; got 'bottom'"),
    ("alibi shape", dict(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes must have shape \(H,\) = \(4,\) .* got \(3,\)"),
    ("softcap negative", dict(softcap=-1.0), ValueError, r"softcap must be >= 0 \(0 = off\); got -1.0"),
    ("dropout 1", dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\); got 1.0"),
    ("dropout negative", dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\); got -0.1"),
    ("seed", dict(seed=-1), ValueError, r"seed must be an integer in \[0, 2\*\*63\); got -1"),
]


@pytest.mark.parametrize("f", [fl.reference_attention, fl.flash_attention_v2])
@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_clear_errors(f, case):
    _, kw, exc, msg = case
    kw = dict(kw)
    k = kw.pop("k", K4)
    with pytest.raises(exc, match=msg):
        f(Q4, k, np.concatenate([V4, V4[:, :1]], axis=1) if k.shape[1] == 3 else V4, **kw)


def test_clear_errors_varlen_and_paged():
    rng = np.random.default_rng(8)
    q, k, v, cq, ck = _varlen_case(rng, [2, 3], [3, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0, never decrease .* got \[0, 3, 2, 5\]"):
        fl.flash_attention_varlen(q, k, v, np.array([0, 3, 2, 5]), np.array([0, 2, 3, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0, never decrease and end at 6"):
        fl.flash_attention_varlen(q, k, v, cq, np.array([0, 3, 5]))
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int >= the longest sequence \(3\); got 2"):
        fl.flash_attention_varlen(q, k, v, cq, ck, max_seqlen_q=2)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(4,\) or \(batch, H\) = \(2, 4\)"):
        fl.flash_attention_varlen(q, k, v, cq, ck, alibi_slopes=np.ones((3, 4)))
    kc, vc = rng.standard_normal((5, 4, 2, 5)), rng.standard_normal((5, 4, 2, 3))
    qd = rng.standard_normal((2, 4, 1, 5))
    with pytest.raises(ValueError, match=r"block_table\[1\] has entries \[3, 7\] .* expected page indices in \[0, 5\)"):
        paged_attention(qd, kc, vc, np.array([[0, 1], [3, 7]]), np.array([5, 6]))
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, max_pages \* page_size = 8\]; got \[5, 9\]"):
        paged_attention(qd, kc, vc, np.array([[0, 1], [3, 4]]), np.array([5, 9]))
    with pytest.raises(ValueError, match=r"H_kv = 3 heads"):
        paged_attention(qd, rng.standard_normal((5, 4, 3, 5)), rng.standard_normal((5, 4, 3, 3)),
                        np.array([[0, 1], [3, 4]]), np.array([5, 6]))


def test_backward_rejects_nan_lse_but_accepts_empty_rows():
    rng = np.random.default_rng(12)
    q, k, v = random_case(rng)
    out, lse = fl.flash_attention_v2(q, k, v)
    with pytest.raises(ValueError, match="lse contains inf or NaN"):
        fl.flash_attention_v2_backward(q, k, v, out, np.full_like(lse, -np.inf), out, window_size=(1, 1))
    with pytest.raises(ValueError, match="lse contains inf or NaN"):  # plain attention has no empty rows
        fl.flash_attention_v2_backward(q, k, v, out, np.full_like(lse, np.inf), out)
