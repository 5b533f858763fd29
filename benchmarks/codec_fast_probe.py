"""A/B/C of the estimator's official forward, its fast pass (workflow/codec/fast.py) and the fast pass
with its blocks compiled, full shape, bf16,
CUDA graphs, on one GPU: each flow call's stages (timing.Runner) at the first call and 100 codes later,
batches 1, 8 and 32, and the CUDA kernels one ODE step launches. Prints a table and writes json.

    PYTHONPATH=. python3 benchmarks/codec_fast_probe.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from workflow.codec.timing import CodecTiming, Runner, close, decoders, stage_ms


def kernels(run: Runner) -> int:
    """CUDA kernels one eager ODE step launches."""
    with torch.no_grad():
        run.ode_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            run.ode_step()
            torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type.name == "CUDA")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--preset", default="full")  # tiny: a dry run
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    device = torch.device(a.device)
    t = CodecTiming(preset=a.preset, dtype="bfloat16", prompt_codes=50, later_codes=100, baseline=False, repeat=5)
    dec, _ = decoders(t, device)
    rows = []
    for call, body in (("first", 58), ("later", 158)):
        for batch in map(int, a.batches.split(",")):
            for variant in ("official", "fast", "compiled"):
                dec.official, dec.compiled = variant == "official", variant == "compiled"
                eager = Runner(dec, batch, body, t.prompt_codes, graphs=False)
                n = kernels(eager) if batch == 1 and device.type == "cuda" else None
                close(eager)
                run = Runner(dec, batch, body, t.prompt_codes, graphs=device.type == "cuda")
                row = {"variant": variant, "call": call, "batch": batch, "frames": run.frames, "kernels_per_step": n}
                row |= stage_ms(run, device, t.repeat)
                close(run)
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    print(f"{'call':6} {'batch':>5} {'variant':9} {'kernels':>8} {'ode step':>9} {'solve':>8} {'chunk':>8}")
    for r in rows:
        k = r["kernels_per_step"] or ""
        ms = f"{r['ode_step_ms']:9.2f} {r['solve_ms']:8.2f} {r['chunk_ms']:8.2f}"
        print(f"{r['call']:6} {r['batch']:5} {r['variant']:9} {k!s:>8} {ms}")
    with open(a.out, "w") as f:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
