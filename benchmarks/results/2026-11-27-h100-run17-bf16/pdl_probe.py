"""GPU probe: the codec section's calls with the slots' Triton kernels as dependent launches (PDL) or not
(full preset, bf16); and one ODE step's kernels by name, with and without."""
import json
import os
import sys
import time
from collections import defaultdict

import torch

from workflow.codec import kernels, timing
from workflow.codec.stream import first_hop
from workflow.codec.timing import CodecTiming, measure

mode = sys.argv[1]
batches = tuple(int(b) for b in sys.argv[2].split(","))
if mode == "off":
    kernels.dependent_launch = lambda x: False
t = CodecTiming(preset="full", dtype="bfloat16", prompt_codes=int(os.environ.get("PROMPT", 46)), later_codes=100,
                batches=batches, repeat=5, baseline=False, flow_cache=False, slots=max(batches), kernels=True)
t0 = time.time()
out = measure(t, torch.device("cuda"))
print(f"pdl {mode}: measured in {time.time() - t0:.0f} s, kernels {out['kernels']}")
print("| variant | call | batch | solved/all | front | step | solve | hift | call |")
for r in out["calls"]:
    print(f"| {r['variant']} | {r['call']} | {r['batch']} | {r['solved_frames']}/{r['frames']} | {r['front_end_ms']:.2f} | "
          f"{r['ode_step_ms']:.2f} | {r['solve_ms']:.2f} | {r['hift_ms']:.2f} | {r['chunk_ms']:.2f} |", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), f"probe-{mode}.json"), "w") as f:
    json.dump(out, f, indent=1)

# one ODE step of a first call at batch 1, kernels by name (as H100 codec 9's step_profile)
ours, _ = timing.decoders(t, torch.device("cuda"))
cfg = ours.cfg
la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
cf = chunk * stride
hop0 = first_hop(t.prompt_codes, chunk, stride)
body = t.prompt_codes + hop0
start = max(0, (t.prompt_codes - la) * stride // cf * cf)
voice = timing.voice_of(t, ours)
new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
run = timing.SlotRunner(ours, voice, 1, body, True, new, start)
step = run.stages["ode_step"]
for _ in range(3):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
by = defaultdict(lambda: [0, 0.0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        name = e.name.split("(")[0][:80]
        by[name][0] += 1
        by[name][1] += e.device_time_total
rows = sorted(((n, c / 3, us / 3) for n, (c, us) in by.items()), key=lambda r: -r[2])
print(f"step: {sum(r[1] for r in rows):.0f} kernels, {sum(r[2] for r in rows):.0f} us on the device")
for n, c, us in rows[:8]:
    print(f"  {us:8.1f} us {c:6.1f}x  {n}")
