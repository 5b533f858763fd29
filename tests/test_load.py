"""The load benchmark (serve/load.py): playback and underruns, the levels, the search for streams at
the SLO; on the CPU, the tiny engine."""

import gc
import itertools
import signal
import time
from collections import Counter

import pytest
import torch

from workflow import load_report, traffic
from workflow.cudagraphs import Graphs
from workflow.engines import load_engine
from workflow.engines.slots import slot_memory
from workflow.generate import Ids, Sampling
from workflow.serve import alone, figures, load, search
from workflow.serve.request import Request, ServeConfig, pcm_rate
from workflow.serve.scheduler import Iteration, Scheduler
from workflow.serve.waits import Counts
from workflow.spec import PRESETS


def test_underruns_count_chunks_ready_after_playback_ran_out():
    req = Request(0, torch.zeros(1, 2, dtype=torch.long), max_steps=1)
    req.chunk_ready, req.chunk_samples = [1.0, 1.3, 1.9, 2.0], [40, 40, 40, 40]  # 100 a second: due at 1.0, 1.4, 1.8, 2.2
    n, stalled = figures.underruns(req, 100.0)
    assert n == 1 and stalled == pytest.approx(0.1)
    assert figures.playback_end(req, 100.0) == pytest.approx(1.0 + 1.6 + 0.1)


def test_playback_starts_at_the_first_chunk_with_pcm_and_paces_by_samples():
    """The codec decoder's way: no PCM for the first chunk (its lookahead), 0.24 s for the next,
    0.4 s each after: time to first audio is the second chunk's, and each is due when the PCM
    before it has played."""
    req = Request(0, torch.zeros(1, 2, dtype=torch.long), max_steps=1, t_arrival=0.5, t_admit=0.6)
    req.chunk_ready, req.chunk_samples = [0.9, 1.0, 1.3, 1.7], [0, 24, 40, 40]  # due -, 1.0, 1.24, 1.64
    assert req.ttfa_s == pytest.approx(0.5)
    assert figures.underruns(req, 100.0) == (2, pytest.approx(0.06 + 0.06))
    assert figures.timeline(req, 100.0)["chunk_due"] == pytest.approx([0.5, 0.74, 1.14])
    req.chunk_sent = [0.8, 0.92, 1.2, 1.6]  # its first audible chunk sent at 0.92, its PCM ready at 1.0
    assert req.ttfa_parts() == pytest.approx((0.1, 0.32, 0.08)) and sum(req.ttfa_parts()) == pytest.approx(req.ttfa_s)
    req.chunk_ready = req.chunk_ready[:1]  # the first audible chunk's PCM not yet known
    assert req.ttfa_parts() is None and req.ttfa_s is None


def test_the_slowest_tenths_parts_are_the_means_of_its_requests():
    parts = sorted([(0.0, 0.1, 0.02)] * 18 + [(0.05, 0.2, 0.1), (0.01, 0.3, 0.05)], key=sum)  # 20: the slowest two
    assert figures.slowest_parts(parts) == pytest.approx({"queued": 30.0, "first_chunk": 250.0, "first_pcm": 75.0})
    assert figures.slowest_parts(parts[:3]) == pytest.approx({"queued": 0.0, "first_chunk": 100.0, "first_pcm": 20.0})


def test_slow_iterations_say_what_the_slowest_held_against_all():
    """A level's slowest hundredth of decoding iterations: here the two of 200 that admitted prompts,
    while half of all began beside a later codec batch and neither slow one did: the prefills, not
    the codec, made them slow. Host ms by phase are their means."""
    fast = [(1.0 + i / 1e3, Iteration(0, i % 2, waits=Counts(pinned_allocs=i // 196)), {"sample": 0.5}) for i in range(198)]
    slow = [(50.0, Iteration(4, 0, waits=Counts(pinned_allocs=3, replay_s=0.04)), {"sample": 48.0, "prefill": 1.0}),
            (60.0, Iteration(2, 0, waits=Counts(gc_runs=1)), {"sample": 58.0, "prefill": 1.0})]  # fmt: skip
    got = figures.slow_iterations(fast + slow)
    assert got["threshold_ms"] == 50.0 and got["n"] == 2 and figures.slow_iterations(fast[:99] + slow)["n"] == 1
    assert got["mean_ms"] == 55.0 and got["with_prompts"] == 1.0 and got["prompts"] == 3.0 and got["beside_later"] == 0.0
    assert got["all_with_prompts"] == 0.01 and got["all_beside_later"] == 0.495
    assert got["host_ms"] == {"prefill": 1.0, "sample": 53.0}  # only the phases the slow ones ran
    assert got["pinned_allocs"] == got["gc"] == 0.5 and got["all_pinned_allocs"] == 0.015
    assert got["replay_ms"] == pytest.approx(20.0) and got["all_replay_ms"] == pytest.approx(0.2)  # 40 ms of 200 iterations
    said = load_report.slow_line(got, 200)  # the waits in words, between the shares and the host's ms
    assert "(of all 50 %); 50 % grew CUDA's pinned pool (of all 2 %); 50 % met a full garbage collection; graph" in said
    assert "graph launches 20.0 ms each (of all 0.2); host ms each: sample 53.0" in said
    assert figures.slow_iterations([]) == {}


def test_the_scheduler_says_what_each_iteration_held(tiny_engine_dir):
    """`Scheduler.last`: the prompts the iteration admitted (two at once, then none), and the later-chunk
    batches still running as it began (a batch is ready 0.05 s of the clock after it is sent)."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    now, running = [0.0], []

    def detokenize(pieces, urgent):
        at = now[0] + 0.05
        return (lambda wait: at if wait or now[0] >= at else None), [len(p.codes) for p in pieces]

    cfg = ServeConfig(chunk_tokens=4, first_chunks_apart=False, detokenize_batches=100, sampling=Sampling(greedy=True))
    sched = Scheduler(engine, ids, cfg, detokenize=detokenize, clock=lambda: now[0])
    for i in (1, 2):
        sched.submit(Request(i, traffic.speech_prompt(1, 20, ids, seed=i)[0], max_steps=24, reply_codes=24))
    held = []
    while not sched.idle():
        sched.iterate()
        held.append(sched.last)
        running.append(sum(not u for _, _, u in sched.unready))
        now[0] += 0.01
    assert held[0].prompts == 2 and all(h.prompts == 0 for h in held[1:])
    assert held[0].later == 0 and max(h.later for h in held) >= 2  # batches of 4 codes every 0.04 s, each 0.05 s long
    assert all(h.later <= r for h, r in zip(held[1:], running, strict=False))  # counted after the ready ones are stamped


def test_a_graph_captured_mid_level_is_counted_and_found_in_the_slow_iterations(tiny_engine_dir, monkeypatch):
    """A CUDA graph made while a level runs holds every stream (`load.prepare` makes them ahead): the
    level counts those its engine's and detokenizer's `Graphs` captured, with their seconds, and its
    slowest iterations say which of them captured one. Here the engine's 5th step "captures" one
    for 1 s, the level's slowest iteration by far, and runs a full garbage collection: counted too."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    engine.graphs = Graphs(torch.device("cpu"))  # the counters the load reads; the CPU engine has none of its own
    step, steps = engine.step, [0]

    def capturing(*args, **kw):
        steps[0] += 1
        if steps[0] == 5:
            time.sleep(1.0)  # longer than any plain iteration here, however busy the CPU
            engine.graphs.captured, engine.graphs.capture_s = 1, 1.0
            gc.collect()  # a full collection, of the oldest generation
        return step(*args, **kw)

    monkeypatch.setattr(engine, "step", capturing)
    cfg = load.LoadConfig(closed=(2,), duration_s=1.5, reply_seconds=(0.8, 1.2), prompt_len=24, slots=4)
    (lv,) = load.run(engine, None, time.perf_counter, cfg, ids, 5, Sampling())["levels"]
    assert lv["graphs_captured"] == {"n": 1, "seconds": 1.0} and lv["alloc_retries"] == 0
    slow = lv["slow_iterations"]  # the slowest hundredth (at least one): the capturing one among them
    assert slow["captured"] * slow["n"] == 1 and slow["mean_ms"] * slow["n"] >= 1000
    assert lv["waits"]["gc_runs"] >= 1 and slow["gc"] * slow["n"] >= 1  # it met the collection
    assert lv["waits"]["pinned_allocs"] == lv["waits"]["device_mallocs"] == 0  # the CPU has neither
    assert alone.graph_sets(engine, None) == {"engine": engine.graphs}  # what the level counted
    assert alone.graph_sets(load_engine(tiny_engine_dir), None) == {}  # the CPU engine has none


@pytest.mark.parametrize("kind", ["closed", "open"])
def test_a_lost_chunk_stops_the_level_with_its_request_named(tiny_engine_dir, monkeypatch, kind):
    """A chunk made but never sent (as the slack's twice-read clock once lost one) leaves its request
    unstamped: a closed level waited for it forever, an open one counted its reply short. After the
    flush nothing is left to send or wait for, so the level stops at once, naming the request."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    real, lost = Scheduler._batch, []

    def losing(sched, chunks, urgent):
        if not lost and len(chunks[0][0].chunk_codes) >= 3:  # a stream's third chunk goes nowhere
            lost.append(chunks.pop(0)[0].rid)
        if chunks:
            real(sched, chunks, urgent)

    monkeypatch.setattr(Scheduler, "_batch", losing)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the level waited for the lost chunk"))
    signal.alarm(120)
    cfg = load.LoadConfig(closed=(2,) if kind == "closed" else (), rates=(2.0,) if kind == "open" else (), duration_s=1.0,
                          reply_seconds=(0.8, 1.2), prompt_len=24, slots=4)  # fmt: skip
    said = rf"load {kind} 2: request \d+ made \d+ chunks, \d+ known ready, .* a chunk was lost"
    try:
        with pytest.raises(RuntimeError, match=said):
            load.run(engine, None, time.perf_counter, cfg, ids, 5, Sampling())
    finally:
        signal.alarm(0)
    assert lost


def test_one_users_closed_level_asks_again_each_time_a_reply_has_played(tiny_engine_dir):
    """A closed level of one user: each request after the first arrives when the reply before it has
    played, until the level's arrivals end. (The loop once ended as soon as the only reply was made:
    the user, done but not yet listening, was counted nowhere.)"""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    cfg = load.LoadConfig(closed=(1,), duration_s=2.0, reply_seconds=(0.4, 0.6), prompt_len=24, slots=4)
    level = load.Level(cfg, "closed", 1, ids, torch.Generator().manual_seed(cfg.seed))
    lv, done = load.run_level(engine, None, time.perf_counter, level, 5, Sampling(), progress=False)
    assert lv["requests"] == len(done) >= 3 and lv["peak_streams"] == 1
    rate = pcm_rate(None)
    for before, req in itertools.pairwise(done):
        assert figures.playback_end(before, rate) <= req.t_arrival <= figures.playback_end(before, rate) + 0.1
    assert done[-1].t_arrival < done[0].t_arrival + cfg.duration_s


def test_the_load_benchmark_runs_and_answers(tiny_engine_dir):
    """Two closed-loop levels and one Poisson level on the tiny engine: every request served,
    its first audio timed from its arrival, and the answer the largest level within the SLO."""
    engine = load_engine(tiny_engine_dir)
    ids = Ids.of(engine.spec)
    cfg = load.LoadConfig(closed=(1, 3), rates=(2.0,), duration_s=1.5, reply_seconds=(0.4, 1.2), prompt_len=24, slots=4)
    out = load.run(engine, None, __import__("time").perf_counter, cfg, ids, 5, Sampling())
    assert [(lv["kind"], lv["value"]) for lv in out["levels"]] == [("closed", 1), ("closed", 3), ("open", 2.0)]
    assert out["prepared"]["frozen_objects"] > 1000 and gc.get_freeze_count() == 0  # frozen for the levels only
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
        parts, slowest = lv["ttfa_parts_ms"], lv["slowest_ttfa_parts_ms"]  # time to first audio by part
        assert parts["queued"] == q and parts["first_chunk"]["p50"] > 0 and parts["first_pcm"]["p99"] == 0  # no detokenizer
        assert parts["first_chunk"]["n"] == lv["served"] and sum(slowest.values()) >= lv["ttfa_ms"]["p50"]
        s = lv["slow_iterations"]  # the slowest hundredth of its iterations, and what they held
        assert s["n"] == max(1, it["n"] // 100) and s["threshold_ms"] <= s["mean_ms"] <= it["max"]
        assert 0 < s["all_with_prompts"] < 1 and s["all_beside_later"] == s["beside_later"] == 0  # no detokenizer
        assert lv["anchor_put_off"] == 0 and lv["detokenizer_calls"] == {}  # no detokenizer, no clock anchor or calls
        assert lv["graphs_captured"] == {"n": 0, "seconds": 0.0} and lv["alloc_retries"] == s["captured"] == 0  # the CPU
        assert "device_alone" not in lv  # no CUDA graphs to price (serve/alone.py)
    assert out["levels"][0]["peak_streams"] == 1  # one user: one reply at a time
    ok = [lv["value"] for lv in out["levels"][:2] if lv["ttfa_ms"]["p99"] <= 200 and not lv["underruns"]]
    assert out["streams_at_slo"] == max(ok, default=0) and out["ttfa_slo_ms"] == 200
    t = out["timeline"]
    assert t["level"] == 3 and 0 <= t["admitted"] <= t["chunk_ready"][0]
    assert slot_memory(engine, False)["kv_bytes_per_slot"] == sum(c[0].numel() for c in engine.caches()) * 4
    made = out["prepared"]  # the CPU engine has no graphs to make, and the device no memory to count
    assert made["engine_graphs"] == made["detokenizer_batches"] == made["reserved_bytes"] == 0
    assert 0 <= made["admission_seconds"] <= made["engine_seconds"] <= made["seconds"]  # the engine's graphs' part of it
    assert "detokenizer_seconds" not in made  # no detokenizer here
    cuda = {"engine_graphs": 174, "detokenizer_batches": 261, "seconds": 163.4, "engine_seconds": 61.2, "reserved_bytes": 2**31}
    said = load_report._prepared(cuda)  # as a GPU's benchmark.md says it; a file from before engine_seconds without its part
    assert "174 engine graphs (61 s) and 261 detokenizer batches in 163 s in all, holding 2.0 GiB more." in said
    assert "engine graphs and 261" in load_report._prepared({k: v for k, v in cuda.items() if k != "engine_seconds"})
    by_rows = {"1": {"flow": 3.2, "pieces": 5.6}, "40": {"flow": 51.0, "pieces": 9.0}}
    split_s = cuda | {"admission_seconds": 40.4, "detokenizer_seconds": by_rows}
    said_s = load_report._prepared(split_s)  # the engine's admissions' part, the detokenizer's by batch rows
    assert "174 engine graphs (61 s, admissions 40) and 261 detokenizer batches in 163 s in all, holding 2.0 GiB more." in said_s
    assert said_s.endswith(" The detokenizer's seconds by batch rows, flows + pieces: 1: 3 + 6, 40: 51 + 9.")
    assert "memory" not in made and "Graph pools" not in said  # the CPU's, and a file from before the split
    gib = {"graph_pools": (45, 4), "rest": (60, 50), "engine_graphs": (3, 1), "detokenizer_graphs": (40, 2.5)}
    split = {k: {"reserved_bytes": int(r * 2**30), "allocated_bytes": int(a * 2**30)} for k, (r, a) in gib.items()}
    said = load_report._prepared(cuda | {"memory": split | {"free_bytes": 12 * 2**30}})
    assert said.endswith(" Graph pools then 45.0 GiB (4.0 held by tensors; the engine's captures added 3.0, the detokenizer's "
                         "40.0); the allocator's own pool 60.0 GiB (weights, caches, pages: 50.0 held, the rest freed blocks "
                         "kept); the device 12.0 GiB free.")  # fmt: skip
    memory = {"slots": 4, "kv_bytes_per_slot": 1, "max_seq_len": 64}
    rows = [r for r in load_report.load_markdown(out | {"memory": memory}) if r.startswith(("| closed", "| Poisson"))]
    by_level = sorted(out["levels"], key=lambda lv: (lv["kind"], lv["value"]))
    host = [lv["host_busy"] for lv in by_level]
    assert [r.split(" | ")[8] for r in rows] == [f"{h['decode']:.2f} / {h.get('detokenize', 0.0):.2f}" for h in host]
    p50 = [{k: v["p50"] for k, v in lv["ttfa_parts_ms"].items()} for lv in by_level]  # each part's p50, then the slowest tenth's
    slow = [lv["slowest_ttfa_parts_ms"] for lv in by_level]
    assert [r.split(" | ")[11] for r in rows] == [
        f"{m['queued']:.0f} / {m['first_chunk']:.0f} / 0 · {s['queued']:.0f} / {s['first_chunk']:.0f} / 0"
        for m, s in zip(p50, slow, strict=True)
    ]
    old = {**out, "memory": memory, "levels": [{k: v for k, v in lv.items() if k != "ttfa_parts_ms"} for lv in by_level]}
    assert next(r.split(" | ")[11] for r in load_report.load_markdown(old) if r.startswith("| closed")) == (
        f"{slow[0]['queued']:.0f} / {slow[0]['first_chunk']:.0f} / 0"  # a file from before the p50s: the slowest tenth's
    )
    lines = [r for r in load_report.load_markdown(out | {"memory": memory}) if r.startswith("- ")]  # a level's slow iterations
    assert [r.split(":")[0] for r in lines] == ["- closed, 1 users", "- closed, 3 users", "- Poisson 2/s"]
    assert all(" % began beside a later codec batch (of all 0 %)" in r and "host ms each: " in r for r in lines)
    assert not any("anchor" in r for r in lines)  # said only where a renewal was put off
    alone = {"device_alone": {"decode": 0.38, "detokenize first": 0.2}, "device_alone_unpriced": 2}  # as a GPU's level has it
    priced = out | {"memory": memory, "levels": [out["levels"][0] | alone, *out["levels"][1:]]}
    said = [r for r in load_report.load_markdown(priced) if r.startswith("- closed, 1 users: decode")]
    assert said == ["- closed, 1 users: decode 0.38, detokenizer first 0.20: 0.58 in all, the detokenizer's 34% "
                    "(2 replays of graphs dropped before, not priced)"]  # fmt: skip
    for most, capped in ((out["streams_at_slo"], True), (out["streams_at_slo"] + 4, False)):  # a search stopped at its most
        searched = out | {"memory": memory, "config": out["config"] | {"search_step": 4, "search_max": most}}
        assert ("the most the search offers" in "\n".join(load_report.load_markdown(searched))) == capped
    stopped = out | {"memory": memory, "config": out["config"] | {"search_step": 4}}
    stopped["search_stopped"] = {"next": 48, "at_s": 531.4, "level_s": 16.2}  # as load.search_until_s stops it
    assert load_report.lower_bound(stopped) and not load_report.lower_bound(stopped | {"search_stopped": None})
    assert "the search stopped 531 s into the benchmark, before 48 users" in "\n".join(load_report.load_markdown(stopped))
    calls = {
        "detokenize": {"per_s": 5.5, "streams": 2.5, "chunks": 12.0},
        "detokenize first": {"per_s": 2.0, "streams": 1.0, "chunks": 1.0},
    }
    lines = [
        r
        for r in load_report.load_markdown(
            out | {"levels": [lv | {"detokenizer_calls": calls} for lv in out["levels"]], "memory": memory}
        )
        if r.startswith("- ")
    ]
    assert all(
        r.endswith("; detokenizer calls: 2.0/s first of 1.0 streams, 1.0 chunks, 5.5/s later of 2.5 streams, 12.0 chunks")
        for r in lines
    )
    put_off = [lv | {"anchor_put_off": 3} if lv["value"] == 3 else lv for lv in out["levels"]]
    lines = [r for r in load_report.load_markdown(out | {"levels": put_off, "memory": memory}) if r.startswith("- ")]
    assert [r.endswith("anchor put off 3 times (its event queued behind a lane's work)") for r in lines] == [False, True, False]
    made = {"graphs_captured": {"n": 2, "seconds": 0.31}, "alloc_retries": 4}  # the Poisson level's, its slow half capturing
    held = [lv | made | {"slow_iterations": lv["slow_iterations"] | {"captured": 0.5}} if lv["kind"] == "open" else lv
            for lv in out["levels"]]  # fmt: skip
    lines = [r for r in load_report.load_markdown(out | {"levels": held, "memory": memory}) if r.startswith("- ")]
    said = "; 2 CUDA graphs captured mid-level (0.31 s), in 50 % of these; the allocator's retries: 4 (each a wait for the whole"
    assert [r.endswith(said + " device)") for r in lines] == [False, False, True]


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


class FakeCodec:
    """The codec decoder's PCM on a fake clock: none for the first 2 codes of a stream (lookahead) until its
    end, 7 codes before its first PCM, ready `latency_s` after a first chunk is sent (3 x after a later one)."""

    sample_rate, first_codes = 24000.0, 7

    def __init__(self, now: list[float], latency_s: float) -> None:
        self.now, self.latency_s = now, latency_s
        self.codes: dict[int, int] = {}
        self.calls: dict[str, Counter] = {}  # what it was asked, by lane
        self.urgent: list[tuple[float, float]] = []  # each urgent batch: sent, ready

    def __call__(self, pieces, urgent):
        lane = self.calls.setdefault("detokenize first" if urgent else "detokenize", Counter())
        lane.update(calls=1, streams=len({p.stream for p in pieces}), chunks=len(pieces))
        at, samples = self.now[0] + self.latency_s * (1 if urgent else 3), []
        if urgent:
            self.urgent.append((self.now[0], at))
        for p in pieces:
            before = self.codes.get(p.stream, 0)
            self.codes[p.stream] = after = before + len(p.codes)
            samples.append(1920 * ((after if p.last else max(0, after - 2)) - max(0, before - 2)))
        return (lambda wait: at if wait or self.now[0] >= at else None), samples


def serve_sixteen(engine, cfg: ServeConfig, latency_s: float) -> tuple[list[Request], Scheduler, FakeCodec]:
    """Sixteen replies of 4-20 s arriving over 3 s, served on a fake clock (4 ms an iteration, 0.5 ms a
    paced wait) with `FakeCodec`; every one served and stamped, and none underran."""
    ids, now = Ids.of(engine.spec), [0.0]
    sched = Scheduler(engine, ids, cfg, detok := FakeCodec(now, latency_s), lambda: now[0], torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    arrivals = sorted((3 * torch.rand(16, generator=g)).tolist())
    replies = torch.randint(50, 251, (16,), generator=g).tolist()
    reqs = [
        Request(i, traffic.speech_prompt(1, 16, ids, seed=i)[0], max_steps=n + 5, reply_codes=n, t_arrival=t)
        for i, (t, n) in enumerate(zip(arrivals, replies, strict=True))
    ]
    coming = list(reqs)  # in order of arrival
    while coming or not sched.idle():
        while coming and coming[0].t_arrival <= now[0]:
            sched.submit(coming.pop(0))
        waits = sched.wait_s() > 0
        sched.iterate()
        now[0] += 0.0005 if waits else 0.004
        assert now[0] < 60, f"stalled: {len(sched.streams)} speaking, {len(sched.outbox)} chunks unsent"
    sched.flush()
    assert sorted(r.rid for r in sched.done) == list(range(16))
    assert all(r.error is None and r.stamped and figures.underruns(r, FakeCodec.sample_rate)[0] == 0 for r in reqs)
    assert sched.sent == detok.calls and set(sched.sent) == {"detokenize", "detokenize first"}  # its calls, by lane
    return reqs, sched, detok


@pytest.mark.parametrize("latency_s", [0.02, 0.08])
def test_paced_streams_with_held_chunks_all_end(tiny_engine_dir, latency_s):
    """H200 run 9's stalled setting: pace 2, later chunks held 8 with 0.5 s of slack, first chunks apart,
    8 speaking at most (`serve_sixteen`): every reply served, stamped and without underrun, each made in
    about its paced time from its admission."""
    cfg = ServeConfig(detokenize_hold=8, detokenize_slack_s=0.5, pace=2, max_streams=8, sampling=Sampling())
    reqs, sched, _ = serve_sixteen(load_engine(tiny_engine_dir, max_batch=8), cfg, latency_s)
    assert all(r.chunk_ready[-1] - r.t_admit < (len(r.codes) * 0.08 - 1) / 2 + 1 for r in reqs)  # each at pace 2 past a 1 s lead
    later = sched.sent["detokenize"]
    assert later["chunks"] > 2 * later["streams"] > 0  # held: a stream's later chunks go several a call


@pytest.mark.parametrize("latency_s", [0.02, 0.08])
def test_the_first_audio_settings_together_serve_every_reply(tiny_engine_dir, latency_s):
    """Unpaced, with the settings built for time to first audio and the codec's calls all on (streams 1.5 s
    ahead sit out while a first chunk is made, one urgent batch at a time, later batches of at least 40
    codes unless due; hold 8, 0.5 s of slack): every reply served, stamped and without underrun
    (`serve_sixteen`), never two urgent batches running at once, and where the urgent PCM comes late
    (80 ms: a stream's second chunk is made before its first's PCM) chunks waiting for the lane go as one."""
    cfg = ServeConfig(detokenize_hold=8, detokenize_slack_s=0.5, detokenize_least=40, first_audio_lead_s=1.5,
                      urgent_batches=1, max_streams=8, sampling=Sampling())  # fmt: skip
    _, sched, detok = serve_sixteen(load_engine(tiny_engine_dir, max_batch=8), cfg, latency_s)
    assert all(sent >= ready for (_, ready), (sent, _) in itertools.pairwise(detok.urgent)), detok.urgent
    first = sched.sent["detokenize first"]
    assert first["chunks"] >= 16 and (first["calls"] < first["chunks"]) == (latency_s > 0.05), first


def test_load_config_names_an_unknown_key():
    with pytest.raises(ValueError, match=r"benchmark\.load: unknown key"):
        load.LoadConfig.from_dict({"closed": [4], "users": 3})


def test_load_config_refuses_the_schedulers_bad_settings_as_it_is_read():
    """A setting the scheduler refuses is refused as the benchmark reads it, not minutes later at its first level."""
    with pytest.raises(ValueError, match=r"benchmark\.load: detokenize_join 3 is not under detokenize_hold 3"):
        load.LoadConfig.from_dict({"detokenize_hold": 3, "detokenize_join": 3})
    with pytest.raises(ValueError, match=r"benchmark\.load: first_audio_first needs detokenize_slack_s"):
        load.LoadConfig.from_dict({"first_audio_first": True})
    with pytest.raises(ValueError, match=r"benchmark\.load: detokenize_least needs detokenize_slack_s"):
        load.LoadConfig.from_dict({"detokenize_least": 80})
    assert load.LoadConfig.from_dict({"detokenize_hold": 8, "detokenize_join": 4}).detokenize_join == 4


def test_every_scheduler_setting_of_the_load_reaches_the_scheduler():
    """Each setting the load and the scheduler both name, set off its default, arrives as set; the
    load's slots are the scheduler's max_streams."""
    given = {
        "prefill_tokens": 512, "when_full": "refuse", "detokenize_batches": 3, "detokenize_hold": 5, "detokenize_slack_s": 0.4,
        "detokenize_join": 3, "detokenize_least": 40,
        "first_audio_first": True, "first_chunks_apart": False, "urgent_batches": 2, "pace": 2.5, "pace_lead_s": 0.7,
        "first_audio_lead_s": 1.5, "slots": 6,
    }  # fmt: skip
    shared = set(ServeConfig.__dataclass_fields__) & set(load.LoadConfig.__dataclass_fields__)
    assert shared == set(given) - {"slots"}  # a setting added to both is added here too
    serve = load.LoadConfig(**given).serve_config(7, Sampling(greedy=True))
    assert {k: getattr(serve, k) for k in shared} == {k: given[k] for k in shared}
    assert (serve.max_streams, serve.chunk_tokens, serve.hold_speech, serve.sampling) == (6, 7, True, Sampling(greedy=True))
    assert all(given[k] != getattr(ServeConfig(), k) for k in shared)  # none left at its default


@pytest.mark.parametrize("within", [0.25, 0.125])
@pytest.mark.parametrize("most_users", [0, 2, 11, 13, 24, 29, 50, 84, 100, 400])
def test_the_search_pins_streams_at_the_slo_between_a_level_that_held_and_one_that_did_not(most_users, within):
    """With levels holding the SLO up to `most_users` and no further, the search ends with the
    largest that held at most that, the smallest that failed above it, and the two within
    search_step users or `within` of the answer (a quarter, or an eighth); past search_max it stops
    at search_max."""
    step, most = 4, 256
    held = {n: n <= most_users for n in (4, 8, 16, 32)}
    runs = 0
    while (n := search.next_search_level(held, step, most, within)) is not None:
        assert n not in held and 0 < n <= most
        held[n], runs = n <= most_users, runs + 1
    lo = max((n for n, ok in held.items() if ok), default=0)
    above = [n for n, ok in held.items() if not ok and n > lo]
    assert lo <= most_users and runs <= 6
    if most_users >= most:
        assert lo == most and not above
    else:
        assert min(above) > most_users and min(above) - lo <= max(step, lo * within)


def test_the_search_keeps_the_largest_level_that_held_and_searches_above_it():
    """A noisy grid (8 failed, 16 held): the search goes on above 16, not below 8."""
    assert search.next_search_level({4: True, 8: False, 16: True, 32: False}, 4, 256) == 24
    assert search.next_search_level({4: True, 8: True}, 4, 256) == 16  # every level held: twice the largest
    assert search.next_search_level({4: True, 8: True}, 4, 8) is None  # ... up to search_max
    assert search.next_search_level({64: True, 128: False, 96: False, 80: True}, 4, 128) is None  # 16 <= 80 / 4
    assert search.next_search_level({64: True, 128: False, 96: False, 80: True}, 4, 128, 0.125) == 88  # H200 run 19's FP8


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


def test_the_search_stops_before_a_level_that_would_end_past_its_budget(monkeypatch):
    """load.search_until_s: counted from the benchmark's start (`began`), the search starts a level only where
    the levels' mean wall time says it would end within it; the answer is what ran, and says where it stopped."""
    ran, now = [], [0.0]

    def level(engine, detokenize, clock, lv, chunk_tokens, sampling):
        ran.append(lv.value)
        now[0] += 16.0  # each level 16 s of the benchmark's clock
        return {"kind": lv.kind, "value": lv.value, "ttfa_ms": {"p99": 150.0 if lv.value <= 21 else 250.0}, "underruns": 0,
                "failed": 0, "tokens_per_s": 1.0, "busy_fraction": 0.5, "wall_s": 16.0}, []  # fmt: skip

    monkeypatch.setattr(load, "run_level", level)
    monkeypatch.setattr(load, "prepare", lambda *a: {})
    cfg = load.LoadConfig(closed=(4, 8), search_step=4, search_max=64, search_until_s=60.0)
    out = load.run(None, None, lambda: now[0], cfg, Ids.of(PRESETS["tiny"]), 5, Sampling(), began=-10.0)
    assert ran == [4, 8, 16] and out["streams_at_slo"] == 16  # 16 ends at 58 s; 32 would end at 74
    assert out["search_stopped"] == {"next": 32, "at_s": 58.0, "level_s": 16.0}
    ran.clear()
    out = load.run(None, None, lambda: now[0], cfg, Ids.of(PRESETS["tiny"]), 5, Sampling())  # no start given: no budget
    assert ran == [4, 8, 16, 32, 24, 20] and out["search_stopped"] is None


def test_prepare_freezes_what_exists_out_of_the_garbage_collectors_walks():
    """After `prepare` every object so far is frozen (gc.freeze): a full collection mid-level walks only
    what came after (on an H200's host one walked ~0.8 M objects in ~400 ms of the loop's thread)."""

    class Node:
        pass

    kept = Node()
    kept.me = kept  # in a cycle: a full collection would walk it every time
    engine = type("Engine", (), {"device": torch.device("cpu"), "active": lambda self: []})()
    try:
        made = load.prepare(engine, None, load.LoadConfig(), 5)
        assert made["frozen_objects"] >= gc.get_freeze_count() > 1000  # (frozen objects freed since leave it)
        assert not any(o is kept for o in gc.get_objects())  # out of every generation the collector walks
        later = Node()
        later.me = later
        assert any(o is later for o in gc.get_objects())  # what comes after is collected as before
    finally:
        gc.unfreeze()
