"""EngineOptions: validated once, the same object from config through engine.json to the engine."""

from __future__ import annotations

import json

import pytest

from workflow.engines import load_engine, read_engine_json
from workflow.engines.options import EngineOptions
from workflow.errors import InputError


def test_the_options_build_stored_are_the_ones_the_engine_runs_with(tiny_engine_dir):
    """conftest builds with {precision, max_batch} as --options-json; the rest are the defaults."""
    stored = read_engine_json(tiny_engine_dir)["options"]
    assert stored == EngineOptions(max_batch=4)
    assert EngineOptions.from_dict(stored.to_dict()) == stored
    engine = load_engine(tiny_engine_dir, max_batch=2)
    assert engine.options == EngineOptions(max_batch=2) and engine.max_batch == 2


@pytest.mark.parametrize(
    ("values", "where", "problem"),
    [
        ({"dtype": "float16"}, "config: engine.dtype", "unknown dtype 'float16' (known: float32, bfloat16)"),
        ({"device": "tpu"}, "config: engine.device", "unknown device 'tpu' (cpu or cuda)"),
        ({"max_seq_len": 0}, "config: engine.max_seq_len", "must be at least 1, not 0"),
        ({"compile": "yes"}, "config: engine.compile", "'yes' is not true or false"),
        ({"max_batch": True}, "config: engine.max_batch", "True is not an integer"),
    ],
)
def test_a_bad_option_is_one_line_naming_the_field(values, where, problem):
    with pytest.raises(InputError) as e:
        EngineOptions.from_dict(values)
    assert str(e.value) == f"{where}: {problem}"


def test_the_kernels_run_on_a_cpu_only_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineOptions(gemv=True, decode_attention=True).gemv
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="gemv: a Triton kernel of the torch backend on cuda"):
        EngineOptions(gemv=True)
    assert EngineOptions(device="cuda:1", gemv=True).on_cuda


def test_opening_an_engine_where_it_cannot_run_names_its_engine_json(tmp_path):
    meta = {"format": 2, "options": {"backend": "trtllm", "device": "cuda"}}
    (tmp_path / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(InputError) as e:
        load_engine(tmp_path, device="cpu")
    assert str(e.value) == f"{tmp_path / 'engine.json'}: backend: backend trtllm runs on cuda only, not on device 'cpu'"
    (tmp_path / "engine.json").write_text(json.dumps({"format": 2, "options": {"fp8_fast_acum": True}}))
    with pytest.raises(InputError, match="unknown engine option"):
        read_engine_json(tmp_path)
