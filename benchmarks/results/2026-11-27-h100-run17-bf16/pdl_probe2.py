"""GPU probe: the slotted flow call (first and later, 1/8/32 streams) with the slots' Triton kernels as
dependent launches (PDL) or not, full preset, bf16, 46-code prompt."""
import sys

import torch

from workflow.codec import kernels, timing
from workflow.codec.stream import first_hop
from workflow.codec.timing import CodecTiming, SlotRunner, close, stage_ms

mode = sys.argv[1]
if mode == "off":
    kernels.dependent_launch = lambda x: False
t = CodecTiming(preset="full", dtype="bfloat16", prompt_codes=46, later_codes=100, batches=(1, 8, 32), repeat=7,
                baseline=False, flow_cache=False, slots=32, kernels=True)
dev = torch.device("cuda")
ours, _ = timing.decoders(t, dev)
cfg = ours.cfg
la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
hop0 = first_hop(t.prompt_codes, chunk, stride)
calls = {"first": t.prompt_codes + hop0, "later": t.prompt_codes + t.later_codes + hop0}
cf = chunk * stride
cached = {"first": max(0, (t.prompt_codes - la) * stride // cf * cf), "later": (calls["later"] - chunk) * stride // cf * cf}
voice = timing.voice_of(t, ours)
new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
print(f"pdl {mode}: first hop {hop0}, new frames {new}")
for call in calls:
    for batch in t.batches:
        run = SlotRunner(ours, voice, batch, calls[call], True, new, cached[call])
        r = stage_ms(run, dev, t.repeat)
        print(f"| {mode} | {call} | {batch} | {r['ode_step_ms']:.2f} | {r['solve_ms']:.2f} | {r['hift_ms']:.2f} | {r['chunk_ms']:.2f} |", flush=True)
        close(run)
        del run
