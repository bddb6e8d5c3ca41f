"""The exercises added to lessons 11-14 (fa3_loop_time, tt_core_reads, backward_memory, cached_attention,
decode_time): each solution passes, each blank is "not implemented", and plausible wrong solutions
("mutants") fail with a message, for several seeds."""
import numpy as np
import pytest

from flashlab.grading import EXERCISES, check
from conftest import load_exercise

torch = pytest.importorskip("torch")
F = torch.nn.functional

SEEDS = (1, 2, 3)
LESSONS = {"fa3_loop_time": "11_fa3_ideas", "tt_core_reads": "12_other_hardware", "backward_memory": "13_real_model",
           "cached_attention": "13_real_model", "decode_time": "14_decoding"}
MUTANTS = {}


def mutant(name):
    def register(fn):
        MUTANTS.setdefault(name, []).append(fn)
        return fn
    return register


# ----------------------------------------------------------------------------- 11: fa3_loop_time
@mutant("fa3_loop_time")
def loop_busiest_unit(g, s, n, overlap):  # perfect overlap: only pingpong's second warpgroup gets there
    return n * max(2 * g, s) if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_no_prologue(g, s, n, overlap):  # every block at the steady pace
    return n * (g + max(g, s)) if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_hides_whole_softmax(g, s, n, overlap):  # softmax under both GEMMs
    return 2 * g + s + (n - 1) * 2 * g if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_plain_two_stage(g, s, n, overlap):  # the two-stage pipeline of lesson 12, with the GEMMs as one stage
    return 2 * g + s + (n - 1) * max(2 * g, s) if overlap else n * (2 * g + s)


@mutant("fa3_loop_time")
def loop_forgets_last_pv(g, s, n, overlap):
    return g + s + (n - 1) * (g + max(g, s)) if overlap else n * (2 * g + s)


# ----------------------------------------------------------------------------- 12: tt_core_reads
def _reads(count_k, *, with_v=True, with_q=True):
    def reads(chunks, seq, d, q_chunk, k_chunk, causal):
        n_k = seq // k_chunk
        kv = sum(min(n_k, count_k(i, q_chunk, k_chunk)) if causal else n_k for i in chunks)
        return (len(chunks) * q_chunk * d * with_q + (1 + with_v) * kv * k_chunk * d, len(chunks) * q_chunk * d)
    return reads


_right = _reads(lambda i, q, k: ((i + 1) * q - 1) // k + 1)
MUTANTS["tt_core_reads"] = [
    _reads(lambda i, q, k: i + 1),  # K chunks 0..i: right only when q_chunk == k_chunk
    _reads(lambda i, q, k: (i + 1) * q // k),  # rounds the partly masked K chunk down
    _reads(lambda i, q, k: i * q // k + 1),  # the first row's keys, not the last row's
    _reads(lambda i, q, k: ((i + 1) * q - 1) // k + 1, with_v=False),  # forgets V
    _reads(lambda i, q, k: ((i + 1) * q - 1) // k + 1, with_q=False),  # forgets the Q chunk
    lambda chunks, seq, d, q, k, causal: (_right(chunks, seq, d, q, k, True)[0],
                                          len(chunks) * q * d),  # always causal
    lambda chunks, seq, d, q, k, causal: (_right(chunks, seq, d, q, k, causal)[0], seq * d),  # writes the whole O
]


# ---------------------------------------------------------------------------- 13: backward_memory
def _memory(*, lse_in_input_dtype=False, with_o=True, v_width_d=False, p_float32=False, p_square=False):
    def memory(B, H, nq, nk, d, dv, dtype):
        size = dtype.itemsize
        lse = size if lse_in_input_dtype else (8 if dtype == torch.float64 else 4)
        w = d if v_width_d else dv
        saved = B * H * (nq * d + nk * d + nk * w + with_o * nq * w) * size + B * H * nq * lse
        return saved, B * H * nq * (nq if p_square else nk) * (4 if p_float32 else size)
    return memory


MUTANTS["backward_memory"] = [
    _memory(lse_in_input_dtype=True),  # lse in float16 for float16 inputs
    _memory(with_o=False),  # forgets O
    _memory(v_width_d=True),  # V and O with d columns
    _memory(p_float32=True),  # P always float32
    _memory(p_square=True),  # P as Nq x Nq
]


@mutant("backward_memory")
def memory_in_numbers(B, H, nq, nk, d, dv, dtype):  # counts numbers, not bytes
    return B * H * (nq * d + nk * d + nk * dv + nq * dv + nq), B * H * nq * nk


# --------------------------------------------------------------------------- 13: cached_attention
@mutant("cached_attention")
def cached_top_left(q, k, v):  # is_causal=True: right only when Nq == Nk
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@mutant("cached_attention")
def cached_no_mask(q, k, v):  # right only for one new token
    return F.scaled_dot_product_attention(q, k, v)


@mutant("cached_attention")
def cached_pad_after(q, k, v):  # pads the queries on the wrong side: top-left again
    nq, nk = q.shape[-2], k.shape[-2]
    pad = torch.zeros(q.shape[:-2] + (nk - nq, q.shape[-1]), dtype=q.dtype)
    return F.scaled_dot_product_attention(torch.cat([q, pad], -2), k, v, is_causal=True)[..., :nq, :]


@mutant("cached_attention")
def cached_cache_only(q, k, v):  # new tokens see the cache but not each other (nor themselves)
    nq, nk = q.shape[-2], k.shape[-2]
    keep = nk - nq if nk > nq else nk
    return F.scaled_dot_product_attention(q, k[..., :keep, :], v[..., :keep, :])


@mutant("cached_attention")
def cached_float32(q, k, v):  # computes in float32 whatever the input
    nq, nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(q.dtype)


# ------------------------------------------------------------------------------ 14: decode_time
def _decode(*, qo=True, v=True, flops_per=4, combine=max):
    def decode_time(B, H, nq, nk, d, size, peak, bw):
        moved = B * H * ((2 * nq * d if qo else 0) + (2 if v else 1) * nk * d) * size
        t_mem, t_math = moved / bw, flops_per * B * H * nq * nk * d / peak
        return combine(t_mem, t_math), ("memory" if t_mem >= t_math else "compute")
    return decode_time


MUTANTS["decode_time"] = [
    _decode(qo=False),  # K and V only
    _decode(v=False),  # K only
    _decode(flops_per=2),  # one product only
    _decode(combine=lambda a, b: a + b),  # adds the two times
    lambda *args: (_decode()(*args)[0], "memory"),  # always memory-bound
    lambda B, H, nq, nk, d, size, peak, bw: (2 * B * H * (nq + nk) * d * size / bw, "memory"),  # bandwidth only
]


# ------------------------------------------------------------------------------------------ tests
SOLUTIONS = {name: load_exercise(stem)[name] for name, stem in LESSONS.items()}


def test_registered_with_their_lessons_and_three_mutants_each():
    assert all(EXERCISES[n].lesson == stem for n, stem in LESSONS.items())
    assert set(MUTANTS) == set(LESSONS) and all(len(MUTANTS[n]) >= 3 for n in LESSONS)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(LESSONS))
def test_solution_passes(name, seed):
    result = check(name, SOLUTIONS[name], seed=seed, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("name", sorted(LESSONS))
def test_blank_is_not_implemented(name):
    blank = load_exercise(LESSONS[name], keep=False)[name]
    assert check(name, blank, seed=0, quiet=True).status == "not implemented"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(LESSONS))
def test_mutants_fail_with_a_reason(name, seed):
    for i, fn in enumerate(MUTANTS[name]):
        result = check(name, fn, seed=seed, quiet=True)
        assert result.status == "failed", f"mutant {i} of {name} ({getattr(fn, '__name__', '')}) passed:\n{result}"
        assert result.message and result.hint, str(result)


@pytest.mark.parametrize("name, fn, words", [
    ("fa3_loop_time", loop_busiest_unit, "busiest unit"),
    ("fa3_loop_time", loop_no_prologue, "Before the loop"),
    ("tt_core_reads", MUTANTS["tt_core_reads"][0], "same length"),
    ("tt_core_reads", MUTANTS["tt_core_reads"][3], "V_j"),
    ("backward_memory", MUTANTS["backward_memory"][0], "float32"),
    ("backward_memory", MUTANTS["backward_memory"][1], "output O"),
    ("cached_attention", cached_top_left, "top-left"),
    ("cached_attention", cached_no_mask, "Only a single new token"),
    ("decode_time", MUTANTS["decode_time"][0], "Reading Q and writing O"),
    ("decode_time", MUTANTS["decode_time"][3], "not their sum"),
])
def test_usual_slips_are_named(name, fn, words):
    result = check(name, fn, seed=1, quiet=True)
    assert words in (result.hint or ""), str(result)


def test_fa3_loop_time_reference_is_the_closed_form(rng=np.random.default_rng(0)):
    """The checker's reference comes from flashlab.timeline's scheduler; it must match the schedule worked out
    by hand: QK_0 and softmax_0 alone, then g + max(g, s) per block, then PV_{n-1} alone."""
    from flashlab.grading.l11_fa3_ideas import loop_time

    for _ in range(50):
        g, s = rng.uniform(0.1, 5, 2)
        n = int(rng.integers(1, 12))
        assert loop_time(g, s, n, True) == pytest.approx(2 * g + s + (n - 1) * (g + max(g, s)))
        assert loop_time(g, s, n, False) == pytest.approx(n * (2 * g + s))
