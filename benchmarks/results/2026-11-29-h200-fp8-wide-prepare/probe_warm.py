"""Where CodecLanes.warm's time goes at h200.yaml's shape: each flow call (rows, tokens shape, solve q) and each
piece call timed with the device synced, dynamo's compile counters, then a second warm (replays only)."""
import collections, json, sys, time
from pathlib import Path
import torch, yaml
from workflow.benchmark import speech_of
from workflow.generate import Ids
from workflow.serve.load import LoadConfig
from workflow.spec import PRESETS  # noqa
p: dict = {}
for f in sys.argv[2:]:
    b = yaml.safe_load(Path(f).read_text()).get("benchmark") or {}
    for k, v in b.items():
        p[k] = (p.get(k) or {}) | v if isinstance(v, dict) else v
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
spec = PRESETS[p.get("preset", "full")] if False else PRESETS["full"]
ids = Ids.of(spec)
cfg = LoadConfig.from_dict(p["load"])
t0 = time.perf_counter()
speech, spt, serving, said, idle = speech_of(p, dev, torch.bfloat16, ids, cfg)
lanes = serving()
print(f"made in {time.perf_counter()-t0:.1f} s; slots {cfg.slots} chunk {p['chunk_tokens']} longest {cfg.longest_codes}", flush=True)
batch = lanes.batch
rec = collections.defaultdict(lambda: [0, 0.0])
orig_mel = batch.mel
def mel(calls, keys=None, solve=0):
    (torch.cuda.synchronize() if dev.type == "cuda" else None); t = time.perf_counter()
    out = orig_mel(calls, keys, solve)
    (torch.cuda.synchronize() if dev.type == "cuda" else None)
    k = ("mel", len(calls), max(len(c.codes) for c in calls) // 40 if calls else 0, solve, (torch.cuda.current_stream().priority if dev.type == "cuda" else 0))
    rec[k][0] += 1; rec[k][1] += time.perf_counter() - t
    return out
batch.mel = mel
from torch._dynamo.utils import counters
out = {}
for rnd in (1, 2):
    rec.clear()
    t0 = time.perf_counter()
    calls = lanes.warm(cfg.slots, p["chunk_tokens"], cfg.longest_codes)
    took = time.perf_counter() - t0
    print(f"round {rnd}: {calls} batches in {took:.1f} s; warm_s " + json.dumps({k: {a: round(b, 2) for a, b in v.items()} for k, v in lanes.warm_s.items()}), flush=True)
    print("dynamo", {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "inductor")}, flush=True)
    tot = 0.0
    for k, (n, s) in sorted(rec.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"  {k}: {n} calls {s:.2f} s", flush=True)
    print(f"  mel total {sum(s for n, s in rec.values()):.1f} s of {took:.1f}", flush=True)
    out[rnd] = {"seconds": took, "warm_s": lanes.warm_s, "mel": {str(k): v for k, v in rec.items()}}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
