"""What decode steps beside them cost the codec's calls (and they the steps), and whether SMs kept from decoding help.

Under load a stream's first call takes about twice its time alone (H200 run 20, FP8 at 4 users: its first PCM
28.4 ms p50 after its first chunk went, the call priced alone 16.9 ms), with decode steps running beside it. This
times, with no engine (a fresh machine, ~2 min at the true shape):

- the codec's calls as serving makes them (`benchmark.codec` as the configs give it; each stream in its flow
  slot, from CUDA graphs captured on a stream of the urgent lane's priority), PROBE_CALLS of them: `first` (a
  stream's first call) and `held` (a later call of `load.detokenize_hold` chunks a stream), at each of
  PROBE_BATCHES streams;
- a stand-in for a decode step: every linear of PROBE_LAYERS decoder layers of MOSS-Speech's shape (bf16; 36:
  an audio-mode step's trunk and branch, ~13.9 GB read, near bf16's step; 20: ~7.7 GB, near FP8's), at each of
  PROBE_ROWS rows, one CUDA graph, on a stream of the decode graphs' priority;
- each alone, then the call timed while the stand-in runs back to back beside it, and the stand-in's steps timed
  while the calls run, then the same with the stand-in on a CUDA green context of each of PROBE_SMS SMs
  (`torch.cuda.green_contexts`), so the rest are the codec's alone.

Each arm prints a line; every figure goes to the JSON. An arm that fails is recorded with its error.

    PROBE_CALLS=first,held PROBE_LAYERS=36 PROBE_ROWS=1,16 PROBE_SMS=100,116 PYTHONPATH=. \\
        python benchmarks/probe_beside.py <out.json> config/full.yaml config/h200.yaml
"""

import dataclasses
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from workflow.codec.settings import CodecTiming, stream_decoder
from workflow.codec.timing import Calls, close

HIDDEN, INTER, QKV = 4096, 12288, (32 + 2 * 8) * 128  # MOSS-Speech's trunk (FACTS.md 1)
URGENT, DECODE = -3, -2  # the stream priorities serving gives the urgent lane and the decode graphs (serve/lanes)
REPEAT = 20


def ints(name: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, default).split(",") if x]


def codec_settings(files: list[str]) -> CodecTiming:
    """`benchmark.codec` as the configs give it, its held call at `load.detokenize_hold` chunks (as probe_codec.py)."""
    codec: dict = {}
    held = 1
    for f in ["config/config.yaml", *files]:
        bench = yaml.safe_load(Path(f).read_text()).get("benchmark") or {}
        codec |= bench.get("codec") or {}
        held = (bench.get("load") or {}).get("detokenize_hold", held)
    return CodecTiming.from_dict(codec | {"baseline": False, "held": held})


class StandIn:
    """A decode step's weight reads: each linear of `layers` layers at `rows` rows, one graph on `stream`."""

    def __init__(self, layers: int, rows: int, stream: torch.cuda.Stream, device: torch.device):
        shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
        self.w = [torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers) for o, i in shapes]
        self.x = {n: torch.randn(rows, n, device=device, dtype=torch.bfloat16) for n in (HIDDEN, INTER)}
        self.stream, self.graph = stream, torch.cuda.CUDAGraph()
        self.bytes = sum(w.numel() * 2 for w in self.w)
        torch.cuda.synchronize()  # the weights made on the default stream before another reads them
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step()
        stream.synchronize()
        with torch.cuda.graph(self.graph, stream=stream):
            self.step()

    def step(self) -> None:
        for w in self.w:
            self.x[w.shape[1]] @ w.t()

    def replay(self, n: int) -> list[torch.cuda.Event]:
        """n steps back to back on its stream; an event after each (the first: before them)."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        with torch.cuda.stream(self.stream):
            events[0].record()
            for e in events[1:]:
                self.graph.replay()
                e.record()
        return events


def timed(call: Callable[[], object], stream: torch.cuda.Stream, n: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """n calls on `stream`, each between two events."""
    out = []
    with torch.cuda.stream(stream):
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            out.append((a, b))
    return out


def beside(
    call: Callable[[], object], codec: torch.cuda.Stream, standin: StandIn | None, alone_ms: float, step_ms: float
) -> dict:
    """The call's ms (median of REPEAT) with the stand-in's steps running beside it, and the stand-in's step ms
    while the calls ran (its steps that began after the first call began and ended before the last ended)."""
    torch.cuda.synchronize()
    steps = standin.replay(int(1.5 * REPEAT * 2 * alone_ms / step_ms) + 20) if standin else None
    calls = timed(call, codec, REPEAT)
    torch.cuda.synchronize()
    out = {"call_ms": statistics.median(a.elapsed_time(b) for a, b in calls)}
    if steps:
        t0 = steps[0]
        start, end = t0.elapsed_time(calls[0][0]), t0.elapsed_time(calls[-1][1])
        at = [t0.elapsed_time(e) for e in steps[1:]]
        inside = [b - a for a, b in itertools.pairwise([0.0, *at]) if a >= start and b <= end]
        out |= {"covered": at[-1] >= end, "standin_step_ms": statistics.median(inside) if inside else None}
    return out


def green_stream(sms: int, device: torch.device) -> tuple[torch.cuda.Stream, dict]:
    """A stream of a green context of `sms` SMs, at the decode graphs' priority where the API takes one."""
    from torch.cuda.green_contexts import GreenContext

    ctx = GreenContext.create(num_sms=sms, device_id=device.index or 0)
    if not hasattr(ctx, "Stream"):
        raise RuntimeError(f"this torch ({torch.__version__}) has no GreenContext.Stream: {sorted(dir(ctx))}")
    return ctx.Stream(), {"context": ctx}


def main() -> None:
    out, files = Path(sys.argv[1]), sys.argv[2:]
    device = torch.device("cuda")
    t = codec_settings(files)
    dec, voice = stream_decoder(t, device)
    at = Calls.of(t, dec.cfg)
    codec = torch.cuda.Stream(device, priority=URGENT)
    decode = torch.cuda.Stream(device, priority=DECODE)
    results: dict = {"codec": dataclasses.asdict(t), "torch": torch.__version__, "arms": []}
    sms_total = torch.cuda.get_device_properties(device).multi_processor_count
    for call, batch in itertools.product(os.environ.get("PROBE_CALLS", "first,held").split(","), ints("PROBE_BATCHES", "1,3")):
        if call == "first":
            run = at.in_slots(t, dec, voice, batch, "first", graphs=True)
        else:
            run = at.held_in_slots(t, dec, voice, batch, graphs=True)
        with torch.cuda.stream(codec):
            for _ in range(3):  # its graphs captured at the urgent lane's priority, then warm
                run.chunk()
        alone = beside(run.chunk, codec, None, 1.0, 1.0)["call_ms"]
        print(f"{call} call, batch {batch}: alone {alone:.2f} ms", flush=True)
        for layers in ints("PROBE_LAYERS", "36"):
            for rows in ints("PROBE_ROWS", "1,16"):
                for sms in [sms_total, *ints("PROBE_SMS", "100,116")]:
                    arm = {"call": call, "batch": batch, "layers": layers, "rows": rows, "standin_sms": sms, "alone_ms": alone}
                    try:
                        stream, keep = (decode, {}) if sms == sms_total else green_stream(sms, device)
                        standin = StandIn(layers, rows, stream, device)
                        steps = standin.replay(20)
                        torch.cuda.synchronize()
                        step = statistics.median(a.elapsed_time(b) for a, b in itertools.pairwise(steps))
                        arm |= {"standin_gb": standin.bytes / 1e9, "standin_alone_ms": step}
                        arm |= beside(run.chunk, codec, standin, alone, step)
                        del standin, keep
                        torch.cuda.empty_cache()  # each arm's stream keeps its own blocks: give them back
                    except Exception as e:  # an arm that cannot run (a green context on this torch) must not cost the rest
                        arm["error"] = f"{type(e).__name__}: {e}"
                    results["arms"].append(arm)
                    print(" | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in arm.items()), flush=True)
                    out.write_text(json.dumps(results, indent=1))
        close(run)
        del run


if __name__ == "__main__":
    main()
