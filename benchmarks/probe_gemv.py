"""Probe 30: the GEMV's flat body against the blocks the engine was tuned with, outside the engine.

For each weight a decode step reads (the full shape, random weights, bf16 and FP8), times every
flat-body candidate the way `gemv.tune` times blocks, then the best few again beside the
engine's own blocks (from an engine.json), in turn. Then the step's GEMVs as a chain: 36 layers
(32 FP8 trunk layers and 4 bf16 for the FP8 side), each its own weights, qkv -> dense -> gate_up
-> proj, replayed from one CUDA graph, with the engine's blocks and with the best flat ones, in
turn: the kernel-to-kernel transitions of a real step, attention left out.

    PYTHONPATH=. python3 benchmarks/probe_gemv.py --out $OUT/gemv.json \\
        --engine-json benchmarks/results/2026-11-24-h100-full11/torch-fp8/engine/engine.json \\
        --engine-json benchmarks/results/2026-11-24-h100-full11/torch-bf16/engine/engine.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from workflow.engines import gemv
from workflow.roofline import median

H, FFN, QKV = 4096, 12288, 6144
USES = {  # name -> (N, K, flags for bf16 weights, flags for FP8 weights): see TorchEngine.gemv_uses
    "qkv": (QKV, H, "norm", ""),
    "dense": (H, H, "res", "res"),
    "gate_up": (2 * FFN, H, "norm+glu", ""),
    "proj": (H, FFN, "res", "res"),
}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def flat_candidates(k: int, nbytes: int) -> list[tuple[int, int, int, int, int]]:
    out = []
    for bn in (2, 4, 8):
        for bk in {2: (512, 1024), 1: (1024, 2048)}[nbytes]:
            for warps in (4, 8):
                for per_sm in (4, 8):
                    for defer in (0, 1) if nbytes == 1 else (0,):
                        if bk < k and (not defer or bn * bk <= gemv.DEFER_REGS * 32 * warps):
                            out.append((bn, bk, warps, defer, per_sm))
    return out


def weight(n: int, k: int, fp8: bool, dev: torch.device) -> torch.Tensor:
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
    return w.to(torch.float8_e4m3fn) if fp8 else w


def per_use(engine_blocks: dict, dev: torch.device, rounds: int = 5) -> dict:
    out = {}
    for fp8 in (False, True):
        for n, k, fl16, fl8 in USES.values():
            fl, nbytes = (fl8, 1) if fp8 else (fl16, 2)
            ukey = gemv.key(n, k, nbytes, fl)
            timer = gemv.Timer(weight(n, k, fp8, dev), fl)
            base = tuple(engine_blocks[ukey]) if ukey in engine_blocks else None
            times = {c: timer(c) for c in flat_candidates(k, nbytes)}
            best = sorted(times, key=times.get)[:3]
            final: dict[str, list[float]] = {str(c): [] for c in ([base] if base else []) + best}
            for _ in range(rounds):
                for c in ([base] if base else []) + best:
                    final[str(c)].append(timer(c))
            row = {c: 1e3 * median(v) for c, v in final.items()}
            flat = min(best, key=lambda c: row[str(c)])
            out[ukey] = {
                "engine": str(base),
                "best_flat": list(flat),
                "flat_faster": base is None or row[str(flat)] < row[str(base)],
                "us": row,
                "all_flat_us": {str(c): 1e3 * t for c, t in times.items()},
            }
            say(f"{ukey}: " + ", ".join(f"{c} {us:.2f}" for c, us in row.items()) + f"  ({n * k * nbytes / 1e6:.1f} MB)")
            del timer
    return out


def chain(blocks: dict[str, dict], fp8: bool, dev: torch.device, rounds: int = 7) -> dict:
    """36 layers' GEMVs (FP8 trunk: the first 32 FP8) in one graph per setting of blocks, timed in turn."""
    layers = []
    for i in range(36):
        f8 = fp8 and i < 32
        layers.append((f8, {name: weight(n, k, f8, dev) for name, (n, k, _, _) in USES.items()}))
    bf, x8 = torch.bfloat16, torch.randn(1, FFN, device=dev).to(torch.float8_e4m3fn)
    xh, xi, one = torch.randn(1, H, device=dev, dtype=bf), torch.randn(1, FFN, device=dev, dtype=bf), torch.ones(1, device=dev)
    g = torch.ones(H, device=dev, dtype=bf)

    def step(chosen: dict) -> None:
        gemv.BLOCKS.clear()
        gemv.BLOCKS.update(chosen)
        for f8, w in layers:
            if f8:
                gemv.launch(x8[:, :H], w["qkv"], bf, scale=one)
                gemv.launch(x8[:, :H], w["dense"], bf, scale=one, residual=xh)
                gemv.launch(x8[:, :H], w["gate_up"], bf, scale=one)
                gemv.launch(x8, w["proj"], bf, scale=one, residual=xh)
            else:
                gemv.launch(xh, w["qkv"], bf, norm=g)
                gemv.launch(xh, w["dense"], bf, residual=xh)
                gemv.launch(xh, w["gate_up"], bf, norm=g, glu=True)
                gemv.launch(xi, w["proj"], bf, residual=xh)

    graphs = {}
    for label, chosen in blocks.items():
        step(chosen)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(chosen)
        graphs[label] = graph
    times: dict[str, list[float]] = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, graph in graphs.items():
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            times[label].append(start.elapsed_time(end) / 5)
    out = {label: median(t) for label, t in times.items()}
    say(f"chain {'fp8' if fp8 else 'bf16'}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items()) + f" (all: {times})")
    return {"ms": out, "rounds_ms": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-json", type=Path, action="append", required=True, help="an engine.json: its gemv_blocks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    engine_blocks: dict = {}
    for f in args.engine_json:
        engine_blocks.update(json.loads(f.read_text())["options"]["gemv_blocks"])
    result = {"gpu": torch.cuda.get_device_name(), "engine_blocks": engine_blocks, "uses": per_use(engine_blocks, dev)}
    uses = result["uses"]
    engine = {k: tuple(v) for k, v in engine_blocks.items()}
    settings = {
        "engine": engine,
        "flat": {**engine, **{k: tuple(r["best_flat"]) for k, r in uses.items()}},
        "best": {**engine, **{k: tuple(r["best_flat"]) for k, r in uses.items() if r["flat_faster"]}},  # each use's faster
    }
    result["chain"] = {"bf16": chain(settings, False, dev), "fp8": chain(settings, True, dev)}
    result["settings"] = {k: {u: list(b) for u, b in v.items()} for k, v in settings.items()}
    args.out.write_text(json.dumps(result, indent=1))
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
