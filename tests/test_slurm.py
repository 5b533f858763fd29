"""The tiny chain under `snakemake --executor slurm` on a real single-node SLURM (slurmcluster.py):
each rule is its own SLURM job and asks for the resources config gives it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from slurmcluster import PARTITION, Cluster, missing_binaries

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["download", "convert", "calibrate", "build", "verify", "benchmark"]
KILL_AFTER_S = 1500

# The engine computes on the CPU (the tiny chain); verify alone also asks SLURM for a GPU (the
# node's fake one), so that the request is seen reaching sbatch and slurmctld.
CONFIG = {
    "resources": {
        "default": {"threads": 2, "mem_mb": 2000, "runtime": 15, "slurm_partition": PARTITION},
        "verify": {"gpu": 1, "mem_mb": 3000, "runtime": 10},
    },
    "benchmark": {"runs": 1, "concurrency": [1]},
}


def cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run munged, slurmctld and slurmd"
    if missing := missing_binaries():
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge (.ci/run does)"
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (requirements.txt)"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if reason := cannot_run():
        if os.environ.get("MOSSBUILD_REQUIRE_SLURM"):  # CI installs SLURM: never skip there
            pytest.fail(reason)
        pytest.skip(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def slurm_chain(cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm-chain")
    (workdir / "test.yaml").write_text(yaml.safe_dump(CONFIG))
    # without an accounting database: status from squeue (slurm.conf keeps finished jobs for
    # MinJobAge), no account; under a hard kill since the plugin may ignore SIGTERM
    cmd = [
        "timeout", "-s", "KILL", str(KILL_AFTER_S), sys.executable, "-m", "snakemake",
        "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "--workflow-profile", str(ROOT / "profiles" / "slurm"),
        "--configfile", str(workdir / "test.yaml"), "--slurm-status-command", "squeue",
        "--slurm-init-seconds-before-status-checks", "5", "--slurm-no-account",
    ]  # fmt: skip
    r = subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=KILL_AFTER_S + 60)
    return workdir, r, cluster.sbatch_lines(), cluster.jobs()


def rule_of(sbatch_line: str) -> str:
    return re.search(r"--comment rule_([a-z]+)", sbatch_line).group(1)


def test_each_rule_runs_as_its_own_slurm_job_with_its_resources(slurm_chain, capsys):
    workdir, r, lines, jobs = slurm_chain
    with capsys.disabled():
        print("\nsbatch lines seen:", *lines, sep="\n  ")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    verify = json.loads((workdir / "results/tiny/torch-bf16/verify.json").read_text())
    assert verify["passed"] is True and verify["device"] == "cpu"  # a GPU asked for, the CPU computing

    # one sbatch per stage; `all` and `pages` run on the submitting machine
    assert sorted(rule_of(line) for line in lines) == sorted(STAGES)
    for line in lines:
        want = CONFIG["resources"]["default"] | CONFIG["resources"].get(rule_of(line), {})
        options = line.split(" --wrap=")[0]
        assert f" -p {PARTITION} -t {want['runtime']} --mem {want['mem_mb']} " in options, line
        assert f" --cpus-per-task={want['threads']} " in options, line
        assert re.findall(r" --gpus=\S+", options) == ([f" --gpus={want['gpu']}"] if "gpu" in want else []), line

    # and slurmctld ran each of them, with the fake GPU for verify only
    by_rule = {j["Comment"].removeprefix("rule_"): j for j in jobs}
    assert sorted(by_rule) == sorted(STAGES), jobs
    for rule, job in by_rule.items():
        assert job["JobState"] == "COMPLETED" and job["Partition"] == PARTITION, job
        assert job["NumCPUs"] == str(CONFIG["resources"]["default"]["threads"]), job
        assert job.get("TresPerJob", "") == ("gres:gpu:1" if rule == "verify" else ""), job
