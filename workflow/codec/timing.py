"""What the codec decoder's stream costs, stage by stage: the benchmark's `codec` section.

A stream's flow call (stream.py) re-runs the flow front end on every code so far (prompt first,
the last `lookahead` codes as context), integrates the ODE over all those frames (each step one
estimator pass at 2B rows: classifier-free guidance), keeps the 20 new frames, and HiFT vocodes
them with its 8 cached ones. So a call costs more the later it comes. Two calls are timed: the
first chunk (the prompt + chunk + lookahead codes) and one `later_codes` into the reply; each at
every batch in `batches` (streams whose calls fall due together, the same length here).

Two ways to run it, on the same weights (random, of the preset's shape, or the codec's checkpoint):
- `baseline`: the official code's structure, float32 and eager, one stream at a time (batch 1);
  HiFT there is the same batched call, eager;
- ours: `dtype`, and on CUDA the front end, one ODE step and the whole solve each replayed from a
  CUDA graph per shape; HiFT (float32) runs every stream's frames at once, its network and iSTFT
  from a graph, its NSF source eager (its noise comes from a generator).

`ttfa_ms`: one stream end to end at batch 1, the engine's prefill and decode steps to the first
chunk's codes, then that chunk's decode with our runner: time to first audio with the real
decoder, the stream's host bookkeeping (stream.py) left out."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workflow import roofline
from workflow.codec import checkpoint
from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder
from workflow.codec.solver import solve
from workflow.cudagraphs import Graphs
from workflow.report import percentiles

PRESETS = {"tiny": CodecConfig.tiny, "full": CodecConfig}
CACHE = Path("results/.hub-cache")  # where hf: weights are fetched, as the download rule does


@dataclass(frozen=True)
class CodecTiming:
    preset: str = "tiny"  # tiny | full (the true shape)
    dtype: str = "float32"  # ours: float32 | bfloat16 (the front end and the flow; HiFT stays float32)
    prompt_codes: int = 10  # the voice prompt's codes (a multiple of the chunk keeps the grid aligned)
    later_codes: int = 20  # where the later call falls: codes of the reply already decoded
    batches: tuple[int, ...] = (1, 2)
    repeat: int = 3
    baseline: bool = True  # also time the official structure (float32, eager, batch 1)
    weights: str | None = None  # None: random; local:<dir> or hf:<repo>@<rev>: the codec's checkpoint (checkpoint.py)
    seed: int = 0
    graphs: bool = True  # CUDA only

    @classmethod
    def from_dict(cls, d: dict) -> CodecTiming:
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"benchmark.codec: unknown key(s) {', '.join(unknown)}")
        if d.get("preset", "tiny") not in PRESETS:
            raise ValueError(f"benchmark.codec.preset: '{d['preset']}' is not one of {', '.join(PRESETS)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


class Runner:
    """One flow call and its HiFT, batched over streams of one length, each stage a callable."""

    def __init__(self, dec: CodecDecoder, batch: int, body: int, prompt_codes: int, graphs: bool):
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
        self.mel = torch.randn(batch, cfg.encoder.mel, 8 + self.new, generator=g).to(dev)
        self.source = torch.zeros(batch, 1, (8 + self.new) * cfg.hift.hop, device=dev)
        self.noise = torch.Generator(dev).manual_seed(0)
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

    @torch.no_grad()
    def ode_step(self) -> torch.Tensor:
        """One estimator pass over 2B rows (the conditioned and the unconditioned half)."""
        x, mask, mu, spks, cond = self.pass_args
        return self.dec.estimator(x, mask, mu, self.t, spks, cond, streaming=True)

    @torch.no_grad()
    def solve(self) -> torch.Tensor:
        cfg = self.dec.cfg
        return solve(self.dec.estimator, self.mu, self.mask, self.spks, self.cond, cfg.solver, True, self.dec.noise)

    @torch.no_grad()
    def hift(self) -> torch.Tensor:
        """HiFT over every stream's 8 cached + new frames at once (float32): f0 and the NSF source
        (eager: its noise comes from a generator), then the network and the iSTFT (a graph on CUDA)."""
        self.source.copy_(self.dec.hift.source(self.mel, self.noise))
        return self._replayed("vocode", self.vocode)()

    @torch.no_grad()
    def vocode(self) -> torch.Tensor:
        """HiFT's network and iSTFT over the mel and the source in place."""
        return self.dec.hift.decode(self.mel, self.source)

    def chunk(self) -> None:
        """The whole call: front end, solve, HiFT."""
        for name in ("front_end", "solve", "hift"):
            self.stages[name]()


def decoders(t: CodecTiming, device: torch.device, cache_dir: Path = CACHE) -> tuple[CodecDecoder, CodecDecoder | None]:
    """Ours (t.dtype; HiFT float32) and the baseline (float32), one set of weights: the checkpoint's,
    checked against the preset's shape, or random."""
    torch.manual_seed(t.seed)
    cfg = PRESETS[t.preset]()
    base = (checkpoint.load(checkpoint.fetch(t.weights, cache_dir), cfg) if t.weights else CodecDecoder(cfg)).eval().to(device)
    base.noise.buffer = base.noise.buffer.to(device)  # read inside the solve's graph: no host copy there
    ours = CodecDecoder(base.cfg).eval().to(device)
    ours.load_state_dict(base.state_dict())
    dtype = getattr(torch, t.dtype)
    ours.flow.to(dtype)
    ours.estimator.to(dtype)
    ours.noise.buffer = base.noise.buffer
    return ours, (base if t.baseline else None)


def measure(t: CodecTiming, device: torch.device, first_codes: Callable[[int], object] | None = None) -> dict:
    """The codec section: parameters, each stage's ms per call position, variant and batch, and
    (first_codes given: it runs the engine to a stream's first k codes) time to first audio, the
    engine's part and the first chunk's decode timed as one."""
    ours, base = decoders(t, device)
    cfg = ours.cfg
    la, chunk = cfg.encoder.lookahead, cfg.chunk
    calls = {"first": t.prompt_codes + chunk, "later": t.prompt_codes + t.later_codes + chunk}  # body codes
    graphs = t.graphs and device.type == "cuda"
    rows = []
    variants = [("ours", ours, t.batches, graphs)] + ([("baseline", base, (1,), False)] if base else [])
    for variant, dec, batches, use_graphs in variants:
        for call, body in calls.items():
            for batch in batches:
                run = Runner(dec, batch, body, t.prompt_codes, use_graphs)
                row = {"variant": variant, "call": call, "batch": batch, "codes": body + la, "frames": run.frames}
                rows.append(row | stage_ms(run, device, t.repeat))
                close(run)
                del run
    out = {
        "config": asdict(t),
        "weights": t.weights or "random",
        "parameters": {
            "front_end": sum(p.numel() for p in ours.flow.parameters()),
            "estimator": sum(p.numel() for p in ours.estimator.parameters()),
            "hift": sum(p.numel() for p in ours.hift.parameters()),
        },
        "graphs": graphs,  # whether ours ran from CUDA graphs (asked for, and on CUDA)
        "steps": cfg.solver.steps,
        "first_codes": chunk + la,
        "calls": rows,
    }
    if first_codes is not None:
        run = Runner(ours, 1, calls["first"], t.prompt_codes, graphs)

        def first_audio() -> None:
            first_codes(chunk + la)
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
