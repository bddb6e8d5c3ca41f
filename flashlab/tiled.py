"""FlashAttention in NumPy: FA1 and FA2 forward, FA2 backward.

Each function is written the way the papers write it, block by block, with the same names:
Q_i, O_i, m_i, l_i (a block of block_q = Br query rows) and K_j, V_j (a block of block_k = Bc keys).
The leading (batch, head) dims ride along in every array, so one Python loop serves all heads.

Numerical safety: a row that has seen no unmasked key yet has m = -inf. Exponents are taken relative to
`m_safe` (m with -inf replaced by 0), so exp(-inf - m_safe) = 0 and no -inf - (-inf) = NaN ever appears.

FA2 (forward and backward) also takes the FlashAttention library's options: GQA/MQA (k, v with H_kv heads),
window_size, align, alibi_slopes, softcap, dropout_p and seed (see reference_attention for their meaning).
They enter only through `_Masking`: which key blocks a query block visits, and what happens to each tile
of S. A row that sees no key ends with o = 0 and lse = +inf, as in the FA library.

Every function takes `io` (see iomodel.py): the HBM reads and writes it reports are those of the loops
below, which is how lessons 04-06 count memory traffic.
"""
from __future__ import annotations

import numpy as np

from ._inputs import (causal_mask, check_attention_inputs, check_backward_inputs, check_block, check_options,
                      compute_dtype)
from .dropout import batch_head_index, keep_scale
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


class _Masking:
    """The options, tile by tile. Query i sits at position i + off among the keys and sees keys j with
    pos - left <= j <= pos + right (None = unbounded; causal sets right = 0). Because that band only moves
    right as i grows, the keys seen by a block of rows [q0, q1) lie in one range, and the loops skip every
    key block outside it (`key_range`).

    Each tile of S goes through the FA library's order (flash_attn's kernels, read in csrc/flash_attn/src:
    apply_softcap right after the Q K^T product, with scale/softcap folded into one factor; then
    Mask::apply_mask adds ALiBi and sets -inf outside the causal/local band, with the ALiBi slope divided by
    the softmax scale so that the bias itself is unscaled): scale, softcap, ALiBi bias, mask."""

    def __init__(self, opt, lead, grouped_lead, nq, nk, batch_offset=0):
        self.opt, self.nq, self.nk = opt, nq, nk
        self.off = opt.offset(nq, nk)
        self.left, self.right = opt.bounds()
        reshape = lambda x: np.broadcast_to(x, tuple(lead) + x.shape[-2:]).reshape(grouped_lead + x.shape[-2:])  # noqa: E731
        self.slopes = None
        if opt.alibi is not None:
            self.slopes = reshape(np.broadcast_to(opt.alibi, tuple(lead))[..., None, None])
        if opt.dropout_p > 0:  # the dropout key uses the query head h, also under GQA
            self.batch, self.head = (reshape(x) for x in batch_head_index(lead))
            self.batch = self.batch + batch_offset

    def key_range(self, q0, q1):
        """[lo, hi): the keys seen by at least one of the rows q0 .. q1-1 (empty when hi <= lo)."""
        lo = 0 if self.left is None else max(0, q0 + self.off - self.left)
        hi = self.nk if self.right is None else min(self.nk, q1 - 1 + self.off + self.right + 1)
        return lo, hi

    def mask(self, q0, k0, r, c):
        """Boolean (r, c) mask of the tile at rows q0.., keys k0.., or None when it hides nothing."""
        first, last = q0 + self.off, q0 + self.off + r - 1  # positions of the tile's first and last rows
        if (self.left is None or k0 >= last - self.left) and (self.right is None or k0 + c - 1 <= first + self.right):
            return None  # the whole tile lies inside the band (most tiles: no mask to build)
        pos = q0 + self.off + np.arange(r)[:, None]
        j = k0 + np.arange(c)[None, :]
        keep = np.ones((r, c), bool)
        if self.left is not None:
            keep &= j >= pos - self.left
        if self.right is not None:
            keep &= j <= pos + self.right
        return None if keep.all() else keep

    def scores(self, Q_i, K_j, q0, k0, io):
        """S_ij: scale, softcap, ALiBi bias and mask. Also returns tanh(S / softcap) for the backward."""
        ct = Q_i.dtype.type
        S = (Q_i @ np.swapaxes(K_j, -1, -2)) * ct(self.opt.scale)
        r, c, d = S.shape[-2], S.shape[-1], Q_i.shape[-1]
        io.flops(matmul=2 * r * c * d, other=r * c)
        T = None
        if self.opt.softcap > 0:
            T = np.tanh(S / ct(self.opt.softcap))
            S = ct(self.opt.softcap) * T
        if self.slopes is not None:
            dist = np.abs(q0 + self.off + np.arange(r)[:, None] - (k0 + np.arange(c))[None, :])
            S = S - (self.slopes * dist).astype(S.dtype)
        keep = self.mask(q0, k0, r, c)
        if keep is not None:
            S = np.where(keep, S, -np.inf)
        return S, T

    def dropout(self, q0, k0, r, c, dtype):
        """Z / (1 - p) for the tile, regenerated from (seed, batch, head, row, col); None without dropout."""
        if self.opt.dropout_p == 0:
            return None
        rows, cols = q0 + np.arange(r)[:, None], k0 + np.arange(c)[None, :]
        return keep_scale(self.opt.seed, self.opt.dropout_p, self.batch, self.head, rows, cols).astype(dtype)


def _group(q, k, v):
    """GQA without copies: q viewed as (..., H_kv, G, N, d), k and v as (..., H_kv, 1, N, d) (broadcast views),
    so query head h = h_kv * G + g meets KV head h_kv = h // G. Equal heads: the arrays as they are."""
    if q.ndim < 4 or q.shape[-3] == k.shape[-3]:
        return q, k, v, False
    h_kv = k.shape[-3]
    qg = q.reshape(q.shape[:-3] + (h_kv, q.shape[-3] // h_kv) + q.shape[-2:])
    return qg, k[..., None, :, :], v[..., None, :, :], True


def _options(q, causal, scale, kw):
    return check_options(q.shape, causal=causal, scale=scale, **kw)


def flash_attention_v2(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), align="top_left",
                       alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0,
                       block_q=None, block_k=None, io=NO_IO, round_p=None):
    """FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1). Returns (o, lse).

    Loop order: outer over Q blocks i (independent, so they can run in parallel), inner over K/V blocks
    j. O_i, m_i, l_i stay on chip; O_i is left unnormalised until the end and written to HBM once.
    Key blocks entirely outside the causal/window band of a query block are never visited.
    Options as in reference_attention (GQA, window_size, align, alibi_slopes, softcap, dropout_p, seed).
    round_p: optional function applied to each tile of P before P V_j, as a low-precision kernel rounds
    its matmul operand (flashlab.fp8 simulates FA3's FP8 P); the row sums l use the unrounded P.
    """
    q, k, v, causal, scale = check_attention_inputs(q, k, v, causal=causal, scale=scale, gqa=True)
    opt = _options(q, causal, scale, dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes,
                                          softcap=softcap, dropout_p=dropout_p, seed=seed))
    return _fa2_forward(q, k, v, opt, *_blocks(q, v, block_q, block_k, io), io=io, round_p=round_p)


def _fa2_forward(q, k, v, opt, br, bc, io=NO_IO, round_p=None, batch_offset=0):
    """The FA2 forward on checked inputs; batch_offset shifts the dropout key's batch index (varlen)."""
    ct = compute_dtype(q.dtype)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    qg, kg, vg, _ = _group(q, k, v)
    batch = qg.shape[:-2]
    masking = _Masking(opt, q.shape[:-2], batch, nq, nk, batch_offset)
    io.start("fa2", q.shape[:-2])
    o = np.empty(batch + (nq, dv), q.dtype)
    lse = np.empty(batch + (nq,), ct)

    for q0 in range(0, nq, br):
        rows = slice(q0, q0 + br)
        Q_i = io.read("Q", qg[..., rows, :]).astype(ct)
        n_rows = Q_i.shape[-2]
        O_i = np.zeros(batch + (n_rows, dv), ct)
        l_i = np.zeros(batch + (n_rows,), ct)
        m_i = np.full(batch + (n_rows,), -np.inf, ct)
        lo, hi = masking.key_range(q0, q0 + n_rows)
        for k0 in range(lo - lo % bc, hi, bc):  # only the key blocks that meet the band
            K_j = io.read("K", kg[..., k0:k0 + bc, :]).astype(ct)
            V_j = io.read("V", vg[..., k0:k0 + bc, :]).astype(ct)
            S, _ = masking.scores(Q_i, K_j, q0, k0, io)
            io.sram(Q_i=Q_i.shape[-2:], K_j=K_j.shape[-2:], V_j=V_j.shape[-2:], O_i=O_i.shape[-2:],
                    S_ij=S.shape[-2:], m_i=m_i.shape[-1:], l_i=l_i.shape[-1:])

            m_new = np.maximum(m_i, S.max(axis=-1))
            P = np.exp(S - _safe(m_new)[..., None])
            alpha = np.exp(m_i - _safe(m_new))
            l_i = alpha * l_i + P.sum(axis=-1)  # l sums the undropped P: dropout acts after the softmax
            Z = masking.dropout(q0, k0, *S.shape[-2:], ct)
            P_mm = P if Z is None else P * Z
            P_mm = P_mm if round_p is None else round_p(P_mm).astype(ct, copy=False)
            O_i = alpha[..., None] * O_i + P_mm @ V_j  # unnormalised: no division inside the loop
            m_i = m_new
            bc_ = S.shape[-1]
            io.flops(matmul=2 * n_rows * bc_ * dv, other=4 * n_rows * bc_ + 2 * n_rows * dv + 4 * n_rows)

        # One normalisation per row, at the end. A row that saw no key (l = 0) gets o = 0 and lse = +inf.
        io.flops(other=n_rows * dv + 2 * n_rows)
        seen = l_i > 0
        l_safe = np.where(seen, l_i, 1)
        o[..., rows, :] = io.write("O", O_i / l_safe[..., None])
        lse[..., rows] = io.write("lse", np.where(seen, m_i + np.log(l_safe), np.inf))
    return o.reshape(q.shape[:-1] + (dv,)), lse.reshape(q.shape[:-1])


def flash_attention_v2_backward(q, k, v, o, lse, do, *, causal=False, scale=None, window_size=(-1, -1),
                                align="top_left", alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0,
                                block_q=None, block_k=None, io=NO_IO):
    """FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2). Returns (dq, dk, dv).

    P is recomputed block by block from the saved lse (P_ij = exp(S_ij - lse_i)); no Nq x Nk array exists.
    D = rowsum(dO * O) replaces the row sums of P * dP in the softmax gradient. Outer loop over K/V
    blocks (each owns its dK_j, dV_j), inner over Q blocks; dQ accumulates in HBM.
    Pass the forward's options. Dropout: the mask Z is regenerated from the seed, dV uses P * Z / (1-p)
    and dP is multiplied by the same Z / (1-p). Softcap: dS is multiplied by 1 - tanh^2. GQA: dK and dV
    of a KV head sum over the query heads of its group.
    """
    q, k, v, o, lse, do, causal, scale = check_backward_inputs(q, k, v, o, lse, do, causal=causal, scale=scale,
                                                                gqa=True, allow_empty_rows=True)
    opt = _options(q, causal, scale, dict(window_size=window_size, align=align, alibi_slopes=alibi_slopes,
                                          softcap=softcap, dropout_p=dropout_p, seed=seed))
    if opt.plain and np.any(np.isinf(lse)):  # without options every row sees a key: lse is finite
        raise ValueError("lse contains inf or NaN; pass the lse returned by the forward pass")
    return _fa2_backward(q, k, v, o, lse, do, opt, *_blocks(q, v, block_q, block_k, io, backward=True), io=io)


def _fa2_backward(q, k, v, o, lse, do, opt, br, bc, io=NO_IO, batch_offset=0):
    """The FA2 backward on checked inputs; batch_offset as in _fa2_forward."""
    ct = compute_dtype(q.dtype)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    qg, kg, vg, grouped = _group(q, k, v)
    batch = qg.shape[:-2]
    masking = _Masking(opt, q.shape[:-2], batch, nq, nk, batch_offset)
    do, o, lse = do.reshape(batch + (nq, dv)), o.reshape(batch + (nq, dv)), lse.reshape(batch + (nq,))
    group_sum = (lambda x: x.sum(axis=-3, keepdims=True)) if grouped else (lambda x: x)  # noqa: E731
    io.start("fa2_backward", q.shape[:-2])

    D = io.write("D", np.sum(io.read("dO", do).astype(ct) * io.read("O", o).astype(ct), axis=-1))
    io.flops(other=2 * nq * dv)
    dQ = io.write("dQ", np.zeros(batch + (nq, d), ct))
    dK = np.empty(kg.shape[:-2] + (nk, d), q.dtype)
    dV = np.empty(vg.shape[:-2] + (nk, dv), q.dtype)
    lse = lse.astype(ct)

    for k0 in range(0, nk, bc):
        cols = slice(k0, k0 + bc)
        n_cols = min(k0 + bc, nk) - k0
        dK_j = np.zeros(kg.shape[:-2] + (n_cols, d), ct)
        dV_j = np.zeros(vg.shape[:-2] + (n_cols, dv), ct)
        q_starts = [q0 for q0 in range(0, nq, br)  # the query blocks whose band meets these keys
                    if max(k0, masking.key_range(q0, min(q0 + br, nq))[0])
                    < min(k0 + n_cols, masking.key_range(q0, min(q0 + br, nq))[1])]
        if q_starts:  # otherwise no query sees these keys: their gradients are zero
            K_j = io.read("K", kg[..., cols, :]).astype(ct)
            V_j = io.read("V", vg[..., cols, :]).astype(ct)
        for q0 in q_starts:
            rows = slice(q0, q0 + br)
            Q_i = io.read("Q", qg[..., rows, :]).astype(ct)
            dO_i = io.read("dO", do[..., rows, :]).astype(ct)
            lse_i, D_i = io.read("lse", lse[..., rows]), io.read("D", D[..., rows])
            S, T = masking.scores(Q_i, K_j, q0, k0, io)
            io.sram(K_j=K_j.shape[-2:], V_j=V_j.shape[-2:], dK_j=dK_j.shape[-2:], dV_j=dV_j.shape[-2:],
                    Q_i=Q_i.shape[-2:], dO_i=dO_i.shape[-2:], dQ_i=Q_i.shape[-2:],
                    S_ij=S.shape[-2:], dP_ij=S.shape[-2:], lse_i=lse_i.shape[-1:], D_i=D_i.shape[-1:])

            P = np.exp(S - lse_i[..., None])  # masked entries: exp(-inf) = 0; rows with lse = +inf: 0
            Z = masking.dropout(q0, k0, *S.shape[-2:], ct)
            dV_j += group_sum(np.swapaxes(P if Z is None else P * Z, -1, -2) @ dO_i)
            dP = dO_i @ np.swapaxes(V_j, -1, -2)
            if Z is not None:
                dP = dP * Z  # the gradient reaches P only through the kept entries
            dS = P * (dP - D_i[..., None])
            if T is not None:
                dS = dS * (1 - T * T)  # d/ds of softcap * tanh(s / softcap)
            dQ[..., rows, :] = io.write("dQ", io.read("dQ", dQ[..., rows, :]) + ct.type(opt.scale) * (dS @ K_j))
            dK_j += group_sum(ct.type(opt.scale) * (np.swapaxes(dS, -1, -2) @ Q_i))
            r, c = S.shape[-2:]
            io.flops(matmul=2 * r * c * (dv + dv + d + d), other=5 * r * c + 2 * r * d + c * d)
        dK[..., cols, :] = io.write("dK", dK_j)
        dV[..., cols, :] = io.write("dV", dV_j)
    return dQ.astype(q.dtype).reshape(q.shape), dK.reshape(k.shape), dV.reshape(v.shape)
