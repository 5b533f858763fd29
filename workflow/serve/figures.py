"""What a load level's requests and iterations say (docs/DESIGN's definitions, shared by every result
file): each chunk's playback and underruns, the parts of the slowest requests' time to first audio,
and what the slowest decoding iterations held."""

from __future__ import annotations

from collections.abc import Callable

from workflow.serve.request import Request
from workflow.serve.scheduler import Iteration

TTFA_PARTS = ("queued", "first_chunk", "first_pcm")  # Request.ttfa_parts: admitted, first audible chunk sent, its PCM ready
Record = tuple[float, Iteration, dict[str, float]]  # a decoding iteration: wall ms, what it held, host ms by phase


def audible(req: Request, sample_rate: float) -> list[tuple[float, float]]:
    """(ready, due) of each chunk with PCM, in order: playback starts at the first, and a chunk is
    due when the PCM of those before it has played, `sample_rate` samples a second."""
    chunks = [(t, n) for t, n in zip(req.chunk_ready, req.chunk_samples, strict=False) if n]
    if not chunks:
        return []
    t0, before = chunks[0][0], 0
    out = []
    for t, n in chunks:
        out.append((t, t0 + before / sample_rate))
        before += n
    return out


def underruns(req: Request, sample_rate: float) -> tuple[int, float]:
    """(chunks ready after they were due, seconds stalled) of one stream."""
    late = [t - due for t, due in audible(req, sample_rate) if t > due]
    return len(late), sum(late)


def slowest_parts(parts: list[tuple[float, float, float]]) -> dict[str, float]:
    """The mean of each part of time to first audio (ms) over the slowest tenth of the requests (at
    least one; `parts` sorted by their sum, slowest last): what the level's p90-p99 is made of."""
    tail = parts[-max(1, len(parts) // 10) :] if parts else []
    return {k: 1e3 * sum(p[i] for p in tail) / len(tail) if tail else float("nan") for i, k in enumerate(TTFA_PARTS)}


def slow_iterations(iters: list[Record]) -> dict:
    """What a level's slowest decoding iterations (the slowest hundredth, at least one) held against all
    of them: the share that admitted prompts (a prefill), that began beside a running later-chunk batch
    of the detokenizer, and (of the slow ones) that captured a CUDA graph, that grew CUDA's pinned pool
    (also of all) and that met a full garbage collection, their mean ms launching CUDA
    graphs (also of all: a launch blocks while the device's queue is full), and their mean host ms by phase
    (sampling's holds the wait for the device). Where a slow iteration's time goes: the step's device
    time shared with a held codec call, prompts', a graph made mid-level, or a wait (serve/waits.py)."""
    if not iters:
        return {}
    slow = sorted(iters, key=lambda r: r[0])[-max(1, len(iters) // 100) :]

    def share(rows: list, held: Callable[[Iteration], float]) -> float:
        return sum(held(it) > 0 for _, it, _ in rows) / len(rows)

    return {
        "threshold_ms": slow[0][0],  # the fastest of them
        "n": len(slow),
        "mean_ms": sum(ms for ms, _, _ in slow) / len(slow),
        "with_prompts": share(slow, lambda it: it.prompts),
        "prompts": sum(it.prompts for _, it, _ in slow) / len(slow),
        "beside_later": share(slow, lambda it: it.later),
        "all_with_prompts": share(iters, lambda it: it.prompts),
        "all_beside_later": share(iters, lambda it: it.later),
        "captured": share(slow, lambda it: it.waits.captured),
        "pinned_allocs": share(slow, lambda it: it.waits.pinned_allocs),
        "all_pinned_allocs": share(iters, lambda it: it.waits.pinned_allocs),
        "gc": share(slow, lambda it: it.waits.gc_runs),
        "replay_ms": 1e3 * sum(it.waits.replay_s for _, it, _ in slow) / len(slow),
        "all_replay_ms": 1e3 * sum(it.waits.replay_s for _, it, _ in iters) / len(iters),
        "host_ms": {k: sum(h.get(k, 0.0) for _, _, h in slow) / len(slow) for k in sorted({k for _, _, h in slow for k in h})},
    }


def playback_end(req: Request, sample_rate: float) -> float:
    """When the stream's last sample has played (stalls included); its last chunk's readiness
    if it made no PCM."""
    chunks = audible(req, sample_rate)
    if not chunks:
        return req.chunk_ready[-1]
    _, stalled = underruns(req, sample_rate)
    return chunks[0][0] + sum(req.chunk_samples) / sample_rate + stalled


def timeline(req: Request, sample_rate: float) -> dict:
    """One stream under load: when it arrived, was admitted, and each chunk with PCM ready against due (s)."""
    t0, chunks = req.t_arrival, audible(req, sample_rate)
    return {
        "arrival": 0.0,
        "admitted": req.t_admit - t0,
        "chunk_ready": [t - t0 for t, _ in chunks],
        "chunk_due": [due - t0 for _, due in chunks],
    }
