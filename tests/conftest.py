"""Shared fixtures: one tiny synthetic checkpoint, converted and built once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

if not torch.cuda.is_available():  # the Triton GEMV runs under Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workflow import build, convert, download, trtckpt
from workflow.artifacts import atomic_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "hf"
    download.main(["--source", "synthetic:tiny", "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_hf) -> Path:
    out = tiny_hf.parent / "ckpt-bf16"
    convert.main(["--hf", str(tiny_hf), "--out", str(out)])
    return out


def build_engine(ckpt: Path, out: Path, precision: str = "bf16", max_batch: int = 4) -> Path:
    options = json.dumps({"precision": precision, "max_batch": max_batch})
    build.main(["--ckpt", str(ckpt), "--out", str(out), "--options-json", options])
    return out


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_ckpt) -> Path:
    return build_engine(tiny_ckpt, tiny_ckpt.parent / "engine-torch-bf16")


def write_variant(src: Path, dst: Path, mutate) -> Path:
    """A copy of checkpoint `src` with mutate(tensors, config, spec) applied, as convert writes."""
    cfg, spec, tensors = trtckpt.load_checkpoint(src)
    tensors = {k: v.clone() for k, v in tensors.items()}
    mutate(tensors, cfg, spec)
    with atomic_dir(dst) as tmp:
        trtckpt.save_checkpoint(tmp, cfg, tensors)
    return dst


def verify_params(**overrides) -> str:
    p = json.loads(json.dumps(CONFIG["verify"]))
    p.update(overrides)
    return json.dumps(p)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


CALIB = {**CONFIG["calibration"], "num_samples": 64, "max_len": 96}  # a quick calibration for tests


def calibrate_fp8(ckpt: Path, hf: Path, out: Path, **overrides) -> Path:
    from workflow import calibrate

    params = json.dumps({**CALIB, **overrides})
    calibrate.main(["--ckpt", str(ckpt), "--hf", str(hf), "--out", str(out), "--precision", "fp8", "--params", params])
    return out


@pytest.fixture(scope="session")
def tiny_fp8(tiny_ckpt, tiny_hf) -> Path:
    """calibrate's fp8 output directory: checkpoint/, dataset/, amax.json, quant_summary.txt."""
    return calibrate_fp8(tiny_ckpt, tiny_hf, tiny_ckpt.parent / "calib-fp8")


@pytest.fixture(scope="session")
def tiny_fp8_engine_dir(tiny_fp8) -> Path:
    return build_engine(tiny_fp8 / "checkpoint", tiny_fp8.parent / "engine-torch-fp8", precision="fp8")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny shapes (the codec's): there, threads only add barrier
    waits, seconds a forward on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def codec_decoder():
    """The tiny codec decoder, every parameter moved off its default (so each shapes the output) and
    F0 voiced (so a stream's sine phase must carry across calls)."""
    from workflow.codec.config import CodecConfig
    from workflow.codec.decoder import CodecDecoder

    torch.manual_seed(0)
    dec = CodecDecoder(CodecConfig.tiny()).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.add_(0.05 * torch.randn_like(p))
        dec.hift.f0_predictor.classifier.bias.fill_(150.0)
    return dec
