"""Probe: a later slot call's cost by streams in the call (batch) and frames solved a row (Q)."""
import json, os, sys, time
import torch
from workflow.codec.timing import CodecTiming, SlotRunner, close, stage_ms, stream_decoder
from workflow.codec.stream import first_hop

preset = sys.argv[1] if len(sys.argv) > 1 else "full"
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
t = CodecTiming(preset=preset, dtype="bfloat16" if dev.type == "cuda" else "float32", prompt_codes=46 if preset == "full" else 11,
                later_codes=100 if preset == "full" else 60, baseline=False, flow_cache=False, slots=10)
t0 = time.time()
dec, voice = stream_decoder(t, dev)
cfg = dec.cfg
la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
cf = chunk * stride
hop0 = first_hop(t.prompt_codes, chunk, stride)
body = t.prompt_codes + t.later_codes + hop0
cached = (body - chunk) * stride // cf * cf
out = os.environ.get("OUT", "/tmp")
rows = []
print(f"decoder ready {time.time() - t0:.1f} s; body {body} codes, {body * stride} frames, later call from {cached}", flush=True)
for batch in (1, 4, 10):
    for q in (cf, 3 * cf, 8 * cf):
        t1 = time.time()
        run = SlotRunner(dec, voice, batch, body, dev.type == "cuda", q, cached - (q - cf))
        ms = stage_ms(run, dev, 3)
        close(run)
        del run
        row = {"batch": batch, "q": q} | ms
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), f"({time.time() - t1:.0f} s)", flush=True)
        json.dump(rows, open(f"{out}/q_probe.json", "w"))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
