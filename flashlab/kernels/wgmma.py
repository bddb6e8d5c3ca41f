"""variant="wgmma": FlashAttention-3's forward on Hopper (sm_90), from pure-Python Numba.

FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, arXiv 2407.08608) keeps FlashAttention-2's
algorithm and changes who does what inside a thread block. A block owns 64 query rows per consumer warpgroup
(block_q = 128 with two consumers, 192 with three) of one (batch, head) and runs warpgroups of 128 threads:

    warpgroup 0, the producer: one thread issues TMA copies (kernels/hopper.py): Q's tile once, then K and V
        tile after tile into a ring of `stages` shared-memory slots. Each slot has three mbarriers: K landed,
        V landed (their transaction bytes count the copy), K released and V released (the consumers' 256 threads
        arrive when they are done with it: K once S = Q K^T is computed, V once P V is). The producer waits for
        a half-slot's release before it refills it, so the next K travels while this tile's softmax runs.
    warpgroups 1, 2 (and 3), the consumers: 64 rows each. For key tile j:
        1. wait until K_j and V_{j-1} have landed; issue S = Q K_j^T (d/16 wgmma m64n{block_k}k16, both operands
           read from 128-byte swizzled tiles through matrix descriptors), then O += P_{j-1} V_{j-1} (block_k/16
           wgmma m64n{d}k16 with A, P, from registers and V read "MN-major": row-major V is the transposed operand
           wgmma wants, so the descriptor says so). Both run asynchronously;
        2. wait for S alone (wgmma_wait(1)), release K_j; mask S (only tiles that cross the causal diagonal or the end of the
           keys) and run the online softmax on its fragments while P_{j-1} V_{j-1} is still on the tensor cores
           (FA3's intra-warpgroup overlap);
        3. wait for P V, release V_{j-1}, rescale O and pack P_j to 16 bits: S's accumulator fragment *is*
           wgmma's A fragment, as with mma.sync.
       The last tile's P V closes the loop.
    Pingpong: the consumers take turns issuing their GEMMs (named barriers 1, 2, 3, round robin), so that one's
    softmax tends to run while another's GEMMs occupy the tensor cores.
    setmaxnreg moves registers from the producer (24 a thread; 32 with three consumers) to the consumers (240;
    160), which hold S, P and O. ptxas needs the launch's limit to accept setmaxnreg (max_registers, REGISTERS:
    168 registers with two consumers, 128 with three), reports that count, and compiles the code after each
    setmaxnreg for its new budget: the consumers' code uses up to 155-200 registers, the producer's 6-13, with no
    spills (the machine code ptxas 13.0 makes, benchmarks/results/setmaxnreg_regions_ptxas13.0.txt).

Where a block works: grid (query blocks, heads, batch), the last query blocks of a head first (under causal
masking they have the most tiles). GQA: query head h reads K/V head h // (H / H_kv). Q, K and V are read by TMA
through 4-D tensor maps over (B, H, N, d) with the inputs' own strides, so a (B, N, H, d) tensor's transpose(1, 2)
(a GPT's heads) is read in place; a tile that runs past its head's last row reads zeros, the mask removes those
keys, and query rows past Nq are computed and not stored.

Where this kernel stops short of FlashAttention-3: a block per query tile rather than a persistent kernel with a
tile scheduler (whose next tile's loads overlap this one's epilogue); O is written from registers, not staged
through shared memory for a TMA store; no fp8, no varlen or paged K/V, none of the library's options but causal.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from numba import config, float32, int32, uint16, uint32, uint64

from ..device import get_cuda
from . import hopper, mma
from ._launch import launch_with_shared
from .common import FASTMATH, LN2, LOG2E, NEG, U

cuda = get_cuda()  # a module global: the simulator swaps it for its own fake module when a kernel runs
SIMULATOR = bool(config.ENABLE_CUDASIM)

BOX = 64  # columns of one TMA box: 128 bytes of 16-bit values, the 128-byte swizzle's row
WORDS = BOX // 2  # the same box in the 32-bit words (pairs of values) that the tensor maps are made of
SWIZZLE = 128
# registers a thread: at launch (65536 / threads, a multiple of 8), then after setmaxnreg the producer's and the
# consumers' (FlashAttention-3's split: 24 * 128 + 240 * 256 and 32 * 128 + 160 * 384, each at most 65536)
REGISTERS = {2: (168, 24, 240), 3: (128, 32, 160)}
DTYPES = ("float16", "bfloat16")
# the timeline build's events (stamps[warpgroup, tile, event], %globaltimer nanoseconds; warpgroup 0 the producer):
# ready to issue (a consumer's tile has landed; the producer's slot is free), GEMMs issued (the producer: K and V's
# copies), S ready, softmax done, P V (of the tile before) done
EVENTS = ("ready", "issued", "S ready", "softmax done", "PV done")
READY, ISSUED, S_READY, SOFTMAX_DONE, PV_DONE = range(5)


@dataclass(frozen=True)
class WgmmaTile:
    """block_k keys per K/V tile (wgmma's N of S = Q K^T: a multiple of 16 up to 256), the ring's stages (at
    least 2), pingpong (the consumers take turns issuing their GEMMs) and the consumer warpgroups (2 or 3)."""

    block_k: int = 128
    stages: int = 2
    pingpong: bool = True
    consumers: int = 2
    timeline: bool = False  # a build that records when each warpgroup reaches each step (the `stamps` argument)

    @property
    def block_q(self) -> int:
        """Query rows of a block: 64 (wgmma's M) per consumer warpgroup."""
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    def shared_bytes(self, d: int) -> int:
        """Dynamic shared memory: Q, then each stage's K and V, plus 1 KB to align the start to 1024 bytes."""
        return 2 * d * (self.block_q + 2 * self.stages * self.block_k) + 1024

    def check(self, d: int):
        if d not in (64, 128):
            raise ValueError(f"variant='wgmma' supports d in (64, 128); got d={d}")
        if self.block_k % 16 or not 16 <= self.block_k <= 256:
            raise ValueError(f"block_k must be a multiple of 16 in [16, 256] (wgmma's N); got {self.block_k}")
        if self.consumers not in REGISTERS:
            raise ValueError(f"consumers must be 2 or 3 warpgroups; got {self.consumers}")
        if self.stages < 2:  # tile j's K is waited for before tile j - 1's slot is released
            raise ValueError(f"stages must be at least 2; got {self.stages}")
        limit = 227 * 1024
        if self.shared_bytes(d) > limit:
            raise ValueError(f"block_k={self.block_k} with {self.stages} stages at d={d} needs "
                             f"{self.shared_bytes(d):,} bytes of shared memory; an H100/H200 block has {limit:,}")


def choose_tile(d: int, causal: bool = False, block_k=None) -> WgmmaTile:
    """The default tile, from the sweep of scripts/gpu_check_wgmma_forward.py (H200, 2026-11-29, B = 1, H = 16,
    float16; benchmarks/results/h200/wgmma_tiles.txt): d = 64, three consumer warpgroups (192 query rows) and two
    stages of 128 keys (88 KB of shared memory; 440-510 TFLOP/s at N = 16384 against 392-424 with two consumers);
    d = 128, two consumers and two stages of 128 keys (160 KB; 560-624 at N = 16384, the best or within 5% of it).
    block_k overrides the keys. causal is not used today: with the mask too, these tiles are the best of the
    sweep or within 5% of it."""
    tile = WgmmaTile(block_k or 128, 2, True, 3 if d == 64 else 2)
    tile.check(d)
    return tile


def _step(fn):
    """A step of the kernel: inlined into it by Numba (no call), under the kernel's fastmath flags."""
    return cuda.jit(device=True, inline="always", fastmath=FASTMATH)(fn)


_BUILDS = {}


def build(d: int, dtype: str, causal: bool, tile: WgmmaTile = WgmmaTile()):
    """The kernel for (d, dtype, causal, tile). Arguments:

        (q_map, k_map, v_map, o, lse, n_q, n_k, group, scale_log2, stamps)

    q_map, k_map, v_map: tensor_map (hopper.tensor_map_4d) of Q (B, H, Nq, d / 2), K and V (B, H_kv, Nk, d / 2)
    as uint32 words (pairs of 16-bit values; any strides but the last), boxes of (block_q or block_k) x 32 words
    with 128-byte swizzle; o: (B, H, Nq, d / 2) uint32 words (any strides); lse: (B, H, Nq) float32;
    group = H / H_kv. grid(B, H, Nq, tile), tile.threads threads, tile.shared_bytes(d) bytes
    of dynamic shared memory."""
    key = (d, dtype, causal, tile)
    if key not in _BUILDS:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
        tile.check(d)
        _BUILDS[key] = _kernel(d, dtype, causal, tile)
    return _BUILDS[key]


def _kernel(d, dtype, causal, tile):
    BK, ST, BQ, CONSUMERS = tile.block_k, tile.stages, tile.block_q, tile.consumers
    LAUNCH_REGISTERS, PRODUCER_REGISTERS, CONSUMER_REGISTERS = REGISTERS[CONSUMERS]
    CONSUMER_THREADS = 128 * CONSUMERS
    CAUSAL = causal
    BOXES = d // BOX
    Q_BOX, K_BOX = BQ * 2 * BOX, BK * 2 * BOX  # bytes of one 64-column box of a Q or K/V tile
    Q_BYTES, KV_BYTES = BOXES * Q_BOX, BOXES * K_BOX
    K_AT, V_AT = Q_BYTES, Q_BYTES + ST * KV_BYTES  # where stage 0's K and V start, from the aligned start
    NS, NO, NP = BK // 2, d // 2, BK // 4  # registers a thread holds of S, of O, of P (16-bit pairs)
    QK_STEPS, PV_STEPS, S_TILES, O_TILES = d // 16, BK // 16, BK // 8, d // 8
    # barrier 0: Q landed; then per slot: K landed, V landed, K released, V released
    FULL_K, FULL_V, EMPTY_K, EMPTY_V, N_BARRIERS = 1, 1 + ST, 1 + 2 * ST, 1 + 3 * ST, 1 + 4 * ST
    SWIZZLE_ROWS = 8 * 2 * BOX  # SBO: 8 rows of 128 bytes, one swizzle pattern
    mma_s = hopper.wgmma_ss(BK, dtype)  # S (64 x BK) = Q (64 x d, K-major) @ K^T (K: BK x d, K-major)
    mma_o = hopper.wgmma_rs(d, dtype, b_major="MN")  # O (64 x d) += P (registers) @ V (BK x d, row-major: MN)
    pack = mma.pack_bf16x2 if dtype == "bfloat16" else mma.pack_f16x2
    ZERO, ONE, NEG32 = float32(0.0), float32(1.0), float32(NEG)

    @_step
    def produce(sm, at, bar, q_map, k_map, v_map, q0, h, h_kv, b, n_tiles, stamps):
        """One thread: Q's tile, then K and V tile by tile into the ring, each half of a slot refilled once the
        consumers released it (K as soon as S = Q K^T is done, V once P V is). Boxes are 32 words (64 values)
        wide, at rows of head h (K and V: h_kv) of batch b."""
        hopper.mbarrier_arrive_expect_tx(bar, 0, Q_BYTES)
        for x in range(BOXES):
            hopper.tma_load_4d(sm, at + x * (Q_BOX // 2), q_map, int32(WORDS * x), int32(q0), int32(h), int32(b),
                               bar, 0)
        for j in range(n_tiles):
            s = j % ST
            row = int32(j * BK)
            if j >= ST:  # fill j // ST of slot s: wait until the consumers released fill j // ST - 1
                hopper.mbarrier_wait_parity(bar, EMPTY_K + s, int32((j // ST - 1) & 1))
            stamp(stamps, 0, j, READY)
            hopper.mbarrier_arrive_expect_tx(bar, FULL_K + s, KV_BYTES)
            for x in range(BOXES):
                hopper.tma_load_4d(sm, at + (K_AT + s * KV_BYTES + x * K_BOX) // 2, k_map, int32(WORDS * x), row,
                                   int32(h_kv), int32(b), bar, FULL_K + s)
            if j >= ST:
                hopper.mbarrier_wait_parity(bar, EMPTY_V + s, int32((j // ST - 1) & 1))
            hopper.mbarrier_arrive_expect_tx(bar, FULL_V + s, KV_BYTES)
            for x in range(BOXES):
                hopper.tma_load_4d(sm, at + (V_AT + s * KV_BYTES + x * K_BOX) // 2, v_map, int32(WORDS * x), row,
                                   int32(h_kv), int32(b), bar, FULL_V + s)
            stamp(stamps, 0, j, ISSUED)

    @_step
    def issue_scores(sacc, q_tile, k_tile):
        """S = Q K^T, issued (not waited for): k16 step kk reads 32 bytes further along the swizzled rows of box
        kk // 4."""
        for kk in range(QK_STEPS):
            step = (kk % 4) * 32
            dq = hopper.make_descriptor(q_tile + (kk // 4) * Q_BOX + step, 16, SWIZZLE_ROWS, SWIZZLE)
            dk = hopper.make_descriptor(k_tile + (kk // 4) * K_BOX + step, 16, SWIZZLE_ROWS, SWIZZLE)
            mma_s(sacc, dq, dk, min(kk, 1))
        hopper.wgmma_commit()

    @_step
    def issue_pv(oacc, p, v_tile):
        """O += P V, issued: k16 step kk is 16 rows (keys) of V further down its 128-byte rows; LBO steps over the
        64-column boxes along d."""
        for kk in range(PV_STEPS):
            dv = hopper.make_descriptor(v_tile + kk * 16 * 2 * BOX, K_BOX, SWIZZLE_ROWS, SWIZZLE)
            mma_o(oacc, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], dv, 1)
        hopper.wgmma_commit()

    @_step
    def mask(sacc, k0, row0, g, t, n_k):
        """Keys past the end, and (causal) keys after the row, get a score of -inf (NEG); only tiles that cross
        the end or this warp's diagonal are touched."""
        if k0 + U(BK) > n_k or (CAUSAL and k0 + U(BK - 1) > row0 - g):
            for n in range(S_TILES):
                for c in range(2):
                    col = k0 + U(8 * n + c) + U(2) * t
                    for r in range(2):
                        if col >= n_k or (CAUSAL and col > row0 + U(8 * r)):
                            sacc[4 * n + 2 * r + c] = NEG32

    @_step
    def softmax(sacc, m, l, alpha, scale_log2):
        """The online softmax on S's fragments: lane (g, t) holds rows g and g + 8 of its warp, keys 8n + 2t + c.
        S becomes exp2(scale * S - m) in place; alpha is each row's rescale of O."""
        for r in range(2):
            mx = sacc[2 * r]
            for n in range(S_TILES):
                mx = max(mx, max(sacc[4 * n + 2 * r], sacc[4 * n + 2 * r + 1]))
            mx = max(mx, mma.shfl_xor(mx, 1))  # the row's 4 lanes agree on its max
            mx = max(mx, mma.shfl_xor(mx, 2))
            m_new = max(m[r], mx)
            alpha[r] = math.exp2((m[r] - m_new) * scale_log2)
            m[r] = m_new
            offset = m_new * scale_log2
            row_sum = ZERO
            for n in range(S_TILES):
                for c in range(2):
                    x = math.exp2(sacc[4 * n + 2 * r + c] * scale_log2 - offset)
                    row_sum += x
                    sacc[4 * n + 2 * r + c] = x
            l[r] = l[r] * alpha[r] + row_sum  # this lane's share; the quad's shares are added at the end

    @_step
    def rescale_and_pack(oacc, p, sacc, alpha):
        """O's rows times alpha, and P packed to 16 bits as wgmma's A fragments: register 4kk + j of k16 step kk
        holds S elements 8kk + 2j and 8kk + 2j + 1 (S's accumulator layout is A's, as with mma.sync). A warp whose
        rows' maxima all stayed put (every alpha is exactly 1) skips the multiplies together."""
        if mma.vote_any(alpha[0] != ONE or alpha[1] != ONE):
            for n in range(O_TILES):
                for r in range(2):
                    oacc[4 * n + 2 * r] *= alpha[r]
                    oacc[4 * n + 2 * r + 1] *= alpha[r]
        for i in range(NP):
            p[i] = pack(sacc[2 * i], sacc[2 * i + 1])

    LAST_CW = CONSUMERS - 1

    @_step
    def stamp_time(stamps, who, j, event):
        """The timeline build: warpgroup `who`'s first thread records %globaltimer at an event of tile j, in the
        grid's first block (the heaviest, launched first)."""
        if cuda.threadIdx.x % 128 == 0 and cuda.blockIdx.x == 0 and cuda.blockIdx.y == 0 and cuda.blockIdx.z == 0:
            if U(j) < U(stamps.shape[1]):
                stamps[who, j, event] = hopper.globaltimer()

    @_step
    def no_stamp(stamps, who, j, event):
        return

    stamp = stamp_time if tile.timeline else no_stamp

    @_step
    def first_turn_pingpong(cw):
        """Pingpong: the last consumer lets the first one issue its GEMMs first."""
        if cw == U(LAST_CW):
            hopper.named_barrier_arrive(1, 256)

    @_step
    def my_turn_pingpong(cw):
        """Pingpong: wait until the previous consumer (round robin) has issued its GEMMs (named barrier 1 + cw:
        this warpgroup's 128 threads and the previous one's arrival)."""
        hopper.named_barrier_sync(int32(1) + int32(cw), int32(256))

    @_step
    def your_turn_pingpong(cw, last):
        """Pingpong: let the next consumer issue its GEMMs (the last consumer's last arrival would have no one to
        wait for it)."""
        if not (cw == U(LAST_CW) and last):
            hopper.named_barrier_arrive(int32(1) + int32((cw + U(1)) % U(CONSUMERS)), int32(256))

    @_step
    def no_turns(cw):
        return

    @_step
    def no_turn_to_give(cw, last):
        return

    # without pingpong each consumer issues its GEMMs when it is ready
    first_turn, my_turn, your_turn = (first_turn_pingpong, my_turn_pingpong, your_turn_pingpong) if tile.pingpong \
        else (no_turns, no_turns, no_turn_to_give)

    @_step
    def finish(o, lse, oacc, m, l, bh_b, bh_h, row0, t, n_q, scale_log2):
        """Add up each row's sum over its quad, normalise once, write O (16-bit pairs) and lse."""
        for r in range(2):
            total = l[r]
            total += mma.shfl_xor(total, 1)
            total += mma.shfl_xor(total, 2)
            row = row0 + U(8 * r)
            if row < n_q:
                inv = float32(1.0) / total
                for n in range(O_TILES):
                    o[bh_b, bh_h, row, U(4 * n) + t] = pack(oacc[4 * n + 2 * r] * inv, oacc[4 * n + 2 * r + 1] * inv)
                if t == U(0):
                    lse[bh_b, bh_h, row] = (m[r] * scale_log2 + math.log2(total)) * LN2

    jit = cuda.jit(fastmath=FASTMATH) if SIMULATOR else cuda.jit(fastmath=FASTMATH, max_registers=LAUNCH_REGISTERS)

    @jit
    def flash_fwd_wgmma(q_map, k_map, v_map, o, lse, n_q, n_k, group, scale_log2, stamps):
        sm = cuda.shared.array(0, uint16)  # Q, K stages, V stages (dynamic: up to 227 KB)
        bar = cuda.shared.array(N_BARRIERS, uint64)
        tid = U(cuda.threadIdx.x)
        wg = tid // U(128)
        b, h = U(cuda.blockIdx.z), U(cuda.blockIdx.y)
        q0 = U(cuda.gridDim.x - 1 - cuda.blockIdx.x) * U(BQ)  # the last (heaviest, if causal) blocks first
        k_end = min(U(n_k), q0 + U(BQ)) if CAUSAL else U(n_k)
        n_tiles = (k_end + U(BK - 1)) // U(BK)
        base = hopper.smem_address(sm, 0)
        at = (U(1024) - U(base) % U(1024)) % U(1024)  # bytes to the first 1024-byte boundary (the swizzle's)
        if tid == U(0):
            for i in range(N_BARRIERS):
                hopper.mbarrier_init(bar, i, 1 if i < EMPTY_K else CONSUMER_THREADS)
        cuda.syncthreads()
        if wg == U(0):
            hopper.setmaxnreg_dec(PRODUCER_REGISTERS)
            if tid == U(0):
                produce(sm, at // U(2), bar, q_map, k_map, v_map, q0, h, h // U(group), b, n_tiles, stamps)
            return
        hopper.setmaxnreg_inc(CONSUMER_REGISTERS)
        lane = tid % U(32)
        g, t = lane // U(4), lane % U(4)
        row0 = q0 + (wg - U(1)) * U(64) + (tid % U(128)) // U(32) * U(16) + g  # rows row0 and row0 + 8
        sacc = cuda.local.array(NS, float32)
        oacc = cuda.local.array(NO, float32)
        p = cuda.local.array(NP, uint32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        for i in range(NO):
            oacc[i] = ZERO
        for r in range(2):
            m[r] = NEG32
            l[r] = ZERO
        start = U(base) + at
        q_tile = start + (wg - U(1)) * U(64 * 2 * BOX)  # this warpgroup's 64 rows of each Q box
        cw = wg - U(1)
        first_turn(cw)
        hopper.mbarrier_wait_parity(bar, 0, 0)  # Q has landed
        hopper.mbarrier_wait_parity(bar, FULL_K, 0)
        stamp(stamps, wg, 0, READY)
        my_turn(cw)
        hopper.wgmma_fence()
        issue_scores(sacc, q_tile, start + U(K_AT))
        your_turn(cw, n_tiles == U(1))
        stamp(stamps, wg, 0, ISSUED)
        hopper.wgmma_wait(0)
        stamp(stamps, wg, 0, S_READY)
        hopper.mbarrier_arrive(bar, EMPTY_K)
        mask(sacc, U(0), row0, g, t, U(n_k))
        softmax(sacc, m, l, alpha, scale_log2)
        stamp(stamps, wg, 0, SOFTMAX_DONE)
        rescale_and_pack(oacc, p, sacc, alpha)
        for j in range(1, n_tiles):
            # S of tile j is computed while P V of tile j - 1 is; the softmax of tile j runs under P V
            s, prev = j % ST, (j - 1) % ST
            hopper.mbarrier_wait_parity(bar, FULL_K + s, int32((j // ST) & 1))
            hopper.mbarrier_wait_parity(bar, FULL_V + prev, int32(((j - 1) // ST) & 1))
            stamp(stamps, wg, j, READY)
            my_turn(cw)
            hopper.wgmma_fence()
            issue_scores(sacc, q_tile, start + U(K_AT + s * KV_BYTES))
            issue_pv(oacc, p, start + U(V_AT + prev * KV_BYTES))
            your_turn(cw, U(j) + U(1) == n_tiles)
            stamp(stamps, wg, j, ISSUED)
            hopper.wgmma_wait(1)  # S is ready (P V may still run: it reads p, and softmax writes only sacc)
            stamp(stamps, wg, j, S_READY)
            hopper.mbarrier_arrive(bar, EMPTY_K + s)  # K_j is read: its half of the slot may be refilled
            mask(sacc, U(j) * U(BK), row0, g, t, U(n_k))
            softmax(sacc, m, l, alpha, scale_log2)
            stamp(stamps, wg, j, SOFTMAX_DONE)
            hopper.wgmma_wait(0)  # P V is done: V_{j-1}'s half of the slot is free, and O and p may change
            stamp(stamps, wg, j, PV_DONE)
            hopper.mbarrier_arrive(bar, EMPTY_V + prev)
            rescale_and_pack(oacc, p, sacc, alpha)
        last = (n_tiles - U(1)) % U(ST)
        hopper.mbarrier_wait_parity(bar, FULL_V + last, int32(((n_tiles - U(1)) // U(ST)) & U(1)))
        stamp(stamps, wg, n_tiles, READY)
        hopper.wgmma_fence()
        issue_pv(oacc, p, start + U(V_AT) + last * U(KV_BYTES))
        hopper.wgmma_wait(0)
        stamp(stamps, wg, n_tiles, PV_DONE)
        hopper.mbarrier_arrive(bar, EMPTY_V + last)
        finish(o, lse, oacc, m, l, b, h, row0, t, U(n_q), scale_log2)

    return flash_fwd_wgmma


# ------------------------------------------------------------------------------------------------ host side
_MAPS = OrderedDict()  # (address, shape, strides, box_rows) -> tensor map on the device: encoded once per buffer
_MAPS_KEPT = 64


def tensor_map(words, box_rows):
    """hopper.tensor_map_4d of a (B, H, N, d/2) uint32 device array (16-bit values in pairs; its last axis
    contiguous, any other strides) with boxes of box_rows x 32 words (64 values), swizzled 128 bytes. A map encodes
    only the address, shape, strides and box, so one made for the same buffer serves again (a training loop or a
    benchmark passes the same tensors call after call); the last _MAPS_KEPT are kept."""
    if SIMULATOR:  # the simulator's map refers to the array object itself
        return hopper.tensor_map_4d(words, box_rows, WORDS, SWIZZLE)
    cai = words.__cuda_array_interface__
    key = (cai["data"][0], tuple(cai["shape"]), cai.get("strides"), box_rows)
    tmap = _MAPS.get(key)
    if tmap is None:
        tmap = _MAPS[key] = hopper.tensor_map_4d(words, box_rows, WORDS, SWIZZLE)
        if len(_MAPS) > _MAPS_KEPT:
            _MAPS.popitem(last=False)
    else:
        _MAPS.move_to_end(key)
    return tmap


def check_tma_strides(name: str, words):
    """Refuse a (B, H, N, d/2) array of words that TMA cannot read in place (hopper.tma_strides: its last axis
    contiguous, its other strides and its start multiples of 16 bytes)."""
    address, shape, strides, itemsize = hopper._matrix_facts(words)
    if hopper.tma_strides(shape, strides, address, itemsize) is None:
        raise ValueError(f"variant='wgmma' reads {name} with TMA, which needs its last axis contiguous and its other "
                         f"strides and start multiples of 16 bytes; got {name} with strides {tuple(strides)} (bytes, "
                         f"as 32-bit pairs) at address 0x{address:x}: pass a contiguous copy, or use variant='tensor'")


def output_strides(q) -> tuple:
    """The strides (in values) of O for q (B, H, N, d): laid out (B, N, H, d) where q is (a GPT's heads,
    x.view(B, N, H, d).transpose(1, 2)), so that O.transpose(1, 2).reshape(B, N, H * d) needs no copy, as with
    torch's attention; else contiguous."""
    B, H, N, d = q.shape
    if H > 1 and N > 1 and q.stride(1) < q.stride(2):
        return (N * H * d, d, H * d, 1)
    return (H * N * d, N * d, d, 1)


def output_like(q):
    """An empty torch tensor for O, shaped as q, with output_strides(q)."""
    import torch  # optional: only torch tensors come here

    return torch.empty_strided(tuple(q.shape), output_strides(q), dtype=q.dtype, device=q.device)


def torch_strides(x):
    """The strides in bytes a tensor map of the torch tensor x (B, H, N, d) of 16-bit values (the kernels' inputs)
    is encoded with (hopper.tma_strides), or None where TMA cannot read x in place."""
    return hopper.tma_strides(tuple(x.shape), tuple(2 * st for st in x.stride()), x.data_ptr(), 2)


_TORCH_MAPS = OrderedDict()  # the prepared path's maps: (address, shape, strides, box_rows, device) -> torch tensor


def torch_map(x, box_rows: int) -> int:
    """The device address of a tensor map of the 16-bit torch tensor x (B, H, N, d) (its last axis contiguous,
    the other strides multiples of 8 values: a (B, N, H, d) tensor's transpose(1, 2) is read in place), made once
    per (buffer, layout, box) as tensor_map does and kept as a torch tensor on x's device."""
    key = (x.data_ptr(), x.shape, x.stride(), box_rows, x.device)
    tmap = _TORCH_MAPS.get(key)
    if tmap is None:
        import torch  # optional: only torch tensors come here

        B, H, N, d = x.shape
        strides = torch_strides(x)
        if strides is None:
            raise ValueError(f"variant='wgmma' reads its inputs with TMA: the last axis contiguous, the other strides "
                             f"multiples of 8 values and a 16-byte aligned start; got strides {tuple(x.stride())} "
                             f"(values), address 0x{x.data_ptr():x}. Pass a contiguous copy")
        words = hopper._encode_tiled(x.data_ptr(), (d // 2, N, H, B), strides[2::-1], 4, box_rows, WORDS, SWIZZLE)
        tmap = _TORCH_MAPS[key] = torch.from_numpy(words.view(np.int64)).to(x.device)
        if len(_TORCH_MAPS) > _MAPS_KEPT:
            _TORCH_MAPS.popitem(last=False)
    else:
        _TORCH_MAPS.move_to_end(key)
    return tmap.data_ptr()


_NO_STAMPS = []


def no_stamps():
    """The stamps argument of a build without a timeline (one element, never written)."""
    if not _NO_STAMPS:
        _NO_STAMPS.append(cuda.to_device(np.zeros((1, 1, len(EVENTS)), np.uint64)))
    return _NO_STAMPS[0]


def grid(B: int, H: int, Nq: int, tile: WgmmaTile) -> tuple:
    return (-(-Nq // tile.block_q), H, B)


def forward(q_words, k_words, v_words, o_words, lse, scale, causal, dtype, tile: WgmmaTile | None = None,
            stamps=None):
    """Launch the kernel on numba device arrays: q_words (B, H, Nq, d/2) uint32, k_words and v_words
    (B, H_kv, Nk, d/2), o_words like q_words, lse (B, H, Nq) float32. stamps: the timeline build's record, a
    uint64 device array (1 + consumers, tiles + 1, len(EVENTS)) (tile.timeline; else not needed)."""
    B, H, Nq, w = q_words.shape
    _, H_kv, Nk, _ = k_words.shape
    d = 2 * w
    tile = tile or choose_tile(d, causal)
    kernel = build(d, dtype, bool(causal), tile)
    q_map = tensor_map(q_words, tile.block_q)
    k_map, v_map = tensor_map(k_words, tile.block_k), tensor_map(v_words, tile.block_k)
    launch_with_shared(kernel, grid(B, H, Nq, tile), tile.threads, tile.shared_bytes(d), q_map, k_map, v_map, o_words, lse,
                       np.int64(Nq), np.int64(Nk), np.int64(H // H_kv),
                       np.float32(scale * LOG2E), stamps if stamps is not None else no_stamps())
