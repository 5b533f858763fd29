"""Probe (ledger: "H200 codec step"): where an ODE step of the codec's slotted flow call goes, by kernel,
at one stream's first call and at a held batch (`streams` streams, `held` chunks a row solved at once:
serving's later lane, ~8 x the step's compute floor in H200 run 11), from the step's CUDA graph; and the
step's, solve's and HiFT's ms. A line per kernel name (top 25), then everything as JSON.

    PYTHONPATH=. python benchmarks/probe_step.py <out.json> [preset (full)] [streams (8)] [held (8)]
"""

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from workflow.codec import timing
from workflow.codec.stream import first_hop


def kernels(fn, cuda: bool, n: int = 3) -> tuple[list[tuple[str, float, float]], float, float]:
    """fn's kernels (name, launches a call, us a call) by device time, their count and us a call."""
    fn()
    kind = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[kind]) as prof:
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
    by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device == cuda and (cuda or e.cpu_parent is None):
            by[e.name.split("(")[0][:90]][0] += 1
            by[e.name.split("(")[0][:90]][1] += e.device_time_total if cuda else e.cpu_time_total
    rows = sorted(((k, c / n, us / n) for k, (c, us) in by.items()), key=lambda r: -r[2])
    return rows, sum(r[1] for r in rows), sum(r[2] for r in rows)


def main() -> None:
    out, preset = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "full"
    streams, held = (int(a) for a in (sys.argv[3:5] + ["8", "8"][len(sys.argv[3:5]) :]))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    t = timing.CodecTiming(
        preset=preset, dtype="bfloat16" if cuda else "float32", prompt_codes=46 if preset == "full" else 11,
        later_codes=100 if preset == "full" else 5 * held, batches=(1, streams), repeat=5, baseline=False,
        flow_cache=False, slots=streams, held=held,
    )  # fmt: skip
    ours, _ = timing.decoders(t, dev)
    cfg, voice = ours.cfg, timing.voice_of(t, ours)
    la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
    hop0, cf = first_hop(t.prompt_codes, chunk, stride), chunk * stride
    first, later = t.prompt_codes + hop0, t.prompt_codes + t.later_codes + hop0
    new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
    cached = (later - chunk) * stride // cf * cf  # as timing.measure: the later call's past, its held chunks before it
    cases = {
        "first, 1 stream": (1, first, new, max(0, (t.prompt_codes - la) * stride // cf * cf)),
        f"later, {streams} streams, {held} held": (streams, later, max(new, held * cf), cached - held * cf + cf),
    }
    result, t0 = {}, time.perf_counter()
    for name, (batch, body, frames, start) in cases.items():
        run = timing.SlotRunner(ours, voice, batch, body, cuda, frames, start)
        if "held" in name:
            run.hift_rows(held)
        ms = timing.stage_ms(run, dev, t.repeat)
        rows, count, us = kernels(run.stages["ode_step"], cuda)
        result[name] = ms | {"solved_frames": run.frames - run.start, "kernels_a_step": count, "us_a_step": us, "top": rows[:40]}
        print(f"{name}: {json.dumps({k: round(v, 3) for k, v in ms.items()})}, {count:.0f} kernels a step, "
              f"{us:.0f} us of them, {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        for k, c, u in rows[:25]:
            print(f"  {u:9.1f} us {c:6.1f} x  {k}", flush=True)
        timing.close(run)
        del run
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
