"""Voice files (workflow/codec/voice.py): the voice prompt a deployment speaks in, written from a prompt
WAV and checked on reading, each bad file refused in one line naming it; the benchmark's streams speak
in it (`benchmark.codec.voice`). CPU, the tiny shape."""

from __future__ import annotations

import math

import numpy as np
import pytest
import soundfile
import torch
from codec_alone import SPC, TINY, alone, voice_of
from safetensors.torch import save_file

from workflow.codec import voice
from workflow.codec.decoder import CodecDecoder
from workflow.codec.settings import CodecTiming, stream_decoder
from workflow.errors import InputError


def test_a_voice_file_reads_back_what_was_written_and_the_stream_speaks_in_it(tmp_path):
    """Written and read, the voice is the same tensors; a stream conditioned on it makes the PCM the
    in-memory voice makes, and another voice's differs: the file, not a default, sets the voice."""
    path = tmp_path / "v.safetensors"
    ours = voice_of(11)
    voice.save(path, ours)
    got = voice.load(path, TINY)
    assert all(torch.equal(a, b) for a, b in ((got.codes, ours.codes), (got.mel, ours.mel), (got.xvector, ours.xvector)))
    dec = CodecDecoder(TINY).eval()
    codes = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(2))
    pcm = alone(dec, got, 0, codes, 5)
    assert len(pcm) == 12 * SPC and torch.equal(pcm, alone(dec, ours, 0, codes, 5))
    assert not torch.allclose(pcm, alone(dec, voice_of(9), 0, codes, 5), atol=1e-3)


def bad(tmp_path, **tensors):
    ours = voice_of(3)
    t = {"codes": ours.codes, "mel": ours.mel, "xvector": ours.xvector} | tensors
    path = tmp_path / "bad.safetensors"
    save_file({k: v for k, v in t.items() if v is not None}, str(path))
    return path


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"xvector": None}, "not a voice file: no tensor 'xvector'"),
        ({"codes": torch.zeros(3)}, "'codes' are torch.float32, expected integers"),
        ({"codes": torch.zeros(1, 3, dtype=torch.long)}, "'codes' has shape [1, 3], expected 1 dimension(s)"),
        ({"codes": torch.tensor([1, 2, 16384])}, "'codes' hold 1..16384, outside the codebook 0..16383"),
        ({"codes": torch.zeros(0, dtype=torch.long), "mel": torch.zeros(80, 0)}, "'codes' is empty"),
        ({"mel": torch.zeros(80, 11)}, "'mel' is [80, 11], expected [80, 12] (4 frames a code)"),
        ({"mel": torch.zeros(100, 12)}, "'mel' is [100, 12], expected [80, 12]"),
        ({"xvector": torch.zeros(128)}, "'xvector' has 128 values, expected 192"),
        ({"mel": torch.full((80, 12), math.nan)}, "'mel' holds non-finite values"),
    ],
)
def test_a_bad_voice_file_is_refused_in_one_line_naming_it(tmp_path, change, problem):
    path = bad(tmp_path, **change)
    with pytest.raises(InputError, match=None) as e:
        voice.load(path, TINY)
    assert str(e.value).startswith(f"{path}: ") and problem in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_or_missing_voice_file_is_refused(tmp_path):
    path = bad(tmp_path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(InputError, match="truncated"):
        voice.load(path, TINY)
    with pytest.raises(InputError, match="file is missing"):
        voice.codes_in(tmp_path / "none.safetensors")


def write_prompt(tmp_path, seconds: float = 1.0, rate: int = 16000, codes: int = 20, xvector: int = 192):
    t = np.arange(int(seconds * rate)) / rate
    wav = tmp_path / "prompt.wav"
    soundfile.write(str(wav), (0.3 * np.sin(2 * math.pi * 220 * t)).astype(np.float32), rate)
    (tmp_path / "codes.txt").write_text(" ".join(str(i * 7 % 16384) for i in range(codes)))
    (tmp_path / "xvector.txt").write_text(",".join(f"{math.sin(i):.4f}" for i in range(xvector)))
    args = ["--wav", str(wav), "--codes", str(tmp_path / "codes.txt"), "--xvector", str(tmp_path / "xvector.txt")]
    return [*args, "--out", str(tmp_path / "voice.safetensors")]


def test_the_voice_maker_writes_a_checked_file_from_a_wav_at_any_rate(tmp_path):
    """A 1 s prompt at 16 kHz (resampled to 24 kHz: 50 mel frames, 12 whole codes' worth) and 20 codes:
    the file keeps 12 codes and their 48 frames, as the official conditioning trims them."""
    voice.main(write_prompt(tmp_path))
    got = voice.load(tmp_path / "voice.safetensors", TINY)
    assert got.codes.tolist() == [i * 7 % 16384 for i in range(12)] and got.mel.shape == (80, 48)
    assert torch.allclose(got.xvector, torch.tensor([math.sin(i) for i in range(192)]), atol=1e-4)
    assert got.mel.std() > 0.1  # a sine's log-mel, not silence's constant floor


@pytest.mark.parametrize(
    "kw, culprit, problem",
    [
        ({"codes": 0}, "codes.txt", "codes: expected integers in 0..16383, at least one"),
        ({"xvector": 100}, "xvector.txt", "x-vector: 100 values, expected 192"),
        ({"seconds": 0.05}, "prompt.wav", "shorter than one code"),
    ],
)
def test_the_voice_maker_refuses_bad_parts_and_writes_nothing(tmp_path, kw, culprit, problem):
    args = write_prompt(tmp_path, **kw)
    with pytest.raises(InputError) as e:
        voice.main(args)
    assert str(e.value).startswith(str(tmp_path / culprit)) and problem in str(e.value)
    assert not (tmp_path / "voice.safetensors").exists()


def test_the_benchmarks_streams_speak_in_the_configured_voice(tmp_path):
    """benchmark.codec.voice: its codes replace prompt_codes, and the serving decoder's voice is the file's."""
    path = tmp_path / "v.safetensors"
    voice.save(path, voice_of(16))
    t = CodecTiming.from_dict({"preset": "tiny", "prompt_codes": 11, "voice": str(path)})
    assert t.prompt_codes == 16
    _, got = stream_decoder(t, torch.device("cpu"))
    assert torch.equal(got.codes, voice_of(16).codes) and torch.equal(got.xvector, voice_of(16).xvector)
    _, random = stream_decoder(CodecTiming.from_dict({"preset": "tiny", "prompt_codes": 16}), torch.device("cpu"))
    assert not torch.equal(random.codes, got.codes)
