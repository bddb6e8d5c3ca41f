"""scripts/browser_check.py finds every explorer from the sources (the browser run itself is a script)."""
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

from flashlab import viz

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("browser_check", ROOT / "scripts" / "browser_check.py")
browser_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(browser_check)


def test_every_explorer_in_the_package_is_found():
    names = browser_check.explorer_names()
    modules = [importlib.import_module(f"flashlab.viz.{m.name}") for m in pkgutil.iter_modules(viz.__path__)]
    public = {name for mod in modules for name, _ in inspect.getmembers(mod, inspect.isfunction)
              if name.endswith("_explorer")}
    assert public and public <= names, public - names
    assert "explore" in names and "plot_block_heatmap" not in names


def test_notebooks_that_call_an_explorer_are_found():
    found = browser_check.explorer_notebooks()
    for path, names in found.items():
        code = path.read_text()
        assert all(f"{name}(" in code for name in names), (path, names)
    lessons = {p.name for p in found}
    assert {"04_tiling_fa1.ipynb", "05_fa2.ipynb"} <= lessons
    calling = {p.name for p in (ROOT / "notebooks").glob("*.ipynb") if "_explorer(" in p.read_text()}
    assert calling <= lessons
