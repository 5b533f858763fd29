"""Choosing the fused GEMV's blocks (workflow.engines.gemv) on the target GPU at build: each
candidate timed at each row count, from CUDA graphs, on weights that L2 cannot hold. Like a
TensorRT tactic choice; the engine stores the result in engine.json."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from tqdm import tqdm

from workflow.engines.blocks import ROWS, Fuse, Tuned, Use, candidates
from workflow.engines.gemv import launch, triton

L2_FLUSH = 256 << 20  # tuning cycles through this many bytes of weight copies: no L2 hits


def tune(
    uses: list[tuple[torch.Tensor, Fuse]], rows: tuple[int, ...] = ROWS, reps: int = 20, known: dict[Use, Tuned] | None = None
) -> dict[Use, Tuned]:
    """Time every candidate block for each (weight, fuse) use at each row count of x, on the
    weight's device, and keep the fastest (a block this GPU cannot launch is passed over). Like a
    TensorRT tactic choice: run once at build on the target GPU; the engine stores the result in
    engine.json and hands each call its block. Minutes at the full shape: a progress bar shows them.
    known: blocks chosen before on this kind of GPU (timing_cache.py), taken as they are, not timed."""
    known = known or {}
    unique = list({Use.of(w, fuse): (w, fuse) for w, fuse in uses}.values())
    found = {u: known[u] for w, fuse in unique for m in rows if (u := Use.of(w, fuse, m)) in known}
    todo = [(w, fuse) for w, fuse in unique if any(Use.of(w, fuse, m) not in found for m in rows)]
    left = [(w, f, m) for w, f in todo for m in rows if Use.of(w, f, m) not in found]
    total = sum(len(candidates(w.shape[1], w.element_size(), f, m)) for w, f, m in left)
    with tqdm(total=total, desc="tuning the decode GEMV", unit="block", disable=not todo) as bar:
        for w, fuse in todo:
            copies = l2_copies(w)
            for m in rows:
                if Use.of(w, fuse, m) not in found:
                    found[Use.of(w, fuse, m)] = tune_use(w, fuse, m, copies, reps, bar.update)
            del copies
    return found


def tune_use(w: torch.Tensor, fuse: Fuse, m: int, copies: list[torch.Tensor], reps: int, timed: Callable[[], object]) -> Tuned:
    """The fastest candidate block for one use at m rows of x (`timed()` after each block)."""
    use = Use.of(w, fuse, m)
    k, n, act = use.k, use.n, torch.bfloat16 if use.weight_bytes == 1 else w.dtype
    x = torch.randn(m, 2 * k if Fuse.SILU in fuse else k, device=w.device).to(w.dtype)
    out_n = n // (1 + (Fuse.GLU in fuse))
    args = {
        "scale": torch.ones(1, device=w.device) if use.weight_bytes == 1 else None,
        "norm": torch.ones(k, device=w.device, dtype=act) if Fuse.NORM in fuse else None,
        "residual": torch.zeros(m, out_n, device=w.device, dtype=act) if Fuse.RES in fuse else None,
        "silu_mul": Fuse.SILU in fuse,
        "glu": Fuse.GLU in fuse,
    }
    times = {}
    for block in candidates(k, use.weight_bytes, fuse, m):
        try:
            times[block] = call_ms(functools.partial(launch, x, out_dtype=act, block=block, **args), copies, reps)
        except triton.runtime.errors.OutOfResources:  # more shared memory or registers than this GPU has
            pass
        except triton.compiler.errors.CompilationError as e:  # a block this GPU's compiler refuses
            why = str(e).splitlines()[0]
            warnings.warn(f"tuning the GEMV: {block} does not compile here, passed over: {why}", stacklevel=1)
        timed()
    if not times:
        raise RuntimeError(f"tuning the GEMV: no block for {use.key()} launches on this GPU")
    best = min(times, key=times.get)
    return Tuned(best, times[best])


def l2_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """w and enough clones of it that, read in turn, they overflow L2: a timed call finds no
    weight bytes cached, as in a decode step that reads each weight once."""
    return [w] + [w.clone() for _ in range(-(-L2_FLUSH // (w.numel() * w.element_size())) - 1)]


def call_ms(call: Callable[[torch.Tensor], object], copies: list[torch.Tensor], reps: int = 20) -> float:
    """ms a call of `call(weight)`: compiled outside the capture, then `reps` calls cycling
    through `copies` replayed from one CUDA graph (launch gaps would hide the kernel's own
    time), the graph replayed once untimed first."""
    call(copies[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(copies[i % len(copies)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
