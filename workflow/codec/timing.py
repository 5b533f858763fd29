"""What the codec decoder's stream costs, stage by stage: the benchmark's `codec` section.

A stream's flow call (stream.py) re-runs the flow front end on every code so far (prompt first,
the last `lookahead` codes as context), integrates the ODE (each step one estimator pass at 2B
rows: classifier-free guidance) and HiFT vocodes the new frames with its 8 cached ones. With the
flow cache (estimator.Past) the ODE runs only the frames after the last call's end, against the
cached keys and values of those before (the first call: after the voice prompt's past, made once
per voice); without it, over every frame so far, so a call costs more the later it comes. Two
calls are timed: the first chunk (the prompt + first hop + lookahead codes) and one `later_codes`
into the reply; each at every batch in `batches` (streams whose calls fall due together, the
same length here).

Three ways to run it, on the same weights (random, of the preset's shape, or the codec's checkpoint):
- `baseline`: the official code's structure (no cache; the estimator's own forward, its q, k and v
  from one GEMM as ours), float32 and eager, one stream at a time (batch 1); HiFT there is the same
  batched call, eager;
- ours: `dtype`, the estimator's fast pass (fast.py), every frame each call (what the benchmark's
  stream runs on CUDA), and on CUDA the front end, one ODE step and the whole solve each replayed
  from a CUDA graph per shape (an ODE step alone makes its resnets' time inputs, which a solve makes
  for every step at once: ten steps cost a little less than ten of it); HiFT (float32) runs every
  stream's frames at once as serving does (`CodecDecoder.hift_calls`: F0, each stream's NSF source
  continued, the network and iSTFT), from a graph;
- `flow_cache` ("ours, flow cache"): ours solving only the new frames against the cached past
  (graphed per past length here), the cache's A/B. Its past costs ~2.3 MB a frame a stream at the
  true shape in bf16, twice that while a call copies it;
- `slots` > 0 ("ours, slots"): the call as serving runs it (slots.py): each stream in its flow slot,
  solving only its new frames (as many as serving's calls: `CodecBatch.new_frames`), with the slots'
  kernels where `kernels` is on; at the batches up to `slots` (serving holds no more streams in slots);
  with `held` > 1 also "later, N held": N chunks a row solved in one call, as serving's held chunks are
  (`CodecBatch.later_frames`), and their HiFT calls, one a chunk, as rows of one pass, as serving runs them
  (`CodecBatch.hift`: there F0 and the rest are two graphs, a stream's source phase carried between).

`ttfa_ms`: one stream end to end at batch 1, the engine's prefill and decode steps to the first
chunk's codes, then that chunk's decode as the benchmark's stream runs it (in a slot if `slots`):
time to first audio with the real decoder, the stream's host bookkeeping (stream.py) left out."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from workflow import roofline
from workflow.codec.config import CodecConfig
from workflow.codec.decoder import F0_RADIUS, CodecDecoder, VoicePrompt
from workflow.codec.estimator import Past
from workflow.codec.settings import CodecTiming, check_hift, decoders, voice_of
from workflow.codec.slots import FlowSlots
from workflow.codec.solver import solve
from workflow.codec.stream import MEL_CACHE, first_hop
from workflow.cudagraphs import Graphs
from workflow.report import percentiles


class Runner:
    """One flow call and its HiFT, batched over streams of one length, each stage a callable."""

    def __init__(self, dec: CodecDecoder, batch: int, body: int, prompt_codes: int, graphs: bool, past_frames: int = 0):
        """past_frames > 0: the flow cache holds that many frames (made here, by the solve over them);
        the call solves the rest."""
        cfg, dev = dec.cfg, dec.device
        dtype = dec.estimator.final_proj.weight.dtype
        g = torch.Generator().manual_seed(batch * 7919 + body)
        la, stride = cfg.encoder.lookahead, cfg.encoder.stride
        self.dec, self.batch, self.frames = dec, batch, body * stride
        self.tokens = torch.randint(0, 16384, (batch, body), generator=g).to(dev)
        self.context = torch.randint(0, 16384, (batch, la), generator=g).to(dev)
        self.lengths = torch.full((batch,), body, device=dev)
        self.spks = dec.flow.speaker(torch.randn(batch, cfg.encoder.spk_dim, generator=g).to(dev, dtype))
        self.cond = torch.zeros(batch, cfg.encoder.mel, self.frames, device=dev, dtype=dtype)
        self.cond[:, :, : prompt_codes * stride] = torch.randn(cfg.encoder.mel, prompt_codes * stride, generator=g).to(dev)
        self.mask = torch.ones(batch, 1, self.frames, device=dev, dtype=dtype)
        self.mu = self.front_end()
        self.new = cfg.chunk * stride  # the frames a call keeps
        two = (torch.cat([v, v]) for v in (self.mask, self.mu, self.spks, self.cond))
        self.pass_args = (torch.randn(2 * batch, cfg.encoder.mel, self.frames, generator=g).to(dev, dtype), *two)
        self.t = torch.full((2 * batch,), 0.5, device=dev, dtype=dtype)
        self.start, self.past = past_frames, None
        if past_frames:
            self.past = [Past() for _ in range(cfg.solver.steps)]
            with torch.no_grad():
                solve(
                    dec.velocity,
                    *self._frames(self.mu, self.mask, self.spks, self.cond, end=past_frames),
                    cfg.solver,
                    True,
                    dec.noise,
                    self.past,
                )
        vocoded = MEL_CACHE + self.new  # a later call's HiFT frames: the cached, then the new
        self.mel = torch.randn(batch, cfg.encoder.mel, F0_RADIUS + 1 + vocoded, generator=g).to(dev)
        self.seeds = torch.arange(batch, device=dev)  # the streams' source noise (NsfSource.noise)
        self.first = torch.full((batch,), 200, device=dev)  # the first frame vocoded: a call 4 s in
        self.before = torch.zeros(batch, dec.source.width, dtype=torch.float64, device=dev)
        self.graphs = Graphs(dev) if graphs else None  # each stage's graph made at its first call
        stages = {"front_end": self.front_end, "ode_step": self.ode_step, "solve": self.solve}
        self.stages: dict[str, Callable[[], object]] = {name: self._replayed(name, fn) for name, fn in stages.items()}
        self.stages["hift"] = self.hift

    def _replayed(self, name: str, fn: Callable[[], object]) -> Callable[[], object]:
        """fn, or on CUDA its replay from the graph `Graphs` keeps for `name`."""
        return fn if self.graphs is None else functools.partial(self.graphs.run, name, fn)

    @torch.no_grad()
    def front_end(self) -> torch.Tensor:
        """mu: FlowFrontEnd.forward less its argument checks (they read the device on the host)."""
        f = self.dec.flow
        x, ctx = f.input_embedding(self.tokens), f.input_embedding(self.context)
        return f.encoder_proj(f.encoder(x, self.lengths, self.dec.cfg.chunk, ctx)).transpose(1, 2)

    def _frames(self, *args: torch.Tensor, end: int | None = None) -> list[torch.Tensor]:
        """The per-frame arguments ([B, C, T]) cut to the frames a call solves: from the past's end, or to `end`."""
        cut = slice(0, end) if end is not None else slice(self.start, None)
        return [a[..., cut] if a.dim() == 3 else a for a in args]

    def _copy(self, i: int | None = None) -> list[Past] | Past | None:
        """A fresh copy of the past (step i's, or every step's), so that each timed call starts from it."""
        if self.past is None:
            return None
        return self.past[i].copy() if i is not None else [p.copy() for p in self.past]

    @torch.no_grad()
    def ode_step(self) -> torch.Tensor:
        """One estimator pass over 2B rows (the conditioned and the unconditioned half), the middle step's past."""
        x, mask, mu, spks, cond = self._frames(*self.pass_args)
        return self.dec.velocity(x, mask, mu, self.t, spks, cond, streaming=True, past=self._copy(self.dec.cfg.solver.steps // 2))

    @torch.no_grad()
    def solve(self) -> torch.Tensor:
        cfg, args = self.dec.cfg, self._frames(self.mu, self.mask, self.spks, self.cond)
        return solve(self.dec.velocity, *args, cfg.solver, True, self.dec.noise, self._copy())

    def past_bytes(self) -> int:
        """The flow cache's bytes, every step's (0 without it)."""
        return sum(p.nbytes() for p in self.past or [])

    def hift(self) -> torch.Tensor:
        """HiFT over every stream's 8 cached + new frames at once (float32), as serving runs a later call's
        (a graph on CUDA): F0 (the context frames for its reach), each stream's NSF source continued, the
        network and the iSTFT."""
        return self._replayed("hift", self.vocode)()

    def hift_rows(self, calls: int) -> None:
        """HiFT over `calls` chunk calls a stream, as rows of one pass (serving's held chunks)."""
        rows = [x.repeat_interleave(calls, 0) for x in (self.mel, self.seeds, self.first, self.before)]
        self.mel, self.seeds, self.first, self.before = rows
        self.first += torch.arange(calls, device=self.first.device).repeat(len(self.first) // calls) * self.new

    @torch.no_grad()
    def vocode(self) -> torch.Tensor:
        return self.dec.hift_calls(self.mel, self.seeds, self.first, self.before, context=F0_RADIUS + 1)[0]

    def chunk(self) -> None:
        """The whole call: front end, solve, HiFT."""
        for name in ("front_end", "solve", "hift"):
            self.stages[name]()


class SlotRunner(Runner):
    """The flow call as serving makes it with the flow slots (slots.py): each of `batch` streams in its
    own slot (its codes the voice prompt's, then the reply's), solving only its frames from `start` (the
    first call: the voice prompt's past's end) to its end, `new` frames a row; the slots hold the frames
    before `start` (solved before timing, in one call). A timed call is run again as it was: no slot
    advances."""

    def __init__(
        self, dec: CodecDecoder, voice: VoicePrompt, batch: int, body: int, graphs: bool, new: int, start: int, fp8: bool = False
    ) -> None:
        super().__init__(dec, batch, body, len(voice.codes), graphs)
        self.tokens[:, : len(voice.codes)] = voice.codes.to(dec.device)
        self.mu = self.front_end()
        base = dec.past_frames(len(voice.codes))
        self.start, rows = start, list(range(batch))
        self.slots = FlowSlots(dec, voice, batch, self.frames + new - base, fp8=fp8)
        if start > base:
            earlier = self.slots.index(rows, [base] * batch, [start] * batch, start - base, self.frames)
            with torch.no_grad():
                self.slots.solve(self.mu, *(x.to(dec.device) for x in earlier.tensors()))
            self.slots.advance(rows)
        ix = self.slots.index(rows, [start] * batch, [self.frames] * batch, new, self.frames)
        self.index = [x.to(dec.device) for x in ix.tensors()]
        mid = dec.cfg.solver.steps // 2
        stages = {"front_end": self.front_end, "ode_step": lambda: self.slot_solve(mid), "solve": self.slot_solve}
        self.stages = {name: self._replayed(name, fn) for name, fn in stages.items()} | {"hift": self.hift}

    @torch.no_grad()
    def slot_solve(self, step: int | None = None) -> torch.Tensor:
        return self.slots.solve(self.mu, *self.index, step=step)

    def past_bytes(self) -> int:
        """The slots' bytes, every stream's."""
        return self.slots.nbytes()


@dataclass(frozen=True)
class Calls:
    """Where the timed calls fall in a stream: each call's body codes (the voice prompt's and the reply's so
    far), the frames its flow cache holds then, and the frames a first call solves a row (CodecBatch.new_frames)."""

    hop0: int  # the first call's reply codes (CodecStream's first hop)
    codes: dict[str, int]  # "first", "later" -> body codes
    cached: dict[str, int]  # "first": the voice prompt's past; "later": the last call's end
    new: int

    @classmethod
    def of(cls, t: CodecTiming, cfg: CodecConfig) -> Calls:
        la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
        hop0 = first_hop(t.prompt_codes, chunk, stride)
        codes = {"first": t.prompt_codes + hop0, "later": t.prompt_codes + t.later_codes + hop0}
        cf = chunk * stride  # a chunk's frames: a past ends on a chunk boundary
        cached = {"first": cfg.past_frames(t.prompt_codes), "later": (codes["later"] - chunk) * stride // cf * cf}
        new = -(-((t.prompt_codes + hop0 + la) * stride - cached["first"]) // cf) * cf
        return cls(hop0, codes, cached, new)

    def in_slots(self, t: CodecTiming, dec: CodecDecoder, voice: VoicePrompt, batch: int, call: str, graphs: bool) -> SlotRunner:
        """`batch` streams' first or later calls as serving makes them, each stream in its flow slot."""
        return SlotRunner(dec, voice, batch, self.codes[call], graphs, self.new, self.cached[call], t.fp8_pages)

    def held_in_slots(self, t: CodecTiming, dec: CodecDecoder, voice: VoicePrompt, batch: int, graphs: bool) -> SlotRunner:
        """`batch` streams' later calls of `t.held` chunks each, their frames in one round and their HiFT in one
        pass, as CodecBatch makes a held batch."""
        cf = dec.cfg.chunk * dec.cfg.encoder.stride
        held = t.held * cf
        start = self.cached["later"] - held + cf
        run = SlotRunner(dec, voice, batch, self.codes["later"], graphs, max(self.new, held), start, t.fp8_pages)
        run.hift_rows(t.held)
        return run


def measure(t: CodecTiming, device: torch.device, first_codes: Callable[[int], object] | None = None) -> dict:
    """The codec section: parameters, each stage's ms per call position, variant and batch, and
    (first_codes given: it runs the engine to a stream's first k codes) time to first audio, the
    engine's part and the first chunk's decode timed as one."""
    ours, base = decoders(t, device)
    cfg = ours.cfg
    la = cfg.encoder.lookahead
    at = Calls.of(t, cfg)
    hop0, calls, cached = at.hop0, at.codes, at.cached
    graphs = t.graphs and device.type == "cuda"
    voice = voice_of(t, ours)
    check_hift(t, ours, voice)

    def runner(variant: str, dec: CodecDecoder, batch: int, call: str, use_graphs: bool) -> Runner:
        if variant == "ours, slots":
            return at.in_slots(t, dec, voice, batch, call, use_graphs)
        return Runner(dec, batch, calls[call], t.prompt_codes, use_graphs, cached[call] if variant == "ours, flow cache" else 0)

    rows = []

    def timed(variant: str, call: str, batch: int, body: int, run: Runner) -> None:
        row = {"variant": variant, "call": call, "batch": batch, "codes": body + la, "frames": run.frames}
        row |= {"solved_frames": run.frames - run.start, "past_mib": run.past_bytes() / 2**20}
        rows.append(row | stage_ms(run, device, t.repeat))
        close(run)

    variants = [("ours", ours, t.batches, graphs)]
    variants += [("ours, flow cache", ours, t.batches, graphs)] if t.flow_cache else []
    variants += [("ours, slots", ours, tuple(b for b in t.batches if b <= t.slots), graphs)] if t.slots else []
    variants += [("baseline", base, (1,), False)] if base else []
    for variant, dec, batches, use_graphs in variants:
        for call, body in calls.items():
            for batch in batches:
                timed(variant, call, batch, body, runner(variant, dec, batch, call, use_graphs))
    if t.slots and t.held > 1:  # a held batch's call: its chunks' frames in one round, as CodecBatch solves them
        for batch in (b for b in t.batches if b <= t.slots):
            slotted = at.held_in_slots(t, ours, voice, batch, graphs)
            timed("ours, slots", f"later, {t.held} held", batch, calls["later"], slotted)
            del slotted  # its graphs go now, not inside another's capture (close)
    out = {
        "config": asdict(t),
        "weights": t.weights or "random",
        "parameters": {
            "front_end": sum(p.numel() for p in ours.flow.parameters()),
            "estimator": sum(p.numel() for p in ours.estimator.parameters()),
            "hift": sum(p.numel() for p in ours.hift.parameters()),
        },
        "graphs": graphs,  # whether ours ran from CUDA graphs (asked for, and on CUDA)
        "compiled": ours.compiled,  # whether ours ran its estimator's blocks compiled
        "kernels": ours.kernels,  # whether the slots' transformer blocks ran as Triton kernels and ours' HiFT fused (HiFT.fuse)
        "steps": cfg.solver.steps,
        "cfg_rate": cfg.solver.cfg_rate,
        "first_codes": hop0 + la,
        "calls": rows,
    }
    if first_codes is not None:
        run = runner("ours, slots" if t.slots else "ours", ours, 1, "first", graphs)

        def first_audio() -> None:
            first_codes(hop0 + la)
            run.chunk()

        out["ttfa_ms"] = percentiles(roofline.timed_ms(first_audio, device, t.repeat, warmup=1))
        close(run)
        del run, first_audio
    gc.collect()
    return out


def stage_ms(run: Runner, device: torch.device, repeat: int) -> dict[str, float]:
    """Each stage's median ms, and the whole call's."""
    stages = [*run.stages.items(), ("chunk", run.chunk)]
    return {f"{name}_ms": roofline.median(roofline.timed_ms(fn, device, repeat, warmup=1)) for name, fn in stages}


def close(run: Runner) -> None:
    """Break a runner's references to itself (its stages and graphs hold its bound methods), so
    that its CUDA graphs are destroyed as soon as the last name for it goes, not when the garbage
    collector next runs: if that falls inside another graph's capture (serving's, made ahead of
    the load), destroying a graph there invalidates that capture."""
    run.stages.clear()
    run.graphs = None
