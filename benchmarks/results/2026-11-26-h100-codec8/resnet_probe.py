"""Probe: the slots' resnets as Triton kernels (workflow/codec/resnets.py) against the compiled torch
resnet (slots.resnet): one resnet in CUDA graphs at serving's row counts (with a blocking sweep), then
the whole slotted call (timing.SlotRunner) at batches 1, 8, 32, first and later, either way."""
import itertools
import json
import os
import sys
import time

import torch

from workflow.codec import resnets, slots, timing
from workflow.codec.estimator import CausalResnetBlock1D
from workflow.codec.kernels import Tile

dev, dt = torch.device("cuda"), torch.bfloat16
out = {"micro": [], "calls": []}
compiled = torch.compile(slots.resnet, dynamic=True)


def timed(fn, n=20, reps=5):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / n)
    return best




def save():
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe-resnets.json"), "w"), indent=1, default=str)


t0 = time.time()
best_tiles = {}
t = timing.CodecTiming(preset="full", dtype="bfloat16", prompt_codes=50, later_codes=100, batches=(1, 8, 32), repeat=5,
                       baseline=False, flow_cache=False, slots=32)
ours, _ = timing.decoders(t, dev)
cfg = ours.cfg
la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
calls = {"first": t.prompt_codes + chunk, "later": t.prompt_codes + t.later_codes + chunk}
cf = chunk * stride
cached = {"first": max(0, (t.prompt_codes - la) * stride // cf * cf), "later": (calls["later"] - chunk) * stride // cf * cf}
voice = timing.voice_of(t, ours)
base_frames = ours.past_frames(t.prompt_codes)
new = -(-((t.prompt_codes + chunk + la) * stride - base_frames) // cf) * cf
tuned = os.environ.get("TUNED") == "1"
for batch in (1, 8, 32):
    for call in ("first", "later"):
        mels = {}
        for mode in ("torch", "kernels") + (("tuned",) if tuned and best_tiles else ()):
            run = timing.SlotRunner(ours, voice, batch, calls[call], True, new, cached[call])
            if mode == "torch":
                run.slots.velocity.resnet = compiled
            elif mode == "tuned":
                def pick(m):
                    return best_tiles[min(best_tiles, key=lambda k: abs(k - m))]
                run.slots.velocity.resnet = lambda r, x, temb, tails, valid: resnets.resnet(r, x, temb, tails, valid, pick(x.shape[0] * x.shape[1]))
            with torch.no_grad():
                mels[mode] = run.slot_solve().float().cpu()
            ms = timing.stage_ms(run, dev, t.repeat)
            row = {"batch": batch, "call": call, "mode": mode} | {k: round(v, 3) for k, v in ms.items()}
            if mode != "torch":
                row["mel_max_abs_diff_vs_torch"] = (mels[mode] - mels["torch"]).abs().max().item()
            out["calls"].append(row)
            print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
            save()
            timing.close(run)
            del run
            torch.cuda.empty_cache()
with torch.no_grad():
    for cin in (320, 256, 512):
        r = CausalResnetBlock1D(cin, 256, 1024).to(dev, dt)
        for rows in (2, 16, 64):
            x = torch.randn(rows, 60, cin, device=dev, dtype=dt)
            temb = torch.randn(rows, 1024, device=dev, dtype=dt)
            tails = (torch.randn(rows, 2, cin, device=dev, dtype=dt), torch.randn(rows, 2, 256, device=dev, dtype=dt))
            valid = torch.full((rows,), 40, device=dev)
            want = compiled(r, x, temb, tails, valid)
            got = resnets.resnet(r, x, temb, tails, valid)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
            t_torch = timed(lambda: compiled(r, x, temb, tails, valid))
            t_default = timed(lambda: resnets.resnet(r, x, temb, tails, valid))
            sweep = []
            if cin == 256:
                for bm, bn, bk, st in itertools.product((16, 32, 64), (32, 64), (64, 128), (3,)):
                    blk = Tile(bm, bn, bk, 4, st)
                    try:
                        sweep.append((round(timed(lambda: resnets.resnet(r, x, temb, tails, valid, blk)), 2), blk))
                    except Exception as e:  # noqa: BLE001
                        print("fail", blk, e, flush=True)
                sweep.sort(key=lambda s: s[0])
                best_tiles[rows * 60] = sweep[0][1]
            row = {"cin": cin, "rows": rows * 60, "torch_us": t_torch, "kernels_us": t_default, "max_abs_diff": err,
                   "best": [(u, b.__dict__) for u, b in sweep[:4]]}
            out["micro"].append(row)
            print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
            save()

