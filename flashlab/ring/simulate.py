"""Ring attention in NumPy, every rank in one process: what each rank computes at each step (lesson 19).

No processes and no torch: a loop over steps and ranks does what the W processes of `ring_attention` do,
so the lesson can show the algorithm, and the exercises' checkers can grade a rank's piece of it.

    parts = rank_partials(q, k, v, rank, W)      # [(o_t, lse_t) for t = 0..W-1]: one per key shard
    o, lse = ring_numpy(q, k, v, W)              # every rank merges its parts; the shards put back together
"""
from __future__ import annotations

import numpy as np

from ..reference import reference_attention
from .layout import check_length, shard, shard_indices, unshard


def block_partial(q, k, v, q_pos, k_pos, causal, scale=None):
    """(o, lse) of queries at positions q_pos against keys at positions k_pos (of the full sequence).
    A row that sees no key gets o = 0 and lse = -inf: the empty state, neutral in a merge."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)) * scale
    if causal:
        S = np.where(k_pos[None, :] <= q_pos[:, None], S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    P = np.exp(S - m)
    l = P.sum(axis=-1)
    seen = l > 0
    o = (P @ v.astype(np.float64)) / np.where(seen, l, 1)[..., None]
    return o, np.where(seen, m[..., 0] + np.log(np.where(seen, l, 1)), -np.inf)


def rank_partials(q, k, v, rank, world_size, layout="zigzag", causal=False, scale=None):
    """The (o, lse) rank `rank` computes at each ring step, in ring order: at step t it holds the K/V shard of
    rank (rank - t) mod W. q, k, v are the full (..., N, d) arrays; o_t has the rows of this rank's shard."""
    n = q.shape[-2]
    check_length(n, world_size, layout)
    q_pos = shard_indices(n, rank, world_size, layout)
    q_r = shard(q, rank, world_size, layout)
    parts = []
    for t in range(world_size):
        s = (rank - t) % world_size
        parts.append(block_partial(q_r, shard(k, s, world_size, layout), shard(v, s, world_size, layout), q_pos,
                                   shard_indices(n, s, world_size, layout), causal, scale))
    return parts


def merge_states(o_a, lse_a, o_b, lse_b):
    """The merge of lesson 03 in (o, lse) form; see flashlab.ring.attention.merge (the same in torch)."""
    m = np.maximum(lse_a, lse_b)
    m_safe = np.where(np.isinf(m), 0, m)
    w_a, w_b = np.exp(lse_a - m_safe), np.exp(lse_b - m_safe)
    l = w_a + w_b
    l_safe = np.where(l > 0, l, 1)
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / l_safe[..., None]
    return o, np.where(l > 0, m_safe + np.log(l_safe), -np.inf)


def ring_numpy(q, k, v, world_size, layout="zigzag", causal=False, scale=None):
    """Full (o, lse), computed as W ranks would: each merges its W partial results in ring order."""
    outs, lses = [], []
    for r in range(world_size):
        parts = rank_partials(q, k, v, r, world_size, layout, causal, scale)
        o, lse = parts[0]
        for o_t, lse_t in parts[1:]:
            o, lse = merge_states(o, lse, o_t, lse_t)
        outs.append(o)
        lses.append(lse)
    return unshard(outs, layout), unshard([x[..., None] for x in lses], layout)[..., 0]


def check_against_reference(q, k, v, world_size, layout="zigzag", causal=False):
    """Relative error of ring_numpy's o against flashlab.reference_attention (float64)."""
    o, _ = ring_numpy(q, k, v, world_size, layout, causal)
    ref, _ = reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=causal)
    return float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
