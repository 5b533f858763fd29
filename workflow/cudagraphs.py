"""CUDA graphs keyed by shape: capture a step once, then replay it without launch gaps.

A graph reads static input buffers: the caller copies each call's inputs into its own and asks
for the graph of that key (`run`), or `call` keeps them per key and copies the inputs in. The
first request warms up on a side stream (where torch.compile and cuBLAS may allocate and choose
kernels) and captures, later ones replay.

Capture runs on a high-priority stream: PyTorch instantiates graphs with per-node priorities,
so a graph's kernels keep its capture stream's priority wherever it is replayed. That priority
is the current stream's where it has one of its own (the detokenizer's lanes: `capture_priority`),
else CAPTURE_PRIORITY, above default-priority work (the engine's graphs, called from the default
stream): a caller that replays one shape on streams of different priorities keys its graphs by
priority too.

Graphs of one priority share one memory pool (they run one after another on their stream) and are
captured on one stream: the caching allocator reuses a freed block only on the stream that
allocated it, so captures on fresh streams would each keep their own memory (hundreds of graphs,
tens of GB). Graphs of different priorities may run at the same time (the detokenizer's lanes), so
each priority has its own pool.

`confine` puts chosen graphs on fewer SMs: a graph runs on the SMs of the stream it was captured on, wherever it
is replayed (levers.md, "H200 codec beside decode"), so those are captured on a green context's stream
(greenctx.py), in a pool of their own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import torch

from workflow.greenctx import GreenStream, green_stream

T = TypeVar("T")
CAPTURE_PRIORITY = -2  # of the capture stream from the default stream: lower is higher; 0 the default
CONFINED = "confined"  # the capture lane of the graphs `confine` picks


def capture_priority(current: int) -> int:
    """The priority a graph is captured at, from the current stream's: its own, or CAPTURE_PRIORITY
    where it is the default (0)."""
    return current or CAPTURE_PRIORITY


class Graphs:
    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object, Callable]] = {}
        self.warm_up: torch.cuda.Stream | None = None
        self.capture: dict[int | str, tuple[torch.cuda.Stream, tuple | None]] = {}  # priority or CONFINED -> stream, pool
        self.green: GreenStream | None = None  # where the graphs `confined` picks are captured (`confine`)
        self.confined: Callable[[Hashable], bool] | None = None
        self.inputs: dict[Hashable, list[torch.Tensor]] = {}  # call's static input buffers, by key
        self.captured, self.capture_s = 0, 0.0  # graphs captured so far, and the host's seconds in it
        self.replay_s = 0.0  # the host's seconds in replays' launches: one blocks while the device's queue is full
        self.replays: Counter[Hashable] = Counter()  # replays so far, by key: the work asked of the device (`alone_ms`)

    def call(self, key: Hashable, fn: Callable[..., T], *args: torch.Tensor) -> T:
        """fn(*args) replayed from the graph for `key`: args are copied into static buffers kept
        for that key (made from the first call's), which the graph reads. The output lives in the
        graph's pool: read or clone it before the next replay."""
        if key not in self.inputs:
            self.inputs[key] = [a.clone() for a in args]
        static = self.inputs[key]
        for buffer, a in zip(static, args, strict=True):
            buffer.copy_(a)
        return self.run(key, lambda: fn(*static))

    def made(self, key: Hashable) -> bool:
        """Whether the graph for `key` is captured (a caller may run a shape eager rather than capture it)."""
        return key in self.graphs

    def drop(self, which: Callable[[Hashable], bool]) -> None:
        """Forget the graphs (and their input buffers) whose keys `which` picks: those that read memory
        about to be freed. Their memory stays in the pool, for the graphs captured next."""
        for key in [k for k in self.graphs if which(k)]:
            del self.graphs[key]
            self.inputs.pop(key, None)

    def confine(self, sms: int, which: Callable[[Hashable], bool], priority: int = CAPTURE_PRIORITY, setting: str = "sms") -> int:
        """From now on the graphs whose keys `which` picks run on `sms` of the GPU's SMs (0: all of them): captured
        at `priority` on the stream of a green context of that many. Where the count changes, those made already
        are dropped, to be captured again when next asked for. The SMs they have (as the driver rounds `sms`)."""
        if sms != (self.green.asked if self.green else 0):
            self.drop(which)
            self.capture.pop(CONFINED, None)
            self.green = green_stream(self.device, sms, priority, setting) if sms else None
            self.confined = which if sms else None
        return self.green.sms if self.green else 0

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        """fn() replayed from the graph captured for `key` (captured now if new). fn runs three
        times on a new key (warm-up, capture, replay): whatever it writes must be the same each
        time (the engine's cache writes at the step's positions are)."""
        if key not in self.graphs:
            t0 = time.perf_counter()
            current = torch.cuda.current_stream(self.device)
            side = self.warm_up = self.warm_up or torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                fn()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            lane: int | str = capture_priority(current.priority)
            if self.green is not None and self.confined is not None and self.confined(key):
                lane = CONFINED
                self.capture.setdefault(lane, (self.green.stream, None))
            if lane not in self.capture:
                self.capture[lane] = (torch.cuda.Stream(self.device, priority=lane), None)
            stream, pool = self.capture[lane]
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = fn()
            except RuntimeError as e:  # a launch the green context refuses: say which setting asked for it
                if lane != CONFINED or self.green is None:
                    raise
                what = str(e).strip().splitlines()[0]
                raise RuntimeError(f"{self.green.setting}: {key}'s graph on {self.green.sms} SMs failed: {what}") from e
            self.capture[lane] = (stream, graph.pool())
            self.graphs[key] = (graph, out, fn)  # fn keeps alive whatever the graph reads
            self.captured, self.capture_s = self.captured + 1, self.capture_s + time.perf_counter() - t0
        graph, out, _ = self.graphs[key]
        t0 = time.perf_counter()
        graph.replay()
        self.replay_s += time.perf_counter() - t0
        self.replays[key] += 1
        return out  # type: ignore[return-value]

    def alone_ms(self, keys: Iterable[Hashable], repeat: int = 3) -> dict[Hashable, float]:
        """Each key's graph replayed by itself, nothing else on the device: ms a replay (the mean of `repeat`
        after an untimed one), what its work costs with no other stream's beside it. Keys no longer made
        (`drop`) are left out. The replays redo the graph's writes: the caller makes sure they are harmless
        (serving's, once every stream has ended, write only slots and pages that are free)."""
        out: dict[Hashable, float] = {}
        made = [key for key in keys if key in self.graphs]
        if made:
            torch.cuda.synchronize(self.device)
        for key in made:
            graph = self.graphs[key][0]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record()
            for _ in range(repeat):
                graph.replay()
            end.record()
            end.synchronize()
            out[key] = start.elapsed_time(end) / repeat
        return out


def device_index(device: torch.device) -> int:
    """The CUDA device's index ("cuda" alone: the current one)."""
    return torch.cuda.current_device() if device.index is None else device.index


def pool_bytes(snapshot: list[dict], device: int) -> dict[str, dict[str, int]]:
    """Bytes reserved and allocated (held by tensors) on `device` in CUDA graphs' pools ("graph_pools") and in
    the caching allocator's own pool, (0, 0) ("rest": weights, caches, pages, and freed blocks kept for reuse),
    from a torch.cuda.memory_snapshot()."""
    out = {name: {"reserved_bytes": 0, "allocated_bytes": 0} for name in ("graph_pools", "rest")}
    for s in snapshot:
        if s["device"] == device:
            part = out["rest" if tuple(s["segment_pool_id"]) == (0, 0) else "graph_pools"]
            part["reserved_bytes"] += s["total_size"]
            part["allocated_bytes"] += s["allocated_size"]
    return out


class PoolMarks:
    """The device's memory in graph pools as stages end (CUDA; elsewhere none): what each stage's captures
    added to them (a stage may capture into a pool made before it: the engine's, by the streams benchmark),
    against the allocator's own pool and what the device has free."""

    def __init__(self, device: torch.device):
        self.index = device_index(device) if device.type == "cuda" else None
        self.stages: dict[str, dict[str, int]] = {}
        self.last = self._graphs()

    def _graphs(self) -> dict[str, int]:
        return pool_bytes(torch.cuda.memory_snapshot(), self.index)["graph_pools"] if self.index is not None else {}

    def mark(self, stage: str) -> None:
        """What the graph pools grew by since the last mark is `stage`'s."""
        now = self._graphs()
        self.stages[stage] = {k: now[k] - self.last[k] for k in now}
        self.last = now

    def split(self) -> dict | None:
        """The graph pools and the allocator's own pool, each stage's growth of the first, and the device's
        free bytes; None off CUDA."""
        if self.index is None:
            return None
        split = pool_bytes(torch.cuda.memory_snapshot(), self.index) | self.stages
        return split | {"free_bytes": torch.cuda.mem_get_info(self.index)[0]}
