"""Streaming arithmetic on a fake clock, and the fail-closed checks."""

import pytest
import torch
from test_generate import IDS, Scripted

from workflow.stream import Chunk, Timeline, audio_seconds, check_stream, run_stream
from workflow.traffic import speech_prompt
from workflow.vocoder import MelStandIn

HOP, SPT = 256, 1920  # 24 kHz: 80 ms = 1920 samples


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedScript(Scripted):
    """A scripted engine whose prefill costs 50 ms and each decode 10 ms of fake time."""

    def __init__(self, clock, codes):
        super().__init__([(0, c) for c in codes])
        self.clock = clock

    def prefill(self, tokens, all_logits=False):
        self.clock.t += 0.050
        return super().prefill(tokens, all_logits)

    def decode(self, tokens, need_text=True):
        self.clock.t += 0.010
        return super().decode(tokens, need_text)


def make_stream(num_tokens=10, chunk=5):
    clock = FakeClock()
    engine = TimedScript(clock, [7 + i for i in range(num_tokens + 1)])
    mel = MelStandIn(IDS.eosp + 1, 8, 24000 / HOP, torch.device("cpu"))

    def mel_stage(codes, done):
        clock.t += 0.001
        return mel(codes, done)

    def vocoder(m):
        clock.t += 0.020
        return torch.randn(m.shape[0], 1, m.shape[2] * HOP)

    prompt = speech_prompt(1, 8, IDS, seed=0)
    return run_stream(engine, mel_stage, vocoder, prompt, num_tokens, chunk, SPT, IDS, clock)


def test_ttfa_rtf_and_stages_on_a_fake_clock():
    timeline, audio = make_stream()
    # prefill 50 ms; codes 1..5 need 4 more decodes (40 ms); mel 1 ms; vocoder 20 ms
    assert timeline.ttfa_ms() == pytest.approx(111.0)
    # then 5 more decodes (50 ms), mel and vocoder again (21 ms)
    assert timeline.wall_s() == pytest.approx(0.182)
    assert audio_seconds(10) == pytest.approx(0.8)
    assert timeline.wall_s() / audio_seconds(10) == pytest.approx(0.2275)
    st = timeline.stages()
    assert st["prefill_ms"] == pytest.approx([50.0])
    assert st["decode_step_ms"] == pytest.approx([10.0] * 9)  # vocoder time is not decode time
    assert st["mel_ms"] == pytest.approx([1.0, 1.0]) and st["vocoder_ms"] == pytest.approx([20.0, 20.0])
    assert timeline.gaps_ms() == pytest.approx([71.0])
    assert timeline.chunk_latency_ms() == pytest.approx([111.0, 182.0])
    assert check_stream(timeline, audio, 10, 5, SPT) == []
    assert audio.shape == (1, 10 * SPT)


def test_a_last_partial_chunk_is_flushed():
    timeline, audio = make_stream(num_tokens=12, chunk=5)
    assert [c.tokens for c in timeline.chunks] == [5, 5, 2]
    assert check_stream(timeline, audio, 12, 5, SPT) == []


def _ok():
    timeline = Timeline(0.0, 0.01, [0.02] * 10, [0.02] * 10, [Chunk(5, 0.1, 0.1, 0.2), Chunk(5, 0.3, 0.3, 0.4)])
    return timeline, torch.randn(2, 10 * SPT)


def _drop_chunk(t, a):
    t.chunks.pop()
    return t, a


@pytest.mark.parametrize(
    "spoil, message",
    [
        (_drop_chunk, "1 chunks arrived, expected 2"),
        (lambda t, a: (t, a[:, :-1]), "samples, expected 10 x 1920"),
        (lambda t, a: (t, a.index_fill(1, torch.tensor([5]), float("nan"))), "NaN or Inf"),
        (lambda t, a: (t, a * torch.tensor([[1.0], [0.0]])), "silent"),
    ],
)
def test_checks_fail_closed(spoil, message):
    timeline, audio = _ok()
    assert check_stream(timeline, audio, 10, 5, SPT) == []
    problems = check_stream(*spoil(*_ok()), 10, 5, SPT)
    assert any(message in p for p in problems), problems


def test_mel_stand_in_covers_exactly_80_ms_per_code():
    mel = MelStandIn(100, 4, 24000 / HOP, torch.device("cpu"))
    codes = torch.randint(0, 100, (2, 50))
    total = sum(mel(codes[:, i : i + 5], i).shape[2] for i in range(0, 50, 5))
    assert total == mel.frames(50) == 375  # 50 x 80 ms x 93.75 frames/s
