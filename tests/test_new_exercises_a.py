"""The exercises added for lessons 02, 05, 06 and 09 (issue 10, "more practice"): each checker passes the
solution, grades the blank "not implemented", and rejects kept wrong solutions ("mutants") for several
seeds, naming the slip. The models behind the checkers are checked against flashlab's instrumented runs.
"""
import math

import numpy as np
import pytest

from conftest import EXERCISE_SOURCES, assert_rejected_naming_its_slip, load_exercise
from flashlab.device import has_gpu
from flashlab.grading import EXERCISES, check

NEW_EXERCISES = {"naive_peak_bytes": "02_naive_attention", "fa2_work": "05_fa2",
                 "recompute_tradeoff": "06_backward", "row_stats": "09_register_fa2"}
SEEDS = (1, 2, 3)
SOLUTIONS = {name: load_exercise(stem)[name] for name, stem in NEW_EXERCISES.items() if name != "row_stats"}
MUTANTS = {}  # exercise -> [(what the learner got wrong, function, words the verdict must contain)]


def mutant(name, says):
    def register(fn):
        MUTANTS.setdefault(name, []).append((fn.__doc__, fn, says))
        return fn
    return register


def _load_kernel(edits=(), keep=True):
    from test_kernel_exercises import load  # imported here: that module's tests are not collected twice

    return load("09_register_fa2", keep=keep, edits=edits)["build_row_stats"]


# -- 02: peak memory of naive attention ----------------------------------------------------------
def _inputs(Nq, Nk, d, dv):
    return Nq * d + Nk * d + Nk * dv


@mutant("naive_peak_bytes", "S and P alone")
def peak_s_and_p_only(B, H, Nq, Nk, d, dv, dtype):
    """counts S and P, forgets the inputs and O"""
    return B * H * dtype.itemsize * 2 * Nq * Nk


@mutant("naive_peak_bytes", "S can be freed")
def peak_never_frees(B, H, Nq, Nk, d, dv, dtype):
    """keeps S until the end"""
    return B * H * dtype.itemsize * (_inputs(Nq, Nk, d, dv) + 2 * Nq * Nk + Nq * dv)


@mutant("naive_peak_bytes", "step 3 holds more")
def peak_step2_only(B, H, Nq, Nk, d, dv, dtype):
    """assumes the softmax step is always the peak"""
    return B * H * dtype.itemsize * (_inputs(Nq, Nk, d, dv) + 2 * Nq * Nk)


@mutant("naive_peak_bytes", "B * H")
def peak_one_head(B, H, Nq, Nk, d, dv, dtype):
    """one head only"""
    return dtype.itemsize * (_inputs(Nq, Nk, d, dv) + Nq * Nk + max(Nq * Nk, Nq * dv))


@mutant("naive_peak_bytes", "4-byte")
def peak_float32_always(B, H, Nq, Nk, d, dv, dtype):
    """4 bytes per element whatever the dtype"""
    return B * H * 4 * (_inputs(Nq, Nk, d, dv) + Nq * Nk + max(Nq * Nk, Nq * dv))


@mutant("naive_peak_bytes", "width dv")
def peak_dv_is_d(B, H, Nq, Nk, d, dv, dtype):
    """V and O of width d"""
    return B * H * dtype.itemsize * (_inputs(Nq, Nk, d, d) + Nq * Nk + max(Nq * Nk, Nq * d))


# -- 05: the work of FA2's grid ------------------------------------------------------------------
def _visits(i, Nq, Nk, bq, bk, causal):
    n = math.ceil(Nk / bk)
    return min(n, (min((i + 1) * bq, Nq) - 1) // bk + 1) if causal else n


def _work(B, H, Nq, Nk, d, bq, bk, causal, *, full_rows=False, padded_keys=False, skip=True, matmuls=2):
    tr = math.ceil(Nq / bq)
    flops = 0
    for i in range(tr):
        rows = bq if full_rows else min((i + 1) * bq, Nq) - i * bq
        keys = _visits(i, Nq, Nk, bq, bk, causal and skip) * bk
        flops += 2 * matmuls * d * rows * (keys if padded_keys else min(keys, Nk))
    return B * H * tr, B * H * flops


@mutant("fa2_work", "FA1's grid")
def work_fa1_grid(B, H, Nq, Nk, d, bq, bk, causal):
    """one thread block per (batch, head)"""
    return B * H, _work(B, H, Nq, Nk, d, bq, bk, causal)[1]


@mutant("fa2_work", "half of the full count")
def work_ideal_half(B, H, Nq, Nk, d, bq, bk, causal):
    """the benchmark convention: causal is half the full work"""
    return B * H * math.ceil(Nq / bq), 4 * B * H * Nq * Nk * d // (2 if causal else 1)


@mutant("fa2_work", "only the scores the mask keeps")
def work_exact_mask(B, H, Nq, Nk, d, bq, bk, causal):
    """counts only unmasked scores"""
    keys = sum(min(r + 1, Nk) for r in range(Nq)) if causal else Nq * Nk
    return B * H * math.ceil(Nq / bq), 4 * B * H * d * keys


@mutant("fa2_work", "counts one matmul")
def work_one_matmul(B, H, Nq, Nk, d, bq, bk, causal):
    """forgets P V"""
    return _work(B, H, Nq, Nk, d, bq, bk, causal, matmuls=1)


@mutant("fa2_work", "last query block")
def work_full_rows(B, H, Nq, Nk, d, bq, bk, causal):
    """the last query block counted as full"""
    return _work(B, H, Nq, Nk, d, bq, bk, causal, full_rows=True)


@mutant("fa2_work", "last key block")
def work_padded_keys(B, H, Nq, Nk, d, bq, bk, causal):
    """the last key block counted as full"""
    return _work(B, H, Nq, Nk, d, bq, bk, causal, padded_keys=True)


@mutant("fa2_work", "skips the key blocks")
def work_no_skipping(B, H, Nq, Nk, d, bq, bk, causal):
    """no causal block skipping"""
    return _work(B, H, Nq, Nk, d, bq, bk, causal, skip=False)


# -- 06: recompute or store ----------------------------------------------------------------------
def _tradeoff(Nq, Nk, d, bk, b, peak, bw, *, p_moves=2, lse_reads=None, lse_bytes=4, matmuls=1, flop_per_fma=2,
              reverse=False):
    flops = flop_per_fma * matmuls * Nq * Nk * d
    reads = math.ceil(Nk / bk) if lse_reads is None else lse_reads
    saved = p_moves * Nq * Nk * b - lse_bytes * (Nq + reads * Nq)
    wins = flops / peak < saved / bw
    return flops, saved, (not wins) if reverse else wins


@mutant("recompute_tradeoff", "reads P twice")
def trade_p_read_twice(Nq, Nk, d, bk, b, peak, bw):
    """P read twice, as in the unfused backward"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, p_moves=3)


@mutant("recompute_tradeoff", "its write in the forward")
def trade_no_p_write(Nq, Nk, d, bk, b, peak, bw):
    """storing P costs only its read"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, p_moves=1)


@mutant("recompute_tradeoff", "moves lse instead")
def trade_no_lse(Nq, Nk, d, bk, b, peak, bw):
    """lse traffic forgotten"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, lse_bytes=0)


@mutant("recompute_tradeoff", "once per key block")
def trade_lse_read_once(Nq, Nk, d, bk, b, peak, bw):
    """lse read once, not with every tile"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, lse_reads=1)


@mutant("recompute_tradeoff", "float32 (4 bytes)")
def trade_lse_input_dtype(Nq, Nk, d, bk, b, peak, bw):
    """lse in the inputs' dtype"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, lse_bytes=b)


@mutant("recompute_tradeoff", "two products")
def trade_two_matmuls(Nq, Nk, d, bk, b, peak, bw):
    """counts the forward's two products"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, matmuls=2)


@mutant("recompute_tradeoff", "multiply-add is 2 FLOPs")
def trade_one_flop_per_fma(Nq, Nk, d, bk, b, peak, bw):
    """one FLOP per multiply-add"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, flop_per_fma=1)


@mutant("recompute_tradeoff", "recompute_wins is")
def trade_reversed(Nq, Nk, d, bk, b, peak, bw):
    """the comparison the wrong way round"""
    return _tradeoff(Nq, Nk, d, bk, b, peak, bw, reverse=True)


# -- 09: row statistics through shared memory (source edits of the solution, run in the simulator) ----
def _solution_body(function):
    """The solution lines of `function` in the lesson 09 exercise source, as the solution notebook has them."""
    source = (EXERCISE_SOURCES / "09_register_fa2.py").read_text()
    body = source[source.index(f"def {function}("):]
    body = body[body.index("### BEGIN SOLUTION\n") + len("### BEGIN SOLUTION\n"):body.index("### END SOLUTION")]
    return body[:body.rindex("\n") + 1]


GLOBAL_ROWS = """        for i in range(RM):
            r = min(q0 + ty * RM + i, n_q - 1)
            mx = s[r, 0]
            for c in range(1, n_k):
                mx = max(mx, s[r, c])
            total = float32(0.0)
            for c in range(n_k):
                total += math.exp(s[r, c] - mx)
            m_row[i] = mx
            l_row[i] = total
"""
KERNEL_MUTANTS = [  # (what the learner got wrong, edits, words the verdict must contain, needs the race check)
    ("no barrier after writing the partial maxima",
     [("        cuda.syncthreads()  # every partial max is in red\n", "")], "hazard", True),
    ("no barrier before the partial sums overwrite the maxima",
     [("        cuda.syncthreads()  # every thread has read the maxima: red may be reused\n", "")], "hazard", True),
    ("each thread keeps its own max",
     [("            for t2 in range(1, tc):\n                mx = max(mx, red[t2, ty * RM + i])\n", ""),
      ("mx = red[0, ty * RM + i]", "mx = red[tx, ty * RM + i]")], "combine the tc partial maxima", False),
    ("each thread keeps its own sum",
     [("            for t2 in range(tc):\n                total += red[t2, ty * RM + i]",
       "            total += red[tx, ty * RM + i]")], "partial sums", False),
    ("one slot per thread row, not per row of the tile",
     [("red[tx, ty * RM + i] = mx", "red[tx, ty] = mx"), ("red[0, ty * RM + i]", "red[0, ty]"),
      ("red[t2, ty * RM + i])", "red[t2, ty])")], "m is wrong", False),
    ("exponents not relative to the max",
     [("part += math.exp(sc[i, j] - m_row[i])", "part += math.exp(sc[i, j])")], "wrong", False),
    ("the whole row read from global memory, nothing shared", [(_solution_body("build_row_stats"), GLOBAL_ROWS)],
     "no thread wrote shared memory", True),
]


# ------------------------------------------------------------------------------------------------
def test_every_new_exercise_is_registered_and_has_three_mutants():
    for name, stem in NEW_EXERCISES.items():
        assert name in EXERCISES and EXERCISES[name].lesson == stem
    assert set(MUTANTS) == set(NEW_EXERCISES) - {"row_stats"}
    assert all(len(m) >= 3 for m in MUTANTS.values()) and len(KERNEL_MUTANTS) >= 3


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_solution_passes(name, seed):
    result = check(name, SOLUTIONS[name], seed=seed, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("name", sorted(NEW_EXERCISES))
def test_blank_is_not_implemented(name):
    blank = _load_kernel(keep=False) if name == "row_stats" else load_exercise(NEW_EXERCISES[name], keep=False)[name]
    assert check(name, blank, seed=0, quiet=True).status == "not implemented"


@pytest.mark.parametrize("name,label,fn,says", [(n, lab, fn, says) for n, ms in MUTANTS.items() for lab, fn, says in ms],
                         ids=[f"{n}: {lab}" for n, ms in MUTANTS.items() for lab, _, _ in ms])
def test_mutant_is_rejected_with_its_slip_named(name, label, fn, says):
    assert_rejected_naming_its_slip(name, fn, label, says, SEEDS)


def test_row_stats_solution_passes():
    for seed in (1, 2):
        result = check("row_stats", _load_kernel(), seed=seed, quiet=True)
        assert result.passed, str(result)
        assert result.seconds < 30, f"row_stats took {result.seconds:.1f} s to grade"


@pytest.mark.parametrize("label,edits,says,sim_only", KERNEL_MUTANTS, ids=[m[0] for m in KERNEL_MUTANTS])
def test_row_stats_mutant_is_rejected(label, edits, says, sim_only):
    if sim_only and has_gpu():
        pytest.skip("found by the simulator's race check and shared-memory counts")
    from flashlab.build import strip_solutions

    source = strip_solutions((EXERCISE_SOURCES / "09_register_fa2.py").read_text(), True)
    for old, _ in edits:
        assert old in source, f"mutant {label!r}: the solution no longer contains {old!r}"
    for seed in (1, 2):
        result = check("row_stats", _load_kernel(edits), seed=seed, quiet=True)
        assert result.status == "failed", f"mutant {label!r} passed with seed {seed}"
        assert says in str(result), f"mutant {label!r}: the verdict does not say {says!r}:\n{result}"


# -- the models behind the checkers, against flashlab's instrumented runs ------------------------
@pytest.mark.parametrize("nq,nk,bq,bk,causal", [(37, 37, 8, 8, True), (37, 20, 8, 6, True), (13, 40, 4, 16, False),
                                                (50, 50, 16, 4, True), (9, 9, 32, 32, True)])
def test_fa2_flop_count_matches_the_instrumented_forward(nq, nk, bq, bk, causal):
    from flashlab import HBMModel, flash_attention_v2
    from flashlab.grading.l05_fa2 import fa2_matmul_flops

    rng = np.random.default_rng(nq * nk + bq)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (nq, nk, nk))
    io = HBMModel(M=None)
    flash_attention_v2(q, k, v, causal=causal, block_q=bq, block_k=bk, io=io)
    assert io.matmul_flops == 2 * 3 * fa2_matmul_flops(nq, nk, 8, bq, bk, causal)


@pytest.mark.parametrize("nq,nk,bk", [(24, 40, 16), (7, 33, 8), (16, 16, 64)])
def test_lse_traffic_of_the_tradeoff_matches_the_instrumented_backward(nq, nk, bk):
    from flashlab import HBMModel, flash_attention_v2, flash_attention_v2_backward
    from flashlab.grading.l06_backward import recompute_tradeoff

    rng = np.random.default_rng(nq + nk)
    q, k, v, do = (rng.standard_normal((n, 8)) for n in (nq, nk, nk, nq))
    fwd, bwd = HBMModel(M=None), HBMModel(M=None)
    o, lse = flash_attention_v2(q, k, v, block_q=8, block_k=bk, io=fwd)
    flash_attention_v2_backward(q, k, v, o, lse, do, block_q=8, block_k=bk, io=bwd)
    lse_elements = fwd.writes["lse"] + bwd.reads["lse"]
    _, saved, _ = recompute_tradeoff(nq, nk, 8, bk, 2, 1e12, 1e12)
    assert saved == 2 * nq * nk * 2 - 4 * lse_elements


def test_naive_peak_is_the_busiest_step():
    """The closed form against a step-by-step walk over what is allocated (lesson 02's three kernels)."""
    from flashlab.grading.l02_naive_attention import naive_peak_elements

    rng = np.random.default_rng(0)
    for _ in range(50):
        nq, nk, d, dv = (int(x) for x in rng.integers(1, 300, 4))
        size = {"Q": nq * d, "K": nk * d, "V": nk * dv, "S": nq * nk, "P": nq * nk, "O": nq * dv}
        steps = [({"Q", "K"}, "S"), ({"S"}, "P"), ({"P", "V"}, "O")]  # (reads, writes)
        live, peak = {"Q", "K", "V"}, 0
        for n, (reads, out) in enumerate(steps):
            live.add(out)
            peak = max(peak, sum(size[a] for a in live))
            later = set().union(*(r for r, _ in steps[n + 1:])) | {"Q", "K", "V", "O"}
            live = {a for a in live if a in later}
        assert naive_peak_elements(nq, nk, d, dv) == peak
