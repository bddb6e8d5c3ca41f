"""kernels/hopper.py: Hopper's wgmma, TMA, mbarrier and friends, against flashlab.fragments' NumPy model.

The model tests need nothing but NumPy. The kernel tests run on whichever backend is active: in the CUDA
simulator (CI) they check the emulation, bit for bit; on an H100/H200 the same tests hold the real instructions
to the same model, with a tolerance for wgmma's sums (PTX leaves the tensor core's order and rounding open).
Tests marked gpu run a wider set of shapes and layouts on a GPU only; scripts/gpu_check_hopper.py runs them and
prints a table. Simulated launches are one block of 128 threads (or fewer), one warpgroup.
"""
import numpy as np
import pytest

from device_views import heads_of_rows, strided_on_device
from flashlab import fragments as F
from flashlab.device import get_cuda, has_gpu

hopper = pytest.importorskip("flashlab.kernels.hopper")
from flashlab.kernels.hopper import SIMULATOR, TILE_ALIGN  # noqa: E402

cuda = get_cuda()
sim_only = pytest.mark.skipif(not SIMULATOR, reason="checks the simulator's emulation")
gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
if has_gpu() and cuda.get_current_device().compute_capability < (9, 0):  # the model tests run in CI
    pytest.skip("Hopper's instructions need compute capability 9.0", allow_module_level=True)
uint16, uint64, float32 = np.uint16, np.uint64, np.float32
# On a GPU: |D - D_model| <= WGMMA_TOL * (|C| + sum_k |a_k b_k|), per element and per wgmma. fp32 summed in any
# order errs by at most ~17 * 2**-24 of that for k16; a wrong layout errs by ~1.
WGMMA_TOL = 2.0 ** -18


# =============================================================================================== the model
def test_descriptor_fields_sit_where_ptx_puts_them():
    d = F.matrix_descriptor(0x1230, 0x80, 0x400, swizzle=128)
    assert d & 0x3FFF == 0x123 and (d >> 16) & 0x3FFF == 0x8 and (d >> 32) & 0x3FFF == 0x40 and d >> 62 == 1
    assert {sw: F.matrix_descriptor(0, 16, 16, sw) >> 62 for sw in F.SWIZZLES} == {0: 0, 32: 3, 64: 2, 128: 1}
    for sw in F.SWIZZLES:
        f = F.decode_descriptor(F.matrix_descriptor(0x3FFF0, 0x3FFF0, 16, sw))
        assert (f["start"], f["lbo"], f["sbo"], f["swizzle"]) == (0x3FFF0, 0x3FFF0, 16, sw)
    with pytest.raises(ValueError, match="multiple of 16"):
        F.matrix_descriptor(8, 16, 16)


@sim_only  # device functions called from the host
def test_a_descriptor_moves_along_shared_memory_by_one_add():
    """descriptor_plus(make_descriptor(a, ...), n) is make_descriptor(a + n, ...) for every 16-byte-aligned a and
    a + n inside shared memory (228 KB), whatever LBO, SBO and swizzle."""
    rng = np.random.default_rng(3)
    for a, n in zip(rng.integers(0, 228 * 1024 // 16, 200) * 16, rng.integers(0, 16 * 1024 // 16, 200) * 16):
        if a + n >= 228 * 1024:
            continue
        for lbo, sbo, sw in [(16, 1024, 128), (8192, 1024, 128), (128, 256, 0)]:
            want = hopper.make_descriptor(int(a + n), lbo, sbo, sw)
            assert hopper.descriptor_plus(hopper.make_descriptor(int(a), lbo, sbo, sw), int(n)) == want
            assert want == F.matrix_descriptor(int(a + n), lbo, sbo, sw)


def test_128_byte_swizzle_moves_chunk_c_of_row_r_to_chunk_c_xor_r():
    r, c, byte = np.arange(16)[:, None, None], np.arange(8)[None, :, None], np.arange(16)[None, None, :]
    got = F.swizzle_address(r * 128 + c * 16 + byte, 128)
    np.testing.assert_array_equal(got, r * 128 + (c ^ (r % 8)) * 16 + byte)
    # 64-byte rows: chunk c (of 4) of row r at c ^ (r // 2 % 4); 32-byte rows: c (of 2) at c ^ (r // 4 % 2)
    for span, shift in ((64, 1), (32, 2)):
        r, c = np.arange(32)[:, None], np.arange(span // 16)[None, :]
        np.testing.assert_array_equal(F.swizzle_address(r * span + c * 16, span),
                                      r * span + (c ^ (r >> shift) % (span // 16)) * 16)


def test_fragment_maps_follow_the_ptx_formulas():
    d = F.wgmma_fragment_map(128)
    assert d.shape == (128, 64, 2)
    flat = d[..., 0] * 128 + d[..., 1]
    assert sorted(flat.ravel().tolist()) == list(range(64 * 128))  # every element, once
    # thread 77: warp 2, lane 13 (g = 3, t = 1); register 5 is row 16 * 2 + 3, column 8 + 2 + 1
    assert d[77, 5].tolist() == [35, 11] and d[77, 2].tolist() == [43, 2] and d[77, 63].tolist() == [43, 123]
    a = F.wgmma_fragment_map(16, "A")  # each warp's 16 rows as mma.sync m16n8k16's A fragment
    mma_a = F.fragment_map("m16n8k16", "A", "float16")
    for w in range(4):
        np.testing.assert_array_equal(a[32 * w:32 * (w + 1)], mma_a + [16 * w, 0])
    m = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    np.testing.assert_array_equal(F.wgmma_from_fragments(F.wgmma_to_fragments(m, 64), 64), m)


@pytest.mark.parametrize("swizzle", F.SWIZZLES)
@pytest.mark.parametrize("major", ["K", "MN"])
def test_descriptors_read_the_tile_layout_that_tma_writes(swizzle, major):
    """operand_descriptor's (start, LBO, SBO) make operand_addresses read a k16 step of a tile_offsets tile."""
    rows, cols = (128, 128) if major == "K" else (64, 128)  # K: (mn, k) tile; MN: (k, mn) tile
    offsets = F.tile_offsets(rows, cols, 2, swizzle)
    for k0, mn0 in ((0, 0), (16, 0), (48, 64 if major == "K" else 0)):
        start, lbo, sbo = F.operand_descriptor(rows, cols, major, k0, swizzle, mn0=mn0)
        mn = 64 if major == "K" else cols
        got = F.operand_addresses(F.matrix_descriptor(8192 + start, lbo, sbo, swizzle), mn, major)
        want = offsets[mn0:mn0 + mn, k0:k0 + 16] if major == "K" else offsets[k0:k0 + 16, mn0:mn0 + mn].T
        np.testing.assert_array_equal(got, 8192 + want)
    assert len(np.unique(offsets)) == offsets.size  # no two elements share a byte


def test_the_layout_the_wgmma_probe_found_on_an_h100():
    """The H100 probe (no swizzle, K-major, LBO 128 B, SBO 256 B) stored A's (r, k) at element
    64 * (2 * (r // 8) + k // 8) + 8 * (r % 8) + k % 8, and wgmma read A @ B from it."""
    r, k = np.arange(64)[:, None], np.arange(16)[None, :]
    probe = 2 * (64 * (2 * (r // 8) + k // 8) + 8 * (r % 8) + k % 8)
    np.testing.assert_array_equal(F.operand_addresses(F.matrix_descriptor(0, 128, 256), 64, "K"), probe)

def test_wgmma_model_is_a_times_b_plus_c_rounded_once(rng):
    a, b = _values(rng, (64, 16), "bfloat16"), _values(rng, (16, 64), "bfloat16")
    c = rng.standard_normal((64, 64)).astype(np.float32)
    want = (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)
    np.testing.assert_array_equal(F.wgmma_mma(a, b, c), want)
    np.testing.assert_array_equal(F.wgmma_mma(a, b, c, scale_d=False), (a.astype(np.float64) @ b).astype(np.float32))


def test_tma_box_fills_zeros_outside_the_matrix():
    m = np.arange(1, 13 * 20 + 1, dtype=np.uint16).reshape(13, 20)
    box = F.tma_box(m, 8, -4, 8, 16)
    np.testing.assert_array_equal(box[:5, 4:], m[8:13, :12])
    assert not box[5:].any() and not box[:, :4].any()
    image = F.tma_image(F.tma_box(np.ones((3, 64), np.uint16), 0, 0, 8, 64), 128)
    assert image.sum() == 3 * 64 and image[:64].all() and image[8:16].all()  # row r's chunk c at chunk c ^ r


# ================================================================================================ kernels
def _values(rng, shape, dtype):
    """Random values exactly representable in the 16-bit dtype (as float32)."""
    return F.from_bits16(F.to_bits16(rng.standard_normal(shape), dtype), dtype)


def _image(matrix, tile_rows, tile_cols, swizzle, dtype):
    """uint16 shared-memory contents of a (tile_rows, tile_cols) matrix laid out as tile_offsets."""
    image = np.zeros(tile_rows * tile_cols, np.uint16)
    image[F.tile_offsets(tile_rows, tile_cols, 2, swizzle) // 2] = F.to_bits16(matrix, dtype)
    return image


def _operand_tiles(a, b, a_major, b_major, swizzle, dtype):
    """Shared images of A (64 x K) and B (K x N) and, per k16 step, the descriptors' (offset, LBO, SBO) of each."""
    k, n = b.shape
    a_tile = a if a_major == "K" else a.T  # K-major A is stored (m, k); MN-major A (k, m)
    b_tile = b.T if b_major == "K" else b  # K-major B (n, k); MN-major B (k, n)
    steps = [[F.operand_descriptor(*a_tile.shape, a_major, k0, swizzle),
              F.operand_descriptor(*b_tile.shape, b_major, k0, swizzle)] for k0 in range(0, k, 16)]
    return (_image(a_tile, *a_tile.shape, swizzle, dtype), _image(b_tile, *b_tile.shape, swizzle, dtype),
            np.array(steps, np.int64))


_KERNELS = {}


def _wgmma_kernel(n, dtype, a_major, b_major, swizzle, in_registers, size_a, size_b, steps):
    """One warpgroup: copy the images to shared memory, `steps` wgmma (the first with scale_d = 0, onto an
    accumulator holding garbage), one commit, wait, each thread writes its n // 2 registers."""
    key = (n, dtype, a_major, b_major, swizzle, in_registers, size_a, size_b, steps)
    if key in _KERNELS:
        return _KERNELS[key]
    acc_n = n // 2
    if in_registers:
        mma = hopper.wgmma_rs(n, dtype, b_major)

        @cuda.jit
        def kernel(a_img, b_img, desc, a_regs, out):
            t = cuda.threadIdx.x
            b_s = cuda.shared.array(size_b, uint16, alignment=TILE_ALIGN)
            for e in range(t, size_b, 128):
                b_s[e] = b_img[e]
            hopper.fence_proxy_async()
            cuda.syncthreads()
            acc = cuda.local.array(acc_n, float32)
            for i in range(acc_n):
                acc[i] = 7.0  # scale_d = 0 must ignore it
            b0 = hopper.smem_address(b_s, 0)
            hopper.wgmma_fence()
            for s in range(steps):
                db = hopper.make_descriptor(b0 + desc[s, 1, 0], desc[s, 1, 1], desc[s, 1, 2], swizzle)
                mma(acc, a_regs[s, t, 0], a_regs[s, t, 1], a_regs[s, t, 2], a_regs[s, t, 3], db, min(s, 1))
            hopper.wgmma_commit()
            hopper.wgmma_wait(0)
            for i in range(acc_n):
                out[t, i] = acc[i]
    else:
        mma = hopper.wgmma_ss(n, dtype, a_major, b_major)

        @cuda.jit
        def kernel(a_img, b_img, desc, a_regs, out):
            t = cuda.threadIdx.x
            a_s = cuda.shared.array(size_a, uint16, alignment=TILE_ALIGN)
            b_s = cuda.shared.array(size_b, uint16, alignment=TILE_ALIGN)
            for e in range(t, size_a, 128):
                a_s[e] = a_img[e]
            for e in range(t, size_b, 128):
                b_s[e] = b_img[e]
            hopper.fence_proxy_async()
            cuda.syncthreads()
            acc = cuda.local.array(acc_n, float32)
            for i in range(acc_n):
                acc[i] = 7.0
            a0, b0 = hopper.smem_address(a_s, 0), hopper.smem_address(b_s, 0)
            hopper.wgmma_fence()
            for s in range(steps):
                da = hopper.make_descriptor(a0 + desc[s, 0, 0], desc[s, 0, 1], desc[s, 0, 2], swizzle)
                db = hopper.make_descriptor(b0 + desc[s, 1, 0], desc[s, 1, 1], desc[s, 1, 2], swizzle)
                mma(acc, da, db, min(s, 1))
            hopper.wgmma_commit()
            hopper.wgmma_wait(0)
            for i in range(acc_n):
                out[t, i] = acc[i]
    _KERNELS[key] = kernel
    return kernel


def run_wgmma(rng, n, dtype, a_major, b_major, swizzle, k, in_registers=False, desc_swizzle=None):
    """(D from the kernel, D of the model, the elementwise GPU tolerance, A @ B in float64) of A (64 x k) @ B (k x n)
    by k16 steps."""
    a, b = _values(rng, (64, k), dtype), _values(rng, (k, n), dtype)
    a_img, b_img, desc = _operand_tiles(a, b, a_major, b_major, swizzle, dtype)
    steps = k // 16
    regs = np.zeros((steps, 128, 4), np.uint32)
    for s in range(steps):
        bits = F.wgmma_to_fragments(F.to_bits16(a[:, 16 * s:16 * s + 16], dtype), operand="A")
        regs[s] = F.pack16(bits[:, 0::2], bits[:, 1::2])
    kernel = _wgmma_kernel(n, dtype, a_major, b_major, swizzle if desc_swizzle is None else desc_swizzle,
                           in_registers, a_img.size, b_img.size, steps)
    out = np.zeros((128, n // 2), np.float32)
    kernel[1, 128](a_img, b_img, desc, regs, out)
    d = None
    for s in range(steps):  # the model, one wgmma at a time (fp32 between steps, as the registers are)
        d = F.wgmma_mma(a[:, 16 * s:16 * s + 16], b[16 * s:16 * s + 16], d, scale_d=s > 0)
    scale = np.abs(a).astype(np.float64) @ np.abs(b)
    return F.wgmma_from_fragments(out, n), d, WGMMA_TOL * scale * steps, a.astype(np.float64) @ b


def assert_wgmma(got, want, tol):
    if SIMULATOR:
        np.testing.assert_array_equal(got, want)  # the emulation computes the model
    else:
        bad = np.abs(got.astype(np.float64) - want) > tol
        assert not bad.any(), (f"{bad.sum()} of {bad.size} elements of D differ from the model by more than the "
                               f"summation-order bound; first at (row, col) {np.argwhere(bad)[0].tolist()}")


def assert_near_exact(got, exact, tol, k):
    """Whatever the model says, D is A @ B: within one fp32 rounding of the running sum per k16 step here (the
    model's), within the summation-order bound on a GPU. Random data: D is not near zero."""
    sums = tol / WGMMA_TOL  # sum_k |a_k b_k|, times the number of steps
    bound = (k // 16) * 2.0 ** -24 * sums if SIMULATOR else tol
    assert np.all(np.abs(got - exact) <= bound) and np.abs(exact).max() > 1


SS_CASES = [(64, "float16", "K", "K", 0, 32), (128, "bfloat16", "K", "MN", 128, 64),
            (64, "float16", "MN", "K", 128, 64)]
SS_GPU = [(n, dt, am, bm, sw, 64) for n in (64, 128, 256) for dt in ("float16", "bfloat16")
          for am, bm in (("K", "K"), ("K", "MN"), ("MN", "MN")) for sw in (0, 128)]


@pytest.mark.parametrize("n,dtype,a_major,b_major,swizzle,k", SS_CASES)
def test_wgmma_from_shared_memory_matches_the_model(rng, n, dtype, a_major, b_major, swizzle, k):
    got, want, tol, exact = run_wgmma(rng, n, dtype, a_major, b_major, swizzle, k)
    assert_wgmma(got, want, tol)
    assert_near_exact(got, exact, tol, k)


@pytest.mark.parametrize("n,dtype,b_major,swizzle", [(64, "float16", "MN", 128), (128, "bfloat16", "K", 0)])
def test_wgmma_with_a_from_registers_matches_the_model(rng, n, dtype, b_major, swizzle):
    """The P @ V form: A (P) in registers, B (V, row-major: MN-major) through a descriptor."""
    got, want, tol, exact = run_wgmma(rng, n, dtype, "K", b_major, swizzle, 64, in_registers=True)
    assert_wgmma(got, want, tol)
    assert_near_exact(got, exact, tol, 64)


@pytest.mark.parametrize("swizzle,read_as", [(128, 0), (0, 128), (128, 64)])
def test_a_wrong_descriptor_gives_a_wrong_product(rng, swizzle, read_as):
    """A tile written with one swizzle and read with another: D is far from A @ B, so the tests above can fail."""
    got, want, _, _ = run_wgmma(rng, 64, "float16", "K", "K", swizzle, 64, desc_swizzle=read_as)
    assert np.linalg.norm(got - want) > 0.3 * np.linalg.norm(want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,dtype,a_major,b_major,swizzle,k", SS_GPU)
def test_gpu_wgmma_ss(rng, n, dtype, a_major, b_major, swizzle, k):
    assert_wgmma(*run_wgmma(rng, n, dtype, a_major, b_major, swizzle, k)[:3])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("b_major,swizzle", [("K", 0), ("K", 128), ("MN", 0), ("MN", 128)])
def test_gpu_wgmma_rs(rng, n, b_major, swizzle):
    for dtype in ("float16", "bfloat16"):
        assert_wgmma(*run_wgmma(rng, n, dtype, "K", b_major, swizzle, 64, in_registers=True)[:3])


# ---------------------------------------------------------------------- the emulation's own checks
_mma64 = hopper.wgmma_ss(64, "float16")


@cuda.jit
def _early_read(a_img, out):
    """wgmma's result is read before wgmma_wait (out[0]) and after (out[1])."""
    t = cuda.threadIdx.x
    a_s = cuda.shared.array(2048, uint16, alignment=TILE_ALIGN)
    for e in range(t, 2048, 128):
        a_s[e] = a_img[e]
    cuda.syncthreads()
    acc = cuda.local.array(32, float32)
    for i in range(32):
        acc[i] = 0.0
    d = hopper.make_descriptor(hopper.smem_address(a_s, 0), 1024, 128, 0)
    hopper.wgmma_fence()
    _mma64(acc, d, d, 0)
    hopper.wgmma_commit()
    out[0, t] = acc[0]
    hopper.wgmma_wait(0)
    out[1, t] = acc[0]


@sim_only
def test_simulated_wgmma_lands_at_wait_group(rng):
    """As on a GPU, the registers hold D only once wgmma_wait has retired its group: a kernel that reads them
    earlier reads the old values here too."""
    img = F.to_bits16(rng.standard_normal(2048) + 3.0, "float16")
    out = np.zeros((2, 128), np.float32)
    _early_read[1, 128](img, out)
    assert not out[0].any() and np.all(out[1] > 0)


@cuda.jit
def _no_fence(out):
    acc = cuda.local.array(32, float32)
    _mma64(acc, 0, 0, 0)
    out[cuda.threadIdx.x] = acc[0]


@cuda.jit
def _one_thread_skips(out):
    acc = cuda.local.array(32, float32)
    hopper.wgmma_fence()
    if cuda.threadIdx.x != 100:
        _mma64(acc, 0, 0, 0)


@sim_only
def test_simulator_refuses_a_wgmma_without_fence_or_with_a_thread_missing():
    with pytest.raises(RuntimeError, match="wgmma_fence"):
        _no_fence[1, 128](np.zeros(128, np.float32))
    with pytest.raises(Exception, match="all 128 threads"):
        _one_thread_skips[1, 128](np.zeros(128, np.float32))


# ================================================================================ mbarrier, bulk copy
@cuda.jit
def _phases(src, out, seen):
    """One thread walks a barrier (count 1) through two phases; seen records each try_wait."""
    bar = cuda.shared.array(2, uint64)
    dst = cuda.shared.array(64, uint16, alignment=TILE_ALIGN)
    if cuda.threadIdx.x == 0:
        hopper.mbarrier_init(bar, 1, 1)
        seen[0] = hopper.mbarrier_try_wait_parity(bar, 1, 0)  # nobody arrived: phase 0 open
        hopper.mbarrier_arrive_expect_tx(bar, 1, 128)
        seen[1] = hopper.mbarrier_try_wait_parity(bar, 1, 0)  # arrived, but 128 bytes are due
        hopper.bulk_copy(dst, 0, src, 0, 128, bar, 1)
        hopper.mbarrier_wait_parity(bar, 1, 0)  # the bytes land: phase 0 completes
        seen[2] = hopper.mbarrier_try_wait_parity(bar, 1, 0)
        seen[3] = hopper.mbarrier_try_wait_parity(bar, 1, 1)  # phase 1 is open
        hopper.mbarrier_arrive(bar, 1)
        seen[4] = hopper.mbarrier_try_wait_parity(bar, 1, 1)
        seen[5] = hopper.mbarrier_try_wait_parity(bar, 1, 0)  # phase 2 has parity 0 and is open
        for i in range(64):
            out[i] = dst[i]


def test_mbarrier_phases_arrivals_and_transaction_bytes(rng):
    src = rng.integers(0, 2**16, 64).astype(np.uint16)
    out, seen = np.zeros(64, np.uint16), np.full(6, 7, np.int32)
    _phases[1, 32](src, out, seen)
    assert seen.tolist() == [0, 0, 1, 0, 1, 0]
    np.testing.assert_array_equal(out, src)


@cuda.jit
def _short_copy(src, out):
    bar = cuda.shared.array(1, uint64)
    dst = cuda.shared.array(64, uint16)
    if cuda.threadIdx.x == 0:
        hopper.mbarrier_init(bar, 0, 1)
        hopper.mbarrier_arrive_expect_tx(bar, 0, 128)
        hopper.bulk_copy(dst, 0, src, 0, 64, bar, 0)  # half the promised bytes
    cuda.syncthreads()
    hopper.mbarrier_wait_parity(bar, 0, 0)
    out[cuda.threadIdx.x] = dst[cuda.threadIdx.x]


@sim_only
def test_simulator_reports_a_barrier_that_can_never_complete():
    with pytest.raises(hopper.BarrierDeadlock, match="64 transaction bytes outstanding"):
        _short_copy[1, 32](np.arange(64, dtype=np.uint16), np.zeros(32, np.uint16))


@cuda.jit
def _half_at_a_named_barrier(out):
    if cuda.threadIdx.x < 32:
        hopper.named_barrier_sync(1, 64)  # waits for the second warp, which never comes
    out[cuda.threadIdx.x] = 1


@sim_only
def test_simulator_reports_a_named_barrier_that_can_never_complete():
    with pytest.raises(hopper.BarrierDeadlock, match="named barrier 1 for 64 threads; 32 arrived.*can never end"):
        _half_at_a_named_barrier[1, 64](np.zeros(64, np.int32))


def test_a_thread_whose_wait_is_done_is_not_stuck():
    """The deadlock check counts a wait only while it is not done: a thread released by a barrier that has not run
    again yet (a busy machine can keep it unscheduled past the grace) must not make the block look stuck."""
    from types import SimpleNamespace

    manager = SimpleNamespace(count=4, waiting=1, finished=1)  # one thread at syncthreads, one finished
    block = SimpleNamespace(waits={"a": lambda: False, "b": lambda: True})
    assert not hopper.every_thread_waits(manager, block)
    block.waits["b"] = lambda: False
    assert hopper.every_thread_waits(manager, block)
    assert not hopper.every_thread_waits(SimpleNamespace(waiting=0, finished=0), block)  # numba's own block loop


@cuda.jit
def _reduce_rows(dst, out, rewrite_early):
    """32 threads stage a row of 32 float32s each (value row + lane / 64) in shared memory, then thread r adds row r
    to dst[r] with a bulk reduce; with rewrite_early, the rows are overwritten with -1 before the wait."""
    rows = cuda.shared.array((32, 32), float32)
    tid = cuda.threadIdx.x
    for lane in range(32):
        rows[tid, lane] = float32(tid) + float32(lane) / float32(64)
    hopper.fence_proxy_async()
    cuda.syncthreads()
    hopper.bulk_reduce_add(dst, 32 * tid, rows[tid], 0, 128)
    hopper.bulk_commit()
    if rewrite_early:
        for lane in range(32):
            rows[tid, lane] = float32(-1)
    hopper.bulk_wait_read(0)
    for lane in range(32):
        rows[tid, lane] = float32(-2)  # after the wait the source may change
    hopper.bulk_wait(0)
    out[tid] = rows[tid, 0]


def test_bulk_reduce_adds_rows_of_shared_memory_to_global():
    start = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
    dst, out = cuda.to_device(start.copy()), cuda.to_device(np.zeros(32, np.float32))
    for _ in range(2):  # added twice: a reduce, not a copy
        _reduce_rows[1, 32](dst, out, False)
    want = start + 2 * (np.arange(32)[:, None] + np.arange(32)[None, :] / 64)
    np.testing.assert_array_equal(dst.copy_to_host(), want.astype(np.float32))
    assert (out.copy_to_host() == -2).all()


@sim_only
def test_simulator_reads_a_bulk_reduce_source_at_the_wait():
    """A kernel that rewrites the source before bulk_wait_read adds what it wrote: the simulator takes the latest
    moment the hardware may read, so the race shows up as wrong sums."""
    dst, out = cuda.to_device(np.zeros((32, 32), np.float32)), cuda.to_device(np.zeros(32, np.float32))
    _reduce_rows[1, 32](dst, out, True)
    assert (dst.copy_to_host() == -1).all()


@cuda.jit
def _partial_group(out):
    acc = cuda.local.array(32, float32)
    hopper.wgmma_fence()
    if cuda.threadIdx.x >= 128:
        _mma64(acc, np.uint64(0), np.uint64(0), 0)
    out[0] = 1


@sim_only
def test_a_partial_warpgroup_may_not_issue_wgmma():
    """A block of 160 threads holds one whole warpgroup and one warp; that warp cannot run a wgmma."""
    with pytest.raises(Exception, match="warpgroup 1, which this block of 160 threads leaves incomplete"):
        _partial_group[1, 160](np.zeros(1, np.int32))


# ============================================================================================== TMA
_TMA_KERNELS = {}


def _tma_kernel(box_rows, box_cols, rank=2):
    """load(tmap, col, row, head, batch, out): thread 0 loads one box with tma_load_2d (rank 2: head and batch
    unread) or tma_load_4d, completing on a barrier that every thread waits on; out = the raw tile."""
    key = (box_rows, box_cols, rank)
    if key not in _TMA_KERNELS:
        size = box_rows * box_cols

        @cuda.jit
        def load(tmap, col, row, head, batch, out):
            tile = cuda.shared.array(size, uint16, alignment=TILE_ALIGN)
            bar = cuda.shared.array(1, uint64)
            t = cuda.threadIdx.x
            if t == 0:
                hopper.mbarrier_init(bar, 0, 1)
            cuda.syncthreads()
            if t == 0:
                hopper.mbarrier_arrive_expect_tx(bar, 0, size * 2)
                if rank == 2:
                    hopper.tma_load_2d(tile, 0, tmap, col, row, bar, 0)
                else:
                    hopper.tma_load_4d(tile, 0, tmap, col, row, head, batch, bar, 0)
            hopper.mbarrier_wait_parity(bar, 0, 0)
            for e in range(t, size, cuda.blockDim.x):
                out[e] = tile[e]
        _TMA_KERNELS[key] = load
    return _TMA_KERNELS[key]


@pytest.mark.parametrize("swizzle,box_cols", [(128, 64), (0, 24)])
def test_tma_box_past_the_end_equals_the_model(rng, swizzle, box_cols):
    """Boxes inside, past the last row and column, and at negative coordinates of a 200 x 72 matrix: the tile
    in shared memory is the model's image (zeros outside the matrix, the swizzle applied)."""
    m = rng.integers(1, 2**16, (200, 72)).astype(np.uint16)
    d_m = cuda.to_device(m)
    tmap = hopper.tensor_map_2d(d_m, 64, box_cols, swizzle)
    kernel = _tma_kernel(64, box_cols)
    for row, col in ((0, 0), (160, 32), (-8, -8)):
        out = np.zeros(64 * box_cols, np.uint16)
        kernel[1, 64](tmap, col, row, 0, 0, out)
        want = F.tma_image(F.tma_box(m, row, col, 64, box_cols), swizzle)
        np.testing.assert_array_equal(out, want, err_msg=f"box at row {row}, column {col}")
        assert (out == 0).any() == (row + 64 > 200 or col + box_cols > 72 or row < 0 or col < 0)


@pytest.mark.parametrize("layout", ["BHNd", "BNHd"])
def test_tma_4d_reads_one_head_in_place(rng, layout):
    """A 4-D map of (B, H, N, d) = (2, 3, 100, 64) values, contiguous or the (B, N, H, d) layout's transpose(1, 2)
    (a GPT's heads): each box is the model's image of x[batch, head]'s rows, zeros past its last row and for a
    head or batch outside the array."""
    B, H, N, d = 2, 3, 100, 64
    x = rng.integers(1, 2**16, (B, H, N, d)).astype(np.uint16)
    d_x, keep = strided_on_device(x if layout == "BHNd" else heads_of_rows(x))
    tmap = hopper.tensor_map_4d(d_x, 64, 64, 128)
    for row, head, batch in ((0, 0, 0), (64, 2, 1), (40, 1, 0), (0, 3, 0), (0, 0, 2)):
        out = np.zeros(64 * 64, np.uint16)
        _tma_kernel(64, 64, 4)[1, 64](tmap, 0, row, head, batch, out)
        inside = head < H and batch < B
        want = F.tma_image(F.tma_box(x[batch, head] if inside else np.zeros((N, d), np.uint16), row, 0, 64, 64), 128)
        np.testing.assert_array_equal(out, want, err_msg=f"box at row {row}, head {head}, batch {batch}")
    del keep


def test_tma_strides_takes_a_gpt_layout_and_refuses_what_tma_cannot_read():
    B, N, H, d = 2, 10, 4, 64  # (B, N, 3 H d) as a linear layer makes it, q = [..., :H d] as (B, H, N, d)
    strides = (N * 3 * H * d * 2, d * 2, 3 * H * d * 2, 2)
    assert hopper.tma_strides((B, H, N, d), strides, 0, 2) == strides
    # an axis of length 1 is never stepped: its stride (often 1 in torch) becomes the array's extent
    assert hopper.tma_strides((1, H, N, d), (2, d * 2, 3 * H * d * 2, 2), 0, 2)[0] % 16 == 0
    assert hopper.tma_strides((B, H, N, d), (strides[0], 0, strides[2], 2), 0, 2) is None  # a broadcast head
    assert hopper.tma_strides((B, H, N, d), (strides[0], 2 * 60, strides[2], 2), 0, 2) is None  # 120 bytes
    assert hopper.tma_strides((B, H, N, d), (strides[0], strides[1], strides[2], 4), 0, 2) is None  # every other
    assert hopper.tma_strides((B, H, N, d), strides, 8, 2) is None  # an unaligned start
    with pytest.raises(ValueError, match="multiples of 16"):
        hopper.tensor_map_4d(cuda.to_device(np.zeros((2, 3, 8, 60), np.uint16)), 8, 60, 0)


def test_a_2d_map_takes_the_4d_maps_stride_rules():
    """tensor_map_2d checks its matrix by hopper.tma_strides, as tensor_map_4d does: rows 136 bytes apart are
    refused; a single row, whose stride is never stepped, is read whatever its stride says."""
    with pytest.raises(ValueError, match="positive multiple of 16 bytes"):
        hopper.tensor_map_2d(cuda.to_device(np.zeros((8, 68), np.uint16))[:, :64], 8, 64, 128)
    hopper.tensor_map_2d(cuda.to_device(np.zeros((1, 68), np.uint16))[:, :64], 8, 64, 128)


def test_tma_load_refuses_a_map_of_the_other_rank():
    tmap = hopper.tensor_map_2d(cuda.to_device(np.zeros((64, 64), np.uint16)), 64, 64, 128)
    if not SIMULATOR:
        pytest.skip("the simulator's check (the GPU reads whatever the map says)")
    with pytest.raises(ValueError, match="tensor_map_2d"):
        _tma_kernel(64, 64, 4)[1, 32](tmap, 0, 0, 0, 0, np.zeros(64 * 64, np.uint16))


def test_tensor_map_refuses_a_box_wider_than_its_swizzle():
    with pytest.raises(ValueError, match="rows of 128 bytes"):
        hopper.tensor_map_2d(cuda.to_device(np.zeros((64, 128), np.uint16)), 64, 128, 128)


def _qk_kernel(block_q, block_k, d, dtype):
    """S = Q @ K^T for one warpgroup, the FlashAttention-3 way: TMA brings Q (block_q x d) and K (block_k x d)
    into 128-byte swizzled shared tiles (one 64-column box at a time), wgmma reads them through descriptors."""
    mma, acc_n = hopper.wgmma_ss(block_k, dtype), block_k // 2
    size_q, size_k, boxes = block_q * d, block_k * d, d // 64
    q_box, k_box = block_q * 64, block_k * 64

    @cuda.jit
    def kernel(q_map, k_map, out):
        q = cuda.shared.array(size_q, uint16, alignment=TILE_ALIGN)
        k = cuda.shared.array(size_k, uint16, alignment=TILE_ALIGN)
        bar = cuda.shared.array(1, uint64)
        t = cuda.threadIdx.x
        if t == 0:
            hopper.mbarrier_init(bar, 0, 1)
        cuda.syncthreads()
        if t == 0:
            hopper.mbarrier_arrive_expect_tx(bar, 0, 2 * (size_q + size_k))
            for b in range(boxes):
                hopper.tma_load_2d(q, b * q_box, q_map, 64 * b, 0, bar, 0)
                hopper.tma_load_2d(k, b * k_box, k_map, 64 * b, 0, bar, 0)
        hopper.mbarrier_wait_parity(bar, 0, 0)
        acc = cuda.local.array(acc_n, float32)
        q0, k0 = hopper.smem_address(q, 0), hopper.smem_address(k, 0)
        hopper.wgmma_fence()
        for s in range(d // 16):  # k16 step s: box s // 4, 32 bytes further along the row per step
            step = (s % 4) * 32
            dq = hopper.make_descriptor(q0 + (s // 4) * q_box * 2 + step, 16, 1024, 128)
            dk = hopper.make_descriptor(k0 + (s // 4) * k_box * 2 + step, 16, 1024, 128)
            mma(acc, dq, dk, min(s, 1))
        hopper.wgmma_commit()
        hopper.wgmma_wait(0)
        for i in range(acc_n):
            out[t, i] = acc[i]
    return kernel


@pytest.mark.parametrize("block_k,d,dtype", [(64, 128, "float16")])
def test_tma_and_wgmma_compute_q_times_k_transposed(rng, block_k, d, dtype):
    q, k = _values(rng, (64, d), dtype), _values(rng, (block_k, d), dtype)
    on_device = [cuda.to_device(F.to_bits16(x, dtype)) for x in (q, k)]  # alive while the maps are used
    maps = [hopper.tensor_map_2d(x, x.shape[0], 64, 128) for x in on_device]
    out = np.zeros((128, block_k // 2), np.float32)
    _qk_kernel(64, block_k, d, dtype)[1, 128](*maps, out)
    want = None
    for s in range(d // 16):
        want = F.wgmma_mma(q[:, 16 * s:16 * s + 16], k[:, 16 * s:16 * s + 16].T, want, s > 0)
    assert_wgmma(F.wgmma_from_fragments(out, block_k), want,
                 WGMMA_TOL * (np.abs(q).astype(np.float64) @ np.abs(k).T) * (d // 16))


@gpu
@pytest.mark.gpu
# static shared memory is 48 KB a block: 16-bit Q (64 x d) and K (block_k x d) fit while (64 + block_k) * d < 24K
@pytest.mark.parametrize("block_k,d,dtype", [(128, 64, "float16"), (96, 128, "bfloat16"), (176, 64, "float16"),
                                             (256, 64, "bfloat16")])
def test_gpu_tma_and_wgmma(rng, block_k, d, dtype):
    test_tma_and_wgmma_compute_q_times_k_transposed(rng, block_k, d, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("swizzle,box_cols,box_rows", [(128, 64, 64), (128, 64, 256), (0, 8, 64), (0, 72, 32)])
def test_gpu_tma_boxes(rng, swizzle, box_cols, box_rows):
    m = rng.integers(1, 2**16, (300, 80)).astype(np.uint16)
    d_m = cuda.to_device(m)
    tmap = hopper.tensor_map_2d(d_m, box_rows, box_cols, swizzle)
    for row, col in ((0, 0), (250, 40), (-3, -16)):
        out = np.zeros(box_rows * box_cols, np.uint16)
        _tma_kernel(box_rows, box_cols)[1, 128](tmap, col, row, 0, 0, out)
        np.testing.assert_array_equal(out, F.tma_image(F.tma_box(m, row, col, box_rows, box_cols), swizzle))


# ================================================================== named barriers, setmaxnreg
@cuda.jit
def _handoff(out):
    """Warp 1 writes, arrives at barrier 1 and goes on; warp 0 waits there for both warps, then reads. (The
    simulator starts warp 0's threads first: without the barrier they would read before warp 1 writes.)"""
    shared = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    if t >= 32:
        shared[t - 32] = t * 2.0 + 1.0
        hopper.named_barrier_arrive(1, 64)
    else:
        hopper.named_barrier_sync(1, 64)
        out[t] = shared[31 - t]


def test_named_barrier_hands_data_from_one_warp_to_another():
    out = np.zeros(32, np.float32)
    _handoff[1, 64](out)
    np.testing.assert_array_equal(out, (63 - np.arange(32)) * 2.0 + 1.0)


def _registers_kernel():
    jit = cuda.jit if SIMULATOR else cuda.jit(max_registers=128)  # setmaxnreg needs a known count at entry

    @jit
    def kernel(out):
        """FlashAttention-3's split: warpgroup 0 (the producer) gives registers up, warpgroup 1 takes them."""
        t = cuda.threadIdx.x
        if t < 128:
            hopper.setmaxnreg_dec(64)
        else:
            hopper.setmaxnreg_inc(192)
        out[t] = t + 1
    return kernel


def test_setmaxnreg_moves_registers_between_warpgroups():
    out = np.zeros(256, np.int32)
    _registers_kernel()[1, 256](out)
    np.testing.assert_array_equal(out, np.arange(1, 257))


@cuda.jit
def _bad_count(out):
    hopper.setmaxnreg_inc(100)
    out[0] = 1


@sim_only
def test_setmaxnreg_refuses_a_count_that_is_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        _bad_count[1, 128](np.zeros(1, np.int32))
