"""The forward kernels composed from steps (kernels/register.py, kernels/tensor.py): bodies that read as a list of
steps, builds keyed by the options' presence (a new window or slope set compiles nothing), and the float16 path
lesson 16 prints (tensor.float16_source) holding no other precision's or option's code."""
import ast
import inspect
import re
import textwrap

import numpy as np
import pytest

import flashlab as fl
from flashlab.kernels import register, tensor
from flashlab.kernels.options import Extras, Features
from flashlab.kernels.register import Tile
from flashlab.kernels.tensor import TensorTile


def body_lines(kernel) -> list:
    """The kernel body's lines (less its signature)."""
    return textwrap.dedent(inspect.getsource(kernel.py_func)).splitlines()[2:]


@pytest.mark.parametrize("kernel", [
    register.build(16, Tile(8, 8, 2, 4), True),
    register.build(16, Tile(8, 8, 2, 4, prefetch=True), True, split=True,
                   features=Features(True, True, True, True, 0.1)),
    tensor.build(16, TensorTile(1, 16), True, "f16"),
    tensor.build(16, TensorTile(1, 16), False, "3xtf32", split=True, features=Features(True, True, True, True, 0.1)),
], ids=["register", "register options", "tensor", "tensor options"])
def test_kernel_bodies_are_short_lists_of_steps(kernel):
    """At most 60 lines, and no branch on a build's flags: a precision's or option's variant is another step."""
    lines = body_lines(kernel)
    assert len(lines) <= 60, len(lines)
    tree = ast.parse(textwrap.dedent("\n".join(lines)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            flags = [n.id for n in ast.walk(node.test) if isinstance(n, ast.Name) and n.id.isupper()]
            assert not flags, f"the body branches on {flags}"


def test_float16_source_is_the_float16_path():
    src = tensor.float16_source()
    body = src.split("\n\n\n")[0]
    called = re.findall(r"\b([a-z_]+)\(", body)
    T, S = tensor.steps(64, tensor.choose_tile(64, "f16"), True, "f16")
    for name, fn in zip(tensor.Steps._fields, S):
        shown = tensor._source(fn) in src
        if tensor._does_nothing(fn):  # a step with nothing to do here: neither called nor shown
            assert not shown and name + "(" not in body.replace(f"= {name}(", ""), name
        else:
            assert name in called and shown, name
    for word in ("tf32", "TF32", "k8", "sm_75", "page", "PAGED", "varlen", "place_packed", "block_table", "capped",
                 "slopes[", "d_keep", "GQA", "hk =", "chunk_keys", "band_range", "heavy_first", "WINDOW", "SOFTCAP"):
        assert word not in src, word
    steps_text = src[len(body):]
    assert "dropout" not in steps_text
    assert tensor.float16_source("scores") == tensor._source(S.scores) and "mma16(" in tensor.float16_source("scores")
    assert "def mask_edges" in tensor.float16_source("mask")


def test_the_float16_steps_are_what_a_float16_build_runs(rng):
    """float16_source shows the steps of the build flash_attention launches for float16 (same functions)."""
    q, k, v = (rng.standard_normal((1, 1, 20, 16)).astype(np.float16) for _ in range(3))
    o, _ = fl.kernels.flash_attention(q, k, v, causal=True, variant="tensor")
    ro, _ = fl.reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    assert fl.relative_error(o.astype(np.float64), ro) < 2e-3
    T, S = tensor.steps(16, tensor.choose_tile(16, "f16"), True, "f16")
    assert S.scores.py_func.__name__ == "scores_16bit" and S.mask.py_func.__name__ == "mask_plain"


@pytest.mark.parametrize("variant", ["register", "tensor"])
def test_option_values_are_arguments_not_builds(rng, variant):
    """Another window, softcap or slope set reuses the build: only the options' presence is compiled in."""
    module = register if variant == "register" else tensor
    args = ((1, 2, 9, 16), (1, 2, 11, 16), 0.25, True) + ((Tile(8, 8, 2, 4),) if variant == "register" else
                                                            (TensorTile(1, 16), "f16"))
    a = module.launches(*args, extras=Extras(left=3, right=1, softcap=2.0, slopes=(0.5, 0.25)))
    b = module.launches(*args, extras=Extras(left=5, right=0, softcap=7.0, slopes=(0.1, 0.9)))
    assert a.launches[0].kernel is b.launches[0].kernel
    assert a.launches[0].args[-5:-1] != b.launches[0].args[-5:-1]
    assert np.allclose(b.host["slopes"], np.array([0.1, 0.9]) * fl.kernels.common.LOG2E)
    plain = module.launches(*args)
    assert plain.launches[0].kernel is not a.launches[0].kernel
    assert len(plain.launches[0].args) == len(a.launches[0].args)  # one signature: plain builds ignore the values


def test_bfloat16_on_an_old_gpu_names_what_works():
    with pytest.raises(ValueError, match="float16 inputs") as e:
        tensor.resolve_precision("bfloat16", None, (7, 5))
    assert "variant" not in str(e.value)


@pytest.mark.parametrize("which", ["register dkdv", "register dkdv options", "tensor main", "tensor main options"])
def test_backward_bodies_are_short_lists_of_steps(which):
    """The backward kernels read the same way: at most 60 lines, no branch on a build's flags."""
    from flashlab.kernels import register_backward, tensor_backward

    features = Features(True, True, True, True, 0.1) if "options" in which else Features()
    if which.startswith("register"):
        kernel = register_backward.make_kernels(16, 8, 16, 32, features=features)[1]
    else:
        kernel = tensor_backward.build(16, tensor_backward.choose_tile(16, "f16"), True, "f16", features=features)[1]
    test_kernel_bodies_are_short_lists_of_steps(kernel)
