"""Serving: engine slots, the scheduler loop's streams and faults, on the CPU in float32 (its chunks:
test_serve_chunks.py; the load benchmark: test_load.py).

Exactness is judged by the reference's own greedy loop run over each request alone; faults are
injected while other streams speak, and those streams' tokens must not change."""

import pytest
import torch

from workflow import traffic
from workflow.engines import load_engine
from workflow.engines.slots import Slots, batch_bucket, step_bucket
from workflow.generate import Ids, Sampling
from workflow.hfckpt import load_hf_state
from workflow.reference import MossSpeechReference, greedy_reference
from workflow.serve.request import Request, ServeConfig
from workflow.serve.scheduler import Scheduler
from workflow.spec import load_spec

GREEDY = ServeConfig(chunk_tokens=3, prefill_tokens=64, hold_speech=False, sampling=Sampling(greedy=True))


@pytest.fixture(scope="module")
def ref(tiny_hf):
    return MossSpeechReference(load_spec(tiny_hf), load_hf_state(tiny_hf), torch.float32, "cpu")


@pytest.fixture(params=[False, True], ids=["text_in_step", "deferred_text_fill"])
def engine(request, tiny_engine_dir):
    e = load_engine(tiny_engine_dir)  # 4 slots
    e.defer_text_fill = request.param
    return e


def requests(ids: Ids, n: int = 7) -> list[Request]:
    """Prompts of different lengths ending in either mode, replies of different lengths."""
    seqs = traffic.batch(n, 40, ids, seed=61)
    return [Request(i, seqs[i, : 16 + 3 * i], max_steps=10 + 4 * (i % 3)) for i in range(n)]


def serve(engine, reqs: list[Request], arrive_every: int = 2, cfg: ServeConfig = GREEDY, fault=None) -> Scheduler:
    """Submit request i at iteration arrive_every * i; iterate until all are done. fault(sched,
    iteration) runs before each iteration."""
    sched = Scheduler(engine, Ids.of(engine.spec), cfg)
    it = 0
    while it <= arrive_every * (len(reqs) - 1) or not sched.idle():
        for i, req in enumerate(reqs):
            if arrive_every * i == it:
                sched.submit(req)
        if fault:
            fault(sched, it)
        sched.iterate()
        it += 1
        assert it < 500
    return sched


def test_streams_joining_and_leaving_match_the_reference_alone(engine, ref):
    """Seven requests through four slots: they join at different steps, prompts of different
    lengths in both modes, leave after different reply lengths (slots reused, rows moved); each
    request's tokens and modes are what the reference's greedy loop gives it alone."""
    ids = Ids.of(engine.spec)
    reqs = requests(ids)
    sched = serve(engine, reqs)
    assert all(r.error is None for r in sched.done)
    modes = set()
    for r in reqs:
        want, _ = greedy_reference(ref, r.prompt, r.max_steps, ids, GREEDY.sampling.repetition_penalty)
        assert [(t, a, m) for (t, a), m in zip(r.tokens, r.modes, strict=True)] == want, r.rid
        modes |= set(r.modes)
    assert modes == {True, False}  # text-mode and audio-mode streams shared steps


class GraphKeys:
    """Stands in for the engine's CUDA graphs on the CPU: records each key asked for, runs fn."""

    def __init__(self, engine):
        self.graphs: dict = {}
        engine.use_graphs, engine.graphs = True, self
        engine._run = lambda tokens, key, fn: self.run((tuple(tokens.shape), *key), lambda: fn(tokens))

    def run(self, key, fn):
        self.graphs.setdefault(key, True)
        return fn()


def test_graphs_captured_ahead_are_every_one_serving_meets(engine, tiny_engine_dir):
    """`capture` prepares every graph a serving run then asks for (a key first met mid-load is a
    capture, or a compile, that stalls every stream), and leaves no trace: the streams' tokens
    are those of an engine that captured nothing."""
    ids = Ids.of(engine.spec)
    keys = GraphKeys(engine)
    reqs = requests(ids)
    lengths = [len(r.prompt) for r in reqs]
    assert engine.capture(engine.max_batch, min(lengths), [(1, n) for n in lengths]) == len(keys.graphs) > 0
    ahead = set(keys.graphs)
    serve(engine, reqs)
    assert set(keys.graphs) == ahead
    plain = load_engine(tiny_engine_dir)
    plain.defer_text_fill = engine.defer_text_fill
    again = requests(ids)
    serve(plain, again)
    assert [r.tokens for r in reqs] == [r.tokens for r in again]
    with pytest.raises(ValueError, match="capture: 1 slot"):
        engine.admit([0], reqs[0].prompt[None])
        engine.capture(rows=4, shortest=16)


def test_admissions_are_captured_from_the_engines_own_step_and_decode_steps_from_the_eager_one(tiny_engine_dir):
    """With `compile` the engine's own layer step is torch.compile'd: `capture` makes admission graphs from it
    (a few shapes, each at hundreds of rows, where eager ops between the matmuls cost about what they do)
    and decode's from the eager step (hundreds of shapes, a compile each). The engine's step stood in for
    by a counting one on the CPU: it ran every admission's prompt rows and no decode step's."""
    engine = load_engine(tiny_engine_dir)
    GraphKeys(engine)
    rows: list[int] = []
    for layer in engine.layers:
        own = layer.step
        layer.step = lambda x, *a, own=own, **k: rows.append(x.shape[1]) or own(x, *a, **k)
    engine.capture(2, 8, [(1, 12), (2, 12)])
    assert rows and set(rows) == {12}  # every layer, each admission (with and without the text head), none at 1 row


def test_slots_bookkeeping_refuses_what_it_cannot_do():
    slots = Slots(max_batch=3, max_seq_len=8)
    assert slots.admit([2, 0], 5) == range(0, 2)
    for bad, match in (([2], "hold a stream"), ([3], "outside 0..2"), ([1, 1], "distinct")):
        with pytest.raises(ValueError, match=match):
            slots.admit(bad, 4)
    with pytest.raises(ValueError, match="does not fit a slot of 8"):
        slots.admit([1], 9)
    for bad in ([1], [0, 0]):
        with pytest.raises(ValueError, match="not distinct active ones"):
            slots.rows(bad)
    assert slots.rows([0, 2]) == [1, 0] and slots.rows([0]) == [1]
    slots.stepped([1], filled=[1])
    assert slots.front([2]) == [] and slots.front([0]) == [(0, 1)]  # slot 0's row to the front
    assert slots.row_of == {0: 0, 2: 1} and slots.length == [6, 5] and slots.filled == [6, 5]
    assert slots.release([2]) == []  # the last row: nothing moves
    assert slots.row_of == {0: 0} and slots.length == [6]
    with pytest.raises(ValueError, match="hold no stream"):
        slots.release([2])
    slots.stepped([0])
    slots.stepped([0])
    assert slots.length == [8] and slots.filled == [6]
    with pytest.raises(ValueError, match="reached the engine's max_seq_len 8"):
        slots.rows([0])
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 4, 5, 7, 9, 13, 100, 200)] == [1, 2, 3, 4, 6, 8, 12, 16, 128, 256]
    assert batch_bucket(5, 5) == 5
    assert [step_bucket(n, 40) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 33)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 40]


def test_faults_under_load_leave_the_other_streams_unchanged(tiny_engine_dir):
    """Refusals (an id outside the vocabulary, a reply longer than a slot, every slot busy), a
    cancel part-way and a NaN in one stream's logits, while other streams speak: each ends
    alone, with its reason, and the rest speak exactly what they speak without it."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    clean = serve(engine, requests(ids, 4))
    want = {r.rid: r.tokens for r in clean.done}

    reqs = requests(ids, 4)
    oov = Request(10, reqs[0].prompt.clone(), max_steps=5)
    oov.prompt[3, 0] = engine.spec.vocab_size + 7
    too_long = Request(11, reqs[0].prompt, max_steps=engine.max_seq_len)
    victim = Request(12, reqs[1].prompt, max_steps=30)
    poisoned = Request(13, reqs[2].prompt, max_steps=30)
    step = engine.step

    def nan_in_one(slots, tokens, need_text):
        text, audio = step(slots, tokens, need_text)
        if poisoned.error is None and poisoned.slot in slots and len(poisoned.tokens) == 4:
            audio[list(slots).index(poisoned.slot), 5] = float("nan")
        return text, audio

    engine.step = nan_in_one

    def fault(sched, it):
        if it == 1:
            for bad in (oov, too_long, victim):
                sched.submit(bad)
        if it == 3:
            sched.submit(poisoned)
        if it == 6:
            sched.cancel(victim.rid)
            assert victim.slot not in sched.streams and victim.slot not in engine.active()

    sched = serve(engine, reqs, fault=fault)
    for r in reqs:
        assert r.error is None and r.tokens == want[r.rid], r.rid
    assert oov.error.startswith("refused: text id") and "outside the text vocabulary" in oov.error
    assert too_long.error.startswith("refused: prompt 16 + reply") and "exceed a slot's" in too_long.error
    assert victim.error == "cancelled" and len(victim.tokens) < victim.max_steps
    assert poisoned.error == "failed: non-finite logits at step 4" and len(poisoned.tokens) == 4
    assert not engine.active() and len(sched.done) == 8

    full = Scheduler(engine, ids, ServeConfig(when_full="refuse", hold_speech=False, sampling=Sampling(greedy=True)))
    for r in requests(ids, 5):
        full.submit(r)
    assert full.done[-1].error == "refused: all 4 slots are busy" and len(full.queue) == 4
    capped = Scheduler(engine, ids, ServeConfig(when_full="refuse", max_streams=2, sampling=Sampling(greedy=True)))
    assert [capped.submit(r) for r in requests(ids, 3)] == [True, True, False]  # max_streams caps it too
    assert capped.done[-1].error == "refused: all 2 slots are busy"
