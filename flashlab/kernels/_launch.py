"""Moving arrays in and out of the kernels, and checking them first.

Every kernel wrapper (forward and backward) does the same three steps:

    q_d, kind = to_device(q, "q")              # NumPy -> copied to the GPU; numba / torch CUDA -> no copy
    B, H, Nq, Nk, d, scale = check_kernel_inputs(q_d, k_d, v_d, causal=causal, scale=scale)
    o_d = empty((B, H, Nq, d), q_d.dtype, kind, like=q)   # outputs in the memory the caller uses
    ... launch ...
    return like_input(o_d, kind)               # back as NumPy / numba / torch, like the input

Checks reuse flashlab._inputs on zero-size stand-ins ("shells") of the device arrays, so the messages are
the same as the NumPy API's and no device memory is read.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .._inputs import check_attention_inputs, check_backward_inputs
from ..device import get_cuda

SUPPORTED_D = (16, 32, 64, 128)
KERNEL_DTYPES = (np.float16, np.float32)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def to_device(x, name: str):
    """(device_array, kind) for an input array; kind is "numpy", "numba" or "torch".

    - numba device arrays (and anything with __cuda_array_interface__, e.g. CuPy) pass through: "numba".
    - torch CUDA tensors are wrapped through __cuda_array_interface__, no copy: "torch".
    - NumPy arrays (and lists) are copied to the device, made C-contiguous first: "numpy".
    """
    cuda = get_cuda()
    if _is_torch(x):
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on the CPU; pass {name}.cuda() or {name}.numpy()")
        try:
            return cuda.as_cuda_array(x.detach()), "torch"
        except Exception as exc:  # e.g. bfloat16 has no __cuda_array_interface__ typestr numba knows
            raise TypeError(f"{name}: torch tensor of dtype {x.dtype} is not supported ({exc}); "
                            "use torch.float32 or torch.float16") from None
    if _is_device_array(cuda, x):
        return x, "numba"
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x), "numba"
    arr = np.asarray(x)
    if arr.dtype.type in KERNEL_DTYPES:  # other dtypes are reported by check_kernel_inputs
        arr = np.ascontiguousarray(arr)
    return cuda.to_device(arr), "numpy"


def to_host(x) -> np.ndarray:
    """A NumPy copy of a small array (cu_seqlens, a block table) given as NumPy, a list, a torch tensor or a numba
    device array: what the host needs to check it and to plan the launch."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


# The tensor kernels address a tile's rows as 32-bit offsets from the tile's first element (mma.cp_async16_flat):
# with tiles of at most 1024 rows, rows may be at most this many 32-bit words apart.
MAX_ROW_STRIDE = 2**22


def to_device_words(x, name: str, layout: str = "(B, H, N, d)"):
    """(device array, kind, dtype name) for the tensor kernel, which reads 32-bit words: float32 arrays as they
    are, float16 / bfloat16 ones as uint32 words holding two values of the last axis (a view, no copy).
    torch CUDA tensors of all three dtypes; NumPy and numba arrays of float16 and float32. layout names the
    expected axes, for the error message (varlen: "(total, H, d)"); its row axis (N, or total) must have a
    stride below MAX_ROW_STRIDE words."""
    words, kind, dtype = _words(x, name, layout)
    if dtype in ("float16", "bfloat16", "float32") and len(words.shape) == layout.count(",") + 1:
        axis = 0 if layout.startswith("(total") else len(words.shape) - 2
        check_row_stride(name, words.strides[axis] // 4, layout)
    return words, kind, dtype


def check_row_stride(name: str, stride: int, layout: str = "(B, H, N, d)"):
    """stride: 32-bit words between consecutive rows (N, or total, of layout)."""
    if abs(stride) >= MAX_ROW_STRIDE:
        raise ValueError(f"{name}: consecutive rows (the {'total' if layout.startswith('(total') else 'N'} axis of "
                         f"{layout}) are {stride} 32-bit words apart; the tensor kernel takes fewer than "
                         f"{MAX_ROW_STRIDE} (it addresses a tile's rows with 32-bit offsets): pass a contiguous "
                         f"{name}")


def _words_view(dev):
    """A float16 device array (last axis contiguous, even) as uint32 pairs, with no copy: numba views only
    C-contiguous arrays as a dtype of another size, so a strided one (a (B, N, H, d) tensor's transpose) is
    described afresh through __cuda_array_interface__."""
    from numba import config

    if config.ENABLE_CUDASIM or dev.is_c_contiguous():
        return dev.view(np.uint32)
    cai = dev.__cuda_array_interface__

    class Words:
        __cuda_array_interface__ = dict(cai, typestr="<u4", shape=(*dev.shape[:-1], dev.shape[-1] // 2),
                                        strides=(*dev.strides[:-1], 4))

    return get_cuda().as_cuda_array(Words())


def _words(x, name: str, layout: str):
    if _is_torch(x):
        import torch  # optional: only torch tensors come here

        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on the CPU; pass {name}.cuda()")
        dtype = str(x.dtype).replace("torch.", "")
        if dtype in ("float16", "bfloat16"):
            _check_pairs(name, tuple(x.shape), x.stride(-1) if x.dim() else 1, layout)
            return get_cuda().as_cuda_array(x.detach().view(torch.int32)).view(np.uint32), "torch", dtype
        if dtype != "float32":
            raise TypeError(f"{name} has dtype {x.dtype}; the tensor kernel takes torch.float16, torch.bfloat16 "
                            "or torch.float32")
    dev, kind = to_device(x, name)
    dtype = np.dtype(dev.dtype).name
    if dtype == "float16":
        _check_pairs(name, tuple(dev.shape), dev.strides[-1] // 2 if len(dev.shape) else 1, layout)
        return _words_view(dev), kind, dtype
    return dev, kind, dtype  # float32, or a dtype the checks reject with a clear message


def all_to_device_words(named, layout: str = "(B, H, N, d)"):
    """to_device_words on each (name, array) pair, which must all share the first's dtype: ([device arrays],
    kind, dtype name), kind and dtype the first's. The tensor kernels' inputs (q, k, v; the backward's o, do)."""
    out = [to_device_words(x, name, layout) for name, x in named]
    (first, _), dtype = named[0], out[0][2]
    for (name, _), (_, _, dt) in zip(named[1:], out[1:]):
        if dt != dtype:
            raise TypeError(f"{name} has dtype {dt}; expected {first}'s dtype {dtype}")
    return [w for w, _, _ in out], out[0][1], dtype


def _check_pairs(name, shape, last_stride, layout="(B, H, N, d)"):
    if len(shape) != layout.count(",") + 1:
        raise ValueError(f"{name} must have {layout.count(',') + 1} dims {layout}; got shape {shape}")
    if shape[-1] % 2 or last_stride != 1:
        raise ValueError(f"{name}: the tensor kernel reads 16-bit values in pairs along d, so d must be even and "
                         f"{name}'s last dim contiguous; got shape {shape} with last-dim stride {last_stride}")


def empty_words(shape, dtype: str, kind: str, like=None):
    """(output, its 32-bit words for the kernel): an uninitialised output of `dtype` in the caller's kind of
    memory, and the same memory as uint32 pairs (16-bit dtypes) or as is (float32)."""
    cuda = get_cuda()
    if kind == "torch":
        import torch  # optional: only torch tensors come here

        t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.device)
        out = cuda.as_cuda_array(t if dtype == "float32" else t.view(torch.int32))
        words = out if dtype == "float32" else out.view(np.uint32)
        out._flashlab_tensor = t
        return out, words
    if dtype == "bfloat16":
        raise TypeError("bfloat16 outputs need torch tensors (NumPy has no bfloat16)")
    out = cuda.device_array(tuple(shape), dtype=np.dtype(dtype))
    return out, (out if dtype == "float32" else out.view(np.uint32))


def _is_device_array(cuda, x) -> bool:
    from numba import config

    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return cuda.is_cuda_array(x)


def like_input(dev, kind: str):
    """An output device array returned the way the caller passed the inputs.

    "numpy": copied to the host. "numba": as is. "torch": a torch CUDA tensor sharing the memory (no copy).
    """
    if kind == "numpy":
        return dev.copy_to_host()
    if kind == "torch":
        import torch  # optional: only torch tensors come here

        owner = getattr(dev, "_flashlab_tensor", None)  # set by empty(): hand back torch's own tensor
        return owner if owner is not None else torch.as_tensor(dev, device="cuda")
    return dev


def empty(shape, dtype, kind: str, like=None):
    """An uninitialised device array for an output. For torch inputs torch allocates it (its caching
    allocator then counts it, e.g. in torch.cuda.max_memory_allocated), on `like`'s device."""
    cuda = get_cuda()
    if kind == "torch":
        import torch  # optional: only torch tensors come here

        tdtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}[np.dtype(dtype)]
        t = torch.empty(tuple(shape), dtype=tdtype, device=like.device)
        dev = cuda.as_cuda_array(t)
        dev._flashlab_tensor = t
        return dev
    return cuda.device_array(tuple(shape), dtype=dtype)


def shell(dev, name: str) -> np.ndarray:
    """A NumPy array with dev's shape and dtype that owns no memory (one zero, broadcast): for checks."""
    shape = tuple(int(s) for s in dev.shape)
    return np.broadcast_to(np.zeros((), dtype=np.dtype(dev.dtype)), shape)


def check_d(d: int, name: str = "d"):
    if d not in SUPPORTED_D:
        raise ValueError(f"{name} = {d} is not supported by the GPU kernels; supported head dims are "
                         f"{', '.join(map(str, SUPPORTED_D))} (the NumPy functions in flashlab take any d)")


def _check_4d_dtype(arrays):
    for name, a in arrays:
        if a.ndim != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, d); got shape {tuple(a.shape)} "
                             f"(add leading dims with {name}[None, None] or reshape)")
        if a.dtype.type not in KERNEL_DTYPES:
            raise TypeError(f"{name} has dtype {a.dtype}; the GPU kernels take float32 or float16 "
                            f"(convert with {name}.astype(np.float32))")


def is_gqa(q, k) -> bool:
    """k has another head count than q (GQA / MQA): such calls skip the prepared path, which holds MHA builds."""
    return tuple(getattr(k, "shape", ()))[1:2] != tuple(getattr(q, "shape", ()))[1:2]


def check_dropout_variant(dropout_p, variant, allowed=("register",)):
    """A ValueError when dropout is asked of kernels without it (`allowed`: the variants that draw the mask; the
    forward passes ("register", "tensor")), rather than a silent no-dropout result. dropout_p's own checks come
    later (flashlab._inputs.check_options)."""
    if variant not in (None, *allowed) and isinstance(dropout_p, numbers.Real) and dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r} needs variant={' or '.join(map(repr, allowed))} (the kernels "
                         f"with a dropout mask); got variant={variant!r}")


def check_kernel_inputs(q, k, v, *, causal=False, scale=None, words=False, gqa=False):
    """Validate device arrays q, k, v (B, H, N, d); returns (B, H, Nq, Nk, d, causal, scale).

    Same messages as the NumPy API (flashlab._inputs), plus: exactly 4 dims, float16/float32,
    v's d equal to q's, d in SUPPORTED_D. words=True: the arrays are the tensor kernel's uint32 pairs of
    16-bit values (their dtype was checked already), so d is twice their last dim. gqa=True (kernels that read
    K/V head h // (H / H_kv)): k and v may have H_kv heads, H_kv dividing H.
    """
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, causal, scale, words, gqa)
    try:
        return _checked(key)
    except TypeError as exc:  # an unhashable argument: check without the cache, which names it
        if "unhashable" not in str(exc):
            raise
    return _check_kernel_inputs(*key)


@lru_cache(maxsize=1024)
def _checked(key):
    """check_kernel_inputs depends only on shapes, dtypes and options: each combination is checked once."""
    return _check_kernel_inputs(*key)


def _check_kernel_inputs(q_shape, k_shape, v_shape, q_dtype, k_dtype, v_dtype, causal, scale, words, gqa=False):
    q, k, v = (np.broadcast_to(np.zeros((), np.dtype(dt)), tuple(int(x) for x in shape))
               for shape, dt in ((q_shape, q_dtype), (k_shape, k_dtype), (v_shape, v_dtype)))
    if words:
        shapes = {n: tuple(int(x) for x in a.shape) for n, a in (("q", q), ("k", k), ("v", v))}
        shells = [(n, np.broadcast_to(np.zeros((), np.float16), s[:-1] + (2 * s[-1],))) for n, s in shapes.items()]
    else:
        shells = [(n, shell(a, n)) for n, a in (("q", q), ("k", k), ("v", v))]
    qs, ks, vs, causal, scale = check_attention_inputs(*(s for _, s in shells), causal=causal, scale=scale, gqa=gqa)
    _check_4d_dtype(shells)
    if vs.shape[-1] != qs.shape[-1]:
        raise ValueError(f"the kernels need v's last dim equal to d = {qs.shape[-1]}; got v.shape {vs.shape}")
    check_d(qs.shape[-1])
    B, H, Nq, d = qs.shape
    return B, H, Nq, ks.shape[-2], d, causal, scale


def check_kernel_backward_inputs(q, k, v, o, lse, do, *, causal=False, scale=None, gqa=False):
    """Backward's version of check_kernel_inputs: o, do like q (same dtype); lse float32 (B, H, Nq).

    lse's values are not read here (that would need a copy); returns (B, H, Nq, Nk, d, causal, scale).
    """
    B, H, Nq, Nk, d, causal, scale = check_kernel_inputs(q, k, v, causal=causal, scale=scale, gqa=gqa)
    shells = {n: shell(a, n) for n, a in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do))}
    check_backward_inputs(*shells.values(), causal=causal, scale=scale, gqa=gqa)
    for n in ("o", "do"):
        if shells[n].dtype != shells["q"].dtype:
            raise TypeError(f"{n} has dtype {shells[n].dtype}; expected q's dtype {shells['q'].dtype}")
    if shells["lse"].dtype != np.float32:
        raise TypeError(f"lse has dtype {shells['lse'].dtype}; expected float32 (as returned by the forward)")
    return B, H, Nq, Nk, d, causal, scale


# ------------------------------------------------------------------------------------- dynamic shared memory
STATIC_SHARED = 48 * 1024  # what a block may use without opting in (CUDA C++ Programming Guide, "Shared Memory")
_OPTED_IN = {}  # (kernel handle, device id) -> bytes allowed


def allow_dynamic_shared(compiled, nbytes: int):
    """Let a compiled numba kernel launch with nbytes of dynamic shared memory. Above 48 KB a kernel must opt
    in (the driver's MAX_DYNAMIC_SHARED_SIZE_BYTES attribute), up to the device's opt-in limit (227 KB on an
    H100, 99 KB on cc 8.6/8.9, 64 KB on a T4). numba-cuda has dynamic shared arrays (cuda.shared.array(0, dtype))
    but (as of 0.30) no API for the opt-in; its driver wrapper has the call. Nothing to do at or under 48 KB."""
    if nbytes <= STATIC_SHARED:
        return
    f = compiled._codelibrary.get_cufunc()
    key = (int(f.handle), f.device.id)
    if _OPTED_IN.get(key, 0) >= nbytes:
        return
    _opt_in(f.handle, f.device.id, int(nbytes))
    _OPTED_IN[key] = nbytes


def _opt_in(handle, device_id: int, nbytes: int):
    """The driver call (raises numba's CudaAPIError if the device refuses, e.g. past its limit)."""
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, binding.CUfunction):  # older numba-cuda (Colab's 0.22) loads modules' functions
        driver.cuFuncSetAttribute(handle, attr, nbytes)
    else:  # a CUkernel, from a library: one attribute per device
        driver.cuKernelSetAttribute(attr, nbytes, handle, device_id)


def launch_with_shared(kernel, grid, block, nbytes: int, *args):
    """kernel[grid, block, 0, nbytes](*args), opting in first where nbytes > 48 KB (the simulator has no limit)."""
    from numba import config

    if nbytes > STATIC_SHARED and not config.ENABLE_CUDASIM:
        allow_dynamic_shared(kernel.compile(tuple(kernel.typeof_pyval(a) for a in args)), nbytes)
    kernel[grid, block, 0, nbytes](*args)


# ------------------------------------------------------------------------------------- launch descriptions
class Arg(NamedTuple):
    """An array argument of a Launch, by name: the array the caller passes under `name`, seen (when given) with
    another `shape` (a contiguous array, as split-KV's partial outputs are viewed per head and split) and/or as
    `dtype` (uint32 pairs seen as float16 values: the last dimension doubles; float16 as pairs: it halves)."""
    name: str
    shape: tuple | None = None
    dtype: object = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch, described once by the kernel module: the kernel, its grid and block, bytes of dynamic
    shared memory, and its arguments in order, arrays by name (str or Arg) and scalars by value. The dropout seed,
    where a kernel takes one, is the last argument. The general path runs it on numba arrays (`run`); the prepared
    path (kernels/prepared.py) turns the same description into a launch with its argument list built once."""
    kernel: object
    grid: tuple
    block: int
    args: tuple
    shared: int = 0

    @property
    def arrays(self) -> tuple:
        """The array arguments' names, in order."""
        return tuple(a if isinstance(a, str) else a.name for a in self.args if isinstance(a, (str, Arg)))

    def run(self, arrays: dict, seed=None):
        """Launch with the numba device arrays named in `arrays`; seed replaces the last argument when given."""
        values = [_view(arrays[a], None, None) if isinstance(a, str) else
                  _view(arrays[a.name], a.shape, a.dtype) if isinstance(a, Arg) else a for a in self.args]
        if seed is not None:
            values[-1] = seed
        if self.shared:
            launch_with_shared(self.kernel, self.grid, self.block, self.shared, *values)
        else:
            self.kernel[self.grid, self.block](*values)


def _view(x, shape, dtype):
    if dtype is not None:
        x = x.view(np.dtype(dtype))
    if shape is not None:
        x = x.reshape(shape)
    return x


def run_all(launches, arrays: dict, temporaries: dict | None = None, alloc=None, seed=None, seeded: int = 0):
    """Run launches in order (a kernel, then split-KV's merge). temporaries: name -> (shape, dtype) of arrays that
    live for one call (split-KV's partial outputs), made with alloc(shape, dtype). seeded: the index of the launch
    that takes the seed (the backward's main kernel comes after its preprocess)."""
    arrays = dict(arrays)
    for name, (shape, dtype) in (temporaries or {}).items():
        arrays[name] = alloc(shape, dtype)
    for i, launch in enumerate(launches):
        launch.run(arrays, seed if i == seeded else None)


class Launches(NamedTuple):
    """A call's launches as a kernel module describes them: the Launch list, run in order; the temporaries (name ->
    (shape, dtype)), made for each call; host arrays the kernels read besides the caller's (name -> NumPy array:
    the ALiBi slopes, varlen's tables), which the prepared path copies to the device once; and `seeded`, the index
    of the launch that takes the dropout seed (the backward's main kernel comes after its preprocess)."""
    launches: tuple
    temporaries: dict
    host: dict
    seeded: int = 0

    def run(self, arrays: dict, alloc=None, seed=None):
        """The general path: copy the host arrays to the device, then run_all."""
        cuda = get_cuda()
        arrays = dict(arrays, **{name: cuda.to_device(x) for name, x in self.host.items()})
        run_all(self.launches, arrays, self.temporaries, alloc or (lambda shape, dt: cuda.device_array(shape, dt)),
                seed, self.seeded)
