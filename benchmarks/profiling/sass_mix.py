"""Where a kernel's instructions and stalls go, from Nsight Compute's per-instruction (SASS) counters.

    ncu --kernel-name regex:flash_fwd_tensor --launch-skip 1 --launch-count 1 --section SourceCounters \
        --section WarpStateStats -o fwd python benchmarks/profiling/profile_forward.py tensor 64 --dtype float16
    ncu -i fwd.ncu-rep --page source --print-source sass --csv > fwd_sass.csv
    python benchmarks/profiling/sass_mix.py fwd_sass.csv [--json mix.json --label after]

Prints the share of stall samples by reason, then by opcode, and the instruction mix of the main loop's body:
the instructions executed as often as the most frequent count (one per warp per key tile). Then the average
per tile: every instruction between the loop body's first and last, weighted by how often it ran per tile
(a branch taken in some tiles only, such as the rescale of O, counts for that share). --json adds the loop
body's opcode counts under --label to a JSON file (lesson 16 plots flashlab/data/h100_sass_mix.json); with
--average, the average per tile (rounded) instead.
"""
import argparse
import collections
import csv
import json
from pathlib import Path


def opcode(sass: str) -> str:
    words = sass.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate
    return word.split(".")[0]


def main(path, json_path=None, label=None, average=False):
    rows = list(csv.reader(open(path)))
    header = next(r for r in rows if "Address" in r and "Source" in r)
    ix = {h: i for i, h in enumerate(header)}
    body = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header) and r[ix["Source"]].strip()]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = collections.Counter()
    by_op = collections.Counter()
    executed = {}
    for r in body:
        op, n = opcode(r[ix["Source"]]), int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        by_op[op] += n
        executed[r[ix["Address"]]] = (op, int(r[ix["Instructions Executed"]] or 0))
        for h in reasons:
            samples[h] += int(r[ix[h]] or 0)
    total = sum(samples.values()) or 1
    print("stall samples by reason:")
    for h, n in samples.most_common(8):
        print(f"  {h[6:]:20s} {n / total:6.1%}")
    print("stall samples by opcode:")
    for op, n in by_op.most_common(10):
        print(f"  {op:10s} {n / total:6.1%}")
    counts = collections.Counter(n for _, n in executed.values() if n)
    loop = counts.most_common(1)[0][0]  # the loop body's instructions all run once per warp and tile
    mix = collections.Counter(op for op, n in executed.values() if n == loop)
    print(f"loop body: {sum(mix.values())} instructions (each executed {loop} times)")
    print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common(14)))
    addresses = [int(a, 16) for a in executed]
    inside = [int(a, 16) for a, (_, n) in executed.items() if n == loop]
    per_tile = collections.Counter()
    for a, (op, n) in zip(addresses, executed.values()):
        if min(inside) <= a <= max(inside):
            per_tile[op] += n / loop
    print(f"average per tile: {sum(per_tile.values()):.1f} instructions")
    print("  " + ", ".join(f"{op} {n:.1f}" for op, n in per_tile.most_common(14)))
    if json_path:
        path = Path(json_path)
        data = json.loads(path.read_text()) if path.exists() else {}
        counts = {op: round(n) for op, n in per_tile.most_common() if round(n)} if average else dict(mix.most_common())
        data.setdefault("loop_body", {})[label] = counts
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--json")
    ap.add_argument("--label", default="run")
    ap.add_argument("--average", action="store_true", help="--json: the average per tile, not the loop body")
    a = ap.parse_args()
    main(a.csv, a.json, a.label, a.average)
