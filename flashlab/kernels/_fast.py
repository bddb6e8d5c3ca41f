"""Host overhead: the CPU time of one call before the GPU starts, and how flashlab keeps it small (issue 12).

A call with torch tensors, done the general way (forward.py, backward.py), pays for: wrapping each tensor as a
numba array (cuda.as_cuda_array builds a DeviceNDArray, and synchronises with the tensor's stream when the
tensor names one), the shape and dtype checks, the plan, numba's dispatch (typing every argument to find
the compiled kernel) and its argument marshalling. Here the first call with given shapes, strides, dtypes
and options does all of that once and records a `PreparedCall`: the plan, the compiled kernels, grids, and
each kernel's argument list with the data pointers left blank. A later call with the same key only reads
the tensors' pointers, allocates the outputs with torch and launches.

Who uses it: the forward, plain (PreparedForward here, GQA included) and with the library's options
(forward._with_extras);
the register backward (PreparedBackward here); the tensor backward (tensor_backward.PreparedBackward); varlen
(varlen.PreparedVarlen); paged decoding (paged.PreparedPaged: the block table and lengths are arguments, not keys). The dropout seed is not part of a key: each launch writes it into the kernel's last
argument (PreparedKernel.launch(..., seed)), so a new seed every training step stays on this path.

The argument list is the one numba-cuda builds (`_Kernel._prepare_args`): per array (meminfo 0, parent 0,
size, itemsize, pointer, shape..., strides in bytes...), int64 as ctypes.c_int64, float32 as ctypes.c_float;
tests/test_plan.py checks the two agree. Launches go to torch's current stream. This path needs numba-cuda's
`_Kernel` internals (checked once: `available()`), and launches with cuLaunchKernel on a kernelParams array
built once (`_DirectLaunch`; FLASHLAB_DIRECT_LAUNCH=0 goes through cuda.core's launch instead). It is on by
default since its GPU run (benchmarks/results/host.csv); FLASHLAB_FAST_LAUNCH=0 sends every call the general way.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_CALLS: dict = {}  # call key -> PreparedCall
_STREAMS: dict = {}  # stream handle -> cuda.core Stream
_CU_STREAMS: dict = {}  # stream handle -> cuda.bindings CUstream
MAX_CALLS = 256


def available() -> bool:
    """True on a GPU with the numba-cuda internals this path uses, unless FLASHLAB_FAST_LAUNCH=0."""
    if os.environ.get("FLASHLAB_FAST_LAUNCH", "1").strip() in ("0", "false", "no"):
        return False
    return _supported()


@lru_cache(maxsize=1)
def _supported() -> bool:
    from ..device import has_gpu

    if not has_gpu():
        return False
    try:
        from numba.cuda import dispatcher as nd

        return all(hasattr(nd, name) for name in ("launch", "LaunchConfig", "CUDA_CORE_GE_1_0", "_Kernel"))
    except Exception:
        return False


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
        out.append(spec_or_value)
    else:
        raise NotImplementedError(f"fast launch: argument type {numba_type}")
    return None


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
        from numba.cuda import dispatcher as nd

        from ._launch import allow_dynamic_shared

        types_ = tuple(a.numba_type if isinstance(a, Spec) else scalar_type(a) for a in args)
        dispatcher.compile(types_)
        kernel = dispatcher.overloads[types_]
        if getattr(kernel, "debug", False):
            raise RuntimeError("fast launch: debug kernels check errors after each launch; use the general path")
        self.template, self.slots = [], []
        for a, t in zip(args, types_):
            slot = marshal(a, t, self.template)
            if slot is not None:
                self.slots.append(slot)
        allow_dynamic_shared(kernel, shared)
        self.function = kernel._codelibrary.get_cufunc().kernel
        options = {"grid": tuple(grid), "block": int(block), "shmem_size": int(shared)}
        options["is_cooperative" if nd.CUDA_CORE_GE_1_0 else "cooperative_launch"] = False
        self.config = nd.LaunchConfig(**options)
        self._launch = nd.launch
        self.kernel = kernel
        self.direct = _DirectLaunch.make(kernel, grid, block, self.template, self.slots, shared)

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
    """cuLaunchKernel with a kernelParams array built once: each argument lives in its own ctypes value, and a
    call only writes the data pointers into theirs. cuda.core's launch instead converts every argument on
    every call (an attention call has about 70: each array is 5 + 2 * ndim words)."""

    def __init__(self, driver, handle, grid, block, template, slots, shared=0):
        def value(a):
            if isinstance(a, bool):
                return ctypes.c_bool(a)
            return ctypes.c_int64(a) if isinstance(a, int) else type(a)(a.value)
        self.values = [value(a) for a in template]
        self.params = (ctypes.c_void_p * len(self.values))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.params)
        self.pointers = [self.values[i] for i in slots]
        # numba-cuda loads kernels as CUkernel handles; cuLaunchKernel takes one in place of a CUfunction
        self.driver, self.handle = driver, driver.CUfunction(int(handle))
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block, self.shared = int(block), int(shared)

    @classmethod
    def make(cls, kernel, grid, block, template, slots, shared=0):
        """None where cuda.bindings is missing: the caller then launches through cuda.core."""
        if os.environ.get("FLASHLAB_DIRECT_LAUNCH", "1").strip() in ("0", "false", "no"):
            return None
        try:
            from cuda.bindings import driver
        except ImportError:
            return None
        return cls(driver, kernel._codelibrary.get_cufunc().handle, grid, block, template, slots, shared)

    def __call__(self, stream: int, pointers, seed=None):
        for holder, ptr in zip(self.pointers, pointers):
            holder.value = ptr
        if seed is not None:  # the last argument: the dropout seed
            self.values[-1].value = seed
        gx, gy, gz = self.grid
        err, = self.driver.cuLaunchKernel(self.handle, gx, gy, gz, self.block, 1, 1, self.shared, _cu_stream(stream),
                                          self.address, 0)
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def current_stream(t) -> int:
    """The handle of torch's current stream on t's device (torch's raw getter: ~1 µs, against ~5 µs for
    torch.cuda.current_stream(...).cuda_stream)."""
    import torch

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
    import torch

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
    from ._launch import to_host

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


# ---------------------------------------------------------------------------------------------- forward
class PreparedForward:
    """flash_attention for torch tensors of one key: torch allocates the outputs, then one launch (or the
    split kernel and the merge). k and v may have fewer heads (GQA: the build that maps query heads to K/V heads).
    extras: the library's options (register.Extras), or None; call(q, k, v, seed) passes the dropout seed to the
    kernel."""

    def __init__(self, plan, scale, q, k, v, extras=None):
        import torch

        from .decoding import build_merge
        from .register import LOG2E

        p = plan.problem
        self.plan = plan
        self.words = plan.variant == "tensor" and p.dtype != "float32"
        self.out_dtype = q.dtype
        self.shapes = ((p.B, p.H, p.Nq, p.d), (p.B, p.H, p.Nq))
        self.part_shapes = ((p.B, p.H, plan.splits, p.Nq, p.d), (p.B, p.H, plan.splits, p.Nq))
        ins = [torch_spec(x) for x in (q, k, v)]
        o = Spec.contiguous(self.shapes[0], {torch.float32: np.float32, torch.float16: np.float16,
                                             torch.bfloat16: np.uint16}[q.dtype])
        lse = Spec.contiguous(self.shapes[1], np.float32)
        if self.words:
            ins, o = [s.words() for s in ins], o.words()
        scalars = (p.Nq, p.Nk, p.H, np.float32(scale * LOG2E))
        if plan.variant in ("register", "tensor"):
            scalars += (np.int64(0),)  # the dropout seed, set on each call that has dropout
        kernel = self._kernel(extras, gqa=k.shape[1] != q.shape[1])
        threads = plan.threads
        if plan.splits == 1:
            self.kernels = [PreparedKernel(kernel, plan.grid, threads, ins + [o, lse, *scalars])]
        else:
            S = plan.splits
            o_part = Spec.contiguous(self.part_shapes[0], np.float32)
            lse_part = Spec.contiguous(self.part_shapes[1], np.float32)
            views = [o_part.reshape((p.B, p.H * S, p.Nq, p.d)), lse_part.reshape((p.B, p.H * S, p.Nq))]
            out = o.values(np.float16) if self.words else o
            self.kernels = [PreparedKernel(kernel, plan.grid, threads, ins + views + list(scalars)),
                            PreparedKernel(build_merge(p.d, normalised=True), (p.Nq, p.H, p.B), p.d,
                                           [lse_part, lse_part, o_part, out, lse, S])]

    def _kernel(self, extras, gqa):
        plan, p = self.plan, self.plan.problem
        split = plan.splits > 1
        if plan.variant == "register":
            from .register import build

            return build(p.d, plan.config, p.causal, split=split, heavy_first=plan.heavy_first, gqa=gqa,
                         extras=extras)
        if plan.variant == "tensor":
            from .tensor import build

            return build(p.d, plan.config, p.causal, plan.precision, split=split, heavy_first=plan.heavy_first,
                         gqa=gqa, extras=extras)
        from .shared import build

        return build(p.d, *plan.config, p.causal, gqa=gqa)

    def __call__(self, q, k, v, seed=None):
        import torch

        stream = current_stream(q)
        o = torch.empty(self.shapes[0], dtype=self.out_dtype, device=q.device)
        lse = torch.empty(self.shapes[1], dtype=torch.float32, device=q.device)
        ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr()]
        if len(self.kernels) == 1:
            self.kernels[0].launch(stream, ptrs + [o.data_ptr(), lse.data_ptr()], seed)
        else:
            o_part = torch.empty(self.part_shapes[0], dtype=torch.float32, device=q.device)
            lse_part = torch.empty(self.part_shapes[1], dtype=torch.float32, device=q.device)
            self.kernels[0].launch(stream, ptrs + [o_part.data_ptr(), lse_part.data_ptr()], seed)
            self.kernels[1].launch(stream, [lse_part.data_ptr(), lse_part.data_ptr(), o_part.data_ptr(),
                                            o.data_ptr(), lse.data_ptr()])
        return o, lse


# --------------------------------------------------------------------------------------------- backward
class PreparedBackward:
    """flash_attention_backward for torch tensors of one key: preprocess, dkdv (and cast for float16)."""

    def __init__(self, plan, scale, rows, q, k, v, o, lse, do):
        import torch

        from .backward import make_kernels

        p = plan.problem
        bq, bk, threads = plan.config
        preprocess, dkdv, cast = make_kernels(p.d, bq, bk, threads, heavy_first=plan.heavy_first)
        self.dtype, self.half = q.dtype, q.dtype != torch.float32
        self.q_shape, self.k_shape = (p.B, p.H, p.Nq, p.d), (p.B, p.H, p.Nk, p.d)
        specs = {n: torch_spec(x) for n, x in zip(("q", "k", "v", "o", "lse", "do"), (q, k, v, o, lse, do))}
        dt = specs["q"].dtype
        D = Spec.contiguous((p.B, p.H, p.Nq), np.float32)
        dq = Spec.contiguous(self.q_shape, np.float32)
        dk = Spec.contiguous(self.k_shape, dt)
        self.kernels = [PreparedKernel(preprocess, ((p.Nq + rows - 1) // rows, p.H, p.B), rows,
                                       [specs["o"], specs["do"], D, dq]),
                        PreparedKernel(dkdv, plan.grid, threads,
                                       [specs["q"], specs["k"], specs["v"], specs["do"], specs["lse"], D, dq, dk, dk,
                                        np.float32(scale), bool(p.causal), 0, 0, 0])]  # unused: varlen tables, seed
        if self.half:
            n = int(np.prod(self.q_shape))
            self.kernels.append(PreparedKernel(cast, ((n + 255) // 256,), 256, [Spec.contiguous((n,), np.float32),
                                                                               Spec.contiguous((n,), dt)]))

    def __call__(self, q, k, v, o, lse, do):
        import torch

        stream = current_stream(q)
        new = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device)  # noqa: E731
        D, dq = new(self.q_shape[:3], torch.float32), new(self.q_shape, torch.float32)
        dk, dv = new(self.k_shape, self.dtype), new(self.k_shape, self.dtype)
        self.kernels[0].launch(stream, [o.data_ptr(), do.data_ptr(), D.data_ptr(), dq.data_ptr()])
        self.kernels[1].launch(stream, [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr(),
                                        D.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()])
        if self.half:
            dq16 = new(self.q_shape, self.dtype)
            self.kernels[2].launch(stream, [dq.data_ptr(), dq16.data_ptr()])
            dq = dq16
        return dq, dk, dv
