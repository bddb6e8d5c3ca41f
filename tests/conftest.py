import os
import zlib
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core: one thread each, for this process and the notebook kernels it
    # starts. OpenMP threads (torch, BLAS) beyond the cores spin while they wait and slow everything down.
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from flashlab.build import parse_cells, strip_solutions

pytest.register_assert_rewrite("exercise_harness")  # the tests it generates report their values as test files do

# Property tests: enough examples to hit tails, causal and float16 often; no deadline (CI is a slow 2-core box).
settings.register_profile("flashlab", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("flashlab")

# What the tests that compare the prepared (fast) launch path with the general one set FLASHLAB_FAST_LAUNCH to, to
# turn it on: "direct" where the run was started with FLASHLAB_FAST_LAUNCH=direct (the direct launch alone, for a
# numba-cuda without cuda.core's launch: kernels/prepared.py), else "1".
FAST_LAUNCH_ON = "direct" if os.environ.get("FLASHLAB_FAST_LAUNCH", "").strip().lower() == "direct" else "1"

# Relative-error tolerances ||out - ref|| / ||ref|| by input dtype (float16 inputs accumulate in float32).
TOL = {np.float16: 1e-2, np.float32: 1e-5, np.float64: 1e-10}


def random_qkv(rng, batch, nq, nk, d, dv, dtype, logit_scale=1.0):
    """Fresh random q, k, v; logit_scale multiplies q so scores reach ~logit_scale in magnitude."""
    q = rng.standard_normal(batch + (nq, d)) * logit_scale
    k = rng.standard_normal(batch + (nk, d))
    v = rng.standard_normal(batch + (nk, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


EXERCISE_SOURCES = Path(__file__).resolve().parent.parent / "course" / "exercises"


def load_exercise(stem, keep=True):
    """The functions an exercise source defines, with its solutions kept (or blanked out, keep=False)."""
    ns = {}
    for kind, src in parse_cells((EXERCISE_SOURCES / f"{stem}.py").read_text()):
        if kind == "code" and src.lstrip().startswith(("def ", "import ", "from ")):
            exec(compile(strip_solutions(src, keep), f"{stem}.py", "exec"), ns)
    return ns


@pytest.fixture
def rng(request):
    # A different, reproducible stream per test.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
