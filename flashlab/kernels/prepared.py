"""Prepared launches: the host time of a call with torch tensors, and how flashlab keeps it small.

A call with torch tensors, done the general way (forward.py, backward.py), pays for: wrapping each tensor as a
numba array (cuda.as_cuda_array builds a DeviceNDArray, and synchronises with the tensor's stream when the
tensor names one), the shape and dtype checks, the plan, numba's dispatch (typing every argument to find
the compiled kernel) and its argument marshalling. The first call with given shapes, strides, dtypes and
options does all of that once and stores a prepared call (`store`, found again by `lookup`): the plan, the
compiled kernels, grids, and each kernel's argument list with the data pointers left blank (`PreparedKernel`).
A later call with the same key only reads the tensors' pointers, allocates the outputs with torch and launches.

This module is the generic part; each entry point keeps its own prepared call beside its general path:
forward.PreparedForward (plain, GQA and the library's options), backward.PreparedRegisterBackward and
backward.PreparedTensorBackward, varlen.PreparedVarlen and paged.PreparedPaged (the block table and lengths
are arguments, not keys). The dropout seed is not part of a key: each launch writes it into the kernel's last
argument (PreparedKernel.launch(..., seed)), so a new seed every training step stays on this path.

The argument list is the one numba-cuda builds (`_Kernel._prepare_args`): per array (meminfo 0, parent 0,
size, itemsize, pointer, shape..., strides in bytes...), int64 as ctypes.c_int64, float32 as ctypes.c_float;
tests/marshal_check.py checks, without a GPU, that each kernel parameter gets the bytes numba-cuda's own launch
would give it (tests/test_plan.py runs it against the installed numba-cuda, tests/test_colab.py against Colab's).
Launches go to torch's current stream, with cuLaunchKernel on a kernelParams array built once (`_DirectLaunch`;
FLASHLAB_DIRECT_LAUNCH=0 goes through cuda.core's launch, as numba-cuda imports it, instead).

Whether calls take this path (`available()`, checked once per setting) is FLASHLAB_FAST_LAUNCH's:
- unset or 1: on where numba-cuda has `_Kernel` and cuda.core's launch (`launch`, `LaunchConfig`,
  `CUDA_CORE_GE_1_0` in its dispatcher, as 0.30 has): the setup measured on a GPU (benchmarks/results/host.csv).
- 0: off; every call goes the general way.
- direct: on wherever numba-cuda has `_Kernel` and cuda.bindings imports, every kernel launched with
  `_DirectLaunch` (FLASHLAB_DIRECT_LAUNCH is not read). This is for numba-cuda releases without cuda.core's
  launch, such as Colab's 0.22, where the default leaves the path off: their argument layout is checked on the CPU
  (tests/marshal_check.py), but the path has not yet run on a GPU with them: scripts/gpu_check_colab_fast_path.sh
  is that check, on Colab's numba and numba-cuda brought to a GPU machine by scripts/colab_gpu_bundle.py.
`state()` says which applies; flashlab.doctor() prints it as `fast launch`.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter

import numpy as np

from ..device import has_gpu
from ._launch import Arg, allow_dynamic_shared, to_host

_CALLS: dict = {}  # call key -> a prepared call
_STREAMS: dict = {}  # stream handle -> cuda.core Stream
_CU_STREAMS: dict = {}  # stream handle -> cuda.bindings CUstream
MAX_CALLS = 256


def launch_mode() -> str:
    """FLASHLAB_FAST_LAUNCH read: "off" (0, false, no), "direct" (direct) or "on" (unset, 1, anything else)."""
    value = os.environ.get("FLASHLAB_FAST_LAUNCH", "1").strip().lower()
    if value in ("0", "false", "no"):
        return "off"
    return "direct" if value == "direct" else "on"


def available() -> bool:
    """True where calls with torch tensors take the prepared path (FLASHLAB_FAST_LAUNCH, in the module docstring)."""
    mode = launch_mode()
    return mode != "off" and _supported(mode == "direct")


def state() -> str:
    """Why the prepared path is on or off, in one word: "on"; "direct" (on through FLASHLAB_FAST_LAUNCH=direct);
    "off" (FLASHLAB_FAST_LAUNCH=0); "no-gpu"; "no-core-launch" (numba-cuda has `_Kernel` and cuda.bindings
    imports, but its dispatcher has no cuda.core launch: Colab's 0.22, where FLASHLAB_FAST_LAUNCH=direct would turn
    the path on); "no-bindings" (FLASHLAB_FAST_LAUNCH=direct, but cuda.bindings does not import); "unsupported"
    (numba-cuda lacks what the path uses)."""
    mode = launch_mode()
    if mode == "off":
        return "off"
    if available():
        return "direct" if mode == "direct" else "on"
    if not has_gpu():
        return "no-gpu"
    nd = _numba_dispatcher()
    if nd is None or not hasattr(nd, "_Kernel"):
        return "unsupported"
    if mode == "direct":
        return "no-bindings"
    return "no-core-launch" if _bindings() else "unsupported"


@lru_cache(maxsize=2)
def _supported(direct_only: bool) -> bool:
    """This GPU and numba-cuda can take the prepared path: numba-cuda's `_Kernel` (the argument layout marshal
    follows) and a launch. By default that is cuda.core's launch as numba-cuda's dispatcher imports it (the
    fallback of _DirectLaunch: a setup that has run on GPUs); with direct_only (FLASHLAB_FAST_LAUNCH=direct),
    cuda.bindings for _DirectLaunch alone. Colab's numba-cuda 0.22 has `_Kernel` but no cuda.core launch in its
    dispatcher: the direct launch alone would serve there (PreparedKernel needs nothing else), but it has not run
    on a GPU with that release, so by default the path stays off there."""
    if not has_gpu():
        return False
    nd = _numba_dispatcher()
    if nd is None or not hasattr(nd, "_Kernel"):
        return False
    return _bindings() if direct_only else _core_launch(nd)


def _numba_dispatcher():
    """numba-cuda's dispatcher module, or None where it does not import."""
    try:
        from numba.cuda import dispatcher as nd
    except Exception:
        return None
    return nd


def _bindings() -> bool:
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _core_launch(nd) -> bool:
    return all(hasattr(nd, name) for name in ("launch", "LaunchConfig", "CUDA_CORE_GE_1_0"))


def _direct_launch_on() -> bool:
    """PreparedKernel launches with _DirectLaunch where cuda.bindings imports: always under
    FLASHLAB_FAST_LAUNCH=direct, else unless FLASHLAB_DIRECT_LAUNCH=0."""
    if launch_mode() != "direct" and os.environ.get("FLASHLAB_DIRECT_LAUNCH", "1").strip() in ("0", "false", "no"):
        return False
    return _bindings()


@dataclass(frozen=True)
class Spec:
    """An array argument: shape, strides in bytes, dtype (a NumPy dtype; uint32 for 16-bit pairs)."""

    shape: tuple
    strides: tuple
    dtype: np.dtype

    @classmethod
    def contiguous(cls, shape, dtype):
        dtype = np.dtype(dtype)
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(tuple(shape), tuple(reversed(strides)), dtype)

    @property
    def layout(self) -> str:
        """"C" when the strides are exactly C-contiguous ones, else "A" (numba compiles either)."""
        return "C" if self.strides == Spec.contiguous(self.shape, self.dtype).strides else "A"

    @property
    def numba_type(self):
        from numba import from_dtype, types

        return types.Array(from_dtype(self.dtype), len(self.shape), self.layout)

    def words(self):
        """The same memory as uint32 pairs of 16-bit values (the tensor kernel's view): last dim halved."""
        return Spec(self.shape[:-1] + (self.shape[-1] // 2,), self.strides[:-1] + (4,), np.dtype(np.uint32))

    def values(self, dtype):
        """uint32 pairs seen as 16-bit values of `dtype` (float16): last dim doubled."""
        return Spec(self.shape[:-1] + (self.shape[-1] * 2,), self.strides[:-1] + (2,), np.dtype(dtype))

    def reshape(self, shape):
        """A contiguous array seen with another shape (contiguous specs only)."""
        assert self.layout == "C", "only contiguous arrays are reshaped"
        return Spec.contiguous(shape, self.dtype)


def marshal(spec_or_value, numba_type, out: list):
    """Append one argument the way numba-cuda's _Kernel._prepare_args does; returns the index of the data
    pointer (arrays, left as 0) or None (scalars)."""
    from numba import types

    if isinstance(numba_type, types.Array):
        spec = spec_or_value
        size = int(np.prod(spec.shape, dtype=np.int64))
        out.extend([0, 0, size, spec.dtype.itemsize])
        slot = len(out)
        out.append(0)
        out.extend(spec.shape)
        out.extend(spec.strides)
        return slot
    if isinstance(numba_type, types.Integer):
        out.append(getattr(ctypes, f"c_{numba_type}")(spec_or_value))
    elif numba_type == types.float32:
        out.append(ctypes.c_float(spec_or_value))
    elif numba_type == types.boolean:
        out.append(bool(spec_or_value))  # a Python bool: NumPy's has no ctypes value for _DirectLaunch to copy
    else:
        raise NotImplementedError(f"fast launch: argument type {numba_type}")
    return None


def arguments(args):
    """(numba types, argument list with blank pointers, the pointers' indices) of a kernel's arguments: Specs
    for arrays, Python or NumPy scalars for the rest."""
    types_ = tuple(a.numba_type if isinstance(a, Spec) else scalar_type(a) for a in args)
    template, slots = [], []
    for a, t in zip(args, types_):
        slot = marshal(a, t, template)
        if slot is not None:
            slots.append(slot)
    return types_, template, slots


def scalar_type(value):
    from numba import types

    if isinstance(value, (bool, np.bool_)):
        return types.boolean
    if isinstance(value, np.float32):
        return types.float32
    if isinstance(value, (int, np.integer)):
        return types.int64
    raise TypeError(f"fast launch: unsupported scalar {value!r}")


class PreparedKernel:
    """One kernel launch with its argument list built once; launch(stream, pointers) fills in the pointers."""

    def __init__(self, dispatcher, grid, block, args, shared=0):
        """shared: bytes of dynamic shared memory per block (the kernel opts in where it passes 48 KB)."""
        nd = _numba_dispatcher()
        types_, self.template, self.slots = arguments(args)
        dispatcher.compile(types_)
        kernel = dispatcher.overloads[types_]
        if getattr(kernel, "debug", False):
            raise RuntimeError("fast launch: debug kernels check errors after each launch; use the general path")
        allow_dynamic_shared(kernel, shared)
        self.kernel = kernel
        self.direct = _DirectLaunch.make(kernel, grid, block, self.template, self.slots, shared)
        if self.direct is None:  # through cuda.core (available() made sure one of the two exists)
            if not _core_launch(nd):
                raise RuntimeError("fast launch: this numba-cuda has no cuda.core launch and cuda.bindings does not "
                                   "import; set FLASHLAB_FAST_LAUNCH=0")
            self.function = kernel._codelibrary.get_cufunc().kernel
            options = {"grid": tuple(grid), "block": int(block), "shmem_size": int(shared)}
            options["is_cooperative" if nd.CUDA_CORE_GE_1_0 else "cooperative_launch"] = False
            self.config = nd.LaunchConfig(**options)
            self._launch = nd.launch

    def launch(self, stream: int, pointers, seed=None):
        """Launch on the CUDA stream with this handle (torch's current stream). seed: a new value for the last
        argument, the kernels' dropout seed (an int64), so that a new seed needs no new preparation."""
        if self.direct is not None:
            return self.direct(stream, pointers, seed)
        args = list(self.template)
        for slot, ptr in zip(self.slots, pointers):
            args[slot] = ptr
        if seed is not None:
            args[-1] = ctypes.c_int64(seed)
        self._launch(stream_for(stream), self.config, self.function, *args)


class _DirectLaunch:
    """cuLaunchKernel with a kernelParams array built once: the data pointers live in one ctypes array, which a call
    writes with one slice assignment, and every other argument in a ctypes value of its own, written once (the seed
    on each call that passes one). cuda.core's launch instead converts every argument on every call (an attention
    call has about 70: each array is 5 + 2 * ndim words)."""

    def __init__(self, driver, handle, grid, block, template, slots, shared=0):
        def value(a):
            if isinstance(a, bool):
                return ctypes.c_bool(a)
            return ctypes.c_int64(a) if isinstance(a, int) else type(a)(a.value)
        # the data pointers side by side: one slice assignment writes them (C's loop, not Python's)
        self.ptrs = (ctypes.c_uint64 * len(slots))()
        self.values = [value(a) for a in template]
        addresses = [ctypes.addressof(v) for v in self.values]
        for i, slot in enumerate(slots):
            addresses[slot] = ctypes.addressof(self.ptrs) + 8 * i
        self.params = (ctypes.c_void_p * len(self.values))(*addresses)
        self.address = ctypes.addressof(self.params)
        # numba-cuda 0.30 loads kernels as CUkernel handles, older ones (Colab's 0.22) as CUfunction; cuLaunchKernel
        # takes either
        self.handle = driver.CUfunction(int(handle))
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block, self.shared = int(block), int(shared)
        self.cu_launch, self.success = driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS

    @classmethod
    def make(cls, kernel, grid, block, template, slots, shared=0):
        """None where cuda.bindings is missing or FLASHLAB_DIRECT_LAUNCH=0: the caller then launches through
        cuda.core."""
        if not _direct_launch_on():
            return None
        from cuda.bindings import driver

        return cls(driver, kernel._codelibrary.get_cufunc().handle, grid, block, template, slots, shared)

    def __call__(self, stream: int, pointers, seed=None):
        self.ptrs[:] = pointers
        if seed is not None:  # the last argument: the dropout seed
            self.values[-1].value = seed
        gx, gy, gz = self.grid
        err, = self.cu_launch(self.handle, gx, gy, gz, self.block, 1, 1, self.shared, _cu_stream(stream), self.address,
                              0)
        if err != self.success:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def current_stream(t) -> int:
    """The handle of torch's current stream on t's device (torch's raw getter: ~1 µs, against ~5 µs for
    torch.cuda.current_stream(...).cuda_stream)."""
    import torch  # optional: only torch tensors come here

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(t.get_device()) if raw is not None else torch.cuda.current_stream(t.device).cuda_stream


def _cu_stream(handle: int):
    s = _CU_STREAMS.get(handle)
    if s is None:
        from cuda.bindings import driver

        s = _CU_STREAMS[handle] = driver.CUstream(handle)
    return s


def stream_for(handle: int):
    s = _STREAMS.get(handle)
    if s is None:
        from cuda.core import Stream

        s = _STREAMS[handle] = Stream.from_handle(handle)
    return s


def torch_spec(t) -> Spec:
    import torch  # optional: only torch tensors come here

    itemsize = t.element_size()
    dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[t.dtype]
    return Spec(tuple(t.shape), tuple(s * itemsize for s in t.stride()), np.dtype(dtype))


def torch_key(*tensors):
    """What a prepared call depends on, or None when these are not all CUDA tensors."""
    key = []
    for t in tensors:
        if not (type(t).__module__.startswith("torch") and getattr(t, "is_cuda", False)):
            return None
        key.append((t.shape, t.stride(), t.dtype, t.get_device()))
    return tuple(key)


def lookup(key):
    return _CALLS.get(key)


def prepared_key(name: str, tensors, *parts, options: dict):
    """The key of a prepared call with the library's options: (name, the tensors' torch_key, parts...,
    options_key of the options but the dropout seed, which each launch takes), or None where the call goes the
    general way (the path is off, the tensors are not all CUDA tensors, or an option cannot be keyed)."""
    if not available():
        return None
    key, opts = torch_key(*tensors), options_key({n: x for n, x in options.items() if n != "seed"})
    return None if key is None or opts is None else (name, key, *parts, opts)


def options_key(options: dict):
    """A hashable key for the library's options (arrays such as ALiBi slopes by their bytes), or None when one of
    them cannot be keyed (the call then goes the general way)."""
    def value(x):
        if isinstance(x, list):
            return tuple(x)
        if x is not None and not isinstance(x, (str, bytes, int, float, tuple)):
            a = to_host(x)
            return a.dtype.str, a.shape, a.tobytes()
        return x

    try:
        key = tuple(sorted((name, value(x)) for name, x in options.items()))
        hash(key)
    except (TypeError, ValueError, AttributeError):
        return None
    return key


def store(key, call):
    if len(_CALLS) >= MAX_CALLS:
        _CALLS.pop(next(iter(_CALLS)))
    _CALLS[key] = call
    return call




# --------------------------------------------------------------------------------- from launch descriptions
def spec_view(spec: Spec, arg) -> Spec:
    """The Spec a Launch argument sees: the named array's, reshaped and/or reinterpreted as _launch.Arg says."""
    if isinstance(arg, str):
        return spec
    if arg.dtype is not None and np.dtype(arg.dtype) != spec.dtype:
        spec = spec.words() if np.dtype(arg.dtype) == np.uint32 else spec.values(arg.dtype)
    return spec.reshape(arg.shape) if arg.shape is not None else spec


class PreparedLaunches:
    """A kernel module's launch descriptions (kernels, grids, arguments), prepared once for arrays with the given
    Specs: a call passes the data pointers of the caller's arrays in the order `inputs` names them, and torch
    allocates the temporaries (split-KV's partial outputs, the backward's D) on the inputs' device, in one block.
    Each kernel's pointers are picked from the call's by position (operator.itemgetter), so a call builds no dict."""

    def __init__(self, launches, specs: dict, inputs: tuple, temporaries: dict | None = None, seeded: int = 0,
                 known: dict | None = None):
        """launches: _launch.Launch descriptions, run in order; specs: name -> Spec of every array they name but
        the temporaries; inputs: the names of the caller's arrays, in the order a call passes their pointers;
        temporaries: name -> (shape, NumPy dtype), contiguous; seeded: the index of the launch that takes the seed;
        known: name -> data pointer of arrays prepared with the call (its host arrays, kept on the device)."""
        self.temporaries, self.known = dict(temporaries or {}), dict(known or {})
        specs = dict(specs)
        for name, (shape, dtype) in self.temporaries.items():
            specs[name] = Spec.contiguous(shape, dtype)
        order = (*inputs, *self.known, *self.temporaries)  # a call's pointers: the caller's, known, temporaries
        missing = sorted({n for launch in launches for n in launch.arrays} - set(order))
        if missing:
            raise ValueError(f"the launches read arrays the call does not pass: {missing}; inputs={tuple(inputs)}")
        self.n_inputs, self.known_pointers = len(inputs), tuple(self.known.values())
        self.arrays = [launch.arrays for launch in launches]  # each launch's arrays by name, in argument order
        self.kernels = []
        for i, launch in enumerate(launches):
            args = [spec_view(specs[a if isinstance(a, str) else a.name], a) if isinstance(a, (str, Arg)) else a
                    for a in launch.args]
            kernel = PreparedKernel(launch.kernel, launch.grid, launch.block, args, launch.shared)
            self.kernels.append((kernel.direct or kernel.launch, _picker([order.index(n) for n in launch.arrays]),
                                 i == seeded))
        # the temporaries share one allocation (one torch.empty a call, not one each): each starts at a multiple of
        # 256 bytes of it
        offsets, end = [], 0
        for shape, dtype in self.temporaries.values():
            offsets.append(end)
            end += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // 256) * 256
        self.temporary_offsets, self.temporary_bytes = tuple(offsets), max(end, 256)

    @classmethod
    def of(cls, described, specs: dict, inputs: tuple, device):
        """Prepare a kernel module's _launch.Launches for the caller's arrays (specs: name -> Spec; inputs: the
        order a call passes their pointers): its host arrays (ALiBi slopes, varlen's tables) go to `device` once,
        and stay there with this call."""
        import torch  # optional: only torch tensors come here

        kept = {name: torch.from_numpy(np.ascontiguousarray(x)).to(device) for name, x in described.host.items()}
        specs = dict(specs, **{name: Spec.contiguous(x.shape, x.dtype) for name, x in described.host.items()})
        self = cls(described.launches, specs, inputs, described.temporaries, described.seeded,
                   {name: t.data_ptr() for name, t in kept.items()})
        self.kept = kept
        return self

    def __call__(self, stream: int, pointers: tuple, device, seed=None):
        """Launch every kernel on the stream; pointers: the data pointers of the caller's arrays, in the order of
        `inputs` (the host arrays' are known)."""
        if len(pointers) != self.n_inputs:
            raise ValueError(f"expected {self.n_inputs} data pointers (the prepared inputs); got {len(pointers)}")
        values = pointers + self.known_pointers
        if self.temporaries:
            import torch  # optional: only torch tensors come here

            # held until every kernel is enqueued; freed at return, the block goes back to torch's cache for later
            # work on this stream, which runs after these kernels
            held = torch.empty(self.temporary_bytes, dtype=torch.uint8, device=device)
            base = held.data_ptr()
            values += tuple([base + offset for offset in self.temporary_offsets])
        for launch, pick, seeded in self.kernels:
            launch(stream, pick(values), seed if seeded else None)


def _picker(indices):
    """values -> the values at `indices`, as a tuple (operator.itemgetter, which returns a lone value bare)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda values: (values[i],)
    return itemgetter(*indices)

