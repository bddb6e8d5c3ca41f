"""Ground truth and the textbook algorithm.

reference_attention: float64, used by every test and checker as the answer.
naive_attention: the three steps S = QK^T, P = softmax(S), O = PV, materialising S and P (N x N each).
"""
from __future__ import annotations

import numpy as np

from ._inputs import as_float_array, causal_mask, check_attention_inputs, check_options, compute_dtype
from .dropout import batch_head_index, keep_scale
from .iomodel import NO_IO


def reference_attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), align="top_left",
                        alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0):
    """Exact attention in float64, with the FlashAttention library's options. Returns (o, lse), both float64.

    lse[..., i] = log(sum_j exp(S[..., i, j])) over the scaled, masked scores S of query row i (before
    dropout). Every option is built explicitly as a full Nq x Nk array (this is the ground truth):
      S = scale * Q K^T;  S = softcap * tanh(S / softcap) if softcap > 0;  S += ALiBi bias;
      S = -inf where the mask (causal and window, aligned) hides the key;  P = softmax(S);
      P *= Z / (1 - p) (dropout);  O = P V.
    k, v may have H_kv heads where H_kv divides q's H (GQA): query head h reads KV head h // (H / H_kv).
    A row that sees no key gets o = 0 and lse = +inf (the FA library's convention: the backward's
    exp(S - lse) is then 0, with no NaN).
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale, gqa=True)
    opt = check_options(q.shape, causal=causal, scale=scale, window_size=window_size, align=align,
                        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed)
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    s = _gqa_matmul(q, np.swapaxes(k, -1, -2)) * scale
    if opt.softcap > 0:
        s = opt.softcap * np.tanh(s / opt.softcap)
    if opt.alibi is not None:
        s = s + alibi_bias(opt.alibi, q.shape[:-2], nq, nk, align=opt.align)
    s = np.where(attention_mask(nq, nk, causal=causal, window_size=opt.window, align=opt.align), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)  # a row that sees no key: exp(-inf - 0) = 0, not NaN
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    P = p / np.where(l > 0, l, 1)
    if opt.dropout_p > 0:
        P = P * dropout_scale(opt.seed, opt.dropout_p, q.shape[:-2], nq, nk)
    o = _gqa_matmul(P, v)
    lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), np.inf)[..., 0]
    return o, lse


def _gqa_matmul(a, b):
    """a @ b where a has H heads (dim -3) and b has H_kv heads dividing H: head h of a meets head
    h // (H / H_kv) of b. b is broadcast through a view (b[..., None, :, :]), never repeated in memory."""
    if a.ndim < 3 or a.shape[-3] == b.shape[-3]:
        return a @ b
    h, h_kv = a.shape[-3], b.shape[-3]
    grouped = a.reshape(a.shape[:-3] + (h_kv, h // h_kv) + a.shape[-2:]) @ b[..., None, :, :]
    return grouped.reshape(a.shape[:-1] + (b.shape[-1],))


def attention_mask(nq, nk, *, causal=False, window_size=(-1, -1), align="top_left"):
    """Boolean (Nq, Nk): True where query i may see key j. Query i sits at position i + offset, offset =
    Nk - Nq for align="bottom_right" (the last query meets the last key) and 0 for "top_left".
    window_size=(left, right) keeps i - left <= j <= i + right (-1 = unbounded); causal keeps j <= i."""
    pos = np.arange(nq)[:, None] + (nk - nq if align == "bottom_right" else 0)
    j = np.arange(nk)[None, :]
    left, right = window_size
    mask = np.ones((nq, nk), bool)
    if left >= 0:
        mask &= j >= pos - left
    if right >= 0:
        mask &= j <= pos + right
    if causal:
        mask &= j <= pos
    return mask


def alibi_bias(slopes, lead_shape, nq, nk, *, align="top_left"):
    """The ALiBi bias -slope * |i - j| over aligned positions, of shape lead_shape + (Nq, Nk).

    slopes: (H,) (one per query head) or lead_shape (one per batch and head).
    (The FA library's causal kernels add +slope * j instead, which differs by a constant per row: the same
    softmax, but another lse. This course keeps -slope * |i - j| everywhere.)"""
    pos = np.arange(nq)[:, None] + (nk - nq if align == "bottom_right" else 0)
    dist = np.abs(pos - np.arange(nk)[None, :])
    slopes = np.broadcast_to(np.asarray(slopes, np.float64), tuple(lead_shape))
    return -slopes[..., None, None] * dist


def dropout_scale(seed, p, lead_shape, nq, nk):
    """Z / (1 - p) of shape lead_shape + (Nq, Nk): 0 for a dropped P entry, 1 / (1 - p) for a kept one.
    Keyed by (seed, batch, head, row, col) as in flashlab.dropout, so every implementation draws the same."""
    b, h = batch_head_index(lead_shape)
    return keep_scale(seed, p, b, h, np.arange(nq)[:, None], np.arange(nk)[None, :])


def naive_attention(q, k, v, *, causal=False, scale=None, io=NO_IO):
    """Textbook attention: three separate steps, each reading its inputs from and writing its output to HBM.

    Materialises S and P (Nq x Nk each). Computes in float32 (float64 for float64 inputs) and returns o in
    the input dtype. Pass `io=HBMModel(...)` to count its memory traffic.
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale)
    ct = compute_dtype(q.dtype)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    io.start("naive", q.shape[:-2])

    # Step 1: S = Q K^T (one matmul kernel: read Q and K, write S)
    Q, K = io.read("Q", q).astype(ct), io.read("K", k).astype(ct)
    s = io.write("S", (Q @ np.swapaxes(K, -1, -2)) * ct.type(scale))
    io.flops(matmul=2 * nq * nk * d, other=nq * nk)
    if causal:
        s = np.where(causal_mask(nq, nk), s, -np.inf)

    # Step 2: P = softmax(S) (read S, write P), max-subtracted so large scores cannot overflow
    s = io.read("S", s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = io.write("P", p / p.sum(axis=-1, keepdims=True))
    io.flops(other=4 * nq * nk)  # max, subtract+exp, sum, divide

    # Step 3: O = P V (read P and V, write O)
    o = io.read("P", p) @ io.read("V", v).astype(ct)
    io.flops(matmul=2 * nq * nk * dv)
    return io.write("O", o).astype(q.dtype)


def naive_attention_backward(q, k, v, do, *, causal=False, scale=None, io=NO_IO):
    """The standard backward (arXiv 2205.14135, Algorithm 3): five steps, each through HBM. Returns (dq, dk, dv).

    It uses the P that the standard forward stored in HBM (recomputed here, but counted as read from HBM):
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(P * dP));  dQ = scale dS K;  dK = scale dS^T Q.
    dP and dS are Nq x Nk arrays written to and read back from HBM.
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale)
    do = as_float_array(do, "do")
    if do.shape != q.shape[:-1] + (v.shape[-1],):
        raise ValueError(f"do must have shape {q.shape[:-1] + (v.shape[-1],)} (that of o); got {do.shape}")
    ct = compute_dtype(q.dtype)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    io.start("naive_backward", q.shape[:-2])
    T = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    Q, K, V, dO = (x.astype(ct) for x in (q, k, v, do))
    s = (Q @ T(K)) * ct.type(scale)
    if causal:
        s = np.where(causal_mask(nq, nk), s, -np.inf)
    P = np.exp(s - s.max(axis=-1, keepdims=True))
    P /= P.sum(axis=-1, keepdims=True)  # as stored by the standard forward

    dV = io.write("dV", T(io.read("P", P)) @ io.read("dO", dO))
    dP = io.write("dP", io.read("dO", dO) @ T(io.read("V", V)))
    P_, dP_ = io.read("P", P), io.read("dP", dP)
    dS = io.write("dS", P_ * (dP_ - (P_ * dP_).sum(axis=-1, keepdims=True)))
    dQ = io.write("dQ", ct.type(scale) * (io.read("dS", dS) @ io.read("K", K)))
    dK = io.write("dK", ct.type(scale) * (T(io.read("dS", dS)) @ io.read("Q", Q)))
    io.flops(matmul=2 * nq * nk * (2 * dv + 2 * d), other=4 * nq * nk)
    return dQ.astype(q.dtype), dK.astype(q.dtype), dV.astype(q.dtype)
