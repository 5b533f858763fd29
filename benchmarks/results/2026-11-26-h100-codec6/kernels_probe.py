"""GPU probe: the codec section's calls with the slots' Triton kernels on or off (full preset, bf16)."""
import json
import sys
import time

import torch

from workflow.codec.timing import CodecTiming, measure

kernels = sys.argv[1] == "on"
batches = tuple(int(b) for b in sys.argv[2].split(","))
t = CodecTiming(preset="full", dtype="bfloat16", prompt_codes=50, later_codes=100, batches=batches, repeat=5,
                baseline=False, flow_cache=False, slots=max(batches), kernels=kernels)
t0 = time.time()
out = measure(t, torch.device("cuda"))
print(f"kernels {kernels}: measured in {time.time() - t0:.0f} s, compiled {out['compiled']}, kernels {out['kernels']}")
print("| variant | call | batch | solved/all | front | step | solve | hift | call |")
for r in out["calls"]:
    print(f"| {r['variant']} | {r['call']} | {r['batch']} | {r['solved_frames']}/{r['frames']} | {r['front_end_ms']:.2f} | "
          f"{r['ode_step_ms']:.2f} | {r['solve_ms']:.2f} | {r['hift_ms']:.2f} | {r['chunk_ms']:.2f} |")
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"probe-{sys.argv[1]}.json"), "w"), indent=1)
