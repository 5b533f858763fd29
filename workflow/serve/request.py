"""A request to serve, what the scheduler records of it, and the settings of the loop that serves it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workflow.detokenize import Piece, Ready
from workflow.generate import Sampling
from workflow.vocoder import SECONDS_PER_TOKEN

Detokenize = Callable[[list[Piece], bool], tuple[Ready, list[int]]]  # (pieces, urgent) -> (ready, samples each made final)


def pcm_rate(detokenize: Detokenize | None) -> float:
    """The detokenizer's PCM samples a second; with none, the scheduler counts a code as a sample."""
    return getattr(detokenize, "sample_rate", 1 / SECONDS_PER_TOKEN)


@dataclass
class Request:
    """One spoken reply to make. The scheduler fills in what happened to it."""

    rid: int
    prompt: torch.Tensor  # [T, 2] (text id, audio id)
    max_steps: int  # tokens to generate at most
    reply_codes: int | None = None  # audio codes to speak, then done; with hold_speech, end-of-speech waits for them
    t_arrival: float = 0.0
    slot: int | None = None
    t_admit: float | None = None
    tokens: list[tuple[int, int]] = field(default_factory=list)  # fed back after each step
    modes: list[bool] = field(default_factory=list)  # the mode each was sampled in (True: audio)
    codes: list[int] = field(default_factory=list)
    chunk_ready: list[float] = field(default_factory=list)  # filled in when known: see `stamped`
    chunk_codes: list[int] = field(default_factory=list)  # of each chunk made
    chunk_samples: list[int] = field(default_factory=list)  # PCM each chunk sent made final (0: none yet)
    chunk_sent: list[float] = field(default_factory=list)  # when each chunk went to the detokenizer
    error: str | None = None  # refused, cancelled, or failed; None: served
    finished: bool = False

    def fault(self, vocab: int, audio_vocab: int, max_seq_len: int) -> str | None:
        """Why an engine of these vocabularies and slot length cannot take this request (None: it can)."""
        t = self.prompt.shape[0]
        if self.prompt.ndim != 2 or self.prompt.shape[1] != 2 or t == 0:
            return f"a prompt is [T, 2] (text id, audio id), not {list(self.prompt.shape)}"
        for channel, size, name in ((0, vocab, "text"), (1, audio_vocab, "audio")):
            bad = self.prompt[:, channel][(self.prompt[:, channel] < 0) | (self.prompt[:, channel] >= size)]
            if bad.numel():
                return f"{name} id {int(bad[0])} is outside the {name} vocabulary (0..{size - 1})"
        if t + self.max_steps > max_seq_len:
            return f"prompt {t} + reply {self.max_steps} positions exceed a slot's {max_seq_len}"
        return None

    def _first_audible(self) -> int | None:
        """The first chunk with PCM (a detokenizer with lookahead gives none for the first codes), once
        its ready time is known; None before."""
        return next((i for i, n in enumerate(self.chunk_samples[: len(self.chunk_ready)]) if n), None)

    @property
    def playback_start(self) -> float | None:
        """When the first chunk with PCM was ready: its playback starts there. None while not known."""
        i = self._first_audible()
        return None if i is None else self.chunk_ready[i]

    @property
    def ttfa_s(self) -> float | None:
        """Arrival to the first chunk with PCM being ready."""
        start = self.playback_start
        return None if start is None else start - self.t_arrival

    def decode_due_at(self, pace: float, lead_s: float) -> float:
        """With pace > 0: the time from which this stream must be decoded again, once the audio its codes
        make would fall under lead_s + pace x the time since its playback's start; -inf (now) while that
        start is not known, and without pace."""
        start = self.playback_start
        if not pace or start is None:
            return float("-inf")
        return start + (len(self.codes) * SECONDS_PER_TOKEN - lead_s) / pace

    def ahead_s(self, now: float) -> float:
        """Seconds of audio its codes make past its playback now (all of it before the playback starts)."""
        start = self.playback_start
        return len(self.codes) * SECONDS_PER_TOKEN - (0.0 if start is None else max(0.0, now - start))

    def ttfa_parts(self) -> tuple[float, float, float] | None:
        """Time to first audio in three parts (s): queued (arrival to admission), the first audible
        chunk made (admission to its sending: prefill, decode steps) and its PCM (sent to ready: the
        detokenizer's lane and call). None while its first PCM is not known."""
        i = self._first_audible()
        if i is None or self.t_admit is None:
            return None
        sent = self.chunk_sent[i]
        return self.t_admit - self.t_arrival, sent - self.t_admit, self.chunk_ready[i] - sent

    @property
    def stamped(self) -> bool:
        """Whether every chunk made has its ready time."""
        return len(self.chunk_ready) == len(self.chunk_codes)


@dataclass(frozen=True)
class ServeConfig:
    chunk_tokens: int = 5
    prefill_tokens: int = 2048  # prompt tokens admitted per iteration (one prompt at least)
    when_full: str = "queue"  # queue | refuse: a request arriving while every slot is busy
    hold_speech: bool = True  # end-of-speech is suppressed until a stream has its reply_codes
    detokenize_batches: int = 2  # detokenizer batches running at once; later chunks wait, then go together
    detokenize_hold: int = 1  # a speaking stream's later chunks go once this many wait (one codec call decodes them)
    detokenize_slack_s: float = 0.0  # > 0: or once the first of them would play within this many seconds
    detokenize_join: int = 0  # > 0: one with this many waiting goes along with a batch of later chunks that goes anyway
    detokenize_least: int = 0  # > 0: a batch of later chunks goes once it takes this many codes, or one of them is due (slack)
    first_audio_first: bool = False  # speaking streams' later chunks wait while one awaits its first audio (slack: above)
    first_chunks_apart: bool = True  # a stream's chunks go at once, on the urgent lane, until it has a chunk's audio
    urgent_batches: int = 0  # > 0: urgent batches running at once; new urgent chunks wait, then go together (0: no limit)
    max_streams: int = 0  # streams open at once (0: the engine's slots); never more than the detokenizer's `max_streams`
    pace: float = 0.0  # >= 1: once its first PCM is ready, a stream is decoded only to pace x real time (0: at once)
    pace_lead_s: float = 1.0  # with pace: the audio a stream keeps ahead of that, from its playback's start
    first_audio_lead_s: float = 0.0  # > 0: while a stream makes its first chunk, streams this far ahead sit out the step
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        if self.first_audio_first and not self.detokenize_slack_s:
            raise ValueError("first_audio_first needs detokenize_slack_s > 0: the later chunks it holds go once due within it")
        if self.detokenize_least and not self.detokenize_slack_s:
            raise ValueError("detokenize_least needs detokenize_slack_s > 0: the later chunks it holds go once due within it")
        if self.detokenize_join and self.detokenize_join >= self.detokenize_hold:
            raise ValueError(f"detokenize_join {self.detokenize_join} is not under detokenize_hold {self.detokenize_hold}: "
                             "a stream with that many chunks waiting goes on its own")  # fmt: skip
        if self.first_audio_lead_s < 0:
            raise ValueError(f"first_audio_lead_s {self.first_audio_lead_s:g} is negative; use 0 (off) or seconds of audio")
        if 0 < self.pace < 1:
            raise ValueError(f"pace {self.pace:g} is under 1: a stream made slower than it plays runs out; use 0 (off) or >= 1")
