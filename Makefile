# Two commands on a fresh machine (see README):
#   make lab    create the environment if needed and open the course in JupyterLab
#   make test   create the environment if needed and run every test
PYTHON ?= python3
VENV   ?= .venv
# The dev environment pins torch for reproducibility; override with e.g. `make test TORCH="torch==2.5.1"`.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flashlab-installed

.PHONY: lab test notebooks clean

# Serve the repository root, so the links between notebooks/, exercises/ and solutions/ resolve, and open
# lesson 00. Jupyter refuses to start as root (as in many containers) unless given --allow-root: pass it
# only when we are root.
LAB_FIRST := notebooks/00_setup.ipynb
lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=. $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_FIRST)

# One pytest worker per core (pytest-xdist): most tests run kernels in numba's simulator, on one core each.
# --dist loadfile keeps each test file on one worker, so the notebooks execute once (a shared fixture).
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile

# Regenerate notebooks/, exercises/ and solutions/ from course/.
notebooks: $(STAMP)
	$(BIN)/python -m flashlab build

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "flashlab needs Python 3.10 or newer; found " + sys.version.split()[0] + ". Run: make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[all]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
