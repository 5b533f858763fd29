"""Graphs on fewer SMs (greenctx.py, `Graphs.confine`, `TorchEngine.confine`, `benchmark.load.decode_sms` and
`later_sms`; the codec's later lane in tests/test_codec_batch.py): a graph runs on the SMs of the stream it was
captured on, the engine serves the same tokens with its decode confined, and what cannot be confined is refused.
The CUDA parts run on the GPU machine only: `pytest tests/test_greenctx.py`."""

import gc
import sys

import pytest
import torch

from workflow import traffic
from workflow.cudagraphs import CONFINED, Graphs
from workflow.engines import load_engine
from workflow.engines.torch_engine import decode_work
from workflow.generate import Ids, Sampling
from workflow.greenctx import green_stream
from workflow.serve import load
from workflow.serve.request import Request, ServeConfig
from workflow.serve.scheduler import Scheduler

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_green_stream_without_cuda_python_names_the_setting_and_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as where cuda-bindings is not installed
    with pytest.raises(RuntimeError, match=r"^benchmark\.load\.decode_sms: .*pip install cuda-bindings"):
        green_stream(torch.device("cuda"), 64, -2, "benchmark.load.decode_sms")


def test_the_load_refuses_counts_of_sms_it_cannot_apply(tiny_engine_dir):
    """A negative count as the config is read; `decode_sms` for an engine with no `confine` (TensorRT-LLM's) and
    `later_sms` with no detokenizer, before any graph is made. The torch engine off CUDA has no graphs to confine:
    its decode runs where it runs."""
    with pytest.raises(ValueError, match=r"benchmark\.load: decode_sms -8"):
        load.LoadConfig.from_dict({"decode_sms": -8})
    with pytest.raises(ValueError, match=r"benchmark\.load: later_sms -1"):
        load.LoadConfig.from_dict({"later_sms": -1})
    engine = type("Engine", (), {"device": torch.device("cpu"), "active": lambda self: []})()
    with pytest.raises(ValueError, match=r"benchmark\.load\.decode_sms: Engine has no graphs to run on fewer SMs"):
        load.prepare(engine, None, load.LoadConfig(decode_sms=64), 5)
    with pytest.raises(ValueError, match=r"later_sms: a run with no detokenizer has no graphs to run"):
        load.prepare(load_engine(tiny_engine_dir), None, load.LoadConfig(later_sms=64), 5)  # no detokenizer
    try:
        made = load.prepare(load_engine(tiny_engine_dir), None, load.LoadConfig(decode_sms=64), 5)
        assert made["decode_sms"] == made["later_sms"] == 0
    finally:
        gc.unfreeze()


def test_decode_work_is_the_steps_and_catch_ups_not_the_admissions():
    assert decode_work(((4, 1, 2), "step", True, 128, False)) and decode_work(("catch-up", 4, 16, 256))
    assert not decode_work(((1, 512, 2), "admit", True, False)) and not decode_work("matmul")


def sm_ids_kernel():
    """A Triton kernel writing each program's SM (%smid) to out[program]."""
    import triton
    import triton.language as tl

    @triton.jit
    def sm_ids(out):
        pid = tl.program_id(0)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out + pid, sm)

    return sm_ids


@needs_cuda
def test_a_graph_runs_on_the_sms_of_the_stream_it_was_captured_on():
    """Thousands of programs, each noting its SM: eager on a green stream of 32 SMs, and from a graph `confine`
    put on that stream but replayed on the default stream, they ran on at most 32 SMs; from a graph captured on
    a stream of the whole GPU, on more. Asked again for as many, `confine` keeps its context; `confine(0)` puts
    the chosen keys back on the whole GPU."""
    device = torch.device("cuda")
    kernel, total = sm_ids_kernel(), torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(64 * total, dtype=torch.int32, device=device)

    def launch() -> torch.Tensor:
        kernel[(out.numel(),)](out)
        return out

    def used() -> int:
        torch.cuda.synchronize()
        return len(out.unique())

    graphs = Graphs(device)
    assert 32 <= graphs.confine(32, lambda key: key == "confined") < total
    green = graphs.green
    assert green.asked == 32 and graphs.confine(32, lambda key: key == "confined") == green.sms and graphs.green is green
    with torch.cuda.stream(green.stream):
        launch()
    assert used() <= green.sms
    graphs.run("confined", launch)
    assert used() <= green.sms
    graphs.run("whole", launch)
    assert used() > green.sms
    graphs.run("confined", launch)
    assert used() <= green.sms and set(graphs.capture) == {CONFINED, -2}
    assert graphs.confine(0, lambda key: key == "confined") == 0
    assert "confined" not in graphs.graphs and CONFINED not in graphs.capture and graphs.green is None
    graphs.run("confined", launch)
    assert used() > green.sms


@needs_cuda
def test_a_graph_the_green_context_cannot_make_names_the_setting():
    """Work that fails only as it is captured on the green stream (as a launch the green context refuses would:
    H200, `later_sms` 64 at the true shape) ends in one line naming the setting, the key and the SMs; the same
    failure in a whole-GPU graph is left as it is."""
    device = torch.device("cuda")
    x = torch.zeros(8, device=device)

    def fails_in_capture() -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("CUDA error: refused\nmore lines")
        return x + 1

    graphs = Graphs(device)
    sms = graphs.confine(32, lambda key: key == "confined", setting="benchmark.load.later_sms")
    said = rf"^benchmark\.load\.later_sms: confined's graph on {sms} SMs failed: CUDA error: refused$"
    with pytest.raises(RuntimeError, match=said):
        graphs.run("confined", fails_in_capture)
    with pytest.raises(RuntimeError, match=r"^CUDA error: refused\nmore lines$"):
        Graphs(device).run("whole", fails_in_capture)


def serve_all(engine) -> list[list[int]]:
    """Seven greedy requests through the engine's four slots, arriving two iterations apart: their tokens."""
    ids = Ids.of(engine.spec)
    seqs = traffic.batch(7, 40, ids, seed=61)
    reqs = [Request(i, seqs[i, : 16 + 3 * i], max_steps=10 + 4 * (i % 3)) for i in range(7)]
    sched = Scheduler(engine, ids, ServeConfig(chunk_tokens=3, prefill_tokens=64, sampling=Sampling(greedy=True)))
    it = 0
    while it <= 12 or not sched.idle():
        if it % 2 == 0 and it // 2 < len(reqs):
            sched.submit(reqs[it // 2])
        sched.iterate()
        it += 1
        assert it < 500
    return [r.tokens for r in reqs]


@needs_cuda
def test_the_engine_serves_the_same_tokens_with_its_decode_confined(tiny_engine_dir):
    """Its decode steps and text catch-ups captured on a green context of 32 SMs (the graphs made before dropped),
    its admissions not; the tokens as on the whole GPU; and back on it with `confine(0)`."""
    engine = load_engine(tiny_engine_dir, device="cuda")
    engine.defer_text_fill = True  # audio steps hold the text branch: catch-ups run too
    whole = serve_all(engine)
    assert any(decode_work(k) for k in engine.graphs.graphs)
    assert engine.confine(32) >= 32 and not any(decode_work(k) for k in engine.graphs.graphs)
    assert serve_all(engine) == whole
    pool = engine.graphs.capture[CONFINED][1]
    made = {k: g.pool() == pool for k, (g, _, _) in engine.graphs.graphs.items()}
    assert made and all(confined == decode_work(k) for k, confined in made.items())  # admissions on the whole GPU
    assert engine.confine(32) >= 32 and engine.graphs.graphs.keys() == made.keys()  # no change: nothing dropped
    assert engine.confine(0) == 0 and CONFINED not in engine.graphs.capture
    assert serve_all(engine) == whole
