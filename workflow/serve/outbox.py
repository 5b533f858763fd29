"""The chunks made and not yet sent to the detokenizer, and which of them go now (the scheduler's 5.).

A chunk is (its request, its codes, the stream's codes before them, whether it is the stream's last).
Each iteration the scheduler asks twice: `urgent()`, the chunks of streams whose PCM does not yet
cover a chunk's audio (`first_chunks_apart`: their own batch, on the detokenizer's urgent lane), and,
when a later batch may run, `later()`: a speaking stream's chunks once `detokenize_hold` of them wait
or one is due within `detokenize_slack_s` of its playback, with those of `detokenize_join` alongside,
every chunk of a stream that no longer speaks, and with `detokenize_least` only a batch of at least
that many codes (unless one is due); never the chunks of a stream that `urgent()` would take, which
wait for their lane while `urgent_batches` run there. docs/serving.md says why each.

A stream's waiting chunks are decided once a call, together: whether one is due reads the clock, and
a chunk whose answer changed between two questions was in neither batch nor outbox (a lost chunk,
levers.md "H200 serving iterations 2"). They go in order, in a later batch as many as one flow call
solves (`codes_a_call`); the rest wait for the next.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from workflow.serve.request import Detokenize, Request, ServeConfig, pcm_rate
from workflow.vocoder import SECONDS_PER_TOKEN

Chunk = tuple[Request, list[int], int, bool]  # request, codes, codes before them, last


class Outbox:
    def __init__(self, cfg: ServeConfig, detokenize: Detokenize | None, clock: Callable[[], float]):
        self.cfg, self.clock = cfg, clock
        self.codes_a_call: int = getattr(detokenize, "codes_a_call", 0)  # a stream's most in a later batch (0: all)
        self.rate = pcm_rate(detokenize)  # PCM samples a second
        self.chunk_audio = round(cfg.chunk_tokens * SECONDS_PER_TOKEN * self.rate)  # a chunk's, in samples
        self.chunks: list[Chunk] = []

    def append(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self.chunks)

    def urgent(self) -> list[Chunk]:
        """The chunks of streams whose PCM covers less than a chunk's audio: they go at once."""
        return self._take(self._urgent, most=0)

    def _urgent(self, req: Request) -> bool:
        return sum(req.chunk_samples) < self.chunk_audio

    def later(self, speaking: set[int], first_audio_waits: bool, hold: bool = True) -> list[Chunk]:
        """A batch of later chunks (module docstring), [] while none go. speaking: the streams still
        decoding; first_audio_waits: only those due within the slack go (`first_audio_first`);
        hold False: every waiting chunk goes (a flush)."""
        waiting = Counter(c[0].rid for c in self.chunks)
        apart = hold and self.cfg.first_chunks_apart  # urgent ones wait for their lane (`urgent_batches`)
        reqs = {rid: req for rid, req in self._requests().items() if not (apart and self._urgent(req))}
        soon = {rid for rid, req in reqs.items() if self.due_soon(req)}  # the clock read once a request
        speaking = speaking if hold else set()
        held = None if first_audio_waits else self.cfg.detokenize_hold  # None: only those due soon go
        join = self.cfg.detokenize_join if held is not None else 0
        return self._take(
            lambda req: (
                req.rid in reqs
                and (req.rid not in speaking or (held is not None and waiting[req.rid] >= held) or req.rid in soon)
            ),
            most=self.codes_a_call,
            joins=lambda req: req.rid in reqs and 0 < join <= waiting[req.rid],
            least=self.cfg.detokenize_least if hold and not soon else 0,
        )

    def due_soon(self, req: Request) -> bool:
        """With `detokenize_slack_s`: whether the stream's next chunk plays within that slack: after the
        PCM of every chunk sent, from its first PCM's ready time (now while that is not yet known)."""
        if not self.cfg.detokenize_slack_s:
            return False
        now = self.clock()
        start = req.playback_start
        return (now if start is None else start) + sum(req.chunk_samples) / self.rate - now <= self.cfg.detokenize_slack_s

    def _requests(self) -> dict[int, Request]:
        return {c[0].rid: c[0] for c in self.chunks}

    def _take(
        self, goes: Callable[[Request], bool], most: int, joins: Callable[[Request], bool] | None = None, least: int = 0
    ) -> list[Chunk]:
        """The waiting chunks whose request `goes`, and where any go those whose request `joins`, at most
        `most` codes a stream (0: all), if they are at least `least` codes (else none); taken out, in order."""
        reqs = self._requests()
        going = {rid for rid, req in reqs.items() if goes(req)}
        if going and joins is not None:
            going |= {rid for rid, req in reqs.items() if joins(req)}
        if not going:
            return []
        go, keep, codes = [], [], Counter()
        for c in self.chunks:
            if c[0].rid in going and (not most or c[0].rid not in codes or codes[c[0].rid] + len(c[1]) <= most):
                go.append(c)
                codes[c[0].rid] += len(c[1])
            else:
                keep.append(c)
                going.discard(c[0].rid)  # its later chunks wait too, in order
        if sum(codes.values()) < least:
            return []  # too few codes for a call's cost: they all wait for more, or for one to be due
        self.chunks = keep
        return go
