"""Device arrays with a NumPy view's strides, for the tests of kernels that read strided inputs in place (the wgmma
kernels' 4-D tensor maps): a (B, N, H, d) tensor's transpose(1, 2), as a GPT makes its heads."""
import numpy as np

from flashlab.device import get_cuda


def strided_on_device(view):
    """(device array with the strides of `view`, what must stay alive while it is used). view is a NumPy view of a
    contiguous base: the simulator wraps the view itself; on a GPU the base is copied and the view described over
    the copy through __cuda_array_interface__."""
    from numba import config

    cuda = get_cuda()
    base = view.base if view.base is not None else view
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(view), base
    d_base = cuda.to_device(np.ascontiguousarray(base))
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]

    class View:
        __cuda_array_interface__ = {"shape": view.shape, "strides": view.strides, "typestr": view.dtype.str,
                                    "data": (d_base.device_ctypes_pointer.value + offset, False), "version": 3}

    return cuda.as_cuda_array(View()), d_base


def heads_of_rows(x):
    """x (B, H, N, ...) laid out as (B, N, H, ...) in memory: the same values, x's transpose(1, 2) of a contiguous
    copy (what q.view(B, N, H, d).transpose(1, 2) gives a GPT)."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2)).swapaxes(1, 2)


def words_on_device(x, dtype: str, heads_inside_rows: bool, kept: list):
    """x (B, H, N, d) rounded to the 16-bit dtype as a device array of uint32 pairs, contiguous or (heads_inside_rows)
    laid out (B, N, H, d) and read through its strides; what must stay alive while it is used goes to `kept`."""
    from flashlab import fragments as F

    words = np.ascontiguousarray(F.to_bits16(x, dtype)).view(np.uint32)
    if not heads_inside_rows:
        return get_cuda().to_device(words)
    dev, base = strided_on_device(heads_of_rows(words))
    kept.append(base)
    return dev


def zero_words_on_device(shape, heads_inside_rows: bool, kept: list):
    """(device array of zero uint32 words of `shape` (B, H, N, w), a function that returns its values on the host),
    contiguous or (heads_inside_rows) laid out (B, N, H, w), for kernels that write outputs through their strides."""
    cuda = get_cuda()
    if not heads_inside_rows:
        dev = cuda.to_device(np.zeros(shape, np.uint32))
        return dev, dev.copy_to_host
    rows = np.zeros((shape[0], shape[2], shape[1], shape[3]), np.uint32)  # (B, N, H, w) in memory
    dev, base = strided_on_device(rows.swapaxes(1, 2))
    kept.append(base)
    host = (lambda: base) if isinstance(base, np.ndarray) else base.copy_to_host  # the simulator writes base itself
    return dev, lambda: np.swapaxes(host(), 1, 2)
