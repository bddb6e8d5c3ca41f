"""A kernel's launches described once (_launch.Launch): the general path runs them on numba arrays, and the prepared
path sees the same arguments as Specs (views by name, shape and dtype)."""
import numpy as np

from flashlab.device import get_cuda
from flashlab.kernels._launch import Arg, Launch, run_all
from flashlab.kernels.prepared import Spec, spec_view

cuda = get_cuda()  # the simulator's module on a machine without a GPU


@cuda.jit
def _add_rows(x, out, scale, seed):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i, 0] = x[i, 0] * scale + seed


@cuda.jit
def _sum_parts(parts, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = parts[i, 0] + parts[i, 1]


def test_run_all_runs_a_kernel_then_a_merge_through_a_temporary_view():
    x = cuda.to_device(np.arange(8, dtype=np.float32).reshape(8, 1))
    out = cuda.device_array(4, np.float32)
    first = Launch(_add_rows, (1,), 32, ("x", Arg("part", (8, 1)), np.float32(2.0), 0))
    merge = Launch(_sum_parts, (1,), 32, (Arg("part", (4, 2)), "out"))
    assert first.arrays == ("x", "part") and merge.arrays == ("part", "out")
    run_all([first, merge], {"x": x, "out": out}, {"part": ((4, 2), np.float32)},
            alloc=lambda shape, dt: cuda.device_array(shape, dt), seed=1)
    want = (np.arange(8) * 2.0 + 1).reshape(4, 2).sum(1)
    assert np.array_equal(out.copy_to_host(), want)


def test_spec_views_follow_the_argument():
    q = Spec.contiguous((2, 3, 8, 64), np.float16)
    assert spec_view(q, "q") == q
    words = spec_view(q, Arg("q", dtype=np.uint32))
    assert words.shape == (2, 3, 8, 32) and words.dtype == np.uint32 and words.strides[-1] == 4
    assert spec_view(words, Arg("o", dtype=np.float16)) == q
    part = Spec.contiguous((2, 3, 4, 8), np.float32)
    assert spec_view(part, Arg("o_part", (2, 12, 8))).shape == (2, 12, 8)
