"""FlashAttention on a Tenstorrent Wormhole, as a discrete-event model (lesson 12).

The tt-metal tech report (tenstorrent/tt-metal, tech_reports/FlashAttention/FlashAttention.md) runs
FA2's algorithm on a 2D grid of Tensix cores. Each core runs three programs at once:

    reader   (a data-movement RISC-V) copies a Q chunk, then K_j and V_j chunks, from DRAM into L1
    compute  (three RISC-Vs driving the matrix and vector engines) does S = Q K_j^T, softmax, O += P V_j
    writer   (the other data-movement RISC-V) copies each finished O chunk back to DRAM

They pass data through circular buffers (CBs) in L1: a fixed number of slots, a producer reserves a slot,
fills it and pushes; a consumer waits for a filled slot, uses it and pops it. With 1 slot the reader
cannot fetch K_{j+1} until compute has finished with K_j; with 2 (double buffering) it can.

Times come from `Wormhole`, whose throughputs are rough assumptions (marked below), not measurements:
the model shows where time goes and how the two tricks help, not what a real chip achieves.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

#: The tech report's measured results, for comparison.
REPORT = {"speedup_vs_unfused_mean": 20, "speedup_vs_unfused_range": (9, 44), "causal_balancing": 1.6}


@dataclass(frozen=True)
class Wormhole:
    grid: tuple = (8, 8)  # Tensix cores in use (the chip has an 8 x 10 grid, some used for other jobs)
    dram_gb_s: float = 288.0  # report: 12 GDDR6 channels, 288 GB/s in all, shared by every core
    matmul_tflops_per_core: float = 1.0  # ASSUMPTION: ~74 TFLOP/s bf16 over ~72 cores
    softmax_ns_per_tile: float = 256.0  # ASSUMPTION: max, subtract, exp, sum of one 32x32 tile on the vector unit
    bytes_per_elem: int = 2  # bf16
    l1_bytes: int = 1536 * 1024  # report: 1.5 MB of SRAM per core

    @property
    def n_cores(self):
        return self.grid[0] * self.grid[1]

    def dram_ns(self, elems, sharing=None):
        """Moving `elems` values when `sharing` cores (default all) stream from DRAM at once."""
        per_core = self.dram_gb_s / (sharing or self.n_cores)  # GB/s = bytes per ns
        return elems * self.bytes_per_elem / per_core

    def matmul_ns(self, m, n, k):
        return 2 * m * n * k / (self.matmul_tflops_per_core * 1e3)  # 1 TFLOP/s = 1000 FLOP per ns

    def softmax_ns(self, m, n):
        return m * n / 1024 * self.softmax_ns_per_tile


# --- a tiny discrete-event simulator of programs joined by circular buffers -----------------------------

def simulate(programs, depths):
    """Run programs {name: [op, ...]} that share circular buffers {cb: slots}; return (end, busy).

    ops: ("work", ns, label) runs for ns; ("reserve", cb) waits for a free slot and takes it;
    ("push", cb) makes the reserved slot's data visible; ("wait", cb) waits for pushed data;
    ("pop", cb) frees the oldest slot. busy = {program: [(start, end, label), ...]}.
    """
    free = dict(depths)
    filled = {cb: 0 for cb in depths}
    pc = {p: 0 for p in programs}
    busy = {p: [] for p in programs}
    blocked = {}  # program -> cb it waits on
    events = [(0.0, i, p) for i, p in enumerate(programs)]  # (time, tiebreak, program)
    order = {p: i for i, p in enumerate(programs)}
    heapq.heapify(events)
    end = 0.0
    while events:
        now, _, p = heapq.heappop(events)
        ops = programs[p]
        while pc[p] < len(ops):
            op = ops[pc[p]]
            kind = op[0]
            if kind == "work":
                busy[p].append((now, now + op[1], op[2]))
                pc[p] += 1
                heapq.heappush(events, (now + op[1], order[p], p))
                break
            cb = op[1]
            if (kind == "reserve" and free[cb] == 0) or (kind == "wait" and filled[cb] == 0):
                blocked[p] = cb
                break
            if kind == "reserve":
                free[cb] -= 1
            elif kind == "push":
                filled[cb] += 1
            elif kind == "pop":
                filled[cb] -= 1
                free[cb] += 1
            pc[p] += 1
            if kind in ("push", "pop"):  # wake whoever waits on this buffer, at this instant
                for q, qcb in list(blocked.items()):
                    if qcb == cb:
                        del blocked[q]
                        heapq.heappush(events, (now, order[q], q))
        end = max(end, now)
    if blocked:
        raise RuntimeError(f"deadlock: {sorted(blocked)} wait forever (check the CB depths and the programs)")
    return end, busy


def pipeline_time(t_read, t_compute, n_chunks, depth, t_write=None):
    """Simulated time for a reader and a compute program passing n_chunks through one CB of `depth` slots.

    With t_write, a writer takes each result from a second CB of `depth` slots: compute then holds a slot
    of the input CB and one of the output CB while it works (wait in, reserve out, work, pop in, push out).
    """
    reader = [op for _ in range(n_chunks) for op in (("reserve", "cb"), ("work", t_read, "read"), ("push", "cb"))]
    if t_write is None:
        compute = [op for _ in range(n_chunks) for op in (("wait", "cb"), ("work", t_compute, "compute"),
                                                          ("pop", "cb"))]
        return simulate({"reader": reader, "compute": compute}, {"cb": depth})[0]
    compute = [op for _ in range(n_chunks) for op in (("wait", "cb"), ("reserve", "out"), ("work", t_compute, "compute"),
                                                      ("pop", "cb"), ("push", "out"))]
    writer = [op for _ in range(n_chunks) for op in (("wait", "out"), ("work", t_write, "write"), ("pop", "out"))]
    return simulate({"reader": reader, "compute": compute, "writer": writer}, {"cb": depth, "out": depth})[0]


# --- FlashAttention on one core, and on the grid ---------------------------------------------------------

def assign_q_chunks(n_heads, n_chunks, n_cores, balanced):
    """Split the Q chunks of n_heads heads (each n_chunks long) over cores: [[(head, chunk), ...] per core].

    Not balanced: consecutive chunks in order, so under causal masking the last cores get the chunks that
    see the most keys. Balanced: pair chunk i with chunk n-1-i (together they always see n+1 key chunks)
    and hand out the pairs, so every core gets the same amount of work.
    """
    if balanced:
        units = [[(h, i), (h, n_chunks - 1 - i)] if i != n_chunks - 1 - i else [(h, i)]
                 for h in range(n_heads) for i in range((n_chunks + 1) // 2)]
    else:
        units = [[(h, i)] for h in range(n_heads) for i in range(n_chunks)]
    parts = np.array_split(np.arange(len(units)), n_cores)
    return [[item for u in part for item in units[u]] for part in parts]


def k_chunks_needed(i, n_k_chunks, q_chunk, k_chunk, causal):
    """How many K chunks Q chunk i reads: all, or (causal) those holding a key at or before its last row.
    Key chunks after that row are skipped entirely; one the mask cuts in the middle is read whole."""
    return min(n_k_chunks, ((i + 1) * q_chunk - 1) // k_chunk + 1) if causal else n_k_chunks


def core_traffic(chunks, seq_len, d, q_chunk, k_chunk, causal):
    """(values read, values written) by the reader and writer of a core that owns Q chunks `chunks` (indices
    into one head): each Q chunk once, K_j and V_j for every K chunk it needs, one O chunk out per Q chunk."""
    kv = sum(k_chunks_needed(i, seq_len // k_chunk, q_chunk, k_chunk, causal) for i in chunks)
    return len(chunks) * q_chunk * d + 2 * kv * k_chunk * d, len(chunks) * q_chunk * d


def core_programs(chunks, n_k_chunks, q_chunk, k_chunk, d, causal, hw):
    """Reader, compute and writer programs of one core that owns the given Q chunks."""
    read_q, read_kv = hw.dram_ns(q_chunk * d), hw.dram_ns(k_chunk * d)
    step = 2 * hw.matmul_ns(q_chunk, k_chunk, d)  # QK^T and PV
    sm = hw.softmax_ns(q_chunk, k_chunk)
    reader, compute, writer = [], [], []
    for _, i in chunks:
        n_k = k_chunks_needed(i, n_k_chunks, q_chunk, k_chunk, causal)
        reader += [("reserve", "q"), ("work", read_q, f"Q{i}"), ("push", "q")]
        compute += [("wait", "q")]
        for j in range(n_k):
            reader += [("reserve", "k"), ("work", read_kv, f"K{j}"), ("push", "k"),
                       ("reserve", "v"), ("work", read_kv, f"V{j}"), ("push", "v")]
            compute += [("wait", "k"), ("work", step / 2 + sm, f"S{j}"), ("pop", "k"),
                        ("wait", "v"), ("work", step / 2, f"PV{j}"), ("pop", "v")]
        compute += [("pop", "q"), ("reserve", "out"), ("work", hw.softmax_ns(q_chunk, d) / 4, "norm"),
                    ("push", "out")]
        writer += [("wait", "out"), ("work", read_q, f"O{i}"), ("pop", "out")]
    return {"reader": reader, "compute": compute, "writer": writer}


@dataclass
class GridResult:
    makespan_ns: float
    core_end_ns: np.ndarray  # (rows, cols) when each core finishes
    compute_busy_ns: np.ndarray  # (rows, cols) time each core's compute program is busy
    busy_example: dict = field(repr=False)  # busy intervals of the slowest core

    @property
    def utilisation(self):
        """Mean fraction of the run during which a core's compute engine is busy."""
        return float(self.compute_busy_ns.mean() / self.makespan_ns)


def flash_attention_grid(seq_len, d, n_heads, batch=1, *, q_chunk=256, k_chunk=256, causal=True,
                         balanced=True, double_buffer=True, hw=Wormhole()):
    """Simulate the FA op on the grid: Q chunks of every (batch, head) are spread over the cores."""
    for name, v in (("seq_len", seq_len), ("d", d), ("n_heads", n_heads), ("batch", batch),
                    ("q_chunk", q_chunk), ("k_chunk", k_chunk)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer; got {v!r}")
    if seq_len % q_chunk or seq_len % k_chunk:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of q_chunk ({q_chunk}) and k_chunk ({k_chunk})")
    n_q, n_k = seq_len // q_chunk, seq_len // k_chunk
    depth = 2 if double_buffer else 1
    depths = {"q": depth, "k": depth, "v": depth, "out": depth}
    cache, ends, busy_c = {}, [], []
    for chunks in assign_q_chunks(batch * n_heads, n_q, hw.n_cores, balanced):
        key = tuple(i for _, i in chunks)  # cores with the same chunk indices take the same time
        if key not in cache:
            cache[key] = simulate(core_programs(chunks, n_k, q_chunk, k_chunk, d, causal, hw), depths)
        end, busy = cache[key]
        ends.append(end)
        busy_c.append(sum(b - a for a, b, _ in busy["compute"]))
    ends, busy_c = np.array(ends), np.array(busy_c)
    slowest = tuple(i for _, i in assign_q_chunks(batch * n_heads, n_q, hw.n_cores, balanced)[int(ends.argmax())])
    return GridResult(float(ends.max()), ends.reshape(hw.grid), busy_c.reshape(hw.grid), cache[slowest][1])


def unfused_baseline_ns(seq_len, d, n_heads, batch=1, hw=Wormhole()):
    """matmul -> softmax -> matmul as three ops, each paying max(compute, DRAM traffic) on the whole grid.

    S and P (N x N per head) go to DRAM and back, and the full score matrix is computed and then masked,
    as in the report's baseline. Peak rates everywhere make this an optimistic baseline.
    """
    bh, n, p = batch * n_heads, seq_len, hw.n_cores
    mm = bh * hw.matmul_ns(n, n, d) / p
    ops = [  # (compute ns, elements moved)
        (mm, bh * (2 * n * d + n * n)),  # S = Q K^T: read Q, K; write S
        (bh * hw.softmax_ns(n, n) / p, bh * 2 * n * n),  # P = softmax(S): read S, write P
        (mm, bh * (n * n + 2 * n * d)),  # O = P V: read P, V; write O
    ]
    return sum(max(c, hw.dram_ns(e, sharing=1)) for c, e in ops)


def report_sweep(seq_lens=(512, 1024, 2048, 4096, 8192, 16384), dims=(64, 128, 256), *, tokens=16384,
                 hidden=2048, hw=Wormhole()):
    """The report's benchmark shape: batch * seq_len = tokens, heads * d = hidden, causal.
    Returns rows (seq_len, d, FA ns, baseline ns, speed-up)."""
    rows = []
    for n in seq_lens:
        for d in dims:
            batch, heads = max(1, tokens // n), hidden // d
            fa = flash_attention_grid(n, d, heads, batch, q_chunk=min(256, n), k_chunk=min(256, n), hw=hw)
            base = unfused_baseline_ns(n, d, heads, batch, hw)
            rows.append((n, d, fa.makespan_ns, base, base / fa.makespan_ns))
    return rows


# --- figures ---------------------------------------------------------------------------------------------

_COLORS = {"reader": "#4c72b0", "compute": "#dd8452", "writer": "#55a868"}


def plot_core(busy, ax=None, until=None, title=None):
    """Gantt chart of one core's reader, compute and writer programs (like the report's Figure 5)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(10, 2))[1]
    names = ["writer", "compute", "reader"]
    for y, p in enumerate(names):
        for a, b, label in busy[p]:
            if until is not None and a >= until:
                break
            ax.barh(y, b - a, left=a, height=0.7, color=_COLORS[p], edgecolor="black", lw=0.4)
            if until and (b - a) > until / 40:
                ax.text((a + b) / 2, y, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(3), names)
    if until:
        ax.set_xlim(0, until)
    ax.set_xlabel("time (ns)")
    if title:
        ax.set_title(title)
    return ax


def plot_grid_utilisation(result, ax=None, title=None):
    """Heat map of each core's compute utilisation over the grid."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(4, 4))[1]
    im = ax.imshow(result.compute_busy_ns / result.makespan_ns, vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"mean utilisation {result.utilisation:.0%}")
    return im
