"""FlashAttention-3's backward on Hopper (sm_90) from pure-Python Numba: every product on wgmma.

FlashAttention-3 (arXiv 2407.08608, Section 3 and Appendix B) splits the backward over keys, as FlashAttention-2
does: a thread block owns BK keys of one (batch, K/V head), keeps K_j and V_j in shared memory, and walks the
query tiles i of BQ rows (of every query head that shares the K/V head, with grouped-query attention): 64, or 128
at d = 64 by default (BackwardTile block_q). Each consumer warpgroup owns 64 of the keys (wgmma's M); a block has
one (BK = 64) or two (BK = 128, BackwardTile consumers=2), and a producer after them:

    the producer: one lane copies K_j and V_j once with TMA, then Q_i and dO_i tile after tile into a ring of
        `stages` slots that every consumer reads; the lanes of its first warp load two queries' lse (times log2 e)
        and D = rowsum(dO * O) each into the slot's stats. A full mbarrier per slot counts the bytes and the
        warp's arrivals; an empty one is released by the consumers when the slot's last product is done. With two
        consumers the producer is a whole warpgroup, which setmaxnreg shrinks to 24 registers a thread so that
        the consumers get 240.
    each consumer, for each query tile:
        1. S^T = K_j Q_i^T and dP^T = V_j dO_i^T over its 64 keys (wgmma, both operands from shared memory),
           issued together;
        2. P^T = exp2(S^T * scale * log2 e - lse_i * log2 e), masked where the key is past Nk, the query past Nq,
           or causal and after the query (at d = 64 only on tiles that hold such a key or query: the mask's
           compares cost more instructions than the exponential); then dS^T = P^T * (dP^T - D_i);
        3. dV_j += P^T dO_i and dK_j += dS^T Q_i, with P^T and dS^T as wgmma's A operand straight from registers
           (an accumulator fragment is an A fragment) and dO_i, Q_i read MN-major;
        4. dS^T goes to shared memory (128-byte swizzled rows of keys); once every consumer's rows are there, dQ_i's
           share of this key block, dS K_j, runs on wgmma with dS read MN-major (the transposition is in the
           descriptor, not in data movement): one consumer in 64-column passes; two, each half of the columns
           over all 128 keys, or with 128 queries a tile, each the rows of its own 64 queries;
        5. the share, in float32 rows in shared memory, is added to dQ's accumulator by bulk reduces
           (cp.reduce.async.bulk .add.f32, one per row), which other key blocks' shares also add to: issued by
           the consumers' warps, or (dq_warp, the default at d = 128) by the producer's second warp, which takes
           the staged rows through one named barrier and hands the buffer back through another.
    D and a zeroed accumulator come first, from the tensor backward's preprocess kernel (kernels/tensor_backward.py),
    and dQ is cast to the inputs' type last (cast_dq), into any strides.

Two consumers halve what a key costs in Q, dO, lse and D traffic and in dQ's reduces (one share per 128 keys,
not 64), at the price of a 384-thread block (one an SM) and a barrier across both consumers between a tile's dS^T
and its dQ.

The library's options (kernels/options.py: window, alignment, ALiBi, softcap, dropout) work as in the tensor
backward: a block visits the query tiles of its keys' band, step 2 masks every score by the band and transforms it
(softcap, then ALiBi) before P, softcap multiplies dS^T by 1 - tanh^2, and dropout regenerates the forward's mask
(dV takes P^T Z, dS^T = P^T (dP^T Z - D)). Without them the build is the plain one, unchanged.

The default tile (default_tile) has two consumers: 384 threads, launched at 168 registers a thread, 240 for the
consumers after setmaxnreg (ptxas 13.0 gives them up to 238 at d = 64 with 128 queries a tile, and 234 at d = 128:
benchmarks/profiling/setmaxnreg_regions.py --kernel backward); one block an SM. Nothing spills: the producer's
24 registers a thread hold the loader's loop and the dQ warp's because both count in 32 bits (work_item) and work
out the block's work after setmaxnreg (block_work). One consumer (BackwardTile()) is
kept for comparison and the tests: at d = 64, capped at 168 registers, two of its 160-thread blocks share an SM.
Checked against float64 in the simulator (tests/test_wgmma_backward.py) and on an H200 beside torch's own error
(scripts/gpu_check_wgmma_backward.py, which also times it; benchmarks/results/h200/wgmma_backward_two_consumers.txt,
docs/design-wgmma-kernels.md).

Where it stops short of FlashAttention-3 so far: no overlap within a warpgroup between one tile's softmax and the
next tile's products (a software-pipelined loop, the next tile's S^T and dP^T under this tile's dQ product, ran
0.98-1.03x this loop at d = 64 on an H200 once the interior tiles went unmasked: the kernel issues too few
instructions a cycle, 1.8 of 4, for the tensor cores' idle time to matter; docs/runs/wgmma-backward.md); at
d = 64 the consumers reduce dQ themselves and meet twice a tile (handing dQ to the producer's second warp, as
FA3 does and as the d = 128 default does, measured slower there); dQ's rows are reduced one bulk copy each (FA3
stores a swizzled tile and reduces it with one TMA copy). d = 64 and 128, float16 and bfloat16, causal or not,
grouped-query attention (a block walks every query head of its K/V head). The options' builds are checked in the
simulator and compile for sm_90a, but have not been timed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import config, float32, int32, uint16, uint32, uint64

from ..device import get_cuda
from ..dropout import device_functions as dropout_functions
from . import hopper, mma, tensor_backward
from ._launch import Arg, Launch, Launches
from .common import FASTMATH, LOG2E, I, U
from .options import Extras, Features, device_functions, plain_arguments

cuda = get_cuda()
SIMULATOR = bool(config.ENABLE_CUDASIM)

CONSUMER = 128  # threads of a consumer warpgroup, which owns 64 keys (warpgroups start at a warp index 4 divides)
# with two consumers, registers a thread at launch (65536 / 384, a multiple of 8) and after setmaxnreg the
# producer's and the consumers' (24 * 128 + 240 * 256 <= 65536), as in the forward (wgmma.REGISTERS)
REGISTERS = (168, 24, 240)
BOX = 64  # 16-bit values per 128-byte swizzled row
WORDS = BOX // 2  # the same row in the 32-bit words (pairs of values) that the tensor maps are made of
SWIZZLE = 128
SBO = 8 * 128  # 8 rows of 128 bytes
DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class BackwardTile:
    """consumers: consumer warpgroups, each of which owns 64 keys (wgmma's M), so a block holds BK = 64 * consumers
    keys. With one, the producer is a warp (producer = 32): only one lane issues copies, and a block of 160
    threads leaves registers for two blocks per SM at d = 64. With two (FlashAttention-3's split), the producer is
    a warpgroup (producer = 128), because setmaxnreg is warpgroup-collective: it gives up registers (24 a thread)
    so that the consumers get 240 (REGISTERS). stages: slots of the Q/dO ring, which both consumers read.
    block_q: queries a tile (BQ), 64 or 128. 128 needs two consumers, each of which then takes the dQ product of
    its 64 queries (wgmma's M) over every column, and d = 64 (build refuses d = 128: S^T, dP^T, dV and dK alone
    would need 256 registers a thread)."""
    stages: int = 2
    producer: int | None = None  # None: 32 with one consumer (64 with dq_warp), 128 with two
    max_registers: int | None = None  # a cap for ptxas (None: its own; with two consumers, REGISTERS' launch count)
    consumers: int = 1
    dq_warp: bool = False  # the producer's second warp reduces dQ's rows (FA3's warp 1), not the consumers
    block_q: int = 64

    def __post_init__(self):
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers must be 1 or 2; got {self.consumers}")
        if self.producer is None:
            object.__setattr__(self, "producer", 128 if self.consumers == 2 else 64 if self.dq_warp else 32)
        if self.consumers == 2 and self.producer != 128:
            raise ValueError(f"with two consumers the producer is a warpgroup (setmaxnreg needs all of one): "
                             f"producer must be 128; got {self.producer}")
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q must be 64 or 128; got {self.block_q}")
        if self.block_q == 128 and self.consumers != 2:
            raise ValueError(f"block_q=128 splits a tile's queries between two consumers: consumers must be 2; "
                             f"got {self.consumers}")
        if self.dq_warp and self.producer < 64:
            raise ValueError(f"dq_warp needs a second producer warp: producer must be 64 or more; got {self.producer}")

    @property
    def block_k(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return CONSUMER * self.consumers + self.producer

    @property
    def registers(self) -> int | None:
        """The launch's register cap: max_registers, or with two consumers the count setmaxnreg starts from."""
        return self.max_registers or (REGISTERS[0] if self.consumers == 2 else None)

    def shared_bytes(self, d: int) -> int:
        """K, V (BK x d each), the ring's Q and dO (BQ x d each per stage), dS^T (BK x BQ), dQ's float32 rows
        (BQ of dq_row_bytes), 1 KB of alignment."""
        bk, bq = self.block_k, self.block_q
        return 2 * (2 * bk * d + 2 * self.stages * bq * d + bk * bq) + bq * dq_row_bytes(d) + 1024

    def map_rows(self) -> dict:
        """The rows of the main kernel's tensor maps' boxes, by map (MAPS): a consumer's keys, a query tile."""
        return {"k_map": 64, "v_map": 64, "q_map": self.block_q, "do_map": self.block_q}


def default_tile(d: int, causal: bool = False) -> BackwardTile:
    """Two consumer warpgroups, 128 keys a block; at d = 64, 128 queries a tile; at d = 128 the producer's second
    warp reduces dQ (dq_warp), and causal, the ring has three stages. Measured on an H200
    (scripts/gpu_check_wgmma_backward.py; benchmarks/results/h200/wgmma_backward_consumers.txt,
    wgmma_backward_two_consumers.txt and wgmma_backward_dq_warp.txt, 2026-12-03; wgmma_backward_block_q.txt,
    2026-12-04):
    - 128 queries a tile ran 1.17-1.25x 64 at d = 64 (8 shapes, float16): the kernel is bound by issuing
      instructions, and a tile's fixed work (waits, barriers, descriptors, dQ's reduces) is spread over twice
      the queries;
    - two consumers ran 1.30-1.53x one consumer's speed at d = 128, where one consumer's 253 registers leave one
      block an SM, and 0.99-1.17x at d = 64 (1.03-1.17 but for one reading of 0.99), against one consumer capped at
      168 registers so that two blocks share an SM;
    - a third stage gained 5-8% at d = 128 causal (4 shapes, float16) and lost 1-3% at most other shapes;
    - dq_warp gained 4-8% at d = 128 and lost 12-16% at d = 64 (16 shapes, float16; not profiled: there one warp
      issues a tile's 64 row reduces, which the consumers' eight warps share without it)."""
    return BackwardTile(stages=3 if causal and d == 128 else 2, consumers=2, dq_warp=d == 128,
                        block_q=128 if d == 64 else 64)


def dq_row_bytes(d: int) -> int:
    """A row of dQ's share in shared memory: d float32s and 16 bytes, so that the 8 rows a warp's store touches
    start in different banks (4 apart), and every row stays 16-byte aligned for its bulk reduce."""
    return 4 * d + 16


def _step(fn):
    return cuda.jit(device=True, inline="always", fastmath=FASTMATH)(fn)


_BUILDS = {}


def build(d: int, dtype: str, causal: bool, tile: BackwardTile | None = None, deterministic: bool = False,
          features: Features = Features()):
    """The main kernel. Arguments:

        (k_map, v_map, q_map, do_map, lse, D, dq_acc, dk, dv, turns, n_q, n_k, scale, scale_log2,
         left, right, cap, slopes, seed)

    maps: hopper.tensor_map_4d of K, V (B, H_kv, Nk, d/2) and Q, dO (B, H, Nq, d/2) as uint32 words (any strides
    but the last), boxes of 32 words x 64 rows (Q and dO: BQ rows; tile.map_rows), 128-byte swizzle; lse, D:
    (B, H, Nq) float32; dq_acc (B, H, Nq, d) float32 (added to); dk, dv (B, H_kv, Nk, d/2) uint32 pairs; H a
    multiple of H_kv. Grid (ceil(Nk / BK), H_kv, B), tile.threads threads,
    tile.shared_bytes(d) bytes of dynamic shared memory.

    deterministic: dQ's shares are added in a fixed order (turn: key block 0 first, or causal, the diagonal block
    first). turns, (B, H, ceil(Nq / BQ)) int32 and zero at launch, counts the blocks that have added their share to
    each query tile; a block waits for its turn before its bulk reduces, waits for them to complete, then passes
    the turn on. Blocks are dispatched
    in index order (in practice; CUDA does not promise it), so the ones a block waits for are running or done.
    Without it, turns is not read. tile: default_tile(d, causal) when None.

    features: the library's options compiled in (options.Features), as in the tensor backward: a key block visits
    the query tiles of its options.query_band, every score is masked by its band and transformed (softcap, then
    ALiBi) before P, softcap multiplies dS by 1 - tanh^2, and dropout regenerates the forward's mask. Their values
    are left, right, cap, slopes (options.OptionArgs in log2 units) and the dropout seed, which a plain build
    ignores."""
    tile = tile or default_tile(d, causal)
    key = (d, dtype, causal, tile, deterministic, features)
    if key not in _BUILDS:
        if d not in (64, 128) or dtype not in DTYPES:
            raise ValueError(f"the wgmma backward takes d in (64, 128) and dtype in {DTYPES}; got d={d}, {dtype!r}")
        if tile.block_q == 128 and d != 64:
            raise ValueError(f"block_q=128 runs at d = 64 only (at d = 128 a consumer's S^T, dP^T, dV and dK "
                             f"would need 256 registers a thread); got d={d}")
        _BUILDS[key] = _kernel(d, dtype, causal, tile, deterministic, features)
    return _BUILDS[key]


def _kernel(d, dtype, causal, tile, deterministic, features):
    ST, C, CAUSAL, DETERMINISTIC, DQ_WARP = tile.stages, tile.consumers, causal, deterministic, tile.dq_warp
    BK, BQ, CT = tile.block_k, tile.block_q, CONSUMER * tile.consumers  # keys, queries per tile, consumer threads
    OPTIONS, BOTTOM_RIGHT = features.any, bool(features.bottom_right)
    SOFTCAP, ALIBI, DROP = bool(features.softcap), bool(features.alibi), features.dropout
    opt = device_functions(features)
    z_start, z_mix, z_keep = dropout_functions(features.dropout_p)
    BOXES = d // BOX
    # Interior tiles skip the mask at d = 64 only: at d = 128 the consumers use up to 234 of 240 registers, and
    # a second path for P made ptxas 13.0 spill 500 bytes and serialize the wgmma (2026-12-04).
    UNMASKED_INTERIOR = d == 64
    KV_BOX, QD_BOX = 64 * 128, BQ * 128  # bytes of one 64-column box of a consumer's 64 keys and of a query tile
    KV_BYTES, QD_BYTES = BOXES * KV_BOX, BOXES * QD_BOX  # a consumer's keys (K or V) and a query tile
    K_AT, V_AT, Q_AT = 0, C * KV_BYTES, 2 * C * KV_BYTES  # K and V: one KV_BYTES part per consumer
    DO_AT = Q_AT + ST * QD_BYTES
    DS_AT = DO_AT + ST * QD_BYTES  # dS^T: BQ // 64 boxes of BK rows (keys) of 64 queries, 128 bytes, swizzled
    DS_BOX = BK * 128
    DQ_AT, ROW = DS_AT + BK * BQ * 2, dq_row_bytes(d)  # dQ's share: BQ rows of d float32s (ROW bytes apart)
    KV_FULL, FULL, EMPTY, N_BARRIERS = 0, 1, 1 + ST, 1 + 2 * ST
    STATS = 2 * BQ  # per stage: lse * log2(e) and D of the tile's BQ queries (float32, 0 past Nq)
    N_STATS = ST * STATS
    NS, ND, NP = BQ // 2, d // 2, BQ // 4  # registers of S^T (and dP^T), of a d-wide accumulator, of packed P^T
    NTH = NS if SOFTCAP else 1  # tanh of each capped score, for dS's factor
    QK_STEPS, Q_STEPS, K_STEPS = d // 16, BQ // 16, BK // 16
    S_TILES, D_TILES = BQ // 8, d // 8
    mma_s = hopper.wgmma_ss(BQ, dtype)  # S^T, dP^T (64 x BQ) = K or V (64 x d) @ Q^T or dO^T
    mma_kv = hopper.wgmma_rs(d, dtype, b_major="MN")  # dV += P^T dO, dK += dS^T Q (A from registers)
    # dQ share = dS (from dS^T, MN-major) @ K, over all BK keys. One consumer: in 64-column passes (at d = 128, 64
    # accumulator registers, not 128). Two: each consumer takes half of the columns of the 64 queries, in one
    # pass; with 128 queries a tile (SPLIT_ROWS), its 64 queries (wgmma's M, one box of dS^T) and every column.
    SPLIT_ROWS = BQ == 128
    DQN = BOX if C == 1 else (d if SPLIT_ROWS else d // 2)  # columns of one pass
    DQ_PASSES = BOXES if C == 1 else 1
    mma_q = hopper.wgmma_ss(DQN, dtype, a_major="MN", b_major="MN")
    NQ = DQN // 2  # registers of one pass's share
    ROWS = BQ // (CT // 32)  # dQ rows each consumer warp reduces
    pack = mma.pack_bf16x2 if dtype == "bfloat16" else mma.pack_f16x2
    ZERO = float32(0.0)

    @_step
    def produce(sm, at, bar, stats, k_map, v_map, q_map, do_map, lse, D, b, h_kv, hq0, k0, i0, n_tiles, n_work, n_q,
                lane):
        """The producer warp: lane 0 copies K and V once, then Q_i and dO_i of each (query head, tile) of the block's
        work into the ring with TMA; then every lane loads two queries' lse (times log2 e) and D into the slot's
        stats. FULL counts 33 arrivals: lane 0's
        with the bytes, before the copies, and the warp's 32 after its stores (an arrival releases the stores
        before it), so the copies start before the loads' latency."""
        if lane == U(0):
            hopper.mbarrier_arrive_expect_tx(bar, KV_FULL, 2 * C * KV_BYTES)
            for c in range(C):  # each consumer's 64 keys, in boxes of 64 columns
                for x in range(BOXES):
                    at_kv = c * KV_BYTES + x * KV_BOX
                    hopper.tma_load_4d(sm, at + (K_AT + at_kv) // 2, k_map, int32(WORDS * x), int32(k0 + U(64 * c)),
                                       int32(h_kv), int32(b), bar, KV_FULL)
                    hopper.tma_load_4d(sm, at + (V_AT + at_kv) // 2, v_map, int32(WORDS * x), int32(k0 + U(64 * c)),
                                       int32(h_kv), int32(b), bar, KV_FULL)
        for j in range(int32(n_work)):  # 32-bit counts: the producer has 24 registers
            s = j % ST
            if j >= ST:
                hopper.mbarrier_wait_parity(bar, EMPTY + s, int32((j // ST - 1) & 1))
            h, q0 = work_item(U(j), hq0, i0, n_tiles)
            if lane == U(0):
                hopper.mbarrier_arrive_expect_tx(bar, FULL + s, 2 * QD_BYTES)
                for x in range(BOXES):
                    hopper.tma_load_4d(sm, at + (Q_AT + s * QD_BYTES + x * QD_BOX) // 2, q_map, int32(WORDS * x),
                                       int32(q0), int32(h), int32(b), bar, FULL + s)
                    hopper.tma_load_4d(sm, at + (DO_AT + s * QD_BYTES + x * QD_BOX) // 2, do_map, int32(WORDS * x),
                                       int32(q0), int32(h), int32(b), bar, FULL + s)
            for r in range(BQ // 32):
                i = lane + U(32 * r)
                query = q0 + i
                inside = query < n_q
                stats[s * STATS + i] = lse[b, h, query] * float32(LOG2E) if inside else ZERO
                stats[s * STATS + BQ + i] = D[b, h, query] if inside else ZERO
            hopper.mbarrier_arrive(bar, FULL + s)

    @_step
    def work_item(j, hq0, i0, n_tiles):
        """The block's j-th piece of work: (query head, first query of the tile). With grouped-query attention
        a K/V head serves several query heads, and its block walks every tile of each in turn. In 32 bits: a
        64-bit division is a subroutine whose registers the producer's 24 cannot hold."""
        head, tile = uint32(j) // uint32(n_tiles), uint32(j) % uint32(n_tiles)
        return uint32(uint32(hq0) + head), uint32((uint32(i0) + tile) * uint32(BQ))

    @_step
    def issue_transposed_scores(acc, key_tile, query_tile):
        """acc = (a key tile) (a query tile)^T, both K-major: 32 bytes further along the rows each k16 step, box
        kk // 4; committed as one group."""
        a0 = hopper.make_descriptor(key_tile, 16, SBO, SWIZZLE)
        b0 = hopper.make_descriptor(query_tile, 16, SBO, SWIZZLE)
        for kk in range(QK_STEPS):
            a = hopper.descriptor_plus(a0, (kk // 4) * KV_BOX + (kk % 4) * 32)
            b = hopper.descriptor_plus(b0, (kk // 4) * QD_BOX + (kk % 4) * 32)
            mma_s(acc, a, b, min(kk, 1))
        hopper.wgmma_commit()

    @_step
    def issue_scores(sacc, dpacc, k_tile, v_tile, q_tile, do_tile):
        """S^T = K Q^T, then dP^T = V dO^T: two groups, so that wgmma_wait(1) returns with S^T."""
        issue_transposed_scores(sacc, k_tile, q_tile)
        issue_transposed_scores(dpacc, v_tile, do_tile)

    if not OPTIONS:
        @_step
        def probabilities(sacc, tanhs, stats, base, key0, q0, t, n_q, n_k, scale_log2, off, left, right, capr,
                          slope, interior):
            """P^T in place: lane (g, t) holds keys key0 + g (+ 8) and queries q0 + 8n + 2t (+ 1). A tile inside
            every bound (interior: no key past Nk, no query past Nq, causal, no key after a query) skips the mask,
            which costs more instructions than the exponential; the others compare in 32 bits."""
            if interior:
                for n in range(S_TILES):
                    for c in range(2):
                        offset = stats[base + U(8 * n + c) + U(2) * t]
                        for r in range(2):
                            i = 4 * n + 2 * r + c
                            sacc[i] = math.exp2(sacc[i] * scale_log2 - offset)
                return
            q32, k32, nq, nk = uint32(q0), uint32(key0), uint32(n_q), uint32(n_k)
            for n in range(S_TILES):
                for c in range(2):
                    i = uint32(8 * n + c) + uint32(2) * uint32(t)
                    query = q32 + i
                    inside = query < nq
                    offset = stats[base + i]
                    for r in range(2):
                        key = k32 + uint32(8 * r)
                        j = 4 * n + 2 * r + c
                        keep = inside and key < nk and not (CAUSAL and key > query)
                        sacc[j] = math.exp2(sacc[j] * scale_log2 - offset) if keep else ZERO

        @_step
        def ds_from_dp(dpacc, sacc, tanhs, stats, base, key0, q0, t, zh):
            """dS^T = P^T * (dP^T - D_query), in dpacc (P^T is 0 past Nq, where D reads 0)."""
            for n in range(S_TILES):
                for c in range(2):
                    dq = stats[base + BQ + U(8 * n + c) + U(2) * t]
                    for r in range(2):
                        i = 4 * n + 2 * r + c
                        dpacc[i] = sacc[i] * (dpacc[i] - dq)
    else:
        @_step
        def band_of(key, n_q, n_k, off, left, right):
            """[lo, hi): the queries that see the key (options.query_band of one key); none past Nk."""
            lo, hi = opt.query_band(I(key), I(key), off, I(n_q), left, right)
            return lo, hi if key < n_k else lo

        @_step
        def probabilities(sacc, tanhs, stats, base, key0, q0, t, n_q, n_k, scale_log2, off, left, right, capr,
                          slope, interior):
            """P^T in place under the options, every tile masked (interior is not read): each score capped
            (softcap, then ALiBi's bias, in raw units as the forward's), masked by its key's band of queries (a
            select, never a product: exp2 may be inf where lse = +inf), its tanh kept for dS."""
            lo0, hi0 = band_of(key0, n_q, n_k, off, left, right)
            lo1, hi1 = band_of(key0 + U(8), n_q, n_k, off, left, right)
            for n in range(S_TILES):
                for c in range(2):
                    i = U(8 * n + c) + U(2) * t
                    query = I(q0 + i)
                    offset = stats[base + i]
                    for r in range(2):
                        lo, hi = (lo0, hi0) if r == 0 else (lo1, hi1)
                        j = 4 * n + 2 * r + c
                        x, th = opt.capped(sacc[j], query + off, I(key0 + U(8 * r)), capr, slope)
                        sacc[j] = ZERO if query < lo or query >= hi else math.exp2(x * scale_log2 - offset)
                        if SOFTCAP:
                            tanhs[j] = th

        @_step
        def ds_from_dp(dpacc, sacc, tanhs, stats, base, key0, q0, t, zh):
            """dS^T = P^T * (dP^T Z - D_query) * (1 - tanh^2 with softcap), in dpacc; then P^T Z in sacc for dV
            (Z: the forward's dropout mask times 1 / (1 - p), keyed by (seed, batch, query head, query, key))."""
            for n in range(S_TILES):
                for c in range(2):
                    i = U(8 * n + c) + U(2) * t
                    dq = stats[base + BQ + i]
                    zq = z_mix(zh, q0 + i) if DROP else U(0)  # the query's hash state, for both keys
                    for r in range(2):
                        j = 4 * n + 2 * r + c
                        z = z_keep(zq, key0 + U(8 * r)) if DROP else float32(1.0)
                        ds = sacc[j] * (dpacc[j] * z - dq)
                        if SOFTCAP:
                            ds *= float32(1.0) - tanhs[j] * tanhs[j]
                        dpacc[j] = ds
                        if DROP:
                            sacc[j] *= z

    @_step
    def interior_tile(q0, keys_end, n_q, n_k):
        """Whether a consumer's tile needs no mask: its queries q0..q0 + BQ - 1 before Nq, its keys (up to keys_end,
        exclusive) before Nk, and causal, its last key at or before its first query."""
        return (UNMASKED_INTERIOR and q0 + U(BQ) <= n_q and keys_end <= n_k
                and (not CAUSAL or keys_end <= q0 + U(1)))

    @_step
    def query_tiles(k0, n_q, n_k, left, right):
        """(off, first query tile, number of tiles) of the block's keys k0..k0 + BK - 1: the tiles that can see
        them (options.query_band; plain causal: from the diagonal on). off: the alignment's shift, query i sits at
        key position i + off."""
        if OPTIONS:
            off = I(n_k) - I(n_q) if BOTTOM_RIGHT else I(0)
            lo, hi = opt.query_band(I(k0), I(min(k0 + U(BK), U(n_k))) - I(1), off, I(n_q), left, right)
            i0 = U(lo) // U(BQ) if lo < hi else U(0)
            return off, i0, (U(hi) + U(BQ - 1)) // U(BQ) - i0 if lo < hi else U(0)
        i0 = k0 // U(BQ) if CAUSAL else U(0)  # causal: query tiles before the block's first key see none of it
        return I(0), i0, (U(n_q) + U(BQ - 1)) // U(BQ) - i0 if U(n_q) > i0 * U(BQ) else U(0)

    @_step
    def head_options(slopes, b, h, n_heads, seed, scale_log2):
        """The (batch, query head)'s ALiBi slope in raw score units and its dropout hash state."""
        slope = slopes[b * n_heads + h] / scale_log2 if ALIBI else ZERO
        return slope, z_start(seed, b, h) if DROP else U(0)

    @_step
    def pack_a(regs, acc):
        """An accumulator (64 x BQ) as wgmma's A operand from registers: k16 step kk is registers 4kk..4kk+3."""
        for i in range(NP):
            regs[i] = pack(acc[2 * i], acc[2 * i + 1])

    @_step
    def issue_grads(dvacc, dkacc, p_regs, ds_regs, do_tile, q_tile):
        """dV += P^T dO and dK += dS^T Q: B is read MN-major (16 query rows further down each k16 step; LBO steps
        over the 64-column boxes along d)."""
        dv0 = hopper.make_descriptor(do_tile, QD_BOX, SBO, SWIZZLE)
        dq0 = hopper.make_descriptor(q_tile, QD_BOX, SBO, SWIZZLE)
        for kk in range(Q_STEPS):
            dv = hopper.descriptor_plus(dv0, kk * 16 * 128)
            mma_kv(dvacc, p_regs[4 * kk], p_regs[4 * kk + 1], p_regs[4 * kk + 2], p_regs[4 * kk + 3], dv, 1)
        for kk in range(Q_STEPS):
            dq = hopper.descriptor_plus(dq0, kk * 16 * 128)
            mma_kv(dkacc, ds_regs[4 * kk], ds_regs[4 * kk + 1], ds_regs[4 * kk + 2], ds_regs[4 * kk + 3], dq, 1)
        hopper.wgmma_commit()

    @_step
    def store_ds(sm32, at, ds_regs, row0, t):
        """dS^T to shared memory as 16-bit pairs: row (key) row0 (+ 8) of BK, 128 bytes, 128-byte swizzle, in the
        box of the queries' 64 (n // 8)."""
        for n in range(S_TILES):
            for r in range(2):
                row = row0 + U(8 * r)
                byte = row * U(128) + U(16 * (n % 8)) + U(4) * t
                byte = U((n // 8) * DS_BOX) + (byte ^ ((byte >> U(3)) & U(0x70)))
                sm32[(at + U(DS_AT) + byte) // U(4)] = ds_regs[2 * n + r]

    @_step
    def issue_dq(dqacc, ds_tile, k_tile):
        """dQ share (BQ x DQN) = dS (BQ x BK) @ K's columns (BK x DQN) that start at k_tile: dS^T read as A,
        MN-major (its rows are keys, the product's K dimension), K as B, MN-major; k16 step kk is 16 key rows
        further down both (K's rows of the second consumer lie KV_BYTES on). A pass of 32 columns starts 64 bytes
        into K's 128-byte rows: the swizzle acts on the address, as for K-major steps along K."""
        da0 = hopper.make_descriptor(ds_tile, DS_BOX, SBO, SWIZZLE)
        db0 = hopper.make_descriptor(k_tile, KV_BOX, SBO, SWIZZLE)
        for kk in range(K_STEPS):
            da = hopper.descriptor_plus(da0, kk * 16 * 128)
            db = hopper.descriptor_plus(db0, (kk // 4) * KV_BYTES + (kk % 4) * 16 * 128)
            mma_q(dqacc, da, db, min(kk, 1))
        hopper.wgmma_commit()

    @_step
    def dq_columns(x, cw):
        """The first column of dQ pass x of consumer cw: one consumer passes over every 64-column box; of two,
        each takes its half (or with SPLIT_ROWS, every column of its own queries)."""
        return U(DQN * x) if C == 1 else (U(0) if SPLIT_ROWS else U(DQN) * cw)

    @_step
    def stage_dq(smf, at, dqacc, row0, col0, g, t, scale):
        """dQ's fragment (rows row0 + g (+ 8), columns col0 + 8n + 2t (+ 1)) into dQ's shared rows."""
        for r in range(2):
            row = (at + U(DQ_AT) + (row0 + g + U(8 * r)) * U(ROW)) // U(4)
            for n in range(DQN // 8):
                for c in range(2):
                    smf[row + col0 + U(8 * n + c) + U(2) * t] = dqacc[4 * n + 2 * r + c] * scale

    @_step
    def reduce_row(dq_acc, smf, at, first, row, rows):
        """Staged dQ row `row` of the tile added to the float32 accumulator by one bulk reduce, for the tile's `rows`
        rows before Nq; `first`: the accumulator's row of the tile's first query."""
        if row < rows:
            word = (uint32(at) + uint32(DQ_AT) + uint32(row) * uint32(ROW)) // uint32(4)  # (32 bits: see work_item)
            hopper.bulk_reduce_add(dq_acc, (first + U(row)) * U(d), smf, word, int32(4 * d))

    @_step
    def reduce_dq(dq_acc, smf, at, first, rows, wq, lane):
        """Each consumer warp wq adds ROWS of dQ's staged rows, one a lane for lanes 0..ROWS - 1 (the hardware
        issues them one lane at a time, so the warps share the work)."""
        if lane < U(ROWS):
            reduce_row(dq_acc, smf, at, first, U(ROWS) * wq + lane, rows)
        hopper.bulk_commit()

    @_step
    def turn(kb, q0, n_kb, n_q, n_k, off, left, right):
        """Deterministic mode: how many key blocks add their shares to query tile q0 before key block kb does.
        Without a mask, blocks 0, 1, 2, ... in index order. Causal, the blocks that reach a tile are 0 to its
        diagonal block, and they take turns from the diagonal down: key block kb starts on its diagonal tile,
        where it goes first, and each later tile waits only for the block one above, which started there a tile
        earlier. (In index order every block would wait for all the ones before it to pass its diagonal: a
        wavefront twice as long as the work.) The grid runs the key blocks from the last, so the ones a block waits
        for were dispatched before it. With options, the blocks that reach the tile are those of its key band."""
        if OPTIONS:
            lo, hi = opt.key_band(I(q0) + off, I(min(q0 + U(BQ), n_q)) - I(1) + off, I(n_k), left, right)
            return int32((hi - I(1)) // I(BK) - I(kb)) if CAUSAL else int32(I(kb) - lo // I(BK))
        if CAUSAL:
            return int32(min((q0 + U(BQ - 1)) // U(BK), n_kb - U(1)) - kb)
        return int32(kb)

    def out_of_turn(j, q0):
        """The simulator runs blocks one after another: a count short of j there means an order that hangs a GPU."""
        raise RuntimeError(f"deterministic backward: block {cuda.blockIdx.x} of the grid waits for turn {j} at "
                           f"query {q0}, which the blocks run before it never reached")

    out_of_turn = _step(out_of_turn if SIMULATOR else lambda j, q0: None)

    @_step
    def wait_turn(turns, b, h, q0, first, j, barrier, threads):
        """Deterministic mode: the first of the threads that reduce dQ spins until j key blocks have added their
        shares to this query tile (an atomic add of 0 reads the count), then they go on together (named barrier
        `barrier` of `threads`: the consumers, or with dq_warp its warp)."""
        if first:
            while cuda.atomic.add(turns, (b, h, q0 // U(BQ)), 0) != j:
                out_of_turn(j, q0)
            cuda.threadfence()
        hopper.named_barrier_sync(barrier, threads)

    @_step
    def pass_turn(turns, b, h, q0, first, barrier, threads):
        """Deterministic mode: every reducing warp's bulk reduces complete, then the first thread counts this
        block's turn done."""
        hopper.bulk_wait(0)
        hopper.fence_proxy_async_global()  # the reduces' writes, then the count that lets the next block add
        hopper.named_barrier_sync(barrier, threads)
        if first:
            cuda.threadfence()
            cuda.atomic.add(turns, (b, h, q0 // U(BQ)), 1)

    @_step
    def reduce_rows(dq_acc, smf, at, first, rows, lane):
        """dq_warp: the producer's second warp adds all BQ staged rows, two a lane."""
        for r in range(BQ // 32):
            reduce_row(dq_acc, smf, at, first, lane + uint32(32 * r), rows)
        hopper.bulk_commit()

    @_step
    def reduce_dq_shares(dq_acc, smf, at, turns, b, hq0, i0, n_tiles, n_work, n_heads, n_q, n_k, kb, n_kb, off, left,
                         right, lane):
        """dq_warp: tile after tile, tell the consumers that the rows may be overwritten (barrier 3: the last
        tile's copies have read them; deterministic: they are complete and the turn is passed on; at the first
        tile, nothing was staged), wait until every consumer has staged its dQ rows (barrier 2) and add them. One
        arrival on barrier 3 a tile, for the consumers' one wait a tile."""
        bh0 = uint32(b * n_heads)  # dQ's rows of batch b start at row bh0 * Nq (32 bits: the warp has 24 registers)
        for j in range(int32(n_work)):
            h, q0 = work_item(j, hq0, i0, n_tiles)
            hopper.named_barrier_arrive(3, CT + 32)  # the last tile's rows are read (or none were staged)
            hopper.named_barrier_sync(2, CT + 32)
            if DETERMINISTIC:
                wait_turn(turns, b, h, q0, lane == U(0), turn(kb, q0, n_kb, n_q, n_k, off, left, right), 4, 32)
            first, rows = tile_rows(bh0, h, q0, n_q)
            reduce_rows(dq_acc, smf, at, first, rows, lane)
            if DETERMINISTIC:
                pass_turn(turns, b, h, q0, lane == U(0), 4, 32)
            else:
                hopper.bulk_wait_read(0)
        hopper.bulk_wait(0)

    @_step
    def store_kv(dk, dv, dkacc, dvacc, b, h, key0, g, t, n_k, scale):
        for r in range(2):
            key = key0 + U(8 * r)
            if key < n_k:
                for n in range(D_TILES):
                    i = 4 * n + 2 * r
                    dk[b, h, key, U(4 * n) + t] = pack(dkacc[i] * scale, dkacc[i + 1] * scale)
                    dv[b, h, key, U(4 * n) + t] = pack(dvacc[i], dvacc[i + 1])

    @_step
    def block_work(lse, n_q, n_k, left, right):
        """The block's key block and the query tiles that see it: (b, K/V head, key block, key blocks, first key,
        query heads, query heads per K/V head, off, first tile, tiles, tiles times query heads of the group)."""
        b, h_kv = U(cuda.blockIdx.z), U(cuda.blockIdx.y)
        n_kb, kb = U(cuda.gridDim.x), U(cuda.blockIdx.x)
        if CAUSAL and DETERMINISTIC:
            kb = n_kb - U(1) - kb  # the last key block first: see turn
        k0 = kb * U(BK)
        n_heads, n_kv_heads = U(lse.shape[1]), U(cuda.gridDim.y)
        group = n_heads // n_kv_heads  # query heads per K/V head (1 without GQA); dK, dV sum over them
        off, i0, n_tiles = query_tiles(k0, U(n_q), U(n_k), left, right)
        return b, h_kv, kb, n_kb, k0, n_heads, group, off, i0, n_tiles, group * n_tiles

    @_step
    def aligned_start(sm):
        """(shared memory's address, the byte offset from it that is 1024-aligned, as the 128-byte swizzle needs)."""
        base = hopper.smem_address(sm, 0)
        return base, (U(1024) - U(base) % U(1024)) % U(1024)

    @_step
    def tile_rows(bh0, h, q0, n_q):
        """(dQ's accumulator row of query tile q0 of (batch, query head) row bh0 + h, its rows before Nq), in 32 bits
        but the row (see work_item)."""
        return U(bh0 + h) * U(n_q) + q0, min(uint32(uint32(n_q) - q0), uint32(BQ))

    _, PRODUCER_REGISTERS, CONSUMER_REGISTERS = REGISTERS
    if C == 2:  # setmaxnreg, warpgroup by warpgroup
        @_step
        def producer_registers():
            hopper.setmaxnreg_dec(PRODUCER_REGISTERS)

        @_step
        def consumer_registers():
            hopper.setmaxnreg_inc(CONSUMER_REGISTERS)
    else:
        @_step
        def producer_registers():
            pass

        consumer_registers = producer_registers
    registers = {"max_registers": tile.registers} if tile.registers and not SIMULATOR else {}

    @cuda.jit(fastmath=FASTMATH, **registers)
    def flash_bwd_wgmma(k_map, v_map, q_map, do_map, lse, D, dq_acc, dk, dv, turns, n_q, n_k, scale, scale_log2,
                        left, right, cap, slopes, seed):
        sm = cuda.shared.array(0, uint16)
        sm32 = cuda.shared.array(0, uint32)  # the same memory, as 32-bit words (dS^T's stores)
        smf = cuda.shared.array(0, float32)  # and as float32s (dQ's rows)
        bar = cuda.shared.array(N_BARRIERS, uint64)
        stats = cuda.shared.array(N_STATS, float32)
        tid = U(cuda.threadIdx.x)
        if tid == U(0):
            for i in range(N_BARRIERS):
                hopper.mbarrier_init(bar, i, 1 if i == KV_FULL else (33 if i < EMPTY else CT))
        cuda.syncthreads()
        if tid >= U(CT):
            producer_registers()  # the block's work is worked out after this, so that no value lives across it
            b, h_kv, kb, n_kb, k0, n_heads, group, off, i0, n_tiles, n_work = block_work(lse, n_q, n_k, left, right)
            base, at = aligned_start(sm)
            if tid < U(CT + 32):
                produce(sm, at // U(2), bar, stats, k_map, v_map, q_map, do_map, lse, D, b, h_kv, h_kv * group, k0,
                        i0, n_tiles, n_work, U(n_q), tid - U(CT))
            elif DQ_WARP and tid < U(CT + 64):
                reduce_dq_shares(dq_acc, smf, at, turns, b, h_kv * group, i0, n_tiles, n_work, n_heads, U(n_q), U(n_k),
                                 kb, n_kb, off, left, right, tid % U(32))
            return
        consumer_registers()
        b, h_kv, kb, n_kb, k0, n_heads, group, off, i0, n_tiles, n_work = block_work(lse, n_q, n_k, left, right)
        capr = cap / scale_log2  # S^T stays in raw units
        base, at = aligned_start(sm)
        cw, wq, lane = tid // U(CONSUMER), tid // U(32), tid % U(32)  # consumer, warp among all consumers', lane
        warp, g, t = wq % U(4), lane // U(4), lane % U(4)  # warp in its warpgroup
        key0 = k0 + U(64) * cw + U(16) * warp + g
        keys_end = k0 + U(64) * (cw + U(1))  # this consumer's keys end here
        dq_rows = U(64) * cw if SPLIT_ROWS else U(0)  # the first of the tile's queries whose dQ this consumer forms
        start = U(base) + at
        k_tile, v_tile = start + U(K_AT) + U(KV_BYTES) * cw, start + U(V_AT) + U(KV_BYTES) * cw  # this consumer's keys
        ds_tile = start + U(DS_AT) + (U(DS_BOX) * cw if SPLIT_ROWS else U(0))  # (their box of dS^T)
        sacc = cuda.local.array(NS, float32)
        dpacc = cuda.local.array(NS, float32)
        dvacc = cuda.local.array(ND, float32)
        dkacc = cuda.local.array(ND, float32)
        dqacc = cuda.local.array(NQ, float32)
        p_regs = cuda.local.array(NP, uint32)
        ds_regs = cuda.local.array(NP, uint32)
        tanhs = cuda.local.array(NTH, float32)
        for i in range(ND):
            dvacc[i] = ZERO
            dkacc[i] = ZERO
        hopper.mbarrier_wait_parity(bar, KV_FULL, 0)
        for j in range(n_work):
            s = j % ST
            h, q0 = work_item(U(j), h_kv * group, i0, n_tiles)
            slope, zh = head_options(slopes, b, h, n_heads, seed, scale_log2)
            q_tile, do_tile = start + U(Q_AT + s * QD_BYTES), start + U(DO_AT + s * QD_BYTES)
            hopper.mbarrier_wait_parity(bar, FULL + s, int32((j // ST) & 1))
            hopper.wgmma_fence()
            issue_scores(sacc, dpacc, k_tile, v_tile, q_tile, do_tile)
            hopper.wgmma_wait(1)  # S^T is ready; dP^T may still run
            probabilities(sacc, tanhs, stats, U(s * STATS), key0, q0, t, U(n_q), U(n_k), scale_log2, off, left,
                          right, capr, slope, interior_tile(q0, keys_end, U(n_q), U(n_k)))
            hopper.wgmma_wait(0)
            ds_from_dp(dpacc, sacc, tanhs, stats, U(s * STATS), key0, q0, t, zh)
            pack_a(p_regs, sacc)
            pack_a(ds_regs, dpacc)
            hopper.wgmma_fence()
            issue_grads(dvacc, dkacc, p_regs, ds_regs, do_tile, q_tile)
            if DQ_WARP:  # the last tile's dQ rows have been read, so every consumer's dQ product read dS^T too
                hopper.named_barrier_sync(3, CT + 32)
            store_ds(sm32, at, ds_regs, U(64) * cw + U(16) * warp + g, t)
            hopper.fence_proxy_async()  # the threads' stores, then wgmma's reads of them
            if not DQ_WARP:
                hopper.bulk_wait_read(0)  # the last tile's dQ rows (this warp's) have left shared memory
            hopper.named_barrier_sync(1, CT)  # every warp's rows of dS^T are in place
            for x in range(DQ_PASSES):
                if x > 0:
                    hopper.wgmma_fence()  # stage_dq read the accumulator that this pass overwrites
                col0 = dq_columns(x, cw)
                issue_dq(dqacc, ds_tile, start + U(K_AT) + col0 // U(BOX) * U(KV_BOX) + col0 % U(BOX) * U(2))
                hopper.wgmma_wait(0)  # (first pass) dV, dK and dQ's share are done: the slot may be reused
                if x == 0:
                    hopper.mbarrier_arrive(bar, EMPTY + s)
                stage_dq(smf, at, dqacc, dq_rows + U(16) * warp, col0, g, t, scale)
            hopper.fence_proxy_async()  # dQ's rows, then the bulk reduce's reads of them
            if DQ_WARP:
                hopper.named_barrier_arrive(2, CT + 32)  # the rows are the reducing warp's
                continue
            hopper.named_barrier_sync(1, CT)  # dQ's rows are in place; every warp's dQ wgmma read dS^T
            if DETERMINISTIC:
                wait_turn(turns, b, h, q0, tid == U(0), turn(kb, q0, n_kb, U(n_q), U(n_k), off, left, right), 1, CT)
            first, rows = tile_rows(uint32(b * n_heads), h, q0, n_q)
            reduce_dq(dq_acc, smf, at, first, rows, wq, lane)
            if DETERMINISTIC:
                pass_turn(turns, b, h, q0, tid == U(0), 1, CT)
        hopper.bulk_wait(0)  # before the block's shared memory goes
        store_kv(dk, dv, dkacc, dvacc, b, h_kv, key0, g, t, U(n_k), scale)

    return flash_bwd_wgmma


MAPS = ("k_map", "v_map", "q_map", "do_map")  # the main kernel's tensor maps, by the array each one reads


@cuda.jit
def zero_turns(turns):
    """turns[i] = 0 over a flat int32 array (the deterministic mode's counts, before the main kernel)."""
    i = cuda.grid(1)
    if i < turns.shape[0]:
        turns[i] = 0


_CASTS = {}


def cast_dq(d: int, dtype: str):
    """The kernel that casts dQ's float32 accumulator (B, H, Nq, d), contiguous, to dq (B, H, Nq, d/2) 16-bit
    pairs of any strides (the prepared call gives the gradients their inputs' layout, so that a GPT's transposed
    heads need no copy after the backward). Grid (ceil(Nq * d/2 / 256), H, B), 256 threads."""
    key = (d, dtype)
    if key not in _CASTS:
        W = d // 2
        pack = mma.pack_bf16x2 if dtype == "bfloat16" else mma.pack_f16x2

        def cast(dq_acc, dq):
            i = cuda.grid(1)
            h, b = cuda.blockIdx.y, cuda.blockIdx.z
            row, c = i // W, i % W
            if row < dq.shape[2]:
                dq[b, h, row, c] = pack(dq_acc[b, h, row, 2 * c], dq_acc[b, h, row, 2 * c + 1])

        _CASTS[key] = cuda.jit(fastmath=FASTMATH)(cast)
    return _CASTS[key]


def launches(B: int, H: int, Nq: int, Nk: int, d: int, scale: float, causal: bool, dtype: str, H_kv: int | None = None,
             tile: BackwardTile | None = None, deterministic: bool = False, extras: Extras | None = None):
    """The launches of one call, described once (_launch.Launch) for the general and the prepared path: D and a
    zeroed dQ accumulator (the tensor backward's preprocess), (deterministic) the turns zeroed, the main kernel,
    dQ cast to the inputs' type. Arrays by name: o, do, dq, dk, dv (uint32 pairs), lse, the tensor maps of k, v, q
    and do (MAPS), the temporaries D, dq_acc and turns (one unread word without deterministic), and slopes (the
    ALiBi slopes, a host array). extras: the library's options (options.Extras), None for none; the dropout seed
    goes to the main kernel (Launches.seeded)."""
    tile, precision = tile or default_tile(d, bool(causal)), "bf16" if dtype == "bfloat16" else "f16"
    features = extras.features() if extras is not None else Features()
    args = extras.arguments(causal, B, H, True) if extras is not None else plain_arguments(causal)
    preprocess = tensor_backward.build(d, tensor_backward.choose_tile(d, precision), bool(causal), precision)[0]
    turns = (B, H, -(-Nq // tile.block_q)) if deterministic else (1, 1, 1)
    n_turns = int(np.prod(turns))
    out = [Launch(preprocess, (-(-Nq // tensor_backward.PREPROCESS_ROWS), B * H),
                  32 * tensor_backward.PREPROCESS_WARPS, ("o", "do", "D", "dq_acc", H))]
    if deterministic:
        out.append(Launch(zero_turns, (-(-n_turns // 256),), 256, (Arg("turns", (n_turns,)),)))
    seeded = len(out)
    grid = (-(-Nk // tile.block_k), H_kv or H, B)
    out += [Launch(build(d, dtype, bool(causal), tile, bool(deterministic), features), grid,
                   tile.threads, MAPS + ("lse", "D", "dq_acc", "dk", "dv", "turns", np.int64(Nq), np.int64(Nk),
                                         np.float32(scale), np.float32(scale * LOG2E), int(args.left),
                                         int(args.right), np.float32(args.cap), "slopes", np.int64(0)),
                   shared=tile.shared_bytes(d)),
            Launch(cast_dq(d, dtype), (-(-(Nq * d // 2) // 256), H, B), 256, ("dq_acc", "dq"))]
    return Launches(tuple(out), {"D": ((B, H, Nq), np.float32), "dq_acc": ((B, H, Nq, d), np.float32),
                                 "turns": (turns, np.int32)}, {"slopes": args.slopes}, seeded)


def backward(q_words, k_words, v_words, o_words, lse, do_words, dq_words, dk_words, dv_words, scale, causal, dtype,
             tile: BackwardTile | None = None, deterministic: bool = False, extras: Extras | None = None, seed: int = 0):
    """The general path, on numba device arrays (16-bit values as uint32 pairs, (B, H, N, d/2)): the tensor maps
    made for this call, then the launches. extras, seed: the library's options and the dropout seed. (Torch
    tensors take flash_attention_backward's prepared path.)"""
    B, H, Nq, w = q_words.shape
    _, H_kv, Nk, _ = k_words.shape
    if H % H_kv:
        raise ValueError(f"the query heads H={H} must be a multiple of the K/V heads H_kv={H_kv}")
    arrays = dict(q=q_words, k=k_words, v=v_words, o=o_words, lse=lse, do=do_words, dq=dq_words, dk=dk_words,
                  dv=dv_words)
    tile = tile or default_tile(2 * w, bool(causal))
    rows = tile.map_rows()
    for name in MAPS:
        arrays[name] = hopper.tensor_map_4d(arrays[name[:-4]], rows[name], WORDS, SWIZZLE)
    launches(B, H, Nq, Nk, 2 * w, scale, causal, dtype, H_kv, tile, deterministic, extras).run(
        arrays, seed=np.int64(seed))
