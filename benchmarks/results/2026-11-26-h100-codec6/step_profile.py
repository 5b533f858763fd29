"""Profile one slot ODE step (b1, first call, full preset, bf16, graphs) with the kernels on: which kernels, how many, how long."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile

from workflow.codec.timing import CodecTiming, SlotRunner, decoders, voice_of

graphs = sys.argv[1] == "graphs"
t = CodecTiming(preset="full", dtype="bfloat16", prompt_codes=50, later_codes=100, batches=(1,), baseline=False, flow_cache=False, slots=1, kernels=True)
ours, _ = decoders(t, torch.device("cuda"))
voice = voice_of(t, ours)
run = SlotRunner(ours, voice, 1, 55, graphs, 60, 180)
step = run.stages["ode_step"]
for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print("kernels per step", len(ev) / 2, "sum us per step", sum(e.device_time for e in ev) / 2)
agg = {}
for e in ev:
    k = e.name[:90]
    n, tt = agg.get(k, (0, 0.0))
    agg[k] = (n + 1, tt + e.device_time)
for k, (n, tt) in sorted(agg.items(), key=lambda x: -x[1][1])[:40]:
    print(f"{n/2:6.0f} {tt/2:9.1f} us  {tt/n:6.2f} us each  {k}")
