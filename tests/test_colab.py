"""Google Colab, for real: the setup cell, the package data, and every lesson and exercise in Colab's runtimes.

Most learners open the course in Colab, where the setup cell installs flashlab with `--no-deps` over Colab's own
packages. The emulation (tests/colab_runtime/emulate.py) rebuilds both of Colab's runtimes from
tests/colab_runtime/versions.toml, installs the built wheel there, runs the setup cell as Colab would and every
lesson and exercise notebook in the fast mode, from a folder outside the repository, and in the GPU image checks
that the prepared launch path's kernel arguments are the ones its numba-cuda builds (tests/marshal_check.py). It
needs PyPI (as `make test` does to build .venv/); the other tests here are quick and need nothing.
"""
import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flashlab import build

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "colab_runtime"))
import emulate  # noqa: E402

# The files lessons read that are copies of recorded benchmark results (docs/contributing.md).
RESULT_COPIES = ("forward.csv", "suite.csv", "host.csv", "decoding.md", "varlen.json")
DATA_SUFFIXES = (".csv", ".json", ".md", ".txt", ".npz", ".npy")
# Two notebooks at a time even beside another pytest worker: much of a notebook's time is a kernel starting and
# waiting, and these runs have no time limit to keep (tests/test_notebooks.py times the fast mode).
WORKERS = 2


# ------------------------------------------------------------------------------------------------ versions
def test_the_versions_file_pins_colabs_packages():
    v = emulate.versions()
    assert v["python"].startswith("3.")
    for image in ("gpu", "cpu"):
        pins = dict(p.split("==") for p in v["images"][image] if "==" in p)
        assert {"numpy", "numba", "ipywidgets", "matplotlib"} <= set(pins), (image, pins)
        assert pins["ipywidgets"].startswith("7."), "Colab's ipywidgets is 7.x: the explorers must draw with it"
    assert [p for p in v["images"]["gpu"] if p.startswith("numba-cuda==")]
    assert not [p for p in v["images"]["cpu"] if p.startswith("numba-cuda")]


def test_a_versions_file_without_both_images_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "versions.toml"
    bad.write_text('python = "3.12"\n[images.gpu]\npackages = ["numpy==2.1.3"]\n')
    monkeypatch.setattr(emulate, "VERSIONS", bad)
    with pytest.raises(ValueError, match=r"expected \[images.gpu\] and \[images.cpu\]"):
        emulate.versions()


# ---------------------------------------------------------------------------------------------- setup cell
def test_the_setup_cell_is_plain_python_pinned_to_the_release():
    code = build.setup_code()
    ast.parse(code)  # no IPython magics: it runs, and is tested, anywhere
    assert build.published_source() in code and f"github.com/{build.REPO}" in code and build.REF in code
    assert "--no-deps" in code and "%pip" not in code


def _run_setup(code, cwd):
    script = "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\n" + code
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_an_unreachable_source_stops_the_setup_cell_with_what_to_do(tmp_path):
    missing = tmp_path / "nowhere" / "flashlab-0.0.0.zip"
    done = _run_setup(build.setup_code(source=str(missing)), tmp_path)
    assert done.returncode != 0, done.stdout
    err = done.stderr
    assert err.count("Traceback") == 1 and "pip._internal" not in err, err  # one short error, not pip's
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: flashlab could not be installed from {missing}"), last
    for what in ("published copy", f"github.com/{build.REPO}", build.REF, "upload the course", "zip",
                 "run this cell again"):
        assert what in last, f"the message does not say {what!r}: {last}"
    assert "flashlab doctor" not in done.stdout  # it stopped before importing flashlab


def test_the_setup_cell_installs_an_uploaded_copy_first(tmp_path):
    (tmp_path / "flashlab-upload.whl").write_text("not a wheel")  # pip must be handed the upload, not the URL
    done = _run_setup(build.setup_code(), tmp_path)
    assert done.returncode != 0
    assert "could not be installed from flashlab-upload.whl" in done.stderr.strip().splitlines()[-1]


def test_release_restamps_every_badge_and_setup_cell(tmp_path, monkeypatch):
    source = tmp_path / "build.py"
    source.write_text(Path(build.__file__).read_text())
    monkeypatch.setattr(build, "REPO", build.REPO)  # restored afterwards: set_release changes the module too
    monkeypatch.setattr(build, "REF", build.REF)
    build.set_release("someone/attention-course", "v9.9.9", path=source)
    text = source.read_text()
    assert 'REPO = "someone/attention-course"' in text and 'REF = "v9.9.9"' in text
    notebooks = build.targets(ROOT)
    assert len(notebooks) > 40
    for path, nb in notebooks.items():
        assert "github/someone/attention-course/blob/v9.9.9/" in nb, path
        assert "git+https://github.com/someone/attention-course@v9.9.9" in nb, path
        assert "flashlab-course/flashlab" not in nb, path


@pytest.mark.parametrize("value, message", [("no-tag", "OWNER/NAME@TAG"), ("a b/c@v1", "OWNER/NAME"),
                                            ("owner/name@bad tag", "git tag")])
def test_release_refuses_a_malformed_address(value, message, capsys, monkeypatch, tmp_path):
    copy = tmp_path / "build.py"  # where a wrong acceptance would write, instead of the real build.py
    copy.write_text(Path(build.__file__).read_text())
    real = build.set_release
    monkeypatch.setattr(build, "set_release", lambda repo, ref: real(repo, ref, path=copy))
    monkeypatch.setattr(build, "REPO", build.REPO)
    monkeypatch.setattr(build, "REF", build.REF)
    assert build.main(["--release", value]) == 2
    assert message in capsys.readouterr().err
    assert copy.read_text() == Path(build.__file__).read_text()


# -------------------------------------------------------------------------------------------- package data
@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return emulate.build_wheel(tmp_path_factory.mktemp("wheel"))


def _data_constants():
    """Module-level Path constants of the package that name a data file: what lessons and figures load."""
    import importlib
    import pkgutil

    import flashlab

    found = {}
    for info in pkgutil.walk_packages(flashlab.__path__, "flashlab."):
        if info.name.split(".")[-1] in ("torch", "gpt") or ".ring" in info.name:
            continue  # need torch to import; checked by name below
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, Path) and value.suffix in DATA_SUFFIXES:
                found[f"{info.name}.{name}"] = value
    from flashlab.gpt import BF16_JSON

    found["flashlab.gpt.BF16_JSON"] = BF16_JSON
    return found


def test_every_data_file_the_lessons_read_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = ROOT / "flashlab" / "data"
    for path in sorted(data.iterdir()):
        assert f"flashlab/data/{path.name}" in names, f"{path.name} is not in {wheel.name}"
    constants = _data_constants()
    assert len(constants) >= 10, constants
    for name, path in constants.items():
        assert path.parent == data, f"{name} = {path}: lessons read data from flashlab/data/ only"
        assert f"flashlab/data/{path.name}" in names, f"{name}: {path.name} is not in {wheel.name}"


@pytest.mark.parametrize("name", RESULT_COPIES)
def test_the_lessons_copy_of_a_result_matches_it(name):
    copy, result = ROOT / "flashlab" / "data" / name, ROOT / "benchmarks" / "results" / name
    assert copy.read_bytes() == result.read_bytes(), (
        f"flashlab/data/{name} differs from benchmarks/results/{name}: copy the new run over "
        f"(cp benchmarks/results/{name} flashlab/data/)")


# ----------------------------------------------------------------------------------------- the emulation
@pytest.fixture(scope="module")
def colab(tmp_path_factory, wheel):
    """The CPU image's environment, with the setup cell run; the GPU test adds numba-cuda to it."""
    work = tmp_path_factory.mktemp("colab")
    python = emulate.make_env("cpu", work / "env")
    return {"work": work, "python": python, "wheel": wheel}


def _emulate(colab, image):
    work, python, wheel = colab["work"], colab["python"], colab["wheel"]
    content = work / f"content-{image}"
    setup = emulate.run_setup_cell(python, content, wheel)
    assert "flashlab doctor" in setup and "smoke kernel     ok" in setup, setup
    results = emulate.run_notebooks(python, emulate.select(), content, WORKERS)
    print(f"\nColab {image} image, notebook times (FLASHLAB_FAST=1):")
    for name, r in results.items():
        print(f"  {name:40s} {r['seconds']:5.1f} s")
    assert len(results) == len(emulate.select()) >= 30
    return setup, emulate.problems(results, work / "env", wheel)


@pytest.mark.notebook
@pytest.mark.slow
def test_colab_cpu_runtime_runs_every_lesson_and_exercise(colab):
    assert emulate.installed(colab["python"], "numba-cuda") is None, "the CPU image has no numba-cuda"
    setup, problems = _emulate(colab, "cpu")
    assert "numba-cuda       not installed" in setup and "numba's built-in" in setup, setup
    assert not problems, "\n".join(problems)


@pytest.mark.notebook
@pytest.mark.slow
def test_colab_gpu_runtime_runs_every_lesson_and_exercise(colab):
    emulate.switch_image(colab["python"], "gpu")
    want = next(p for p in emulate.versions()["images"]["gpu"] if p.startswith("numba-cuda=="))
    assert emulate.installed(colab["python"], "numba-cuda") == want.split("==")[1]
    setup, problems = _emulate(colab, "gpu")
    assert "numba's built-in" not in setup, setup
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_colab_gpu_runtime_gets_the_kernel_arguments_its_numba_cuda_builds(colab):
    """The prepared launch path's kernel arguments (tests/marshal_check.py) against the GPU image's numba-cuda,
    Colab's 0.22, run in that environment on the installed flashlab: seconds, after the notebooks' minutes."""
    python = colab["python"]
    want = next(p for p in emulate.versions()["images"]["gpu"] if p.startswith("numba-cuda==")).split("==")[1]
    if emulate.installed(python, "numba-cuda") != want:  # run alone: the GPU image's test has not switched
        emulate.switch_image(python, "gpu")
    content = colab["work"] / "content-gpu"
    if emulate.installed(python, "flashlab") is None:
        emulate.run_setup_cell(python, content, colab["wheel"])
    content.mkdir(parents=True, exist_ok=True)
    last = emulate.check_marshal(python, content).strip().splitlines()[-1]
    print("\n" + last)
    assert f"as numba-cuda {want} " in last, last
