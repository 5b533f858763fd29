"""Reading config.json into a ModelSpec: the one place shapes come from."""

import json

import pytest

from workflow.errors import InputError
from workflow.spec import PRESETS, hf_config, load_spec, spec_from_config


def test_hf_config_round_trip():
    for spec in PRESETS.values():
        assert spec_from_config(hf_config(spec)) == spec


def test_full_preset_is_moss_speech():
    s = PRESETS["full"]
    assert (s.hidden_size, s.intermediate_size, s.num_shared_layers, s.num_modality_layers) == (4096, 12288, 32, 4)
    assert (s.vocab_size, s.audio_vocab_size, s.num_layers) == (151680, 16512, 40)
    assert hf_config(s)["num_hidden_layers"] == 36


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("rope_theta"), "field 'rope_theta' is missing"),
        (lambda c: c.pop("hidden_size"), "field 'hidden_size' is missing"),
        (lambda c: c.update(hidden_size="4096"), "field 'hidden_size' must be int, got str"),
        (lambda c: c.update(num_shared_layers=True), "must be int, got bool"),
        (lambda c: c.update(num_hidden_layers=40), "must equal num_hidden_layers"),
        (lambda c: c.update(model_type="qwen3"), "model_type is 'qwen3'"),
        (lambda c: c.update(rope_scaling={"type": "yarn"}), "rope_scaling"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, change, message):
    cfg = hf_config(PRESETS["tiny"])
    change(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError) as e:
        load_spec(tmp_path)
    assert message in str(e.value)
    assert str(tmp_path / "config.json") in str(e.value)
    assert "\n" not in str(e.value)
