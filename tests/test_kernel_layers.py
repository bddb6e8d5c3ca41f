"""flashlab/kernels in layers: each module imports only from its own layer or the layers below, with no circle,
and never from inside a function (except torch, optional, with a comment that says so).

The layers, bottom up; flashlab/kernels/__init__.py's docstring describes them for a reader.
"""
import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "flashlab" / "kernels"
LAYERS = [
    ("constants, PTX intrinsics, host arrays", {"common", "mma", "_launch"}),
    ("the library's options and split-KV, as device functions", {"options", "split_kv"}),
    ("kernels: build and launch", {"shared", "register", "register_backward", "tensor", "tensor_backward", "decoding"}),
    ("planning: device facts, tiles, the plan", {"devices", "plan"}),
    ("prepared launches", {"prepared"}),
    ("entry points", {"forward", "backward", "varlen", "varlen_backward", "paged", "info", "demo", "__init__"}),
]
LAYER = {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}
MODULES = sorted(p.stem for p in KERNELS.glob("*.py"))


def sibling_imports(module):
    """[(imported sibling, line, inside a function?)] of one module of flashlab/kernels."""
    tree = ast.parse((KERNELS / f"{module}.py").read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level == 1 and child.module:  # from .x import ...
                    found.append((child.module.split(".")[0], child.lineno, in_function))
                elif child.level == 1:  # from . import x, y
                    found.extend((alias.name, child.lineno, in_function) for alias in child.names)
                elif (child.module or "").startswith("flashlab.kernels."):
                    found.append((child.module.split(".")[2], child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER), set(MODULES) ^ set(LAYER)


@pytest.mark.parametrize("module", MODULES)
def test_imports_flow_down(module):
    for target, line, _ in sibling_imports(module):
        assert LAYER[target] <= LAYER[module], \
            f"kernels/{module}.py:{line} imports {target} from a higher layer ({LAYERS[LAYER[target]][0]})"


@pytest.mark.parametrize("module", MODULES)
def test_no_function_local_sibling_imports(module):
    local = [(target, line) for target, line, in_function in sibling_imports(module) if in_function]
    assert not local, f"kernels/{module}.py imports siblings inside functions: {local}"


@pytest.mark.parametrize("module", MODULES)
def test_lazy_torch_imports_say_why(module):
    lines = (KERNELS / f"{module}.py").read_text().splitlines()
    bare = [i + 1 for i, text in enumerate(lines) if text.startswith(" ") and text.strip().startswith("import torch")
            and "#" not in text]
    assert not bare, f"kernels/{module}.py: lazy torch imports without a comment saying why, lines {bare}"


def test_no_circle():
    graph = {m: {t for t, _, _ in sibling_imports(m)} for m in MODULES}
    done, active = set(), []

    def walk(m):
        if m in active:
            raise AssertionError("import circle: " + " -> ".join(active[active.index(m):] + [m]))
        if m in done:
            return
        active.append(m)
        for t in sorted(graph[m]):
            walk(t)
        active.pop()
        done.add(m)

    for m in MODULES:
        walk(m)


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """The walker sees a function-local import and an upward one (a module written for the purpose)."""
    (tmp_path / "common.py").write_text("def f():\n    from .plan import plan\n")
    monkeypatch.setattr(__import__(__name__), "KERNELS", tmp_path)
    assert sibling_imports("common") == [("plan", 2, True)]
