"""Ground truth and the textbook algorithm.

reference_attention: float64, used by every test and checker as the answer.
naive_attention: the three steps S = QK^T, P = softmax(S), O = PV, materialising S and P (N x N each).
"""
from __future__ import annotations

import numpy as np

from ._inputs import as_float_array, causal_mask, check_attention_inputs, compute_dtype
from .iomodel import NO_IO


def reference_attention(q, k, v, *, causal=False, scale=None):
    """Exact attention in float64. Returns (o, lse), both float64.

    lse[..., i] = log(sum_j exp(S[..., i, j])) over the scaled, masked scores S of query row i.
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale)
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        s = np.where(causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # every row sees key 0, so m is finite
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = (p / l) @ v
    lse = (m + np.log(l))[..., 0]
    return o, lse


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
