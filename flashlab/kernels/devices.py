"""What the planner knows of a GPU: the Device record, the T4, A100 and H100 by hand, this machine's GPU (or the
simulator's stand-in), and occupancy, the blocks of a kernel an SM holds at once."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from functools import lru_cache

from ..device import device_limits, get_cuda, has_gpu, simulated_gpu


@dataclass(frozen=True)
class Device:
    """What the planner needs to know about a GPU. Pass one by hand to plan for a GPU you do not have."""

    name: str
    sms: int
    shared_per_block: int  # bytes of static shared memory a kernel may use (48 KB at most)
    shared_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    cc: tuple | None = None  # compute capability; None for the simulator
    reserved_shared_per_block: int = 1024  # the driver's share of every block (1 KB from cc 8.0 on)
    l2_bytes: int = 0  # L2 cache size; 0: unknown
    warp: int = 32
    simulated: bool = False
    shared_optin: int = 0  # bytes a block may use with dynamic shared memory and the opt-in; 0: shared_per_block

    def __post_init__(self):
        for name in ("sms", "shared_per_block", "shared_per_sm", "regs_per_sm", "max_threads_per_sm",
                     "max_blocks_per_sm", "warp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Device {name} must be a positive integer; got {value!r}")
        for name in ("reserved_shared_per_block", "l2_bytes", "shared_optin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"Device {name} must be a non-negative integer; got {value!r}")
        if self.cc is not None and (not isinstance(self.cc, tuple) or len(self.cc) != 2
                                    or not all(isinstance(x, numbers.Integral) for x in self.cc)):
            raise ValueError(f"Device cc must be None or a (major, minor) tuple of ints, e.g. (7, 5); got {self.cc!r}")

    @property
    def dynamic_shared_per_block(self) -> int:
        """What a kernel with dynamic shared memory may ask for (the tensor backward's tiles)."""
        return max(self.shared_optin, self.shared_per_block)

    @property
    def limits(self) -> dict:
        """The dict `occupancy` reads."""
        return {"warp": self.warp, "max_threads_per_sm": self.max_threads_per_sm, "regs_per_sm": self.regs_per_sm,
                "max_blocks_per_sm": self.max_blocks_per_sm, "shared_per_sm": self.shared_per_sm,
                "reserved_shared_per_block": self.reserved_shared_per_block}

    @property
    def label(self) -> str:
        if self.simulated:
            return f"{self.name} (one block at a time; {'cc %d.%d' % self.cc if self.cc else 'T4-like limits'})"
        cc = f", cc {self.cc[0]}.{self.cc[1]}" if self.cc else ""
        return f"{self.name} ({self.sms} SMs{cc})"


# Vendor specifications (CUDA C++ Programming Guide, "Compute Capabilities"; the Turing, A100 and H100
# architecture whitepapers for SM counts and L2 sizes). shared_per_block is the 48 KB of static shared memory
# on all three; shared_optin what a block may have with the opt-in (64, 163 and 227 KB).
T4 = Device("Tesla T4", sms=40, shared_per_block=48 * 1024, shared_per_sm=64 * 1024, regs_per_sm=65536,
            max_threads_per_sm=1024, max_blocks_per_sm=16, cc=(7, 5), reserved_shared_per_block=0,
            l2_bytes=4 * 2**20, shared_optin=64 * 1024)


A100 = Device("A100 SXM", sms=108, shared_per_block=48 * 1024, shared_per_sm=164 * 1024, regs_per_sm=65536,
              max_threads_per_sm=2048, max_blocks_per_sm=32, cc=(8, 0), l2_bytes=40 * 2**20, shared_optin=163 * 1024)


H100 = Device("H100 SXM", sms=132, shared_per_block=48 * 1024, shared_per_sm=228 * 1024, regs_per_sm=65536,
              max_threads_per_sm=2048, max_blocks_per_sm=32, cc=(9, 0), l2_bytes=50 * 2**20, shared_optin=227 * 1024)


DEVICES = {"T4": T4, "A100": A100, "H100": H100}


def current_device() -> Device:
    """This machine's GPU (numba-cuda's device attributes), or the simulator's stand-in: the GPU named by
    FLASHLAB_SIMULATE_GPU (device.simulated_gpu), else T4-like limits with no compute capability."""
    return _current_device(simulated_gpu())


@lru_cache(maxsize=4)
def _current_device(simulating) -> Device:
    if simulating:
        d = DEVICES[simulating]
        return replace(d, name=f"CUDA simulator as a {d.name}", simulated=True)
    lim = device_limits()
    reserved, l2 = 1024, 0
    if has_gpu():
        dev = get_cuda().get_current_device()
        try:
            reserved = int(dev.RESERVED_SHARED_MEMORY_PER_BLOCK)
        except Exception:  # an old driver without the attribute
            reserved = 1024 if lim["cc"] >= (8, 0) else 0
        try:
            l2 = int(dev.L2_CACHE_SIZE)
        except Exception:
            l2 = 0
    return Device(lim["name"], sms=lim["sms"], shared_per_block=lim["shared_per_block"],
                  shared_per_sm=lim["shared_per_sm"], regs_per_sm=lim["regs_per_sm"],
                  max_threads_per_sm=lim["max_threads_per_sm"], max_blocks_per_sm=lim["max_blocks_per_sm"],
                  cc=tuple(lim["cc"]) if lim["cc"] else None, reserved_shared_per_block=reserved, l2_bytes=l2,
                  warp=lim["warp"], simulated=not has_gpu(), shared_optin=lim.get("shared_optin", 0))


def _device(device) -> Device:
    if device is None:
        return current_device()
    if isinstance(device, str):
        if device not in DEVICES:
            raise ValueError(f"device must be a Device, None (this GPU) or one of {sorted(DEVICES)}; got {device!r}")
        return DEVICES[device]
    if not isinstance(device, Device):
        raise TypeError(f"device must be a flashlab.kernels.plan.Device, a name in {sorted(DEVICES)} or None; "
                        f"got {type(device).__name__}")
    return device


def occupancy(threads: int, regs: int | None, shared_bytes: int, limits: dict) -> dict:
    """Resident blocks per SM and theoretical occupancy, with the resource that limits it.

    The rules of NVIDIA's CUDA Occupancy Calculator (now part of Nsight Compute): registers are handed out per
    warp in units of 256, and the warps that registers allow are rounded down to a multiple of 4 (the warp
    allocation granularity); every block also takes the shared memory the driver reserves per block,
    limits["reserved_shared_per_block"] (1 KB from compute capability 8.0 on; 1 KB when not given)."""
    warps = -(-threads // limits["warp"])
    max_warps = limits["max_threads_per_sm"] // limits["warp"]
    bounds = {"threads": max_warps // warps, "blocks": limits["max_blocks_per_sm"]}
    if regs:
        per_warp = -(-regs * limits["warp"] // 256) * 256
        bounds["registers"] = limits["regs_per_sm"] // per_warp // 4 * 4 // warps
    if shared_bytes:
        reserved = limits.get("reserved_shared_per_block", 1024)
        bounds["shared memory"] = limits["shared_per_sm"] // (shared_bytes + reserved)
    limiter = min(bounds, key=bounds.get)
    blocks = bounds[limiter]
    return {"blocks_per_sm": blocks, "occupancy": blocks * warps / max_warps, "limited_by": limiter,
            "bounds": bounds}
