"""What the planner knows of a GPU: this machine's GPU (or the simulator's stand-in) as a Device record, and
occupancy, the blocks of a kernel an SM holds at once. The records of the T4, A100 and H100 by hand live in
flashlab/gpu_limits.py, below flashlab.device, which needs them to simulate one."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ..device import device_limits, get_cuda, has_gpu, simulated_gpu
from ..gpu_limits import A100, DEVICES, H100, T4, Device  # noqa: F401  (the records, below flashlab.device)




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
