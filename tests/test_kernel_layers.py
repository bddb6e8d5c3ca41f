"""flashlab/kernels in layers: each module imports only from its own layer or the layers below, with no circle,
and never from inside a function (except torch, optional, with a comment that says so).

The layers, bottom up; flashlab/kernels/__init__.py's docstring describes them for a reader.
"""
import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "flashlab" / "kernels"
LAYERS = [
    ("constants, PTX intrinsics, host arrays", {"common", "mma", "_launch", "hopper"}),
    ("the library's options and split-KV, as device functions", {"options", "split_kv"}),
    ("kernels: build and launch", {"shared", "register", "register_backward", "tensor", "tensor_backward", "wgmma",
                                    "wgmma_backward", "decoding"}),
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


def first_circle(graph):
    """One import circle of graph {node: {imported nodes}} as a list that ends where it starts, or None."""
    done, active = set(), []

    def walk(m):
        if m in active:
            raise AssertionError("import circle: " + " -> ".join(active[active.index(m):] + [m]))
        if m in done:
            return
        active.append(m)
        for t in sorted(graph.get(m, ())):
            walk(t)
        active.pop()
        done.add(m)

    try:
        for m in sorted(graph):
            walk(m)
    except AssertionError as circle:
        return str(circle)
    return None


def test_no_circle():
    circle = first_circle({m: {t for t, _, _ in sibling_imports(m)} for m in MODULES})
    assert circle is None, circle


PACKAGE = KERNELS.parent


def package_imports():
    """{part: {parts it imports}} over flashlab's modules and subpackages (a subpackage is one part), counting imports
    inside functions too: a lazy import still runs, and still makes a circle. flashlab/__init__.py and __main__.py
    are the package's face and entry point, above every part."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        if rel in (("__init__",), ("__main__",)):
            continue
        part, package = rel[0], ["flashlab", *rel[:-1]]
        targets = graph.setdefault(part, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - node.level + 1]
                names = [*base, *node.module.split(".")] if node.module else None
                if names is None:  # from . import a, b
                    targets.update(alias.name if len(base) == 1 else base[1] for alias in node.names)
                elif len(names) > 1:
                    targets.add(names[1])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashlab."):
                targets.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                targets.update(a.name.split(".")[1] for a in node.names if a.name.startswith("flashlab."))
        targets.discard(part)
    return graph


def test_no_circle_in_the_package():
    """Across flashlab (flashlab.device, flashlab.kernels, flashlab.viz, ...), function-local imports included."""
    graph = package_imports()
    assert {"device", "kernels", "checkup", "viz"} <= set(graph)
    assert "kernels" in graph["checkup"] and "device" in graph["kernels"]
    circle = first_circle(graph)
    assert circle is None, circle


def test_a_circle_is_found():
    assert first_circle({"device": {"gpu_limits"}, "gpu_limits": set()}) is None
    assert first_circle({"device": {"kernels"}, "kernels": {"device"}}) == "import circle: device -> kernels -> device"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """The walker sees a function-local import and an upward one (a module written for the purpose)."""
    (tmp_path / "common.py").write_text("def f():\n    from .plan import plan\n")
    monkeypatch.setattr(__import__(__name__), "KERNELS", tmp_path)
    assert sibling_imports("common") == [("plan", 2, True)]
