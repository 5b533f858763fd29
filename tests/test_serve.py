"""Serving: engine slots, the scheduler loop and the load benchmark, on the CPU in float32.

Exactness is judged by the reference's own greedy loop run over each request alone; faults are
injected while other streams speak, and those streams' tokens must not change."""

import pytest
import torch

from workflow import report, traffic, vocoder
from workflow.detokenize import Batched, Piece
from workflow.engines import load_engine
from workflow.engines.slots import Slots, batch_bucket
from workflow.generate import Ids, Sampling
from workflow.hfckpt import load_hf_state
from workflow.reference import MossSpeechReference, greedy_reference
from workflow.serve import load
from workflow.serve.request import Request, ServeConfig
from workflow.serve.scheduler import Scheduler
from workflow.spec import PRESETS, load_spec

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


def test_slots_bookkeeping_refuses_what_it_cannot_do():
    slots = Slots(max_batch=3, max_seq_len=8)
    assert slots.admit([2, 0], 5) == range(0, 2)
    for bad, match in (([2], "hold a stream"), ([3], "outside 0..2"), ([1, 1], "distinct")):
        with pytest.raises(ValueError, match=match):
            slots.admit(bad, 4)
    with pytest.raises(ValueError, match="does not fit a slot of 8"):
        slots.admit([1], 9)
    with pytest.raises(ValueError, match="not the active ones"):
        slots.rows([2])
    assert slots.rows([0, 2]) == [1, 0]
    assert slots.release([2]) == [(1, 0)]  # the last row moves into the freed one
    assert slots.row_of == {0: 0} and slots.length == [5]
    with pytest.raises(ValueError, match="hold no stream"):
        slots.release([2])
    slots.stepped(filled=False)
    slots.stepped(filled=False)
    slots.stepped(filled=False)
    assert slots.length == [8] and slots.filled == [5]
    with pytest.raises(ValueError, match="reached the engine's max_seq_len 8"):
        slots.rows([0])
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 4, 5, 7, 9, 13, 100, 200)] == [1, 2, 3, 4, 6, 8, 12, 16, 128, 256]
    assert batch_bucket(5, 5) == 5


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


def test_chunks_go_out_every_k_codes_and_the_rest_at_the_end(tiny_engine_dir):
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    prompt = traffic.speech_prompt(1, 20, ids, seed=3)[0]
    req = Request(0, prompt, max_steps=11, reply_codes=11)
    got: list[tuple[list[int], int, bool]] = []
    cfg = ServeConfig(chunk_tokens=4, sampling=Sampling(greedy=True))

    def detokenize(pieces, urgent):
        got.extend((p.codes.tolist(), p.done, p.last) for p in pieces)
        return (lambda wait: 1.0), [7 * len(p.codes) for p in pieces]

    sched = Scheduler(engine, ids, cfg, detokenize=detokenize)
    sched.submit(req)
    while not sched.idle():
        sched.iterate()
    assert req.error is None and len(req.codes) == 11 and all(req.modes)  # hold_speech: no end-of-speech before 11
    assert [(d, last) for _, d, last in got] == [(0, False), (4, False), (8, True)] and req.chunk_codes == [4, 4, 3]
    assert [c for chunk, _, _ in got for c in chunk] == req.codes and req.chunk_samples == [28, 28, 21]


@pytest.mark.parametrize("end", ["whole_chunk", "cancelled"])
def test_a_stream_says_which_chunk_is_its_last(tiny_engine_dir, end):
    """A detokenizer with lookahead holds codes back until it hears of the stream's end: a reply
    that ends on a whole chunk marks that chunk last; a stream cancelled part-way sends an empty
    last chunk (its unsent codes are dropped)."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    req = Request(0, traffic.speech_prompt(1, 20, ids, seed=3)[0], max_steps=8, reply_codes=8)
    got: list[tuple[int, int, bool]] = []

    def detokenize(pieces, urgent):
        got.extend((len(p.codes), p.done, p.last) for p in pieces)
        return (lambda wait: 1.0), [len(p.codes) for p in pieces]

    sched = Scheduler(engine, ids, ServeConfig(chunk_tokens=4, sampling=Sampling(greedy=True)), detokenize=detokenize)
    sched.submit(req)
    for _ in range(6 if end == "cancelled" else 100):
        sched.iterate()
        if sched.idle():
            break
    if end == "cancelled":
        sched.cancel(0)
    sched.flush()
    assert req.stamped and len(req.chunk_ready) == len(got)
    if end == "cancelled":
        assert req.error == "cancelled" and 4 < len(req.codes) < 8 and got == [(4, 0, False), (0, 4, True)]
    else:
        assert (req.error, len(req.codes)) == (None, 8) and got == [(4, 0, False), (4, 4, True)]


@pytest.mark.parametrize("apart", [False, True], ids=["first_chunks_batched", "first_chunks_apart"])
def test_the_loop_never_waits_for_the_detokenizer(tiny_engine_dir, apart):
    """Chunks whose PCM is not known to be ready leave the loop going: two batches run at once,
    later chunks wait and go together; all are stamped, in the order made, once their ready
    times are known (flush sends what waits and waits for it). With `first_chunks_apart` the
    streams' first chunks go at once, on the urgent lane, and do not count among the two."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=i)[0], max_steps=17, reply_codes=17) for i in range(2)]
    batches: list[tuple[int, bool]] = []

    def detokenize(pieces, urgent):
        t = float(len(batches))
        batches.append((len(pieces), urgent))
        return (lambda wait: t if wait else None), [len(p.codes) for p in pieces]  # never known until asked to wait

    cfg = ServeConfig(chunk_tokens=4, first_chunks_apart=apart, sampling=Sampling(greedy=True))
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize)
    for r in reqs:
        sched.submit(r)
    while not sched.idle():
        sched.iterate()
    sent = [(2, apart), (2, False)] + ([(2, False)] if apart else [])
    assert batches == sent and len(sched.outbox) == 2 * (5 - len(sent))  # the rest of 5 chunks a stream wait
    assert all(r.error is None and len(r.codes) == 17 and not r.stamped and not r.chunk_ready for r in reqs)
    sched.flush()
    assert batches == [*sent, (len(sched.done) * (5 - len(sent)), False)] and not sched.outbox
    assert all(r.stamped and r.chunk_codes == [4, 4, 4, 4, 1] for r in reqs)
    ready = [float(i) for i in range(len(sent))] + [float(len(sent))] * (5 - len(sent))
    assert reqs[0].chunk_ready == reqs[1].chunk_ready == ready


def test_chunks_go_urgent_until_a_stream_has_a_chunks_audio(tiny_engine_dir):
    """As the codec decoder with a short first hop: a first chunk whose PCM is half a chunk's audio
    sends the stream's second chunk on the urgent lane too (its deadline is half a chunk away); from
    the third on, chunks wait for the other lane. A first chunk of a whole chunk's audio (the
    stand-in's) sends only itself there."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)

    class Detokenizer:
        sample_rate = 100.0  # a chunk of 4 codes: 0.32 s, 32 samples
        first_codes = 4

        def __init__(self, first: int) -> None:
            self.first, self.sent = first, []

        def __call__(self, pieces, urgent):
            self.sent += [(p.done, urgent) for p in pieces]
            return (lambda wait: 1.0), [self.first if p.done == 0 else 8 * len(p.codes) for p in pieces]

    for first, urgent in ((16, [True, True, False, False]), (32, [True, False, False, False])):
        detok = Detokenizer(first)
        sched = Scheduler(engine, ids, ServeConfig(chunk_tokens=4, sampling=Sampling(greedy=True)), detokenize=detok)
        assert sched.chunk_audio == 32
        sched.submit(Request(0, traffic.speech_prompt(1, 20, ids, seed=3)[0], max_steps=16, reply_codes=16))
        while not sched.idle():
            sched.iterate()
        sched.flush()
        assert [d for d, _ in detok.sent] == [0, 4, 8, 12] and [u for _, u in detok.sent] == urgent, first


@pytest.mark.parametrize("hold", [1, 3])
def test_a_speaking_streams_later_chunks_wait_until_hold_of_them_do(tiny_engine_dir, hold):
    """`detokenize_hold`: a stream's chunks after the urgent first go together once `hold` of them
    wait (one codec flow call decodes them), and all that wait go when the stream ends; with 1, each
    goes as it is made."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    sent: list[tuple[list[int], bool]] = []

    def detokenize(pieces, urgent):
        sent.append(([p.done for p in pieces], urgent))
        return (lambda wait: 1.0), [len(p.codes) for p in pieces]  # every chunk its whole audio

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, detokenize_hold=hold, sampling=Sampling(greedy=True))
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize)
    req = Request(0, traffic.speech_prompt(1, 20, ids, seed=3)[0], max_steps=22, reply_codes=22)
    sched.submit(req)
    while not sched.idle():
        sched.iterate()
    sched.flush()
    assert req.error is None and req.stamped and req.chunk_codes == [4, 4, 4, 4, 4, 2]
    later = [[4], [8], [12], [16], [20]] if hold == 1 else [[4, 8, 12], [16, 20]]
    assert sent == [([0], True)] + [(d, False) for d in later]


@pytest.mark.parametrize("slack", [0.0, 0.3])
def test_a_held_chunk_goes_sooner_when_its_playback_is_near(tiny_engine_dir, slack):
    """`detokenize_slack_s`: with a hold of 5 chunks, a stream made only 1.6 x faster than it plays
    (a code each 50 ms of the clock, 80 ms of audio) waits for chunks past its audio's end and
    underruns; with 0.3 s of slack its held chunks go once the first would play within 0.3 s, in
    more than one batch before its end, and none is late (the detokenizer here is ready at once)."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    now, sent = [0.0], []

    def detokenize(pieces, urgent):
        at = now[0]
        sent.append(([p.done for p in pieces], urgent))
        return (lambda wait: at), [len(p.codes) for p in pieces]  # a code's PCM a "sample": 12.5 a second

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, detokenize_hold=5, detokenize_slack_s=slack,
                      sampling=Sampling(greedy=True))  # fmt: skip
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=lambda: now[0])
    req = Request(0, traffic.speech_prompt(1, 20, ids, seed=3)[0], max_steps=30, reply_codes=30)
    sched.submit(req)
    while not sched.idle():
        sched.iterate()
        now[0] += 0.05
    sched.flush()
    assert req.error is None and req.stamped and sent[0] == ([0], True)
    late, _ = load.underruns(req, 12.5)
    if slack:
        assert late == 0 and len(sent) > 3 and all(len(d) < 5 for d, _ in sent[1:-1])
    else:
        assert late > 0 and [len(d) for d, _ in sent[1:]] == [5, 2]


@pytest.mark.parametrize("first", [False, True])
def test_later_chunks_wait_while_a_stream_awaits_its_first_audio(tiny_engine_dir, first):
    """`first_audio_first`: stream 1 speaks 8 x faster than it plays; stream 2 arrives later, and its first
    chunk's PCM takes 0.1 s of the clock. Meanwhile stream 1's later chunks, far from due, wait (with
    it off they go as made); once stream 2's first PCM is ready they go together. Neither underruns. It
    needs a slack: without one a held chunk could wait past its due time."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    now, sent = [0.0], []

    def detokenize(pieces, urgent):
        at = now[0] + (0.1 if urgent and pieces[0].stream == 2 else 0.0)
        sent.append((now[0], [(p.stream, p.done) for p in pieces], urgent))
        return (lambda wait: at if wait or now[0] >= at else None), [len(p.codes) for p in pieces]

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, detokenize_slack_s=0.3, first_audio_first=first,
                      sampling=Sampling(greedy=True))  # fmt: skip
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=lambda: now[0])
    reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=i)[0], max_steps=40, reply_codes=40) for i in (1, 2)]
    sched.submit(reqs[0])
    for it in range(200):
        if it == 12:
            sched.submit(reqs[1])
        if sched.idle():
            break
        sched.iterate()
        now[0] += 0.01
    sched.flush()
    first_pcm = reqs[1].ttfa_s  # its arrival: 0 (the scheduler's clock starts there)
    waiting = [t for t, chunks, urgent in sent if not urgent and 0.12 <= t < first_pcm and any(k == 1 for k, _ in chunks)]
    assert 0.22 < first_pcm < 0.3 and all(r.error is None and r.stamped for r in reqs)  # its first chunk, + 0.1 s
    assert (not waiting) == first  # stream 1's later chunks sent while stream 2 awaited its first PCM
    if first:  # then they go together, at the first iteration that sees it ready
        after = next(chunks for t, chunks, urgent in sent if not urgent and t >= first_pcm)
        assert len([k for k, _ in after if k == 1]) > 1
    assert all(load.underruns(r, 12.5)[0] == 0 for r in reqs)
    with pytest.raises(ValueError, match="needs detokenize_slack_s"):
        Scheduler(engine, ids, ServeConfig(first_audio_first=True))


def paced(engine, pace: float, second_at: float | None = None) -> tuple[list[Request], list[tuple[float, int]], bool]:
    """Stream 1 (60 codes: 4.8 s of audio), and stream 2 arriving at `second_at`, served on a clock of
    10 ms an iteration (racing: 8 x real time), with `pace` and a lead of 0.4 s; the detokenizer is ready
    at once, a code's PCM a "sample". Returns the requests, (time, stream 1's codes) at each iteration
    that decoded, and whether any iteration waited (iterate False while wait_s > 0)."""
    ids = Ids.of(engine.spec)
    now = [0.0]

    def detokenize(pieces, urgent):
        at = now[0]
        return (lambda wait: at), [len(p.codes) for p in pieces]

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, pace=pace, pace_lead_s=0.4, sampling=Sampling(greedy=True))
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=lambda: now[0])
    reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=i)[0], max_steps=60, reply_codes=60, t_arrival=0.0) for i in (1, 2)]
    sched.submit(reqs[0])
    made, waited = [], False
    while not sched.idle() or (second_at is not None and reqs[1].slot is None):
        if second_at is not None and reqs[1].slot is None and now[0] >= second_at and reqs[1] not in sched.queue:
            reqs[1].t_arrival = now[0]
            sched.submit(reqs[1])
        waits = sched.wait_s() > 0
        decoded = sched.iterate()
        assert decoded != waits
        waited |= waits
        if decoded:
            made.append((now[0], len(reqs[0].codes)))
        now[0] += 0.01
        assert now[0] < 10
    sched.flush()
    return reqs if second_at is not None else reqs[:1], made, waited


@pytest.mark.parametrize("pace", [0, 2])
def test_a_paced_stream_is_made_at_pace_times_real_time_past_a_lead(tiny_engine_dir, pace):
    """`pace`: once its first PCM is ready, a stream is decoded only while the audio its codes make is
    under lead + pace x its playback so far: it never runs more than a code past that, never runs out,
    and its 4.8 s reply is made in about (4.8 - 0.4) / 2 s from its first PCM, not 0.6 s; its codes are
    the unpaced stream's (a pause leaves its cache as it was). Without pace no iteration waits."""
    engine = load_engine(tiny_engine_dir)
    (req,), made, waited = paced(engine, pace)
    (alone,), _, _ = paced(load_engine(tiny_engine_dir), 0)
    start = req.playback_start
    assert req.error is None and req.stamped and req.codes == alone.codes and load.underruns(req, 12.5)[0] == 0
    assert waited == bool(pace)
    last = next(t for t, n in made if n == 60)  # when its last code was sampled
    if pace:
        assert all(n <= (0.4 + pace * max(0.0, t - start)) / 0.08 + 1 for t, n in made if t >= start)
        assert abs(last - start - (4.8 - 0.4) / pace) < 0.1
    else:
        assert last - start < 0.65


def test_a_stream_awaiting_its_first_audio_is_decoded_at_once_beside_paced_ones(tiny_engine_dir):
    """Stream 2 arrives while stream 1 is paced: it is decoded every iteration until its first PCM (its
    time to first audio what it is alone), and stream 1, stepped with it, gets a code each iteration
    meanwhile."""
    reqs, made, _ = paced(load_engine(tiny_engine_dir), 2, second_at=1.0)
    (alone,), _, _ = paced(load_engine(tiny_engine_dir), 0)
    assert all(r.error is None and r.stamped and load.underruns(r, 12.5)[0] == 0 for r in reqs)
    assert reqs[1].ttfa_s == pytest.approx(alone.ttfa_s, abs=0.015)
    racing = [n for t, n in made if reqs[1].t_arrival <= t < reqs[1].playback_start]
    assert len(racing) >= 2 and racing == list(range(racing[0], racing[0] + len(racing)))  # a code each 10 ms
    assert len([t for t, _ in made if 0.5 <= t < 1.0]) < 25  # before it, stream 1 paced: not one each 10 ms
    with pytest.raises(ValueError, match=r"pace 0\.5 is under 1"):
        ServeConfig(pace=0.5)


@pytest.mark.parametrize("detok_cap,cfg_cap,cap", [(2, 0, 2), (0, 3, 3), (3, 2, 2), (0, 0, 4)])
def test_no_more_streams_open_than_the_detokenizer_serves(tiny_engine_dir, detok_cap, cfg_cap, cap):
    """A stream is open from its admission until its last chunk is sent, and at most `max_streams`
    are (the detokenizer's, as the codec decoder's flow slots; ServeConfig's; the engine's 4 slots):
    here the detokenizer's batches finish only when waited for, so a finished stream's last chunk
    waits in the outbox, and a request must still not be admitted beside it. All are served."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)

    class Detokenizer:
        def __init__(self) -> None:
            self.max_streams, self.open, self.most = detok_cap, set(), 0

        def __call__(self, pieces, urgent):
            for p in pieces:
                (self.open.discard if p.last else self.open.add)(p.stream)
            self.most = max(self.most, len(self.open))
            return (lambda wait: 1.0 if wait else None), [len(p.codes) for p in pieces]

    detok = Detokenizer()
    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=1, max_streams=cfg_cap, sampling=Sampling(greedy=True))
    sched = Scheduler(engine, ids, cfg, detokenize=detok)
    reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=i)[0], max_steps=10, reply_codes=10) for i in range(6)]
    for req in reqs:
        sched.submit(req)
    speaking = 0
    while not sched.idle():
        sched.iterate()
        speaking = max(speaking, len(sched.streams))
    sched.flush()
    assert speaking == cap and detok.most <= cap and not detok.open
    assert all(r.error is None and r.stamped and sum(r.chunk_codes) == 10 for r in reqs)


def test_streams_open_only_while_the_detokenizer_holds_their_replies(tiny_engine_dir):
    """With a detokenizer that `holds` only so many codes of replies at once (the codec decoder's flow
    pages, `CodecBatch.holds`), a request waits until the open streams' and its own fit, however many
    slots are free; a reply it could never hold is refused with a reason, and so, with when_full:
    refuse, is one that does not fit now. The others are all served."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    reqs = [
        Request(i, traffic.speech_prompt(1, 20, ids, seed=i)[0], max_steps=n, reply_codes=n)
        for i, n in enumerate([10, 8, 12, 6, 9])
    ]
    steps = {r.rid: r.max_steps for r in reqs}

    class Detokenizer:
        def __init__(self) -> None:
            self.open, self.most = set(), 0

        def holds(self, codes: list[int]) -> bool:
            return sum(codes) <= 20

        def __call__(self, pieces, urgent):
            for p in pieces:
                (self.open.discard if p.last else self.open.add)(p.stream)
            self.most = max(self.most, sum(steps[k] for k in self.open))
            return (lambda wait: 1.0 if wait else None), [len(p.codes) for p in pieces]

    detok = Detokenizer()
    sched = Scheduler(engine, ids, ServeConfig(chunk_tokens=4, detokenize_batches=1, sampling=Sampling(greedy=True)), detok)
    huge = Request(9, traffic.speech_prompt(1, 20, ids, seed=9)[0], max_steps=21, reply_codes=21)
    assert [sched.submit(r) for r in [*reqs, huge]] == [True] * 5 + [False]
    assert huge.error == "refused: a reply of 21 codes is more than the detokenizer's flow slots hold"
    most = 0
    while not sched.idle():
        sched.iterate()
        most = max(most, sum(r.max_steps for r in sched.streams.values()))
    sched.flush()
    assert most <= 20 and detok.most <= 20 and not detok.open  # 10 + 8 first; 12 waited for 8 codes to free
    assert all(r.error is None and r.stamped and sum(r.chunk_codes) == r.max_steps for r in reqs)
    refusing = Scheduler(engine, ids, ServeConfig(when_full="refuse", sampling=Sampling(greedy=True)), Detokenizer())
    assert [refusing.submit(r) for r in reqs[:3]] == [True, True, False]  # 10 + 8 fit, 12 more does not
    assert reqs[2].error == "refused: the detokenizer's flow slots hold no more replies now"


def test_serving_detokenizer_batches_chunks_by_frame_count():
    """One vocoder call per mel length, the batch padded to its bucket; each chunk's mel at its
    own offset (the CPU: in line, stamped by the clock after it)."""
    calls = []
    mel = vocoder.MelStandIn(16, 4, 100.0 / 0.96, torch.device("cpu"))  # 104.2 frames a second: 8 or 9 a code
    detok = Batched(mel, lambda m: calls.append(m.clone()), 9, torch.device("cpu"), lambda n: 4, lambda: 7.0)
    assert detok.sample_rate == pytest.approx(9 / 0.08)
    codes = [
        torch.tensor([1, 2, 3, 4, 5]),
        torch.tensor([6, 7, 8, 9, 10]),
        torch.tensor([11, 12]),
        torch.tensor([], dtype=torch.long),
    ]
    ready, samples = detok([Piece(1, codes[0], 0), Piece(2, codes[1], 5), Piece(3, codes[2], 0), Piece(2, codes[3], 10, True)])
    assert ready(False) == 7.0 and samples == [45, 45, 18, 0]  # an empty last piece vocodes nothing
    frames = sorted(c.shape[-1] for c in calls)
    assert len(calls) == 2 and frames == [mel.frames(2), mel.frames(5)] and all(c.shape[0] == 4 for c in calls)
    five = next(c for c in calls if c.shape[-1] == mel.frames(5))
    assert torch.equal(five[0], mel(codes[0][None], 0)[0]) and torch.equal(five[1], mel(codes[1][None], 5)[0])


def test_underruns_count_chunks_ready_after_playback_ran_out():
    req = Request(0, torch.zeros(1, 2, dtype=torch.long), max_steps=1)
    req.chunk_ready, req.chunk_samples = [1.0, 1.3, 1.9, 2.0], [40, 40, 40, 40]  # 100 a second: due at 1.0, 1.4, 1.8, 2.2
    n, stalled = load.underruns(req, 100.0)
    assert n == 1 and stalled == pytest.approx(0.1)
    assert load.playback_end(req, 100.0) == pytest.approx(1.0 + 1.6 + 0.1)


def test_playback_starts_at_the_first_chunk_with_pcm_and_paces_by_samples():
    """The codec decoder's way: no PCM for the first chunk (its lookahead), 0.24 s for the next,
    0.4 s each after: time to first audio is the second chunk's, and each is due when the PCM
    before it has played."""
    req = Request(0, torch.zeros(1, 2, dtype=torch.long), max_steps=1, t_arrival=0.5, t_admit=0.6)
    req.chunk_ready, req.chunk_samples = [0.9, 1.0, 1.3, 1.7], [0, 24, 40, 40]  # due -, 1.0, 1.24, 1.64
    assert req.ttfa_s == pytest.approx(0.5)
    assert load.underruns(req, 100.0) == (2, pytest.approx(0.06 + 0.06))
    assert load.timeline(req, 100.0)["chunk_due"] == pytest.approx([0.5, 0.74, 1.14])


def test_the_load_benchmark_runs_and_answers(tiny_engine_dir):
    """Two closed-loop levels and one Poisson level on the tiny engine: every request served,
    its first audio timed from its arrival, and the answer the largest level within the SLO."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    cfg = load.LoadConfig(closed=(1, 3), rates=(2.0,), duration_s=1.5, reply_seconds=(0.4, 1.2), prompt_len=24, slots=4)
    out = load.run(engine, None, __import__("time").perf_counter, cfg, ids, 5, Sampling())
    assert [(lv["kind"], lv["value"]) for lv in out["levels"]] == [("closed", 1), ("closed", 3), ("open", 2.0)]
    for lv in out["levels"]:
        assert lv["served"] == lv["requests"] > 0 and lv["failed"] == lv["refused"] == 0
        assert 0 < lv["ttfa_ms"]["p50"] <= lv["ttfa_ms"]["p99"] and 0 < lv["busy_fraction"] <= 1
        assert set(lv["device_busy"]) == {"prefill", "sample", "decode"}  # no detokenizer given
        assert 0 < sum(lv["device_busy"].values()) <= lv["busy_fraction"]  # the CPU: its phases are the loop's time
        assert lv["host_busy"] == lv["device_busy"]  # on the CPU the work runs as the host calls it
        it = lv["iteration_ms"]  # each decoding iteration's wall time
        assert it["n"] == lv["iterations"] and 0 < it["p50"] <= it["p99"] <= it["max"] <= 1e3 * lv["wall_s"]
        q = lv["queued_ms"]  # arrival to admission, part of each request's time to first audio
        assert lv["max_streams"] == 4 and q["n"] == lv["served"] and 0 <= q["p50"] <= q["p99"] <= lv["ttfa_ms"]["p99"]
        assert 1 <= lv["peak_streams"] <= min(4, lv["requests"])  # the most open at once, never past the allowed
    assert out["levels"][0]["peak_streams"] == 1  # one user: one reply at a time
    ok = [lv["value"] for lv in out["levels"][:2] if lv["ttfa_ms"]["p99"] <= 200 and not lv["underruns"]]
    assert out["streams_at_slo"] == max(ok, default=0) and out["ttfa_slo_ms"] == 200
    t = out["timeline"]
    assert t["level"] == 3 and 0 <= t["admitted"] <= t["chunk_ready"][0]
    assert load.slot_memory(engine, False)["kv_bytes_per_slot"] == sum(c[0].numel() for c in engine.caches()) * 4
    made = out["prepared"]  # the CPU engine has no graphs to make, and the device no memory to count
    assert made["engine_graphs"] == made["detokenizer_batches"] == made["reserved_bytes"] == 0 and made["seconds"] >= 0
    memory = {"slots": 4, "kv_bytes_per_slot": 1, "max_seq_len": 64}
    rows = [r for r in report.load_markdown(out | {"memory": memory}) if r.startswith(("| closed", "| Poisson"))]
    host = [lv["host_busy"] for lv in sorted(out["levels"], key=lambda lv: (lv["kind"], lv["value"]))]
    assert [r.split(" | ")[8] for r in rows] == [f"{h['decode']:.2f} / {h.get('detokenize', 0.0):.2f}" for h in host]


def test_a_paced_level_makes_each_reply_at_its_pace(tiny_engine_dir):
    """The load's loop with `pace` 2 (its lead 0.4 s): every request served with no underrun, and each
    reply's codes made over (its audio - 0.4 s) / 2 from its first PCM, the loop sleeping meanwhile,
    where unpaced the tiny engine makes them in a fraction of that."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    cfg = load.LoadConfig(closed=(2,), duration_s=1.5, reply_seconds=(1.2, 2.0), prompt_len=24, slots=4, pace=2, pace_lead_s=0.4)
    level = load.Level(cfg, "closed", 2, ids, torch.Generator().manual_seed(5))
    result, done = load.run_level(engine, None, __import__("time").perf_counter, level, 5, Sampling(), progress=False)
    assert result["served"] == result["requests"] > 0 and result["underruns"] == 0
    for req in done:
        paced_s = (len(req.codes) * 0.08 - 0.4) / 2
        assert req.chunk_ready[-1] - req.playback_start > 0.9 * paced_s


def test_load_config_names_an_unknown_key():
    with pytest.raises(ValueError, match=r"benchmark\.load: unknown key"):
        load.LoadConfig.from_dict({"closed": [4], "users": 3})


@pytest.mark.parametrize("most_users", [0, 2, 11, 13, 24, 29, 50, 100, 400])
def test_the_search_pins_streams_at_the_slo_between_a_level_that_held_and_one_that_did_not(most_users):
    """With levels holding the SLO up to `most_users` and no further, the search ends with the
    largest that held at most that, the smallest that failed above it, and the two within
    search_step users or a quarter of the answer; past search_max it stops at search_max."""
    step, most = 4, 256
    held = {n: n <= most_users for n in (4, 8, 16, 32)}
    runs = 0
    while (n := load.next_search_level(held, step, most)) is not None:
        assert n not in held and 0 < n <= most
        held[n], runs = n <= most_users, runs + 1
    lo = max((n for n, ok in held.items() if ok), default=0)
    above = [n for n, ok in held.items() if not ok and n > lo]
    assert lo <= most_users and runs <= 6
    if most_users >= most:
        assert lo == most and not above
    else:
        assert min(above) > most_users and min(above) - lo <= max(step, lo // 4)


def test_the_search_keeps_the_largest_level_that_held_and_searches_above_it():
    """A noisy grid (8 failed, 16 held): the search goes on above 16, not below 8."""
    assert load.next_search_level({4: True, 8: False, 16: True, 32: False}, 4, 256) == 24
    assert load.next_search_level({4: True, 8: True}, 4, 256) == 16  # every level held: twice the largest
    assert load.next_search_level({4: True, 8: True}, 4, 8) is None  # ... up to search_max


def test_the_load_benchmark_searches_past_its_levels(monkeypatch):
    """load.run with search_step: the given levels, then searched ones (marked), each run as any
    level, until streams at the SLO is pinned; the answer is the largest level that held."""
    ran, drawn = [], {}

    def level(engine, detokenize, clock, lv, chunk_tokens, sampling):
        ran.append(lv.value)
        drawn.setdefault(lv.value, []).append((lv.first_arrivals(), lv.new_request(0.0).reply_codes))
        p99 = 150.0 if lv.value <= 21 else 250.0  # 21 users hold the 200 ms SLO, 22 do not
        return {"kind": lv.kind, "value": lv.value, "ttfa_ms": {"p99": p99}, "underruns": 0, "failed": 0,
                "tokens_per_s": 1.0, "busy_fraction": 0.5}, []  # fmt: skip

    monkeypatch.setattr(load, "run_level", level)
    monkeypatch.setattr(load, "prepare", lambda *a: {})
    cfg = load.LoadConfig(closed=(4, 8), search_step=4, search_max=64)
    out = load.run(None, None, lambda: 0.0, cfg, Ids.of(PRESETS["tiny"]), 5, Sampling())
    assert ran == [4, 8, 16, 32, 24, 20] and out["streams_at_slo"] == 20
    assert [lv["searched"] for lv in out["levels"]] == [False, False, True, True, True, True]
    # a level's traffic is its own: 24 users draw the same arrivals and replies given first or searched
    load.run(None, None, lambda: 0.0, load.LoadConfig(closed=(24,)), Ids.of(PRESETS["tiny"]), 5, Sampling())
    assert drawn[24][0] == drawn[24][1] and drawn[16][0] != drawn[24][0][:16]
