"""Probe 32: how close one kernel per op can come to the decode floor, in one process.

The decode goals of issue 6 (bf16 <= 1.10 x its floor, FP8 <= 1.15 x) leave the step 10-15 %
over reading its weights once at the copy bandwidth. This probe times, against the floor
measured in the same process (the benchmark's own `roofline` functions), the kernels no engine
of this design can do without, replayed from CUDA graphs, timed in turn:

- `read`: the step's weight bytes read by eight large GEMVs, the engine's GEMV at its longest
  (the rate a GEMV reaches with its ramp and tail amortised);
- `gemvs`: the step's 144 layer GEMVs and the audio head, each its own weights, with the
  engine's tuned blocks (from the runs of record's engine.json);
- `gemvs+attention`: those and decode attention (with its combine) at each layer, at the
  benchmark's cache length, data flowing qkv -> attention -> dense as in the engine;
- `fixed`: probe 30's chain, the layer GEMVs on fixed inputs, no head (a cross-check).

Left out: the FP8 quantize kernels, the embedding row, sampling and the host's call; a whole
step can only be slower than `gemvs+attention`.

    PYTHONPATH=. python3 benchmarks/probe_bound.py --out $OUT/bound.json \\
        --engine-json benchmarks/results/2026-11-24-h100-full11/torch-fp8/engine/engine.json \\
        --engine-json benchmarks/results/2026-11-24-h100-full11/torch-bf16/engine/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from workflow import roofline
from workflow.engines import attention, gemv
from workflow.spec import PRESETS

SPEC = PRESETS["full"]
H, FFN, D = SPEC.hidden_size, SPEC.intermediate_size, SPEC.head_dim
HKV, QKV = SPEC.num_key_value_heads, SPEC.qkv_size
GOAL = {"bf16": 1.10, "fp8": 1.15}  # issue 6: decode step <= this x its floor
BF = torch.bfloat16


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def weight(n: int, k: int, fp8: bool, dev: torch.device) -> torch.Tensor:
    w = torch.randn(n, k, device=dev, dtype=BF) / 64
    return w.to(torch.float8_e4m3fn) if fp8 else w


class Layer:
    """One decoder layer's weights, norms and caches; FP8 weights with per-tensor scales of 1."""

    def __init__(self, fp8: bool, dev: torch.device):
        self.fp8 = fp8
        self.w = {
            "qkv": weight(QKV, H, fp8, dev),
            "dense": weight(H, H, fp8, dev),
            "gate_up": weight(2 * FFN, H, fp8, dev),
            "proj": weight(H, FFN, fp8, dev),
        }
        self.norm = torch.ones(H, device=dev, dtype=BF)
        self.qk_norm = torch.ones(D, device=dev, dtype=BF)
        self.one = torch.ones(1, device=dev)

    def add_caches(self, kv_len: int, max_seq: int) -> Layer:
        self.kv_len = kv_len
        self.k_cache = torch.randn(1, HKV, max_seq, D, device=self.norm.device, dtype=BF)
        self.v_cache = torch.randn_like(self.k_cache)
        return self

    def step(self, h: torch.Tensor, x8: torch.Tensor, rope: tuple, pos: torch.Tensor, attend: bool) -> torch.Tensor:
        """The layer's GEMVs (FP8: on a stand-in quantized input, as the quantize kernels are
        left out), with decode attention between qkv and dense when `attend`."""
        w, f8 = self.w, self.fp8
        qkv = gemv.launch(x8[:, :H], w["qkv"], BF, scale=self.one) if f8 else gemv.launch(h, w["qkv"], BF, norm=self.norm)
        if attend:
            y = attention.launch(
                qkv.view(1, 1, QKV), self.qk_norm, self.qk_norm, *rope, self.k_cache, self.v_cache, pos,
                self.kv_len, 1e-6, quant=self.one if f8 else None,
            ).view(1, H)  # fmt: skip
        else:
            y = x8[:, :H] if f8 else h
        h = gemv.launch(y, w["dense"], BF, scale=self.one if f8 else None, residual=h)
        if f8:
            gemv.launch(x8[:, :H], w["gate_up"], BF, scale=self.one)
            return gemv.launch(x8, w["proj"], BF, scale=self.one, residual=h)
        act = gemv.launch(h, w["gate_up"], BF, norm=self.norm, glu=True)
        return gemv.launch(act, w["proj"], BF, residual=h)


def chains(fp8: bool, dev: torch.device, args: argparse.Namespace) -> dict:
    """The graphs for one precision, timed in turn: median ms a replay, and every round, with the
    copy bandwidth measured before each round."""
    kv_len, rounds, names = args.kv_len, args.rounds, args.graphs.split(",")
    trunk, audio = SPEC.num_shared_layers, SPEC.num_modality_layers  # an audio step's layers: no text branch
    layers = [Layer(fp8 and i < trunk, dev).add_caches(kv_len, kv_len + 128) for i in range(trunk + audio)]
    head, head_norm = weight(SPEC.audio_vocab_size, H, False, dev), torch.ones(H, device=dev, dtype=BF)
    nbytes = roofline.step_bytes(SPEC, 1 if fp8 else 2, 2, need_text=False, text_branch=False)
    chunk = nbytes // 8 // (H * (1 if fp8 else 2))
    big = [weight(chunk, H, fp8, dev) for _ in range(8)] if "read" in names else []
    big_block = gemv.config_for(2 * FFN, H, 1, "") if fp8 else gemv.config_for(QKV, H, 2, "norm")
    h0, x8 = torch.randn(1, H, device=dev, dtype=BF), torch.randn(1, FFN, device=dev).to(torch.float8_e4m3fn)
    pos = torch.tensor([kv_len - 128], device=dev)  # the benchmark: a 512-token prompt, the bucket of 640
    angles = pos.float()[:, None] / SPEC.rope_theta ** (torch.arange(0, D, 2, device=dev).float() / D)
    rope = (angles.cos()[0], angles.sin()[0])
    one = torch.ones(1, device=dev)

    def read() -> None:
        for w in big:
            gemv.launch(x8[:, :H] if fp8 else h0, w, BF, scale=one if fp8 else None, block=list(big_block))

    def step(attend: bool) -> None:
        h = h0
        for layer in layers:
            h = layer.step(h, x8, rope, pos, attend)
        gemv.launch(h, head, BF, norm=head_norm)

    xi = torch.randn(1, FFN, device=dev, dtype=BF)

    def fixed() -> None:  # probe 30's chain: the same kernels, every input a fixed tensor, no head
        for layer in layers:
            w, f8, s = layer.w, layer.fp8, layer.one
            if f8:
                gemv.launch(x8[:, :H], w["qkv"], BF, scale=s)
                gemv.launch(x8[:, :H], w["dense"], BF, scale=s, residual=h0)
                gemv.launch(x8[:, :H], w["gate_up"], BF, scale=s)
                gemv.launch(x8, w["proj"], BF, scale=s, residual=h0)
            else:
                gemv.launch(h0, w["qkv"], BF, norm=layer.norm)
                gemv.launch(h0, w["dense"], BF, residual=h0)
                gemv.launch(h0, w["gate_up"], BF, norm=layer.norm, glu=True)
                gemv.launch(xi, w["proj"], BF, residual=h0)

    runs = {"read": read, "gemvs": lambda: step(False), "gemvs+attention": lambda: step(True), "fixed": fixed}
    graphs = {}
    for label, fn in ((n, runs[n]) for n in names):
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs[label] = graph
    times: dict[str, list[float]] = {label: [] for label in graphs}
    bandwidth = []  # the copy bandwidth in every round: the floor where the chains ran
    for _ in range(rounds):
        bandwidth.append(roofline.copy_bandwidth(dev))
        for label, graph in graphs.items():
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            times[label].append(start.elapsed_time(end) / 5)
    ms = {k: roofline.median(v) for k, v in times.items()}
    copies = [round(b / 1e12, 3) for b in bandwidth]
    say(f"{'fp8' if fp8 else 'bf16'}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()) + f"; copy TB/s {copies}")
    return {"bytes": nbytes, "ms": ms, "rounds_ms": times, "copy_bandwidth_rounds": bandwidth}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-json", type=Path, action="append", required=True, help="an engine.json: its gemv_blocks")
    ap.add_argument("--kv-len", type=int, default=640, help="positions decode attends to (the benchmark's bucket)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--graphs", default="read,gemvs,gemvs+attention,fixed", help="which of the graphs, comma-separated")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for f in args.engine_json:
        gemv.BLOCKS.update({k: tuple(v) for k, v in json.loads(f.read_text())["options"]["gemv_blocks"].items()})
    out = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "commit": os.environ.get("MOSSBUILD_COMMIT", "unknown"),
           "command": "PYTHONPATH=. python3 " + shlex.join(sys.argv),
           "config": {**{k: str(v) for k, v in vars(args).items()}, "blocks": {k: list(v) for k, v in gemv.BLOCKS.items()}},
           "precisions": {}}  # fmt: skip
    for name, fp8 in (("bf16", False), ("fp8", True)):
        say(f"{name}: building and timing")
        out["precisions"][name] = chains(fp8, dev, args)
        torch.cuda.empty_cache()
    heads = " | ".join(f"{k} ms (x floor)" for k in out["precisions"]["bf16"]["ms"])
    lines = [f"| precision | copy TB/s | floor ms | {heads} | goal's step ms |"]
    for name, r in out["precisions"].items():
        bw = roofline.median(r["copy_bandwidth_rounds"])
        floor = 1e3 * r["bytes"] / bw
        r["copy_bandwidth_TBps"] = bw / 1e12
        r["floor_ms"], r["goal_step_ms"] = floor, GOAL[name] * floor
        r["x_floor"] = {k: v / floor for k, v in r["ms"].items()}
        cells = " | ".join(f"{v:.3f} ({v / floor:.3f})" for v in r["ms"].values())
        lines.append(f"| {name} | {bw / 1e12:.3f} | {floor:.3f} | {cells} | {r['goal_step_ms']:.3f} ({GOAL[name]}) |")
    out["table"] = lines
    args.out.write_text(json.dumps(out, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
