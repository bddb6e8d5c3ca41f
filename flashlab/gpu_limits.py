"""The limits the planner and the simulator plan with, for the GPUs flashlab knows by name: a `Device` record each
for the T4, the A100 and the H100, from the vendor's specifications. flashlab.kernels.devices describes this
machine's GPU with the same record (and plans for any of these by name), and flashlab.device makes the simulator
report one of them (FLASHLAB_SIMULATE_GPU=T4). No flashlab import: both sit above it.

flashlab/hardware.py holds the figures lessons draw of an SM (units, caches, bandwidth); this holds what
occupancy and tile choice need.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass


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
