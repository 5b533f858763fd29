"""The codec decoder's real weights: the codec repo's flow and HiFT checkpoints, fetched through the
LLM's download path, read without running any code, and checked against our modules before use.

Where they come from (`benchmark.codec.weights`): `local:<dir>` (a copy of the codec repo) or
`hf:<repo>@<pinned revision>` (e.g. fnlp/MOSS-Speech-Codec), fetched by `hub.fetch` (resumable,
each file checked against the hub's hash), only the two files named below. Both files are torch
pickles; `torch.load(weights_only=True)` builds tensors and plain containers only, so a pickle
that would run code, or build any other object, is refused with one line naming the file.

Checked, one line naming the file and the first problems: every tensor our module has is there,
no other, each of its shape and a floating dtype. `flow-chunk-*.pt`'s training counters (`epoch`,
`step`) are not tensors and are dropped; `hift.pt` has its `generator.` prefix removed and its
weight norm folded (`hift.hift_state_dict`). The flow's vocabulary is read from its embedding's rows
(20480 in the third-party transcription, unconfirmed: docs/codec.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from torch import Tensor

from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder
from workflow.codec.estimator import PREFIX
from workflow.codec.hift import hift_state_dict
from workflow.errors import InputError
from workflow.sources import parse_source
from workflow.tensorfile import load_pickle

FLOW_FILE = "flow/flow-chunk-5.pt"  # the chunk-5 streaming weights (docs/codec.md, "Codec files")
HIFT_FILE = "flow/hift.pt"


def fetch(weights: str, cache_dir: Path) -> Path:
    """The directory holding the codec's files: a local one, or the hub snapshot they are fetched into."""
    src = parse_source(weights, "config: benchmark.codec.weights")
    if src.kind == "synthetic":
        raise InputError("config: benchmark.codec.weights", f"'{weights}' names no checkpoint (local:<dir> or hf:<repo>@<rev>)")
    if src.kind == "local":
        return Path(src.value)
    from workflow import hub  # huggingface_hub: only when the hub is asked

    snapshot, _ = hub.fetch(src.value, src.revision, cache_dir, allow=[FLOW_FILE, HIFT_FILE], ignore=[])
    return snapshot


def read_state(path: Path) -> dict[str, Tensor]:
    """A checkpoint's tensors (non-tensor entries dropped), refusing anything but tensors and containers."""
    state = load_pickle(path)
    if not isinstance(state, dict):
        raise InputError(path, f"holds a {type(state).__name__}, not a state dict")
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def check(state: dict[str, Tensor], want: dict[str, Tensor], path: Path) -> None:
    """Names, shapes and dtypes against our module's state dict; one line, the first few problems."""
    problems = [f"missing {k}" for k in want if k not in state] + [f"unexpected {k}" for k in state if k not in want]
    for k, v in want.items():
        if k in state and state[k].shape != v.shape:
            problems.append(f"{k} is {list(state[k].shape)}, expected {list(v.shape)}")
        elif k in state and not state[k].is_floating_point():
            problems.append(f"{k} is {state[k].dtype}, expected floating point")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InputError(path, "; ".join(problems[:3]) + more)


def load(directory: Path, cfg: CodecConfig | None = None) -> CodecDecoder:
    """The decoder (float32, CPU) with the checkpoint's weights, each file checked first."""
    flow_path, hift_path = Path(directory) / FLOW_FILE, Path(directory) / HIFT_FILE
    flow = read_state(flow_path)
    cfg = cfg or CodecConfig()
    embedding = flow.get("input_embedding.weight")
    if embedding is not None and embedding.dim() == 2:  # the vocabulary is the checkpoint's
        cfg = replace(cfg, encoder=replace(cfg.encoder, vocab_size=embedding.shape[0]))
    dec = CodecDecoder(cfg)
    want = dict(dec.flow.state_dict()) | {PREFIX + k: v for k, v in dec.estimator.state_dict().items()}
    check(flow, want, flow_path)
    dec.load_flow_state(flow)
    hift = hift_state_dict(read_state(hift_path))
    check(hift, dict(dec.hift.state_dict()), hift_path)
    dec.hift.load_state_dict(hift)
    return dec.eval()
