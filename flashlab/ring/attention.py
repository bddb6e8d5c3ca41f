"""Ring attention on torch.distributed: every rank keeps its queries, K/V shards travel around a ring.

    o = ring_attention(q, k, v, causal=True)     # this rank's shards in, this rank's shard of O out
    o.backward(do)                               # dq here; dk, dv travel home around the ring

W ranks each hold one shard of q, k and v (`flashlab.ring.shard`, a layout of lesson 19). At step t = 0..W-1
rank r holds the K/V shard of rank (r - t) mod W: it sends that shard on to rank r + 1 and receives the next
one from rank r - 1 (isend / irecv, started before the local block is computed, so the transfer can hide
under the compute), computes attention of its queries against the keys it holds, and merges the block's
(o, lse) into its running state with the rule of lessons 03 and 14. After W steps every query has met every
key: the result is exact attention, summed in another order.

The backward runs the same ring. Each rank keeps q, o, lse and dO; K, V travel as in the forward and with
them a buffer of dK, dV for that shard, to which every rank adds its block's share. After the last step one
more send brings every dK, dV buffer home. dQ stays on its rank.

Local blocks run on flashlab's FlashAttention-2: the Numba kernels for CUDA tensors, the NumPy code for CPU
tensors (through `flashlab.torch`), both of which return (o, lse) and take lse back for the backward. Under a
causal mask, a block whose keys all come after its queries is skipped, and the rank's own shard is masked
(its chunks are in sequence order, so the usual top-left mask is right). GQA: k and v may have fewer heads.

Communication: gloo for CPU tensors, NCCL for CUDA tensors; ranks are those of `group` (default: the world).
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..torch import _backward as _local_backward
from ..torch import _check_tensors
from ..torch import _forward as _local_forward
from .layout import check_layout, check_length, rank_chunks, visible_chunks

#: Set to a list to record every forward step of this process as (step, compute seconds, seconds waiting for
#: the next shard, CPU seconds this process spent computing): benchmarks/timing/bench_ring.py does, to split
#: a step into its compute and its wait. On a CPU shared by more processes than cores, the CPU seconds are the
#: work itself, the wall-clock seconds also the turns the process waited for a core.
TRACE = None

#: Set to a list to record, for CUDA tensors, every step of this process as (direction, step, start, computed,
#: received): torch.cuda.Event's recorded on the current stream when the step starts, when its local compute has
#: been queued and after the wait for the transfers (benchmarks/timing/bench_ring_gpus.py reads
#: start.elapsed_time(computed) as compute and computed.elapsed_time(received) as the stream's wait). direction
#: is "forward" or "backward".
EVENTS = None

_LAYOUT_CODE = {"contiguous": 0, "zigzag": 1}
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


# ---------------------------------------------------------------------------------------------------------
# The merge rule, in (o, lse) form
# ---------------------------------------------------------------------------------------------------------

def merge(o_a, lse_a, o_b, lse_b):
    """Merge two partial results of the same query rows over disjoint sets of keys.

    o is normalised (o = O / l) and lse = m + log l, so each state is (m = lse, l = 1, O = o) and the merge of
    lesson 03 applies: m = max(lse_a, lse_b), weights e^(lse_a - m), e^(lse_b - m). A state that has seen no
    key (lse = -inf, o = 0) merges as the identity.
    """
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    l = w_a + w_b
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    o = (w_a.unsqueeze(-1) * o_a + w_b.unsqueeze(-1) * o_b) / l_safe.unsqueeze(-1)
    return o, torch.where(l > 0, m_safe + torch.log(l_safe), torch.full_like(l, -math.inf))


# ---------------------------------------------------------------------------------------------------------
# Which blocks a rank computes at a step
# ---------------------------------------------------------------------------------------------------------

def block_plan(rank, source, world_size, layout, causal):
    """The attention calls rank `rank` makes against the K/V shard of rank `source`, as a list of
    (query chunks, key chunks, causal) with chunks given by their place in the local shard (0 or 1).

    Query chunks that see the same key chunks fully share one call; the rank's own shard is one causal call.
    """
    q_chunks, k_chunks = rank_chunks(rank, world_size, layout), rank_chunks(source, world_size, layout)
    every_q, every_k = tuple(range(len(q_chunks))), tuple(range(len(k_chunks)))
    if not causal:
        return [(every_q, every_k, False)]
    if source == rank:  # the shard's chunks ascend, so the top-left causal mask on the shard is exact
        return [(every_q, every_k, True)]
    groups = {}
    for i, qc in enumerate(q_chunks):
        keys = tuple(j for j, kc in enumerate(k_chunks) if visible_chunks(qc, kc, True) == "full")
        if keys:
            groups.setdefault(keys, []).append(i)
    return [(tuple(qs), keys, False) for keys, qs in groups.items()]


def _rows(x, chunks, size):
    """The rows of local chunks `chunks` (each `size` rows) of x (..., n, d): a view when they are adjacent."""
    if all(b == a + 1 for a, b in zip(chunks, chunks[1:])):
        return x[..., chunks[0] * size:(chunks[-1] + 1) * size, :]
    return torch.cat([x[..., c * size:(c + 1) * size, :] for c in chunks], dim=-2)


def _put(acc, chunks, size, value, add=False):
    """Write (or add) the rows of value (..., len(chunks) * size, x) into the rows of local chunks `chunks`
    of acc (..., n, x). For lse (..., n), pass both with .unsqueeze(-1): views, so acc itself changes."""
    for i, c in enumerate(chunks):
        part = value[..., i * size:(i + 1) * size, :]
        if add:
            acc[..., c * size:(c + 1) * size, :] += part
        else:
            acc[..., c * size:(c + 1) * size, :] = part


# ---------------------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------------------

class _Ring:
    """This rank's place in the ring: its neighbours' global ranks, and non-blocking rotation."""

    def __init__(self, group):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))  # noqa: E731
        self.next = glob((self.rank + 1) % self.world_size)
        self.prev = glob((self.rank - 1) % self.world_size)

    def rotate(self, tensors, tag):
        """Start sending `tensors` to the next rank and receiving as many from the previous one.
        Returns (received buffers, requests): `_wait(requests)` before reading the buffers. The requests keep
        the tensors being sent alive until then."""
        received = [torch.empty_like(t) for t in tensors]
        sent = [t.contiguous() for t in tensors]
        ops = []
        for i, (out, into) in enumerate(zip(sent, received)):
            ops.append(dist.P2POp(dist.isend, out, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, into, self.prev, self.group, tag + i))
        # One batch: NCCL may hold a lone send until its receive is posted, so W ranks that each send first
        # would wait on each other; batched sends and receives start together (gloo takes them one by one).
        return received, (dist.batch_isend_irecv(ops), sent)


def _wait(requests):
    works, _sent = requests
    for work in works:
        work.wait()


def _mark(x, marks=None, done=None):
    """EVENTS' bookkeeping (nothing unless EVENTS is a list and x is on a GPU): _mark(x) starts a step's events,
    _mark(x, marks) records the next one, _mark(x, marks, (direction, step)) the last and stores the step."""
    if EVENTS is None or not x.is_cuda:
        return None
    if marks is None:
        marks = []
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    marks.append(event)
    if done is not None:
        EVENTS.append((*done, *marks))
    return marks


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ring_forward(q, k, v, causal, scale, ring, layout):
    w, r = ring.world_size, ring.rank
    per = len(rank_chunks(r, w, layout))
    size = q.shape[-2] // per
    o = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=_acc_dtype(q.dtype), device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=o.dtype, device=q.device)
    kv = (k, v)
    for t in range(w):
        t0, c0 = time.perf_counter(), time.process_time()
        marks = _mark(q)
        pending = ring.rotate(kv, tag=0) if t < w - 1 else None  # the next shard travels while we compute
        for q_chunks, k_chunks, masked in block_plan(r, (r - t) % w, w, layout, causal):
            q_b = _rows(q, q_chunks, size)
            k_b, v_b = (_rows(x, k_chunks, size) for x in kv)
            o_b, lse_b = _local_forward(q_b, k_b, v_b, masked, scale)
            o_old, lse_old = _rows(o, q_chunks, size), _rows(lse.unsqueeze(-1), q_chunks, size).squeeze(-1)
            o_new, lse_new = merge(o_old, lse_old, o_b.to(o.dtype), lse_b.to(o.dtype))
            _put(o, q_chunks, size, o_new)
            _put(lse.unsqueeze(-1), q_chunks, size, lse_new.unsqueeze(-1))
        t1, c1 = time.perf_counter(), time.process_time()
        _mark(q, marks)
        if pending is not None:
            kv, requests = pending
            _wait(requests)
        _mark(q, marks, ("forward", t))
        if TRACE is not None:
            TRACE.append((t, t1 - t0, time.perf_counter() - t1, c1 - c0))
    return o.to(q.dtype), lse


def _ring_backward(q, k, v, o, lse, do, causal, scale, ring, layout):
    w, r = ring.world_size, ring.rank
    per = len(rank_chunks(r, w, layout))
    size = q.shape[-2] // per
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = (k, v)
    dkv = None  # the dK, dV buffer of the shard we hold, as it arrives
    dkv_pending = None
    for t in range(w):
        marks = _mark(q)
        kv_pending = ring.rotate(kv, tag=0) if t < w - 1 else None
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for q_chunks, k_chunks, masked in block_plan(r, (r - t) % w, w, layout, causal):
            rows = [_rows(x, q_chunks, size) for x in (q, o, do)]
            lse_b = _rows(lse.unsqueeze(-1), q_chunks, size).squeeze(-1)
            k_b, v_b = (_rows(x, k_chunks, size) for x in kv)
            dq_b, dk_b, dv_b = _local_backward(rows[0], k_b, v_b, rows[1], lse_b, rows[2], masked, scale)
            _put(dq, q_chunks, size, dq_b.to(acc), add=True)
            _put(dk, k_chunks, size, dk_b.to(acc), add=True)
            _put(dv, k_chunks, size, dv_b.to(acc), add=True)
        _mark(q, marks)
        if dkv_pending is not None:  # what the ranks before us added to this shard's gradient
            dkv, requests = dkv_pending
            _wait(requests)
            dk, dv = dk + dkv[0], dv + dkv[1]
        if w == 1:  # one rank: the gradient of its own shard is complete
            _mark(q, marks, ("backward", t))
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        dkv_pending = ring.rotate((dk, dv), tag=2)  # on to the next rank; after the last step: home
        if kv_pending is not None:
            kv, requests = kv_pending
            _wait(requests)
        if t < w - 1:
            _mark(q, marks, ("backward", t))
    dkv, requests = dkv_pending
    _wait(requests)
    _mark(q, marks, ("backward", w - 1))
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """apply(q, k, v, causal, scale, group, layout): this rank's shard of O; backward by the ring."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, layout):
        ring = _Ring(group)
        o, lse = _ring_forward(q.detach(), k.detach(), v.detach(), causal, scale, ring, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.ring, ctx.layout = causal, scale, ring, layout
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q.detach(), k.detach(), v.detach(), o, lse, do.contiguous(), ctx.causal,
                                    ctx.scale, ctx.ring, ctx.layout)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------

def _check_group(group):
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch; ring attention needs it")
    if not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs an initialised process group: call torch.distributed.init_process_group("
            "backend, rank=..., world_size=...) on every rank first (\"gloo\" for CPU tensors, \"nccl\" for "
            "CUDA ones), or start the script with torchrun; flashlab.ring.run_ranks does it for you")


def _check_shapes(q, k, v, world_size, layout):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention takes this rank's shards of shape (B, H, N/W, d); got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:-1] != v.shape[:-1] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k and v must match q's batch, k q's head dim, v k's heads and length; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"GQA: k and v have {k.shape[1]} heads, which must divide q's {q.shape[1]}")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"q and k shards must hold the same tokens: {q.shape[-2]} queries, {k.shape[-2]} keys")
    check_length(q.shape[-2] * world_size, world_size, layout)


def _check_same_everywhere(q, k, v, causal, scale, group, layout):
    """One all-gather of this rank's shapes and arguments; every rank must agree, else a ValueError naming
    what each rank passed (instead of a hang, or a wrong answer from mismatched transfers). It runs before any
    other check, so that every rank reaches it and all of them raise the same error."""
    def dims(x):
        shape = list(x.shape)[-4:] if x.dim() >= 4 else [-1] * (4 - x.dim()) + list(x.shape)
        return [x.dim()] + shape

    mine = dims(q) + dims(k) + dims(v) + [_DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, float(causal),
                                          _LAYOUT_CODE.get(layout, -1), -1.0 if scale is None else float(scale)]
    t = torch.tensor(mine, dtype=torch.float64, device=q.device)
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, t, group=group)
    rows = [x.tolist() for x in everyone]
    if any(row != rows[0] for row in rows):
        def shape(r, i):
            return tuple(int(x) for x in r[i + 1:i + 5] if x >= 0)

        desc = [f"rank {i}: q {shape(r, 0)}, k {shape(r, 5)}, v {shape(r, 10)}, dtype "
                f"{_DTYPES[int(r[15])] if r[15] >= 0 else 'other'}, causal={bool(r[16])}, layout "
                f"{list(_LAYOUT_CODE)[int(r[17])] if r[17] >= 0 else 'unknown'}, scale "
                f"{'default' if r[18] == -1 else r[18]}" for i, r in enumerate(rows)]
        raise ValueError("every rank must call ring_attention with shards of the same shapes and the same "
                         "dtype, causal, layout and scale; they differ:\n  " + "\n  ".join(desc))


def ring_attention(q, k, v, *, causal=False, scale=None, group=None, layout="zigzag", check=True):
    """This rank's shard of attention(Q, K, V) over the whole sequence, with autograd.

    q (B, H, N/W, d), k (B, H_kv, N/W, d), v (B, H_kv, N/W, dv): this rank's shards, cut by
    `flashlab.ring.shard(x, rank, W, layout)` (H_kv divides H: GQA). Returns o (B, H, N/W, dv), this rank's
    shard of the output in the same layout. causal: query i sees keys j <= i of the full sequence.
    scale: default 1/sqrt(d). group: a torch.distributed process group (default: the world); every rank of
    it must call ring_attention with the same shapes and arguments. check: compare them across ranks with
    one small all-gather first (turn it off once a training loop is known to be right).
    """
    _check_group(group)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if check:
        _check_same_everywhere(q, k, v, causal, scale, group, layout)
    _check_tensors(q, k, v)
    layout = check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    _check_shapes(q, k, v, dist.get_world_size(group), layout)
    return RingAttentionFunction.apply(q, k, v, causal, scale, group, layout)
