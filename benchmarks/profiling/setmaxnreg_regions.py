"""How many registers the wgmma kernels' warpgroups really get, compiled without a GPU: ptxas -v reports the
launch's count (65536 / threads: 168 with two consumer warpgroups, 128 with three), but after `setmaxnreg.inc`
the consumers may use more. This reads the machine code (SASS, from cuobjdump) and prints, per build, the highest
register each region of the code uses: before setmaxnreg (every warpgroup), after the consumers' setmaxnreg.inc,
after the producer's setmaxnreg.dec.

    export LD_LIBRARY_PATH=/path/to/nvrtc/lib CUDA_HOME=/usr/local/cuda NUMBA_ENABLE_CUDASIM=0
    PATH=/path/to/cuobjdump_and_nvdisasm:$PATH python benchmarks/profiling/setmaxnreg_regions.py \
        [--kernel forward|backward] [--out FILE]

--kernel backward: the wgmma backward's default builds (wgmma_backward.default_tile: two consumer warpgroups;
at d 128 the producer's second warp reduces dQ, and causal, three ring slots), plain and deterministic.

Needs NVRTC (numba-cuda's compile_ptx), ptxas, cuobjdump and nvdisasm (pip: nvidia-cuda-nvrtc,
nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), no GPU. The regions are read in code order: from the
`USETMAXREG.TRY_ALLOC` to the `USETMAXREG.DEALLOC` is the consumers' code, after it the producer's.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "generators"))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")


def regions(sass: str) -> tuple:
    """(registers used before setmaxnreg, after the consumers' inc, after the producer's dec) in code order."""
    used, region = [0, 0, 0], 0
    for line in sass.splitlines():
        if "USETMAXREG.TRY_ALLOC" in line:
            region = 1
        elif "USETMAXREG.DEALLOC" in line:
            region = 2
        regs = [int(x) for x in re.findall(r"\bR(\d+)\b", line)]
        if regs:
            used[region] = max(used[region], max(regs) + 1)
    return tuple(used)


def forward_build(d: int, consumers: int, causal: bool) -> tuple:
    """(kernel, signature, (launch, producer, consumer registers)) of a wgmma forward build."""
    from numba import types

    from flashlab.kernels import wgmma

    kernel = wgmma.build(d, "float16", causal, wgmma.WgmmaTile(128, 2, True, consumers))
    maps = types.Array(types.uint64, 1, "C")
    sig = (maps, maps, maps, types.Array(types.uint32, 4, "C"), types.Array(types.float32, 3, "C"), types.int64,
           types.int64, types.int64, types.float32, types.Array(types.uint64, 3, "C"))
    return kernel, sig, wgmma.REGISTERS[consumers]


def backward_build(d: int, deterministic: bool, causal: bool) -> tuple:
    """The same of a wgmma backward build with its default tile."""
    from numba import types

    from flashlab.kernels import wgmma_backward

    kernel = wgmma_backward.build(d, "float16", causal, wgmma_backward.default_tile(d, causal), deterministic)
    maps, f32, i64 = types.Array(types.uint64, 1, "C"), types.float32, types.int64
    sig = (maps, maps, maps, maps, types.Array(f32, 3, "C"), types.Array(f32, 3, "C"), types.Array(f32, 4, "C"),
           types.Array(types.uint32, 4, "C"), types.Array(types.uint32, 4, "C"), types.Array(types.int32, 3, "C"),
           i64, i64, f32, f32, i64, i64, f32, types.Array(f32, 1, "C"), i64)
    return kernel, sig, wgmma_backward.REGISTERS


def compile_build(kernel, sig, registers) -> tuple:
    from numba.cuda import compile_ptx

    ptx, _ = compile_ptx(kernel.py_func, sig, cc=(9, 0), fastmath=kernel.targetoptions.get("fastmath", False))
    ptx = ptx.replace(".target sm_90\n", ".target sm_90a\n")  # wgmma and setmaxnreg: numba adds the "a" on a GPU
    launch = registers[0]
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        report = subprocess.run(["ptxas", "-arch=sm_90a", "-maxrregcount", str(launch), "-v", str(src), "-o",
                                 str(cubin)], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    reported = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores", report)
    return launch, reported, int(spills.group(1)) if spills else 0, regions(sass), registers[1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("forward", "backward"), default="forward")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    import kernel_resources

    kernel_resources._compile_only()
    version = kernel_resources.ptxas_version()
    column, build, builds = {"forward": ("consumers", forward_build, ((64, 3), (64, 2), (128, 2))),
                             "backward": ("determ.", backward_build, ((64, False), (64, True), (128, False),
                                                                      (128, True)))}[args.kernel]
    lines = [f"wgmma {args.kernel} builds, float16, ptxas {version}, sm_90a: the launch's register count (ptxas -v) "
             "against the highest register each region of the SASS uses",
             "(code order: what follows the producer's setmaxnreg.dec counts as its region, including subroutines "
             "placed at the end, such as 64-bit division, that the consumers call too)",
             f"  d {column:>9s} causal | launch ptxas-v spills | before setmaxnreg  consumers (inc to)  "
             "producer (dec to)"]
    for d, which in builds:
        for causal in (False, True):
            launch, reported, spills, (before, cons, prod), (dec, inc) = compile_build(*build(d, which, causal))
            lines.append(f"{d:3d} {str(which):>9s} {str(causal):>6s} | {launch:6d} {reported:7d} {spills:6d} | "
                         f"{before:17d}  {cons:9d} ({inc:3d})  {prod:9d} ({dec:3d})")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
