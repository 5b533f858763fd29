"""Streaming arithmetic on a fake clock, the detokenizer in line and overlapped (CUDA), the
event-to-host-time arithmetic, the overlap switch in the config, and the fail-closed checks."""

import random
from pathlib import Path
from typing import ClassVar

import jsonschema
import pytest
import torch
import yaml
from test_generate import IDS, Scripted

from workflow.detokenize import Inline, Lanes, StandIn, chunk_due, host_time, overlaps, seen_complete
from workflow.stream import Chunk, Timeline, audio_seconds, check_stream, chunks_of, device_clock, run_stream
from workflow.traffic import speech_prompt
from workflow.vocoder import MelStandIn

ROOT = Path(__file__).resolve().parents[1]

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

    def prefill(self, tokens, all_logits=False, need_text=True):
        self.clock.t += 0.050
        return super().prefill(tokens, all_logits, need_text)

    def decode(self, tokens, need_text=True):
        self.clock.t += 0.010
        return super().decode(tokens, need_text)


def make_stream(num_tokens=10, chunk=5, overlap=False, outputs=None):
    """A stream on the fake clock; `outputs` collects each vocoder call's waveform."""
    clock = FakeClock()
    engine = TimedScript(clock, [7 + i for i in range(num_tokens + 1)])
    mel = MelStandIn(IDS.eosp + 1, 8, 24000 / HOP, torch.device("cpu"))
    noise = torch.Generator().manual_seed(0)

    def mel_stage(codes, done):
        clock.t += 0.001
        return mel(codes, done)

    def vocoder(m):
        clock.t += 0.020
        wav = torch.randn(m.shape[0], 1, m.shape[2] * HOP, generator=noise)
        if outputs is not None:
            outputs.append(wav)
        return wav

    prompt = speech_prompt(1, 8, IDS, seed=0)
    return run_stream(engine, StandIn(mel_stage, vocoder, SPT), prompt, num_tokens, chunk, IDS, clock, overlap=overlap)


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
    timeline = Timeline(0.0, 0.01, [0.02] * 10, [0.02] * 10, [Chunk(5, 0.1, 0.1, 0.2, 5 * SPT), Chunk(5, 0.3, 0.3, 0.4, 5 * SPT)])
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


# --- the detokenizer in line -------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [10, 12])
def test_inline_pcm_is_the_vocoder_output_cut_at_80_ms_a_code(num_tokens):
    """Each chunk emits exactly its codes x 80 ms of the waveform vocoded so far, carrying the
    hop-aligned rest over: the whole stream is the vocoders' output joined and cut to length."""
    outputs = []
    timeline, audio = make_stream(num_tokens=num_tokens, outputs=outputs)
    assert torch.equal(audio, torch.cat(outputs, dim=2)[:, 0, : num_tokens * SPT])
    assert [c.tokens for c in timeline.chunks] == [5] * (num_tokens // 5) + ([num_tokens % 5] if num_tokens % 5 else [])


def test_overlap_on_the_cpu_runs_in_line_exactly_as_without_it():
    plain, plain_audio = make_stream(num_tokens=12)
    asked, asked_audio = make_stream(num_tokens=12, overlap=True)
    assert torch.equal(plain_audio, asked_audio)
    assert asked == plain  # every timestamp, on the same fake clock
    assert not overlaps(True, torch.device("cpu")) and not overlaps(False, torch.device("cuda"))
    assert overlaps(True, torch.device("cuda"))


def test_inline_times_each_stage_with_the_clock():
    clock = FakeClock()

    def mel(codes, done):
        clock.t += 0.002
        return torch.zeros(codes.shape[0], 4, 8)

    def vocoder(m):
        clock.t += 0.030
        return torch.ones(m.shape[0], 1, 3 * SPT)

    detok = Inline(StandIn(mel, vocoder, SPT), clock)
    clock.t = 1.0
    assert detok.start() == 1.0
    t_start = detok.stamp()
    clock.t = 1.5  # a stamp keeps the time it was taken at
    detok.submit(torch.zeros(2, 2, dtype=torch.long), 0, t_start=t_start)
    chunks, pcm = detok.finish()
    assert chunks == [Chunk(2, 1.0, pytest.approx(1.502), pytest.approx(1.532), 2 * SPT)]
    assert pcm.shape == (2, 2 * SPT)


def test_the_cpu_clock_reads_perf_counter():
    clock = device_clock(torch.device("cpu"))
    a, b = clock(), clock()
    assert 0 <= b - a < 1.0


# --- events to host time -----------------------------------------------------------------


def test_host_time_adds_the_elapsed_gpu_time_to_the_anchor():
    assert host_time(100.0, 0.0) == 100.0
    assert host_time(100.0, 250.0) == pytest.approx(100.25)
    assert host_time(2.5, 1.5) == pytest.approx(2.5015)


def test_host_time_is_never_earlier_than_the_truth():
    """The anchor completes on the GPU at a (true, host-clock) time; the host reads its clock
    only after seeing that, `delay` later. An event `elapsed` after the anchor really happened
    at a + elapsed: the derived time is late by exactly the delay, never early."""
    rng = random.Random(0)
    for _ in range(1000):
        anchor_done = rng.uniform(0, 1e4)
        delay = rng.choice([0.0, rng.uniform(0, 1e-3)])  # the synchronisation's wake-up
        elapsed_ms = rng.uniform(0, 5e3)
        truth = anchor_done + elapsed_ms / 1e3
        derived = host_time(anchor_done + delay, elapsed_ms)
        assert derived >= truth - 1e-9 * max(1.0, truth)  # float rounding only
        assert derived - truth == pytest.approx(delay, abs=1e-9 * max(1.0, truth))


class Ticks:
    """A clock that moves `step` seconds each read (a host spinning on an event)."""

    def __init__(self, step: float = 1e-4):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class Event:
    """A CUDA event stand-in: complete once the clock passes `done_at` (set by the test per event)."""

    made: ClassVar[list["Event"]] = []
    done_at = 0.0

    def __init__(self, enable_timing: bool = False):
        self.recorded, self.waited, self.at = False, False, Event.done_at
        Event.made.append(self)

    def record(self, stream: object) -> None:
        self.recorded = True

    def query(self) -> bool:
        return CLOCK.t >= self.at

    def synchronize(self) -> None:
        self.waited = True
        CLOCK.t = max(CLOCK.t, self.at)


CLOCK = Ticks()  # the events' and the lanes' clock; each test sets it back to 0


@pytest.fixture
def lanes(monkeypatch):
    """A `Lanes` whose anchor events are `Event`s on the `CLOCK`, renewed every 2 s."""
    CLOCK.t, Event.made, Event.done_at = 0.0, [], 0.0
    monkeypatch.setattr(torch.cuda, "Event", Event)
    out = Lanes(24000, torch.device("cpu"), CLOCK, anchor_s=2.0)
    out.idle = object()
    return out


def test_seen_complete_gives_the_time_first_seen_or_none_past_the_watch():
    CLOCK.t = 0.0
    e = Event()
    e.at = 0.0005
    assert seen_complete(e, CLOCK, 0.001) == pytest.approx(0.0005, abs=1.1e-4)  # seen within a tick of it
    late = Event()
    late.at = 1.0
    assert seen_complete(late, CLOCK, 0.001) is None
    assert CLOCK.t < 0.01  # it gave up, not waited


def test_the_first_anchor_waits_and_a_renewal_stuck_behind_a_lane_does_not(lanes):
    """The first anchor is waited for. Two seconds on, a renewal whose event completes at once is taken
    at the time it was seen; one whose event sits behind a lane's work (complete 80 ms on) is put off:
    the old anchor serves on at once, no new try until anchor_s / 8 later, then one that completes is
    taken."""
    Event.done_at = 0.05  # the first: complete 50 ms on
    first, t_first = lanes._anchor()
    assert first.waited and t_first >= 0.05
    assert lanes._anchor() == (first, t_first) and len(Event.made) == 1  # not yet due
    CLOCK.t = t_first + 2.1
    Event.done_at = CLOCK.t  # complete as recorded
    second, t_second = lanes._anchor()
    assert second is not first and not second.waited
    assert t_first + 2.1 <= t_second < t_first + 2.1 + 0.001
    CLOCK.t = t_second + 2.1
    Event.done_at = CLOCK.t + 0.08  # queued behind 80 ms of a lane's work
    before = CLOCK.t
    assert lanes._anchor() == (second, t_second)
    assert CLOCK.t - before < 0.002 and lanes.renewals_put_off == 1 and not Event.made[-1].waited
    made = len(Event.made)
    CLOCK.t += 0.1  # within anchor_s / 8 of the try: no new event
    assert lanes._anchor() == (second, t_second) and len(Event.made) == made
    CLOCK.t += 0.2
    Event.done_at = CLOCK.t
    third, t_third = lanes._anchor()
    assert third is Event.made[-1] and t_third > t_second + 2.1 and lanes.renewals_put_off == 1


def test_an_unbounded_watch_waits_for_the_renewal_as_before(lanes):
    lanes.anchor_wait_s = float("inf")
    Event.done_at = 0.0
    lanes._anchor()
    CLOCK.t = 3.0
    Event.done_at = 3.08
    anchor, t = lanes._anchor()
    assert anchor is Event.made[-1] and t >= 3.08 and lanes.renewals_put_off == 0


# --- the switch in the config ------------------------------------------------------------


def _config_with(**vocoder):
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["benchmark"]["vocoder"] |= vocoder
    return config


def _schema():
    return yaml.safe_load((ROOT / "config" / "config.schema.yaml").read_text())


def test_overlap_is_on_by_default_and_a_boolean_in_the_schema():
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    assert config["benchmark"]["vocoder"]["overlap"] is True
    overlap = _schema()["properties"]["benchmark"]["properties"]["vocoder"]["properties"]["overlap"]
    assert overlap["type"] == "boolean" and overlap["default"] is True and overlap["description"]
    full = yaml.safe_load((ROOT / "config" / "full.yaml").read_text())
    assert "overlap" not in full["benchmark"]["vocoder"]  # inherits the default


@pytest.mark.parametrize("value", [False, True])
def test_the_schema_takes_a_boolean_overlap(value):
    jsonschema.validate(_config_with(overlap=value), _schema())


@pytest.mark.parametrize("value", ["maybe", "yes", 1, 0, None, [True]])
def test_the_schema_refuses_an_overlap_that_is_not_a_boolean(value):
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'boolean'") as e:
        jsonschema.validate(_config_with(overlap=value), _schema())
    assert list(e.value.absolute_path) == ["benchmark", "vocoder", "overlap"]


# --- overlapped on CUDA: the same PCM, bit for bit ----------------------------------------

CUDA = torch.device("cuda")


class BusyScript(Scripted):
    """A scripted engine on CUDA whose every step does a few ms of matmuls, allocating and
    freeing memory on the decoding stream while the side stream vocodes."""

    def __init__(self, codes, batch):
        super().__init__([(0, c) for c in codes])
        self.device, self.max_batch = CUDA, batch
        self.w = torch.randn(2048, 2048, device=CUDA)

    def _logits(self):
        x = torch.randn(2048, 2048, device=CUDA)
        for _ in range(8):
            x = torch.tanh(x @ self.w)
        t, a = (z.to(CUDA).expand(self.max_batch, -1).contiguous() for z in super()._logits())
        return t + 0 * x[0, 0], a


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_pcm_equals_inline_pcm_bit_for_bit_and_decoding_does_not_wait():
    from workflow.vocoder import Graphed, load_bigvgan

    model, info = load_bigvgan("bigvgan_v2_24khz_100band_256x", None, CUDA, torch.bfloat16)
    graphed = Graphed(model, CUDA)
    mel = MelStandIn(IDS.eosp + 1, info.num_mels, info.sampling_rate / info.hop, CUDA)
    spt = round(0.08 * info.sampling_rate)

    def vocode(m):
        return graphed(m.to(torch.bfloat16))

    num_tokens, chunk = 22, 5  # 4 full chunks and a partial one: 37, 38 and 19 frames
    prompt = speech_prompt(2, 8, IDS, seed=0)
    codes = [7 + (i * 37) % 1000 for i in range(num_tokens + 1)]
    results = {}
    for overlap in (False, True, False, True):  # the first two capture the vocoder's graphs
        clock = device_clock(CUDA)
        engine = BusyScript(codes, batch=2)
        speech = StandIn(mel, vocode, spt)
        timeline, audio = run_stream(engine, speech, prompt, num_tokens, chunk, IDS, clock, overlap=overlap)
        t_end = clock()
        assert check_stream(timeline, audio, num_tokens, chunk, spt) == []
        results[overlap] = timeline, audio, t_end
    (inline, inline_audio, _), (over, over_audio, t_end) = results[False], results[True]
    assert torch.equal(inline_audio, over_audio)
    assert inline_audio.device.type == over_audio.device.type == "cuda"

    # the events put every chunk in order on the host clock, within the request
    previous = over.t_request
    for c in over.chunks:
        assert previous <= c.t_ready and c.t_start <= c.t_mel <= c.t_ready <= t_end
        previous = c.t_ready
    assert over.wall_s() == over.chunks[-1].t_ready - over.t_request > 0
    # in line, a chunk's step resumes decoding after its PCM is ready; overlapped, at once
    chunk_steps = [i for i, t in enumerate(over.t_tokens) if any(c.t_start == t for c in over.chunks)]
    waits = [over.t_resume[i] - over.t_tokens[i] for i in chunk_steps]
    vocoder_s = [c.t_ready - c.t_mel for c in inline.chunks]
    assert max(waits) < min(vocoder_s), (waits, vocoder_s)
    assert over.wall_s() < inline.wall_s()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_first_chunk_alone_holds_decoding_once():
    """first_alone: the step after the first chunk starts once that chunk's PCM is ready; the
    later chunks' steps do not wait for their PCM."""
    from workflow.vocoder import Graphed, load_bigvgan

    model, info = load_bigvgan("bigvgan_v2_24khz_100band_256x", None, CUDA, torch.bfloat16)
    graphed = Graphed(model, CUDA)
    mel = MelStandIn(IDS.eosp + 1, info.num_mels, info.sampling_rate / info.hop, CUDA)
    spt = round(0.08 * info.sampling_rate)
    num_tokens, chunk = 22, 5
    prompt = speech_prompt(2, 8, IDS, seed=0)
    codes = [7 + (i * 37) % 1000 for i in range(num_tokens + 1)]
    for _ in range(2):  # the first run captures the vocoder's graphs
        clock = device_clock(CUDA)
        timeline, audio = run_stream(
            BusyScript(codes, batch=2), StandIn(mel, lambda m: graphed(m.to(torch.bfloat16)), spt), prompt, num_tokens,
            chunk, IDS, clock, overlap=True, first_alone=True,
        )  # fmt: skip
    assert check_stream(timeline, audio, num_tokens, chunk, spt) == []
    steps = [timeline.t_tokens.index(c.t_start) for c in timeline.chunks]
    assert timeline.t_tokens[steps[0] + 1] >= timeline.chunks[0].t_ready
    later = [timeline.t_tokens[i + 1] < c.t_ready for i, c in zip(steps[1:-1], timeline.chunks[1:-1], strict=True)]
    assert any(later)


# --- MOSS-Speech's codec decoder as the detokenizer ---------------------------------------


def test_the_first_chunk_is_as_many_codes_as_the_first_pcm_needs():
    assert [chunk_due(0, n, 5) for n in (4, 5)] == [False, True]  # the stand-in: every 5 codes
    assert [chunk_due(0, n, 5, 8) for n in (5, 7, 8)] == [False, False, True]  # the codec: 8, then every 5
    assert [chunk_due(8, n, 5, 8) for n in (4, 5)] == [False, True]
    assert [chunks_of(n, 5) for n in (10, 12, 3)] == [2, 3, 1]
    assert [chunks_of(n, 5, 8) for n in (17, 18, 8, 5)] == [3, 3, 1, 1]


def test_the_codec_decoder_streams_a_request_as_its_own_stream_would():
    """run_stream through CodecSpeech gives the PCM a CodecStream of its own gives for the same codes,
    pushed chunk by chunk. The first chunk is 8 codes (chunk + lookahead: the decoder's first PCM), so
    every chunk makes PCM and time to first audio is the first's; the last flushes the rest."""
    from workflow.codec.batch import CodecBatch, CodecSpeech
    from workflow.codec.config import CodecConfig
    from workflow.codec.decoder import CodecDecoder, VoicePrompt
    from workflow.codec.hift import DEFAULT_SEED
    from workflow.codec.stream import CodecStream

    torch.manual_seed(0)
    decoder = CodecDecoder(CodecConfig.tiny()).eval()
    g = torch.Generator().manual_seed(1)
    voice = VoicePrompt(
        torch.randint(0, 1000, (10,), generator=g), torch.randn(80, 40, generator=g), torch.randn(192, generator=g)
    )
    clock, num_tokens, chunk = FakeClock(), 17, 5
    codes = [7 + i for i in range(num_tokens + 1)]
    batch = CodecBatch(decoder, voice)
    timeline, audio = run_stream(
        TimedScript(clock, codes), CodecSpeech(batch, 1), speech_prompt(1, 8, IDS, seed=0), num_tokens, chunk, IDS, clock
    )
    assert check_stream(timeline, audio, num_tokens, chunk, SPT, batch.first_codes) == []
    assert audio.shape == (1, num_tokens * SPT)
    assert check_stream(timeline, audio, num_tokens, chunk, SPT) == ["3 chunks arrived, expected 4"]  # not 5, 10, 15
    assert [c.tokens for c in timeline.chunks] == [8, 5, 4]
    assert all(c.samples > 0 for c in timeline.chunks) and timeline.audible() == timeline.chunks
    assert timeline.ttfa_ms() == 1e3 * (timeline.chunks[0].t_ready - timeline.t_request)
    own = CodecStream(decoder, voice, DEFAULT_SEED + batch.keys, flow_cache=False)
    pieces = [own.push(codes[i:j]) for i, j in ((0, 8), (8, 13), (13, 17))]
    assert torch.equal(audio[0], torch.cat([*pieces, own.finish()]))
