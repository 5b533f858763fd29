"""The Snakemake workflow end to end on the embedded default, in a scratch directory."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


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
    import json

    variant = chain / "results" / "tiny" / "torch-bf16"
    assert json.loads((variant / "verify.json").read_text())["passed"] is True
    bench = json.loads((variant / "benchmark" / "benchmark.json").read_text())
    assert bench["summary"]["ttfa_ms_p50"] > 0 and bench["summary"]["rtf"] > 0
    assert (variant / "benchmark" / "benchmark.md").read_text().startswith("# Streaming benchmark")


def test_second_run_does_nothing(chain):
    r = snakemake(chain, "-c2")
    assert r.returncode == 0
    assert "Nothing to be done" in r.stdout + r.stderr
