"""graph_us and rows from probe_tiles.py (for probe_attn.py; out of the tree after its run)."""

import math
import statistics

import torch


def graph_us(fn, reps: int = 20, replays: int = 7) -> float:
    """fn's device time per launch, from a CUDA graph of `reps` launches replayed (median)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del g
    return statistics.median(times)


def rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """t's rows repeated to m."""
    return t.repeat(math.ceil(m / len(t)), *[1] * (t.dim() - 1))[:m].contiguous()
