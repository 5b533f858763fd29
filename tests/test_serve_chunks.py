"""Serving: the scheduler's chunks to the detokenizer (when they go, held, urgent, last), pace, and
the streams it keeps open for the detokenizer; on the CPU, the tiny engine."""

from collections import Counter

import pytest
import torch

from workflow import traffic, vocoder
from workflow.detokenize import Batched, Piece
from workflow.engines import load_engine
from workflow.generate import Ids, Sampling
from workflow.serve import figures
from workflow.serve.request import Request, ServeConfig
from workflow.serve.scheduler import Scheduler


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
        assert sched.outbox.chunk_audio == 32
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


def test_a_stream_with_join_chunks_waiting_goes_along_with_a_batch_that_goes_anyway(tiny_engine_dir):
    """`detokenize_join`: stream 1 starts two chunks after stream 0, so with a hold of 4 their later
    batches fall apart, one stream each. With a join of 2, stream 1's 2-3 waiting chunks go along with
    stream 0's batch, and the two streams' batches fall together: fewer, wider calls. Every chunk
    goes once, in order."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)

    def later_batches(join: int) -> list[dict[int, int]]:
        sent: list[dict[int, int]] = []  # each later batch: {stream: its chunks}
        done: dict[int, list[int]] = {0: [], 1: []}

        def detokenize(pieces, urgent):
            if not urgent:
                sent.append(dict(Counter(p.stream for p in pieces)))
            for p in pieces:
                done[p.stream].append(p.done)
            return (lambda wait: 1.0), [len(p.codes) for p in pieces]

        cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, detokenize_hold=4, detokenize_join=join,
                          sampling=Sampling(greedy=True))  # fmt: skip
        sched = Scheduler(engine, ids, cfg, detokenize=detokenize)
        reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=3 + i)[0], max_steps=48, reply_codes=48) for i in range(2)]
        sched.submit(reqs[0])
        for _ in range(8):  # stream 0 two chunks ahead
            sched.iterate()
        sched.submit(reqs[1])
        while not sched.idle():
            sched.iterate()
        sched.flush()
        for req in reqs:
            assert req.error is None and req.stamped and done[req.rid] == list(range(0, 48, 4)), (join, req.rid)
        return sent

    apart, together = later_batches(0), later_batches(2)
    assert all(len(b) == 1 and max(b.values()) == 4 for b in apart[:-2]), apart  # one stream each (but the ends)
    assert len(together) < len(apart) and any(len(b) == 2 and min(b.values()) < 4 for b in together), together
    assert sum(len(b) == 2 for b in together) >= 2  # once joined, their batches keep falling together
    with pytest.raises(ValueError, match="detokenize_join 4 is not under detokenize_hold 4"):
        ServeConfig(detokenize_hold=4, detokenize_join=4)


def test_a_later_batch_takes_no_more_of_a_streams_chunks_than_one_flow_call_solves(tiny_engine_dir):
    """A detokenizer whose flow call solves at most 8 codes of a stream (`codes_a_call`, the codec's largest
    `frames_a_call`): while its later batches queue (one at a time, each taking two iterations), a stream's
    waiting chunks pile up past 2, and each later batch takes its first 2 (8 codes), the rest waiting for
    the next; the urgent first chunk is not capped. Every chunk goes once, in order, and the tokens are
    those of a detokenizer with no cap."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)

    def serve(cap: int) -> tuple[list[list[int]], list[int]]:
        sent: list[list[int]] = []

        class Detokenizer:
            codes_a_call = cap

            def __call__(self, pieces, urgent):
                sent.append([p.done for p in pieces] if not urgent else [-1])
                t = len(sent)
                return (lambda wait: 1.0 if wait or len(sent) > t + 1 else None), [len(p.codes) for p in pieces]

        cfg = ServeConfig(chunk_tokens=4, detokenize_batches=1, sampling=Sampling(greedy=True))
        sched = Scheduler(engine, ids, cfg, detokenize=Detokenizer())
        req = Request(0, traffic.speech_prompt(1, 20, ids, seed=3)[0], max_steps=40, reply_codes=40)
        sched.submit(req)
        while not sched.idle():
            sched.iterate()
        sched.flush()
        assert req.error is None and req.stamped
        return sent, req.tokens

    capped, free = serve(8), serve(0)
    later = [b for b in capped[0] if b != [-1]]
    assert max(map(len, later)) == 2 and max(len(b) for b in free[0] if b != [-1]) > 2  # the cap held where it was needed
    assert [d for b in later for d in b] == list(range(4, 40, 4))  # every later chunk once, in order
    assert capped[1] == free[1]


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
    late, _ = figures.underruns(req, 12.5)
    if slack:
        assert late == 0 and len(sent) > 3 and all(len(d) < 5 for d, _ in sent[1:-1])
    else:
        assert late > 0 and [len(d) for d, _ in sent[1:]] == [5, 2]


@pytest.mark.parametrize("least", [0, 36])
def test_a_later_batch_waits_for_least_codes_unless_a_chunk_is_due(tiny_engine_dir, least):
    """`detokenize_least`: three streams made 8 x faster than they play (a code each 10 ms of the clock,
    80 ms of audio), every later chunk free to go (hold 1). Without it a later batch goes as chunks are
    made, a chunk of each stream; with 36, a batch goes only once it takes 36 codes or more, or once a stream's next
    chunk would play within the 0.3 s of slack. So: fewer, wider batches; every chunk once, in order,
    and none late."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    now, later = [0.0], []

    def detokenize(pieces, urgent):
        if not urgent:  # each later batch: its codes, and whether one of its streams was due within the slack
            due = [now[0] + 0.3 >= reqs[p.stream].playback_start + sum(reqs[p.stream].chunk_samples) / 12.5 for p in pieces]
            later.append((sum(len(p.codes) for p in pieces), any(due)))
        return (lambda wait, at=now[0]: at), [len(p.codes) for p in pieces]  # a code's PCM a "sample": 12.5 a second

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, detokenize_slack_s=0.3, detokenize_least=least,
                      sampling=Sampling(greedy=True))  # fmt: skip
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=lambda: now[0])
    reqs = {i: Request(i, traffic.speech_prompt(1, 20, ids, seed=3 + i)[0], max_steps=60, reply_codes=60) for i in range(3)}
    for req in reqs.values():
        sched.submit(req)
    while not sched.idle():
        sched.iterate()
        now[0] += 0.01
    sched.flush()
    for req in reqs.values():
        assert req.error is None and req.stamped and sum(req.chunk_codes) == 60 and figures.underruns(req, 12.5)[0] == 0
    if least:  # the first went short, due (a stream's second chunk); the flush at the end sends what is left
        assert later[0] == (12, True) and all(n >= least for n, _ in later[1:-1]) and len(later) <= 6, later
    else:
        assert len(later) >= 12 and max(n for n, _ in later) == 12, later  # a chunk of each stream as made


@pytest.mark.parametrize("tick", [0.002, 0.004, 0.007])
def test_every_chunk_goes_once_and_in_order_on_a_clock_that_moves_as_it_is_read(tiny_engine_dir, tick):
    """Whether a held chunk is due within the slack reads the clock, which moves between one chunk's
    decision and the next, as a real clock does (here `tick` a read): a stream's waiting chunks are
    decided once, together, so none is lost and none overtakes another. Each lost chunk left its
    request unstamped and a closed level of the load waiting for it forever (an H200 probe)."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    reads, sent = [0], []

    def clock():
        reads[0] += 1
        return reads[0] * tick

    def detokenize(pieces, urgent):
        sent.extend((p.stream, p.done, len(p.codes)) for p in pieces)
        at = clock()
        return (lambda wait: at), [len(p.codes) for p in pieces]  # a code's PCM a "sample": 12.5 a second

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, detokenize_hold=5, detokenize_slack_s=0.3,
                      sampling=Sampling(greedy=True))  # fmt: skip
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=clock)
    reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=3 + i)[0], max_steps=80, reply_codes=80) for i in range(3)]
    for req in reqs:
        sched.submit(req)
    while not sched.idle():
        sched.iterate()
    sched.flush()
    for req in reqs:
        mine = [(done, n) for s, done, n in sent if s == req.rid]
        assert [done for done, _ in mine] == [sum(n for _, n in mine[:i]) for i in range(len(mine))], req.rid
        assert sum(n for _, n in mine) == len(req.codes) == 80 and req.stamped


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
    assert all(figures.underruns(r, 12.5)[0] == 0 for r in reqs)
    with pytest.raises(ValueError, match="needs detokenize_slack_s"):
        Scheduler(engine, ids, ServeConfig(first_audio_first=True))


def paced(
    engine, pace: float, second_at: float | None = None, first_lead: float = 0.0
) -> tuple[list[Request], list[tuple[float, int]], bool]:
    """Stream 1 (60 codes: 4.8 s of audio), and stream 2 arriving at `second_at`, served on a clock of
    10 ms an iteration (racing: 8 x real time), with `pace` and a lead of 0.4 s (and `first_audio_lead_s`
    first_lead); the detokenizer is ready at once, a code's PCM a "sample". Returns the requests, (time,
    stream 1's codes) at each iteration that decoded, and whether any iteration waited (iterate False
    while wait_s > 0)."""
    ids = Ids.of(engine.spec)
    now = [0.0]

    def detokenize(pieces, urgent):
        at = now[0]
        return (lambda wait: at), [len(p.codes) for p in pieces]

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, pace=pace, pace_lead_s=0.4, first_audio_lead_s=first_lead,
                      sampling=Sampling(greedy=True))  # fmt: skip
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
    assert req.error is None and req.stamped and req.codes == alone.codes and figures.underruns(req, 12.5)[0] == 0
    assert waited == bool(pace)
    last = next(t for t, n in made if n == 60)  # when its last code was sampled
    if pace:
        assert all(n <= (0.4 + pace * max(0.0, t - start)) / 0.08 + 1 for t, n in made if t >= start)
        assert abs(last - start - (4.8 - 0.4) / pace) < 0.1
    else:
        assert last - start < 0.65


def test_a_stream_awaiting_its_first_audio_is_decoded_at_once_beside_paced_ones(tiny_engine_dir):
    """Stream 2 arrives while stream 1 is paced: it is decoded every iteration until its first PCM (its
    time to first audio what it is alone), in steps of its slot alone while stream 1 is not due, so
    stream 1 stays at its pace meanwhile; both streams' codes are what each makes alone."""
    reqs, made, _ = paced(load_engine(tiny_engine_dir), 2, second_at=1.0)
    (alone,), _, _ = paced(load_engine(tiny_engine_dir), 0)
    assert all(r.error is None and r.stamped and figures.underruns(r, 12.5)[0] == 0 for r in reqs)
    assert reqs[0].codes == alone.codes
    assert reqs[1].ttfa_s == pytest.approx(alone.ttfa_s, abs=0.015)
    first = [(t, n) for t, n in made if reqs[1].t_arrival <= t < reqs[1].playback_start]
    assert len(first) >= 3 and len(first) >= (reqs[1].playback_start - reqs[1].t_arrival) / 0.01 - 1  # each 10 ms
    start = reqs[0].playback_start
    assert all(n <= (0.4 + 2 * (t - start)) / 0.08 + 1 for t, n in first)  # stream 1 held to its pace
    assert first[-1][1] - first[0][1] < len(first) / 2  # not a code each iteration
    assert len([t for t, _ in made if 0.5 <= t < 1.0]) < 25  # before it, stream 1 paced: not one each 10 ms
    with pytest.raises(ValueError, match=r"pace 0\.5 is under 1"):
        ServeConfig(pace=0.5)


def test_streams_far_ahead_sit_out_while_a_new_stream_makes_its_first_chunk(tiny_engine_dir):
    """`first_audio_lead_s`: stream 2 arrives at 0.45 s, when stream 1 (unpaced, 8 x real time) has ~3 s of
    audio made past its playback. With a lead of 1 s stream 1 sits out every step from stream 2's admission
    until its first chunk is made (4 codes: steps of its row alone), then goes on; with none, or with a lead
    of 5 s (more than stream 1 has in hand), it steps beside. Both streams' codes are the same each way, and
    neither underruns."""
    runs = {lead: paced(load_engine(tiny_engine_dir), 0, second_at=0.45, first_lead=lead) for lead in (0.0, 1.0, 5.0)}
    for reqs, _, waited in runs.values():
        assert all(r.error is None and r.stamped and figures.underruns(r, 12.5)[0] == 0 for r in reqs) and not waited
    assert [r.codes for r in runs[0.0][0]] == [r.codes for r in runs[1.0][0]] == [r.codes for r in runs[5.0][0]]
    for lead, (reqs, made, _) in runs.items():
        first = [n for t, n in made if reqs[1].t_admit <= t < reqs[1].chunk_sent[0]]  # stream 1's codes meanwhile
        assert len(first) >= 3 and reqs[0].ahead_s(reqs[1].t_admit) > 2.5
        assert first[-1] - first[0] == (0 if lead == 1.0 else len(first) - 1), (lead, first)
    with pytest.raises(ValueError, match="first_audio_lead_s -1 is negative"):
        ServeConfig(first_audio_lead_s=-1)


@pytest.mark.parametrize("most", [0, 1])
def test_urgent_chunks_made_while_an_urgent_batch_runs_wait_and_go_together(tiny_engine_dir, most):
    """`urgent_batches`: three streams arrive an iteration apart, and an urgent batch's PCM is ready 30 ms
    (three iterations) after it is sent. With no limit each first chunk goes at once, a batch each (on one
    lane they would queue); with 1, the second and third wait while the first's batch runs, then go as one.
    A waiting first chunk never goes on the later lane; every chunk goes once, in order."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    now, urgent_batches, lanes = [0.0], [], {}

    def detokenize(pieces, urgent):
        at = now[0] + (0.03 if urgent else 0.0)
        if urgent:
            urgent_batches.append(sorted(p.stream for p in pieces))
        for p in pieces:
            lanes.setdefault(p.stream, []).append((p.done, urgent))
        return (lambda wait: at if wait or now[0] >= at - 1e-9 else None), [len(p.codes) for p in pieces]

    cfg = ServeConfig(chunk_tokens=4, detokenize_batches=100, urgent_batches=most, sampling=Sampling(greedy=True))
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=lambda: now[0])
    reqs = [Request(i, traffic.speech_prompt(1, 20, ids, seed=3 + i)[0], max_steps=24, reply_codes=24) for i in range(3)]
    for req in reqs:
        sched.submit(req)
        sched.iterate()
        now[0] += 0.01
    while not sched.idle():
        sched.iterate()
        now[0] += 0.01
    sched.flush()
    assert urgent_batches == ([[0], [1], [2]] if not most else [[0], [1, 2]]), urgent_batches
    for req in reqs:
        assert req.error is None and req.stamped and [d for d, _ in lanes[req.rid]] == list(range(0, 24, 4))
        assert lanes[req.rid][0][1] and not any(u for _, u in lanes[req.rid][1:])  # its first chunk urgent, no other


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
