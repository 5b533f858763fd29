"""The load benchmark: users arrive and listen, the scheduler serves them, the clock judges.

Traffic (`LoadConfig`, the config's `benchmark.load`), from a fixed seed:
- closed loop, N users: each listens to one reply at a time. Their first requests arrive spread
  over one mean reply length; each later one when the user's previous reply has finished
  playing. N is the number of streams heard at once (the offered concurrency);
- open loop: Poisson arrivals at a rate (per second); its offered concurrency is the rate times
  the mean reply length.
Every reply is `reply_seconds` of audio (uniform in the range, 80 ms a code); every prompt is
`prompt_len` tokens ending in start-of-speech. A level runs `duration_s` of arrivals, then the
streams in flight finish. Before the first level, `prepare` makes every CUDA graph the levels
can meet; `warmup_s` of the largest closed level may come first too, not recorded.

Figures per level, with the definitions of docs/DESIGN (shared by every result file):
- time to first audio (TTFA): a request's arrival to its first chunk's PCM ready (the first chunk
  with PCM: the codec decoder's lookahead gives none for a stream's first 5 codes);
- playback starts when the first chunk is ready; a chunk is due when the PCM of those before it
  has played (t_first + i x chunk seconds where every chunk holds a chunk's audio), and an
  underrun is a chunk ready after it is due (count and total stalled seconds);
- tokens/s (codes generated), busy fraction (time the loop had work / wall time), and the
  device's time per phase of the loop over wall time (`device_busy`: prefill, sample, decode on
  the decoding stream, detokenize on its own);
- streams at the SLO: the largest closed-loop N whose TTFA p99 <= ttfa_slo_ms with no underrun
  and no failed stream. With `search_step`, closed levels follow the given ones until that N is
  known to within search_step users or `search_within` of it (`next_search_level`), so the answer is not
  capped by the levels a config happened to offer.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from workflow import traffic
from workflow.cudagraphs import PoolMarks
from workflow.engines.base import Engine
from workflow.generate import Ids, Sampling
from workflow.report import percentiles
from workflow.serve import alone
from workflow.serve.figures import TTFA_PARTS, Record, playback_end, slow_iterations, slowest_parts, timeline, underruns
from workflow.serve.request import Detokenize, Request, ServeConfig, pcm_rate
from workflow.serve.scheduler import Scheduler
from workflow.serve.search import WITHIN, holds, next_search_level, past_budget
from workflow.serve.waits import Waits
from workflow.vocoder import SECONDS_PER_TOKEN

PACE_POLL_S = 0.002  # with pace: the loop's sleep at most, while no stream needs decoding


@dataclass(frozen=True)
class LoadConfig:
    closed: tuple[int, ...] = (1, 4)  # users held, one level each
    rates: tuple[float, ...] = ()  # open-loop arrivals per second, one level each
    duration_s: float = 10.0  # of arrivals, per level
    warmup_s: float = 0.0  # a first run of the largest closed level, not recorded (graphs are made ahead: `prepare`)
    reply_seconds: tuple[float, float] = (4.0, 20.0)
    prompt_len: int = 512
    ttfa_slo_ms: float = 200.0
    slots: int = 8  # streams open at once (the scheduler's max_streams; graphs are made for up to this many)
    prefill_tokens: int = 2048  # (ServeConfig)
    when_full: str = "queue"  # (ServeConfig)
    detokenize_batches: int = 2  # detokenizer batches running at once (ServeConfig)
    detokenize_hold: int = 1  # a speaking stream's later chunks go once this many wait (ServeConfig)
    detokenize_slack_s: float = 0.0  # > 0: or once the first of them would play within this many seconds (ServeConfig)
    detokenize_join: int = 0  # > 0: one with this many waiting goes along with a batch that goes anyway (ServeConfig)
    detokenize_least: int = 0  # > 0: a later batch goes once it takes this many codes, or one of them is due (ServeConfig)
    first_audio_first: bool = False  # later chunks wait while a stream awaits its first audio, but those due soon (ServeConfig)
    first_chunks_apart: bool = True  # a stream's chunks at once, on the urgent lane, until it has a chunk's audio (ServeConfig)
    urgent_batches: int = 0  # > 0: urgent batches running at once; new urgent chunks wait, then go together (ServeConfig)
    later_below_decode: bool = False  # the detokenizer's later lane one priority below the decode graphs (lane_priorities)
    decode_sms: int = 0  # > 0: the engine's decode steps on this many SMs (TorchEngine.confine), the codec's on all
    later_sms: int = 0  # > 0: the detokenizer's later lane on this many SMs (CodecLanes.confine_later), the rest on all
    pace: float = 0.0  # >= 1: a stream past its first PCM decoded only to this many times real time (ServeConfig; 0: off)
    pace_lead_s: float = 1.0  # with pace: the audio kept ahead of that (ServeConfig)
    first_audio_lead_s: float = 0.0  # > 0: while a stream makes its first chunk, those this far ahead sit out (ServeConfig)
    seed: int = 9101
    search_step: int = 0  # > 0: closed levels after the given ones, until streams at the SLO is known this closely
    search_max: int = 256  # the most users the search offers
    search_within: float = WITHIN  # the search ends once the answer is known to within this share of it (or search_step)
    search_until_s: float = 0.0  # > 0: no searched level that would end past this many seconds of the benchmark's run

    @property
    def longest_codes(self) -> int:
        """The codes of the longest reply the levels ask for."""
        return round(self.reply_seconds[1] / SECONDS_PER_TOKEN)

    def serve_config(self, chunk_tokens: int, sampling: Sampling) -> ServeConfig:
        """The scheduler's settings: every field the two name alike (marked ServeConfig above), its
        max_streams from `slots`; a reply is spoken whole (hold_speech)."""
        shared = {k: getattr(self, k) for k in ServeConfig.__dataclass_fields__ if k in self.__dataclass_fields__}
        return ServeConfig(chunk_tokens=chunk_tokens, hold_speech=True, max_streams=self.slots, sampling=sampling, **shared)

    @classmethod
    def from_dict(cls, d: dict) -> LoadConfig:
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"benchmark.load: unknown key(s) {', '.join(unknown)}")
        tuples = {k: tuple(v) for k, v in d.items() if isinstance(v, list)}
        cfg = cls(**(d | tuples))
        for name in ("decode_sms", "later_sms"):
            if getattr(cfg, name) < 0:
                raise ValueError(f"benchmark.load: {name} {getattr(cfg, name)}: a count of SMs, or 0 for all of them")
        try:  # the scheduler's settings refused as the benchmark starts, not at its first level
            cfg.serve_config(1, Sampling())
        except ValueError as e:
            raise ValueError(f"benchmark.load: {e}") from None
        return cfg


class Level:
    """One offered load, run in real time against the scheduler."""

    def __init__(self, cfg: LoadConfig, kind: str, value: float, ids: Ids, g: torch.Generator):
        self.cfg, self.kind, self.value, self.ids, self.g = cfg, kind, value, ids, g
        lo, hi = cfg.reply_seconds
        self.mean_reply_s = (lo + hi) / 2
        self.rid = 0

    def new_request(self, t: float) -> Request:
        lo, hi = self.cfg.reply_seconds
        seconds = lo + (hi - lo) * float(torch.rand(1, generator=self.g))
        codes = max(1, round(seconds / SECONDS_PER_TOKEN))
        prompt = traffic.speech_prompt(
            1, self.cfg.prompt_len, self.ids, seed=int(torch.randint(1 << 30, (1,), generator=self.g))
        )[0]
        self.rid += 1
        return Request(self.rid, prompt, max_steps=codes, reply_codes=codes, t_arrival=t)

    def first_arrivals(self) -> list[float]:
        """Offsets (seconds) of the first requests."""
        if self.kind == "closed":
            return sorted(float(x) * self.mean_reply_s for x in torch.rand(int(self.value), generator=self.g))
        gaps = torch.empty(int(self.value * self.cfg.duration_s * 2) + 16).exponential_(generator=self.g) / self.value
        times = torch.cumsum(gaps, 0)
        return [float(t) for t in times if t < self.cfg.duration_s]


def level_seed(seed: int, kind: str, value: float) -> int:
    """A level's traffic seed, from what it offers and not from its place in the run: the same
    level draws the same arrivals and replies whichever levels ran before it (the search's order
    depends on what held), so levels compare across runs and configs."""
    return seed + round(1000 * value) + (1 << 24 if kind == "open" else 0)


def all_stamped(reqs: list[Request], level: Level) -> None:
    """After a flush every chunk made has its ready time: one without was lost on its way to the
    detokenizer (its stream's audio skips it) and a closed level would wait for it forever."""
    for r in reqs:
        if not r.stamped:
            raise RuntimeError(
                f"load {level.kind} {level.value:g}: request {r.rid} made {len(r.chunk_codes)} chunks, {len(r.chunk_ready)} "
                "known ready, and nothing is left to send or wait for: a chunk was lost"
            )


def run_level(
    engine: Engine,
    detokenize: Detokenize | None,
    clock: Callable[[], float],
    level: Level,
    chunk_tokens: int,
    sampling: Sampling,
    progress: bool = True,
) -> tuple[dict, list[Request]]:
    cfg = level.cfg
    serve = cfg.serve_config(chunk_tokens, sampling)
    sched = Scheduler(engine, level.ids, serve, detokenize, clock, torch.Generator(engine.device).manual_seed(cfg.seed))
    rate, put_off = pcm_rate(detokenize), getattr(detokenize, "renewals_put_off", 0)
    waits = Waits(engine.device, list(alone.graph_sets(engine, detokenize).values()))  # a capture mid-level holds every stream
    first = waits.level()
    t0 = clock()
    pending = [t0 + t for t in level.first_arrivals()]  # arrival times not yet submitted
    end = t0 + cfg.duration_s
    busy, active_sum, seen, peak, last_print = 0.0, 0, 0, 0, t0
    iters: list[Record] = []  # each decoding iteration's
    listening: list[Request] = []  # closed loop: users whose reply is not all stamped yet
    while pending or listening or not sched.idle() or (level.kind == "closed" and seen < len(sched.done)):
        now = clock()
        while pending and pending[0] <= now:
            sched.submit(level.new_request(pending.pop(0)))
        if level.kind == "closed":  # a user whose reply has played asks again
            listening += sched.done[seen:]
            seen = len(sched.done)
            if sched.idle():  # nothing to launch: wait for the detokenizer, to stamp the last replies
                sched.flush()
                all_stamped(listening, level)
            for req in [r for r in listening if r.stamped]:
                listening.remove(req)
                t_next = playback_end(req, rate) if req.chunk_ready else clock()
                if t_next < end:
                    pending.append(t_next)
            pending.sort()
        if sched.idle():
            time.sleep(max(0.0, min(pending[0] - clock(), 0.05)) if pending else 0.0)
            continue
        if (wait := sched.wait_s()) > 0:  # every stream ahead of its pace: chunks and stamps still looked at
            time.sleep(min(wait, PACE_POLL_S))
        t_iter, host, w0 = clock(), dict(sched.phases.host), waits.iteration()
        decoded = sched.iterate()
        took = clock() - t_iter
        busy += took
        if decoded:  # an arrival waits up to one to be admitted
            held = replace(sched.last, waits=waits.iteration() - w0)
            iters.append((1e3 * took, held, {k: 1e3 * (s - host.get(k, 0.0)) for k, s in sched.phases.host.items()}))
        active_sum += sched.last.stepped if decoded else 0
        peak = max(peak, sched.streams_open())
        if progress and clock() - last_print > 2.0:
            last_print = clock()
            print(
                f"  load {level.kind} {level.value:g}: {last_print - t0:5.1f} s, {len(sched.streams)} speaking, "
                f"{len(sched.queue)} queued, {len(sched.done)} done",
                file=sys.stderr,
            )
    sched.flush()
    all_stamped(sched.done, level)
    waited = waits.level() - first
    wall = clock() - t0
    done = sched.done
    served = [r for r in done if r.error is None]
    ttfa = [1e3 * r.ttfa_s for r in served if r.ttfa_s is not None]
    queued = [1e3 * (r.t_admit - r.t_arrival) for r in served if r.t_admit is not None]
    runs = [underruns(r, rate) for r in served]
    parts = sorted((p for r in served if (p := r.ttfa_parts()) is not None), key=sum)  # slowest last
    step_ms = [ms for ms, _, _ in iters]
    offered = level.value if level.kind == "closed" else level.value * level.mean_reply_s
    return {
        "kind": level.kind,
        "value": level.value,
        "offered_streams": offered,
        "requests": len(done),
        "served": len(served),
        "refused": sum(r.error is not None and r.error.startswith("refused") for r in done),
        "failed": sum(r.error is not None and not r.error.startswith("refused") for r in done),
        "ttfa_ms": percentiles(ttfa),
        "queued_ms": percentiles(queued),  # arrival to admission: part of time to first audio
        "ttfa_parts_ms": {k: percentiles([1e3 * p[i] for p in parts]) for i, k in enumerate(TTFA_PARTS)},
        "slowest_ttfa_parts_ms": slowest_parts(parts),
        "max_streams": sched.max_streams,
        "peak_streams": peak,  # the most open at once after an iteration: whether the level met max_streams
        "underruns": sum(n for n, _ in runs),
        "stalled_s": sum(s for _, s in runs),
        "tokens_per_s": sum(len(r.codes) for r in done) / wall,
        "busy_fraction": busy / wall,
        "device_busy": {phase: s / wall for phase, s in sorted(sched.phases.seconds.items())},
        "host_busy": {phase: s / wall for phase, s in sorted(sched.phases.host.items())},
        "mean_active_slots": active_sum / max(1, len(iters)),
        "iteration_ms": percentiles(step_ms) | {"max": max(step_ms, default=0.0)},
        "slow_iterations": slow_iterations(iters),
        "detokenizer_calls": {  # by lane: calls a second, the streams and chunks a call took
            phase: {"per_s": c["calls"] / wall, "streams": c["streams"] / c["calls"], "chunks": c["chunks"] / c["calls"]}
            for phase, c in sorted(sched.sent.items())
        },
        "anchor_put_off": getattr(detokenize, "renewals_put_off", 0) - put_off,  # its event behind a lane's work
        "graphs_captured": {"n": waited.captured, "seconds": waited.capture_s},  # mid-level: every stream held
        "alloc_retries": waited.alloc_retries,  # each a device-wide wait (CUDA)
        "waits": {  # what else could hold the loop's thread (serve/waits.py)
            "pinned_allocs": waited.pinned_allocs,
            "device_mallocs": waited.device_mallocs,
            "gc_runs": waited.gc_runs,
            "replay_ms": 1e3 * waited.replay_s,
        },
        "iterations": len(iters),
        "wall_s": wall,
    }, done


def prepare(engine: Engine, detokenize: Detokenize | None, cfg: LoadConfig, chunk_tokens: int) -> dict:
    """Before any level: the engine's decode and admission graphs for every shape the levels can
    meet, and the detokenizer's for every batch (where they have them), so that no stream
    stalls while one is captured or compiled mid-level. Then every object so far is frozen out of
    Python's garbage collector (gc.freeze, until `run` ends): a full collection walked ~0.8 M of them, ~400 ms
    of the loop's thread, on an H200's host (levers.md, "H200 detokenizer host"). Returns what it made, how long
    it took (the engine's part, its admissions' within it; the detokenizer's by batch size), the objects frozen
    and (CUDA) the memory it left reserved, split by the engine's and the detokenizer's graph pools."""
    t0, graphs, calls, t_admit = time.perf_counter(), 0, 0, 0.0
    cuda, marks = engine.device.type == "cuda", PoolMarks(engine.device)
    reserved = torch.cuda.memory_reserved(engine.device) if cuda else 0
    if engine.active():  # what ran before (the streams benchmark) ends: the load starts from free slots
        engine.release(engine.active())
    sms = {}  # before any graph is made: a graph runs on the SMs of the stream it was captured on
    for name, owner, method in (("decode_sms", engine, "confine"), ("later_sms", detokenize, "confine_later")):
        if (confine := getattr(owner, method, None)) is None and getattr(cfg, name):
            who = type(owner).__name__ if owner is not None else "a run with no detokenizer"
            raise ValueError(f"benchmark.load.{name}: {who} has no graphs to run on fewer SMs")
        sms[name] = confine(getattr(cfg, name), f"benchmark.load.{name}") if confine else 0
    if capture := getattr(engine, "capture", None):
        admissions = [(b, cfg.prompt_len) for b in range(1, max(1, cfg.prefill_tokens // cfg.prompt_len) + 1)]
        graphs = capture(0, cfg.prompt_len, admissions)  # admissions alone first: their part of the time
        if cuda:
            torch.cuda.synchronize(engine.device)
        t_admit = time.perf_counter() - t0
        graphs += capture(cfg.slots, cfg.prompt_len)
    t_engine = time.perf_counter() - t0
    marks.mark("engine_graphs")  # its snapshot's time counted in the detokenizer's part
    if warm := getattr(detokenize, "warm", None):
        calls = warm(cfg.slots, chunk_tokens, cfg.longest_codes)
    took = time.perf_counter() - t0
    marks.mark("detokenizer_graphs")
    if graphs or calls:
        print(f"load: {graphs} engine graphs and {calls} detokenizer batches made ahead in {took:.1f} s", file=sys.stderr)
    grown = torch.cuda.memory_reserved(engine.device) - reserved if cuda else 0
    gc.collect()
    memory = marks.split()
    gc.freeze()  # Python's full collections walk only what comes after (`run` unfreezes it)
    made = {"engine_graphs": graphs, "detokenizer_batches": calls, "seconds": took, "engine_seconds": t_engine,
            "admission_seconds": t_admit, "reserved_bytes": grown, "frozen_objects": gc.get_freeze_count(),
            **sms}  # fmt: skip
    if by_rows := getattr(detokenize, "warm_s", None):
        made["detokenizer_seconds"] = {str(n): s for n, s in by_rows.items()}
    return made | {"memory": memory} if memory else made


def run(
    engine: Engine,
    detokenize: Detokenize | None,
    clock: Callable[[], float],
    cfg: LoadConfig,
    ids: Ids,
    chunk_tokens: int,
    sampling: Sampling,
    began: float | None = None,
) -> dict:
    """Every level, one after another; the answer and one stream's timeline. `began`: the benchmark's start on
    `clock`, which `search_until_s` counts from. What `prepare` froze out of the garbage collector's walks is
    unfrozen as it ends."""
    try:
        return _levels(engine, detokenize, clock, cfg, ids, chunk_tokens, sampling, began)
    finally:
        gc.unfreeze()


def _levels(
    engine: Engine, detokenize: Detokenize | None, clock: Callable[[], float], cfg: LoadConfig, ids: Ids,
    chunk_tokens: int, sampling: Sampling, began: float | None,
) -> dict:  # fmt: skip
    levels, example, priced = [], None, []
    made, sets, stopped = prepare(engine, detokenize, cfg, chunk_tokens), alone.graph_sets(engine, detokenize), None
    if cfg.warmup_s and cfg.closed:
        warm = LoadConfig(**(cfg.__dict__ | {"duration_s": cfg.warmup_s}))
        level = Level(warm, "closed", max(cfg.closed), ids, torch.Generator().manual_seed(cfg.seed - 1))
        run_level(engine, detokenize, clock, level, chunk_tokens, sampling)

    def one(kind: str, value: float, searched: bool = False) -> dict:
        """Runs a level and records it; its result."""
        nonlocal example
        g, before = torch.Generator().manual_seed(level_seed(cfg.seed, kind, value)), alone.replays(sets)
        result, done = run_level(engine, detokenize, clock, Level(cfg, kind, value, ids, g), chunk_tokens, sampling)
        result = result | {"searched": searched}
        levels.append(result)
        priced.append((result, alone.replays(sets) - before))  # its graphs priced alone once every level has run
        print(
            f"load {kind} {value:g}{' (search)' if searched else ''}: TTFA p99 {result['ttfa_ms']['p99']:.1f} ms, "
            f"{result['underruns']} underruns, {result['tokens_per_s']:.0f} codes/s, busy {result['busy_fraction']:.2f}",
            file=sys.stderr,
        )
        served = [r for r in done if r.error is None and r.ttfa_s is not None]
        if served and kind == "closed":  # the latest closed level's stream arriving nearest its middle
            mid = served[0].t_arrival + cfg.duration_s / 2
            example = timeline(min(served, key=lambda r: abs(r.t_arrival - mid)), pcm_rate(detokenize))
            example["level"] = value
        return result

    for kind, values in (("closed", cfg.closed), ("open", cfg.rates)):
        for value in values:
            one(kind, value)
    held = {lv["value"]: holds(lv, cfg.ttfa_slo_ms) for lv in levels if lv["kind"] == "closed"}
    while cfg.search_step and (n := next_search_level(held, cfg.search_step, cfg.search_max, cfg.search_within)) is not None:
        if began is not None and (stopped := past_budget(cfg, levels, clock() - began, n)):
            break
        held[n] = holds(one("closed", n, searched=True), cfg.ttfa_slo_ms)
    ok = [n for n, yes in held.items() if yes]
    if sets:  # every stream has ended: replaying a graph alone writes only free slots and pages
        alone.price(priced, sets, getattr(detokenize, "priorities", {}).get("urgent"))
    return {
        "config": cfg.__dict__,
        "levels": levels,
        "ttfa_slo_ms": cfg.ttfa_slo_ms,
        "streams_at_slo": max(ok, default=0),
        "search_stopped": stopped,
        "timeline": example,
        "prepared": made,
        "lane_priorities": getattr(detokenize, "priorities", {}),  # the detokenizer's lanes' (CUDA; lower is higher)
    }
