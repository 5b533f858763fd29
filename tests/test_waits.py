"""What can hold the load loop's thread (serve/waits.py): counts, read as differences."""

import gc

import pytest
import torch

from workflow.cudagraphs import Graphs
from workflow.serve.waits import Counts, Waits


def test_full_collections_are_counted_and_young_ones_not():
    waits = Waits(torch.device("cpu"))
    before = waits.level()
    gc.collect(0)  # a young generation's: frequent and short, not counted
    assert waits.level() == before
    gc.collect()  # a full one
    got = waits.iteration() - before
    assert got.gc_runs == 1 and got.pinned_allocs == got.device_mallocs == got.alloc_retries == 0


def test_counts_subtract_field_by_field():
    assert Counts(3, 2, 1, 4, 2, 0.5, 0.5) - Counts(1, 2, 0, 1, 1, 0.25, 0.25) == Counts(2, 0, 1, 3, 1, 0.25, 0.25)


def test_graph_launches_are_the_seconds_their_graphs_spent_replaying():
    """A replay's launch blocks while the device's queue is full, a capture holds every stream: Waits
    sums `Graphs`' counters over the graphs it is given (here set by hand: graphs need CUDA)."""
    engine, codec = Graphs(torch.device("cpu")), Graphs(torch.device("cpu"))
    waits = Waits(torch.device("cpu"), [engine, codec])
    before = waits.iteration()
    engine.replay_s, codec.replay_s, codec.captured, codec.capture_s = 0.002, 0.030, 2, 0.5
    for got in (waits.iteration() - before, waits.level() - before):
        assert got.replay_s == pytest.approx(0.032) and got.captured == 2 and got.capture_s == 0.5
