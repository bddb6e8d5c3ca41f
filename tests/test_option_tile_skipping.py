"""The kernels visit only the tiles of the window's band (options.key_band, options.query_band): NaN in the tiles
outside it leaves the outputs finite, and in the simulator the tensor backward's Q/dO copies are recorded. In the
simulator (and on a GPU, where the NaN checks run as they are). The options against float64:
tests/test_kernel_options.py."""
import numpy as np
import pytest

import flashlab as fl
from flashlab.kernels import flash_attention, flash_attention_backward


def test_register_window_skips_key_tiles(rng):
    """Tiles outside the band are never loaded: the kernel's loop bounds, seen through the key range it reads."""
    q = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 64, 16)).astype(np.float32)
    nan_far = k.copy()
    nan_far[..., 40:, :] = np.nan  # keys no row of block 0..15 may see with window (4, 4): must never be read
    o, _ = flash_attention(q[:, :, :16], nan_far, nan_far, variant="register", block_q=16, block_k=16,
                           window_size=(4, 4))
    assert np.all(np.isfinite(o))


def inputs(rng, nq, nk, d=16, dtype=np.float16):
    q = (1.5 * rng.standard_normal((1, 1, nq, d))).astype(dtype)
    k, v = (rng.standard_normal((1, 1, nk, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((1, 1, nq, d)).astype(dtype)
    return q, k, v, do


def test_tensor_window_skips_key_tiles(rng):
    """Key tiles outside the band of a block's rows are never read: NaN keys there leave the output finite."""
    q, k, v, _ = inputs(rng, 16, 64)
    k[..., 40:, :] = np.nan  # rows 0..15 with window (4, 4) see keys 0..19; tiles 32.. must not even be loaded
    v[..., 40:, :] = np.nan
    o, _ = flash_attention(q, k, v, variant="tensor", block_q=16, block_k=16, window_size=(4, 4))
    assert np.all(np.isfinite(o))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_tensor_backward_skips_query_tiles_outside_the_band(rng, align, monkeypatch):
    """One key block (Nk = 16) and four query tiles; with window (4, 4) only the tiles that meet the band are
    loaded: NaN in q and do of the others (after the band: top_left; before it: bottom_right, where the first
    44 rows see no key) leave the gradients finite and right. A warp outside the band skips its products, so
    NaN alone would not notice a tile loaded for nothing: in the simulator the Q/dO row copies are recorded."""
    from flashlab.kernels import mma

    opts = dict(window_size=(4, 4), align=align)
    q, k, v, do = inputs(rng, 64, 16)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, do)]
    o, lse = fl.reference_attention(*f64[:3], **opts)
    want = fl.flash_attention_v2_backward(*f64[:3], o, lse, f64[3], **opts)
    far = slice(32, 64) if align == "top_left" else slice(0, 32)  # rows 20.. (top_left), ..43 (bottom_right)
    assert np.isinf(lse[..., far]).all()
    q[..., far, :] = np.nan
    do[..., far, :] = np.nan
    rows = set()
    if not fl.device.has_gpu():
        copy = mma.cp_async16_flat

        def recording(dst, dst_index, src, base, offset, src_bytes):
            if src.shape[0] == 64 and int(src_bytes):  # Q or dO (K and V have 16 rows)
                rows.add((int(base) + int(offset)) // (src.strides[0] // src.itemsize))
            return copy(dst, dst_index, src, base, offset, src_bytes)

        monkeypatch.setattr(mma, "cp_async16_flat", recording)
    got = flash_attention_backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do, variant="tensor",
                                   block_q=16, block_k=16, **opts)
    assert not rows & set(range(64)[far]), f"rows outside the band were copied: {sorted(rows & set(range(64)[far]))}"
    assert fl.device.has_gpu() or rows, "no Q/dO copy was recorded (the kernel no longer uses cp_async16_flat?)"
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all(), f"{name} has NaN or inf"
        assert fl.relative_error(g, w) < 2e-3, name
