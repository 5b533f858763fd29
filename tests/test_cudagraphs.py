"""CUDA graphs share their memory (on the GPU machine only: `pytest tests/test_cudagraphs.py`), and the
priorities they are captured at, with the detokenizer's lanes' (anywhere)."""

import pytest
import torch

from workflow.cudagraphs import CAPTURE_PRIORITY, Graphs, PoolMarks, capture_priority, pool_bytes
from workflow.detokenize import lane_priorities

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_graphs_of_one_priority_reuse_each_others_scratch_memory():
    """Twenty graphs, each with 64 MiB of scratch and a 4 KiB output, hold a few scratches' worth
    of the pool, not twenty (an H200: 196 MiB; captures on fresh streams keep 20 x 64 MiB)."""
    device = torch.device("cuda")
    x = torch.randn(1024, device=device)
    graphs = Graphs(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    outs = []
    for i in range(20):
        outs.append(graphs.run(i, lambda i=i: (x[None].expand(16384, -1) * (i + 1)).sum(0)))  # 64 MiB scratch
        assert torch.allclose(outs[-1], x * 16384 * (i + 1), rtol=1e-4)
    torch.cuda.empty_cache()  # what the warm-ups left; the graphs' pool stays
    held = torch.cuda.memory_reserved(device) - before
    assert held < 6 * 64 * 2**20, f"the graphs hold {held / 2**20:.0f} MiB"
    for i in range(20):  # each replays its own function still
        assert torch.allclose(graphs.run(i, lambda: None).clone(), x * 16384 * (i + 1), rtol=1e-4)


@needs_cuda
def test_graphs_of_different_priorities_never_share_memory():
    """The detokenizer's two lanes replay at the same time: a graph captured on the urgent lane
    must not use memory a default-lane graph writes."""
    device = torch.device("cuda")
    x = torch.randn(1024, device=device)
    graphs = Graphs(device)
    normal = graphs.run("normal", lambda: (x[None].expand(16384, -1) * 2).sum(0))
    with torch.cuda.stream(torch.cuda.Stream(device, priority=-100)):
        urgent = graphs.run("urgent", lambda: (x[None].expand(16384, -1) * 3).sum(0))
    torch.cuda.synchronize()
    assert len(graphs.capture) == 2 and len({pool for _, pool in graphs.capture.values()}) == 2
    assert torch.allclose(urgent, normal * 1.5, rtol=1e-4)


@needs_cuda
def test_call_copies_each_calls_inputs_into_the_keys_static_buffers():
    """`call` replays one graph per key on the inputs of the call, not the first call's."""
    device = torch.device("cuda")
    graphs = Graphs(device)
    for scale in (1.0, 2.0, -3.0):
        x, y = torch.randn(64, device=device) * scale, torch.randn(64, device=device)
        got = graphs.call("add", torch.add, x, y).clone()
        torch.testing.assert_close(got, x + y)
    assert len(graphs.graphs) == 1 and len(graphs.inputs["add"]) == 2


@needs_cuda
def test_replays_are_counted_by_key_and_each_graph_priced_alone():
    """`Graphs.run` counts each key's replays (the capturing call's one included: its work ran); `alone_ms`
    times a graph by itself: one that does eight times the work of another takes longer, a key dropped
    since is left out, and a replay alone redoes the graph's write (here the same values again)."""
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    graphs, out = Graphs(device), torch.empty(2048, 2048, device=device)
    for _ in range(3):
        graphs.run("one", lambda: torch.mm(a, a, out=out))
    graphs.run("eight", lambda: [torch.mm(a, a) for _ in range(8)][-1])
    graphs.run("dropped", lambda: a * 2)
    graphs.drop(lambda key: key == "dropped")
    assert graphs.replays == {"one": 3, "eight": 1, "dropped": 1}
    before = out.clone()
    ms = graphs.alone_ms(["one", "eight", "dropped"])
    assert set(ms) == {"one", "eight"} and 0 < ms["one"] < ms["eight"] and ms["eight"] > 4 * ms["one"]
    assert torch.equal(out, before) and graphs.replays["one"] == 3  # pricing is not serving's work


def test_later_pieces_below_decoding_only_when_asked_and_their_graphs_keep_it():
    """Lower is higher. The engine's graphs, called from the default stream (0), are captured above it; a
    lane's graphs at the lane's own priority. Urgent pieces above decoding; later ones at decoding's, or
    with later_below between it and default-priority work, and then their graphs too (a capture at the
    higher of the two, as before, would put them back level with decoding)."""
    assert capture_priority(0) == CAPTURE_PRIORITY < 0
    for later_below in (False, True):
        lanes = lane_priorities(later_below)
        assert lanes[True] < CAPTURE_PRIORITY and {capture_priority(p) for p in lanes.values()} == set(lanes.values())
    assert lane_priorities(False)[False] == CAPTURE_PRIORITY
    assert CAPTURE_PRIORITY < lane_priorities(True)[False] < 0


def test_pool_bytes_sorts_segments_into_graph_pools_and_the_allocators_own():
    """Segments of a memory snapshot (torch.cuda.memory_snapshot's form) in any graph's pool go to
    "graph_pools", those of the allocator's own pool (0, 0) to "rest", other devices' to neither."""
    snapshot = [
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 100, "allocated_size": 60},
        {"device": 0, "segment_pool_id": (1, 0), "total_size": 20, "allocated_size": 5},
        {"device": 0, "segment_pool_id": (2, 0), "total_size": 7, "allocated_size": 1},
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 4, "allocated_size": 4},
        {"device": 1, "segment_pool_id": (2, 0), "total_size": 1000, "allocated_size": 1000},  # another GPU's
    ]
    assert pool_bytes(snapshot, 0) == {
        "graph_pools": {"reserved_bytes": 27, "allocated_bytes": 6},
        "rest": {"reserved_bytes": 104, "allocated_bytes": 64},
    }
    assert PoolMarks(torch.device("cpu")).split() is None  # off CUDA: nothing to split


@needs_cuda
def test_pool_marks_give_each_stage_what_its_captures_added():
    """A Graphs object made before the marks start, then captures into its pool in the first stage, a new
    one in the second: each stage gets what its graphs' outputs (8 MiB each, kept alive) added, the pool
    made before it included; the allocator's own pool holds the input; the device has the rest free."""
    device = torch.device("cuda")
    x = torch.randn(2**21, device=device)  # 8 MiB, in the allocator's own pool
    first, second = Graphs(device), Graphs(device)
    outs = [first.run("before", lambda: x * 0)]  # its pool exists before the marks (the engine's does)
    marks = PoolMarks(device)
    outs += [first.run(i, lambda i=i: x * (i + 1)) for i in range(3)]
    marks.mark("engine_graphs")
    outs += [second.run(i, lambda i=i: x - i) for i in range(2)]
    marks.mark("detokenizer_graphs")
    split = marks.split()
    engine, detokenizer = split["engine_graphs"]["allocated_bytes"], split["detokenizer_graphs"]["allocated_bytes"]
    assert 3 * x.nbytes <= engine < 4 * x.nbytes and 2 * x.nbytes <= detokenizer < 3 * x.nbytes  # each its own stage's
    assert split["graph_pools"]["allocated_bytes"] >= 6 * x.nbytes and split["rest"]["allocated_bytes"] >= x.nbytes
    assert 0 < split["free_bytes"] <= torch.cuda.mem_get_info(device)[1]
    assert all(part["reserved_bytes"] >= part["allocated_bytes"] for part in (split["graph_pools"], split["rest"]))
    assert torch.equal(outs[5], x - 1)
