"""Launch plans: the one place that decides how every kernel is launched (lesson 10).

    from flashlab.kernels.plan import plan, T4, H100
    p = plan((1, 16, 1024, 1024, 64), causal=True)         # on this GPU (in the simulator: its T4-like limits)
    p = plan((1, 16, 1024, 1024, 64), device=H100)         # an H100 planned without one
    print(p.explain())
    o, lse = flash_attention(q, k, v, plan=p)              # or let flash_attention make the same plan

For one problem (B, H, Nq, Nk, d, dtype, causal, forward or backward) on one device a plan holds:
- the variant's tile and threads per block (the tiles the kernels have always used, or block_q / block_k /
  tile overrides);
- blocks per SM: how many blocks of this kernel an SM holds at once, limited by threads, registers or shared
  memory (`devices.occupancy`). Registers come from the compiled kernel on this GPU, and from
  flashlab/data/kernel_resources.csv (written by benchmarks/generators/kernel_resources.py with NVIDIA's compiler) for a
  device passed by hand;
- waves: the blocks that have work, over the blocks the whole GPU holds at once (SMs x blocks per SM);
- split-KV: when the grid fills fewer than SPLIT_BELOW_WAVES waves, the keys are cut into chunks, one block
  per (query block, chunk); each chunk's partial result is merged with the course's merge rule (lesson 03's
  (m, l) merge, lesson 14's kernel);
- the order of the blocks: under causal masking, the heaviest first across all heads.

Predicted efficiency is a model, not a measurement: each block holds one of the GPU's SMs x blocks-per-SM
slots for a time proportional to its work (key tiles visited); blocks go to free slots in launch order (what
GPUs do in practice; CUDA does not promise an order). Efficiency = the slots' busy time / (slots x the time
the last block ends). It ignores that a lonely block on an SM runs faster than one that shares it, and the
merge's own cost; the shape suite (benchmarks/timing/bench_kernels.py --suite) measures what it predicts.
"""
from __future__ import annotations

import csv
import heapq
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .._inputs import check_block
from ..device import device_limits, has_gpu
from . import hopper, register, register_backward, shared, tensor, tensor_backward
from ._launch import SUPPORTED_D, check_d
from .options import Features, key_band, query_band, tile_band
# T4, A100, H100, DEVICES and current_device are part of plan's API (lesson 10 plans for them by name).
from .devices import A100, DEVICES, H100, T4, Device, _device, current_device, occupancy  # noqa: F401
from .split_kv import grid, split_chunk

RESOURCES_CSV = Path(__file__).resolve().parent.parent / "data" / "kernel_resources.csv"
RESOURCE_COLUMNS = ("variant", "direction", "d", "dtype", "precision", "tile", "causal", "split", "heavy_first",
                    "cc", "registers", "spill_bytes", "shared_bytes", "threads")
VARIANTS = {"forward": ("shared", "register", "tensor"), "backward": ("register", "tensor")}
DTYPES = {"shared": ("float32", "float16"), "register": ("float32", "float16"),
          "tensor": ("float32", "float16", "bfloat16")}

# When and how far to split the keys: the model above, checked against the H100 shape suite, which times
# split and unsplit launches side by side (benchmarks/results/h100/split_decision.csv). There the register
# kernel's automatic splits won in 13 of 15 shapes (1.03x to 1.66x; B1 N2048 d128 causal lost 14%, B4 N1024
# d64 causal 7%).
SPLIT_BELOW_WAVES = 2.0  # consider split-KV when the blocks with work fill fewer waves than this
SPLIT_TARGET = 0.9  # the fewest chunks whose predicted efficiency reaches this (else the best available)
SPLIT_GAIN = 0.05  # ... and only if that beats no split by this much: partial results cost traffic and a merge
MIN_CHUNK = 256  # keys per chunk, at least
MAX_SPLITS = 32
# The tensor-core kernel's automatic splits lost in 15 of 17 shapes (fp16 0.46x to 1.0x, 3xTF32 0.86x to
# 1.05x): its blocks are few and short already, and the fp32 partial results and the merge cost more than
# the fuller waves give back. It splits only when splits= asks.
# AUTO_SPLIT = False turns automatic split-KV off on the GPU in use (device=None); plans for a device passed
# by hand (lesson 10, what-if questions) still split as the model says, and splits= forces a split anywhere.
AUTO_SPLIT = True


RESOURCE_CCS = ((7, 5), (8, 0), (9, 0))  # kernel_resources.csv has builds for these


# ---------------------------------------------------------------------------------------------- problems
@dataclass(frozen=True)
class Problem:
    """One attention call: (B, H, Nq, Nk, d), dtype, causal, and forward or backward."""

    B: int
    H: int
    Nq: int
    Nk: int
    d: int
    causal: bool = False
    dtype: str = "float32"
    direction: str = "forward"

    def __post_init__(self):
        for name in ("B", "H", "Nq", "Nk", "d"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        check_d(self.d)
        if self.direction not in VARIANTS:
            raise ValueError(f"direction must be 'forward' or 'backward'; got {self.direction!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16'; got {self.dtype!r}")

    @property
    def shape(self) -> str:
        nk = "" if self.Nk == self.Nq else f" Nk={self.Nk}"
        return f"B={self.B} H={self.H} N={self.Nq}{nk} d={self.d}"


def _problem(problem, causal, dtype, direction) -> Problem:
    if isinstance(problem, Problem):
        return Problem(problem.B, problem.H, problem.Nq, problem.Nk, problem.d,
                       problem.causal if causal is None else bool(causal), dtype or problem.dtype,
                       direction or problem.direction)
    shape = tuple(problem)
    if len(shape) == 4:
        shape = shape[:3] + (shape[2],) + shape[3:]
    if len(shape) != 5:
        raise ValueError(f"problem must be a Problem, (B, H, N, d) or (B, H, Nq, Nk, d); got {problem!r}")
    return Problem(*(int(x) if isinstance(x, numbers.Integral) else x for x in shape), causal=bool(causal),
                   dtype=dtype or "float32", direction=direction or "forward")


# ------------------------------------------------------------------------------------------------ configs
def config_text(variant: str, direction: str, config) -> str:
    """A configuration in a few characters: the `tile` column of kernel_resources.csv."""
    if direction == "backward":
        if variant == "tensor":
            return f"{config.block_q}x{config.block_k} {config.warps}w {config.stages}st" + (" vsh" if config.v_shared else "")
        bq, bk, threads = config
        return f"{bq}x{bk} {threads}t"
    if variant == "register":
        return f"{config.block_q}x{config.block_k} {config.tr}x{config.tc}" + (" prefetch" if config.prefetch else "")
    if variant == "tensor":
        return f"{config.block_q}x{config.block_k} {config.warps}w"
    return f"{config[0]}x{config[1]}"


def _choose_config(p: Problem, variant: str, dev: Device, block_q, block_k, tile, threads, precision, extras=False,
                   varlen=False):
    """(config, precision, threads per block, shared bytes, block_q, block_k) of the kernel this call launches."""
    d = p.d
    if p.direction == "backward" and variant == "tensor":
        precision = tensor.resolve_precision(p.dtype, precision, dev.cc)
        config = tensor_backward.choose_tile(d, precision, block_q, block_k, dev.dynamic_shared_per_block)
        return config, precision, config.threads, 4 * config.shared_words(d, precision), config.block_q, config.block_k
    if p.direction == "backward":
        bq, bk, nt = register_backward.default_config(d, simulator=dev.simulated)
        config = (block_q or bq, block_k or bk, threads or nt)
        register_backward.check_config(d, *config)
        return config, None, config[2], register_backward.shared_bytes(d, config[0], config[1]), config[0], config[1]
    if variant == "register":
        config = tile.check(d, dev.shared_per_block) if tile is not None else \
            register.choose_tile(d, block_q, block_k, dev.shared_per_block, dev.shared_per_sm)
        return config, None, config.threads, config.shared_bytes(d), config.block_q, config.block_k
    if variant == "tensor":
        precision = tensor.resolve_precision(p.dtype, precision, dev.cc)
        config = tensor.choose_tile(d, precision, block_q, block_k, p.causal, extras, varlen)
        config.check(d, precision, dev.shared_per_block)
        return config, precision, config.threads, 4 * config.shared_words(d, precision), config.block_q, config.block_k
    bq, bk = block_q or shared.DEFAULT_BLOCK_Q, block_k or shared.DEFAULT_BLOCK_K
    shared.check_blocks(d, bq, bk, dev.shared_per_block)
    return (bq, bk), None, bq, shared.shared_bytes(d, bk), bq, bk


# ---------------------------------------------------------------------------------------- registers
@lru_cache(maxsize=1)
def resource_table() -> dict:
    """kernel_resources.csv as {key: row}; key = (variant, direction, d, dtype, precision, tile, causal, split,
    heavy_first, cc). Empty when the file is missing."""
    table = {}
    if RESOURCES_CSV.exists():
        with open(RESOURCES_CSV, newline="") as f:
            for row in csv.DictReader(f):
                key = resource_key(row["variant"], row["direction"], int(row["d"]), row["dtype"], row["precision"],
                                   row["tile"], row["causal"] == "1", row["split"] == "1", row["heavy_first"] == "1",
                                   row["cc"])
                table[key] = {"registers": int(row["registers"]), "spill_bytes": int(row["spill_bytes"]),
                              "shared_bytes": int(row["shared_bytes"])}
    return table


def resource_key(variant, direction, d, dtype, precision, tile, causal, split, heavy_first, cc) -> tuple:
    cc = cc if isinstance(cc, str) else f"{cc[0]}.{cc[1]}"
    return (variant, direction, int(d), dtype, precision or "", tile, bool(causal), bool(split), bool(heavy_first), cc)


def _table_cc(cc):
    """The compute capability whose build stands in for `cc`: the newest table build not newer than it."""
    older = [c for c in RESOURCE_CCS if c <= tuple(cc)]
    return older[-1] if older else None


def kernel_and_signature(variant, direction, d, dtype, precision, config, causal, split, heavy_first,
                         features=Features()):
    """(numba dispatcher, argument types) of one configuration, C-contiguous arrays of `dtype` in (compiled
    here on a GPU; by benchmarks/generators/kernel_resources.py for other compute capabilities). features: the
    library's options a build compiles in (options.Features; their values are arguments in every build)."""
    if direction == "backward" and variant == "tensor":
        # the non-causal build stands for both (as the resource table has always measured it)
        return tensor_backward.build(d, config, False, precision, features=features)[1], \
            tensor_backward.signature(precision)
    if direction == "backward":
        return register_backward.make_kernels(d, *config, heavy_first=heavy_first, features=features)[1], \
            register_backward.signature(dtype)
    if variant == "register":
        return register.build(d, config, causal, split=split, heavy_first=heavy_first, features=features), \
            register.signature(dtype, split)
    if variant == "tensor":
        return tensor.build(d, config, causal, precision, split=split, heavy_first=heavy_first, features=features), \
            tensor.signature(precision, split)
    from numba import float32, int64, types

    a4 = types.Array({"float32": float32, "float16": types.float16}[dtype], 4, "C")
    return shared.build(d, *config, causal), (a4, a4, a4, a4, types.Array(float32, 3, "C"), int64, int64, int64, float32)


def _compiled_resources(p: Problem, variant, config, precision, split, heavy):
    """(registers, spill bytes) of the kernel compiled for this GPU."""
    kernel, sig = kernel_and_signature(variant, p.direction, p.d, p.dtype, precision, config, p.causal, split, heavy)
    kernel.compile(sig)
    compiled = kernel.overloads[sig]
    return int(compiled.regs_per_thread), int(compiled.local_mem_per_thread)


def _resources(p, variant, config, precision, split, heavy, dev):
    """(registers, spill bytes, where they come from)."""
    if dev.simulated:
        return None, None, "simulator: registers need NVIDIA's compiler"
    if has_gpu() and dev == current_device():
        regs, spill = _compiled_resources(p, variant, config, precision, split, heavy)
        return regs, spill, "the compiled kernel"
    cc = _table_cc(dev.cc) if dev.cc else None
    if cc is not None:
        key = resource_key(variant, p.direction, p.d, p.dtype, precision, config_text(variant, p.direction, config),
                           p.causal if p.direction == "forward" else False, split, heavy, cc)
        row = resource_table().get(key)
        if row:
            return row["registers"], row["spill_bytes"], f"kernel_resources.csv (cc {cc[0]}.{cc[1]} build)"
    return None, None, "unknown (no row in kernel_resources.csv): counted without registers"


# ------------------------------------------------------------------------------------------ the model
def block_work(p: Problem, block_q: int, block_k: int, splits: int = 1, chunk: int | None = None) -> np.ndarray:
    """Work of every block of one (batch, head), in key tiles (forward: rows = query blocks, columns = chunks)
    or query tiles visited (backward: one column, rows = key blocks): the tiles that overlap the band of the
    block's rows or keys (options.key_band / query_band, as the kernels compute it; causal here, no window)."""
    right = 0 if p.causal else -1
    if p.direction == "backward":
        k0 = np.arange(-(-p.Nk // block_k)) * block_k
        lo, hi = query_band(k0, np.minimum(k0 + block_k, p.Nk) - 1, 0, p.Nq, -1, right)
        return tile_band(lo, hi, block_q)[2][:, None]
    chunk = chunk or p.Nk
    q0 = np.arange(-(-p.Nq // block_q))[:, None] * block_q
    begin = np.arange(splits)[None, :] * chunk
    lo, hi = key_band(q0, q0 + block_q - 1, p.Nk, -1, right)  # the block's rows, past Nq too, as the kernels
    lo, hi = np.maximum(lo, begin), np.minimum(hi, np.minimum(p.Nk, begin + chunk))
    return np.broadcast_to(-(-np.maximum(hi - lo, 0) // block_k), (len(q0), splits))


def dispatch_order(work: np.ndarray, batch_heads: int, heavy_first: bool, direction: str = "forward",
                   section=None) -> np.ndarray:
    """Work of every block of the grid in launch order (x fastest, then y, then z), from one head's `work`.

    Forward grids: (query blocks, B*H, splits) with query block Tr-1-x, or heavy-first (g, query blocks,
    sections x splits): sections of g = `section` heads, chunk by chunk, each section's blocks heaviest first.
    Backward: (key blocks, H, B), or heavy-first (g, key blocks, sections), key block 0 (the heaviest under
    causal) first."""
    rows = work.shape[0]
    g = section or batch_heads
    if direction == "backward":
        col = work[:, 0]
        return np.tile(np.repeat(col, g), batch_heads // g) if heavy_first else np.tile(col, batch_heads)
    if heavy_first:  # z = (chunk, section), then y (query block, heaviest first), then x (head in the section)
        per_chunk = [np.tile(np.repeat(work[::-1, c], g), batch_heads // g) for c in range(work.shape[1])]
        return np.concatenate(per_chunk)
    w = work[::-1]  # grid index x = Tr - 1 - query block
    return np.tile(w.T.reshape(work.shape[1], 1, rows), (1, batch_heads, 1)).reshape(-1)


def l2_section(p: Problem, dev: Device, itemsize: int) -> int:
    """Heads per section of the heaviest-first order: the most heads (a power of two dividing B*H) whose
    streamed operand fits in L2 (K and V for the forward, Q and dO for the backward), as FlashAttention's
    SingleTileLPTScheduler does (flash_attn/cute/tile_scheduler.py); all of B*H when L2 is unknown. Grid
    axes y (blocks) and z (sections x splits) must stay below 65536."""
    bh = p.B * p.H
    rows = p.Nk if p.direction == "forward" else p.Nq
    per_head = 2 * rows * p.d * itemsize
    g = bh
    if dev.l2_bytes:
        fit = max(1, dev.l2_bytes // per_head)
        g = 1 << (fit.bit_length() - 1)
        while bh % g:
            g //= 2
    return g


def schedule(works, slots: int):
    """(slot, start, end) of every block of `works` (in launch order) on `slots` slots, each block taking the
    slot that frees first (the earliest started on ties): what lesson 10's timelines draw."""
    works = np.asarray(works, dtype=np.float64)
    slot, start = np.empty(len(works), np.int64), np.empty(len(works))
    free = [(0.0, i) for i in range(slots)]
    for b, w in enumerate(works):
        t, i = heapq.heappop(free)
        slot[b], start[b] = i, t
        heapq.heappush(free, (t + w, i))
    return slot, start, start + works


def slot_efficiency(works, slots: int) -> tuple:
    """(makespan, efficiency) of `works` (in launch order) on `slots` slots, each block taking the first free
    slot: efficiency = sum(works) / (slots x makespan)."""
    works = np.asarray(works, dtype=np.float64)
    total = float(works.sum())
    if total == 0:
        return 0.0, 1.0
    if np.all(works == works[0]):  # equal blocks: whole waves
        makespan = math.ceil(len(works) / slots) * works[0]
    elif len(works) <= slots:
        makespan = float(works.max())
    else:
        free = [0.0] * slots
        for w in works:
            t = heapq.heappop(free)
            heapq.heappush(free, t + w)
        makespan = max(free)
    return makespan, total / (slots * makespan)


# ----------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """How one kernel call is launched, and why (see the module docstring). `explain()` says it in words."""

    problem: Problem
    device: Device
    variant: str
    precision: str | None
    config: object
    threads: int
    shared_bytes: int
    registers: int | None
    spill_bytes: int | None
    registers_from: str
    blocks_per_sm: int
    limited_by: str
    bounds: tuple
    occupancy: float
    block_q: int
    block_k: int
    splits: int
    chunk: int
    heavy_first: bool
    section: int  # heads per section of the heaviest-first order (B*H when not heavy-first)
    blocks: int  # launched
    busy_blocks: int  # with work
    efficiency: float
    unsplit: tuple  # (waves, efficiency) without split
    split_reason: str

    @property
    def direction(self) -> str:
        return self.problem.direction

    @property
    def slots(self) -> int:
        return self.device.sms * self.blocks_per_sm

    @property
    def waves(self) -> float:
        return self.busy_blocks / self.slots

    @property
    def grid(self) -> tuple:
        p = self.problem
        if p.direction == "backward":
            nkb = -(-p.Nk // self.block_k)
            if self.variant == "tensor":
                return (nkb, p.B * p.H)
            return (self.section, nkb, p.B * p.H // self.section) if self.heavy_first else (nkb, p.H, p.B)
        return grid(p.B, p.H, p.Nq, self.block_q, self.splits, self.heavy_first, self.section)

    @property
    def order(self) -> str:
        if not self.problem.causal:
            return "in order (every block has the same work)"
        if self.heavy_first:
            bh = self.problem.B * self.problem.H
            what = "K and V" if self.direction == "forward" else "Q and dO"
            return "heaviest first across all heads" if self.section == bh else \
                f"heaviest first, in sections of {self.section} heads whose {what} fit in L2"
        return "heaviest first within each head"

    def works(self, splits=None, heavy_first=None) -> np.ndarray:
        """Every block's work in launch order (key tiles, or query blocks for the backward); by default this
        plan's, or with another number of chunks / order for comparison."""
        p = self.problem
        splits = self.splits if splits is None else splits
        chunk = self.chunk if splits == self.splits else split_chunk(p.Nk, splits, self.block_k)[0]
        if p.direction == "forward" and splits > 1:
            splits = split_chunk(p.Nk, splits, self.block_k)[1]
        heavy = self.heavy_first if heavy_first is None else heavy_first
        return dispatch_order(block_work(p, self.block_q, self.block_k, splits, chunk), p.B * p.H, heavy, p.direction,
                              self.section)

    def predict(self, splits=None, heavy_first=None) -> dict:
        """The model's numbers for this plan, or for it with another number of chunks / order."""
        works = self.works(splits, heavy_first)
        busy = int(np.count_nonzero(works))
        makespan, eff = slot_efficiency(works, self.slots)
        return {"blocks": len(works), "busy_blocks": busy, "waves": busy / self.slots, "efficiency": eff,
                "time": makespan}

    def summary(self) -> str:
        """The plan in a few words (the suite's `plan` column)."""
        split = f" split {self.splits}x{self.chunk}" if self.splits > 1 else ""
        regs = f" {self.registers}r" if self.registers else ""
        order = " heavy-first" if self.heavy_first else ""
        return (f"{self.variant} {config_text(self.variant, self.direction, self.config)}{regs} "
                f"{self.blocks_per_sm}/SM {self.waves:.2f}w{split}{order}")

    def explain(self) -> str:
        p, dev = self.problem, self.device
        mask = ", causal" if p.causal else ""
        prec = f" ({self.precision})" if self.precision else ""
        lines = [f"{p.direction} {self.variant}{prec}, {p.dtype}, {p.shape}{mask}, on {dev.label}"]
        regs = f"{self.registers} registers per thread (from {self.registers_from})" if self.registers else \
            f"registers: {self.registers_from}"
        optin = f" (dynamic: past {dev.shared_per_block // 1024} KB, the kernel opts in; " \
            f"{dev.dynamic_shared_per_block:,} allowed)" if self.shared_bytes > dev.shared_per_block else ""
        m_tiles = getattr(self.config, "m_tiles", 1)  # the tensor forward: 16-row m-tiles per warp
        rows = f", {m_tiles} m-tiles of 16 rows per warp" if m_tiles > 1 else ""
        lines.append(f"- tile: block_q = {self.block_q}, block_k = {self.block_k} "
                     f"({config_text(self.variant, self.direction, self.config)}{rows}), {self.threads} threads, "
                     f"{self.shared_bytes:,} bytes of shared memory{optin}, {regs}")
        limits = [k for k, v in self.bounds if v == self.blocks_per_sm]
        others = ", ".join(f"{k} {v}" for k, v in self.bounds if v != self.blocks_per_sm)
        warps = self.blocks_per_sm * -(-self.threads // dev.warp)
        lines.append(f"- {self.blocks_per_sm} block{'s' if self.blocks_per_sm > 1 else ''} per SM, limited by "
                     f"{' and '.join(limits)} ({others or 'nothing else'}): {warps} warps of "
                     f"{dev.max_threads_per_sm // dev.warp}, occupancy {self.occupancy:.0%}")
        what = "key blocks" if p.direction == "backward" else "query blocks"
        per_head = -(-(p.Nk if p.direction == "backward" else p.Nq) // (self.block_k if p.direction == "backward"
                                                                       else self.block_q))
        lines.append(f"- grid: {per_head} {what} x {p.B * p.H} heads = {per_head * p.B * p.H} blocks for "
                     f"{dev.sms} SMs x {self.blocks_per_sm} = {self.slots} slots: {self.unsplit[0]:.2f} waves, "
                     f"predicted efficiency {self.unsplit[1]:.0%}")
        if self.splits > 1:
            idle = self.blocks - self.busy_blocks
            gone = f" ({idle} of them see no key of their chunk and exit at once)" if idle else ""
            lines.append(f"- split-KV: {self.splits} chunks of {self.chunk} keys -> {self.blocks} blocks{gone}: "
                         f"{self.waves:.2f} waves, predicted efficiency {self.efficiency:.0%}; a merge kernel then "
                         f"combines the {self.splits} partial results of each row")
        else:
            lines.append(f"- no split: {self.split_reason}")
        lines.append(f"- order: {self.order}")
        return "\n".join(lines)

    __str__ = explain

    # ---- launching
    def check_inputs(self, B, H, Nq, Nk, d, causal, dtype):
        p = self.problem
        got = (B, H, Nq, Nk, d, bool(causal))
        if got != (p.B, p.H, p.Nq, p.Nk, p.d, p.causal) or dtype != p.dtype:
            raise ValueError(f"plan= was made for {p.shape}, {p.dtype}, causal={p.causal}; these inputs are "
                             f"B={B} H={H} Nq={Nq} Nk={Nk} d={d}, {dtype}, causal={bool(causal)}: make a plan for "
                             f"them with flashlab.kernels.plan.plan(...)")


def _choose_splits(p, variant, precision, dev, block_q, block_k, slots, splits):
    """(splits, chunk, reason) for a forward launch."""
    if splits is not None:
        if variant == "shared" and splits > 1:
            raise ValueError("splits > 1 needs variant='register' or 'tensor'; the textbook kernel does not split")
        if precision == "bf16" and splits > 1:
            raise ValueError(f"splits={splits} does not apply to bfloat16: the merge of the key chunks writes float16 "
                             f"or float32; pass splits=None or 1")
        chunk, n = split_chunk(p.Nk, splits, block_k)
        return n, chunk, f"splits={splits} asked for"
    if variant == "shared":
        return 1, p.Nk, "the textbook kernel does not split"
    if variant == "tensor":
        return 1, p.Nk, "the tensor-core kernel splits only when asked: automatic splits measured slower on the H100"
    if precision == "bf16":
        return 1, p.Nk, "bfloat16 does not split (the merge kernel writes float16 or float32)"
    if dev.simulated:
        return 1, p.Nk, "the simulator runs one block at a time (pass a device, or splits=)"
    return None, None, None


def plan(problem, *, variant: str = "register", direction: str | None = None, causal=None, dtype: str | None = None,
         device=None, block_q=None, block_k=None, tile=None, threads=None, precision=None, splits=None,
         extras: bool = False, varlen: bool = False) -> Plan:
    """The launch plan for `problem`: a Problem, (B, H, N, d) or (B, H, Nq, Nk, d) (then causal, dtype and
    direction, default False, "float32", "forward"). device: a Device, "T4" / "A100" / "H100", or None for
    this GPU. block_q / block_k / tile (register) / threads (backward) / precision (tensor) override the
    kernel's configuration as in flash_attention; splits forces a number of key chunks (1: none). extras / varlen:
    the forward build compiles in the library's options (tensor.options_weight: False, "light" or "heavy") /
    packs sequences; the tensor kernel's default tile then leaves registers for them."""
    args = (problem if isinstance(problem, Problem) else tuple(problem), variant, direction, causal, dtype, device,
            block_q, block_k, tile, threads, precision, splits, AUTO_SPLIT or device is not None, extras or False,
            bool(varlen))
    try:
        hash(args)
    except TypeError:  # e.g. a list somewhere: plan without the cache (the checks name the bad argument)
        return _make_plan(*args)
    return _cached_plan(*args)


@lru_cache(maxsize=1024)
def _cached_plan(*args) -> Plan:
    return _make_plan(*args)


def _make_plan(problem, variant, direction, causal, dtype, device, block_q, block_k, tile, threads, precision,
               splits, auto, extras=False, varlen=False) -> Plan:
    p = _problem(problem, causal, dtype, direction)
    dev = _device(device)
    if variant not in VARIANTS[p.direction]:
        raise ValueError(f"variant for the {p.direction} must be one of {VARIANTS[p.direction]}; got {variant!r}")
    if p.direction == "forward" and p.dtype not in DTYPES[variant]:
        raise ValueError(f"variant {variant!r} takes {' or '.join(DTYPES[variant])}; got dtype {p.dtype!r}")
    if p.direction == "backward" and p.dtype == "bfloat16" and variant == "register":
        raise ValueError("the register backward takes float32 or float16; bfloat16 runs on variant='tensor'")
    block_q, block_k = check_block(block_q, "block_q"), check_block(block_k, "block_k")
    threads, splits = check_block(threads, "threads"), check_block(splits, "splits")
    if tile is not None and (variant != "register" or p.direction != "forward"):
        raise ValueError("tile= configures the register forward kernel; use block_q / block_k otherwise")
    if threads is not None and (p.direction != "backward" or variant != "register"):
        raise ValueError("threads= configures the register backward kernel; other kernels have 32 threads per warp "
                         "and set their warps from block_q / block_k")
    if precision is not None and variant != "tensor":
        raise ValueError(f"precision applies to variant='tensor' only; got precision={precision!r}")
    if splits is not None and p.direction == "backward":
        raise ValueError("the backward kernel does not split (one block per key block already)")
    return _plan(p, variant, dev, block_q, block_k, tile, threads, precision, splits, auto, extras, varlen)


@lru_cache(maxsize=256)
def _plan(p: Problem, variant, dev: Device, block_q, block_k, tile, threads, precision, splits, auto=True,
          extras=False, varlen=False) -> Plan:
    config, precision, nthreads, shared_bytes, bq, bk = _choose_config(p, variant, dev, block_q, block_k, tile,
                                                                       threads, precision, extras, varlen)
    # The tensor backward's grid (key blocks, B*H) already starts each head with its heaviest key block.
    heavy = p.causal and variant != "shared" and not (p.direction == "backward" and variant == "tensor")
    bh = p.B * p.H
    itemsize = 4 if p.dtype == "float32" else 2
    section = l2_section(p, dev, itemsize) if heavy else bh
    n_blocks = -(-(p.Nk if p.direction == "backward" else p.Nq) // (bk if p.direction == "backward" else bq))
    if heavy and n_blocks > 65535:  # grid axis y would overflow: keep the per-head order
        heavy, section = False, bh

    def model(n_splits, chunk, blocks_per_sm):
        work = block_work(p, bq, bk, n_splits, chunk)
        order = dispatch_order(work, bh, heavy, p.direction, section)
        busy = int(np.count_nonzero(order))
        return len(order), busy, busy / (dev.sms * blocks_per_sm), slot_efficiency(order, dev.sms * blocks_per_sm)[1]

    regs, spill, source = _resources(p, variant, config, precision, False, heavy, dev)
    occ = occupancy(nthreads, regs, shared_bytes, dev.limits)
    if occ["blocks_per_sm"] < 1:
        raise ValueError(f"{config_text(variant, p.direction, config)} does not fit one block on an SM of "
                         f"{dev.label}: {occ['limited_by']} ({occ['bounds']})")
    blocks, busy, waves, eff = model(1, p.Nk, occ["blocks_per_sm"])
    unsplit = (waves, eff)
    n, chunk, reason = (1, p.Nk, "the backward kernel has one block per key block") if p.direction == "backward" \
        else _choose_splits(p, variant, precision, dev, bq, bk, None, splits)
    if n is None and not auto:
        n, chunk, reason = 1, p.Nk, ("automatic split-KV is off on the GPU in use "
                                     "(flashlab.kernels.plan.AUTO_SPLIT = False); pass splits= to split")
    if n is None:  # the planner's choice
        n, chunk, reason = 1, p.Nk, f"{waves:.2f} waves fill the GPU (>= {SPLIT_BELOW_WAVES:g})"
        if waves < SPLIT_BELOW_WAVES:
            reason = f"shorter chunks than {MIN_CHUNK} keys would cost more than they win"
            options = {}
            for s in range(2, MAX_SPLITS + 1):
                c, m = split_chunk(p.Nk, s, bk)
                if c < MIN_CHUNK:
                    break
                if m not in options:
                    options[m] = (c, model(m, c, occ["blocks_per_sm"])[3])
            if options:
                good = [m for m, (c, e) in options.items() if e >= SPLIT_TARGET]
                best = min(good) if good else max(options, key=lambda m: (round(options[m][1], 3), -m))
                if options[best][1] >= eff + SPLIT_GAIN:
                    n, chunk = best, options[best][0]
                    reason = "split"
                else:
                    reason = (f"splitting would not help: {options[best][1]:.0%} with {best} chunks against "
                              f"{eff:.0%} (a split must win {SPLIT_GAIN:.0%} to pay for its merge)")
    if n > 1 and splits is None:
        spill2 = _resources(p, variant, config, precision, True, heavy, dev)[1]
        if spill2:  # the split build would spill to local memory: not worth the gamble
            n, chunk, reason = 1, p.Nk, f"the split kernel spills {spill2} bytes per thread to local memory"
    if n > 1:
        regs2, spill2, source2 = _resources(p, variant, config, precision, True, heavy, dev)
        if regs2 is not None or regs is None:
            regs, spill, source = regs2, spill2, source2
            occ = occupancy(nthreads, regs, shared_bytes, dev.limits)
        blocks, busy, _, eff = model(n, chunk, occ["blocks_per_sm"])
    return Plan(problem=p, device=dev, variant=variant, precision=precision, config=config, threads=nthreads,
                shared_bytes=shared_bytes, registers=regs, spill_bytes=spill, registers_from=source,
                blocks_per_sm=occ["blocks_per_sm"], limited_by=occ["limited_by"], bounds=tuple(occ["bounds"].items()),
                occupancy=occ["occupancy"], block_q=bq, block_k=bk, splits=n, chunk=chunk, heavy_first=heavy,
                section=section, blocks=blocks, busy_blocks=busy, efficiency=eff, unsplit=unsplit, split_reason=reason)


def planner_configs(devices=(T4, A100, H100)):
    """Every kernel configuration the planner chooses without overrides on `devices`, plus the tiles kept
    selectable (register.D128_REDESIGN): tuples (variant, direction, d, dtype, precision, config, causal, split,
    heavy_first, cc). benchmarks/generators/kernel_resources.py compiles each; a test checks the table has them all."""

    out = {}
    for dev in devices:
        for d in SUPPORTED_D:
            for causal in (False, True):
                for direction, variant, dtype, precision in (
                        [("forward", v, dt, None) for v in ("shared", "register") for dt in ("float32", "float16")]
                        + [("forward", "tensor", dt, None) for dt in ("float16", "bfloat16", "float32")]
                        + [("forward", "tensor", "float32", "tf32"), ("backward", "register", "float32", None),
                           ("backward", "register", "float16", None)]
                        + [("backward", "tensor", dt, None) for dt in ("float16", "bfloat16", "float32")]):
                    prob = Problem(1, 1, 256, 256, d, causal, dtype, direction)
                    try:  # the forward's tensor tile depends on the build: plain, with options, varlen
                        builds = ((False, False), ("light", False), ("heavy", False), (False, True)) \
                            if variant == "tensor" else ((False,) * 2,)
                        chosen = [_choose_config(prob, variant, dev, None, None, None, None, precision, *b) for b in builds]
                    except ValueError:  # e.g. bfloat16 on a T4
                        continue
                    config, prec = chosen[0][:2]
                    heavy = causal and variant != "shared" and not (direction == "backward" and variant == "tensor")
                    can_split = direction == "forward" and variant != "shared" and prec != "bf16"
                    configs = list(dict.fromkeys(c[0] for c in chosen)) + (
                        [register.D128_REDESIGN] if variant == "register" and direction == "forward" and d == 128 else [])
                    for cfg in configs:
                        for split in ((False, True) if can_split else (False,)):
                            key = (variant, direction, d, dtype, prec, cfg, causal if direction == "forward" else False,
                                   split, heavy, dev.cc)
                            out[key] = None
    return list(out)


def forward_variant(dtype: str, d: int, cc, options: bool = False) -> str:
    """The forward kernel a library call (flashlab.torch) runs for inputs of `dtype` and head size d on a GPU of
    compute capability cc (None: the simulator, which runs every instruction; planned as an sm_80 GPU), with or
    without the library's options:

    - "wgmma" (FlashAttention-3, kernels/wgmma.py) on Hopper for float16 / bfloat16 at d = 64 or 128 without
      options: on an H200 (2026-11-29, benchmarks/results/h200/wgmma_forward.csv) it was faster than the tensor
      kernel at 47 of the 48 bar shapes (N 4096 to 16384) and at every shorter one timed (N 256 to 2048, B = 1,
      float16); the exception, B = 1, N = 4096, d = 64, causal, bfloat16, measured 0.85x in one run;
    - else "tensor" where the GPU has tensor-core mma for the dtype (float16: sm_75+; bfloat16, and float32 through
      tf32: sm_80+; bfloat16 below that gets the tensor kernel's clear error) and the kernels take d; on an H100
      the tensor kernel is also the faster one for float32 (flashlab/data/h100_tensor.csv);
    - else "register"."""
    cc = tuple(cc) if cc is not None else (8, 0)
    if d not in SUPPORTED_D:
        return "register"
    if hopper.runs_on(cc) and dtype in ("float16", "bfloat16") and d in (64, 128) and not options:
        return "wgmma"
    if dtype == "bfloat16" or cc >= ((7, 5) if dtype == "float16" else (8, 0)):
        return "tensor"
    return "register"


# The backward shapes timed against the tensor backward on an H200, with the wgmma backward's default tile of two
# consumer warpgroups (2026-12-03, benchmarks/results/h200/wgmma_backward_two_consumers.txt; with the dQ warp at
# d 128, flashlab/data/wgmma_backward.csv): faster at all 32 shapes with N 4096 and 16384 (1.37-2.12x, then
# 1.54-2.29x; d 64 and 128, causal or not, B H 16 and 64, float16 and bfloat16) and at all 48 with N 512, 1024 and
# 2048 (1.08-1.93x; B H 16 and 32). Shorter sequences were not timed.
WGMMA_BACKWARD_MIN_N = 512


def wgmma_backward_fits(dtype: str, d: int, cc, n_q: int, n_k: int, gqa: bool = False, options: bool = False) -> bool:
    """Whether a library call (flashlab.torch) runs the backward on "wgmma" (FlashAttention-3's, kernels/
    wgmma_backward.py) rather than its default (kernels/backward.default_variant): on Hopper, for float16 /
    bfloat16 at d = 64 or 128, without options or grouped-query heads, with Nq and Nk at least
    WGMMA_BACKWARD_MIN_N, the shapes where it was measured faster than the tensor backward. cc None (the
    simulator): no, as for any GPU before Hopper."""
    return (hopper.runs_on(cc) and dtype in ("float16", "bfloat16") and d in (64, 128)
            and not options and not gqa and min(n_q, n_k) >= WGMMA_BACKWARD_MIN_N)


def resolve_config(variant: str, d: int, block_q=None, block_k=None, precision=None):
    """The launch configuration a call would use: a register.Tile, a tensor.TensorTile, or (block_q, block_k)
    for "shared"."""
    if variant not in VARIANTS["forward"]:
        raise ValueError(f"variant must be one of {VARIANTS['forward']}; got {variant!r}")
    block_q, block_k = check_block(block_q, "block_q"), check_block(block_k, "block_k")
    if variant == "tensor":
        return tensor.choose_tile(d, precision or "f16", block_q, block_k)
    limits = device_limits()
    limit = limits["shared_per_block"]
    if variant == "register":
        return register.choose_tile(d, block_q, block_k, limit, limits["shared_per_sm"])
    bq, bk = block_q or shared.DEFAULT_BLOCK_Q, block_k or shared.DEFAULT_BLOCK_K
    shared.check_blocks(d, bq, bk, limit)
    return bq, bk
