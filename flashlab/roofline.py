"""Rooflines: how fast a machine can move bytes and do arithmetic, measured or published (lesson 01).

A kernel that does F FLOPs and moves B bytes between memory and the chip needs at least
max(F / peak_flops, B / bandwidth) seconds. Its arithmetic intensity I = F / B (FLOPs per byte) decides
which term wins: below the ridge point peak_flops / bandwidth it is memory-bound, above it compute-bound.

    measure_cpu()        this machine's copy bandwidth and float32 matmul rate, with NumPy (about a second)
    measure_gpu()        the same for a CUDA GPU through torch, or None when there is none (never imports
                         torch unless an NVIDIA driver is present)
    PUBLISHED            vendor datasheet figures for A100, H100 and T4 (SMS: their SM counts)
    example_kernels()    FLOPs and bytes of a few operations attention is made of

Everything is plain Python + NumPy; plotting lives in flashlab.viz.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from .config import size


@dataclass(frozen=True)
class Machine:
    """A roofline: peak arithmetic rate (FLOP/s) and memory bandwidth (bytes/s)."""

    name: str
    peak_flops: float
    bandwidth: float
    source: str = ""  # where the numbers come from: a datasheet URL or "measured ..."
    measured: bool = False

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOP/byte) where the memory and compute limits meet."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity):
        """Best FLOP/s a kernel of the given intensity (FLOP/byte) can reach: min(peak, bandwidth * I)."""
        return np.minimum(self.peak_flops, self.bandwidth * np.asarray(intensity, dtype=float))

    def time(self, flops, nbytes) -> float:
        """Lower bound on the run time (s) of a kernel doing `flops` FLOPs and moving `nbytes` bytes."""
        return max(flops / self.peak_flops, nbytes / self.bandwidth)

    def __str__(self):
        return (f"{self.name}: {self.bandwidth / 1e9:,.0f} GB/s, {self.peak_flops / 1e12:,.2f} TFLOP/s, "
                f"ridge at {self.ridge:,.1f} FLOP/byte")


_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet)"
_T4 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"

#: Datasheet figures: dense FP16 tensor-core peak (no sparsity) and memory bandwidth. The FP32 (non
#: tensor-core) peak is what softmax, exp and other elementwise work runs at.
PUBLISHED = {
    "A100": Machine("A100 SXM 80GB (FP16 tensor cores)", 312e12, 2039e9, _A100),
    "H100": Machine("H100 SXM (FP16 tensor cores)", 989e12, 3350e9, _H100),
    "T4": Machine("T4 (FP16 tensor cores)", 65e12, 320e9, _T4),
}
#: FP32 CUDA-core peaks from the same datasheets (FLOP/s).
PUBLISHED_FP32 = {"A100": 19.5e12, "H100": 67e12, "T4": 8.1e12}
#: Streaming multiprocessors: A100 108 and H100 SXM 132 (NVIDIA's A100 and H100 architecture whitepapers);
#: T4 40 (2,560 CUDA cores at 64 per Turing SM; also what Colab's T4 reports, shared/anchors.md).
SMS = {"A100": 108, "H100": 132, "T4": 40}


def _best_time(fn, repeats):
    fn()  # warm up: page in memory, load BLAS
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes=None, repeats=5) -> float:
    """Memory bandwidth in bytes/s from copying a float32 array much larger than the CPU caches.

    A copy reads and writes every byte once, so it moves 2 * nbytes per run. Best of `repeats` runs.
    """
    nbytes = nbytes or size(256 << 20, 64 << 20)
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_time(lambda: np.copyto(dst, src), repeats)


def measure_flops(n=None, repeats=3) -> float:
    """float32 matmul rate in FLOP/s (2 n^3 FLOPs per n x n product), best of `repeats` runs."""
    n = n or size(2048, 768)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / _best_time(lambda: a @ b, repeats)


def measure_cpu(name=None) -> Machine:
    """This machine's CPU roofline, measured with NumPy (about a second; less in the fast mode)."""
    bw, fl = measure_bandwidth(), measure_flops()
    cores = os.cpu_count() or 1
    return Machine(name or f"this CPU ({cores} cores, measured)", fl, bw, "measured with NumPy: copy + float32 matmul",
                   measured=True)


def gpu_present() -> bool:
    """Cheap check for an NVIDIA driver, without importing torch or numba."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def measure_gpu(name=None):
    """The GPU's roofline measured with torch (copy bandwidth, float16 matmul), or None without a CUDA GPU.

    Returns None quickly when no NVIDIA driver is present, when torch is missing, or on any error.
    """
    if not gpu_present():
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda")
        x = torch.empty(size(256 << 20, 64 << 20) // 2, dtype=torch.float16, device=dev)
        y = torch.empty_like(x)
        n = size(8192, 2048)
        a = torch.randn(n, n, dtype=torch.float16, device=dev)
        b = torch.randn(n, n, dtype=torch.float16, device=dev)

        from .bench import time_cuda

        def timed(fn):  # best of 5 after a warm-up, in seconds
            return time_cuda(fn, warmup=1, reps=5)["min_ms"] / 1e3

        bw = 2 * x.numel() * x.element_size() / timed(lambda: y.copy_(x))
        fl = 2 * n**3 / timed(lambda: a @ b)
        gpu = torch.cuda.get_device_name(0)
        return Machine(name or f"{gpu} (FP16, measured)", fl, bw, "measured with torch: copy + float16 matmul",
                       measured=True)
    except Exception:  # a broken driver or torch build must not break a lesson
        return None


def example_kernels(n=4096, d=64, bytes_per_element=2) -> dict:
    """FLOPs and HBM bytes of operations attention is built from, for one (batch, head), N = n.

    Returns {name: (flops, bytes)}. Each operation reads its inputs from and writes its output to memory
    once, as a separate kernel would. Element counts follow the naive algorithm in flashlab.reference.
    """
    e = bytes_per_element
    return {
        # S = Q K^T: read two N x d, write N x N
        "S = QKᵀ": (2 * n * n * d, e * (2 * n * d + n * n)),
        # softmax over rows: read N x N, write N x N; about 5 FLOPs per element (max, sub, exp, sum, div)
        "softmax": (5 * n * n, e * 2 * n * n),
        # elementwise, e.g. masking or dropout: 1 FLOP per element, read + write
        "elementwise": (n * n, e * 2 * n * n),
        # O = P V: read N x N and N x d, write N x d
        "O = PV": (2 * n * n * d, e * (n * n + 2 * n * d)),
        # a square matmul of size N x N x N for comparison
        "square matmul": (2 * n**3, e * 3 * n * n),
    }


def intensity(flops, nbytes) -> float:
    """Arithmetic intensity in FLOPs per byte."""
    return flops / nbytes


def time_kernel(fn, flops, nbytes, repeats=3):
    """(intensity, achieved FLOP/s) of `fn()`, which does `flops` FLOPs and moves `nbytes` bytes; best of runs."""
    return flops / nbytes, flops / _best_time(fn, repeats)
