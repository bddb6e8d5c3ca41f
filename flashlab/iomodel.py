"""A model of the two memories attention runs between: large, slow HBM and small, fast SRAM.

The algorithms in `reference` and `tiled` take an `io` argument. By default it is `NO_IO`, which does
nothing. Pass an `HBMModel` instead and the *same code* reports what it moved:

    io = HBMModel(M=16384)
    flash_attention_v2(q, k, v, io=io)
    io.hbm_bytes, io.peak_sram, io.matmul_flops, io.other_flops

The algorithm calls four hooks:
    io.read(name, x) -> x      x was loaded from HBM (counted: x.size elements)
    io.write(name, x) -> x     x is stored to HBM   (counted: x.size elements)
    io.sram(**shapes)          the tiles held in SRAM during one step, per (batch, head); checked against M
    io.flops(matmul=, other=)  FLOPs of one step, per (batch, head)

`formula_traffic` gives the same counts in closed form (tests check they agree), which is what the
lessons' traffic plots are drawn from, since running the NumPy algorithms at large N is slow.

Budget convention (FlashAttention, arXiv 2205.14135, Sec. 3.1 and Thm. 2): M counts the matrix tiles that
stream between HBM and SRAM (Q_i, K_j, V_j, O_i; in the backward also dQ_i, dK_j, dV_j, dO_i). The
score tile S_ij (kept in registers on a GPU) and the row statistics m, l are on-chip too; they are
reported in `peak_onchip` but not charged against M.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

#: Default SRAM budget M, in elements: 16384 floats = 64 KiB of float32, a third of an A100 SM's
#: 192 KB of shared memory/L1. With the paper's rule it gives block_k = 64, block_q = 64 at d = 64.
DEFAULT_SRAM = 16384

# Tiles that live in registers / are tiny: on chip, but not charged against M (see module docstring).
_UNCHARGED = {"S_ij", "P_ij", "dP_ij", "dS_ij", "m_i", "l_i", "lse_i", "D_i"}


def default_block_sizes(d, M=DEFAULT_SRAM, *, backward=False):
    """(block_q, block_k) by the paper's rule: Bc = ceil(M / 4d), Br = min(Bc, d) (arXiv 2205.14135, Alg. 1).

    The forward streams four d-wide tiles (Q_i, K_j, V_j, O_i) through SRAM, so each gets about M/4.
    The backward streams seven (K_j, V_j, dK_j, dV_j, Q_i, dO_i, dQ_i), so it applies the rule to M/2.
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be a positive integer; got {d!r}")
    budget = M // 2 if backward else M
    bc = max(1, math.ceil(budget / (4 * d)))
    return min(bc, int(d)), bc


class _NoIO:
    """The default `io`: every hook does nothing, so the algorithms run at full speed."""

    def start(self, algorithm, batch_shape):
        pass

    def read(self, name, x):
        return x

    def write(self, name, x):
        return x

    def sram(self, **shapes):
        pass

    def flops(self, matmul=0, other=0):
        pass


NO_IO = _NoIO()


class SRAMOverflowError(ValueError):
    """A tile does not fit in the SRAM budget M."""


class HBMModel:
    """Counts HBM reads/writes, on-chip footprint and FLOPs of one run of an algorithm.

    M: SRAM capacity in elements (None: unlimited). bytes_per_element: 4 for float32, 2 for float16.
    """

    def __init__(self, M=DEFAULT_SRAM, bytes_per_element=4):
        if M is not None and (isinstance(M, bool) or not isinstance(M, (int, np.integer)) or M < 1):
            raise ValueError(f"M (SRAM size in elements) must be a positive integer or None; got {M!r}")
        self.M = None if M is None else int(M)
        self.bytes_per_element = bytes_per_element
        self.reset()

    def reset(self):
        self.algorithm = None
        self.batch = 1
        self.reads = defaultdict(int)  # name -> elements
        self.writes = defaultdict(int)
        self.peak_sram = 0  # elements charged against M, per (batch, head)
        self.peak_onchip = 0  # everything declared on chip, per (batch, head)
        self.matmul_flops = 0
        self.other_flops = 0

    # hooks called by the algorithms -------------------------------------------------------------
    def start(self, algorithm, batch_shape):
        self.reset()
        self.algorithm = algorithm
        self.batch = int(np.prod(batch_shape, dtype=np.int64))

    def read(self, name, x):
        self.reads[name] += int(np.size(x))
        return x

    def write(self, name, x):
        self.writes[name] += int(np.size(x))
        return x

    def sram(self, **shapes):
        charged, onchip = 0, 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            onchip += n
            if name in _UNCHARGED:
                continue
            charged += n
            if self.M is not None and charged > self.M:
                raise SRAMOverflowError(
                    f"tile {name} of shape {tuple(shape)} ({n} elements) does not fit in SRAM: "
                    f"the tiles before it already use {charged - n} of M = {self.M} elements. "
                    f"Use smaller block sizes or a larger M."
                )
        self.peak_sram = max(self.peak_sram, charged)
        self.peak_onchip = max(self.peak_onchip, onchip)

    def flops(self, matmul=0, other=0):
        self.matmul_flops += matmul * self.batch
        self.other_flops += other * self.batch

    # results ------------------------------------------------------------------------------------
    @property
    def elements_read(self):
        return sum(self.reads.values())

    @property
    def elements_written(self):
        return sum(self.writes.values())

    @property
    def bytes_read(self):
        return self.elements_read * self.bytes_per_element

    @property
    def bytes_written(self):
        return self.elements_written * self.bytes_per_element

    @property
    def hbm_bytes(self):
        return self.bytes_read + self.bytes_written

    def summary(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "M": self.M,
            "hbm_read_bytes": self.bytes_read,
            "hbm_write_bytes": self.bytes_written,
            "hbm_bytes": self.hbm_bytes,
            "peak_sram_elements": self.peak_sram,
            "peak_onchip_elements": self.peak_onchip,
            "matmul_flops": self.matmul_flops,
            "other_flops": self.other_flops,
            "reads": dict(self.reads),
            "writes": dict(self.writes),
        }

    def __repr__(self):
        s = self.summary()
        return (
            f"HBMModel({s['algorithm']}: read {s['hbm_read_bytes']:,} B, wrote {s['hbm_write_bytes']:,} B, "
            f"peak SRAM {s['peak_sram_elements']:,}/{self.M} elements, "
            f"{s['matmul_flops']:,} matmul + {s['other_flops']:,} other FLOPs)"
        )


# --------------------------------------------------------------------------------------------------
# Closed forms. All counts are in elements, for `batch` independent (batch, head) problems.
# --------------------------------------------------------------------------------------------------

def visited_k_blocks(nq, nk, block_q, block_k, causal):
    """For each query block, how many key blocks the FA loops visit (causal: those not fully masked)."""
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    if not causal:
        return [tc] * tr
    # the last query row of block i is min((i+1)*Br, Nq) - 1; key block j is visited iff j*Bc <= that row
    return [min(tc, (min((i + 1) * block_q, nq) - 1) // block_k + 1) for i in range(tr)]


def formula_traffic(algorithm, nq, nk, d, dv=None, *, block_q=None, block_k=None, causal=False, batch=1, M=DEFAULT_SRAM):
    """HBM traffic of `algorithm` in elements, as a dict {"read": r, "write": w}.

    algorithm: "naive", "naive_backward", "fa1", "fa2" or "fa2_backward". Block sizes default to the paper's rule for M.
    Non-causal closed forms (Tr = ceil(Nq/Br), Tc = ceil(Nk/Bc)):
      naive:  read  (Nq+Nk) d + Nq Nk (S) + Nq Nk (P) + Nk dv            write Nq Nk (S) + Nq Nk (P) + Nq dv
      naive_backward: read 5 Nq Nk (P twice, dP, dS twice) + 2 Nq dv + Nk dv + (Nq+Nk) d
                      write 2 Nq Nk (dP, dS) + Nk dv + (Nq+Nk) d
      fa1:    read  Nk(d+dv) + Tc Nq (d + dv + 2) + 2Nq (m, l for lse)  write Nq(dv+2) (init) + Tc Nq (dv+2) + Nq (lse)
      fa2:    read  Nq d + Tr Nk (d + dv)                               write Nq (dv + 1)
      fa2_backward: read  2 Nq dv (for D) + Nk(d+dv) + Tc Nq (d + dv + 2 + d)   write Nq + Nq d (init dQ) + Tc Nq d + Nk(d+dv)
    With causal masking the Tc (or Tr) factors become the number of visited blocks per row of blocks.
    """
    dv = d if dv is None else dv
    if block_q is None or block_k is None:
        bq, bk = default_block_sizes(d, M, backward=(algorithm == "fa2_backward"))
        block_q, block_k = block_q or bq, block_k or bk
    visits = visited_k_blocks(nq, nk, block_q, block_k, causal)
    # rows_times_blocks = sum over query rows of the key blocks that row's block visits
    rows_times_blocks = sum(v * (min((i + 1) * block_q, nq) - i * block_q) for i, v in enumerate(visits))
    # keys_times_blocks = sum over query blocks of the keys those visited blocks contain
    keys_times_blocks = sum(min(v * block_k, nk) for v in visits)
    # K/V blocks that at least one query block visits (FA1 and the backward load each of them once)
    visited_keys = min(max(visits) * block_k, nk)

    if algorithm == "naive":
        r = nq * d + nk * d + 2 * nq * nk + nk * dv
        w = 2 * nq * nk + nq * dv
    elif algorithm == "naive_backward":
        # dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P dP)); dQ = dS K; dK = dS^T Q, each through HBM
        r = 5 * nq * nk + 2 * nq * dv + nk * dv + nk * d + nq * d
        w = 2 * nq * nk + nk * dv + nq * d + nk * d
    elif algorithm == "fa1":
        # per visited (i, j): read Q_i, O_i, l_i, m_i and write O_i, l_i, m_i; + init, + lse at the end
        r = visited_keys * (d + dv) + rows_times_blocks * (d + dv + 2) + 2 * nq
        w = nq * (dv + 2) + rows_times_blocks * (dv + 2) + nq
    elif algorithm == "fa2":
        r = nq * d + keys_times_blocks * (d + dv)
        w = nq * (dv + 1)
    elif algorithm == "fa2_backward":
        # D pass reads O, dO; per visited (i, j): read Q_i, dO_i, lse_i, D_i, dQ_i and write dQ_i
        r = 2 * nq * dv + visited_keys * (d + dv) + rows_times_blocks * (2 * d + dv + 2)
        w = nq + nq * d + rows_times_blocks * d + nk * (d + dv)
    else:
        raise ValueError(f"algorithm must be 'naive', 'naive_backward', 'fa1', 'fa2' or 'fa2_backward'; got {algorithm!r}")
    return {"read": batch * r, "write": batch * w}


def asymptotic_traffic(algorithm, n, d, M=DEFAULT_SRAM):
    """The Theta-forms from the paper, without constants: naive N d + N^2, FlashAttention N^2 d^2 / M."""
    if algorithm in ("naive", "naive_backward"):
        return n * d + n * n
    if algorithm in ("fa1", "fa2", "fa2_backward"):
        return n * n * d * d / M
    raise ValueError(f"algorithm must be 'naive', 'naive_backward', 'fa1', 'fa2' or 'fa2_backward'; got {algorithm!r}")
