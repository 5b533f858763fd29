"""One streaming speech request, timed: prompt -> prefill -> audio codes one step at a time
through the real modality-switching loop -> every K codes a chunk through the detokenizer.

Every timestamp is taken after a device synchronisation (the `clock` does both), so it means
"this work is done". Time to first audio is request -> first PCM chunk ready; RTF is wall time
over seconds of audio produced (codes x 80 ms). The detokenizer runs in line with decoding
(no overlap), which is what a single-stream server without a separate vocoder stream does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workflow.engines.base import Engine
from workflow.generate import Ids, Sampling, generate
from workflow.vocoder import SECONDS_PER_TOKEN, MelStandIn

Clock = Callable[[], float]
GREEDY = Sampling(greedy=True)


@dataclass
class Chunk:
    tokens: int  # codes in this chunk
    t_start: float  # its last code was sampled
    t_mel: float  # stage 1 done
    t_ready: float  # PCM ready


@dataclass
class Timeline:
    """Timestamps (seconds, one clock) of one request for a batch of streams."""

    t_request: float
    t_prefill: float = 0.0
    t_tokens: list[float] = field(default_factory=list)  # each step's codes sampled
    t_resume: list[float] = field(default_factory=list)  # decoding resumed after that step
    chunks: list[Chunk] = field(default_factory=list)

    def stages(self) -> dict[str, list[float]]:
        """Per-stage durations in ms: prefill, each decode step, each chunk's mel and vocoder."""
        decode = [1e3 * (t - r) for t, r in zip(self.t_tokens[1:], self.t_resume[:-1], strict=True)]
        return {
            "prefill_ms": [1e3 * (self.t_prefill - self.t_request)],
            "decode_step_ms": decode,
            "mel_ms": [1e3 * (c.t_mel - c.t_start) for c in self.chunks],
            "vocoder_ms": [1e3 * (c.t_ready - c.t_mel) for c in self.chunks],
        }

    def ttfa_ms(self) -> float:
        return 1e3 * (self.chunks[0].t_ready - self.t_request)

    def chunk_latency_ms(self) -> list[float]:
        """Each chunk's ready time after the request."""
        return [1e3 * (c.t_ready - self.t_request) for c in self.chunks]

    def gaps_ms(self) -> list[float]:
        """Time between consecutive chunks; above the chunk's duration the listener waits."""
        ready = [c.t_ready for c in self.chunks]
        return [1e3 * (b - a) for a, b in itertools.pairwise(ready)]

    def wall_s(self) -> float:
        return self.chunks[-1].t_ready - self.t_request


class _Timed(Engine):
    """Wraps an engine to timestamp the end of prefill."""

    def __init__(self, inner: Engine, clock: Clock, timeline: Timeline):
        self.inner, self.clock, self.timeline = inner, clock, timeline
        self.spec, self.device = inner.spec, inner.device
        self.max_batch, self.max_seq_len = inner.max_batch, inner.max_seq_len

    def prefill(self, tokens: torch.Tensor, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.inner.prefill(tokens, all_logits)
        self.timeline.t_prefill = self.clock()
        return out

    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self.inner.decode(tokens, need_text)


def run_stream(
    engine: Engine,
    mel: MelStandIn,
    vocoder: Callable[[torch.Tensor], torch.Tensor],
    prompt: torch.Tensor,
    num_tokens: int,
    chunk_tokens: int,
    samples_per_token: int,
    ids: Ids,
    clock: Clock,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> tuple[Timeline, torch.Tensor]:
    """Stream `num_tokens` audio codes for each prompt row; returns the timeline and the PCM
    [B, num_tokens * samples_per_token]: each chunk emits exactly its codes x 80 ms."""
    timeline = Timeline(t_request=clock())
    codes: list[torch.Tensor] = []
    pcm: list[torch.Tensor] = []
    spare = torch.zeros(prompt.shape[0], 0, device=engine.device)  # vocoded, not yet emitted
    done = 0

    def on_step(step: int, tokens: torch.Tensor, audio_mode: torch.Tensor) -> None:
        nonlocal done, spare
        timeline.t_tokens.append(clock())
        if audio_mode.all():
            codes.append(tokens[:, 1])
        pending = len(codes) - done
        if pending == chunk_tokens or (step == num_tokens - 1 and pending):
            chunk = torch.stack(codes[done:], dim=1)
            t_start = timeline.t_tokens[-1]
            m = mel(chunk, done)
            t_mel = clock()
            # frames come hop-aligned, 7.5 per code: emit exactly 80 ms per code, keep the rest
            wav = torch.cat([spare, vocoder(m)[:, 0].float()], dim=1)
            pcm.append(wav[:, : pending * samples_per_token])
            spare = wav[:, pending * samples_per_token :]
            timeline.chunks.append(Chunk(pending, t_start, t_mel, clock()))
            done += pending
        timeline.t_resume.append(clock())

    engine = _Timed(engine, clock, timeline)
    generate(engine, prompt, num_tokens, ids, sampling, generator, min_speech_tokens=num_tokens, on_step=on_step)
    return timeline, torch.cat(pcm, dim=1) if pcm else torch.zeros(prompt.shape[0], 0)


def check_stream(
    timeline: Timeline, audio: torch.Tensor, num_tokens: int, chunk_tokens: int, samples_per_token: int
) -> list[str]:
    """The fail-closed checks: every chunk arrived, audio finite and not silent, right length."""
    problems = []
    want_chunks = math.ceil(num_tokens / chunk_tokens)
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
