"""Setup stays true: one dependency list mirrored in environment.yml, a light `import flashlab`, CI = README."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _req(spec):
    name, bound = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", spec.strip()).groups()
    return name.lower(), bound.replace(" ", "")


def pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        specs += [s for s in items if not s.startswith("flashlab")]
    return dict(_req(s) for s in specs)


def conda_requirements():
    deps = {}
    text = (ROOT / "environment.yml").read_text()
    for line in text[text.index("dependencies:"):].splitlines():
        m = re.match(r"^  - ([A-Za-z][^#]*)$", line)
        if m and not m.group(1).startswith(("python", "pip")):
            name, bound = _req(m.group(1))
            deps[CONDA_NAMES.get(name, name)] = bound
    return deps


def test_environment_yml_lists_the_same_packages_as_pyproject():
    assert conda_requirements() == pyproject_requirements()


def test_lower_bounds_do_not_exceed_what_colab_ships():
    # Colab's versions live in tests/colab_runtime/versions.toml (both images); torch is not pinned there (the
    # emulation links the test environment's), so its bound stays checked against 2.3 here.
    images = tomllib.loads((ROOT / "tests" / "colab_runtime" / "versions.toml").read_text())["images"]
    colab = {"torch": (2, 3)}
    for image in images.values():
        for spec in image["packages"]:
            if "==" in spec:
                name, version = spec.split("==")
                colab[name] = tuple(int(x) for x in version.split(".")[:2])
    reqs = pyproject_requirements()
    assert {"numpy", "numba", "numba-cuda", "ipywidgets", "matplotlib"} <= set(colab), colab
    for name, ceiling in colab.items():
        bound = tuple(int(x) for x in reqs[name].removeprefix(">=").split("."))
        assert bound <= ceiling, f"{name}{reqs[name]} in pyproject.toml, but Colab ships {ceiling}: pip would upgrade it"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"


def test_import_is_light_and_quick():
    code = (
        "import sys, time; t = time.perf_counter(); import flashlab; dt = time.perf_counter() - t;"
        "heavy = [m for m in ('numba', 'torch', 'matplotlib', 'ipywidgets') if m in sys.modules];"
        "print(dt, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert float(out[0]) < 1.0
    assert out[1].strip() == "[]", f"import flashlab pulled in {out[1]}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^make test$", ci, re.M)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "flashlab", "--help"], capture_output=True, text=True, check=True)
    assert "grade" in out.stdout and "build" in out.stdout
