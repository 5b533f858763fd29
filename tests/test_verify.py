"""verify passes a correct engine and fails closed on seeded conversion bugs."""

import json

import pytest
import torch
from conftest import build_engine, verify_params, write_variant

from workflow import verify
from workflow.errors import InputError


def run_verify(engine, ckpt, hf, out, **params):
    verify.main(
        ["--engine", str(engine), "--ckpt", str(ckpt), "--hf", str(hf), "--out", str(out), "--params", verify_params(**params)]
    )


def test_correct_engine_passes(tiny_engine_dir, tiny_ckpt, tiny_hf, tmp_path):
    out = tmp_path / "verify.json"
    run_verify(tiny_engine_dir, tiny_ckpt, tiny_hf, out)
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["failures"] == []
    for head in ("text", "audio"):
        m = report["teacher_forced"][head]
        assert m["top1"] == 1.0 and m["max_abs_diff"] < 1e-3 and m["positions_used"] > 0
    assert report["greedy"]["match_fraction"] == 1.0
    assert report["greedy"]["modality_switches"] >= 1


def _swap_mlp_halves(t, cfg, spec):
    n = spec.num_shared_layers - 1  # one trunk layer
    a, b = f"transformer.layers.{n}.mlp.fc.weight", f"transformer.layers.{n}.mlp.gate.weight"
    t[a], t[b] = t[b], t[a]


def _drop_qk_norm(t, cfg, spec):
    for name in t:
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            t[name] = torch.ones_like(t[name])


BUGS = {
    "mlp_halves_swapped": _swap_mlp_halves,
    "qk_norm_dropped": _drop_qk_norm,
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_seeded_bug_fails_verify(bug, tiny_ckpt, tiny_hf, tmp_path):
    bad = write_variant(tiny_ckpt, tmp_path / "ckpt", BUGS[bug])
    engine = build_engine(bad, tmp_path / "engine")
    out = tmp_path / "verify.json"
    with pytest.raises(SystemExit) as e:
        run_verify(engine, bad, tiny_hf, out, num_prompts=4, greedy_steps=16)
    assert "verify FAILED" in str(e.value)
    assert not out.exists(), "a failing verify must not leave verify.json"
    report = json.loads(out.with_suffix(".failed.json").read_text())
    assert report["passed"] is False and report["failures"]


def test_engine_from_another_checkpoint_is_refused(tiny_engine_dir, tiny_ckpt, tiny_hf, tmp_path):
    other = write_variant(tiny_ckpt, tmp_path / "other", lambda t, c, s: t["lm_head.weight"][0].add_(1.0))
    with pytest.raises(InputError, match="built from checkpoint"):
        run_verify(tiny_engine_dir, other, tiny_hf, tmp_path / "verify.json")
