"""benchmark: streaming speech generation, timed honestly, next to a baseline and a floor.

The same stream (a prompt ending in start-of-speech, audio codes decoded one step at a time,
a chunk to the detokenizer every K codes) runs through (a) a plain eager baseline, the
transformers Qwen3 paths of the reference, and (b) our engine: the very directory verify
passed. For each, warm-up runs are discarded and R runs measured; every figure gets
p50/p90/p99. The floor is the bytes one decode step must read over the copy bandwidth
measured in the same run. A stream that loses a chunk, or yields non-finite, silent or
wrongly sized audio, fails the rule.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from workflow import artifacts, report, traffic
from workflow.build import versions
from workflow.download import load_hf_state
from workflow.engines import check_built_from, load_engine
from workflow.engines.base import Engine
from workflow.errors import run_main
from workflow.generate import Ids
from workflow.reference import MossSpeechReference, ReferenceEngine
from workflow.spec import ModelSpec, load_spec
from workflow.stream import SECONDS_PER_TOKEN, audio_seconds, check_stream, run_stream
from workflow.vocoder import MelStandIn, load_bigvgan


def percentiles(xs: list[float]) -> dict[str, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"p50": q[0], "p90": q[1], "p99": q[2], "mean": float(t.mean()), "n": len(xs)}


def step_bytes(spec: ModelSpec, trunk_bytes: float, other_bytes: float, need_text: bool) -> int:
    """Weight bytes one decode step reads: every layer and norm, the audio head, and the text
    head only when needed. The embedding is one row per token: left out."""
    h, d = spec.hidden_size, spec.head_dim
    layer = h * spec.qkv_size + h * spec.num_attention_heads * d + 3 * h * spec.intermediate_size
    norms = 2 * h + 2 * d
    trunk = spec.num_shared_layers * (layer * trunk_bytes + norms * other_bytes)
    branches = 2 * spec.num_modality_layers * (layer + norms) * other_bytes + 2 * h * other_bytes
    heads = spec.audio_vocab_size * h + (spec.vocab_size * h if need_text else 0)
    return int(trunk + branches + heads * other_bytes)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large device copy (median of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() / sorted(times[2:])[len(times[2:]) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engine: Engine, p: dict, mel: MelStandIn, vocoder, spt: int, ids: Ids, batch: int) -> dict:
    """Warm-up, then R runs of `batch` streams; returns percentiles and the raw timelines."""
    prompt = traffic.speech_prompt(batch, p["prompt_len"], ids, p["seed"])

    def clock() -> float:
        sync(engine.device)
        return time.perf_counter()

    runs = []
    for i in range(p["warmup"] + p["runs"]):
        timeline, audio = run_stream(engine, mel, vocoder, prompt, p["num_tokens"], p["chunk_tokens"], spt, ids, clock)
        problems = check_stream(timeline, audio, p["num_tokens"], p["chunk_tokens"], spt)
        if problems:
            raise SystemExit(f"benchmark FAILED ({batch} streams): " + "; ".join(problems))
        if i >= p["warmup"]:
            runs.append(timeline)
    secs = audio_seconds(p["num_tokens"])
    stages = {k: percentiles([x for t in runs for x in t.stages()[k]]) for k in runs[0].stages()}
    return {
        "streams": batch,
        "ttfa_ms": percentiles([t.ttfa_ms() for t in runs]),
        "rtf": percentiles([t.wall_s() / secs for t in runs]),
        "tokens_per_s": percentiles([batch * p["num_tokens"] / t.wall_s() for t in runs]),
        "chunk_gap_ms": percentiles([g for t in runs for g in t.gaps_ms()] or [0.0]),
        "stages": stages,
        "timeline_ms": runs[0].chunk_latency_ms(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--hf", type=Path, required=True, help="HF checkpoint for the eager baseline")
    ap.add_argument("--out", type=Path, required=True, help="directory: benchmark.json, .md, plots")
    ap.add_argument("--params", required=True, help="the benchmark section of the config, as JSON")
    ap.add_argument("--config-json", default="{}", help="the whole config, recorded in the result")
    args = ap.parse_args(argv)
    p = json.loads(args.params)
    meta = check_built_from(args.engine, args.ckpt)
    concurrency = sorted(p["concurrency"])
    engine = load_engine(args.engine, max_batch=max(concurrency))
    spec, ids = engine.spec, Ids.of(engine.spec)
    dtype = getattr(torch, meta["options"]["dtype"])
    vocoder, vinfo = load_bigvgan(p["vocoder"]["name"], p["vocoder"].get("weights"), engine.device, dtype)
    mel = MelStandIn(ids.eosp + 1, vinfo.num_mels, vinfo.sampling_rate / vinfo.hop, engine.device)
    spt = round(SECONDS_PER_TOKEN * vinfo.sampling_rate)

    def voc(m: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return vocoder(m.to(dtype))

    systems: dict[str, Engine] = {"engine": engine}
    if p["baseline"]:
        ref = MossSpeechReference(load_spec(args.hf), load_hf_state(args.hf), dtype, engine.device)
        systems["eager_baseline"] = ReferenceEngine(ref, engine.device)  # type: ignore[assignment]
    results: dict[str, dict] = {}
    for name, system in systems.items():
        batches = concurrency if name == "engine" else [1]
        results[name] = {str(n): measure(system, p, mel, voc, spt, ids, n) for n in batches}
        print(f"{name}: " + ", ".join(f"{n} streams RTF p50 {r['rtf']['p50']:.3f}" for n, r in results[name].items()))
    bw = copy_bandwidth(engine.device)
    trunk_b = 1 if meta["precision"] == "fp8" else dtype.itemsize
    floor_ms = 1e3 * step_bytes(spec, trunk_b, dtype.itemsize, need_text=False) / bw
    one = results["engine"]["1"]
    summary = {
        "ttfa_ms_p50": one["ttfa_ms"]["p50"],
        "ttfa_ms_p99": one["ttfa_ms"]["p99"],
        "rtf": one["rtf"]["p50"],
        "decode_step_ms_p50": one["stages"]["decode_step_ms"]["p50"],
        "decode_floor_ms": floor_ms,
        "decode_vs_floor": one["stages"]["decode_step_ms"]["p50"] / floor_ms,
        "max_streams_rtf_below_1": max([n for n in concurrency if results["engine"][str(n)]["rtf"]["p50"] < 1] or [0]),
    }
    if "eager_baseline" in results:
        summary["speedup_vs_eager_decode"] = (
            results["eager_baseline"]["1"]["stages"]["decode_step_ms"]["p50"] / summary["decode_step_ms_p50"]
        )
    out = {
        "summary": summary,
        "engine": {
            "path": str(args.engine),
            "backend": meta["backend"],
            "precision": meta["precision"],
            "dtype": meta["options"]["dtype"],
        },
        "device": torch.cuda.get_device_name(engine.device)
        if engine.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "copy_bandwidth_GBps": bw / 1e9,
        "vocoder": vinfo.__dict__,
        "mel_stage": "STAND-IN (fixed random code->mel table), not MOSS-Speech's flow-matching decoder",
        "settings": p,
        "results": results,
        "versions": versions(),
        "config": json.loads(args.config_json),
    }
    with artifacts.atomic_dir(args.out) as tmp:
        (tmp / "benchmark.json").write_text(json.dumps(out, indent=2) + "\n")
        (tmp / "benchmark.md").write_text(report.markdown(out))
    print(report.markdown(out))


if __name__ == "__main__":
    run_main(main)
