"""Profile: where an ODE step of the slotted call goes (kernels by name, from a CUDA graph's replay),
and HiFT's two parts (the eager NSF source, the graphed network + iSTFT), at batches 1 and 8."""
import json
import os
import time
from collections import defaultdict

import torch

from workflow.codec import timing

dev = torch.device("cuda")
t0 = time.time()
out = {"steps": [], "hift": []}


def save():
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "step-profile.json"), "w"), indent=1)


def ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / n)
    return best


t = timing.CodecTiming(preset="full", dtype="bfloat16", prompt_codes=50, later_codes=100, batches=(1, 8), repeat=5,
                       baseline=False, flow_cache=False, slots=8)
ours, _ = timing.decoders(t, dev)
cfg = ours.cfg
la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
cf = chunk * stride
body = t.prompt_codes + chunk
start = max(0, (t.prompt_codes - la) * stride // cf * cf)
voice = timing.voice_of(t, ours)
new = -(-((t.prompt_codes + chunk + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
for batch in (1, 8):
    run = timing.SlotRunner(ours, voice, batch, body, True, new, start)
    step = run.stages["ode_step"]
    step_ms = ms(step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    by = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0][:90]
            by[name][0] += 1
            by[name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(((n, c / 3, us / 3) for n, (c, us) in by.items()), key=lambda r: -r[2])
    kernels = sum(r[1] for r in rows)
    device_us = sum(r[2] for r in rows)
    src = ms(lambda: run.dec.hift.source(run.mel, run.noise))
    voc = ms(run._replayed("vocode", run.vocode))
    hift = ms(run.hift)
    row = {"batch": batch, "ode_step_ms": step_ms, "kernels_a_step": kernels, "device_us_a_step": device_us,
           "top": [(n, round(c, 1), round(us, 1)) for n, c, us in rows[:40]], "hift_ms": hift, "source_ms": src, "vocode_ms": voc}
    out["steps"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "top"}), f"{time.time() - t0:.0f}s", flush=True)
    for n, c, us in rows[:25]:
        print(f"  {us:8.1f} us {c:6.1f}x  {n}")
    save()
    timing.close(run)
    del run
    torch.cuda.empty_cache()
