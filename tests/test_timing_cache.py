"""The GEMV's timing cache (`engine.timing_cache`, workflow/engines/timing_cache.py): blocks kept by device key,
taken by the tuner instead of timing them, the file written whole or not at all, and a bad file refused in one
line naming it. Tuning itself times on a GPU: its part with a cache runs in tests/test_gemv.py on CUDA."""

import json
from types import SimpleNamespace

import pytest
import torch

from workflow.engines import blocks, timing_cache, tuning
from workflow.engines.blocks import Block, Body, Fuse, Tuned, Use
from workflow.engines.options import EngineOptions
from workflow.errors import InputError

W = torch.zeros(64, 32, dtype=torch.bfloat16)
ONE = {Use.of(W, Fuse.NORM, m): Tuned(Block(Body.RESIDENT, 2, 32, 4, 4), 0.01 * m) for m in blocks.ROWS}


def test_blocks_written_under_a_device_key_read_back_under_it_only(tmp_path):
    path = tmp_path / "cache" / "gemv-timing.json"
    assert timing_cache.read(path, "H200") == {}  # no file yet: nothing known
    timing_cache.write(path, "H200", ONE)
    other = {Use.of(W, Fuse.RES, 1): Tuned(Block(Body.TILE, 4, 32, 4), 0.02)}
    timing_cache.write(path, "H100", other)
    assert timing_cache.read(path, "H200") == ONE and timing_cache.read(path, "H100") == other
    assert timing_cache.read(path, "H200, another triton") == {}
    more = {Use.of(W, Fuse.NONE, 1): Tuned(Block(Body.TILE, 8, 32, 4), 0.03)}
    timing_cache.write(path, "H200", more)  # added to what the key held
    assert timing_cache.read(path, "H200") == ONE | more
    assert [p.name for p in path.parent.iterdir()] == ["gemv-timing.json"]  # no temporary file left


@pytest.mark.parametrize(
    "text, said",
    [
        ("{not json", "not JSON"),
        (json.dumps({"format": 9, "devices": {}}), "not a GEMV timing cache of format 1"),
        (json.dumps({"format": 1, "devices": {"H200": {"64x32:2:norm:1": {"body": "warp"}}}}), "an entry under 'H200'"),
    ],
)
def test_a_bad_cache_is_refused_in_one_line_naming_it(tmp_path, text, said):
    path = tmp_path / "gemv-timing.json"
    path.write_text(text)
    with pytest.raises(InputError, match=said) as e:
        timing_cache.read(path, "H200")
    assert str(path) in str(e.value) and "\n" not in str(e.value) and "delete it" in str(e.value)


def test_the_tuner_takes_known_blocks_without_timing_them():
    """Every use's rows known: nothing is timed (no GPU here to time on), the known blocks come back as they are."""
    assert tuning.tune([(W, Fuse.NORM), (W, Fuse.NORM)], known=ONE) == ONE


def test_the_device_key_names_the_gpu_and_changes_with_it(monkeypatch):
    props = {"NVIDIA H200": SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props[device])
    key = timing_cache.device_key("NVIDIA H200")
    assert key.startswith("NVIDIA H200, sm_90, 132 SMs, triton ") and f"torch {torch.__version__}" in key
    props["NVIDIA H200"] = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=64)
    assert timing_cache.device_key("NVIDIA H200") != key


def test_only_the_torch_backend_takes_a_timing_cache():
    assert EngineOptions(timing_cache="results/gemv-timing.json").timing_cache == "results/gemv-timing.json"
    with pytest.raises(ValueError, match="timing_cache: an option of the torch backend"):
        EngineOptions(backend="trtllm", device="cuda", timing_cache="results/gemv-timing.json")


def test_a_build_without_the_gemv_on_cuda_neither_reads_nor_writes_the_cache(tiny_ckpt, tmp_path):
    """The tiny engine on the CPU tunes nothing: a timing cache named in its options is left alone (a bad file too)."""
    from workflow import build

    cache = tmp_path / "gemv-timing.json"
    cache.write_text("{not json")
    options = json.dumps({"timing_cache": str(cache)})
    build.main(["--ckpt", str(tiny_ckpt), "--out", str(tmp_path / "engine"), "--options-json", options])
    assert json.loads((tmp_path / "engine" / "engine.json").read_text())["options"]["timing_cache"] == str(cache)
    assert cache.read_text() == "{not json"


def test_engine_json_records_the_versions_a_tuned_block_depends_on(tiny_engine_dir):
    """engine.json names what computed the engine, Triton (our kernels' compiler) among them where it is installed."""
    import importlib.util

    found = json.loads((tiny_engine_dir / "engine.json").read_text())["versions"]
    assert found["torch"] == torch.__version__ and {"python", "transformers"} <= set(found)
    if importlib.util.find_spec("triton") is not None:
        import triton

        assert found["triton"] == triton.__version__
    assert found.get("cuda") == torch.version.cuda
