"""Probe (temporary): the engine's audio-mode decode step at 1 / 2 / 4 / 8 rows, full shape, random
weights, with the GEMV tuned at one row only (its block for every row count: before), tuned at
each row count (after), and without the GEMV (cuBLAS). Also how long tuning takes per row count.

    python3 benchmarks/probe_gemv_rows.py bf16|fp8 OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import yaml

from workflow import trtckpt
from workflow.benchmark import microbench
from workflow.engines import blocks, gemv
from workflow.engines.options import EngineOptions
from workflow.engines.torch_engine import TorchEngine
from workflow.generate import Ids
from workflow.spec import PRESETS


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
    spec = PRESETS["full"]
    with open("config/full.yaml") as f:
        cfg = yaml.safe_load(f)["engine"]
    cfg = cfg | {"precision": precision, "max_batch": 8}
    opts = EngineOptions.from_dict(cfg)
    ts = tensors(spec, precision == "fp8")
    ids = Ids.of(spec)
    untuned = {blocks.Use(0, 0, 0, blocks.Fuse.NONE): None}  # not empty: the engine does not tune
    probe = TorchEngine(spec, ts, EngineOptions.from_dict(cfg | {"compile": False, "cuda_graphs": False}), untuned)
    uses = [(lin.weight, fuse) for lin, fuse in probe.gemv_uses()]
    uses = list({blocks.Use.of(w, f): (w, f) for w, f in uses}.values())
    del probe
    result = {"precision": precision, "gpu": torch.cuda.get_device_name(), "tune_s": {}, "tuning": {}}
    tuning: dict = {}
    for m in blocks.ROWS:
        t = time.perf_counter()
        found = gemv.tune(uses, rows=(m,))
        result["tune_s"][m] = round(time.perf_counter() - t, 1)
        tuning |= found
        print(f"tune rows {m}: {result['tune_s'][m]} s", flush=True)
        for u, tuned in found.items():
            print(
                f"  {u.key()}: {tuned.block.body.value} {tuned.block.block_n}x{tuned.block.block_k} w{tuned.block.warps} {tuned.ms * 1e3:.1f} us",
                flush=True,
            )
    result["tuning"] = blocks.tuning_json(tuning)
    one_row = {u._replace(rows=m): t for u, t in tuning.items() if u.rows == 1 for m in blocks.ROWS}
    variants = {
        "row1": (opts, one_row),
        "per_row": (opts, tuning),
        "cublas": (EngineOptions.from_dict(cfg | {"gemv": False}), {}),
    }
    result["decode"] = {}
    for name, (o, tu) in variants.items():
        t = time.perf_counter()
        torch._dynamo.reset()  # each variant compiles afresh (one cache across engines would overflow)
        engine = TorchEngine(spec, ts, o, tu or None)
        micro = microbench(engine, 512, ids, repeat=50, rows=(2, 4, 8))
        row = {1: micro["decode_audio_mode_ms"]["p50"]} | {n: micro[f"decode_audio_mode_{n}_rows_ms"]["p50"] for n in (2, 4, 8)}
        result["decode"][name] = row
        print(
            f"{name}: " + " / ".join(f"{v:.3f}" for v in row.values()) + f" ms at 1/2/4/8 rows ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        del engine
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
