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
  while the calls run; then with the stand-in on a CUDA green context of each of PROBE_SMS SMs, the codec on the
  whole GPU (`decode N`), and with the codec on a green context of the SMs left (`split N`: each its own SMs).

Green contexts come from the driver through cuda-python (`cuda.bindings.driver`: the SMs it gives, rounded to
its granularity, are recorded), else from `torch.cuda.green_contexts` where it has `Stream`. Whether a stream's
green context confines its kernels is checked first, for each context: an 8192^3 bf16 matmul eager on its
stream, from a graph captured there, and from a graph captured on a stream of the whole GPU and replayed there.

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


def checked(result: tuple) -> object:
    """A cuda-python call's value, or its error raised."""
    err, *value = result
    if int(err):
        raise RuntimeError(f"CUDA driver error {err}")
    return value[0] if len(value) == 1 else value


def green_streams(sms: int, device: torch.device, priorities: tuple[int, int]) -> tuple[list[torch.cuda.Stream], list[int]]:
    """Streams of two green contexts that split the GPU: `sms` SMs (as the driver rounds it) and the rest,
    at `priorities`; and their SM counts."""
    try:
        from cuda.bindings import driver
    except ImportError:  # torch's own: one context of `sms` and no second (the rest stays the whole GPU's)
        from torch.cuda.green_contexts import GreenContext

        ctx = GreenContext.create(num_sms=sms, device_id=device.index or 0)
        if not hasattr(ctx, "Stream"):
            raise RuntimeError(f"no cuda-python, and this torch ({torch.__version__}) has no GreenContext.Stream") from None
        KEEP.append(ctx)
        return [ctx.Stream()], [sms]
    dev = checked(driver.cuDeviceGet(device.index or 0))
    whole = checked(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = checked(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms))
    streams, counts = [], []
    for part, priority in zip([groups[0], rest], priorities, strict=True):
        desc = checked(driver.cuDevResourceGenerateDesc([part], 1))
        ctx = checked(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = checked(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
        KEEP.append(ctx)
        streams.append(torch.cuda.ExternalStream(int(raw), device=device))
        counts.append(int(part.sm.smCount))
    return streams, counts


KEEP: list = []  # the green contexts made, alive to the end (their streams are theirs)


def confined(stream: torch.cuda.Stream, whole: torch.cuda.Stream) -> dict:
    """An 8192^3 bf16 matmul's ms on `stream`: eager, from a graph captured on it, and from a graph captured on
    `whole` (a stream of the whole GPU) replayed on it; slower than on `whole` where its context confines it."""
    a = torch.randn(8192, 8192, device=whole.device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out = {}
    for name, capture in [("eager", None), ("graph", stream), ("graph_from_whole", whole)]:
        graph = None
        if capture is not None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(capture):
                a @ a
            capture.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                a @ a
        events = timed((lambda: a @ a) if graph is None else graph.replay, stream, 6)
        torch.cuda.synchronize()
        out[f"matmul_{name}_ms"] = statistics.median(x.elapsed_time(y) for x, y in events[1:])
    return out


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
    parts: dict[int, tuple[list[torch.cuda.Stream], list[int]]] = {}  # asked SMs -> (decode, codec) streams, SMs
    results["green"] = [{"asked": sms_total} | confined(decode, decode)]
    for sms in ints("PROBE_SMS", "100,116"):
        row: dict = {"asked": sms}
        try:
            parts[sms] = green_streams(sms, device, (DECODE, URGENT))
            row["sms"] = parts[sms][1]
            row |= {f"{k}_{i}": v for i, s in enumerate(parts[sms][0]) for k, v in confined(s, decode).items()}
        except Exception as e:  # green contexts this machine cannot make: the whole-GPU arms still run
            row["error"] = f"{type(e).__name__}: {e}"
        results["green"].append(row)
        print(row, flush=True)
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
                modes = [("shared", sms_total, decode, codec)]
                modes += [(f"decode {n}", parts[n][1][0], parts[n][0][0], codec) for n in parts]
                modes += [(f"split {n}", parts[n][1][0], *parts[n][0]) for n in parts if len(parts[n][0]) == 2]
                for mode, sms, stream, codec_stream in modes:
                    arm = {"call": call, "batch": batch, "layers": layers, "rows": rows, "mode": mode, "standin_sms": sms}
                    arm["alone_ms"] = alone
                    try:
                        if codec_stream is not codec:  # the call alone on the SMs the split leaves it
                            arm["alone_ms"] = beside(run.chunk, codec_stream, None, 1.0, 1.0)["call_ms"]
                        standin = StandIn(layers, rows, stream, device)
                        steps = standin.replay(20)
                        torch.cuda.synchronize()
                        step = statistics.median(a.elapsed_time(b) for a, b in itertools.pairwise(steps))
                        arm |= {"standin_gb": standin.bytes / 1e9, "standin_alone_ms": step}
                        arm |= beside(run.chunk, codec_stream, standin, arm["alone_ms"], step)
                        del standin
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
