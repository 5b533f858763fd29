"""Probe (ledger: "H200 codec held 1"): the codec's slotted flow call with the slots' LayerNorms apart
from N rows (`CodecDecoder.norm_apart_rows`, kernels.block) against fused (0), in one process on one
decoder: one stream's first call (80 rows with guidance: fused at any N here), eight streams' first
calls (640 rows) and eight streams' held batch (8 chunks a row, 160 frames: 2,560 rows). H200 run
12's held step was ~8 x its GEMMs' compute floor (levers.md, "H200 codec step"). Then the held batch
with the attention kernel's other blockings (queries x keys a program: PROBE_ATTN), the LayerNorms
fused: attention was ~27 % of the held step's kernel time. A line per case and variant as it ends,
then everything as JSON.

    PROBE_APART=0,1024,512 PROBE_ATTN=64x64,32x128,128x64 PYTHONPATH=. \
        python benchmarks/probe_held.py <out.json> [preset (full)] [streams (8)] [held (8)]
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from workflow.codec import kernels, timing
from workflow.codec.stream import first_hop

APART = [int(n) for n in os.environ.get("PROBE_APART", "0,1024,512").split(",")]
ATTN = [tuple(int(n) for n in v.split("x")) for v in os.environ.get("PROBE_ATTN", "64x64,32x128,128x64").split(",") if v]


def main() -> None:
    out, preset = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "full"
    streams, held = (int(a) for a in (sys.argv[3:5] + ["8", "8"][len(sys.argv[3:5]) :]))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    t = timing.CodecTiming(
        preset=preset, dtype="bfloat16" if cuda else "float32", prompt_codes=46 if preset == "full" else 11,
        later_codes=100 if preset == "full" else 5 * held, batches=(1, streams), repeat=5, baseline=False,
        flow_cache=False, slots=streams, held=held,
    )  # fmt: skip
    ours, _ = timing.decoders(t, dev)
    cfg, voice = ours.cfg, timing.voice_of(t, ours)
    la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
    hop0, cf = first_hop(t.prompt_codes, chunk, stride), chunk * stride
    first, later = t.prompt_codes + hop0, t.prompt_codes + t.later_codes + hop0
    new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
    cached = (later - chunk) * stride // cf * cf  # as timing.measure: the later call's past, its held chunks before it
    start0 = max(0, (t.prompt_codes - la) * stride // cf * cf)
    cases = {
        "first, 1 stream": (1, first, new, start0),
        f"first, {streams} streams": (streams, first, new, start0),
        f"later, {streams} streams, {held} held": (streams, later, max(new, held * cf), cached - held * cf + cf),
    }
    result, t0, attention = {}, time.perf_counter(), kernels.attention
    variants = [(name, apart, None) for name in cases for apart in APART]
    variants += [(name, 0, blocking) for name in cases if "held" in name for blocking in ATTN]
    for name, apart, blocking in variants:  # each case's variants in turn, on one warm decoder
        batch, body, frames, start = cases[name]
        ours.norm_apart_rows = apart  # read by the slots' pass when SlotRunner makes its FlowSlots
        bq, bk = blocking or (0, kernels.BLOCK_KEYS)  # kernels.block calls the module's attention
        kernels.attention = lambda *a, bq=bq, bk=bk, **k: attention(*a, **(k | {"bq": bq, "bk": bk}))
        run = timing.SlotRunner(ours, voice, batch, body, cuda, frames, start)
        if "held" in name:
            run.hift_rows(held)
        ms = timing.stage_ms(run, dev, t.repeat)
        label = f"apart {apart}" if blocking is None else f"attention {bq}x{bk}"
        result.setdefault(name, {})[label] = ms | {"rows": 2 * batch * frames}
        print(f"{name}, {label}: {json.dumps({k: round(v, 3) for k, v in ms.items()})}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        timing.close(run)
        del run
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
