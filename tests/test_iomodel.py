"""The HBM/SRAM model: counted traffic of the real algorithms equals the closed forms."""
import math

import numpy as np
import pytest

import flashlab as fl
from flashlab.iomodel import SRAMOverflowError, asymptotic_traffic

RUNS = {
    "naive": lambda q, k, v, io, **kw: fl.naive_attention(q, k, v, causal=kw["causal"], io=io),
    "fa1": lambda q, k, v, io, **kw: fl.flash_attention_v1(q, k, v, io=io, **kw),
    "fa2": lambda q, k, v, io, **kw: fl.flash_attention_v2(q, k, v, io=io, **kw),
}
SHAPES = [  # (batch, Nq, Nk, d, dv, block_q, block_k, M)
    ((), 64, 64, 16, 16, 16, 32, 4096),
    ((2,), 37, 91, 8, 5, 7, 13, 1024),
    ((2, 3), 91, 37, 8, 8, 16, 8, 2048),
    ((), 1, 50, 4, 4, 4, 16, 512),
    ((3,), 100, 100, 16, 16, None, None, 2048),  # default blocks from the paper's rule for this M
]


def run(alg, shape, causal, rng):
    batch, nq, nk, d, dv, bq, bk, M = shape
    q = rng.standard_normal(batch + (nq, d)).astype(np.float32)
    k = rng.standard_normal(batch + (nk, d)).astype(np.float32)
    v = rng.standard_normal(batch + (nk, dv)).astype(np.float32)
    if bq is None:
        bq, bk = fl.default_block_sizes(max(d, dv), M)
    io = fl.HBMModel(M=M)
    kw = dict(causal=causal) if alg == "naive" else dict(causal=causal, block_q=bq, block_k=bk)
    RUNS[alg](q, k, v, io, **kw)
    want = fl.formula_traffic(alg, nq, nk, d, dv, block_q=bq, block_k=bk, causal=causal,
                              batch=math.prod(batch), M=M)
    return io, want


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("alg", ["naive", "fa1", "fa2"])
def test_forward_traffic_equals_formula(alg, shape, causal, rng):
    io, want = run(alg, shape, causal, rng)
    assert (io.elements_read, io.elements_written) == (want["read"], want["write"])
    assert io.hbm_bytes == 4 * (want["read"] + want["write"])
    if alg != "naive":
        assert 0 < io.peak_sram <= shape[-1]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_traffic_equals_formula(shape, causal, rng):
    batch, nq, nk, d, dv, bq, bk, M = shape
    q = rng.standard_normal(batch + (nq, d)).astype(np.float32)
    k = rng.standard_normal(batch + (nk, d)).astype(np.float32)
    v = rng.standard_normal(batch + (nk, dv)).astype(np.float32)
    o, lse = fl.flash_attention_v2(q, k, v, causal=causal)
    do = rng.standard_normal(o.shape).astype(np.float32)
    if bq is None:
        bq, bk = fl.default_block_sizes(max(d, dv), M, backward=True)
    io = fl.HBMModel(M=M)
    fl.flash_attention_v2_backward(q, k, v, o, lse, do, causal=causal, block_q=bq, block_k=bk, io=io)
    want = fl.formula_traffic("fa2_backward", nq, nk, d, dv, block_q=bq, block_k=bk, causal=causal,
                              batch=math.prod(batch), M=M)
    assert (io.elements_read, io.elements_written) == (want["read"], want["write"])


@pytest.mark.parametrize("shape", SHAPES)
def test_naive_backward_traffic_equals_formula(shape, rng):
    batch, nq, nk, d, dv, _, _, M = shape
    q, k = rng.standard_normal(batch + (nq, d)), rng.standard_normal(batch + (nk, d))
    v, do = rng.standard_normal(batch + (nk, dv)), rng.standard_normal(batch + (nq, dv))
    io = fl.HBMModel(M=M)
    fl.naive_attention_backward(q, k, v, do, io=io)
    want = fl.formula_traffic("naive_backward", nq, nk, d, dv, batch=math.prod(batch))
    assert (io.elements_read, io.elements_written) == (want["read"], want["write"])
    # 7 N^2 + 8 N d for square problems: the standard backward's count (arXiv 2205.14135, Algorithm 3)
    assert fl.formula_traffic("naive_backward", 64, 64, 16) == {"read": 5 * 64 * 64 + 5 * 64 * 16,
                                                                 "write": 2 * 64 * 64 + 3 * 64 * 16}


def test_closed_forms_by_hand():
    """Spot values worked out on paper, so formula and counter cannot be wrong in the same way."""
    # naive, N=4, d=2: read Q,K (16) + S (16) + P (16) + V (8) = 56; write S, P (32) + O (8) = 40
    assert fl.formula_traffic("naive", 4, 4, 2) == {"read": 56, "write": 40}
    # fa2, N=4, d=2, Br=Bc=2: read Q (8) + Tr=2 passes over K,V (2*16) = 40; write O (8) + lse (4) = 12
    assert fl.formula_traffic("fa2", 4, 4, 2, block_q=2, block_k=2) == {"read": 40, "write": 12}


def test_flash_traffic_scales_as_n2_d2_over_m():
    """Theta(N^2 d^2 / M): doubling M roughly halves FA2's traffic; naive does not care about M."""
    n, d = 4096, 64
    t = {M: sum(fl.formula_traffic("fa2", n, n, d, M=M).values()) for M in (16384, 32768, 65536)}
    # Br = min(Bc, d) caps at d, so with these M the query block is fixed at 64 and traffic is flat...
    assert t[16384] >= t[32768] >= t[65536]
    # ...while FA1 (whose passes over Q, O scale with Tc = N / Bc) shrinks ~2x per doubling of M.
    f1 = {M: sum(fl.formula_traffic("fa1", n, n, d, M=M).values()) for M in (16384, 32768, 65536)}
    assert 1.7 < f1[16384] / f1[32768] < 2.1 and 1.7 < f1[32768] / f1[65536] < 2.1
    # Naive moves ~4 N^2 elements, FA1 ~12 N^2 d^2 / M: FA1 wins once M >> 3 d^2. With an A100's SRAM in
    # fp16 (~96K elements) that is the several-fold saving the paper reports (arXiv 2205.14135, Fig. 2).
    naive = sum(fl.formula_traffic("naive", n, n, d).values())
    assert naive / sum(fl.formula_traffic("fa1", n, n, d, M=96 * 1024).values()) > 5
    assert naive / f1[16384] < 2  # at 64 KiB of fp32 and d = 64 the advantage is small
    assert asymptotic_traffic("naive", n, d) == n * d + n * n
    assert asymptotic_traffic("fa1", n, d, M=16384) == n * n * d * d / 16384


def test_fa2_moves_less_than_fa1_and_does_fewer_non_matmul_flops(rng):
    q, k, v = (rng.standard_normal((128, 32)).astype(np.float32) for _ in range(3))
    io1, io2 = fl.HBMModel(M=4096), fl.HBMModel(M=4096)
    fl.flash_attention_v1(q, k, v, io=io1)
    fl.flash_attention_v2(q, k, v, io=io2)
    assert io2.hbm_bytes < io1.hbm_bytes
    assert io2.matmul_flops == io1.matmul_flops == 2 * 2 * 128 * 128 * 32
    assert io2.other_flops < io1.other_flops


def test_causal_skips_about_half_the_work(rng):
    q, k, v = (rng.standard_normal((256, 16)).astype(np.float32) for _ in range(3))
    full, causal = fl.HBMModel(M=None), fl.HBMModel(M=None)
    fl.flash_attention_v2(q, k, v, block_q=16, block_k=16, io=full)
    fl.flash_attention_v2(q, k, v, causal=True, block_q=16, block_k=16, io=causal)
    assert 0.5 < causal.matmul_flops / full.matmul_flops < 0.6  # 16 diagonal blocks of 256 are extra


def test_tile_too_big_for_sram_names_tile_and_budget(rng):
    q, k, v = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(3))
    with pytest.raises(SRAMOverflowError, match=r"tile V_j of shape \(64, 32\).*M = 4096"):
        fl.flash_attention_v2(q, k, v, block_q=32, block_k=64, io=fl.HBMModel(M=4096))


def test_default_blocks_fit_the_default_budget(rng):
    for d in (16, 32, 64, 128):
        q, k, v = (rng.standard_normal((2, 300, d)).astype(np.float32) for _ in range(3))
        io = fl.HBMModel()  # M = DEFAULT_SRAM, blocks from the rule for the same M
        o, lse = fl.flash_attention_v2(q, k, v, io=io)
        assert io.peak_sram <= fl.DEFAULT_SRAM
        do = np.ones_like(o)
        fl.flash_attention_v2_backward(q, k, v, o, lse, do, io=io)
        assert io.peak_sram <= fl.DEFAULT_SRAM


@pytest.mark.parametrize("M", [0, -5, 2.5, "big", True])
def test_bad_sram_size(M):
    with pytest.raises(ValueError, match="M"):
        fl.HBMModel(M=M)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="algorithm must be"):
        fl.formula_traffic("fa9", 4, 4, 2)
