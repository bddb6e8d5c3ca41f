"""Probe: can a pure-Python numba-cuda kernel use more than 48 KB of shared memory per block?

CUDA gives a block 48 KB of shared memory unless the kernel opts in to more (cudaFuncSetAttribute with
MaxDynamicSharedMemorySize, up to the device's MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 227 KB on an H100), and only
dynamic shared memory can go above 48 KB. numba-cuda has dynamic shared arrays (cuda.shared.array(0, dtype),
sized by the launch's fourth argument) and its driver wrapper has cuKernelSetAttribute. This script launches one
kernel with 100 KB of dynamic shared memory, without and then with the opt-in, and checks what it computed.

    python benchmarks/experiments/probe_dynamic_shared.py       # needs a GPU
"""
import numpy as np
from numba import cuda, float32

N_BYTES = 100 * 1024


@cuda.jit
def roll(out):
    """Each thread writes its slice of the whole dynamic array, then reads its neighbour's after a barrier."""
    sm = cuda.shared.array(0, float32)
    n = sm.shape[0]
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    for i in range(t, n, nt):
        sm[i] = float32(i)
    cuda.syncthreads()
    acc = float32(0.0)
    for i in range((t + 1) % nt, n, nt):
        acc += sm[i]
    out[t] = acc


def main():
    from flashlab.kernels._launch import allow_dynamic_shared

    dev = cuda.get_current_device()
    optin = dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    print(f"{dev.name.decode() if isinstance(dev.name, bytes) else dev.name}: opt-in limit {optin} bytes a block")
    nt = 256
    out = cuda.device_array(nt, np.float32)
    n = N_BYTES // 4
    expect = np.array([sum(range((t + 1) % nt, n, nt)) for t in range(nt)], np.float64)
    try:
        roll[1, nt, 0, N_BYTES](out)
        cuda.synchronize()
        print(f"without the opt-in: {N_BYTES} bytes launched (unexpected)")
    except Exception as e:  # noqa: BLE001 - the driver's refusal is the point
        print(f"without the opt-in: refused ({type(e).__name__}: {str(e)[:80]})")
    allow_dynamic_shared(roll.compile((roll.typeof_pyval(out),)), N_BYTES)
    roll[1, nt, 0, N_BYTES](out)
    got = out.copy_to_host().astype(np.float64)
    ok = np.allclose(got, expect, rtol=1e-6)
    print(f"with the opt-in: {N_BYTES} bytes, result {'correct' if ok else 'WRONG'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
