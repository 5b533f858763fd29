"""Device time per phase of the serving loop (prefill, sampling, decode, detokenizer), read
without making the host wait: on CUDA a pair of events around each phase on its stream, summed
once they are complete; on the CPU, where the work runs as it is called, the clock around it.
And the host's time in each phase (its Python and launches): the loop is one thread, so what one
phase's host work takes, no other phase's launch can use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class Phases:
    def __init__(self, device: torch.device, clock: Callable[[], float]):
        self.cuda, self.clock = device.type == "cuda", clock
        self.seconds: dict[str, float] = {}  # device
        self.host: dict[str, float] = {}
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, name: str, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        """Time what the block enqueues on `stream` (the current one if None): the span from the
        stream reaching the block's first work to finishing its last, host launch gaps included."""
        t = self.clock()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self.pending.append((name, start, end))
        else:
            yield
        host = self.clock() - t
        self.host[name] = self.host.get(name, 0.0) + host
        if not self.cuda:  # the work ran as it was called: the device's time is the host's
            self._add(name, host)

    def collect(self, wait: bool = False) -> None:
        """Add the spans that are complete (wait: all of them)."""
        left = []
        for name, start, end in self.pending:
            if wait or end.query():
                end.synchronize()
                self._add(name, start.elapsed_time(end) / 1e3)
            else:
                left.append((name, start, end))
        self.pending = left

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
