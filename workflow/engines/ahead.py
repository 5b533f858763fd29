"""Serving's CUDA graphs made before serving starts, not when a step first meets their shape.

A graph first met mid-load is captured there (its step run three times) or, for the compiled
small batches, compiled (seconds): every stream waits meanwhile, and the load's figures would
time the capture, not the serving. The shapes a load can meet are known from its settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from workflow.engines.slots import step_bucket

if TYPE_CHECKING:
    from workflow.engines.torch_engine import TorchEngine


@torch.no_grad()
def capture(
    engine: TorchEngine, rows: int, shortest: int, admissions: Sequence[tuple[int, int]] = (), catch_up_max: int = 64
) -> int:
    """Capture now the graphs that serving would otherwise capture when it first meets them:
    mid-load, where a capture (or a compile) stalls every stream. Decode: steps of up to `rows`
    active rows at lengths from `shortest` to max_seq_len, each row bucket x attention bucket x
    mode (text head; audio only, holding the text fill when `defer_text_fill`), and the
    catch-up's for R up to `catch_up_max`. Admission: each (prompts, prompt length) given, with
    and without the text head. Decode's from eager steps (a compile per shape costs seconds, and
    there are hundreds); admission's from the engine's own step, compiled where the engine
    compiles: a few shapes, and at hundreds of rows the eager ops between the matmuls cost about
    what the matmuls do (FP8 serving's 512-token admission priced ~20 ms alone, the compiled
    prefill ~8-10: levers.md, "H200 serving priced"). Keys already captured are kept. Only with no
    active slot: the warm-up runs write rows no stream holds, at positions an admit overwrites.
    Returns the graphs captured."""
    from workflow.engines import torch_engine as te  # its module imports this one

    if not engine.use_graphs:
        return 0
    if engine.slots.n:
        raise ValueError(f"capture: {engine.slots.n} slot(s) active; capture before serving")
    if engine.defer_text_fill and engine.held is None:
        engine.held = engine.embedding.new_zeros(engine.max_batch, engine.max_seq_len, engine.spec.hidden_size)
    before = len(engine.graphs.graphs)
    buckets = sorted({step_bucket(n, engine.max_batch) for n in range(1, min(rows, engine.max_batch) + 1)})
    spans = sorted({te.kv_bucket(n, engine.max_seq_len) for n in range(shortest + 1, engine.max_seq_len + 1)})
    modes = [(True, False), (False, engine.defer_text_fill)]
    engine.pos.zero_()
    engine.catch_up_pos.zero_()
    for b, t in admissions:
        engine.admit_rows[:b, 0].copy_(engine.row_ids[:b, 0])
        for need_text in (True, False):
            prefill = engine._prefill(b, t, need_text, False)
            engine._run(torch.zeros(b, t, 2, dtype=torch.long), ("admit", need_text, False), prefill)
    for b in buckets:
        tokens = torch.zeros(b, 1, 2, dtype=torch.long)
        for kv_len in spans:
            for text_head, hold in modes:
                engine._run(tokens, ("step", text_head, kv_len, hold), engine._decode(b, kv_len, text_head, hold, te.layer_step))
            r = te.CATCH_UP_ROWS
            while engine.defer_text_fill and r <= catch_up_max:
                engine._fill_text(b, r, kv_len)
                r *= 2
    return len(engine.graphs.graphs) - before
