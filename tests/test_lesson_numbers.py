"""No orphan numbers: what a lesson quotes as a measured result comes from a committed data file.

Every number with a unit of speed, time, share or count that results are quoted in (TFLOP/s, GFLOP/s,
TB/s, GB/s, µs, ms, ns, %, registers, ×), in the markdown of course/ and in the strings its code prints,
must either appear with the same unit, to the quoted precision, in a committed data file
(benchmarks/results/**, flashlab/data/**, docs/runs/*.md), or be in ALLOWED below: vendor specs,
published figures and arithmetic, each with where it comes from. Numbers in markdown tables take the unit
of their column's header. A new, unmeasured number in a lesson fails here; so does an ALLOWED entry no
lesson uses any more. The data files the lessons and their figures load must exist.
"""
from __future__ import annotations

import ast
import csv
import io
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from flashlab.build import parse_cells

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "course").glob("*/*.py"))
DATA_FILES = sorted({*ROOT.glob("benchmarks/results/**/*.csv"), *ROOT.glob("benchmarks/results/**/*.md"),
                     *ROOT.glob("benchmarks/results/**/*.json"), *ROOT.glob("flashlab/data/*"),
                     *ROOT.glob("docs/runs/*.md")})

UNIT_ALIASES = {"TFLOP/s": "TFLOP/s", "GFLOP/s": "GFLOP/s", "TB/s": "TB/s", "GB/s": "GB/s", "µs": "µs", "us": "µs",
                "ms": "ms", "ns": "ns", "%": "%", "registers": "registers", "×": "×", "x": "×"}
NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
# a number (or a range "a–b", "a to b") followed by a unit; "4 x 4" and "x86" are not ratios
QUOTE = re.compile(rf"(?<![\w.^/])({NUM})(?:\s*(?:–|-|to)\s*({NUM}))?\s?"
                   r"(TFLOP/s|GFLOP/s|TB/s|GB/s|µs|us\b|ms\b|ns\b|%|registers\b|×|x\b)(?!\s*\d)")
HEADER_UNIT = re.compile(r"\((TFLOP/s|GFLOP/s|TB/s|GB/s|µs|us|ms|ns|%)\)|^\s*(TFLOP/s|GFLOP/s|GB/s|ms|%|registers)"
                         r"(?:/thread)?\s*$")

# (lesson or exercise file stem, number with its unit as written) -> where the value comes from.
ALLOWED = {
    # vendor specifications
    ("05_fa2", "312 TFLOP/s"): "A100 datasheet, dense FP16 tensor cores (flashlab.roofline.PUBLISHED)",
    ("08_first_flash_kernel", "67 TFLOP/s"): "H100 SXM datasheet, FP32 (flashlab.roofline.PUBLISHED_FP32)",
    ("10_tuning", "67 TFLOP/s"): "H100 SXM datasheet, FP32 (flashlab.roofline.PUBLISHED_FP32)",
    ("08_first_flash_kernel", "3.35 TB/s"): "H100 SXM datasheet, HBM3 bandwidth (flashlab.roofline.PUBLISHED)",
    ("14_decoding", "3.35 TB/s"): "H100 SXM datasheet, HBM3 bandwidth (flashlab.roofline.PUBLISHED)",
    ("14_decoding", "989 TFLOP/s"): "H100 SXM datasheet: 1979 TFLOP/s dense-equivalent FP16 with 2:4 sparsity, 989 without",
    ("08_first_flash_kernel", "255 registers"): "CUDA C++ Programming Guide: at most 255 registers per thread",
    ("09_register_fa2", "255 registers"): "CUDA C++ Programming Guide: at most 255 registers per thread",
    ("12_other_hardware", "288 GB/s"): "tt-metal FlashAttention report, section 2.2: Wormhole's 12 GDDR6 channels",
    # published measurements, cited where they are quoted
    ("01_memory_hierarchy", "75%"): "FA3 paper (arXiv 2407.08608), abstract: 740 TFLOP/s, 75% of H100 FP16 peak",
    ("01_memory_hierarchy", "35%"): "FA3 paper, abstract: FA2 reaches 35% utilization on the H100",
    ("11_fa3_ideas", "35%"): "FlashAttention-3 paper (arXiv 2407.08608), abstract: FA2 reaches 35% of H100 peak",
    ("11_fa3_ideas", "2.6×"): "FA3 paper, Table 3: 2.4e-2 / 9.1e-3",
    ("11_fa3_ideas", "3.9 TFLOP/s"): "FA3 paper, section 3.1: H100 SXM5 special-function throughput",
    ("11_fa3_ideas", "570 TFLOP/s"): "FA3 paper, section 3.1 and Table 2 (range '570 to 620')",
    ("11_fa3_ideas", "620 TFLOP/s"): "FA3 paper, section 3.1 (range '570 to 620')",
    ("12_other_hardware", "1.6×"): "tt-metal FlashAttention report, section 3.1.2: causal load balancing",
    ("12_other_hardware", "20×"): "tt-metal FlashAttention report, section 4: average speed-up over its baseline",
    ("12_other_hardware", "9×"): "tt-metal FlashAttention report, section 4: smallest speed-up",
    ("12_other_hardware", "44×"): "tt-metal FlashAttention report, section 4: largest speed-up",
    # arithmetic on the numbers above or on committed data
    ("01_memory_hierarchy", "1%"): "computed: softmax's 1.25 FLOP/byte / the A100's ridge of 153 FLOP/byte",
    ("08_first_flash_kernel", "0.3 TB/s"): "computed: 9.4 TFLOP/s / 32 FLOP per byte (the cell above)",
    ("10_tuning", "86%"): "computed: 1.5 x the FFMA share 57.6% (flashlab/data/issue_profile.csv, printed above)",
    ("10_tuning", "1.5×"): "a round target, not a measurement: 'the next 1.5x'",
    ("10_tuning", "77%"): "computed: cuBLAS 51.4 TFLOP/s (register_experiments.md) / 67 TFLOP/s FP32 peak",
    ("11_fa3_ideas", "97%"): "printed by the cell above it (per-tensor error on the second block)",
    ("11_fa3_ideas", "6%"): "computed: e4m3's half step, 2^-4 of the value",
    ("11_fa3_ideas", "2.5×"): "printed by the accuracy-study cell (per-tensor / incoherent RMSE at N = 8192)",
    ("11_fa3_ideas", "1.7×"): "read off the speed-up curve the cell above draws (timeline.speedup_curve)",
    ("12_other_hardware", "2×"): "the pipeline formula's limit: n(t_r + t_c) / (n max(t_r, t_c)) with t_r = t_c",
    ("12_other_hardware", "1.5×"): "read off the balancing curve the cell above draws (model, lower end)",
    ("12_other_hardware", "1.75×"): "read off the balancing curve the cell above draws (model, upper end)",
    ("10_tuning", "100%"): "exercise statement: a hypothetical GPU issuing on every cycle, not a measurement",
    ("14_decoding", "21×"): "computed: torch's 3501 GB/s / the split-KV kernel's 166 GB/s (decoding.md)",
}


def _key(num: str, unit: str) -> str:
    """How ALLOWED writes a quoted number: '26 µs', '84%', '2.5×'."""
    return f"{num}{unit}" if unit in ("%", "×") else f"{num} {unit}"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def quotes(text: str):
    """[(number as written, unit, the matched text)] for every number with a unit in `text`, including the
    cells of markdown tables whose header names a unit, e.g. "time (µs)"."""
    found = []
    for m in QUOTE.finditer(text):
        unit = UNIT_ALIASES[m.group(3)]
        for num in filter(None, (m.group(1), m.group(2))):
            found.append((num, unit, m.group(0)))
    lines = text.splitlines()
    for i, line in enumerate(lines):  # a table header, its --- row, then rows
        if not (line.lstrip().startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: ")
                and "---" in lines[i + 1]):
            continue
        header = [c.strip() for c in line.strip().strip("|").split("|")]
        units = {}
        for col, cell in enumerate(header):
            h = HEADER_UNIT.search(cell)
            if h:
                units[col] = UNIT_ALIASES[h.group(1) or h.group(2)]
        for row in lines[i + 2:]:
            if not row.lstrip().startswith("|"):
                break
            cells = [c.strip().strip("*") for c in row.strip().strip("|").split("|")]
            for col, unit in units.items():
                if col < len(cells) and re.fullmatch(NUM, cells[col]):
                    found.append((cells[col], unit, f"{cells[col]} ({header[col]})"))
    return found


def source_quotes(path: Path):
    """quotes() of a course source: its markdown cells and the string constants of its code cells."""
    out = []
    for kind, src in parse_cells(path.read_text()):
        if kind == "markdown":
            out += quotes(src)
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:  # notebook magics; none today
            continue
        specs = {id(c) for f in ast.walk(tree) if isinstance(f, ast.FormattedValue) and f.format_spec
                 for c in ast.walk(f.format_spec)}  # "{x:4.0%}" is a format, not a quoted 4.0%
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in specs:
                out += quotes(node.value)
    return out


_COLUMN_UNITS = {"tflops": ("TFLOP/s", 1), "ms": ("ms", 1), "registers": ("registers", 1), "regs": ("registers", 1),
                 "occupancy": ("%", 100), "vs_sdpa_fp32": ("%", 100), "time_ns": ("ns", 1),
                 "issue_active_pct": ("%", 1)}


def _json_values(obj, key=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _json_values(v, k)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if key.endswith("_us"):
            yield "µs", obj
        elif key == "ms" or key.endswith("_ms"):
            yield "ms", obj
        elif key == "registers":
            yield "registers", obj
        elif key == "tflops":
            yield "TFLOP/s", obj


def data_values() -> dict:
    """{unit: [values]} from every committed data file."""
    values = defaultdict(list)
    for path in DATA_FILES:
        text = path.read_text()
        if path.suffix == ".md":
            for num, unit, _ in quotes(text):
                values[unit].append(_number(num))
        elif path.suffix == ".csv":
            rows = list(csv.DictReader(io.StringIO(text)))
            for row in rows:
                if "key" in row and "value" in row:  # key/value files (issue_profile.csv)
                    row = {row["key"]: row["value"]}
                for col, cell in row.items():
                    if col in _COLUMN_UNITS and cell not in (None, ""):
                        unit, factor = _COLUMN_UNITS[col]
                        values[unit].append(float(cell) * factor)
        elif path.suffix == ".json":
            for unit, v in _json_values(json.loads(text)):
                values[unit].append(float(v))
    return values


def matches(num: str, unit: str, values: dict) -> bool:
    """Does some recorded value with this unit round to `num` at the precision it is written with?"""
    q, tol = _number(num), 0.5 * 10.0 ** -_decimals(num) + 1e-9
    return any(abs(v - q) <= tol for v in values.get(unit, ()))


@pytest.fixture(scope="module")
def recorded():
    return data_values()


def test_the_data_files_hold_quoted_values(recorded):
    # guards the index itself: a parser that read nothing would make every lesson look orphaned
    assert DATA_FILES and {"TFLOP/s", "ms", "%", "×", "µs", "registers"} <= set(recorded)
    from flashlab.bench import load_lesson_facts

    launch_us = load_lesson_facts()["launch"]["numba_event_us"]
    assert matches("27.3", "TFLOP/s", recorded) and matches(f"{launch_us:.1f}", "µs", recorded)
    assert not matches("27.35", "TFLOP/s", recorded)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_quoted_numbers_come_from_data(path, recorded):
    orphans = []
    for num, unit, text in source_quotes(path):
        if matches(num, unit, recorded) or (path.stem, _key(num, unit)) in ALLOWED:
            continue
        orphans.append(f"{text!r} ({num} {unit})")
    assert not orphans, (
        f"{path.relative_to(ROOT)} quotes numbers found in no committed data file: {orphans}. Measure them "
        "and commit the result (benchmarks/results/, flashlab/data/), compute them in the notebook without "
        "quoting them in the text, or add them to ALLOWED in tests/test_lesson_numbers.py with their source.")


def test_every_allowed_number_is_still_quoted():
    used = {(path.stem, _key(num, unit)) for path in SOURCES for num, unit, _ in source_quotes(path)}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries no lesson quotes any more (remove them): {stale}"


def test_the_extractor_catches_a_new_number(recorded):
    # numbers no data file holds (the recorded set grows with every benchmark: keep these odd)
    text = "Our kernel now launches in 9173 µs and reaches 913.7 TFLOP/s, 97.3x faster (9913% of SDPA)."
    found = [(n, u) for n, u, _ in quotes(text)]
    assert found == [("9173", "µs"), ("913.7", "TFLOP/s"), ("97.3", "×"), ("9913", "%")]
    assert not any(matches(n, u, recorded) for n, u in found)
    table = "| Nk | time (µs) |\n| --- | --- |\n| 4096 | 3597 |\n| 8192 | 1234 |\n"
    assert [(n, u) for n, u, _ in quotes(table)] == [("3597", "µs"), ("1234", "µs")]
    assert quotes("a 4 x 4 micro-tile of 32 × 16 threads") == []


# ------------------------------------------------------------------------ the data files lessons load
DATA_PATH = re.compile(r"(?:benchmarks/results|flashlab/data|docs)/[\w./-]*\w\.(?:csv|md|json|png)")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_data_files_named_in_lessons_exist(path):
    missing = sorted({m for m in DATA_PATH.findall(path.read_text()) if not (ROOT / m).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names data files that are not in the repository: {missing}"


def test_data_files_the_figures_load_exist():
    from flashlab import bench
    from flashlab.viz import gpu

    for p in (gpu.SWEEP_CSV, gpu.ISSUE_CSV, gpu.FORWARD_CSV, bench.FACTS_JSON):
        assert p.exists(), f"{p} is missing: a lesson's figure or number loads it"
    assert gpu.load_tile_sweep() and gpu.load_issue_profile() and bench.load_lesson_facts()


def test_recorded_fallback_numbers_are_in_the_h100_results():
    # viz.gpu.RECORDED stands in for benchmarks/results/forward.csv where that file is absent (Colab)
    from flashlab.viz import gpu

    with open(ROOT / "benchmarks" / "results" / "h100" / "forward.csv", newline="") as f:
        h100 = {(int(r["N"]), int(r["d"]), r["impl"]): float(r["tflops"]) for r in csv.DictReader(f)}
    for row in gpu.RECORDED:
        key = (row["N"], row["d"], row["impl"])
        assert h100.get(key) == row["tflops"], f"viz.gpu.RECORDED {key} = {row['tflops']} is not in h100/forward.csv"
