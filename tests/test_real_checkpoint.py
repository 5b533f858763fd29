"""A checkpoint the project did not make, end to end: the hub's layout (three shards split
inside layers), plain random weights that never switch modality by themselves, sizes unlike
any preset (tests/hubckpt.py). The whole chain runs on it as a user runs it, with
`model.source: local:<dir>`, for bf16 and then fp8, and verify must pass on both with its
default settings: forced switches cross modality where the weights never do, and top-1 is
judged only where the reference decides (a plain-random head is unsure of every token)."""

from __future__ import annotations

import json
from pathlib import Path

import hubckpt
import pytest
from conftest import CONFIG
from test_workflow import Workflow

from workflow.artifacts import read_manifest
from workflow.trtckpt import read_config

QUICK = ["benchmark={runs: 1, concurrency: [1], num_tokens: 10, baseline: false}", "calibration={num_samples: 64}"]


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> tuple[Workflow, Path, str]:
    """The workflow in a scratch work directory, the checkpoint, and the results' tag."""
    source = hubckpt.write(tmp_path_factory.mktemp("downloads") / "moss-speech-rnd")
    return Workflow(Path(__file__).resolve().parents[1], tmp_path_factory.mktemp("work")), source, "local-moss-speech-rnd"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_chain_passes_on_a_plain_random_hub_layout_checkpoint(user, precision):
    wf, source, tag = user
    r = wf.run("-c2", "--config", f"model={{source: 'local:{source}'}}", f"engine={{precision: {precision}}}", *QUICK)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = wf.workdir / "results" / tag
    assert sorted(read_manifest(results / "hf")["files"]) == sorted(p.name for p in source.iterdir())
    _, spec = read_config(results / f"calib-{precision}" / "checkpoint")
    assert (spec.hidden_size, spec.num_layers, spec.rms_norm_eps, spec.rope_theta) == (160, 8, 1e-5, 500000.0)
    report = json.loads((results / f"torch-{precision}" / "verify.json").read_text())
    assert report["passed"] and report["precision"] == precision
    assert report["config"]["differences"] == []
    g = report["greedy"]
    assert g["natural_switches"] == 0, "these weights switch by themselves: the test no longer shows forcing at work"
    assert g["forced_switches"] >= CONFIG["verify"]["thresholds"][precision]["min_switches"]
    assert g["switches_to_audio"] > 0 and g["switches_to_text"] > 0
    if precision == "bf16":  # float32 on the CPU: every position and every greedy step agree
        assert g["matched"] == g["sequences"]
        assert report["teacher_forced"]["text"]["positions_decided"] == report["teacher_forced"]["text"]["positions_used"]
    bench = json.loads((results / f"torch-{precision}" / "benchmark" / "benchmark.json").read_text())
    assert bench["summary"]["ttfa_ms_p50"] > 0
