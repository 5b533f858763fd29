"""A voice file: the voice prompt the codec decoder continues, kept on disk so that a deployment
speaks in a chosen voice rather than the benchmark's random one (`benchmark.codec.voice`).

A safetensors file of three tensors, as MOSS-Speech's voice conditioning makes them from a prompt
WAV (docs/codec.md, "Prompt -> conditioning"):
- `codes` [P], integers in [0, 16384): the prompt's codes from the codec's own encoder (Whisper-VQ);
- `mel` [80, 4 P]: its 24 kHz log-mel (`mel.LogMel`), trimmed to the codes;
- `xvector` [192]: its CAM++ speaker embedding (`campplus.onnx`, 16 kHz fbank).

Neither the encoder nor CAM++ is part of this repository: their outputs come from the official
tools. `python -m workflow.codec.voice` makes the file from the WAV (the mel is computed here) and
those two outputs as text files of numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from workflow.artifacts import atomic_file
from workflow.codec.config import CodecConfig
from workflow.codec.decoder import VoicePrompt
from workflow.errors import InputError, run_main
from workflow.tensorfile import read_header

AUDIO_CODES = 16384  # the codec's codebook: 16384 and above are the LLM's control ids (eosp), never a voice's
RANKS = {"codes": 1, "mel": 2, "xvector": 1}


def codes_in(path: str | Path) -> int:
    """The prompt codes a voice file holds, from its header alone (a settings check reads it)."""
    meta = read_header(path)
    if "codes" not in meta or len(meta["codes"][0]) != 1:
        raise InputError(path, "not a voice file: no 1-D tensor 'codes'")
    return meta["codes"][0][0]


def load(path: str | Path, cfg: CodecConfig) -> VoicePrompt:
    """The voice in `path`, checked (`check`) against the decoder's shape."""
    meta = read_header(path)
    missing = [k for k in RANKS if k not in meta]
    if missing:
        raise InputError(path, f"not a voice file: no tensor {', '.join(repr(k) for k in missing)} (codes, mel, xvector)")
    if meta["codes"][1] not in (torch.int64, torch.int32):
        raise InputError(path, f"'codes' are {meta['codes'][1]}, expected integers (int64 or int32)")
    t = load_file(str(path))
    return check(path, t["codes"], t["mel"], t["xvector"], cfg)


def check(path: str | Path, codes: torch.Tensor, mel: torch.Tensor, xvector: torch.Tensor, cfg: CodecConfig) -> VoicePrompt:
    """A voice prompt from its three tensors, or an InputError naming `path`: each of its rank, codes
    in the codebook, mel bands and x-vector size the decoder's, mel frames 4 x codes, all finite."""
    for name, x in (("codes", codes), ("mel", mel), ("xvector", xvector)):
        if x.dim() != RANKS[name]:
            raise InputError(path, f"'{name}' has shape {list(x.shape)}, expected {RANKS[name]} dimension(s)")
    codes, mel, xvector, enc = codes.long(), mel.float(), xvector.float(), cfg.encoder
    if not len(codes):
        raise InputError(path, "'codes' is empty: a voice prompt has at least one code")
    top = min(enc.vocab_size, AUDIO_CODES)
    if codes.min() < 0 or codes.max() >= top:
        raise InputError(path, f"'codes' hold {int(codes.min())}..{int(codes.max())}, outside the codebook 0..{top - 1}")
    if mel.shape != (enc.mel, enc.stride * len(codes)):
        want = f"[{enc.mel}, {enc.stride * len(codes)}]"
        raise InputError(path, f"'mel' is {list(mel.shape)}, expected {want} ({enc.stride} frames a code)")
    if xvector.shape != (enc.spk_dim,):
        raise InputError(path, f"'xvector' has {xvector.numel()} values, expected {enc.spk_dim}")
    for name, x in (("mel", mel), ("xvector", xvector)):
        if not torch.isfinite(x).all():
            raise InputError(path, f"'{name}' holds non-finite values")
    return VoicePrompt(codes, mel, xvector)


def save(path: str | Path, voice: VoicePrompt) -> None:
    """Write a voice file (temporary file, then rename)."""
    tensors = {"codes": voice.codes.long(), "mel": voice.mel.float(), "xvector": voice.xvector.float()}
    with atomic_file(path) as tmp:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))


def read_wav(path: str | Path, rate: int) -> torch.Tensor:
    """A WAV's first channel as float32 at `rate` Hz (resampled if it has another rate)."""
    import soundfile
    from scipy.signal import resample_poly

    try:
        data, sr = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError) as e:
        raise InputError(path, f"not a readable audio file ({e})") from None
    x = data[:, 0]
    if sr != rate:
        g = np.gcd(int(sr), rate)
        x = resample_poly(x, rate // g, int(sr) // g).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(x))


def read_numbers(path: str | Path, what: str) -> torch.Tensor:
    """Whitespace- or comma-separated numbers from a text file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InputError(path, "file is missing") from None
    try:
        return torch.tensor([float(v) for v in text.replace(",", " ").split()])
    except ValueError as e:
        raise InputError(path, f"{what}: not a list of numbers ({e})") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Make a voice file for benchmark.codec.voice from a prompt WAV")
    ap.add_argument("--wav", required=True, help="the voice prompt (any rate: resampled to 24 kHz)")
    ap.add_argument("--codes", required=True, help="text file: the prompt's codes from the codec's encoder")
    ap.add_argument("--xvector", required=True, help="text file: its 192 CAM++ values")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    codes, xvector = read_numbers(a.codes, "codes"), read_numbers(a.xvector, "x-vector")
    cfg = CodecConfig()
    if not len(codes) or (codes != codes.round()).any() or codes.min() < 0 or codes.max() >= AUDIO_CODES:
        raise InputError(a.codes, f"codes: expected integers in 0..{AUDIO_CODES - 1}, at least one")
    if xvector.numel() != cfg.encoder.spk_dim:
        raise InputError(a.xvector, f"x-vector: {xvector.numel()} values, expected {cfg.encoder.spk_dim}")
    voice = VoicePrompt.from_wav(read_wav(a.wav, cfg.mel.sampling_rate)[None], codes.long(), xvector)
    if not len(voice.codes):
        raise InputError(a.wav, "shorter than one code (80 ms): no voice prompt")
    save(a.out, check(a.wav, voice.codes, voice.mel, voice.xvector, cfg))  # as the benchmark checks it
    print(f"{a.out}: {len(voice.codes)} codes ({len(voice.codes) * 0.08:.2f} s of voice)")


if __name__ == "__main__":
    run_main(main)
