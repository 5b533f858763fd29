"""verify passes a correct engine and fails closed on every seeded bug (tests/seeded_bugs.py)."""

import json

import pytest
import torch
from conftest import CONFIG, build_engine, verify_params, write_variant
from seeded_bugs import BUGS

from workflow import generate as generate_module
from workflow import traffic, verify
from workflow.engines import load_engine
from workflow.errors import InputError
from workflow.generate import Ids, generate
from workflow.hfckpt import load_hf_state
from workflow.reference import MossSpeechReference
from workflow.spec import load_spec
from workflow.trtckpt import read_config

QUICK = {"num_prompts": 4, "greedy_steps": 16}  # enough for every seeded bug; the default run is longer


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
    assert report["config"]["differences"] == [] and report["config"]["fields_checked"] > 30
    g = report["greedy"]
    assert g["match_fraction"] == 1.0 and g["matched"] == g["sequences"] and g["diverged_at_tie"] == 0
    # forced switches, both directions, beside the planted model's own, and counted apart
    assert g["force_switch_at"] == CONFIG["verify"]["force_switch_at"]
    assert g["forced_switches"] >= 2 * g["sequences"] and g["natural_switches"] >= 1
    assert g["modality_switches"] == g["forced_switches"] + g["natural_switches"]
    assert g["modality_switches"] == g["switches_to_audio"] + g["switches_to_text"]
    assert min(g["switches_to_audio"], g["switches_to_text"]) >= g["sequences"]


def _checkpoint(precision, request):
    """The correct checkpoint a bug of this precision is seeded into."""
    if precision == "bf16":
        return request.getfixturevalue("tiny_ckpt")
    return request.getfixturevalue("tiny_fp8") / "checkpoint"


@pytest.mark.parametrize("bug", [b for b in BUGS if b.checkpoint and not b.refused_at_build], ids=lambda b: b.name)
def test_seeded_checkpoint_bug_fails_verify(bug, request, tiny_hf, tmp_path):
    bad = write_variant(_checkpoint(bug.precision, request), tmp_path / "ckpt", bug.checkpoint)
    engine = build_engine(bad, tmp_path / "engine", precision=bug.precision)
    out = tmp_path / "verify.json"
    out.write_text('{"passed": true}')  # a stale pass from an earlier run must not survive
    with pytest.raises(SystemExit) as e:
        run_verify(engine, bad, tiny_hf, out, **QUICK)
    assert str(e.value).startswith("verify FAILED: ") and "\n" not in str(e.value)
    assert not out.exists(), "a failing verify must not leave verify.json"
    report = json.loads(out.with_suffix(".failed.json").read_text())
    assert report["passed"] is False
    assert any(f.startswith(bug.fails) for f in report["failures"]), report["failures"]


def evaluate_engine(engine, hf, precision: str = "bf16") -> dict:
    """verify's core on an engine object, with verify's own prompts and thresholds."""
    p = {**CONFIG["verify"], **QUICK}
    spec = load_spec(hf)
    ref = MossSpeechReference(spec, load_hf_state(hf), torch.float32, "cpu")
    prompts = traffic.batch(p["num_prompts"], p["prompt_len"], Ids.of(spec), p["seed"])
    return verify.evaluate(engine, ref, prompts, p["greedy_steps"], p["thresholds"][precision], p["force_switch_at"])


@pytest.mark.parametrize("bug", [b for b in BUGS if b.engine], ids=lambda b: b.name)
def test_seeded_engine_bug_fails_verify(bug, tiny_engine_dir, tiny_hf):
    engine = load_engine(tiny_engine_dir)
    assert evaluate_engine(engine, tiny_hf)["passed"], "the engine must pass before the fault is injected"
    bug.engine(engine)
    report = evaluate_engine(engine, tiny_hf)
    assert report["passed"] is False
    assert any(f.startswith(bug.fails) for f in report["failures"]), report["failures"]


@pytest.mark.parametrize("bug", [b for b in BUGS if b.loop], ids=lambda b: b.name)
def test_seeded_loop_bug_fails_verify(bug, tiny_engine_dir, tiny_hf, monkeypatch):
    """The loop under test is the product's (workflow.generate); the reference runs its own
    (reference.greedy_reference), so a loop bug on the engine's side cannot hide."""
    engine = load_engine(tiny_engine_dir)
    monkeypatch.setattr(generate_module, "advance", bug.loop)
    report = evaluate_engine(engine, tiny_hf)
    assert report["passed"] is False
    assert any(f.startswith(bug.fails) for f in report["failures"]), report["failures"]


def test_forced_switches_go_through_the_loop_as_sampled_ones(tiny_engine_dir, tiny_hf):
    """At a forced step the switch token takes the sampled one's place on both sides, and
    what follows (embedding choice, modality pad, the head read, the deferred text fill)
    still matches the reference token for token."""
    engine = load_engine(tiny_engine_dir)
    engine.defer_text_fill = True
    spec = load_spec(tiny_hf)
    ids = Ids.of(spec)
    ref = MossSpeechReference(spec, load_hf_state(tiny_hf), torch.float32, "cpu")
    prompts = traffic.batch(2, 40, ids, seed=31)
    force = frozenset({0, 1, 5, 9})
    g = verify.greedy(engine, ref, prompts, 12, ids, force)
    assert g["match_fraction"] == 1.0 and g["forced_switches"] == 8
    out = generate(engine, prompts, 12, ids, force_switch_at=force)
    for b in range(2):
        modes = out.audio_mode[b].tolist()
        for k in sorted(force):
            switch = (ids.pad, ids.eosp) if modes[k] else (ids.sosp, ids.audio_pad)
            assert out.tokens[b, k].tolist() == list(switch)
            assert modes[k + 1] != modes[k]


def test_a_checkpoint_that_never_switches_by_itself_still_crosses_switches(tiny_engine_dir, tiny_hf):
    """Without forcing, a model that does not switch within the greedy steps fails
    min_switches whatever its engine computes; forced switches make it pass, reported as such."""
    engine = load_engine(tiny_engine_dir)
    spec = load_spec(tiny_hf)
    ids = Ids.of(spec)
    ref = MossSpeechReference(spec, load_hf_state(tiny_hf), torch.float32, "cpu")
    prompts = traffic.speech_prompt(1, 24, ids, seed=3)[:, :-1]  # text, not yet asked to speak
    alone = verify.greedy(engine, ref, prompts, 3, ids, frozenset())
    assert alone["modality_switches"] == 0
    forced = verify.greedy(engine, ref, prompts, 3, ids, frozenset({0, 1}))
    assert forced["forced_switches"] == 2 and forced["switches_to_audio"] == forced["switches_to_text"] == 1


@pytest.mark.parametrize(
    "field, value, line",
    [
        ("text_layers", [3, 5], "config.text_layers [3, 5] vs [3, 4] (derived from the HF config)"),
        ("rotary_scaling", {"type": "linear", "factor": 2.0}, "config.rotary_scaling {'type': 'linear', 'factor': 2.0} vs None"),
        ("sosp_token_id", 151645, "config.sosp_token_id 151645 vs 151646 (the HF config's sosp_token_id)"),
    ],
)
def test_a_checkpoint_field_the_engine_never_reads_wrong_still_fails(tiny_ckpt, tiny_hf, field, value, line):
    """The torch engine derives its layer plan from the layer counts and ignores rope scaling,
    so its logits cannot show these: the checkpoint's config.json is compared field by field,
    whatever the engine's own spec says (TensorRT-LLM reads them)."""
    cfg, spec = read_config(tiny_ckpt)
    hf = load_spec(tiny_hf)
    assert verify.config_check(spec, hf, cfg)["differences"] == []
    (diff,) = verify.config_check(spec, hf, {**cfg, field: value})["differences"]
    assert diff.startswith(line)


def test_an_engine_deferring_the_text_branch_passes_verify(tiny_engine_dir, tiny_hf):
    """verify's decode path skips the text head where the loop does, so a deferring engine's
    catch-up is what its text logits after audio steps read (and the seeded hole above fails)."""
    engine = load_engine(tiny_engine_dir)
    engine.defer_text_fill = True
    report = evaluate_engine(engine, tiny_hf)
    assert report["passed"], report["failures"]
    assert report["teacher_forced_decode"]["text"]["positions"] < report["teacher_forced_decode"]["audio"]["positions"]


@pytest.mark.parametrize("bug", [b for b in BUGS if b.refused_at_build], ids=lambda b: b.name)
def test_seeded_bug_that_cannot_load_is_refused_at_build(bug, request, tmp_path):
    bad = write_variant(_checkpoint(bug.precision, request), tmp_path / "ckpt", bug.checkpoint)
    with pytest.raises(InputError) as e:
        build_engine(bad, tmp_path / "engine", precision=bug.precision)
    assert str(e.value) == f"{bad / 'rank0.safetensors'}: {bug.refused_at_build}"
    assert not (tmp_path / "engine").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "no temporary engine directory may be left"


def test_engine_from_another_checkpoint_is_refused(tiny_engine_dir, tiny_ckpt, tiny_hf, tmp_path):
    other = write_variant(tiny_ckpt, tmp_path / "other", lambda t, c, s: t["lm_head.weight"][0].add_(1.0))
    with pytest.raises(InputError, match="built from checkpoint"):
        run_verify(tiny_engine_dir, other, tiny_hf, tmp_path / "verify.json")


@pytest.mark.parametrize(
    "thresholds, problem",
    [
        ({}, "no thresholds for precision 'bf16'"),
        ({"bf16": {"top1_min": None}}, "no thresholds for precision 'bf16'"),
        ({"bf16": {"top1_minimum": 1.0}}, "unknown threshold(s) top1_minimum for precision 'bf16'"),
    ],
)
def test_missing_or_misspelt_thresholds_fail_closed(thresholds, problem):
    with pytest.raises(InputError) as e:
        verify.thresholds_for({"thresholds": thresholds}, "bf16")
    assert str(e.value) == f"config: verify.thresholds: {problem}"


def test_a_bug_only_at_batch_one_is_caught(tiny_engine_dir, tiny_hf):
    """The benchmark's headline runs one sequence, through kernels (the fused GEMV) that a full
    batch never reaches: verify must run a single sequence too, not only batches."""
    engine = load_engine(tiny_engine_dir)
    decode = engine.decode

    def single_sequence_bug(tokens, need_text=True):
        text, audio = decode(tokens, need_text)
        return (None if text is None else text.flip(-1) if tokens.shape[0] == 1 else text), audio

    engine.decode = single_sequence_bug
    ref = MossSpeechReference(load_spec(tiny_hf), load_hf_state(tiny_hf), torch.float32, "cpu")
    ids = Ids.of(engine.spec)
    prompts = traffic.batch(1 + engine.max_batch, 24, ids, seed=4)
    assert [len(c) for c in verify.batches(prompts, engine.max_batch)] == [1, engine.max_batch]
    assert verify.teacher_forced(engine, ref, prompts, ids)["decode"]["text"]["top1"] < 1.0
