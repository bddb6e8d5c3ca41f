"""Course-wide settings read from the environment.

FLASHLAB_FAST=1 shrinks the sizes every notebook uses so the whole course runs on a 2-core CPU with the
CUDA simulator (CI does this). Notebooks call `size(full, fast)` for anything that scales, and
`flashlab.device.kernel_size(full, fast)` for kernel launches (always `fast` in the simulator).
"""
from __future__ import annotations

import os


def fast_mode() -> bool:
    return os.environ.get("FLASHLAB_FAST", "").strip().lower() not in ("", "0", "false", "no")


def size(full, fast):
    """`fast` in the fast mode, `full` otherwise."""
    return fast if fast_mode() else full
