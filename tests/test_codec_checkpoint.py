"""The codec's real checkpoint files, as the codec repo holds them (flow/flow-chunk-5.pt with its
training counters, flow/hift.pt with a `generator.` prefix and weight norm), read from a local
directory or the hub stand-in: the decoder built from them computes what the original does, and
a bad file is refused in one line that names it."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hubserver import HubServer

from workflow.codec import checkpoint
from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.estimator import PREFIX
from workflow.codec.settings import CodecTiming, decoders
from workflow.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = CodecConfig.tiny()
ROOT = Path(__file__).resolve().parents[1]


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def weight_norm_form(state: dict) -> dict:
    """HiFT's plain conv weights as torch.nn.utils.weight_norm saves them (g and v), for 3-d weights."""
    out = {}
    for k, v in state.items():
        if k.endswith(".weight") and v.dim() == 3:
            g = v.flatten(1).norm(dim=1).reshape(-1, 1, 1)
            out[k[: -len("weight")] + "weight_g"], out[k[: -len("weight")] + "weight_v"] = g, v
        else:
            out[k] = v
    return out


def write_repo(dec: CodecDecoder, root: Path, flow: dict | None = None, hift: dict | None = None) -> Path:
    (root / "flow").mkdir(parents=True, exist_ok=True)
    official = dict(dec.flow.state_dict()) | {PREFIX + k: v for k, v in dec.estimator.state_dict().items()}
    torch.save(flow if flow is not None else official | {"epoch": 7, "step": 1234}, root / checkpoint.FLOW_FILE)
    gen = {"generator." + k: v for k, v in weight_norm_form(dec.hift.state_dict()).items()}
    torch.save(hift if hift is not None else gen, root / checkpoint.HIFT_FILE)
    return root


@pytest.fixture(scope="module")
def original() -> CodecDecoder:
    torch.manual_seed(3)
    return CodecDecoder(TINY).eval()


@torch.no_grad()
def test_a_checkpoint_gives_the_decoder_that_wrote_it(original, tmp_path):
    loaded = checkpoint.load(write_repo(original, tmp_path), TINY)
    prompt = VoicePrompt(torch.arange(5), torch.randn(80, 20), torch.randn(192))
    codes = torch.randint(0, 16384, (13,), generator=torch.Generator().manual_seed(1))
    want = original.whole(codes, prompt)
    assert torch.allclose(loaded.whole(codes, prompt), want, atol=1e-5)  # weight norm folded: float rounding only
    assert torch.equal(loaded.mel(codes, prompt, streaming=True), original.mel(codes, prompt, streaming=True))


def test_the_vocabulary_is_the_checkpoints(original, tmp_path):
    """vocab_size is unconfirmed (docs/codec.md): the embedding's rows say it."""
    wider = CodecDecoder(replace(TINY, encoder=replace(TINY.encoder, vocab_size=20480)))
    assert checkpoint.load(write_repo(wider, tmp_path), TINY).cfg.encoder.vocab_size == 20480


@pytest.mark.parametrize(
    "which, edit, problem",
    [
        ("flow", lambda s: {k: v for k, v in s.items() if "final_proj" not in k}, "missing decoder.estimator.final_proj"),
        ("flow", lambda s: s | {"extra.weight": torch.zeros(1)}, "unexpected extra.weight"),
        ("flow", lambda s: s | {"encoder_proj.weight": torch.zeros(80, 3)}, r"encoder_proj.weight is \[80, 3\], expected"),
        ("flow", lambda s: s | {"encoder_proj.bias": torch.zeros(80, dtype=torch.long)}, "expected floating point"),
        ("hift", lambda s: {k: v for k, v in s.items() if "conv_post" not in k}, "missing conv_post"),
        ("flow", lambda s: Exploit(), "refused: not a plain tensor file"),
        ("hift", lambda s: [1, 2], "holds a list, not a state dict"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_it(original, tmp_path, which, edit, problem):
    official = dict(original.flow.state_dict()) | {PREFIX + k: v for k, v in original.estimator.state_dict().items()}
    hift = {"generator." + k: v for k, v in original.hift.state_dict().items()}
    flow, hift = (edit(official), None) if which == "flow" else (None, edit(hift))
    root = write_repo(original, tmp_path, flow, hift)
    with pytest.raises(InputError, match=problem) as e:
        checkpoint.load(root, TINY)
    name = checkpoint.FLOW_FILE if which == "flow" else checkpoint.HIFT_FILE
    assert e.value.path == str(root / name) and "\n" not in str(e.value)


def test_a_missing_file_and_a_source_without_files_are_one_line(tmp_path):
    with pytest.raises(InputError, match="file is missing"):
        checkpoint.load(tmp_path, TINY)
    with pytest.raises(InputError, match="names no checkpoint"):
        checkpoint.fetch("synthetic:tiny", tmp_path)
    with pytest.raises(InputError, match="no pinned revision"):
        checkpoint.fetch("hf:fnlp/MOSS-Speech-Codec", tmp_path)


def test_the_hub_path_fetches_only_the_two_files_and_the_timing_uses_them(original, tmp_path):
    """Through the hub stand-in, in a process of its own (huggingface_hub reads HF_ENDPOINT once,
    when imported): only the flow and HiFT files are fetched, and the timing's decoders hold them."""
    repo = write_repo(original, tmp_path / "repo")
    (repo / "model.safetensors").write_bytes(b"the encoder: not fetched")
    (repo / "flow" / "flow.pt").write_bytes(b"the offline flow: not fetched")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    with HubServer(deadline=60, max_requests=50) as hub:
        hub.add_repo("fnlp/MOSS-Speech-Codec", repo, refs=("main",))
        env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "NO_PROXY": "127.0.0.1"}
        cache = str(tmp_path / "cache")
        code = f"from workflow.codec import checkpoint; print(checkpoint.fetch('hf:fnlp/MOSS-Speech-Codec@main', {cache!r}))"
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    snapshot = Path(out.stdout.strip().splitlines()[-1])
    files = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    assert files == sorted([checkpoint.FLOW_FILE, checkpoint.HIFT_FILE])
    ours, base = decoders(CodecTiming(weights=f"local:{snapshot}"), torch.device("cpu"))
    for module in (ours, base):
        for got, want in zip(module.estimator.state_dict().values(), original.estimator.state_dict().values(), strict=True):
            assert torch.equal(got, want)
