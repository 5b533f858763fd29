"""Probe: serving's HiFT stage, per-stream excitation (eager F0 + NSF source, then the network from a
graph: the code before this commit) against the calls of one shape in one graph (CodecBatch.hift),
at 1, 4, 8, 16 streams in step: wall ms a call (host work included, synchronized at the end)."""
import json
import os
import time

import torch

from workflow.codec import timing
from workflow.codec.batch import CodecBatch

dev = torch.device("cuda")
t = timing.CodecTiming(preset="full", dtype="bfloat16", prompt_codes=50, baseline=False, flow_cache=False)
dec, voice = timing.stream_decoder(t, dev)
out = []


def old_hift(batch, calls, final):
    excited = [s.excite(m) for s, m in calls]
    mel = torch.stack([e[0] for e in excited])
    source = torch.stack([e[1] for e in excited])[:, None]
    prio = torch.cuda.current_stream(dev).priority
    pcm = batch.graphs.call(("old", tuple(mel.shape), prio), dec.hift.decode, mel, source).clone()
    return [s.settle(pcm[j], e[2], f) for j, ((s, _), e, f) in enumerate(zip(calls, excited, final))]


with torch.inference_mode():
    for n in (1, 4, 8, 16):
        for way in ("old", "new"):
            batch = CodecBatch(dec, voice, graphs=True)
            streams = [batch.stream(batch.new_key()) for _ in range(n)]
            g = torch.Generator().manual_seed(n)
            mels = [torch.randn(80, 40 if i == 0 else 20, generator=g).to(dev) for i in range(30)]
            fn = old_hift if way == "old" else CodecBatch.hift
            times = []
            for i, m in enumerate(mels):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(batch, [(s, m) for s in streams], [False] * n)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1000)
            later = sorted(times[5:])
            row = {"streams": n, "way": way, "first_ms": times[0], "later_ms_p50": later[len(later) // 2], "later_ms_min": later[0]}
            out.append(row)
            print(json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe-hift.json"), "w"), indent=1)
