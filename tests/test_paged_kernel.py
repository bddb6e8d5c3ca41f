"""The paged-decoding kernel (flashlab/kernels/paged.py) against decoding.paged_attention (NumPy, float64) and the
float64 reference: in the simulator on small shapes, on a GPU at decoding sizes."""
import numpy as np
import pytest

import flashlab as fl
from flashlab.decoding import paged_attention

paged = pytest.importorskip("flashlab.kernels.paged")
flash_decoding = pytest.importorskip("flashlab.kernels.decoding").flash_decoding


def paged_case(rng, B, H, H_kv, nq, d, page, lens, dtype=np.float32, spare=3):
    """Caches with pages in random order (and unused pages), a block table, and q."""
    max_pages = -(-max(max(lens), 1) // page)
    n_pages = B * max_pages + spare
    kc, vc = (rng.standard_normal((n_pages, page, H_kv, d)).astype(dtype) for _ in range(2))
    table = rng.permutation(n_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    q = (2 * rng.standard_normal((B, H, nq, d))).astype(dtype)
    return q, kc, vc, table, np.array(lens, np.int32)


def check(q, kc, vc, table, lens, causal, num_splits, threads=32, variant="register"):
    o, lse = paged.paged_decoding(q, kc, vc, table, lens, causal=causal, num_splits=num_splits, threads=threads,
                                  variant=variant)
    f64 = [x.astype(np.float64) for x in (q, kc, vc)]
    want_o, want_lse = paged_attention(*f64[:1], *f64[1:], table, lens, causal=causal)
    tol = 2e-3 if q.dtype == np.float16 else 2e-5
    assert o.dtype == q.dtype and lse.dtype == np.float32 and o.shape == want_o.shape
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse)), (lse, want_lse)
    assert np.all(o[np.isinf(want_lse)] == 0)
    fin = np.isfinite(want_lse)
    assert fl.relative_error(o[fin], want_o[fin]) < tol
    assert np.max(np.abs(lse[fin] - want_lse[fin])) < 1e-4


@pytest.mark.parametrize("B,H,H_kv,nq,page,lens,causal,splits", [
    (2, 4, 2, 1, 8, [19, 5], False, 2),        # GQA 2:1, ragged lengths, pages of 8
    (1, 4, 1, 2, 4, [13], True, 3),            # MQA, two queries, causal: the first query sees one key less
    (3, 2, 2, 1, 16, [0, 40, 1], False, 2),    # an empty sequence (o = 0, lse = inf) and one with a single key
    (1, 2, 1, 3, 8, [2], True, 1),             # causal with Nq > cache length: the first query sees no key
])
def test_paged_kernel_matches_numpy(rng, B, H, H_kv, nq, page, lens, causal, splits):
    check(*paged_case(rng, B, H, H_kv, nq, 16, page, lens), causal, splits)


def test_paged_kernel_float16(rng):
    check(*paged_case(rng, 1, 2, 1, 1, 16, 8, [21], dtype=np.float16), False, 2)


def test_paged_register_kernel_is_the_decoding_kernel(rng):
    """Over pages that hold each sequence's keys in order, without GQA, the register variant gives
    flash_decoding's outputs bit for bit: both are kernels/decoding.py's split kernel, whose two builds differ only
    in where a key row lives."""
    B, H, nq, nk, d, page = 2, 2, 3, 24, 16, 8
    q, k, v = (rng.standard_normal((B, H, n, d)).astype(np.float32) for n in (nq, nk, nk))
    pages = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B * nk // page, page, H, d)  # noqa: E731
    table = np.arange(B * nk // page, dtype=np.int32).reshape(B, nk // page)  # sequence b: pages in order
    o, lse = paged.paged_decoding(q, pages(k), pages(v), table, np.full(B, nk, np.int32), num_splits=2, threads=32,
                                  variant="register")
    want_o, want_lse = flash_decoding(q, k, v, num_splits=2, threads=32)
    assert np.array_equal(o, want_o) and np.array_equal(lse, want_lse)


@pytest.mark.parametrize("B,H,H_kv,nq,page,lens,causal,splits", [
    (2, 4, 2, 1, 8, [19, 40], True, 2),        # GQA 2:1: the group's 2 heads are 2 rows of one mma tile
    (3, 4, 1, 1, 16, [0, 33, 1], False, 2),    # MQA; an empty sequence, a chunk past a sequence's end
    (1, 2, 2, 3, 4, [13], False, 1),           # three queries without causal, pages of 4 keys
])
def test_paged_tensor_variant_matches_numpy(rng, B, H, H_kv, nq, page, lens, causal, splits):
    """The tensor-core paged build (kernels/tensor.py, page > 0), with q's group packed as rows."""
    check(*paged_case(rng, B, H, H_kv, nq, 16, page, lens, dtype=np.float16), causal, splits, threads=None,
          variant="tensor")


def test_paged_prepare_runs_again(rng):
    """prepare() (what the benchmark times): each run() recomputes o and lse in place, as a call would."""
    q, kc, vc, table, lens = paged_case(rng, 2, 4, 2, 1, 16, 8, [19, 5], dtype=np.float16)
    want_o, want_lse = paged.paged_decoding(q, kc, vc, table, lens, num_splits=2, variant="tensor")
    run, o, lse = paged.prepare(q, kc, vc, table, lens, num_splits=2)
    for _ in range(2):
        run()
        assert np.array_equal(o.copy_to_host(), want_o) and np.array_equal(lse.copy_to_host(), want_lse)
        o.copy_to_device(np.zeros(o.shape, o.dtype))


def test_paged_tensor_variant_refuses_what_it_cannot_do(rng):
    q, kc, vc, table, lens = paged_case(rng, 1, 2, 1, 2, 16, 8, [10], dtype=np.float16)
    with pytest.raises(ValueError, match="Nq = 1 or causal=False"):
        paged.paged_decoding(q, kc, vc, table, lens, causal=True, variant="tensor")
    with pytest.raises(ValueError, match="Nq = 1 or causal=False; got float32"):
        paged.paged_decoding(q.astype(np.float32), kc.astype(np.float32), vc.astype(np.float32), table, lens,
                             variant="tensor")
    with pytest.raises(ValueError, match="variant must be"):
        paged.paged_decoding(q, kc, vc, table, lens, variant="shared")


@pytest.mark.parametrize("change,err,match", [
    (dict(lens=[99]), ValueError, "cache_seqlens must be in"),
    (dict(table_value=50), ValueError, "block_table\\[0\\] has entries"),
    (dict(H=3), ValueError, "H = 3 heads and the caches H_kv = 2"),
    (dict(nq=40), ValueError, "at most 64"),
    (dict(d=20), ValueError, "d in \\(16, 32, 64, 128\\)"),
])
def test_paged_kernel_bad_inputs(rng, change, err, match):
    d = change.get("d", 16)
    q, kc, vc, table, lens = paged_case(rng, 1, change.get("H", 4), 2, change.get("nq", 1), d, 8, [10])
    if "lens" in change:
        lens = np.array(change["lens"], np.int32)
    if "table_value" in change:
        table[0, 0] = change["table_value"]
    with pytest.raises(err, match=match):
        paged.paged_decoding(q, kc, vc, table, lens)


gpu = pytest.mark.skipif(not fl.device.has_gpu(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("H,H_kv", [(32, 4), (8, 8), (8, 1)])
def test_paged_kernel_on_gpu(rng, H, H_kv):
    for causal, nq, dtype, d, variant in ((False, 1, np.float16, 64, None), (True, 1, np.float16, 128, "tensor"),
                                         (False, 1, np.float16, 128, "register"), (True, 4, np.float32, 64, None)):
        case = paged_case(rng, 3, H, H_kv, nq, d, 16, [3000, 1, 777], dtype=dtype)
        check(*case, causal, None, threads=None, variant=variant)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["tensor", "register"])
def test_paged_prepared_path_on_gpu(rng, variant):
    """Torch CUDA tensors: the first call prepares (kernels/prepared.py), later calls with new lengths and a new
    block table reuse it and give the general path's (NumPy inputs') outputs bit for bit; the device check of the
    tables raises the host check's errors."""
    torch = pytest.importorskip("torch")
    from flashlab.kernels import prepared

    if not prepared.available():
        pytest.skip("the prepared path needs numba-cuda's launch internals")
    q, kc, vc, table, lens = paged_case(rng, 3, 8, 2, 1, 64, 16, [300, 1, 77], dtype=np.float16, spare=5)
    on_gpu = lambda *xs: [torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in xs]  # noqa: E731
    tq, tk, tv = on_gpu(q, kc, vc)
    prepared._CALLS.clear()
    steps = [(table, lens), (table[::-1], np.array([299, 0, 300], np.int32)), (table, np.array([1, 2, 3], np.int64))]
    for bt, sl in steps:
        want_o, want_lse = paged.paged_decoding(q, kc, vc, bt, sl, variant=variant)
        o, lse = paged.paged_decoding(tq, tk, tv, *on_gpu(bt.astype(np.int64), sl), variant=variant)
        assert np.array_equal(o.cpu().numpy(), want_o) and np.array_equal(lse.cpu().numpy(), want_lse)
    kinds = [type(c).__name__ for c in prepared._CALLS.values()]
    assert kinds == ["PreparedPaged", "PreparedPaged"], kinds  # one per table dtype: int64 lengths are a new key
    bad_table = table.astype(np.int64)
    bad_table[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="block_table\\[1\\] has entries"):
        paged.paged_decoding(tq, tk, tv, *on_gpu(bad_table, lens), variant=variant)
    with pytest.raises(ValueError, match="cache_seqlens must be in"):
        paged.paged_decoding(tq, tk, tv, *on_gpu(table.astype(np.int64), np.array([1, 2, 10**6], np.int32)),
                             variant=variant)
    bad_table[1, 0] = -1  # unused pages (past a sequence's length) may hold anything, as on the host
    o, _ = paged.paged_decoding(tq, tk, tv, *on_gpu(bad_table, np.array([300, 0, 77], np.int32)), variant=variant)
    assert torch.isfinite(o).all()


def test_split_counts_depend_on_shapes_only():
    """The chunks come from the table's capacity, never from the lengths (which stay on the GPU in a decoding
    loop): both variants, default and given counts, and the error past the capacity."""
    for capacity in (1, 300, 32768):
        n, chunk = paged.register_chunks(None, 8, capacity)
        assert 1 <= n and n * chunk >= capacity and (n - 1) * chunk < capacity
        assert 1 <= paged.tensor_splits(None, 8, capacity) <= max(capacity // 256, 1)
    assert paged.tensor_splits(5, 8, 300) == 5 and paged.register_chunks(3, 8, 300) == (3, 100)
    with pytest.raises(ValueError, match="num_splits must be between 1 and Nk = 16"):
        paged.tensor_splits(17, 1, 16)
