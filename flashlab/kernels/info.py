"""kernel_info: what a kernel configuration costs the GPU (lessons 09 and 10).

    kernel_info(64)                                  # register variant, default tile, d = 64
    kernel_info(64, variant="shared", block_q=128)
    kernel_info(64, asm=True)["ptx"]                 # the PTX (and "sass" where nvdisasm is installed)
    kernel_info(128, variant="wgmma", dtype="float16")   # FlashAttention-3's forward (Hopper)

Registers and spills come from the compiler, so they need a real GPU (numba-cuda compiles for the device
it finds); in the simulator those entries are None and "note" says so. Shared memory and threads per block
are known from the tile shape alone. Theoretical occupancy = resident warps per SM / the SM's maximum,
where the resident blocks are limited by threads, registers and shared memory (whichever runs out first).
"""
from __future__ import annotations

import numpy as np

from ..device import device_limits, get_cuda, has_gpu
from . import hopper, register, shared, tensor, wgmma
from ._launch import check_d
from .devices import occupancy
from .plan import kernel_and_signature, resolve_config


def kernel_info(d: int = 64, *, variant: str = "register", block_q=None, block_k=None, causal: bool = False,
                dtype=np.float32, tile=None, asm: bool = False, precision=None) -> dict:
    """Registers/thread, spill (local) bytes/thread, shared bytes/block and theoretical occupancy of the
    forward kernel that flash_attention(..., variant, block_q, block_k) would launch for head dim d.

    With asm=True the dict also holds "ptx" (and "sass" when nvdisasm is available). GPU only for
    registers, spills and assembly; the simulator reports what the tile shape determines.
    """
    check_d(d)
    if variant == "wgmma":
        return _wgmma_info(d, block_k, bool(causal), dtype if dtype == "bfloat16" else np.dtype(dtype).name, asm)
    if tile is not None:
        variant = "register"
        config = tile.check(d, device_limits()["shared_per_block"])
    else:
        if variant == "tensor" and precision is None:
            precision = "3xtf32" if np.dtype(dtype) == np.float32 else "f16"
        config = resolve_config(variant, d, block_q, block_k, precision)
    if variant == "tensor":
        kernel = tensor.build(d, config, bool(causal), precision)
        threads, smem = config.threads, 4 * config.shared_words(d, precision)
        info = {"variant": variant, "precision": precision, "block_q": config.block_q, "block_k": config.block_k,
                "warps": config.warps}
    elif variant == "register":
        kernel = register.build(d, config, bool(causal))
        threads, smem = config.threads, config.shared_bytes(d)
        info = {"variant": variant, "block_q": config.block_q, "block_k": config.block_k, "tr": config.tr,
                "tc": config.tc, "micro_tile": dict(zip(("rows", "keys", "dims"), config.micro(d)))}
    else:
        bq, bk = config
        kernel = shared.build(d, bq, bk, bool(causal))
        threads, smem = bq, shared.shared_bytes(d, bk)
        info = {"variant": variant, "block_q": bq, "block_k": bk}
    info.update(d=d, threads_per_block=threads, shared_bytes_per_block=smem,
                registers_per_thread=None, local_bytes_per_thread=None)
    limits = device_limits()
    if has_gpu():
        _, sig = kernel_and_signature(variant, "forward", d, np.dtype(dtype).name, precision, config, bool(causal),
                                      False, False)
        kernel.compile(sig)
        compiled = kernel.overloads[sig]  # the compiled kernel for this signature on this device
        info["registers_per_thread"] = int(compiled.regs_per_thread)
        info["local_bytes_per_thread"] = int(compiled.local_mem_per_thread)
        info["shared_bytes_per_block"] = int(compiled.shared_mem_per_block)
        if asm:
            info["ptx"] = compiled.inspect_asm(limits["cc"])
            try:
                info["sass"] = compiled.inspect_sass()
            except Exception as exc:  # nvdisasm missing, typically
                info["sass"] = f"unavailable: {type(exc).__name__}: {exc}"
        info["device"] = limits["name"]
    else:
        info["note"] = ("CUDA simulator: registers, spills, PTX and SASS come from the GPU compiler and need a "
                        "real GPU; occupancy below counts threads and shared memory only (T4-like limits).")
    occ = occupancy(threads, info["registers_per_thread"], info["shared_bytes_per_block"], limits)
    occ.pop("bounds")
    info.update(occ)
    get_cuda()  # keep the import explicit: info is meaningless before the backend is chosen
    return info


def _wgmma_info(d, block_k, causal, dtype, asm):
    """kernel_info for variant="wgmma": its tile, warpgroups and dynamic shared memory, and on a Hopper GPU what
    the compiler made of it."""
    from numba import types

    if dtype not in wgmma.DTYPES:
        raise ValueError(f"variant='wgmma' takes float16 or bfloat16 (dtype=...); got {dtype}")
    config = wgmma.choose_tile(d, causal, block_k)
    info = {"variant": "wgmma", "dtype": dtype, "block_q": config.block_q, "block_k": config.block_k,
            "stages": config.stages, "consumers": config.consumers, "pingpong": config.pingpong, "d": d,
            "threads_per_block": config.threads, "shared_bytes_per_block": config.shared_bytes(d),
            "registers_per_thread": None, "local_bytes_per_thread": None}
    limits = device_limits()
    if has_gpu() and hopper.runs_on(limits["cc"]):
        kernel = wgmma.build(d, dtype, causal, config)
        maps = types.Array(types.uint64, 1, "C")
        sig = (maps, maps, maps, types.Array(types.uint32, 4, "C"), types.Array(types.float32, 3, "C"),
               types.int64, types.int64, types.int64, types.float32, types.Array(types.uint64, 3, "C"))
        kernel.compile(sig)
        compiled = kernel.overloads[sig]
        info["registers_per_thread"] = int(compiled.regs_per_thread)
        info["local_bytes_per_thread"] = int(compiled.local_mem_per_thread)
        if asm:
            info["ptx"] = compiled.inspect_asm(limits["cc"])
        info["device"] = limits["name"]
    else:
        info["note"] = ("wgmma needs a Hopper GPU (compute capability 9.0) for registers and assembly; the tile, "
                        "threads and shared memory come from the tile alone. Registers at launch are capped at "
                        f"{wgmma.REGISTERS[config.consumers][0]} a thread, then setmaxnreg gives the consumers "
                        f"{wgmma.REGISTERS[config.consumers][2]}.")
    return info
