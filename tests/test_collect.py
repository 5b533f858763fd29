"""benchmarks/collect.py over committed GPU runs: the figures the README quotes come out of it."""

import json
import re
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
COLLECT = Path(__file__).resolve().parents[1] / "benchmarks" / "collect.py"


def collect(tmp_path: Path, run: str, *variants: str) -> dict:
    args = [arg for v in variants for arg in (f"--{v}", str(RESULTS / run / f"torch-{v}"))]
    out = tmp_path / "summary.json"
    tsv = RESULTS / run / "benchmarks" / "calibrate-fp8.tsv"
    cmd = [sys.executable, str(COLLECT), *args, "--calibrate-tsv", str(tsv), "--date", "d", "--command", "c", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "run",
    [
        "2026-11-23-h100-full7",
        "2026-11-23-h100-full9",
        "2026-11-24-h100-full10",
        "2026-11-24-h100-full11",
        "2026-11-24-h100-full12",
        "2026-11-24-h200-full4",
        "2026-11-24-h200-full5",
    ],
)
def test_both_variants_give_the_committed_summary(tmp_path, run):
    """H100 runs 7, 9, 10, 11 and 12 and H200 runs 4 and 5 (README's table quotes H100 run 11 and
    H200 run 5, its text runs 12 and 4): each summary.json, recomputed from its two variants' files."""
    got = collect(tmp_path, run, "bf16", "fp8")
    want = json.loads((RESULTS / run / "summary.json").read_text())
    keys = ("decode_step_ms", "decode_vs_floor", "fp8_decode_speedup", "fp8_prefill_speedup", "ttfa_ms_p50")
    for key in (*keys, "max_streams_rtf_below_1"):
        assert got[key] == want[key]
    assert [g["met"] for g in got["goals"]] == [g["met"] for g in want["goals"]]


def test_one_variant_marks_what_it_cannot_judge(tmp_path):
    """FP8 alone (run 8): its own figures and goals; bf16's and the ratios between the two are
    not measured, neither met nor missed."""
    got = collect(tmp_path, "2026-11-23-h100-full8", "fp8")
    assert set(got["decode_step_ms"]) == {"fp8"} and "fp8_decode_speedup" not in got
    goals = {g["figure"]: g for g in got["goals"]}
    assert goals["decode_vs_floor.fp8"]["met"] is False and goals["rtf.fp8"]["met"] is True
    for figure in ("decode_vs_floor.bf16", "fp8_decode_speedup", "fp8_prefill_speedup"):
        assert goals[figure]["measured"] is None and goals[figure]["met"] is None


def test_the_speed_up_spreads_the_text_catch_up_where_it_was_measured(tmp_path):
    """Run 10 (text branch deferred): the FP8 speed-up is judged on steps with the catch-up
    spread over the reply, not on the bare audio steps; run 9 (no catch-up measured) on its steps."""
    got = collect(tmp_path, "2026-11-24-h100-full10", "bf16", "fp8")
    spread, bare = got["decode_step_amortized_ms"], got["decode_step_ms"]
    assert all(spread[p] > bare[p] for p in ("bf16", "fp8"))
    assert got["fp8_decode_speedup"] == spread["bf16"] / spread["fp8"] != bare["bf16"] / bare["fp8"]
    old = collect(tmp_path, "2026-11-23-h100-full9", "bf16", "fp8")
    assert "decode_step_amortized_ms" not in old
    assert old["fp8_decode_speedup"] == old["decode_step_ms"]["bf16"] / old["decode_step_ms"]["fp8"]


def test_every_result_the_docs_name_is_committed():
    """README.md and the lever ledger point at result directories and the patches of reverted
    levers: each must exist, or a claim would rest on nothing a reader can open."""
    root = RESULTS.parents[1]
    readme = (root / "README.md").read_text()
    named = {m.rstrip("/.") for m in re.findall(r"benchmarks/results/[\w./*-]+", readme)}
    assert len(named) > 10
    for path in named:
        assert list(root.glob(path)), f"README.md names {path}, which is not committed"
    lines = (RESULTS / "LEVERS.md").read_text().splitlines()
    start = lines.index("| probe | lever | predicted | measured | verdict | where |") + 2  # past the header row
    rows = list(takewhile(lambda line: line.startswith("|"), lines[start:]))  # the table ends at its first other line
    assert len(rows) > 60
    for row in rows:
        where = row.split("|")[-2]
        dirs = re.findall(r"`(\d{4}-\d{2}-\d{2}-[\w-]+)/`", where)
        assert dirs, f"LEVERS.md row names no directory: {row[:80]}"
        for d in dirs:
            assert (RESULTS / d).is_dir(), f"LEVERS.md names {d}/, which is not committed"
        for patch in re.findall(r"`([\w-]+\.patch)`", row):
            assert any((RESULTS / d / patch).is_file() for d in dirs), f"LEVERS.md names {patch} beside {dirs}"
