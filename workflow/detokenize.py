"""The detokenizer stage of a stream, two ways: in line with decoding, or overlapped with it on
a second CUDA stream; and serving's (`Lanes`: the stand-in's `Batched`, the codec decoder's
`codec.lanes.CodecLanes`), chunks of many streams at once.

A request's chunks go through a `Speech`, in two timed stages: codes -> mel, then mel -> the PCM
that became final. `StandIn` gives each chunk of K codes exactly K x 80 ms (a code->mel table, then a
vocoder; frames come hop-aligned, so a few samples carry over to the next chunk). MOSS-Speech's codec
decoder (`codec.batch.CodecSpeech`) gives PCM later than its codes (its lookahead, its cross-fade):
the first after 6 to 10 codes (its `first_codes`), the rest at `finish`. The figures mean the same either way: a chunk's t_mel
is "its mel is done", t_ready "the PCM it made final is ready". How they are read differs:

- Inline: the stage runs on the decoding stream, each time read by the clock (which
  synchronises first), so decoding waits for the vocoder: what a one-stream server does, and
  the only way on the CPU.
- Overlapped (CUDA): the stage is enqueued on a side stream that first waits for the decoding
  stream (so the codes are ready), and decoding goes on at once. Its times come from CUDA
  events recorded on the side stream after the mel and after the PCM, read once the request's
  work is all done and put on the host clock through an anchor event (`host_time`). The side
  stream has the highest priority: when both have work, the GPU runs the vocoder's blocks
  first. With `first_alone`, decoding waits for the first PCM (once): the chunk that makes it is
  vocoded with the GPU to itself, as in line, which is what time to first audio measures.

Both also give the stream's own timestamps as `Stamp`s: taken now, read later. In line a stamp
is the clock's reading; overlapped it is a CUDA event on the decoding stream, so taking one does
not make the host wait for the GPU (a wait would hold back the launch of the work after it, and
the timing would change what it times).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from workflow.cudagraphs import CAPTURE_PRIORITY
from workflow.vocoder import SECONDS_PER_TOKEN

Clock = Callable[[], float]
Stamp = Callable[[], float]  # a time taken at some point, read (as host seconds) after finish()
Mel = Callable[[torch.Tensor, int], torch.Tensor]  # (codes [B, K], codes before them) -> mel [B, M, F]
Vocoder = Callable[[torch.Tensor], torch.Tensor]  # mel [B, M, F] -> waveform [B, 1, F x hop]


def chunk_due(sent: int, pending: int, chunk: int, first_codes: int = 1) -> bool:
    """Whether a stream's `pending` codes after the `sent` already chunked make its next chunk: the
    first once the detokenizer can make PCM of them (`first_codes`, at least `chunk`), then every
    `chunk` codes. So each chunk makes PCM as it comes: after a 5k-code voice prompt the codec
    decoder's first PCM needs 8 codes (a chunk and its lookahead), and its chunks end at 8, 13, 18 ...,
    not at 5 (no PCM), 10, 15 ..., each of which would wait 2 codes for the lookahead."""
    return pending >= (max(chunk, first_codes) if sent == 0 else chunk)


class Speech(Protocol):
    """One request's codes -> PCM, in two stages: `mel(codes [B, K], done, last)` (the K codes after
    `done` earlier ones; last: none follow), then `pcm(that)`: the PCM [B, n] that became final.
    `first_codes`: the codes it needs before its first PCM (see `chunk_due`)."""

    first_codes: int

    def mel(self, codes: torch.Tensor, done: int, last: bool) -> object: ...

    def pcm(self, mel: object) -> torch.Tensor: ...


@dataclass
class Chunk:
    tokens: int  # codes in this chunk
    t_start: float  # its last code was sampled
    t_mel: float  # stage 1 done
    t_ready: float  # PCM ready
    samples: int  # the PCM it made final, per stream


def overlaps(overlap: bool, device: torch.device) -> bool:
    """Whether `benchmark.vocoder.overlap` takes effect: only on CUDA (the CPU has one stream)."""
    return overlap and device.type == "cuda"


def seen_complete(event: torch.cuda.Event, clock: Clock, within_s: float) -> float | None:
    """The clock when the event is first seen complete, watched for at most `within_s` (None: not by
    then). The time is no earlier than the event's completion and at most the watch's polling late."""
    t0 = clock()
    while True:
        if event.query():
            return clock()
        if clock() - t0 > within_s:
            return None


def host_time(t_anchor: float, elapsed_ms: float) -> float:
    """The host-clock time of a CUDA event recorded `elapsed_ms` after the anchor event.

    t_anchor is read on the host after the anchor event was seen complete, so it is no earlier
    than the anchor's completion on the GPU; the event's derived time is therefore never
    earlier than its true time (conservative: late by the delay before the anchor was seen
    complete, microseconds, plus the events' ~0.5 us resolution and any GPU/host clock drift since
    the anchor, parts per million).
    """
    return t_anchor + elapsed_ms / 1e3


@dataclass
class StandIn:
    """The stand-in detokenizer: a code->mel table, then a vocoder; each chunk emits exactly its
    codes x samples_per_token, and the rest of its hop-aligned waveform carries over to the next."""

    table: Mel
    vocoder: Vocoder
    samples_per_token: int
    spare: torch.Tensor | None = None  # [B, n] vocoded, not yet emitted (made where the first PCM is)
    first_codes: ClassVar[int] = 1  # each code makes its own PCM

    def mel(self, codes: torch.Tensor, done: int, last: bool) -> tuple[torch.Tensor, int]:
        return self.table(codes, done), codes.shape[1]

    def pcm(self, mel: tuple[torch.Tensor, int]) -> torch.Tensor:
        m, codes = mel
        wav = self.vocoder(m)[:, 0].float()
        wav = wav if self.spare is None else torch.cat([self.spare, wav], dim=1)
        n = codes * self.samples_per_token
        self.spare = wav[:, n:]
        return wav[:, :n]


def _join(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The request's PCM [B, samples]: every chunk's, in order (none: an empty [0, 0])."""
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(0, 0)


class Inline:
    """Both stages on the decoding stream, each timed by the clock: decoding waits."""

    def __init__(self, speech: Speech, clock: Clock):
        self.speech, self.clock = speech, clock
        self.pieces: list[torch.Tensor] = []
        self.chunks: list[Chunk] = []

    def start(self) -> float:
        """The request's time."""
        return self.clock()

    def stamp(self) -> Stamp:
        """The clock now."""
        t = self.clock()
        return lambda: t

    def submit(self, codes: torch.Tensor, done: int, t_start: Stamp, last: bool = False) -> None:
        """Detokenize codes [B, K] (after `done` earlier codes; last: none follow), whose last was sampled at t_start."""
        m = self.speech.mel(codes, done, last)
        t_mel = self.clock()
        self.pieces.append(self.speech.pcm(m))
        self.chunks.append(Chunk(codes.shape[1], t_start(), t_mel, self.clock(), self.pieces[-1].shape[1]))

    def finish(self) -> tuple[list[Chunk], torch.Tensor]:
        """Every chunk's times, and the PCM [B, samples]."""
        return self.chunks, _join(self.pieces)


class Overlapped:
    """Both stages on a side CUDA stream, timed by events: decoding does not wait. The clock is
    read once, at the request (`start`); every later time is an event."""

    def __init__(self, speech: Speech, device: torch.device, clock: Clock, first_alone: bool = False):
        self.speech, self.clock, self.first_alone = speech, clock, first_alone
        self.main = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device, priority=-100)  # clamped to the highest there is
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.t_anchor = 0.0
        self.pieces: list[torch.Tensor] = []
        self.events: list[tuple[int, Stamp, torch.cuda.Event, torch.cuda.Event]] = []
        self.inputs: list[torch.Tensor] = []

    def start(self) -> float:
        """The request's time: the anchor's host time (read after the anchor completed)."""
        self.anchor.record(self.main)
        self.anchor.synchronize()
        self.t_anchor = self.clock()
        return self.t_anchor

    def stamp(self) -> Stamp:
        """An event recorded on the decoding stream now: no waiting; read after finish()."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.main)
        return lambda: self._host(event)

    def _host(self, event: torch.cuda.Event) -> float:
        """An event's host time (`host_time`); the event must be complete."""
        return host_time(self.t_anchor, self.anchor.elapsed_time(event))

    def submit(self, codes: torch.Tensor, done: int, t_start: Stamp, last: bool = False) -> None:
        """Enqueue codes [B, K] on the side stream and return at once."""
        self.side.wait_stream(self.main)  # the codes are computed
        # made on the decoding stream, read on the side one: held until finish() so that the
        # allocator cannot hand their memory to the decoding stream while the side one reads it
        self.inputs.append(codes)
        mel_done, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side):  # what is allocated here belongs to the side stream
            m = self.speech.mel(codes, done, last)
            mel_done.record(self.side)
            self.pieces.append(self.speech.pcm(m))
            ready.record(self.side)
        if self.first_alone and self.pieces[-1].shape[1] and not any(p.shape[1] for p in self.pieces[:-1]):
            self.main.wait_stream(self.side)  # the next decode step waits for the first PCM
        self.events.append((codes.shape[1], t_start, mel_done, ready))

    def finish(self) -> tuple[list[Chunk], torch.Tensor]:
        """Wait for the side stream, join the PCM on the decoding stream, then read the events."""
        self.main.wait_stream(self.side)
        pcm = _join(self.pieces)  # on the decoding stream, after every chunk
        self.main.synchronize()  # the side stream's work is done too: it came before
        self.inputs.clear()
        chunks = [
            Chunk(k, t_start(), self._host(m), self._host(r), piece.shape[1])
            for (k, t_start, m, r), piece in zip(self.events, self.pieces, strict=True)
        ]
        return chunks, pcm


Detokenizer = Inline | Overlapped


def detokenizer(speech: Speech, device: torch.device, clock: Clock, overlap: bool, first_alone: bool = False) -> Detokenizer:
    """Overlapped where asked for and on CUDA (first_alone: see `Overlapped`), else in line."""
    if overlaps(overlap, device):
        return Overlapped(speech, device, clock, first_alone)
    return Inline(speech, clock)


Ready = Callable[[bool], float | None]  # (wait) -> when a batch's PCM was ready (host seconds); None: not yet


@dataclass(frozen=True)
class Piece:
    """One stream's chunk to serving's detokenizer: its codes [K], after `done` earlier ones; `last`:
    the stream's end (a detokenizer that keeps state per stream may drop it after)."""

    stream: int
    codes: torch.Tensor
    done: int
    last: bool = False


def lane_priorities(later_below: bool) -> dict[bool, int]:
    """The lanes' stream priorities (lower is higher), by `urgent`: first pieces above everything (-100 is
    clamped to the highest there is); later ones at the decode graphs' priority, or with `later_below`
    one step below it (above default-priority work), so that where both wait for the GPU, decoding,
    which time to first audio waits on, goes first and a held batch, which has its slack, after."""
    return {False: CAPTURE_PRIORITY + 1 if later_below else CAPTURE_PRIORITY, True: -100}


class Lanes:
    """Serving's detokenizer, the part every kind shares: a batch of many streams' pieces (`_run`,
    the kind's own) and when its PCM was ready.

    On CUDA the work goes to a side stream (a lane) and the call returns at once: the codes come
    from the host, so nothing waits for decoding, and decoding goes on beside it. Later pieces run
    at the decode graphs' priority, or below it (`later_below`: `lane_priorities`); `urgent` ones
    (streams' first audible pieces: time to first audio waits on them) on a lane of the highest
    priority, which the GPU serves first. The
    batch's ready time is a CUDA event read once complete and put on the host clock through an
    anchor event (`host_time`), recorded on an idle stream and renewed every `anchor_s`, as the
    GPU's and the host's clocks drift apart (parts per million), never waiting behind a lane's work
    (`_anchor`). On the CPU it runs in line and the clock is read after it."""

    first_codes = 1  # codes a stream needs before its first PCM: pieces until then are urgent
    anchor_wait_s = 0.0005  # the longest a renewal of the anchor watches its event (inf: waits, whatever it takes)

    def __init__(
        self, sample_rate: float, device: torch.device, clock: Clock, anchor_s: float = 2.0, later_below: bool = False
    ):  # fmt: skip
        self.sample_rate, self.device, self.clock = sample_rate, device, clock  # PCM samples a second
        self.anchor_s, self.anchor, self.t_anchor = anchor_s, None, -float("inf")
        self.t_renew, self.renewals_put_off = -float("inf"), 0  # the next try to renew the anchor; those put off
        cuda = device.type == "cuda"
        lanes = lane_priorities(later_below)  # a graph captured on a lane keeps its priority
        self.lanes = {urgent: torch.cuda.Stream(device, priority=p) for urgent, p in lanes.items()} if cuda else {}
        self.priorities = {"urgent" if u else "later": s.priority for u, s in self.lanes.items()}  # as the device clamped them
        if cuda:  # and the engine's graphs' (cudagraphs.CAPTURE_PRIORITY)
            self.priorities["decode graphs"] = torch.cuda.Stream(device, priority=CAPTURE_PRIORITY).priority
        self.idle = torch.cuda.Stream(device) if cuda else None

    def __call__(self, pieces: list[Piece], urgent: bool = False) -> tuple[Ready, list[int]]:
        """Detokenize the pieces; (when their PCM is ready, the PCM samples each made final)."""
        if not self.lanes:
            samples = self._run(pieces)
            t = self.clock()
            return (lambda wait: t), samples
        anchor, t_anchor = self._anchor()
        done = torch.cuda.Event(enable_timing=True)
        lane = self.lanes[urgent]
        with torch.cuda.stream(lane):  # what is allocated here belongs to the lane's stream
            samples = self._run(pieces)
            done.record(lane)

        def ready(wait: bool) -> float | None:
            if not wait and not done.query():
                return None
            done.synchronize()
            return host_time(t_anchor, anchor.elapsed_time(done))

        return ready, samples

    def _run(self, pieces: list[Piece]) -> list[int]:
        raise NotImplementedError

    def _anchor(self) -> tuple[torch.cuda.Event, float]:
        """The anchor, renewed once `anchor_s` old: an event recorded on the idle stream and put on the
        host clock when seen complete. Were the idle stream to share one of the GPU's hardware queues
        with a lane (there are more streams than CUDA_DEVICE_MAX_CONNECTIONS), its event would complete
        only after the lane's work queued before it, a held codec batch's tens of ms, and a wait would
        add that to the loop's iteration (H200 run 12 put off no renewal: `anchor_put_off`). So a
        renewal watches its event for at most
        `anchor_wait_s` (`seen_complete`); past that the old anchor serves on (the clocks drift apart by
        parts per million) and a new one is tried `anchor_s / 8` later. Only the first one waits."""
        now = self.clock()
        if now < self.t_renew:
            return self.anchor, self.t_anchor
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.idle)
        if self.anchor is None:
            event.synchronize()
            seen = self.clock()
        else:
            seen = seen_complete(event, self.clock, self.anchor_wait_s)
        if seen is None:
            self.t_renew = now + self.anchor_s / 8
            self.renewals_put_off += 1
        else:
            self.anchor, self.t_anchor, self.t_renew = event, seen, seen + self.anchor_s
        return self.anchor, self.t_anchor


class Batched(Lanes):
    """The stand-in's serving detokenizer: each piece's mel at its own offset, then the vocoder once
    per frame count (a chunk's mel is 37 or 38 frames) over every piece of it, the batch padded to
    bucket(n) rows (a CUDA graph each). A piece of K codes gives K x samples_per_code samples."""

    def __init__(
        self, mel: Mel, vocoder: Vocoder, samples_per_code: int, device: torch.device, bucket: Callable[[int], int],
        clock: Clock, anchor_s: float = 2.0, later_below: bool = False,
    ):  # fmt: skip
        super().__init__(samples_per_code / SECONDS_PER_TOKEN, device, clock, anchor_s, later_below)
        self.mel, self.vocoder, self.samples_per_code, self.bucket = mel, vocoder, samples_per_code, bucket

    def warm(self, rows: int, codes: int, max_codes: int = 0, few: int = 8) -> int:
        """Make now the vocoder's graphs (and compiles) that serving would meet: a batch of n pieces
        for every bucket up to `rows`, of `codes` codes at both offsets (mel lengths alternate), and
        the shorter last pieces of streams, fewer at once, up to `few`; on the urgent lane, up to
        `few` first pieces. Returns the calls. (max_codes, a reply's most: no shape depends on it.)"""
        calls = 0
        for n in sorted({self.bucket(i) for i in range(1, rows + 1)}):
            batches = [(k, done, False) for k in (range(1, codes + 1) if n <= few else [codes]) for done in (0, codes)]
            for k, done, urgent in batches + ([(codes, 0, True)] if n <= few and self.lanes else []):
                self([Piece(i, torch.zeros(k, dtype=torch.long), done) for i in range(n)], urgent)[0](True)
                calls += 1
        return calls

    @torch.no_grad()
    def _run(self, pieces: list[Piece]) -> list[int]:
        codes = torch.cat([p.codes for p in pieces])  # one copy to the device, not waiting (pinned)
        codes = (codes.pin_memory() if self.lanes else codes).to(self.device, non_blocking=True)
        groups: dict[int, list[torch.Tensor]] = {}
        for part, p in zip(codes.split([len(p.codes) for p in pieces]), pieces, strict=True):
            if not len(part):  # a stream's end right after a whole chunk: nothing to vocode
                continue
            m = self.mel(part[None], p.done)
            groups.setdefault(m.shape[-1], []).append(m)
        for group in groups.values():
            x = torch.cat(group)
            pad = self.bucket(len(x)) - len(x)
            self.vocoder(torch.cat([x, x[:1].expand(pad, -1, -1)]) if pad else x)
        return [len(p.codes) * self.samples_per_code for p in pieces]
