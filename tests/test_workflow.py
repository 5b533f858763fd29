"""The Snakemake workflow end to end on the embedded default, in a scratch directory."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


def planned(workdir: Path, *args: str) -> set[str]:
    """The rules `snakemake -n` would run."""
    r = snakemake(workdir, "-n", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(re.findall(r"^(?:local)?rule (\w+):", r.stdout, flags=re.M))


def test_dry_run_lists_every_stage(tmp_path):
    r = snakemake(tmp_path, "-n")
    assert r.returncode == 0, r.stderr
    for rule in ("download", "convert", "calibrate", "build", "verify", "benchmark"):
        assert f"rule {rule}:" in r.stdout, rule


def test_bad_source_fails_before_any_job(tmp_path):
    r = snakemake(tmp_path, "-n", "--config", "model={source: ftp://x}")
    assert r.returncode != 0
    assert "unknown source 'ftp://x'" in r.stdout + r.stderr


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chain")
    r = snakemake(workdir, "-c2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return workdir


def test_whole_chain_passes_verify_and_benchmarks(chain):
    variant = chain / "results" / "tiny" / "torch-bf16"
    assert json.loads((variant / "verify.json").read_text())["passed"] is True
    bench = json.loads((variant / "benchmark" / "benchmark.json").read_text())
    assert bench["summary"]["ttfa_ms_p50"] > 0 and bench["summary"]["rtf"] > 0
    assert (variant / "benchmark" / "benchmark.md").read_text().startswith("# Streaming benchmark")


def test_second_run_does_nothing(chain):
    r = snakemake(chain, "-c2")
    assert r.returncode == 0
    assert "Nothing to be done" in r.stdout + r.stderr


FP8 = ["--config", "engine={precision: fp8}", "calibration={num_samples: 64}", "benchmark={runs: 1, concurrency: [1]}"]


@pytest.fixture(scope="module")
def fp8_chain(chain):
    r = snakemake(chain, "-c2", *FP8)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return chain


def test_fp8_chain_reuses_the_download_and_passes_verify(fp8_chain):
    report = json.loads((fp8_chain / "results" / "tiny" / "torch-fp8" / "verify.json").read_text())
    assert report["passed"] and report["precision"] == "fp8"
    assert report["held_out"]["disjoint"]
    assert planned(fp8_chain, *FP8) == set()


def test_calibration_change_reruns_calibrate_and_what_follows(fp8_chain):
    changed = [*FP8[:2], "calibration={num_samples: 65}", *FP8[3:]]
    assert planned(fp8_chain, *changed) == {"calibrate", "build", "verify", "benchmark", "all"}
    # bf16 passes the checkpoint through: calibration settings do not touch it
    assert planned(fp8_chain, "--config", "calibration={num_samples: 65}") == set()
