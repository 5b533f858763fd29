"""Probe (ledger: "decode rows 16"): the engine's audio-mode decode step at 4 / 8 / 16 rows, full shape,
random weights, three ways: today (the GEMV to 4 rows, cuBLAS past them, the compiled layer step to 4
rows); the GEMV to 16 rows (tuned at 8 and 16 rows, the tensor-core body only there), the layer step
past 4 rows eager as today; and the same with the compiled layer step to 16 rows. H200 run 12: the step
at 4 / 8 rows 5.47 / 6.54 ms bf16, 3.28 / 6.50 ms FP8. Also how long tuning and each engine take.

    python3 benchmarks/probe_rows.py bf16|fp8 OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import yaml

from workflow import trtckpt
from workflow.benchmark import microbench
from workflow.engines import blocks, gemv, layer, tuning
from workflow.engines.blocks import Body
from workflow.engines.options import EngineOptions
from workflow.engines.torch_engine import TorchEngine
from workflow.generate import Ids
from workflow.spec import PRESETS

WIDE = (8, 16)
candidates = blocks.candidates


def wide_candidates(k, weight_bytes, fuse=blocks.Fuse.NONE, rows=1):
    """From 8 rows the tensor-core body alone, where it takes the use (CUDA cores' products grow with the rows)."""
    found = candidates(k, weight_bytes, fuse, rows)
    dot = [b for b in found if b.body == Body.DOT]
    return dot if rows >= WIDE[0] and dot else found


def tensors(spec, fp8: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, (shape, dtype) in trtckpt.expected_tensors(spec, fp8).items():
        if name.endswith("scaling_factor"):
            out[name] = torch.full(shape, 0.01, device="cuda")
        elif dtype == torch.float8_e4m3fn:
            out[name] = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 8).to(dtype)
        elif len(shape) == 1:
            out[name] = torch.ones(shape, device="cuda", dtype=dtype)
        else:
            out[name] = torch.randn(shape, device="cuda", dtype=dtype) * 0.02
    return out


def main() -> None:
    precision, out_path = sys.argv[1], sys.argv[2]
    t0 = time.perf_counter()
    spec = PRESETS["full"]
    with open("config/full.yaml") as f:
        cfg = yaml.safe_load(f)["engine"] | {"precision": precision, "max_batch": 16}
    opts = EngineOptions.from_dict(cfg)
    ts = tensors(spec, precision == "fp8")
    ids = Ids.of(spec)
    untuned = {blocks.Use(0, 0, 0, blocks.Fuse.NONE): None}  # not empty: the engine does not tune
    probe = TorchEngine(spec, ts, EngineOptions.from_dict(cfg | {"compile": False, "cuda_graphs": False}), untuned)
    uses = list({blocks.Use.of(lin.weight, f): (lin.weight, f) for lin, f in probe.gemv_uses()}.values())
    del probe
    result = {"precision": precision, "gpu": torch.cuda.get_device_name(), "tune_s": {}, "decode": {}, "engine_s": {}}
    tuning.candidates = wide_candidates
    gemv.MAX_M = 16  # tuning launches 16 rows
    found = {}
    for m in (1, 4, *WIDE):
        t = time.perf_counter()
        found |= tuning.tune(uses, rows=(m,))
        result["tune_s"][m] = round(time.perf_counter() - t, 1)
        print(f"tune rows {m}: {result['tune_s'][m]} s", flush=True)
    result["tuning"] = blocks.tuning_json(found)
    for u, tuned in sorted(found.items(), key=lambda kv: kv[0].key()):
        b = tuned.block
        print(f"  {u.key()}: {b.body.value} {b.block_n}x{b.block_k} w{b.warps} s{b.stages} {tuned.ms * 1e3:.1f} us", flush=True)
    today = {u: t for u, t in found.items() if u.rows in (1, 4)}
    variants = {  # name: (ROWS, gemv.MAX_M, layer.COMPILED_BATCH, tuning)
        "today": ((1, 4), 4, 4, today),
        "gemv16": ((1, 4, 8, 16), 16, 4, found),
        "gemv16_compiled16": ((1, 4, 8, 16), 16, 16, found),
    }
    for name, (rows, max_m, compiled, tu) in variants.items():
        t = time.perf_counter()
        blocks.ROWS, gemv.MAX_M, layer.COMPILED_BATCH = rows, max_m, compiled
        torch._dynamo.reset()  # each variant compiles afresh
        engine = TorchEngine(spec, ts, opts, tu)
        micro = microbench(engine, 512, ids, repeat=30, rows=(4, 8, 16))
        row = {1: micro["decode_audio_mode_ms"]["p50"]} | {n: micro[f"decode_audio_mode_{n}_rows_ms"]["p50"] for n in (4, 8, 16)}
        result["decode"][name] = row
        result["engine_s"][name] = round(time.perf_counter() - t, 1)
        print(f"{name}: " + " / ".join(f"{v:.3f}" for v in row.values()) + f" ms at 1/4/8/16 rows "
              f"({result['engine_s'][name]} s; {time.perf_counter() - t0:.0f} s in all)", flush=True)  # fmt: skip
        del engine
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
