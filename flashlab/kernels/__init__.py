"""Numba-CUDA FlashAttention kernels (run on a GPU, or in Numba's CUDA simulator without one).

    o, lse = flash_attention(q, k, v, causal=False, variant="register")
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do)
    kernel_info(q.shape, variant="register")   # registers, spills, shared memory, occupancy, PTX/SASS

Inputs are (B, H, N, d) NumPy arrays, numba device arrays or torch CUDA tensors (no copies); outputs come
back in the same kind. Variants: "shared" (lesson 08: one thread per query row, K/V tiles in shared
memory) and "register" (lesson 09: FA2 with register tiling).
"""
from ._launch import SUPPORTED_D
from .forward import VARIANTS, flash_attention
from .info import kernel_info

try:  # written separately (issue 4, backward); the forward works without it
    from .backward import flash_attention_backward
except ImportError as _exc:  # pragma: no cover - only while the backward is missing
    _missing = _exc

    def flash_attention_backward(*args, **kwargs):
        raise NotImplementedError(f"the backward kernel is not available: {_missing}")

__all__ = ["flash_attention", "flash_attention_backward", "kernel_info", "VARIANTS", "SUPPORTED_D"]
