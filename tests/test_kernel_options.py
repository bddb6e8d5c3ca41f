"""The FlashAttention library's options in the GPU kernels, as one matrix: variant (register, tensor, wgmma) x
direction (forward, backward) x option (window, bottom-right alignment, ALiBi per head and per batch, softcap,
dropout, all of them at once) x dtype, each cell against float64 in the simulator on fresh random inputs of ragged
lengths (Nq != Nk, not multiples of the tile), GQA where the case has it, a few blocks of 16 x 16 (the wgmma
backward: one block of 64, d = 64).

The forward is checked against flashlab.reference_attention (o, lse, and the rows that see no key: o = 0,
lse = +inf). The backward gets the float64 reference's o (rounded to the input type) and lse, so that a forward's
error can neither hide nor cause a backward one, and is checked against float64 gradients
(flashlab.flash_attention_v2_backward on those o and lse, itself tested against autograd). A mask off by one, a
lost softcap factor, a wrong ALiBi sign or a dropout mask drawn for another head is off by 1e-2 or more.

A cell a variant does not serve (the wgmma forward takes no option) is in the matrix too, as the check that the
call is refused with an error naming the variants that serve it. Select cells by id, e.g.
`-k "tensor and backward and softcap"`. The gpu-marked cells run the same cases at a few hundred rows and keys
with the planner's tiles, d 64 and 128 (bfloat16 too, as torch tensors, where the variant takes it); they are
skipped without a GPU.

Not here (not option x variant x direction against float64): dropout masks bit for bit and seeds
(test_kernel_dropout.py, test_tensor_dropout.py), builds counted as option values change
(test_backward_option_arguments.py), tiles outside the band never read (test_option_tile_skipping.py), argument
errors (test_option_errors.py), the prepared paths (test_prepared_options.py), the wgmma backward's deterministic
mode under options (test_wgmma_backward.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

import flashlab as fl
from flashlab.device import device_limits, has_gpu

kernels = pytest.importorskip("flashlab.kernels")
from flashlab.kernels import flash_attention, flash_attention_backward  # noqa: E402

BIG = 2 ** 40 + 11  # a seed whose high 32 bits are not 0: a seed cut to 32 bits draws another mask


class Case(NamedTuple):
    B: int
    H: int
    H_kv: int
    nq: int
    nk: int
    opts: dict
    splits: int | None = None  # the forward's key chunks (split-KV), None: the planner's
    empty: int = 0  # rows at the top that see no key (bottom-right with Nq > Nk)
    backward: bool = True  # False: a forward case only (its gradients are 0 but for dv)


# Every case's lengths are ragged for 16 x 16 tiles and fit one wgmma block (64 x 64). Where an option alone would
# leave a path untouched, a case adds it: a one-sided window with ALiBi (keys on both sides of a row, so |i - j|
# of both signs), split-KV with a window (chunks a row never sees) and with dropout (each chunk keys the mask by
# its own columns), the window's degenerate (0, 0).
CASES = {
    "window": [Case(1, 2, 1, 30, 41, dict(window_size=(5, 3)), splits=2),  # GQA, both sides bounded
               # each row sees only its own key (in the backward, dq = dk = 0: nothing to compare)
               Case(1, 1, 1, 24, 29, dict(window_size=(0, 0)), backward=False)],
    # causal, Nq > Nk: the first 21 rows see no key
    "bottom_right": [Case(1, 1, 1, 40, 19, dict(causal=True, align="bottom_right"), empty=21)],
    # one query head per slope under GQA; left bound only, no causal: keys on both sides of each row
    "alibi_head": [Case(1, 2, 1, 29, 40, dict(window_size=(8, -1), alibi_slopes=np.array([0.5, 0.125])))],
    # one slope per (batch, head): b * H + h, not h * B + b
    "alibi_batch": [Case(2, 2, 1, 21, 30, dict(causal=True, alibi_slopes=np.array([[0.5, 0.25], [0.125, 1.0]])))],
    "softcap": [Case(1, 1, 1, 25, 33, dict(softcap=1.5))],
    # the batch in the mask's key, causal bottom-right: 9 rows see no key
    "dropout": [Case(2, 1, 1, 30, 21, dict(dropout_p=0.3, seed=BIG, causal=True, align="bottom_right"), splits=2,
                     empty=9)],
    # everything at once, Nq < Nk bottom-right: the window's right (2) beyond causal's (0) is causal's; the query
    # head in the dropout mask's key (GQA: two query heads of one K/V head)
    "all": [Case(1, 2, 1, 20, 29, dict(causal=True, align="bottom_right", window_size=(9, 2), softcap=2.0,
                                       alibi_slopes=np.array([0.4, 0.2]), dropout_p=0.25, seed=2 ** 62 + 1),
                 splits=2)],
}
OPTIONS = list(CASES)
# What each option's cells check: without these arguments the reference moves by far more than any tolerance.
ARGUMENTS = {"window": ("window_size",), "bottom_right": ("align",), "alibi_head": ("alibi_slopes",),
             "alibi_batch": ("alibi_slopes",), "softcap": ("softcap",), "dropout": ("dropout_p", "seed"),
             "all": ("window_size", "align", "alibi_slopes", "softcap", "dropout_p", "seed")}

# The dtypes each (variant, direction) takes in the simulator (NumPy has no bfloat16: that runs on a GPU, below);
# None: the variant does not serve the direction's options, and the call must be refused.
DTYPES = {
    ("register", "forward"): ("f16", "f32"),
    ("register", "backward"): ("f16", "f32"),
    ("tensor", "forward"): ("f16", "f32"),  # f32: 3xTF32
    ("tensor", "backward"): ("f16", "f32"),
    ("wgmma", "forward"): None,
    ("wgmma", "backward"): ("f16",),  # d = 64, one block: the simulator emulates every Hopper instruction
}
NP = {"f16": np.float16, "f32": np.float32}
REFUSED = {("wgmma", "forward"): (NotImplementedError, r"run on variant='register' or 'tensor'")}

# Tolerances in the simulator: o's relative error, lse's largest absolute error, the gradients' relative error.
# 16-bit inputs, float32 accumulation and a 16-bit o or gradient: ~1e-3; float32: register FP32 units ~1e-6,
# 3xTF32 ~1e-7.
TOL = {
    ("register", "f32"): (2e-5, 1e-4, 1e-4), ("register", "f16"): (2e-3, 1e-3, 2e-3),
    ("tensor", "f32"): (1e-5, 1e-5, 1e-5), ("tensor", "f16"): (2e-3, 1e-3, 2e-3),
    ("wgmma", "f16"): (None, None, 2e-3),
}


def hopper_or_simulator() -> bool:
    """The wgmma kernels run in the simulator or on a GPU of compute capability 9.0."""
    if not has_gpu():
        return True
    cc = device_limits()["cc"]
    return cc is not None and tuple(cc) >= (9, 0)


NEEDS_HOPPER = pytest.mark.skipif(not hopper_or_simulator(), reason="wgmma needs compute capability 9.0")


def cells():
    for (variant, direction), dtypes in DTYPES.items():
        for option in OPTIONS:
            for dtype in dtypes or ("f16",):
                marks = [NEEDS_HOPPER] if variant == "wgmma" and direction == "backward" else []
                yield pytest.param(variant, direction, option, dtype, id=f"{variant}-{direction}-{option}-{dtype}",
                                   marks=marks)


def inputs(rng, case: Case, d: int, dtype):
    """q (scaled by 1.5: scores ~ 1.5, enough for softcap to bend them), k, v and do in dtype."""
    q = (1.5 * rng.standard_normal((case.B, case.H, case.nq, d))).astype(dtype)
    k, v = (rng.standard_normal((case.B, case.H_kv, case.nk, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((case.B, case.H, case.nq, d)).astype(dtype)
    return q, k, v, do


def f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def check_forward(q, k, v, case: Case, o, lse, tol, what):
    """o and lse against the float64 reference; the rows that see no key get o = 0 and lse = +inf."""
    o, lse = np.asarray(o, np.float64), np.asarray(lse)
    want_o, want_lse = fl.reference_attention(*f64(q, k, v), **case.opts)
    empty = np.isinf(want_lse)
    assert empty.sum() == case.B * case.H * case.empty and not empty[..., case.empty:].any(), \
        f"{what}: the case's rows without a key moved"  # the case is what it says
    assert np.array_equal(np.isinf(lse), empty), f"{what}: rows without a key {np.argwhere(np.isinf(lse) != empty)[:5]}"
    assert np.all(o[empty] == 0) and np.isfinite(o).all(), f"{what}: o is not 0 on rows without a key, or not finite"
    err, lse_err = fl.relative_error(o, want_o), np.max(np.abs(lse[~empty] - want_lse[~empty]))
    assert err < tol[0], f"{what}: o relative error {err:.2e} (tolerance {tol[0]:.0e})"
    assert lse_err < tol[1], f"{what}: lse error {lse_err:.2e} (tolerance {tol[1]:.0e})"
    if case.opts.get("dropout_p"):
        plain_lse = fl.reference_attention(*f64(q, k, v), **{**case.opts, "dropout_p": 0.0})[1]
        assert np.array_equal(want_lse, plain_lse)  # lse is dropout-free, so the kernel's (checked above) is too
        fa2_o = fl.flash_attention_v2(*f64(q, k, v), **case.opts)[0]  # NumPy FA2 drops the same elements
        assert fl.relative_error(o, fa2_o) < tol[0], f"{what}: o against NumPy FA2"


def assert_the_option_matters(q, k, v, case: Case, option, what):
    """The reference without the option's arguments is far from the one with them: the comparison is not
    vacuous."""
    without = {name: value for name, value in case.opts.items() if name not in ARGUMENTS[option]}
    moved = fl.relative_error(fl.reference_attention(*f64(q, k, v), **without)[0],
                              fl.reference_attention(*f64(q, k, v), **case.opts)[0])
    assert moved > 0.05, f"{what}: the reference moves by {moved:.2e} without {ARGUMENTS[option]}"


def expected_backward(q, k, v, do, case: Case):
    """(o, lse, [dq, dk, dv]) in float64 from the reference."""
    q, k, v, do = f64(q, k, v, do)
    o, lse = fl.reference_attention(q, k, v, **case.opts)
    assert np.isinf(lse).sum() == case.B * case.H * case.empty
    return o, lse, fl.flash_attention_v2_backward(q, k, v, o, lse, do, **case.opts)


def check_gradients(got, want, tol, what):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape and np.isfinite(g).all(), f"{what}: {name} has NaN or inf, or shape {g.shape}"
        err = fl.relative_error(g, w)
        assert err < tol, f"{what}: {name} relative error {err:.2e} (tolerance {tol:.0e})"


def run_forward(variant, q, k, v, case: Case, **tiles):
    return flash_attention(q, k, v, variant=variant, splits=case.splits, **tiles, **case.opts)


def run_backward(variant, q, k, v, o, lse, do, case: Case, **tiles):
    return flash_attention_backward(q, k, v, o, lse, do, variant=variant, **tiles, **case.opts)


@pytest.mark.parametrize("variant,direction,option,dtype", list(cells()))
def test_option_cell(rng, variant, direction, option, dtype):
    """One cell of the matrix: its cases against float64, or (a cell the variant does not serve) the refusal."""
    if DTYPES[variant, direction] is None:
        error, match = REFUSED[variant, direction]
        for case in CASES[option]:
            q, k, v, _ = inputs(rng, case, 64, NP[dtype])
            with pytest.raises(error, match=match) as refused:
                run_forward(variant, q, k, v, case)
            assert "window_size, align, alibi_slopes, softcap and dropout_p" in str(refused.value)
        return
    d = 64 if variant == "wgmma" else 16
    tiles = {} if variant == "wgmma" else dict(block_q=16, block_k=16)
    tol = TOL[variant, dtype]
    for case in CASES[option]:
        if direction == "backward" and not case.backward:
            continue
        what = f"{variant} {direction} {option} {dtype} {case.opts}"
        q, k, v, do = inputs(rng, case, d, NP[dtype])
        assert_the_option_matters(q, k, v, case, option, what)
        if direction == "forward":
            o, lse = run_forward(variant, q, k, v, case, **tiles)
            assert o.dtype == q.dtype and lse.dtype == np.float32
            check_forward(q, k, v, case, o, lse, tol, what)
        else:
            o, lse, want = expected_backward(q, k, v, do, case)
            got = run_backward(variant, q, k, v, o.astype(q.dtype), lse.astype(np.float32), do, case, **tiles)
            assert all(g.dtype == q.dtype for g in got)
            check_gradients(got, want, tol[2], what)


# ------------------------------------------------------------------------------------------- on a GPU
# The same cells at a few hundred rows and keys (GQA and the rows without a key kept), the planner's tiles, d 64
# and 128; 16-bit inputs as NumPy float16 or torch bfloat16 (the variants that take it), float32 as NumPy.
GPU_DTYPES = {
    ("register", "forward"): ("f16", "f32"),
    ("register", "backward"): ("f16", "f32"),
    ("tensor", "forward"): ("f16", "bf16", "f32"),
    ("tensor", "backward"): ("f16", "bf16", "f32"),
    ("wgmma", "backward"): ("f16", "bf16"),
}
GPU_TOL = {  # Nk ~ 500 keys of 16-bit rounding, lse ~ 8 from d = 128 products
    ("register", "f32"): (2e-5, 1e-4, 1e-4), ("register", "f16"): (1e-2, 1e-2, 2e-2),
    ("tensor", "f32"): (1e-5, 1e-4, 1e-4), ("tensor", "f16"): (3e-3, 1e-3, 3e-3),
    ("tensor", "bf16"): (2e-2, 1e-2, 2e-2),
    ("wgmma", "f16"): (None, None, 3e-3), ("wgmma", "bf16"): (None, None, 2e-2),
}
SCALE = 12  # rows and keys of a GPU case per simulated one


def gpu_cells():
    for (variant, direction) in GPU_DTYPES:
        for option in OPTIONS:
            yield pytest.param(variant, direction, option, id=f"{variant}-{direction}-{option}-gpu")


def on_gpu(x, dtype, as_dtype=None):
    """x (float64 NumPy) as the kernel takes it, in dtype's kind of array: NumPy float16 / float32, or a torch CUDA
    tensor for bfloat16 (of bfloat16, or of as_dtype: "f32" for lse)."""
    if dtype != "bf16":
        return x.astype(NP[as_dtype or dtype])
    import torch

    return torch.tensor(x, device="cuda", dtype=torch.float32 if as_dtype == "f32" else torch.bfloat16)


def as_f64(x):
    return x.double().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x, np.float64)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("variant,direction,option", list(gpu_cells()))
def test_option_cell_on_gpu(rng, variant, direction, option, d):
    if variant == "wgmma" and not hopper_or_simulator():
        pytest.skip("wgmma needs compute capability 9.0")
    for dtype in GPU_DTYPES[variant, direction]:
        if dtype == "bf16":
            pytest.importorskip("torch")
        tol = GPU_TOL[variant, dtype]
        for small in CASES[option]:
            if direction == "backward" and not small.backward:
                continue
            case = small._replace(nq=SCALE * small.nq, nk=SCALE * small.nk, empty=SCALE * small.empty)
            what = f"{variant} {direction} {option} {dtype} d={d} {case.opts}"
            q, k, v, do = (on_gpu(x, dtype) for x in inputs(rng, case, d, np.float64))
            if direction == "forward" and dtype == "bf16" and (case.splits or 1) > 1:
                # split-KV's merge writes float16 or float32: bfloat16 is refused, then runs unsplit
                with pytest.raises(ValueError, match=rf"splits={case.splits} does not apply to bfloat16"):
                    run_forward(variant, q, k, v, case)
                case = case._replace(splits=None)
            if direction == "forward":
                o, lse = run_forward(variant, q, k, v, case)
                check_forward(*map(as_f64, (q, k, v)), case, as_f64(o), as_f64(lse), tol, what)
            else:
                o, lse, want = expected_backward(*map(as_f64, (q, k, v, do)), case)
                got = run_backward(variant, q, k, v, on_gpu(o, dtype), on_gpu(lse, dtype, "f32"), do, case)
                check_gradients([as_f64(g) for g in got], want, tol[2], what)
