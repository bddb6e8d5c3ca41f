"""How long a ring step takes: compute against transfer (lesson 19). A model, not a measurement.

At each step a rank computes attention of its c = N/W queries against c keys, 4 c^2 d FLOPs per head (half of
that under a causal mask with the zigzag layout), while it sends a K/V shard of 2 c d numbers per KV head to
the next rank. The step takes the longer of the two when the transfer overlaps the compute. Both grow with c,
the compute faster: past a crossover c* the link keeps up and the ring is compute-bound. The head dimension
cancels: c* = itemsize * flops / (2 * bandwidth) * (H_kv / H), doubled under a causal mask.

    ring_bytes(...)        bytes one rank sends in a forward and in a backward
    hiding_length(...)     the total N at which the link keeps up with the compute
    timeline(...)          when each rank computes and receives, step by step (the explorer draws it)
    at_scale(...)          8 to 1024 GPUs: NVLink inside a node, InfiniBand between nodes, memory per GPU
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hardware import LINKS
from ..roofline import PUBLISHED
from .layout import causal_work

#: FlashAttention-3's forward on an H100 in FP16: 740 TFLOP/s, 75% of the 989 TFLOP/s peak (arXiv 2407.08608,
#: abstract): what "H100-class compute" means in at_scale.
H100_ATTENTION_FLOPS = 740e12
H100_PEAK = PUBLISHED["H100"].peak_flops
H100_MEMORY = 80e9  # bytes of HBM3 (H100 SXM datasheet)
GPUS_PER_NODE = 8  # a DGX / HGX H100 node


def step_flops(tokens, d, heads=1, work=1.0):
    """FLOPs of one ring step's forward on one rank: Q K^T and P V, 2 c^2 d each, per head, times the share
    of the block a causal mask leaves (1 without a mask, 1/2 with zigzag)."""
    return 4.0 * tokens**2 * d * heads * work


def step_bytes(tokens, d, kv_heads=1, itemsize=2):
    """Bytes of the K/V shard a rank sends at a step of the forward: K and V, c x d each, per KV head."""
    return 2.0 * tokens * d * kv_heads * itemsize


def ring_bytes(N, world_size, batch, kv_heads, d, itemsize, grad_itemsize=4):
    """(forward, backward) bytes one rank sends. Forward: its K/V shard travels W - 1 times. Backward: K/V again
    W - 1 times, and the dK/dV buffer (in grad_itemsize bytes per number) W times, the last send bringing it
    home. One rank sends nothing."""
    shard = 2.0 * batch * kv_heads * (N / world_size) * d  # numbers in K and V of one shard
    forward = (world_size - 1) * shard * itemsize
    backward = forward + (world_size * shard * grad_itemsize if world_size > 1 else 0.0)
    return forward, backward


def hiding_length(world_size, heads, kv_heads, itemsize, peak_flops, bandwidth, causal=False):
    """The total sequence length N at which one ring step's compute takes as long as its transfer: with
    c = N / W tokens per rank, 4 c^2 d H w / flops = 2 c d H_kv itemsize / bandwidth, w = 1/2 under a causal
    mask (zigzag). Longer sequences hide the transfers under the compute."""
    work = 0.5 if causal else 1.0
    tokens = itemsize * peak_flops * kv_heads / (2.0 * bandwidth * heads * work)
    return world_size * tokens


@dataclass
class Timeline:
    """Per rank (rows) and step (columns), in seconds: when the step's compute starts and ends, and when the
    shard the rank needs for the next step has arrived (inf where none is sent)."""

    start: np.ndarray
    end: np.ndarray
    arrived: np.ndarray
    compute: np.ndarray  # seconds of compute per rank and step
    transfer: float  # seconds of one shard's transfer

    @property
    def total(self) -> float:
        return float(self.end[:, -1].max())


def timeline(world_size, N, d, heads=1, kv_heads=1, itemsize=2, flops=H100_ATTENTION_FLOPS, bandwidth=450e9,
             layout="zigzag", causal=True, latency=0.0):
    """When every rank computes and receives, under the model: a step starts when the rank has finished the
    previous step's compute and received the shard; a transfer starts when both ends have started the step
    before it (the sender holds the shard, the receiver has posted its receive), and lasts
    latency + bytes / bandwidth."""
    w = world_size
    c = N / w
    work = causal_work(w, layout, causal) if causal else np.ones((w, w))
    compute = step_flops(c, d, heads) * work / flops
    transfer = latency + step_bytes(c, d, kv_heads, itemsize) / bandwidth
    start, end, arrived = np.zeros((w, w)), np.zeros((w, w)), np.full((w, w), np.inf)
    for t in range(w):
        for r in range(w):
            ready = 0.0 if t == 0 else max(end[r, t - 1], arrived[r, t - 1])
            start[r, t] = ready
            end[r, t] = ready + compute[r, t]
        if t < w - 1:
            for r in range(w):
                arrived[r, t] = max(start[(r - 1) % w, t], start[r, t]) + transfer
    return Timeline(start, end, arrived, compute, transfer)


#: A model the size of Llama 2 7B (Touvron et al., arXiv 2307.09288): 32 layers, width 4096, 32 heads of 128.
LLAMA_7B = dict(layers=32, width=4096, heads=32, kv_heads=32, d=128, params=6.7e9)


def tokens_per_gpu(world_size, layers, width, params, memory=H100_MEMORY, **_):
    """The most tokens one GPU can hold while training, in this model: the weights, their gradients and
    Adam's states (16 bytes per parameter in mixed precision) are sharded over the W GPUs (as FSDP / ZeRO-3
    does), and with full activation recomputation a token keeps its bf16 input to every layer (2 x width bytes
    per layer) plus the activations of the one layer being recomputed, 34 x width bytes (Korthikanti et al.,
    arXiv 2205.05198, Table 2, whose attention-score term FlashAttention removes)."""
    free = memory - 16.0 * params / world_size
    per_token = 2.0 * width * layers + 34.0 * width
    return max(free, 0.0) / per_token


def at_scale(N, gpus=(8, 16, 32, 64, 128, 256, 512, 1024), model=LLAMA_7B, itemsize=2, causal=True,
             flops=H100_ATTENTION_FLOPS):
    """Per number of GPUs W: one ring step of one attention layer's forward for a sequence of N tokens.
    Inside one node the ring runs on NVLink; across nodes every step waits for its slowest hop, InfiniBand.
    Returns a list of dicts (W, link, tokens per GPU, compute and transfer seconds, step, bound, fits)."""
    rows = []
    for w in gpus:
        link = LINKS["NVLink 4"] if w <= GPUS_PER_NODE else LINKS["InfiniBand NDR"]
        c = N / w
        compute = step_flops(c, model["d"], model["heads"], 0.5 if causal else 1.0) / flops
        transfer = step_bytes(c, model["d"], model["kv_heads"], itemsize) / link.bandwidth
        rows.append(dict(W=w, link=link.name, bandwidth=link.bandwidth, tokens=c, compute_s=compute,
                         transfer_s=transfer, step_s=max(compute, transfer),
                         bound="compute" if compute >= transfer else "link",
                         crossover_tokens=hiding_length(1, model["heads"], model["kv_heads"], itemsize, flops,
                                                        link.bandwidth, causal),
                         max_tokens=tokens_per_gpu(w, **model), fits=c <= tokens_per_gpu(w, **model)))
    return rows
