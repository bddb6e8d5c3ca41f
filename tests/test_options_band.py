"""The options defined once (flashlab/kernels/options.py): the device functions, their NumPy twins (the planner and
the varlen tables use those) and NumPy's tiled FlashAttention (flashlab/tiled.py, which mirrors them) agree with each
other and with the definition, key by key, on random bands."""
import numpy as np
import pytest

from flashlab._inputs import check_options
from flashlab.kernels import options as O
from flashlab.tiled import _Masking


def brute(nq, nk, off, left, right):
    """The definition: visible[i, j] for row i at position i + off, key j."""
    pos = np.arange(nq)[:, None] + off
    j = np.arange(nk)[None, :]
    seen = np.broadcast_to(j < nk, (nq, nk)).copy()
    if left >= 0:
        seen &= j >= pos - left
    if right >= 0:
        seen &= j <= pos + right
    return seen


def cases(n=60, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        nq, nk = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        off = int(rng.choice([0, nk - nq]))
        left, right = (int(rng.choice([-1, 0, 1, 3, 17])) for _ in range(2))
        yield nq, nk, off, left, right


@pytest.mark.parametrize("features", [O.Features(), O.Features(window=True)])
def test_device_functions_match_their_host_twins_and_the_definition(features):
    f = O.device_functions(features)
    for nq, nk, off, left, right in cases():
        if not features.window:
            left = -1  # a build without a window never sees a left bound
        seen = brute(nq, nk, off, left, right)
        masked = O.outside(np.arange(nq)[:, None] + off, np.arange(nk)[None, :], nk, left, right)
        assert (masked == ~seen).all()
        I = np.int64
        for first in range(0, nq, 7):
            last = min(first + 6, nq - 1)
            lo, hi = O.key_band(first + off, last + off, nk, left, right)
            keys = np.flatnonzero(seen[first:last + 1].any(0))
            want = (keys[0], keys[-1] + 1) if keys.size else None
            got = (int(lo), int(hi)) if hi > lo else None
            assert got == want or (want is None and got is None), (nq, nk, off, left, right, first, got, want)
            if want is not None:  # the device's band may be wider only where no key is visible; here it is exact
                assert tuple(int(x) for x in f.key_band(I(first + off), I(last + off), I(nk), I(left), I(right))) == got
        for first in range(0, nk, 5):
            last = min(first + 4, nk - 1)
            lo, hi = O.query_band(first, last, off, nq, left, right)
            rows = np.flatnonzero(seen[:, first:last + 1].any(1))
            want = (rows[0], rows[-1] + 1) if rows.size else None
            got = (int(lo), int(hi)) if hi > lo else None
            assert got == want, (nq, nk, off, left, right, first, got, want)
            dev = tuple(int(x) for x in f.query_band(I(first), I(last), I(off), I(nq), I(left), I(right)))
            assert dev == (int(lo), int(hi))
        for i, j in [(0, 0), (nq - 1, nk - 1), (nq // 2, nk // 3)]:
            assert bool(f.outside(I(i + off), I(j), I(nk), I(left), I(right))) == (not seen[i, j])


def test_tile_band_counts_the_tiles_that_overlap():
    lo, hi = np.array([0, 5, 64, 70, 9]), np.array([64, 65, 64, 200, 3])
    start, end, n = O.tile_band(lo, hi, 32)
    assert start.tolist() == [0, 0, 64, 64, 0] and n.tolist() == [2, 3, 0, 5, 0]
    assert (end - start == 32 * n).all()


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_numpy_masking_mirrors_the_kernels_options(align, causal):
    """flashlab.tiled's own band and mask (the NumPy FA2) agree with the options module the kernels use."""
    rng = np.random.default_rng(1)
    for _ in range(40):
        nq, nk = int(rng.integers(1, 50)), int(rng.integers(1, 50))
        window = tuple(int(rng.choice([-1, 0, 2, 9])) for _ in range(2))
        opt = check_options((1, 1, nq, 8), causal=causal, scale=None, window_size=window, align=align)
        ex = O.Extras.from_options(opt, 1, 1) or O.Extras()
        args = ex.arguments(causal, 1, 1, log2=False)
        m = _Masking(opt, (1, 1), (1, 1), nq, nk)
        off = opt.offset(nq, nk)
        for q0 in range(0, nq, 8):
            q1 = min(q0 + 8, nq)
            lo, hi = O.key_band(q0 + off, q1 - 1 + off, nk, args.left, args.right)
            tlo, thi = m.key_range(q0, q1)
            assert (max(int(lo), 0), int(hi)) == (tlo, min(thi, nk)) or (hi <= lo and thi <= tlo)
            keep = m.mask(q0, 0, q1 - q0, nk)
            want = ~O.outside(np.arange(q0, q1)[:, None] + off, np.arange(nk)[None, :], nk, args.left, args.right)
            assert ((keep if keep is not None else np.ones_like(want)) == want).all()


def test_arguments_carry_the_values_in_the_kernels_units():
    ex = O.Extras(left=5, right=3, softcap=30.0, slopes=(0.5, 0.25))
    a = ex.arguments(causal=True, B=2, H=2, log2=True)
    assert (a.left, a.right) == (5, 0)
    assert a.cap == np.float32(30.0 * O.LOG2E)
    assert a.slopes.dtype == np.float32 and a.slopes.tolist() == [np.float32(x * O.LOG2E) for x in (.5, .25, .5, .25)]
    per_batch = O.Extras(slopes=(1.0, 2.0, 3.0, 4.0), per_batch=True).arguments(False, 2, 2, log2=False)
    assert per_batch.slopes.tolist() == [1.0, 2.0, 3.0, 4.0] and per_batch.right == -1
    assert O.Extras(left=4).features() == O.Features(window=True)
    assert O.Extras(dropout_p=0.1).features().per_score is False
    assert O.plain_arguments().slopes.shape == (1,)
