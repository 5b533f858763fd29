"""What can hold the load loop's one thread beyond its own work, counted so that a level says
whether it happened and its slowest iterations say whether they met it:

- CUDA's pinned-memory pool growing (`to_device` copies through pinned blocks; a block is reused
  only once the copies that read it are done, so with a lane's work queued the pool grows):
  cudaHostAlloc, which CUDA orders against the work of every stream;
- the device allocator's new segments (cudaMalloc) and its retries (after a failed cudaMalloc it
  frees its cache: a wait for the whole device);
- a CUDA graph captured mid-level (`load.prepare` makes them ahead), which holds every stream while
  it is made, and a graph's launch, which blocks while the device's queue of launched work is full
  (the host's seconds in `Graphs.run`'s captures and replays);
- Python's full garbage collections (of its oldest generation), which stop every thread while
  they walk every object (counted, from the collector's own statistics; not timed).

Each is a count so far: a level or an iteration takes the difference of two readings."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from workflow.cudagraphs import Graphs


@dataclass(frozen=True)
class Counts:
    pinned_allocs: int = 0  # blocks added to CUDA's pinned-memory pool
    device_mallocs: int = 0  # segments the CUDA caching allocator asked cudaMalloc for (`Waits.level` only)
    alloc_retries: int = 0  # its retries after a failed cudaMalloc (`Waits.level` only)
    gc_runs: int = 0  # Python's full collections
    captured: int = 0  # CUDA graphs captured
    capture_s: float = 0.0  # and the host's seconds in them
    replay_s: float = 0.0  # the host's seconds launching CUDA graphs' replays

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


def pinned_allocs(device: torch.device) -> int:
    """Blocks CUDA's pinned-memory pool has allocated so far (0 off CUDA, or where torch does not count
    them); read from the nested statistics, which torch.cuda.host_memory_stats flattens and sorts."""
    stats = getattr(torch.cuda.memory, "host_memory_stats_as_nested_dict", None)
    return int(stats().get("num_host_alloc", 0)) if device.type == "cuda" and stats is not None else 0


class Waits:
    """Counts so far, `graphs`' captures and replays included: `iteration()` the cheap ones, read every decoding
    iteration; `level()` all, the device allocator's too (its statistics cost ~0.1 ms a read), at a
    level's ends."""

    def __init__(self, device: torch.device, graphs: Sequence[Graphs] = ()):
        self.device, self.graphs = device, graphs

    def iteration(self) -> Counts:
        return Counts(
            pinned_allocs=pinned_allocs(self.device),
            gc_runs=gc.get_stats()[-1]["collections"],
            captured=sum(g.captured for g in self.graphs),
            capture_s=sum(g.capture_s for g in self.graphs),
            replay_s=sum(g.replay_s for g in self.graphs),
        )

    def level(self) -> Counts:
        if self.device.type != "cuda":
            return self.iteration()
        stats = torch.cuda.memory_stats(self.device)
        mallocs, retries = stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)
        return replace(self.iteration(), device_mallocs=mallocs, alloc_retries=retries)
