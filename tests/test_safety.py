"""Safety: tensors only from safetensors, pickles only with weights_only, no remote code, and a
hub token never written anywhere."""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, verify_params

from workflow.download import HUB_PATTERNS
from workflow.errors import InputError

SOURCES = sorted((ROOT / "workflow").rglob("*.py"))


def calls(path: Path) -> list[tuple[str, ast.Call]]:
    """Every call in a module, with its callee written out (e.g. 'torch.load')."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            out.append((ast.unparse(node.func), node))
    return out


def keyword(call: ast.Call, name: str) -> object:
    kw = next((k for k in call.keywords if k.arg == name), None)
    return ast.literal_eval(kw.value) if kw is not None and isinstance(kw.value, ast.Constant) else kw


UNPICKLERS = {"torch.load", "torch.jit.load", "pickle.load", "pickle.loads", "np.load", "numpy.load", "joblib.load"}


def test_one_reader_unpickles_and_only_with_weights_only():
    """Checkpoints are read with safetensors; the .pt files (the vocoder's, the codec's flow and
    HiFT) all go through one pickle reader, `tensorfile.load_pickle`."""
    found = [(p.name, f, c) for p in SOURCES for f, c in calls(p) if f in UNPICKLERS]
    assert [(name, f) for name, f, _ in found] == [("tensorfile.py", "torch.load")]
    assert keyword(found[0][2], "weights_only") is True


def test_no_remote_code_is_ever_loaded():
    """We build every model from our own config classes: nothing calls from_pretrained or an
    Auto* class, nothing passes trust_remote_code=True, and the hub download fetches no .py."""
    for path in SOURCES:
        for f, call in calls(path):
            assert not f.endswith("from_pretrained") and not f.split(".")[-1].startswith("Auto"), (path.name, f)
            assert keyword(call, "trust_remote_code") in (None, False), (path.name, f)
    for name in ("modeling_moss_speech.py", "configuration_moss_speech.py", "tokenization_moss_speech.py"):
        assert not any(fnmatch.fnmatch(name, p) for p in HUB_PATTERNS), name


@pytest.fixture
def vocoder_dir(tmp_path) -> Path:
    from workflow.vocoder import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["reduced_24khz_100band_256x"]))
    return tmp_path


class Exploit:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_vocoder_pickle_is_refused_not_run(vocoder_dir, tmp_path):
    from workflow.vocoder import load_bigvgan

    marker = tmp_path / "pwned"
    torch.save({"generator": Exploit(marker)}, vocoder_dir / "bigvgan_generator.pt")
    with pytest.raises(InputError) as e:
        load_bigvgan("reduced_24khz_100band_256x", str(vocoder_dir), torch.device("cpu"), torch.float32)
    path = vocoder_dir / "bigvgan_generator.pt"
    problem = "refused: not a plain tensor file (Trying to load unsupported GLOBAL posix.system whose module posix is blocked.)"
    assert str(e.value) == f"{path}: {problem}"
    assert not marker.exists(), "the pickle's code ran"


def test_a_plain_vocoder_state_dict_still_loads(vocoder_dir):
    """The refusal above is weights_only at work, not every file refused."""
    import bigvgan
    from bigvgan.env import AttrDict

    from workflow.vocoder import load_bigvgan

    torch.manual_seed(123)  # not load_bigvgan's own seed, so the weights tell the two apart
    saved = bigvgan.BigVGAN(AttrDict(json.loads((vocoder_dir / "config.json").read_text())))
    torch.save({"generator": saved.state_dict()}, vocoder_dir / "bigvgan_generator.pt")
    loaded, info = load_bigvgan("reduced_24khz_100band_256x", str(vocoder_dir), torch.device("cpu"), torch.float32)
    assert info.weights == str(vocoder_dir)
    assert torch.equal(loaded.conv_pre.bias, saved.conv_pre.bias)


def test_a_hub_token_is_never_written(tiny_hf, tmp_path):
    """HF_TOKEN set for every stage but benchmark (download from a local source, convert,
    calibrate, build, verify): no file written and no line printed holds it."""
    token = "hf_secret" + secrets.token_hex(12)
    env = {**os.environ, "HF_TOKEN": token, "HUGGING_FACE_HUB_TOKEN": token}
    r = tmp_path / "results"
    stages = [
        ("download", "--source", f"local:{tiny_hf}", "--out", r / "hf"),
        ("convert", "--hf", r / "hf", "--out", r / "ckpt-bf16"),
        ("calibrate", "--ckpt", r / "ckpt-bf16", "--hf", r / "hf", "--precision", "bf16", "--out", r / "calib-bf16"),
        ("build", "--ckpt", r / "calib-bf16/checkpoint", "--out", r / "torch-bf16/engine"),
        ("verify", "--engine", r / "torch-bf16/engine", "--ckpt", r / "calib-bf16/checkpoint", "--hf", r / "hf",
         "--out", r / "torch-bf16/verify.json", "--params", verify_params(num_prompts=4, greedy_steps=8)),
    ]  # fmt: skip
    printed = []
    for stage, *args in stages:
        p = subprocess.run(
            [sys.executable, "-m", f"workflow.{stage}", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert p.returncode == 0, p.stderr[-2000:]
        printed.append(p.stdout + p.stderr)
    assert (r / "torch-bf16/verify.json").exists()
    written = [p for p in r.rglob("*") if p.is_file()]
    assert len(written) > 10
    assert not [p for p in written if token.encode() in p.read_bytes()]
    assert not [out for out in printed if token in out]
