"""What is inside one SM of the two GPUs the course runs on, from NVIDIA's documents (lesson 07).

One table, `GPUS`, that the SM figure and the lessons' text both read, so a number is written once.
Sizes are bytes; NVIDIA's tables use KB = 1024 bytes and K = 1024.

Sources (cited in lesson 07):
- CUDA C++ Programming Guide, "Compute Capabilities": Table 27 (registers, resident warps and blocks,
  shared memory per SM and per block, 32 banks) and the 7.x / 9.0 architecture sections (FP32 cores,
  tensor cores and 4 warp schedulers per SM; unified L1/shared memory of 96 KB on Turing, 256 KB on H100).
- Hopper Tuning Guide ("Occupancy", "Increased L2 Capacity": 50 MB L2 on H100) and Turing Tuning Guide
  ("Instruction Scheduling", "Occupancy"); the H100 and Turing architecture whitepapers draw an SM as four
  partitions, each with its scheduler, a 16,384 x 32-bit register file and a quarter of the SM's units.
- Datasheets: H100 SXM (132 SMs, 80 GB HBM3, 3.35 TB/s), T4 (2,560 CUDA cores = 40 SMs x 64, 16 GB
  GDDR6, 320 GB/s). Bandwidths and FP32 peaks are taken from flashlab.roofline, where they live already.
- The T4's 4 MB L2 is the TU104 chip's (Turing whitepaper); `cudaGetDeviceProperties` reports 4 MiB.

`LINKS`, the links between GPUs (lesson 19), per direction: datasheets give NVLink and PCIe as the sum of
both directions (H100 SXM datasheet: NVLink 900 GB/s, PCIe Gen5 128 GB/s; A100 datasheet: PCIe Gen4 64 GB/s),
and InfiniBand as the rate of one port in one direction (NVIDIA ConnectX-7 datasheet: NDR 400 Gb/s; a DGX
H100 has one such port per GPU for the compute network, per the DGX H100 user guide).
"""
from __future__ import annotations

from dataclasses import dataclass

from .roofline import PUBLISHED, PUBLISHED_FP32

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class GPU:
    """One GPU's SM and memory system."""

    name: str
    cc: str  # compute capability
    sms: int
    fp32_per_sm: int  # FP32 units ("CUDA cores"); a warp instruction needs 32 of them for one cycle
    tensor_cores_per_sm: int
    registers_per_sm: int  # 32-bit registers
    max_warps_per_sm: int  # resident warps
    max_blocks_per_sm: int
    l1_shared_per_sm: int  # the unified L1 data cache / shared memory, bytes
    shared_per_sm: int  # the largest shared-memory carve-out
    shared_per_block: int  # with the dynamic opt-in (kernels/_launch.allow_dynamic_shared); 48 KB static
    l2_bytes: int
    memory: str
    bandwidth: float  # bytes/s
    fp32_flops: float  # FP32 (non tensor-core) peak, FLOP/s
    partitions_per_sm: int = 4  # sub-partitions (SMSPs), one warp scheduler each
    warp_size: int = 32
    static_shared_per_block: int = 48 * KiB

    def per_partition(self, per_sm: int) -> int:
        """A quarter of an SM's units or registers: what one scheduler's partition owns."""
        return per_sm // self.partitions_per_sm

    @property
    def schedulers(self) -> int:
        return self.sms * self.partitions_per_sm


GPUS = {
    "H100": GPU(name="H100 SXM", cc="9.0", sms=132, fp32_per_sm=128, tensor_cores_per_sm=4,
                registers_per_sm=64 * 1024, max_warps_per_sm=64, max_blocks_per_sm=32,
                l1_shared_per_sm=256 * KiB, shared_per_sm=228 * KiB, shared_per_block=227 * KiB,
                l2_bytes=50 * MiB, memory="80 GB HBM3", bandwidth=PUBLISHED["H100"].bandwidth,
                fp32_flops=PUBLISHED_FP32["H100"]),
    "T4": GPU(name="T4", cc="7.5", sms=40, fp32_per_sm=64, tensor_cores_per_sm=8,
              registers_per_sm=64 * 1024, max_warps_per_sm=32, max_blocks_per_sm=16,
              l1_shared_per_sm=96 * KiB, shared_per_sm=64 * KiB, shared_per_block=64 * KiB,
              l2_bytes=4 * MiB, memory="16 GB GDDR6", bandwidth=PUBLISHED["T4"].bandwidth,
              fp32_flops=PUBLISHED_FP32["T4"]),
}


@dataclass(frozen=True)
class Link:
    """A link between two GPUs: bytes per second in each direction, and where the number comes from."""

    name: str
    bandwidth: float  # bytes/s, one direction
    source: str


LINKS = {
    "NVLink 4": Link("NVLink 4 (H100 SXM, inside a node)", 450e9,
                     "H100 SXM datasheet: NVLink 900 GB/s, both directions together"),
    "PCIe 5": Link("PCIe Gen5 x16", 64e9, "H100 datasheet: PCIe Gen5 128 GB/s, both directions together"),
    "PCIe 4": Link("PCIe Gen4 x16", 32e9, "A100 datasheet: PCIe Gen4 64 GB/s, both directions together"),
    "InfiniBand NDR": Link("InfiniBand NDR (between nodes)", 50e9,
                           "ConnectX-7 datasheet: 400 Gb/s per port, one direction; one port per GPU in a DGX H100"),
}


def gpu(name) -> GPU:
    """GPUS[name], with an error that lists the known names."""
    if name not in GPUS:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}; got {name!r}")
    return GPUS[name]


def size_text(n: int) -> str:
    """Bytes as NVIDIA's documents write them: 227 KB, 50 MB (KB = 1024 bytes)."""
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KB"
    return f"{n} B"


def scheduler_timeline(warps: int, latency: int, cycles: int) -> list:
    """A toy model of one warp scheduler: which warp issues at each cycle (None: an idle cycle).

    Each of `warps` warps runs a chain of dependent instructions: its next instruction may issue
    `latency` cycles after its previous one. Every cycle the scheduler issues for one ready warp (the one
    that has waited longest), so the issue slots are busy min(1, warps / latency) of the time once the
    pipeline is full. With the 4-cycle latency of dependent FMAs (Turing Tuning Guide), 4 warps per
    scheduler keep it busy; the guide's "16 warps per SM without instruction-level parallelism".
    """
    for name, value, low in (("warps", warps, 1), ("latency", latency, 1), ("cycles", cycles, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    ready = [0] * warps  # the first cycle each warp may issue again
    issued = []
    for c in range(cycles):
        waiting = [w for w in range(warps) if ready[w] <= c]
        if waiting:
            w = min(waiting, key=lambda w: (ready[w], w))
            ready[w] = c + latency
        issued.append(w if waiting else None)
    return issued
