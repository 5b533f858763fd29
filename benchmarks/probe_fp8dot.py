"""Probe 33: is the FP8 GEMV bound by its conversions on an H200, and do tensor cores lift it?

Probe 32 read the step's bytes with eight large GEMVs: bf16 weights at 4.55 TB/s on an H200,
FP8 weights at 4.17 (on an H100 both at 3.13). A CUDA-core FP8 GEMV converts every weight byte
to float32 before its multiply; at the H200's bandwidth that may be the limit. The GEMV's
tensor-core body (`gemv._dot`) multiplies e4m3 by e4m3 as stored (x padded to 16 rows), its
loads pipelined. This times, per FP8 use of a decode step and for one large weight, the
engine's tuned block (from an engine.json) against tensor-core blocks, as `gemv.tune` times
(`gemv.call_ms`: one row of x, 20 calls from a CUDA graph cycling through weight copies that
overflow L2; median of three), after checking each against float32 arithmetic.

The results in benchmarks/results/2026-11-24-h200-probe33 came from commit 0023540, where this
probe carried its own copy of the body (the same arithmetic; it also offered x as the left
operand at 64 rows).

    PYTHONPATH=. python3 benchmarks/probe_fp8dot.py --out $OUT/fp8dot.json \\
        --engine-json benchmarks/results/2026-11-24-h200-full4/torch-fp8/engine/engine.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from workflow.engines import gemv
from workflow.roofline import median

H, FFN, QKV = 4096, 12288, 6144
USES = {"qkv": (QKV, H, ""), "dense": (H, H, "res"), "gate_up": (2 * FFN, H, ""), "proj": (H, FFN, "res")}
USES["large"] = (262144, H, "")  # 1 GB: the body's rate with its ramp and tail amortised
DOT_BLOCKS = [(bn, bk, 4, 0, 0, s) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for s in (2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-json", type=Path, required=True, help="an FP8 engine.json: its gemv_blocks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gemv.BLOCKS.update({k: tuple(v) for k, v in json.loads(args.engine_json.read_text())["options"]["gemv_blocks"].items()})
    out = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "commit": os.environ.get("MOSSBUILD_COMMIT", "unknown"), "command": "PYTHONPATH=. python3 " + shlex.join(sys.argv),
           "uses": {}}  # fmt: skip
    x = torch.randn(1, FFN, device=dev).to(torch.float8_e4m3fn)
    scale = torch.full((1,), 0.5, device=dev)
    for name, (n, k, fl) in USES.items():
        w = (torch.randn(n, k, device=dev) / 8).to(torch.float8_e4m3fn)
        copies = gemv.l2_copies(w)
        res = torch.randn(1, n, device=dev, dtype=torch.bfloat16) if fl else None
        xk = x[:, :k].contiguous()
        want = (xk.float() @ w.float().T) * 0.5
        want = (want.to(torch.bfloat16).float() + res.float()) if res is not None else want
        eb = gemv.config_for(*((2 * FFN, H) if name == "large" else (n, k)), 1, fl)  # large: gate_up's block
        row = {"mb": n * k / 1e6, "engine_block": list(eb), "us": {}, "max_err": {}}
        for label, block in [("engine", eb), *((str(b), b) for b in DOT_BLOCKS)]:
            call = functools.partial(gemv.launch, xk, out_dtype=torch.bfloat16, scale=scale, residual=res, block=list(block))
            try:
                got = call(w).float()
            except Exception as e:  # a shape Triton cannot compile: note it, go on
                row["us"][label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            row["max_err"][label] = (got - want).abs().max().item() / (want.abs().max().item() + 1e-6)
            row["us"][label] = median([1e3 * gemv.call_ms(call, copies) for _ in range(3)])
        timed = {b: t for b, t in row["us"].items() if isinstance(t, float)}
        best = min((b for b in timed if b != "engine"), key=timed.get, default="engine")
        row["best_dot"], row["best_dot_us"] = best, timed[best]
        out["uses"][name] = row
        eng = timed["engine"]
        print(f"{name} {n}x{k} ({row['mb']:.0f} MB): engine {row['engine_block']} {eng:.2f} us ({n * k / eng / 1e6:.2f} TB/s); "
              f"best dot {best} {timed[best]:.2f} us ({n * k / timed[best] / 1e6:.2f} TB/s), err {row['max_err'][best]:.1e}",
              flush=True)  # fmt: skip
        del copies, w
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
