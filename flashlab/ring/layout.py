"""Which tokens of a sequence each rank holds: the layouts of ring attention (lesson 19).

The sequence of N tokens is cut into equal chunks; each rank holds some of them, in increasing order:

    contiguous   W chunks of N/W tokens; rank r holds chunk r.
    zigzag       2W chunks of N/(2W) tokens; rank r holds chunks r and 2W-1-r. Under a causal mask the
                 early chunk sees few keys and the late one many, so every rank gets the same work.

`shard` and `unshard` work on NumPy arrays and torch tensors alike, along the sequence axis (-2) of
(..., N, d). Nothing here imports torch.
"""
from __future__ import annotations

import numbers

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
    return layout


def _check_int(value, name, low=0):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    return int(value)


def num_chunks(world_size: int, layout: str = "zigzag") -> int:
    """How many equal chunks the sequence is cut into: W (contiguous) or 2W (zigzag)."""
    world_size = _check_int(world_size, "world_size", 1)
    return world_size * (2 if check_layout(layout) == "zigzag" else 1)


def rank_chunks(rank: int, world_size: int, layout: str = "zigzag") -> tuple:
    """The chunks rank `rank` holds, in increasing order (so its tokens stay in sequence order)."""
    world_size = _check_int(world_size, "world_size", 1)
    rank = _check_int(rank, "rank")
    if rank >= world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} for world_size {world_size}; got {rank}")
    if check_layout(layout) == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def check_length(n: int, world_size: int, layout: str = "zigzag") -> int:
    """The chunk size N / chunks, or a ValueError that names the rule."""
    chunks = num_chunks(world_size, layout)
    n = _check_int(n, "the sequence length N", 1)
    if n % chunks:
        rule = ("N divisible by 2 * world_size (two chunks per rank)" if layout == "zigzag"
                else "N divisible by world_size")
        raise ValueError(f"the {layout} layout needs {rule}: N = {n}, world_size = {world_size}, and "
                         f"{n} % {chunks} = {n % chunks}. Pad the sequence or choose another world size.")
    return n // chunks


def shard_indices(n: int, rank: int, world_size: int, layout: str = "zigzag") -> np.ndarray:
    """The positions in the full sequence of the tokens rank `rank` holds, in the order it holds them."""
    c = check_length(n, world_size, layout)
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in rank_chunks(rank, world_size, layout)])


def _take(x, idx):
    if type(x).__module__.startswith("torch"):
        import torch

        return x.index_select(-2, torch.as_tensor(idx, device=x.device))
    return np.take(np.asarray(x), idx, axis=-2)


def _seq_len(x) -> int:
    if getattr(x, "ndim", 0) < 2:
        raise ValueError(f"expected an array of shape (..., N, d) with the sequence on axis -2; got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    return int(x.shape[-2])


def shard(x, rank: int, world_size: int, layout: str = "zigzag"):
    """This rank's part of x (..., N, d): the tokens `shard_indices` names, along axis -2.

    For a torch tensor the result is differentiable (an index_select), so a gradient flows back to x.
    """
    return _take(x, shard_indices(_seq_len(x), rank, world_size, layout))


def unshard(shards, layout: str = "zigzag"):
    """The full (..., N, d) from the shards of ranks 0, 1, ..., W-1 (a list, in rank order)."""
    shards = list(shards)
    if not shards:
        raise ValueError("unshard needs the list of every rank's shard, in rank order; got an empty list")
    world_size = len(shards)
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"every rank's shard must have the same shape; got {[tuple(s.shape) for s in shards]}")
    n = _seq_len(shards[0]) * world_size
    order = np.concatenate([shard_indices(n, r, world_size, layout) for r in range(world_size)])
    inverse = np.argsort(order)  # position p of the full sequence sits at inverse[p] of the concatenation
    if type(shards[0]).__module__.startswith("torch"):
        import torch

        return _take(torch.cat(shards, dim=-2), inverse)
    return _take(np.concatenate(shards, axis=-2), inverse)


def visible_chunks(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How query chunk `q_chunk` sees key chunk `k_chunk`: "full", "diagonal" (causal, the same chunk:
    query i sees keys j <= i) or "none" (causal, every key after every query)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "none"


def causal_work(world_size: int, layout: str = "zigzag", causal: bool = True) -> np.ndarray:
    """(W ranks, W steps): the fraction of one full (N/W x N/W) block of scores each rank computes at each
    ring step, when at step t rank r holds the keys of rank (r - t) mod W. A diagonal chunk counts half."""
    per = num_chunks(world_size, layout) // world_size
    work = np.zeros((world_size, world_size))
    for r in range(world_size):
        for t in range(world_size):
            s = (r - t) % world_size
            for qc in rank_chunks(r, world_size, layout):
                for kc in rank_chunks(s, world_size, layout):
                    kind = visible_chunks(qc, kc, causal)
                    work[r, t] += {"full": 1.0, "diagonal": 0.5, "none": 0.0}[kind] / per**2
    return work
