"""Probe (ledger: "H100 decode rows 16"): the engine's audio-mode decode step at 1 / 4 / 8 / 16 rows,
full shape, random weights: before (the GEMV to 4 rows, cuBLAS past them; FP8's input quantized by
torch ops) and now (the GEMV to 16 rows; FP8's input by quant.py's kernel), each with the layer step
compiled to 4 rows (as the benchmark's microbench runs it) and eager at every row count (as serving's
graphs, made ahead by ahead.capture, run it). Also how long tuning and each engine take.

    python3 benchmarks/probe_rows.py bf16|fp8 OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import yaml

from workflow import fp8, trtckpt
from workflow.benchmark import microbench
from workflow.engines import blocks, gemv, layer, linears, quant, tuning
from workflow.engines.options import EngineOptions
from workflow.engines.torch_engine import TorchEngine
from workflow.generate import Ids
from workflow.spec import PRESETS


def torch_quantize(x, scale, norm=None, eps=1e-6, silu_mul=False):
    """The FP8 input as torch ops (before quant.py): a dozen small kernels eager."""
    return fp8.quantize(linears.prologue(x, norm, eps, silu_mul), scale)


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
    found = {}
    for m in (1, 4, 8, 16):
        t = time.perf_counter()
        found |= tuning.tune(uses, rows=(m,))
        result["tune_s"][m] = round(time.perf_counter() - t, 1)
        print(f"tune rows {m}: {result['tune_s'][m]} s", flush=True)
    result["tuning"] = blocks.tuning_json(found)
    before = {u: t for u, t in found.items() if u.rows in (1, 4)}
    quantize = quant.quantize
    variants = {  # name: (ROWS, gemv.MAX_M, layer.COMPILED_BATCH, tuning, FP8 input)
        "before, compiled to 4 rows (microbench)": ((1, 4), 4, 4, before, torch_quantize),
        "before, eager (serving's graphs)": ((1, 4), 4, 0, before, torch_quantize),
        "now, eager (serving's graphs)": ((1, 4, 8, 16), 16, 0, found, quantize),
        "now, compiled to 4 rows (microbench)": ((1, 4, 8, 16), 16, 4, found, quantize),
    }
    for name, (rows, max_m, compiled, tu, quantizer) in variants.items():
        t = time.perf_counter()
        blocks.ROWS, gemv.MAX_M, layer.COMPILED_BATCH, quant.quantize = rows, max_m, compiled, quantizer
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
