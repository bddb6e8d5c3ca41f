"""Checkers of lessons 13 and 14 accept the solutions and reject plausible wrong ones ("mutants")."""

import numpy as np
import pytest

import flashlab
from flashlab.grading import EXERCISES, check
from conftest import load_exercise

torch = pytest.importorskip("torch")

SEEDS = (1, 2, 3)
NAMES = ("attention_function", "chunk_partial", "merge_partials")




MUTANTS = {}


def mutant(name):
    def register(fn):
        MUTANTS.setdefault(name, []).append(fn)
        return fn
    return register


# ------------------------------------------------------------------------------ 13: attention_function
def _function(forward_extra=None, backward=None, causal_fwd=None, save_p=False, scale=None):
    """An autograd Function built from the library, with one thing changed."""

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal):
            c = is_causal if causal_fwd is None else causal_fwd
            qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
            o, lse = flashlab.flash_attention_v2(qn, kn, vn, causal=c, scale=scale)
            o, lse = torch.from_numpy(o), torch.from_numpy(lse)
            saved = [q, k, v, o, lse]
            if save_p:
                S = torch.from_numpy(qn @ np.swapaxes(kn, -1, -2) / np.sqrt(qn.shape[-1]))
                saved.append(torch.softmax(S, -1))
            ctx.save_for_backward(*saved)
            ctx.is_causal = is_causal
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = (x.detach().numpy() for x in ctx.saved_tensors[:5])
            g = flashlab.flash_attention_v2_backward(q, k, v, o, lse, do.numpy(), causal=ctx.is_causal)
            g = [torch.from_numpy(x) for x in g]
            return (*(backward(g) if backward else g), None)

    return lambda q, k, v, is_causal: F.apply(q, k, v, is_causal)


MUTANTS["attention_function"] = [
    _function(save_p=True),  # keeps the N x N probabilities for the backward
    _function(backward=lambda g: (g[1], g[0], g[2]) if g[0].shape == g[1].shape else (g[0], g[0][..., :1, :].expand_as(g[1]), g[2])),  # dq/dk mixed up
    _function(causal_fwd=False),  # forward ignores is_causal
    _function(backward=lambda g: (g[0] * 0, g[1], g[2])),  # forgets dq
    _function(scale=1.0),  # no 1/sqrt(d) in the forward
]


@mutant("attention_function")
def plain_torch_attention(q, k, v, is_causal):  # right numbers, but keeps S and P through autograd
    d = q.shape[-1]
    S = q @ k.transpose(-1, -2) / d ** 0.5
    if is_causal:
        S = S.masked_fill(~torch.ones(S.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(S, -1) @ v


# ----------------------------------------------------------------------------------- 14: chunk_partial
def _cp(q, k_c, v_c, scale, *, normalise=False, subtract=True, use_scale=True):
    ct = np.float64 if q.dtype == np.float64 else np.float32
    S = q.astype(ct) @ k_c.astype(ct).T * (ct(scale) if use_scale else 1)
    m = S.max(axis=-1)
    P = np.exp(S - m[:, None]) if subtract else np.exp(S)
    l, O = P.sum(-1), P @ v_c.astype(ct)
    return m, l, (O / l[:, None] if normalise else O)


MUTANTS["chunk_partial"] = [
    lambda q, k, v, s: _cp(q, k, v, s, normalise=True),  # O already divided by l
    lambda q, k, v, s: _cp(q, k, v, s, subtract=False),  # exp(S) without the max: overflows
    lambda q, k, v, s: _cp(q, k, v, s, use_scale=False),  # forgot the scale
    lambda q, k, v, s: (lambda m, l, O: (m, l, O.astype(np.float16)))(*_cp(q, k, v, s)),  # O in float16
]


@mutant("chunk_partial")
def chunk_partial_column_max(q, k_c, v_c, scale):  # max over the wrong axis
    S = q.astype(np.float64) @ k_c.astype(np.float64).T * scale
    m = np.broadcast_to(S.max(), S.shape[:1]).copy()
    P = np.exp(S - m[:, None])
    return m, P.sum(-1), P @ v_c


# ---------------------------------------------------------------------------------- 14: merge_partials
@mutant("merge_partials")
def merge_without_rescaling(m, l, O):  # adds states relative to different maxima
    l_all = l.sum(0)
    return O.sum(0) / l_all[:, None], m.max(0) + np.log(l_all)


@mutant("merge_partials")
def merge_rescales_l_only(m, l, O):
    w = np.exp(m - m.max(0))
    l_all = (w * l).sum(0)
    return O.sum(0) / l_all[:, None], m.max(0) + np.log(l_all)


@mutant("merge_partials")
def merge_averages_normalised_chunks(m, l, O):  # mean of the chunks' own outputs, ignoring their weights
    return (O / l[..., None]).mean(0), m.max(0) + np.log((np.exp(m - m.max(0)) * l).sum(0))


@mutant("merge_partials")
def merge_lse_without_log(m, l, O):
    w = np.exp(m - m.max(0))
    l_all = (w * l).sum(0)
    return (w[..., None] * O).sum(0) / l_all[:, None], m.max(0) + l_all


@mutant("merge_partials")
def merge_without_max(m, l, O):  # exp(m_c) overflows when chunks' maxima are large
    w = np.exp(m)
    l_all = (w * l).sum(0)
    with np.errstate(all="ignore"):
        return (w[..., None] * O).sum(0) / l_all[:, None], np.log(l_all)


# ------------------------------------------------------------------------------------------------ tests
SOLUTIONS = {"attention_function": load_exercise("13_real_model")["attention_function"],
             **{n: load_exercise("14_decoding")[n] for n in ("chunk_partial", "merge_partials")}}


def test_registered_with_lessons_and_three_mutants_each():
    assert all(EXERCISES[n].lesson in ("13_real_model", "14_decoding") for n in NAMES)
    assert set(MUTANTS) == set(NAMES) and all(len(MUTANTS[n]) >= 3 for n in NAMES)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name, seed):
    result = check(name, SOLUTIONS[name], seed=seed, quiet=True)
    assert result.passed, str(result)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", NAMES)
def test_mutants_fail(name, seed):
    for i, fn in enumerate(MUTANTS[name]):
        result = check(name, fn, seed=seed, quiet=True)
        assert result.status == "failed", f"mutant {i} of {name} ({getattr(fn, '__name__', '')}) passed:\n{result}"
        assert result.message


@pytest.mark.parametrize("stem,name", [("13_real_model", "attention_function"), ("14_decoding", "chunk_partial"),
                                       ("14_decoding", "merge_partials")])
def test_blank_is_not_implemented(stem, name):
    assert check(name, load_exercise(stem, keep=False)[name], seed=0, quiet=True).status == "not implemented"
