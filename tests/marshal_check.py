"""flashlab's kernel arguments against numba-cuda's own, without a GPU or a driver.

kernels/prepared.py builds each kernel's argument list once (`prepared.arguments`, `marshal`) and launches it
itself (`_DirectLaunch`, or cuda.core's launch). This checks, for the argument kinds flashlab's kernels take
(arrays of ranks 1 to 4 in float32, float16, bfloat16 as uint16, int32 and the uint32 views of 16-bit pairs, with
C and other strides; int64, float32 and bool scalars; a new dropout seed at launch), that every kernel parameter
gets the bytes numba-cuda's launch of the same call would give it:

- numba-cuda's side: its own `_Kernel._prepare_args`, on a stand-in device array that exposes what it reads
  (0.22 reads size, dtype, shape, strides and device_ctypes_pointer; 0.30 reads size, dtype, shape, ptr and
  _layout.strides_in_bytes through _strided_memory_view_shim). Its values are then passed on as its launch passes
  them: 0.22 hands the ctypes values' addresses to cuLaunchKernel; 0.30 hands the list to cuda.core's launch,
  which takes a Python int as an intptr_t (a bool as one or as a C++ bool: the byte the kernel reads is the same).
- flashlab's side: `_DirectLaunch` called with a stand-in driver whose cuLaunchKernel reads each parameter's bytes
  from the kernelParams array it is given, and the cuda.core path of `PreparedKernel.launch` with a recording launch.
- the parameters and their sizes: numba-cuda's own data model (the target context's argument packer), as the
  compiled kernel declares them; the driver copies that many bytes from each kernelParams entry.

Run by the Python under test, with flashlab importable (an install, or PYTHONPATH=. from the repository root;
tests/test_plan.py runs it against the installed numba-cuda, tests/test_colab.py in the emulated Colab GPU image):

    python tests/marshal_check.py

It prints one line per argument list and `ok: ...`, or the differences and exits 1.
"""
import ctypes
import os
import sys
from types import SimpleNamespace

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # numba-cuda's own dispatcher and data model: no driver is touched

import numpy as np  # noqa: E402

STREAM, GRID, BLOCK, SHARED = 7, (3, 2), 128, 4096


class DeviceArray:
    """A stand-in for a device array: what numba-cuda's _prepare_args reads from one, in 0.22 and in 0.30."""

    __cuda_memory__ = True

    def __init__(self, spec, ptr):
        self.shape, self.strides, self.dtype = tuple(spec.shape), tuple(spec.strides), spec.dtype
        self.size = int(np.prod(spec.shape, dtype=np.int64))
        self.ptr = ptr
        self.device_ctypes_pointer = ctypes.c_void_p(ptr)
        c = spec.layout == "C"
        self._layout = SimpleNamespace(strides_in_bytes=self.strides, is_contiguous_c=c, is_contiguous_f=False,
                                       is_contiguous_any=c)

    @property
    def _strided_memory_view_shim(self):
        return self


class Kernel:  # what _prepare_args reads from its _Kernel
    extensions = []


class Driver:
    """cuda.bindings' driver as _DirectLaunch uses it; cuLaunchKernel records what the kernel would get."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUfunction = int

    def __init__(self, sizes):
        self.sizes, self.launches = sizes, []

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        entries = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        self.launches.append({"dims": (f, gx, gy, gz, bx, by, bz, shared, stream, extra),
                              "params": [ctypes.string_at(p, n) for p, n in zip(entries, self.sizes)]})
        return (0,)


def launched(value) -> bytes:
    """The bytes numba-cuda's launch passes on for one value of its argument list."""
    if isinstance(value, ctypes._SimpleCData):
        return bytes(value)
    if isinstance(value, np.generic):
        return value.tobytes()
    if isinstance(value, int):  # cuda.core: a Python int is an intptr_t
        return int(value).to_bytes(8, "little", signed=True)
    raise TypeError(f"unexpected kernel argument {value!r}")


def parameter_sizes(types_):
    """The bytes of each kernel parameter: numba-cuda's argument packer flattens the arguments into LLVM scalars
    (an array into its members), sized here for NVPTX64 (the target's data layout needs libNVVM in 0.22)."""
    from llvmlite import ir
    from numba.cuda.descriptor import cuda_target

    def size(t):
        if isinstance(t, ir.PointerType):
            return 8
        if isinstance(t, ir.IntType):
            return (t.width + 7) // 8
        return {ir.HalfType: 2, ir.FloatType: 4, ir.DoubleType: 8}[type(t)]

    return [size(t) for t in cuda_target.target_context.get_arg_packer(types_).argument_types]


def cases(Spec):
    f32, f16, u16, i32 = (np.dtype(t) for t in (np.float32, np.float16, np.uint16, np.int32))
    q = Spec.contiguous((2, 3, 5, 64), f32)
    heads_apart = Spec((2, 3, 5, 64), (1920, 128, 384, 2), f16)  # a (B, N, H, d) tensor seen as (B, H, N, d)
    padded = Spec((2, 3, 5, 64), (3840, 1280, 256, 2), u16)  # bfloat16 rows 128 apart
    return {
        "forward: float32 arrays, C order; int64, float32, bool scalars; a new seed at launch":
            ([q, q, q, q, Spec.contiguous((2, 3, 5), f32), 5, 2 ** 40 + 3, np.float32(0.125), True, False, -1], 99),
        "float16 with other strides; bfloat16 as uint16; uint32 views of 16-bit pairs and back":
            ([heads_apart, heads_apart.words(), padded, padded.words(), Spec.contiguous((6, 4, 16), f16).words(),
              Spec.contiguous((2, 3, 5, 32), np.uint32).values(f16), np.float32(-np.inf), -7, 0], None),
        "varlen and paged: int32 tables of ranks 1 and 2, a column slice, one element, NumPy scalars":
            ([Spec.contiguous((5,), i32), Spec.contiguous((3, 8), i32), Spec((4, 6), (40, 4), f32),
              Spec.contiguous((1,), f32), Spec((7,), (8,), f32), np.int64(12), np.float32(3.5), np.bool_(True),
              0], 2 ** 62 + 1),
    }


def check(name, args, seed, prepared, nd):
    types_, template, slots = prepared.arguments(args)
    sizes = parameter_sizes(types_)
    pointers = [0x7F0000000000 + 0x100000 * (i + 1) for i in range(len(slots))]
    values, it = [], iter(pointers)
    for a in args:
        values.append(DeviceArray(a, next(it)) if isinstance(a, prepared.Spec) else a)
    if seed is not None:  # the kernels' last argument, the dropout seed, written at launch
        values[-1] = seed
    theirs = []
    for t, v in zip(types_, values):
        nd._Kernel._prepare_args(Kernel(), t, v, 0, [], theirs)
    want = [launched(v) for v in theirs]
    bad = []
    if len(want) != len(sizes):
        return [f"numba-cuda's list has {len(want)} values for {len(sizes)} kernel parameters"]
    for i, (w, n) in enumerate(zip(want, sizes)):
        if len(w) < n:
            bad.append(f"parameter {i}: numba-cuda passes {len(w)} bytes for {n}")

    # the direct launch: cuLaunchKernel on the kernelParams array
    if len(template) != len(sizes):
        return bad + [f"flashlab's list has {len(template)} values for {len(sizes)} kernel parameters"]
    driver = Driver(sizes)
    direct = prepared._DirectLaunch(driver, 1234, GRID, BLOCK, template, slots, SHARED)
    prepared._CU_STREAMS[STREAM] = "stream-7"
    direct(STREAM, pointers, seed)
    got = driver.launches[-1]
    if got["dims"] != (1234, *GRID, 1, BLOCK, 1, 1, SHARED, "stream-7", 0):
        bad.append(f"direct launch: grid, block, shared memory or stream {got['dims']}")
    for i, (v, n) in enumerate(zip(direct.values, sizes)):
        if ctypes.sizeof(v) < n:
            bad.append(f"direct launch, parameter {i}: a {type(v).__name__} holds {ctypes.sizeof(v)} bytes for {n}")
    for i, (w, g, n) in enumerate(zip(want, got["params"], sizes)):
        if w[:n] != g:
            bad.append(f"direct launch, parameter {i} ({n} bytes): numba-cuda {w[:n].hex()}, flashlab {g.hex()}")

    # cuda.core's launch, PreparedKernel's other way
    calls = []
    kernel = prepared.PreparedKernel.__new__(prepared.PreparedKernel)
    kernel.direct, kernel.template, kernel.slots = None, template, slots
    kernel.config, kernel.function = "config", "function"
    kernel._launch = lambda stream, config, function, *a: calls.append((stream, config, function, a))
    prepared._STREAMS[STREAM] = "core-stream-7"
    kernel.launch(STREAM, pointers, seed)
    stream, config, function, mine = calls[-1]
    if (stream, config, function) != ("core-stream-7", "config", "function"):
        bad.append(f"cuda.core launch: stream, config or kernel {(stream, config, function)}")
    for i, (w, m, n) in enumerate(zip(want, [launched(v) for v in mine], sizes)):
        if w[:n] != m[:n] or len(m) < n:
            bad.append(f"cuda.core launch, parameter {i} ({n} bytes): numba-cuda {w[:n].hex()}, flashlab {m.hex()}")
    print(f"{'FAIL' if bad else 'ok  '} {name}: {len(args)} arguments, {len(sizes)} parameters")
    return bad


def main() -> int:
    import flashlab.device as dev

    dev._state["backend"] = "gpu"  # the kernels' modules import numba-cuda's real target; nothing is compiled
    import numba
    import numba_cuda
    from numba.cuda import dispatcher as nd

    from flashlab.kernels import prepared

    problems, params = [], 0
    for name, (args, seed) in cases(prepared.Spec).items():
        problems += [f"{name}: {p}" for p in check(name, args, seed, prepared, nd)]
        params += len(parameter_sizes(prepared.arguments(args)[0]))
    for p in problems:
        print("  " + p)
    if problems:
        print(f"FAILED: {len(problems)} differences from numba-cuda {numba_cuda.__version__} ({nd.__file__})")
        return 1
    print(f"ok: {len(cases(prepared.Spec))} argument lists, {params} kernel parameters, as numba-cuda "
          f"{numba_cuda.__version__} (numba {numba.__version__}, {nd.__file__}) passes them to flashlab's "
          f"{prepared.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
