"""One streaming speech request, timed: prompt -> prefill -> audio codes one step at a time
through the real modality-switching loop -> every K codes a chunk through the detokenizer.

Every timestamp means "this work is done". Time to first audio is request -> first PCM chunk
ready; RTF is wall time (request -> last chunk's PCM ready) over seconds of audio produced
(codes x 80 ms). The detokenizer (`workflow.detokenize`) runs either in line with decoding,
every time read by the clock, which synchronises the whole device first (a one-stream server;
always so on the CPU), or, with `benchmark.vocoder.overlap` on CUDA, on a second stream
overlapped with the next decode steps: then every time (prefill done, each step's codes
sampled, each chunk's mel and PCM) is a CUDA event, read after the request and put on the same
host clock, never earlier than the truth, so that timing never makes the host wait."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workflow import roofline
from workflow.detokenize import Chunk, Clock, Speech, Stamp, chunk_due, detokenizer
from workflow.engines.base import Engine
from workflow.generate import Ids, Sampling, generate
from workflow.vocoder import SECONDS_PER_TOKEN

__all__ = ["Chunk", "Timeline", "audio_seconds", "check_stream", "chunks_of", "device_clock", "run_stream"]
GREEDY = Sampling(greedy=True)


def device_clock(device: torch.device) -> Clock:
    """perf_counter after a synchronisation of the whole device. Overlapped, the detokenizer
    reads it once, at the request; every later time is an event (`detokenize.Stamp`)."""

    def clock() -> float:
        roofline.sync(device)
        return time.perf_counter()

    return clock


@dataclass
class Timeline:
    """Timestamps (seconds, one clock) of one request for a batch of streams."""

    t_request: float
    t_prefill: float = 0.0
    t_tokens: list[float] = field(default_factory=list)  # each step's codes sampled
    t_resume: list[float] = field(default_factory=list)  # decoding resumed after that step
    chunks: list[Chunk] = field(default_factory=list)

    def stages(self) -> dict[str, list[float]]:
        """Per-stage durations in ms: prefill, each decode step, each chunk's mel and vocoder.

        A chunk's mel time runs from its last code sampled; overlapped, that includes any wait
        behind the previous chunk on the side stream, and a decode step or vocoder that runs
        beside the other shares the GPU with it: each is what a listener would see."""
        decode = [1e3 * (t - r) for t, r in zip(self.t_tokens[1:], self.t_resume[:-1], strict=True)]
        return {
            "prefill_ms": [1e3 * (self.t_prefill - self.t_request)],
            "decode_step_ms": decode,
            "mel_ms": [1e3 * (c.t_mel - c.t_start) for c in self.chunks],
            "vocoder_ms": [1e3 * (c.t_ready - c.t_mel) for c in self.chunks],
        }

    def audible(self) -> list[Chunk]:
        """The chunks that made PCM final (the codec decoder's first makes none: its lookahead)."""
        return [c for c in self.chunks if c.samples != 0]

    def ttfa_ms(self) -> float:
        return 1e3 * (self.audible()[0].t_ready - self.t_request)

    def chunk_latency_ms(self) -> list[float]:
        """Each chunk's ready time after the request."""
        return [1e3 * (c.t_ready - self.t_request) for c in self.chunks]

    def gaps_ms(self) -> list[float]:
        """Time between consecutive chunks that made PCM; above the audio before, the listener waits."""
        ready = [c.t_ready for c in self.audible()]
        return [1e3 * (b - a) for a, b in itertools.pairwise(ready)]

    def wall_s(self) -> float:
        return self.chunks[-1].t_ready - self.t_request


class _Timed:
    """Wraps an engine's lockstep calls (all the loop makes) to stamp the end of prefill
    (without waiting for it: `Stamp`)."""

    def __init__(self, inner: Engine, stamp: Callable[[], Stamp]):
        self.inner, self.stamp, self.t_prefill = inner, stamp, None
        self.spec, self.device = inner.spec, inner.device
        self.max_batch, self.max_seq_len = inner.max_batch, inner.max_seq_len

    def prefill(
        self, tokens: torch.Tensor, all_logits: bool = False, need_text: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        out = self.inner.prefill(tokens, all_logits, need_text)
        self.t_prefill = self.stamp()
        return out

    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self.inner.decode(tokens, need_text)


def run_stream(
    engine: Engine,
    speech: Speech,
    prompt: torch.Tensor,
    num_tokens: int,
    chunk_tokens: int,
    ids: Ids,
    clock: Clock,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    overlap: bool = False,
    first_alone: bool = False,
) -> tuple[Timeline, torch.Tensor]:
    """Stream `num_tokens` audio codes for each prompt row through `speech` (made for this request);
    returns the timeline and the PCM [B, num_tokens x 80 ms]; the last chunk flushes the rest.

    With overlap on CUDA the detokenizer runs on a side stream and the stream's timestamps
    are CUDA events (`detokenize.Stamp`): the host never waits to read a time, and a chunk is
    enqueued right behind the sampling of its last code; first_alone: decoding waits once,
    for the first chunk's PCM (`detokenize.Overlapped`)."""
    detok = detokenizer(speech, engine.device, clock, overlap, first_alone)
    timeline = Timeline(t_request=detok.start())
    tokens_at: list[Stamp] = []
    resumed_at: list[Stamp] = []
    codes: list[torch.Tensor] = []
    done = 0

    def on_step(step: int, tokens: torch.Tensor, audio_mode: list[bool]) -> None:
        nonlocal done
        tokens_at.append(detok.stamp())
        if all(audio_mode):
            codes.append(tokens[:, 1])
        pending, last = len(codes) - done, step == num_tokens - 1
        if chunk_due(done, pending, chunk_tokens, speech.first_codes) or (last and pending):
            detok.submit(torch.stack(codes[done:], dim=1), done, tokens_at[-1], last)
            done += pending
        resumed_at.append(detok.stamp())

    timed = _Timed(engine, detok.stamp)
    generate(timed, prompt, num_tokens, ids, sampling, generator, min_speech_tokens=num_tokens, on_step=on_step)
    timeline.chunks, audio = detok.finish()
    timeline.t_prefill = timed.t_prefill()
    timeline.t_tokens, timeline.t_resume = [t() for t in tokens_at], [t() for t in resumed_at]
    return timeline, audio


def chunks_of(num_tokens: int, chunk_tokens: int, first_codes: int = 1) -> int:
    """The chunks a stream of `num_tokens` codes is cut into (`detokenize.chunk_due`)."""
    first = max(chunk_tokens, first_codes)
    return 1 + max(0, math.ceil((num_tokens - first) / chunk_tokens))


def check_stream(
    timeline: Timeline, audio: torch.Tensor, num_tokens: int, chunk_tokens: int, samples_per_token: int, first_codes: int = 1
) -> list[str]:
    """The fail-closed checks: every chunk arrived, audio finite and not silent, right length."""
    problems = []
    want_chunks = chunks_of(num_tokens, chunk_tokens, first_codes)
    if len(timeline.chunks) != want_chunks:
        problems.append(f"{len(timeline.chunks)} chunks arrived, expected {want_chunks}")
    if sum(c.tokens for c in timeline.chunks) != num_tokens:
        problems.append(f"{sum(c.tokens for c in timeline.chunks)} codes streamed, expected {num_tokens}")
    if audio.shape[-1] != num_tokens * samples_per_token:
        problems.append(f"{audio.shape[-1]} samples, expected {num_tokens} x {samples_per_token}")
    if not torch.isfinite(audio).all():
        problems.append("audio holds NaN or Inf")
    elif audio.numel() and float(audio.pow(2).mean(-1).sqrt().min()) < 1e-5:
        problems.append("audio is silent (rms < 1e-5) in at least one stream")
    return problems


def audio_seconds(num_tokens: int) -> float:
    return num_tokens * SECONDS_PER_TOKEN
