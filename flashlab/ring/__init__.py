"""Ring attention (context parallelism): one sequence split across W ranks, K/V shards passed around a ring
(Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
arXiv 2310.01889). Lesson 19.

    from flashlab.ring import shard, unshard, ring_attention, run_ranks

    q_r = shard(q, rank, W)                      # this rank's tokens of (B, H, N, d), zigzag layout
    o_r = ring_attention(q_r, k_r, v_r, causal=True)
    o = unshard([o_0, o_1, ...])                 # back to (B, H, N, d)

    python -m flashlab.ring --world-size 4       # an example on 4 CPU processes (gloo)

layout.py   which tokens each rank holds (contiguous, zigzag), shard and unshard; no torch needed
attention.py  ring_attention on torch.distributed: forward, backward, the merge rule
processes.py  run_ranks: W processes on one machine, a failing rank stops them all; the example's worker
simulate.py   the same ring in NumPy, every rank in one process: what each rank computes at each step
model.py    the time of a ring step: compute against transfer, the crossover, a timeline, many GPUs

Only attention.py and processes.py import torch, and only when used: `import flashlab.ring` stays light.
"""
from .layout import (LAYOUTS, causal_work, check_length, num_chunks, rank_chunks, shard, shard_indices, unshard,
                     visible_chunks)
from .processes import RankFailed, run_ranks

__all__ = ["LAYOUTS", "causal_work", "check_length", "num_chunks", "rank_chunks", "shard", "shard_indices",
           "unshard", "visible_chunks", "ring_attention", "merge", "block_plan", "RingAttentionFunction",
           "run_ranks", "RankFailed"]

_FROM_ATTENTION = {"ring_attention", "merge", "block_plan", "RingAttentionFunction"}


def __getattr__(name):  # torch loads with the first use of ring_attention
    if name in _FROM_ATTENTION:
        from . import attention

        return getattr(attention, name)
    raise AttributeError(f"module 'flashlab.ring' has no attribute {name!r}")
