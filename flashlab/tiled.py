"""FlashAttention in NumPy: FA1 and FA2 forward, FA2 backward.

Each function is written the way the papers write it, block by block, with the same names:
Q_i, O_i, m_i, l_i (a block of block_q = Br query rows) and K_j, V_j (a block of block_k = Bc keys).
The leading (batch, head) dims ride along in every array, so one Python loop serves all heads.

Numerical safety: a row that has seen no unmasked key yet has m = -inf. Exponents are taken relative to
`m_safe` (m with -inf replaced by 0), so exp(-inf - m_safe) = 0 and no -inf - (-inf) = NaN ever appears.

Every function takes `io` (see iomodel.py): the HBM reads and writes it reports are those of the loops
below, which is how lessons 04-06 count memory traffic.
"""
from __future__ import annotations

import numpy as np

from ._inputs import causal_mask, check_attention_inputs, check_backward_inputs, check_block, compute_dtype
from .iomodel import DEFAULT_SRAM, NO_IO, default_block_sizes


def _blocks(q, v, block_q, block_k, io, backward=False):
    """Resolve block sizes: explicit ones are checked; missing ones follow the paper's SRAM rule for the
    io model's M when it has one (so a smaller SRAM gets smaller tiles), else for DEFAULT_SRAM."""
    block_q, block_k = check_block(block_q, "block_q"), check_block(block_k, "block_k")
    M = getattr(io, "M", None) or DEFAULT_SRAM
    br, bc = default_block_sizes(max(q.shape[-1], v.shape[-1]), M, backward=backward)
    return block_q or br, block_k or bc


def _last_row(q0, br, nq):
    return min(q0 + br, nq) - 1


def _scores(Q_i, K_j, scale, causal, q0, k0, io):
    """S_ij = scale * Q_i K_j^T, with keys after the query masked to -inf when causal."""
    S = (Q_i @ np.swapaxes(K_j, -1, -2)) * Q_i.dtype.type(scale)
    br, bc, d = Q_i.shape[-2], K_j.shape[-2], Q_i.shape[-1]
    io.flops(matmul=2 * br * bc * d, other=br * bc)
    if causal and k0 + bc - 1 > q0:  # the block reaches above the diagonal
        S = np.where(causal_mask(br, bc, q0, k0), S, -np.inf)
    return S


def _safe(m):
    return np.where(np.isneginf(m), 0, m)


def flash_attention_v1(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None, io=NO_IO):
    """FlashAttention-1 forward (arXiv 2205.14135, Algorithm 1). Returns (o, lse).

    Loop order: outer over K/V blocks j, inner over Q blocks i. O, l and m live in HBM and are read back
    and rewritten on every inner step, and O_i is renormalised by 1/l every time.
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale)
    br, bc = _blocks(q, v, block_q, block_k, io)
    ct = compute_dtype(q.dtype)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    batch = q.shape[:-2]
    io.start("fa1", batch)

    # Algorithm 1, line 2: initialise O = 0, l = 0, m = -inf in HBM.
    O = io.write("O", np.zeros(batch + (nq, dv), ct))
    l = io.write("l", np.zeros(batch + (nq,), ct))
    m = io.write("m", np.full(batch + (nq,), -np.inf, ct))

    for k0 in range(0, nk, bc):
        q_starts = [q0 for q0 in range(0, nq, br) if not causal or k0 <= _last_row(q0, br, nq)]
        if not q_starts:  # causal: no query sees this key block, nor any later one
            break
        K_j = io.read("K", k[..., k0:k0 + bc, :]).astype(ct)
        V_j = io.read("V", v[..., k0:k0 + bc, :]).astype(ct)
        for q0 in q_starts:
            rows = slice(q0, q0 + br)
            Q_i = io.read("Q", q[..., rows, :]).astype(ct)
            O_i, l_i, m_i = io.read("O", O[..., rows, :]), io.read("l", l[..., rows]), io.read("m", m[..., rows])
            S = _scores(Q_i, K_j, scale, causal, q0, k0, io)
            io.sram(Q_i=Q_i.shape[-2:], K_j=K_j.shape[-2:], V_j=V_j.shape[-2:], O_i=O_i.shape[-2:],
                    S_ij=S.shape[-2:], m_i=m_i.shape[-1:], l_i=l_i.shape[-1:])

            m_new = np.maximum(m_i, S.max(axis=-1))
            P = np.exp(S - _safe(m_new)[..., None])
            alpha = np.exp(m_i - _safe(m_new))  # how much the old statistics shrink
            l_new = alpha * l_i + P.sum(axis=-1)
            # FA1 keeps O_i normalised after every step: undo the old 1/l_i, add P V_j, divide by l_new.
            denom = np.where(l_new > 0, l_new, 1)[..., None]  # rows with no visible key so far stay 0
            O_i = ((l_i * alpha)[..., None] * O_i + P @ V_j) / denom
            br_, bc_ = S.shape[-2:]
            io.flops(matmul=2 * br_ * bc_ * dv, other=4 * br_ * bc_ + 3 * br_ * dv + 6 * br_)

            O[..., rows, :] = io.write("O", O_i)
            l[..., rows] = io.write("l", l_new)
            m[..., rows] = io.write("m", m_new)

    lse = io.write("lse", io.read("m", m) + np.log(io.read("l", l)))
    return O.astype(q.dtype), lse


def flash_attention_v2(q, k, v, *, causal=False, scale=None, block_q=None, block_k=None, io=NO_IO, round_p=None):
    """FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1). Returns (o, lse).

    Loop order: outer over Q blocks i (independent, so they can run in parallel), inner over K/V blocks
    j. O_i, m_i, l_i stay on chip; O_i is left unnormalised until the end and written to HBM once.
    Under causal masking, key blocks entirely after the block's last query are never visited.
    round_p: optional function applied to each tile of P before P V_j, as a low-precision kernel rounds
    its matmul operand (flashlab.fp8 simulates FA3's FP8 P); the row sums l use the unrounded P.
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale)
    br, bc = _blocks(q, v, block_q, block_k, io)
    ct = compute_dtype(q.dtype)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    batch = q.shape[:-2]
    io.start("fa2", batch)
    o = np.empty(batch + (nq, dv), q.dtype)
    lse = np.empty(batch + (nq,), ct)

    for q0 in range(0, nq, br):
        rows = slice(q0, q0 + br)
        Q_i = io.read("Q", q[..., rows, :]).astype(ct)
        n_rows = Q_i.shape[-2]
        O_i = np.zeros(batch + (n_rows, dv), ct)
        l_i = np.zeros(batch + (n_rows,), ct)
        m_i = np.full(batch + (n_rows,), -np.inf, ct)
        k_end = min(nk, _last_row(q0, br, nq) + 1) if causal else nk
        for k0 in range(0, k_end, bc):
            K_j = io.read("K", k[..., k0:k0 + bc, :]).astype(ct)
            V_j = io.read("V", v[..., k0:k0 + bc, :]).astype(ct)
            S = _scores(Q_i, K_j, scale, causal, q0, k0, io)
            io.sram(Q_i=Q_i.shape[-2:], K_j=K_j.shape[-2:], V_j=V_j.shape[-2:], O_i=O_i.shape[-2:],
                    S_ij=S.shape[-2:], m_i=m_i.shape[-1:], l_i=l_i.shape[-1:])

            m_new = np.maximum(m_i, S.max(axis=-1))
            P = np.exp(S - _safe(m_new)[..., None])
            alpha = np.exp(m_i - _safe(m_new))
            l_i = alpha * l_i + P.sum(axis=-1)
            P_mm = P if round_p is None else round_p(P).astype(ct, copy=False)
            O_i = alpha[..., None] * O_i + P_mm @ V_j  # unnormalised: no division inside the loop
            m_i = m_new
            bc_ = S.shape[-1]
            io.flops(matmul=2 * n_rows * bc_ * dv, other=4 * n_rows * bc_ + 2 * n_rows * dv + 4 * n_rows)

        # One normalisation per row, at the end. Every row saw key 0, so l_i > 0.
        io.flops(other=n_rows * dv + 2 * n_rows)
        o[..., rows, :] = io.write("O", O_i / l_i[..., None])
        lse[..., rows] = io.write("lse", m_i + np.log(l_i))
    return o, lse


def flash_attention_v2_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_q=None, block_k=None, io=NO_IO):
    """FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2). Returns (dq, dk, dv).

    P is recomputed block by block from the saved lse (P_ij = exp(S_ij - lse_i)); no Nq x Nk array exists.
    D = rowsum(dO * O) replaces the row sums of P * dP in the softmax gradient. Outer loop over K/V
    blocks (each owns its dK_j, dV_j), inner over Q blocks; dQ accumulates in HBM.
    """
    q, k, v, o, lse, do, causal, scale = check_backward_inputs(q, k, v, o, lse, do, causal=causal, scale=scale)
    br, bc = _blocks(q, v, block_q, block_k, io, backward=True)
    ct = compute_dtype(q.dtype)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = q.shape[:-2]
    io.start("fa2_backward", batch)

    D = io.write("D", np.sum(io.read("dO", do).astype(ct) * io.read("O", o).astype(ct), axis=-1))
    io.flops(other=2 * nq * dv)
    dQ = io.write("dQ", np.zeros(batch + (nq, d), ct))
    dK = np.empty(batch + (nk, d), q.dtype)
    dV = np.empty(batch + (nk, dv), q.dtype)
    lse = lse.astype(ct)

    for k0 in range(0, nk, bc):
        cols = slice(k0, k0 + bc)
        n_cols = min(k0 + bc, nk) - k0
        dK_j = np.zeros(batch + (n_cols, d), ct)
        dV_j = np.zeros(batch + (n_cols, dv), ct)
        q_starts = [q0 for q0 in range(0, nq, br) if not causal or k0 <= _last_row(q0, br, nq)]
        if q_starts:  # otherwise no query sees these keys: their gradients are zero
            K_j = io.read("K", k[..., cols, :]).astype(ct)
            V_j = io.read("V", v[..., cols, :]).astype(ct)
        for q0 in q_starts:
            rows = slice(q0, q0 + br)
            Q_i = io.read("Q", q[..., rows, :]).astype(ct)
            dO_i = io.read("dO", do[..., rows, :]).astype(ct)
            lse_i, D_i = io.read("lse", lse[..., rows]), io.read("D", D[..., rows])
            S = _scores(Q_i, K_j, scale, causal, q0, k0, io)
            io.sram(K_j=K_j.shape[-2:], V_j=V_j.shape[-2:], dK_j=dK_j.shape[-2:], dV_j=dV_j.shape[-2:],
                    Q_i=Q_i.shape[-2:], dO_i=dO_i.shape[-2:], dQ_i=Q_i.shape[-2:],
                    S_ij=S.shape[-2:], dP_ij=S.shape[-2:], lse_i=lse_i.shape[-1:], D_i=D_i.shape[-1:])

            P = np.exp(S - lse_i[..., None])  # masked entries: exp(-inf) = 0
            dV_j += np.swapaxes(P, -1, -2) @ dO_i
            dP = dO_i @ np.swapaxes(V_j, -1, -2)
            dS = P * (dP - D_i[..., None])
            dQ[..., rows, :] = io.write("dQ", io.read("dQ", dQ[..., rows, :]) + ct.type(scale) * (dS @ K_j))
            dK_j += ct.type(scale) * (np.swapaxes(dS, -1, -2) @ Q_i)
            r, c = S.shape[-2:]
            io.flops(matmul=2 * r * c * (dv + dv + d + d), other=5 * r * c + 2 * r * d + c * d)
        dK[..., cols, :] = io.write("dK", dK_j)
        dV[..., cols, :] = io.write("dV", dV_j)
    return dQ.astype(q.dtype), dK, dV
