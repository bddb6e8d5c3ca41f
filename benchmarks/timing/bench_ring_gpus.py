"""Ring attention on several GPUs joined by NCCL, against one GPU and PyTorch's context parallelism (lesson 19).

    python benchmarks/timing/bench_ring_gpus.py --out $OUT/ring_gpus.json      # every GPU of this machine
    python benchmarks/timing/bench_ring_gpus.py --device cpu --world-size 2 --out /tmp/ring_gpus.json  # CPU check

The script starts its own ranks (flashlab.ring.run_ranks: one process per GPU, rank r on cuda:r, NCCL; no
torchrun). With W GPUs it measures world sizes 1, 2, 4, ... up to W on sub-groups of the same processes
(torch.distributed.new_group: ranks 0..w-1), so each process compiles flashlab's kernels once. Rank 0 prints
one line per phase as it starts (flushed) and rewrites the JSON after every phase, so a run stopped by a time
limit still leaves what it measured. The phases, in order:

1. links: all-gather bandwidth, P2P bandwidth between rank 0 and each other rank (batched isend/irecv, both
   directions at once), and the ring exchange itself (every rank sends to the next and receives from the one
   before, through ring_attention's own rotate) at the sizes of the K/V shards the timing phase sends.
2. correctness (the timing dtype, bfloat16): ring_attention forward and backward on GPU shards, causal and
   not, both layouts, every world size; the gathered output and gradients against float64 attention on the
   full sequence and against single-GPU flashlab (flashlab.torch.scaled_dot_product_attention on rank 0). A case passes
   when every one of o, dq, dk, dv is within twice the single-GPU error of the float64 reference (+1e-4).
3. single: one GPU, flashlab and torch SDPA on the full sequence, every length the timing needs.
4. scaling: the ring's forward and forward+backward time at a fixed number of tokens per GPU and at a fixed
   total length, causal (zigzag and contiguous) and without a mask: CUDA events, warm-up rounds, the median of
   --rounds (each round's time is its slowest rank's). Efficiency = one GPU's time on the full sequence / (W x
   the ring's time). Per rank and ring step, from CUDA events on the compute stream (ring_attention's EVENTS):
   the compute and the time the stream waited for the transfer. Balance: (max - min) / mean over ranks of the
   compute per rank and of the forward time per rank. The model of lesson 19 (flashlab.ring.model.timeline)
   predicts the step time twice: with this run's measured rates (one-GPU FLOP/s at the rank's length, the ring
   exchange's GB/s) and with the lesson's datasheet numbers (H100 attention FLOP/s, NVLink 4).
5. context_parallel: the same shapes through torch.distributed.tensor.experimental.context_parallel (SDPA,
   its default rotate method and head-tail load balancing): errors against float64 and time beside the ring.
   A failure is recorded in the JSON, not raised.
6. correctness in the other dtype (float16), if --budget-s leaves time (its kernels compile first).

Numba compiles every kernel configuration on first use (tens of seconds each): every configuration runs
untimed first, and all timings use one dtype and head dim. A phase that would not fit in what is left of
--budget-s is skipped and marked so in the JSON. --device cpu runs every phase on CPU processes joined by
gloo with tiny sizes (float32 and float16; time.perf_counter instead of CUDA events) to check the script.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashlab.ring import RankFailed, run_ranks  # noqa: E402

SIZES = {  # per device: the defaults of the command-line options
    "cuda": dict(B=1, heads=16, d=64, check_n=4096, per_gpu=8192, total=32768, rounds=7, warmup=2,
                 link_mib=64.0, dtypes=["bfloat16", "float16"], budget_s=390.0),
    "cpu": dict(B=1, heads=2, d=16, check_n=64, per_gpu=64, total=128, rounds=2, warmup=1, link_mib=0.0625,
                dtypes=["float32", "float16"], budget_s=600.0),
}
WORLDS = (1, 2, 4, 8)
DEFINITIONS = {
    "forward_ms": "median over rounds of the slowest rank's forward (CUDA events on each rank's stream)",
    "step_ms": "forward_ms / W",
    "efficiency_forward": "one GPU's flashlab forward on the full N / (W x forward_ms); likewise forward_backward",
    "compute_ms_per_step": "per rank, per forward step of the median round: GPU time from the step's start to "
                           "the end of its local compute and merge (CUDA events; host perf_counter on CPU)",
    "wait_ms_per_step": "per rank and step: how long the stream then waited for the next K/V shard",
    "wait_fraction": "all ranks' waiting / (their compute + waiting), forward",
    "balance_compute": "(max - min) / mean over ranks of each rank's summed compute (forward)",
    "balance_forward": "(max - min) / mean over ranks of each rank's forward time",
    "model_step_ms": "flashlab.ring.model.timeline(...).total / W with this run's rates: one GPU's forward FLOP/s at "
                     "N / W tokens and the ring exchange's GB/s per rank at that shard size",
    "model_step_ms_datasheet": "the same model with lesson 19's numbers: H100 attention FLOP/s "
                               "(model.H100_ATTENTION_FLOPS) and NVLink 4 (hardware.LINKS)",
    "pass": "every one of o, dq, dk, dv within 2 x the single-GPU error against float64, + 1e-4",
}


# ---------------------------------------------------------------------------------------------------------
# What every rank shares: its device, its groups, a clock, the time left
# ---------------------------------------------------------------------------------------------------------

class Rank:
    def __init__(self, rank, world_size, cfg):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.cfg = torch, dist, cfg
        self.rank, self.world_size = rank, world_size
        self.cuda = cfg["device"] == "cuda"
        if self.cuda:
            torch.cuda.set_device(rank)
            self.dev = torch.device("cuda", rank)
        else:
            self.dev = torch.device("cpu")
        self.start = cfg["start"]
        long = datetime.timedelta(seconds=cfg["budget_s"] + 600)  # gloo: barriers while rank 0 works alone
        ring = datetime.timedelta(seconds=300)  # NCCL: every rank has compiled its kernels before the ring starts
        backend = "nccl" if self.cuda else "gloo"
        self.worlds = [w for w in cfg["worlds"] if w <= world_size]
        # every rank creates every group, in the same order (new_group is collective over the world)
        self.cpu = dist.new_group(list(range(world_size)), backend="gloo", timeout=long)  # barriers, results
        self.groups, self.cpu_groups = {}, {}
        for w in self.worlds:
            self.groups[w] = dist.new_group(list(range(w)), backend=backend, timeout=ring)
            self.cpu_groups[w] = dist.new_group(list(range(w)), backend="gloo", timeout=long)
        self.refs = {}  # rank 0: float64 references and single-GPU errors per (dtype, causal)

    # -- time
    def elapsed(self):
        return time.time() - self.start

    def left(self):
        return self.cfg["budget_s"] - self.elapsed()

    def log(self, text):
        if self.rank == 0:
            print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def stamp(self):
        """A point in time on this rank's stream (a recorded CUDA event) or on the host clock (CPU)."""
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a, b):
        """Milliseconds between two stamps (after sync())."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    # -- ranks together
    def barrier(self, w=None):
        self.sync()
        self.dist.barrier(group=self.cpu if w is None else self.cpu_groups[w])

    def gather(self, obj):
        """[obj of every rank] on rank 0, None elsewhere."""
        out = [None] * self.world_size if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.cpu)
        return out

    def agree(self, obj):
        """Rank 0's obj on every rank (decisions every rank must take alike)."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.cpu)
        return box[0]

    # -- tensors
    def dtype(self, name):
        return getattr(self.torch, name)

    def randn(self, *shape, dtype, seed):
        g = self.torch.Generator(device=self.dev).manual_seed(seed)
        return self.torch.randn(*shape, generator=g, device=self.dev, dtype=dtype)


def rel(a, b):
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


def spread(xs):
    """(max - min) / mean."""
    mean = sum(xs) / len(xs)
    return float((max(xs) - min(xs)) / mean) if mean > 0 else 0.0


def attention_flops(N, d, heads, B=1, causal=False):
    """FLOPs of one forward on the full sequence: 4 N^2 d per head (Q K^T and P V), half under a causal mask."""
    return 4.0 * N * N * d * heads * B * (0.5 if causal else 1.0)


# ---------------------------------------------------------------------------------------------------------
# 1. links
# ---------------------------------------------------------------------------------------------------------

def _timed_loop(R, w, fn, iters, warmup=3):
    """Milliseconds per call of fn() on this rank, after warm-up, timed together over `iters` calls."""
    for _ in range(warmup):
        fn()
    R.barrier(w)
    a = R.stamp()
    for _ in range(iters):
        fn()
    b = R.stamp()
    R.sync()
    return R.ms(a, b) / iters


def links(R):
    torch, dist = R.torch, R.dist
    from flashlab.ring.attention import _Ring, _wait

    cfg = R.cfg
    nbytes = int(cfg["link_mib"] * 2**20) // 2 * 2
    iters = 10 if R.cuda else 3
    out = {"all_gather": [], "p2p_pair": [], "p2p_ring": []}
    big = max(R.worlds)
    for w in R.worlds:
        if w == 1:
            continue
        mine = None
        if R.rank < w:
            group = R.groups[w]
            x = torch.ones(nbytes // 2, dtype=torch.bfloat16 if R.cuda else torch.float16, device=R.dev)
            parts = [torch.empty_like(x) for _ in range(w)]
            ms = _timed_loop(R, w, lambda: dist.all_gather(parts, x, group=group), iters)
            mine = {"ms": ms}
        R.barrier()
        got = R.gather(mine)
        if R.rank == 0:
            ms = max(g["ms"] for g in got[:w])
            alg = nbytes * w / (ms * 1e-3) / 1e9
            out["all_gather"].append({"W": w, "bytes_per_rank": nbytes, "ms": ms, "algbw_GBps": alg,
                                      "busbw_GBps": alg * (w - 1) / w})
    # pairs: rank 0 and rank j exchange nbytes both ways at once, on the largest group; the others wait
    for j in range(1, big):
        mine = None
        if R.rank in (0, j):
            group, peer = R.groups[big], j if R.rank == 0 else 0
            send = torch.ones(nbytes // 2, dtype=torch.float16, device=R.dev)
            recv = torch.empty_like(send)

            def exchange():
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, group),
                                                dist.P2POp(dist.irecv, recv, peer, group)])
                for work in works:
                    work.wait()

            for _ in range(3):
                exchange()
            R.sync()
            a = R.stamp()
            for _ in range(iters):
                exchange()
            b = R.stamp()
            R.sync()
            mine = {"ms": R.ms(a, b) / iters}
        R.barrier()
        got = R.gather(mine)
        if R.rank == 0:
            ms = max(got[0]["ms"], got[j]["ms"])
            out["p2p_pair"].append({"ranks": [0, j], "bytes": nbytes, "ms": ms,
                                    "GBps_per_direction": nbytes / (ms * 1e-3) / 1e9})
    # the ring exchange as ring_attention does it, at every K/V shard size the scaling phase sends
    for w in R.worlds:
        if w == 1:
            continue
        for tokens in sorted({cfg["per_gpu"], cfg["total"] // w}):
            mine = None
            shard_bytes = 2 * cfg["B"] * cfg["heads"] * tokens * cfg["d"] * 2  # K and V, 2 bytes a number
            if R.rank < w:
                ring = _Ring(R.groups[w])
                kv = [torch.ones(cfg["B"], cfg["heads"], tokens, cfg["d"], dtype=torch.float16, device=R.dev)
                      for _ in range(2)]

                def rotate():
                    _, requests = ring.rotate(kv, tag=0)
                    _wait(requests)

                mine = {"ms": _timed_loop(R, w, rotate, iters)}
            R.barrier()
            got = R.gather(mine)
            if R.rank == 0:
                ms = max(g["ms"] for g in got[:w])
                out["p2p_ring"].append({"W": w, "tokens_per_rank": tokens, "bytes": shard_bytes, "ms": ms,
                                        "GBps_per_rank": shard_bytes / (ms * 1e-3) / 1e9})
    return out


# ---------------------------------------------------------------------------------------------------------
# 2. correctness
# ---------------------------------------------------------------------------------------------------------

def _full_inputs(R, N, seed=0):
    """The same float64 q, k, v, dO on every rank (drawn on the CPU with one seed), and on this device."""
    torch = R.torch
    cfg = R.cfg
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(cfg["B"], cfg["heads"], N, cfg["d"], generator=g, dtype=torch.float64).to(R.dev)
            for _ in range(4)]


def _reference(R, full, causal):
    """float64 attention with autograd: (o, dq, dk, dv)."""
    import torch.nn.functional as F

    q, k, v = (x.clone().requires_grad_() for x in full[:3])
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(full[3])
    return [o.detach(), q.grad, k.grad, v.grad]


def _single_flashlab(R, full, causal, dtype):
    """flashlab's FA2 on one device, on the full sequence: (o, dq, dk, dv)."""
    from flashlab.torch import scaled_dot_product_attention

    q, k, v = (x.to(dtype).requires_grad_() for x in full[:3])
    o = scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(full[3].to(dtype))
    return [o.detach(), q.grad, k.grad, v.grad]


def warm_ring(R, shards, w, layout, causal):
    """Run, without communication, every local block call this rank's ring makes (each compiles on first use), so
    that no rank compiles for long while its neighbours wait on a transfer."""
    from flashlab.ring import attention as A
    from flashlab.ring.layout import rank_chunks

    q, k, v, do = shards
    size = q.shape[-2] // len(rank_chunks(R.rank, w, layout))
    for source in range(w):
        for q_chunks, k_chunks, masked in A.block_plan(R.rank, source, w, layout, causal):
            qb, ob = A._rows(q, q_chunks, size), A._rows(do, q_chunks, size)
            kb, vb = A._rows(k, k_chunks, size), A._rows(v, k_chunks, size)
            o, lse = A._local_forward(qb, kb, vb, masked, None)
            A._local_backward(qb, kb, vb, o, lse, ob, masked, None)
    R.sync()


def correctness(R, dtype_name):
    torch, dist = R.torch, R.dist
    from flashlab.ring import attention, shard, unshard

    cfg = R.cfg
    N, dtype = cfg["check_n"], R.dtype(dtype_name)
    full = _full_inputs(R, N)
    names = ("o", "dq", "dk", "dv")
    rows = []
    t_start = time.time()
    # every rank compiles every kernel this dtype needs now, all at once, rather than each rank in turn when it
    # first joins a ring while the others wait for it
    big = max(R.worlds)
    for causal in (True, False):
        for layout in ("zigzag", "contiguous"):
            warm_ring(R, [shard(x, R.rank, big, layout).to(dtype).contiguous() for x in full], big, layout, causal)
    R.barrier()
    R.log(f"  kernels compiled and run once on every rank: {time.time() - t_start:.1f} s")
    for causal in (True, False):
        if R.rank == 0:
            ref = _reference(R, full, causal)
            single = _single_flashlab(R, full, causal, dtype)
            R.refs[dtype_name, causal] = (ref, single)
            R.sync()
        for layout in ("zigzag", "contiguous"):
            for w in R.worlds:
                mine = None
                if R.rank < w:
                    q, k, v, do = (shard(x, R.rank, w, layout).to(dtype).contiguous() for x in full)
                    warm_ring(R, (q, k, v, do), w, layout, causal)
                    q, k, v = (x.requires_grad_() for x in (q, k, v))
                    o = attention.ring_attention(q, k, v, causal=causal, layout=layout, group=R.groups[w])
                    o.backward(do)
                    got = []
                    for x in (o.detach(), q.grad, k.grad, v.grad):
                        parts = [torch.empty_like(x) for _ in range(w)]
                        dist.all_gather(parts, x.contiguous(), group=R.groups[w])
                        got.append(parts)
                    R.sync()
                    if R.rank == 0:
                        ref, single = R.refs[dtype_name, causal]
                        ring = [unshard([p.double() for p in parts], layout) for parts in got]
                        e_single = {n: rel(s, r) for n, s, r in zip(names, single, ref)}
                        e_ring = {n: rel(g, r) for n, g, r in zip(names, ring, ref)}
                        e_between = {n: rel(g, s) for n, g, s in zip(names, ring, single)}
                        ok = all(e_ring[n] <= 2 * e_single[n] + 1e-4 for n in names)
                        mine = {"dtype": dtype_name, "causal": causal, "layout": layout, "W": w, "N": N,
                                "err_single": e_single, "err_ring": e_ring, "ring_vs_single": e_between,
                                "pass": ok}
                R.barrier()
                if R.rank == 0:
                    rows.append(mine)
                    worst = max(mine["err_ring"].values())
                    R.log(f"  {dtype_name} {'causal' if causal else 'full'} {layout} W={w}: ring error "
                          f"{worst:.2e}, single {max(mine['err_single'].values()):.2e}: "
                          f"{'pass' if mine['pass'] else 'FAIL'}")
    return rows, time.time() - t_start


# ---------------------------------------------------------------------------------------------------------
# 3. one GPU: flashlab and torch SDPA on the full sequence
# ---------------------------------------------------------------------------------------------------------

def _time_call(R, fn, rounds, warmup):
    """(median forward ms, median forward+backward ms) of fn() -> (output, do, leaves)."""
    fwd, both = [], []
    for i in range(warmup + rounds):
        R.sync()
        a = R.stamp()
        o, do, leaves = fn()
        b = R.stamp()
        o.backward(do)
        c = R.stamp()
        R.sync()
        for x in leaves:
            x.grad = None
        if i >= warmup:
            fwd.append(R.ms(a, b))
            both.append(R.ms(a, c))
    return median(fwd), median(both)


def single(R, lengths, causal_set, dtype_name):
    import torch.nn.functional as F

    from flashlab.torch import scaled_dot_product_attention as flashlab_sdpa

    cfg = R.cfg
    dtype = R.dtype(dtype_name)
    rows = []
    if R.rank == 0:
        for causal in causal_set:
            for N in lengths:
                q, k, v, do = (R.randn(cfg["B"], cfg["heads"], N, cfg["d"], dtype=dtype, seed=s) for s in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                row = {"N": N, "causal": causal, "dtype": dtype_name}
                for name, attn in (("flashlab", lambda: flashlab_sdpa(q, k, v, is_causal=causal)),
                                   ("torch_sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
                    try:
                        f, fb = _time_call(R, lambda: (attn(), do, (q, k, v)), cfg["rounds"], cfg["warmup"])
                        row[name] = {"forward_ms": f, "forward_backward_ms": fb,
                                     "forward_TFLOPs": attention_flops(N, cfg["d"], cfg["heads"], cfg["B"], causal)
                                     / (f * 1e-3) / 1e12}
                    except Exception as exc:  # torch's SDPA may lack a kernel for this device and dtype
                        row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                R.log(f"  one device, N={N} {'causal' if causal else 'full'}: flashlab "
                      f"{row['flashlab'].get('forward_ms', float('nan')):.2f} ms forward, "
                      f"{row['flashlab'].get('forward_backward_ms', float('nan')):.2f} ms forward+backward")
    R.barrier()
    return rows


# ---------------------------------------------------------------------------------------------------------
# 4. scaling
# ---------------------------------------------------------------------------------------------------------

def _steps(R, trace, events):
    """Per forward step (compute ms, wait ms) and per backward step, from EVENTS (CUDA) or TRACE (CPU)."""
    if R.cuda:
        fwd = [(a.elapsed_time(b), b.elapsed_time(c)) for d, t, a, b, c in events if d == "forward"]
        bwd = [(a.elapsed_time(b), b.elapsed_time(c)) for d, t, a, b, c in events if d == "backward"]
        return fwd, bwd
    return [(c * 1e3, w * 1e3) for t, c, w, _cpu in trace], []


def time_ring(R, w, N, causal, layout, dtype_name):
    """This rank's per-round forward and forward+backward ms and per-step (compute, wait) ms; None off the group."""
    from flashlab.ring import attention

    if R.rank >= w:
        return None
    cfg = R.cfg
    dtype = R.dtype(dtype_name)
    tokens = N // w
    q, k, v, do = (R.randn(cfg["B"], cfg["heads"], tokens, cfg["d"], dtype=dtype, seed=100 * R.rank + s)
                   for s in range(4))
    warm_ring(R, (q, k, v, do), w, layout, causal)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fwd, both, steps = [], [], []
    try:
        for i in range(cfg["warmup"] + cfg["rounds"]):
            attention.EVENTS, attention.TRACE = [], []
            R.barrier(w)
            a = R.stamp()
            o = attention.ring_attention(q, k, v, causal=causal, layout=layout, group=R.groups[w], check=False)
            b = R.stamp()
            o.backward(do)
            c = R.stamp()
            R.sync()
            for x in (q, k, v):
                x.grad = None
            if i >= cfg["warmup"]:
                fwd.append(R.ms(a, b))
                both.append(R.ms(a, c))
                steps.append(_steps(R, attention.TRACE, attention.EVENTS))
    finally:
        attention.EVENTS, attention.TRACE = None, None
    return {"forward_ms": fwd, "forward_backward_ms": both, "steps": steps}


def _model(cfg, w, N, causal, layout, flops, bandwidth):
    from flashlab.ring import model

    tl = model.timeline(w, N, cfg["d"], cfg["heads"], cfg["heads"], 2, flops, bandwidth, layout, causal)
    return tl.total * 1e3 / w


def scaling(R, single_rows, link_rows, dtype_name, cases):
    from flashlab.hardware import LINKS
    from flashlab.ring import model

    cfg = R.cfg
    rows = []
    series = [("per_gpu", lambda w: cfg["per_gpu"] * w), ("total", lambda w: cfg["total"])]
    for causal, layout in cases:
        for name, length in series:
            for w in R.worlds:
                N = length(w)
                mine = time_ring(R, w, N, causal, layout, dtype_name)
                R.barrier()
                got = R.gather(mine)
                if R.rank != 0:
                    continue
                ranks = got[:w]
                rounds = len(ranks[0]["forward_ms"])
                fwd_round = [max(r["forward_ms"][i] for r in ranks) for i in range(rounds)]
                both_round = [max(r["forward_backward_ms"][i] for r in ranks) for i in range(rounds)]
                mid = sorted(range(rounds), key=lambda i: fwd_round[i])[rounds // 2]  # the median round
                fwd, both = median(fwd_round), median(both_round)
                steps = [r["steps"][mid] for r in ranks]
                compute = [[s[0] for s in st[0]] for st in steps]  # per rank, per forward step
                wait = [[s[1] for s in st[0]] for st in steps]
                row = {"series": name, "N": N, "W": w, "tokens_per_rank": N // w, "causal": causal,
                       "layout": layout, "dtype": dtype_name, "forward_ms": fwd, "forward_backward_ms": both,
                       "step_ms": fwd / w, "forward_ms_per_rank": [r["forward_ms"][mid] for r in ranks],
                       "compute_ms_per_step": compute, "wait_ms_per_step": wait,
                       "backward_compute_ms_per_step": [[s[0] for s in st[1]] for st in steps],
                       "backward_wait_ms_per_step": [[s[1] for s in st[1]] for st in steps],
                       "compute_ms_per_rank": [sum(c) for c in compute],
                       "wait_ms_per_rank": [sum(x) for x in wait]}
                row["balance_compute"] = spread(row["compute_ms_per_rank"])
                row["balance_forward"] = spread(row["forward_ms_per_rank"])
                total_compute, total_wait = sum(row["compute_ms_per_rank"]), sum(row["wait_ms_per_rank"])
                row["wait_fraction"] = total_wait / (total_compute + total_wait) if total_compute + total_wait else 0.0
                one = {(s["N"], s["causal"]): s["flashlab"] for s in single_rows}
                base = one.get((N, causal), {})
                if "forward_ms" in base:
                    row["efficiency_forward"] = base["forward_ms"] / (w * fwd)
                    row["efficiency_forward_backward"] = base["forward_backward_ms"] / (w * both)
                # the model: measured rates, then the lesson's datasheet numbers
                at_rank = one.get((N // w, causal), {})
                link = [x for x in link_rows if x["W"] == w and x["tokens_per_rank"] == N // w]
                if "forward_ms" in at_rank:
                    work = attention_flops(N // w, cfg["d"], cfg["heads"], cfg["B"], causal)
                    flops = work / (at_rank["forward_ms"] * 1e-3)
                    bandwidth = link[0]["GBps_per_rank"] * 1e9 if link else float("inf")
                    row["model_rates"] = {"TFLOPs": flops / 1e12, "GBps": bandwidth / 1e9}
                    row["model_step_ms"] = _model(cfg, w, N, causal, layout, flops, bandwidth)
                row["model_step_ms_datasheet"] = _model(cfg, w, N, causal, layout, model.H100_ATTENTION_FLOPS,
                                                        LINKS["NVLink 4"].bandwidth)
                rows.append(row)
                R.log(f"  {name} N={N} W={w} {'causal' if causal else 'full'} {layout}: forward {fwd:.2f} ms "
                      f"({row['step_ms']:.3f} ms a step, model {row.get('model_step_ms', float('nan')):.3f}), "
                      f"forward+backward {both:.2f} ms, efficiency {row.get('efficiency_forward', float('nan')):.2f}, "
                      f"waiting {100 * row['wait_fraction']:.0f}%, balance {row['balance_compute']:.2f}")
    return rows


# ---------------------------------------------------------------------------------------------------------
# 5. PyTorch's context parallelism
# ---------------------------------------------------------------------------------------------------------

def context_parallel_phase(R, dtype_name, ring_rows, single_rows):
    import torch.nn.functional as F

    torch = R.torch
    cfg = R.cfg
    dtype = R.dtype(dtype_name)
    out = {"correctness": [], "timing": [], "errors": []}
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    except Exception as exc:
        out["errors"].append(f"import: {type(exc).__name__}: {exc}"[:500])
        return out
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options

        out["rotate_method"] = str(getattr(_cp_options, "rotate_method", "?"))
        out["load_balance"] = bool(getattr(_cp_options, "enable_load_balance", False))
    except Exception as exc:
        out["options"] = f"not read: {type(exc).__name__}: {exc}"[:300]
    # groups of their own, with a short NCCL timeout: a transfer that never completes inside torch's code ends
    # the run (the watchdog stops the process, run_ranks stops the rest) instead of hanging until the time limit
    short = datetime.timedelta(seconds=120)
    groups = {w: R.dist.new_group(list(range(w)), backend="nccl" if R.cuda else "gloo", timeout=short)
              for w in R.worlds}
    names = ("o", "dq", "dk", "dv")
    causal = True
    gathered = None  # rank 0's unsharded output and gradients of the check
    for w in R.worlds:
        if w == 1:
            continue
        for what in ["check"] + sorted({cfg["per_gpu"] * w, cfg["total"]}):
            mine = None
            if R.rank < w:
                try:
                    mesh = DeviceMesh.from_group(groups[w], R.dev.type)
                    if what == "check":
                        N = cfg["check_n"]
                        full = [x.to(dtype) for x in _full_inputs(R, N)]
                    else:
                        N = what
                        full = [R.randn(cfg["B"], cfg["heads"], N, cfg["d"], dtype=dtype, seed=s) for s in range(4)]
                    q, k, v, do = full
                    with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2],
                                          no_restore_buffers={q, k, v, do}):
                        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

                        def call():
                            return F.scaled_dot_product_attention(*leaves, is_causal=causal), do, leaves

                        if what == "check":
                            o, _, _ = call()
                            o.backward(do)
                            gathered = context_parallel_unshard(mesh, [o.detach()] + [x.grad for x in leaves],
                                                                [2, 2, 2, 2])
                            mine = {}
                        else:
                            R.barrier(w)
                            f, fb = _time_call(R, call, cfg["rounds"], cfg["warmup"])
                            mine = {"forward_ms": f, "forward_backward_ms": fb}
                except Exception as exc:
                    mine = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            R.barrier()
            got = R.gather(mine)
            if R.rank != 0:
                continue
            failed = [g["error"] for g in got[:w] if "error" in g]
            if failed:
                out["errors"].append(f"W={w} {what}: {failed[0]}")
                R.log(f"  context_parallel W={w} {what}: failed: {failed[0][:200]}")
                continue
            if what == "check":
                ref, _single = R.refs.get((dtype_name, causal), (None, None))
                if ref is None:
                    continue
                errs = {n: rel(g, r) for n, g, r in zip(names, gathered, ref)}
                out["correctness"].append({"W": w, "N": cfg["check_n"], "causal": causal, "dtype": dtype_name,
                                           "err_torch_cp": errs})
                R.log(f"  context_parallel W={w}: error {max(errs.values()):.2e} against float64")
            else:
                ring = [r for r in ring_rows if r["W"] == w and r["N"] == what and r["causal"] == causal
                        and r["layout"] == "zigzag"]
                one = [s for s in single_rows if s["N"] == what and s["causal"] == causal]
                row = {"W": w, "N": what, "causal": causal, "dtype": dtype_name,
                       "torch_cp_forward_ms": max(g["forward_ms"] for g in got[:w]),
                       "torch_cp_forward_backward_ms": max(g["forward_backward_ms"] for g in got[:w]),
                       "flashlab_ring_forward_ms": ring[0]["forward_ms"] if ring else None,
                       "flashlab_ring_forward_backward_ms": ring[0]["forward_backward_ms"] if ring else None,
                       "torch_sdpa_one_device": one[0].get("torch_sdpa") if one else None}
                out["timing"].append(row)
                R.log(f"  context_parallel W={w} N={what}: forward {row['torch_cp_forward_ms']:.2f} ms, "
                      f"forward+backward {row['torch_cp_forward_backward_ms']:.2f} ms")
    return out


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------

def _machine(R):
    torch = R.torch
    info = {"device": R.cfg["device"], "world_size": R.world_size, "torch": torch.__version__}
    try:
        import numba

        info["numba"] = numba.__version__
        from importlib.metadata import version

        info["numba_cuda"] = version("numba-cuda")
    except Exception as exc:
        info.setdefault("numba", f"unknown ({type(exc).__name__})")
    if R.cuda:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(R.world_size)]
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        try:
            import subprocess

            info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                              timeout=20).stdout
        except Exception as exc:
            info["topology"] = f"nvidia-smi topo -m failed: {exc}"
    else:
        import platform

        info["gpu"] = f"none: CPU processes joined by gloo ({platform.processor() or platform.machine()})"
    return info


def worker(rank, world_size, cfg):
    R = Rank(rank, world_size, cfg)
    data = {"date": cfg["date"], "command": cfg["command"], "setup": {k: cfg[k] for k in (
        "B", "heads", "d", "check_n", "per_gpu", "total", "rounds", "warmup", "link_mib", "dtypes", "budget_s")},
            "worlds": R.worlds, "phases": {}, "definitions": DEFINITIONS}
    if rank == 0:
        data.update(_machine(R))
    timing_dtype, other = cfg["dtypes"][0], cfg["dtypes"][1:]

    def done(name, value, started):
        if rank == 0:
            data[name] = value
            data["phases"][name] = {"seconds": round(time.time() - started, 1), "status": "done"}
            data["elapsed_s"] = round(R.elapsed(), 1)
            write(cfg["out"], data)
            R.log(f"phase {name}: done in {time.time() - started:.1f} s")

    def skipped(name, why):
        if rank == 0:
            data["phases"][name] = {"status": "skipped", "why": why}
            write(cfg["out"], data)
            R.log(f"phase {name}: skipped ({why})")

    R.log(f"{world_size} ranks on {cfg['device']}; world sizes {R.worlds}; budget {cfg['budget_s']:.0f} s")
    started = time.time()
    R.log("phase links: all-gather, pairs, ring exchange")
    link = links(R)
    done("links", link, started)

    started = time.time()
    R.log(f"phase correctness_{timing_dtype}: compiles the kernels first (tens of seconds each on a GPU)")
    rows, compile_and_check = correctness(R, timing_dtype)
    done(f"correctness_{timing_dtype}", rows, started)

    lengths = sorted({cfg["per_gpu"] * w for w in R.worlds} | {cfg["total"] // w for w in R.worlds}
                     | {cfg["total"]})
    started = time.time()
    R.log(f"phase single: one device, N = {lengths}")
    single_rows = single(R, lengths, (True, False), timing_dtype)
    done("single", single_rows, started)

    started = time.time()
    R.log("phase scaling")
    cases = [(True, "zigzag"), (True, "contiguous"), (False, "zigzag")]
    ring_rows = scaling(R, single_rows, link["p2p_ring"] if rank == 0 else [], timing_dtype, cases) \
        if R.agree(R.left() > 30) else None
    if ring_rows is None:
        skipped("scaling", "no time left")
        ring_rows = []
    else:
        done("scaling", ring_rows, started)

    started = time.time()
    if R.agree(R.left() > 20):
        R.log("phase context_parallel: torch.distributed.tensor.experimental.context_parallel with SDPA")
        cp = context_parallel_phase(R, timing_dtype, ring_rows, single_rows)
        done("context_parallel", cp, started)
    else:
        skipped("context_parallel", "no time left")

    for name in other:  # more compiles: only with time for them (as long as the first dtype's, and margin)
        started = time.time()
        if R.agree(R.left() > 1.3 * compile_and_check + 20):
            R.log(f"phase correctness_{name}")
            rows, _ = correctness(R, name)
            done(f"correctness_{name}", rows, started)
        else:
            skipped(f"correctness_{name}", f"{R.left():.0f} s left, the first dtype's took {compile_and_check:.0f} s")
    R.barrier()
    return data if rank == 0 else None


def write(path, data):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(path.suffix + ".part")
    part.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(part, path)


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------

def table(data) -> str:
    """A compact markdown summary of a result file."""
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    lines = [f"ring attention on {data.get('world_size')} x {data.get('gpu')}, {data.get('date')}, torch "
             f"{data.get('torch')}, numba-cuda {data.get('numba_cuda', '?')}", ""]
    link = data.get("links")
    if link:
        lines += ["| link test | W / ranks | bytes | GB/s |", "| --- | --- | --- | --- |"]
        lines += [f"| all-gather (bus) | {r['W']} | {r['bytes_per_rank']} | {r['busbw_GBps']:.1f} |"
                  for r in link["all_gather"]]
        lines += [f"| P2P pair, each way | {r['ranks']} | {r['bytes']} | {r['GBps_per_direction']:.1f} |"
                  for r in link["p2p_pair"]]
        lines += [f"| ring exchange, per rank | {r['W']} | {r['bytes']} | {r['GBps_per_rank']:.1f} |"
                  for r in link["p2p_ring"]]
        lines.append("")
    checks = [r for k, v in data.items() if k.startswith("correctness_") for r in v]
    if checks:
        bad = [r for r in checks if not r["pass"]]
        lines += ["| dtype | mask | layout | W | error single (max of o, dq, dk, dv) | error ring | pass |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['dtype']} | {'causal' if r['causal'] else 'none'} | {r['layout']} | {r['W']} | "
                  f"{max(r['err_single'].values()):.2e} | {max(r['err_ring'].values()):.2e} | "
                  f"{'yes' if r['pass'] else 'NO'} |" for r in checks]
        lines += ["", f"correctness: {len(checks) - len(bad)} of {len(checks)} cases pass", ""]
    for r in data.get("single") or []:
        fl, th = r["flashlab"], r.get("torch_sdpa", {})
        lines.append(f"one device, N={r['N']} {'causal' if r['causal'] else 'no mask'}: flashlab "
                     f"{f(fl.get('forward_ms'))} / {f(fl.get('forward_backward_ms'))} ms (fwd / fwd+bwd), torch SDPA "
                     f"{f(th.get('forward_ms'))} / {f(th.get('forward_backward_ms'))} ms")
    rows = data.get("scaling") or []
    if rows:
        lines.append("")
        lines += ["| series | N | W | mask | layout | fwd ms | fwd+bwd ms | step ms | model step ms (measured rates"
                  " / datasheet) | efficiency fwd / fwd+bwd | wait | balance compute / fwd |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['series']} | {r['N']} | {r['W']} | {'causal' if r['causal'] else 'none'} | {r['layout']} | "
                  f"{r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | {r['step_ms']:.3f} | "
                  f"{f(r.get('model_step_ms'), '.3g')} / {r['model_step_ms_datasheet']:.3g} | "
                  f"{f(r.get('efficiency_forward'))} / {f(r.get('efficiency_forward_backward'))} | "
                  f"{100 * r['wait_fraction']:.0f}% | {r['balance_compute']:.2f} / {r['balance_forward']:.2f} |"
                  for r in rows]
        lines.append("")
    cp = data.get("context_parallel")
    if cp:
        for r in cp["correctness"]:
            lines.append(f"torch context_parallel W={r['W']} N={r['N']}: error against float64 "
                         f"{max(r['err_torch_cp'].values()):.2e}")
        if cp["timing"]:
            lines += ["", "| W | N | torch CP fwd / fwd+bwd ms | flashlab ring fwd / fwd+bwd ms |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| {r['W']} | {r['N']} | {r['torch_cp_forward_ms']:.2f} / "
                      f"{r['torch_cp_forward_backward_ms']:.2f} | {f(r['flashlab_ring_forward_ms'])} / "
                      f"{f(r['flashlab_ring_forward_backward_ms'])} |"
                      for r in cp["timing"]]
        for e in cp["errors"]:
            lines.append(f"torch context_parallel failed: {e[:300]}")
        lines.append("")
    for name, p in data.get("phases", {}).items():
        if p["status"] != "done":
            lines.append(f"phase {name}: {p['status']} ({p.get('why', '')})")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to start (default: every GPU; 2 on --device cpu)")
    p.add_argument("--worlds", type=int, nargs="+", default=None,
                   help="world sizes to measure (default: 1, 2, 4, 8 up to --world-size)")
    p.add_argument("--out", default=str(ROOT / "flashlab" / "data" / "ring_gpus.json"))
    for name in ("B", "heads", "d", "check_n", "per_gpu", "total", "rounds", "warmup"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--link-mib", type=float, default=None, help="MiB per rank in the all-gather and pair tests")
    p.add_argument("--dtypes", nargs="+", default=None, help="the first is timed; the others are only checked")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run; phases that would "
                   "not fit are skipped (default 390 on a GPU)")
    a = p.parse_args(argv)
    cfg = dict(SIZES[a.device])
    for k, v in vars(a).items():
        if v is not None and k in cfg:
            cfg[k] = v
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda needs a CUDA GPU; --device cpu checks the script on CPU processes")
        world = a.world_size or torch.cuda.device_count()
        if world > torch.cuda.device_count():
            p.error(f"--world-size {world} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    else:
        world = a.world_size or 2
    if world < 1:
        p.error(f"--world-size must be at least 1; got {world}")
    worlds = sorted(set(a.worlds or [w for w in WORLDS if w <= world]))
    if worlds[0] < 1 or worlds[-1] > world:
        p.error(f"--worlds must lie in 1..{world} (the --world-size); got {worlds}")
    for w in worlds:
        for name in ("check_n", "total"):
            if cfg[name] % (2 * w):
                p.error(f"--{name.replace('_', '-')} {cfg[name]} must be a multiple of 2 W = {2 * w} (zigzag "
                        f"cuts the sequence into 2 W chunks)")
    if cfg["per_gpu"] % 2:
        p.error(f"--per-gpu must be even (zigzag gives each rank two chunks); got {cfg['per_gpu']}")
    now = datetime.datetime.now(datetime.timezone.utc)
    cfg.update(device=a.device, worlds=worlds, out=a.out, start=time.time(),
               date=now.strftime("%Y-%m-%d %H:%M UTC"),
               command="python benchmarks/timing/bench_ring_gpus.py "
               + " ".join(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo (barriers, results) stays on this machine
    print(f"bench_ring_gpus: {world} ranks ({a.device}), world sizes {worlds}, writing {a.out}", flush=True)
    try:
        data = run_ranks(worker, world, cfg, backend="nccl" if a.device == "cuda" else "gloo",
                         timeout=cfg["budget_s"] + 300)[0]
    except RankFailed as exc:
        print(f"\nthe run stopped: {exc}", flush=True)
        if Path(a.out).exists():  # what the phases before wrote
            print("\n" + table(json.loads(Path(a.out).read_text())), flush=True)
        return 1
    print()
    print(table(data), flush=True)
    print(f"\nwrote {a.out} ({data.get('elapsed_s')} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
