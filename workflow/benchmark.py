"""benchmark: streaming speech generation, timed honestly, next to a baseline and a floor.

The same stream (a prompt ending in start-of-speech, audio codes decoded one step at a time
with MOSS-Speech's sampling, a chunk to the detokenizer every K codes) runs through (a) a
plain eager baseline, the transformers Qwen3 paths of the reference, and (b) our engine: the
very directory verify passed. For each, warm-up runs are discarded and R runs measured; every
figure gets p50/p90/p99. Beside the streams, a micro-benchmark times the engine's own calls
(prefill of the prompt; one decode step in audio and in text mode) against their floors: the
bytes a decode step must read over the copy bandwidth, and the FLOPs of the prefill over the
matmul rate, both measured in this run. A stream that loses a chunk, or yields non-finite,
silent or wrongly sized audio, fails the rule; so does a benchmark.json that breaks its schema.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from workflow import artifacts, report, roofline, traffic
from workflow.codec import timing as codec_timing
from workflow.codec.batch import CodecBatch, CodecSpeech
from workflow.codec.lanes import CodecLanes
from workflow.codec.settings import CodecTiming, stream_decoder
from workflow.codec.slots import FlowSlots
from workflow.detokenize import Batched, Lanes, Speech, StandIn, overlaps
from workflow.engines import check_built_from, load_engine
from workflow.engines.base import Engine
from workflow.engines.slots import batch_bucket, slot_memory
from workflow.errors import InputError, run_main
from workflow.generate import Ids, Sampling
from workflow.hfckpt import load_hf_state
from workflow.load_report import lower_bound
from workflow.reference import MossSpeechReference, ReferenceEngine
from workflow.report import percentiles
from workflow.serve import alone, load
from workflow.serve.load import LoadConfig
from workflow.spec import ModelSpec, load_spec
from workflow.stream import SECONDS_PER_TOKEN, audio_seconds, check_stream, run_stream
from workflow.stream import device_clock as clock_of
from workflow.versions import versions
from workflow.vocoder import Graphed, MelStandIn, load_bigvgan

SCHEMA = Path(__file__).with_name("benchmark.schema.json")
ROWS = (2, 4, 8, 16)  # few-row decode steps, as serving's: the fused GEMV takes up to 16 rows, cuBLAS more


def microbench(engine: Engine, prompt_len: int, ids: Ids, repeat: int, reply_len: int = 0, rows: tuple[int, ...] = ()) -> dict:
    """The engine's own calls at batch 1: prefill of the prompt, one decode step per mode, and
    (reply_len > 0) the first text-mode step after a spoken reply of `reply_len` audio steps:
    where an engine that defers the text branch pays for it (once for the whole reply); then an
    audio-mode step of each of `rows` streams (`decode_audio_mode_<n>_rows_ms`), alone on the GPU."""
    prompt = traffic.speech_prompt(1, prompt_len, ids, seed=0)
    prefill = roofline.timed_ms(lambda: engine.prefill(prompt), engine.device, repeat)
    engine.prefill(prompt)
    audio_step = torch.tensor([[ids.pad, 100]])
    text_step = torch.tensor([[100, ids.audio_pad]])
    out = {
        "prefill_ms": percentiles(prefill),
        "decode_audio_mode_ms": percentiles(
            roofline.timed_ms(lambda: engine.decode(audio_step, need_text=False), engine.device, repeat)
        ),
        "decode_text_mode_ms": percentiles(
            roofline.timed_ms(lambda: engine.decode(text_step, need_text=True), engine.device, repeat)
        ),
    }
    for n in (r for r in rows if r <= engine.max_batch):
        engine.prefill(traffic.speech_prompt(n, prompt_len, ids, seed=0))
        step = functools.partial(engine.decode, audio_step.repeat(n, 1), need_text=False)
        out[f"decode_audio_mode_{n}_rows_ms"] = percentiles(roofline.timed_ms(step, engine.device, repeat))
    if not reply_len:
        return out
    after = []
    for _ in range(1 + max(1, repeat // 4)):  # a reply per sample: the first one warms up
        engine.prefill(prompt)
        for _ in range(reply_len):
            engine.decode(audio_step, need_text=False)
        after += roofline.timed_ms(lambda: engine.decode(text_step, need_text=True), engine.device, 1, warmup=0)
    out["decode_text_after_reply_ms"] = percentiles(after[1:])
    return out


def streams(engine: Engine, p: dict, speech: Callable[[int], Speech], spt: int, ids: Ids, batch: int) -> dict:
    """Warm-up, then R runs of `batch` streams decoded as one batch, each through a new speech(batch)."""
    prompt = traffic.speech_prompt(batch, p["prompt_len"], ids, p["seed"])
    sampling = sampling_of(p)
    overlap = overlaps(p["vocoder"].get("overlap", True), engine.device)
    first_alone = overlap and p["vocoder"].get("first_chunk_alone", True)
    clock = clock_of(engine.device)
    runs = []
    for i in range(p["warmup"] + p["runs"]):
        g = torch.Generator(engine.device).manual_seed(p["seed"] + i)
        request = speech(batch)
        timeline, audio = run_stream(
            engine, request, prompt, p["num_tokens"], p["chunk_tokens"], ids, clock, sampling, g, overlap, first_alone
        )
        problems = check_stream(timeline, audio, p["num_tokens"], p["chunk_tokens"], spt, request.first_codes)
        if problems:
            raise SystemExit(f"benchmark FAILED ({batch} streams): " + "; ".join(problems))
        if i >= p["warmup"]:
            runs.append(timeline)
    secs = audio_seconds(p["num_tokens"])
    return {
        "streams": batch,
        "overlap": overlap,
        "first_chunk_alone": first_alone,
        "ttfa_ms": percentiles([t.ttfa_ms() for t in runs]),
        "rtf": percentiles([t.wall_s() / secs for t in runs]),
        "tokens_per_s": percentiles([batch * p["num_tokens"] / t.wall_s() for t in runs]),
        "chunk_gap_ms": percentiles([g for t in runs for g in t.gaps_ms()] or [0.0]),
        "stages": {k: percentiles([x for t in runs for x in t.stages()[k]]) for k in runs[0].stages()},
        "chunk_ready_ms": runs[0].chunk_latency_ms(),
        "token_ms": runs[0].stages()["decode_step_ms"],
    }


def sampling_of(p: dict) -> Sampling:
    return Sampling(greedy=p["sampling"] == "greedy")


def commit() -> str:
    """The git commit of the code that ran (with -dirty if it had uncommitted changes), or
    MOSSBUILD_COMMIT where the code runs from a copy without .git (a lent GPU machine)."""
    if os.environ.get("MOSSBUILD_COMMIT"):
        return os.environ["MOSSBUILD_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(b: dict, concurrency: list[int], reply_len: int) -> dict:
    """The headline figures, each with its ratio to a floor or a baseline. The text branch's
    catch-up (what the first text-mode step after a reply of `reply_len` audio steps costs over
    a plain one) is spread over the reply's steps in decode_step_amortized_ms; measured below zero
    (noise: two medians of a busy CPU's steps), it adds nothing there."""
    one, micro, machine = b["streams"]["engine"]["1"], b["microbench"]["engine"], b["machine"]
    decode = micro["decode_audio_mode_ms"]["p50"]
    prefill = micro["prefill_ms"]["p50"]
    out = {
        "ttfa_ms_p50": one["ttfa_ms"]["p50"],
        "ttfa_ms_p99": one["ttfa_ms"]["p99"],
        "rtf": one["rtf"]["p50"],
        "decode_step_ms": decode,
        "decode_floor_ms": b["floors"]["decode_audio_mode_ms"],
        "decode_vs_floor": decode / b["floors"]["decode_audio_mode_ms"],
        "prefill_ms": prefill,
        "prefill_matmul_efficiency": b["floors"]["prefill_ms"] / prefill,
        "max_streams_rtf_below_1": max([n for n in concurrency if b["streams"]["engine"][str(n)]["rtf"]["p50"] < 1] or [0]),
        "copy_bandwidth_TBps": machine["copy_bandwidth_GBps"] / 1e3,
        "matmul_peak_TFLOPs": machine["matmul_peak_TFLOPs"],
        "text_catch_up_ms": micro["decode_text_after_reply_ms"]["p50"] - micro["decode_text_mode_ms"]["p50"],
    }
    out["decode_step_amortized_ms"] = decode + max(0.0, out["text_catch_up_ms"]) / reply_len
    if b["speech"]["kind"] == "codec":  # the figures above are the real decoder's: collect.py judges its goals on them
        out |= {"ttfa_ms_p50_codec": out["ttfa_ms_p50"], "rtf_codec": out["rtf"]}
    if "eager_baseline" in b["microbench"]:
        base = b["microbench"]["eager_baseline"]
        out["speedup_vs_eager_decode"] = base["decode_audio_mode_ms"]["p50"] / decode
        out["speedup_vs_eager_ttfa"] = b["streams"]["eager_baseline"]["1"]["ttfa_ms"]["p50"] / out["ttfa_ms_p50"]
    return out


def first_codes(engine: Engine, prompt: torch.Tensor, ids: Ids) -> Callable[[int], None]:
    """Runs one stream to its first k audio codes (prefill, then k - 1 audio-mode steps, each code
    the audio head's best before end-of-speech): the engine's part of time to first audio."""

    def run(k: int) -> None:
        _, audio = engine.prefill(prompt)
        for _ in range(k - 1):
            code = int(audio[0, : ids.eosp].argmax())
            _, audio = engine.decode(torch.tensor([[ids.pad, code]]), need_text=False)

    return run


def speech_of(p: dict, device: torch.device, dtype: torch.dtype, ids: Ids, load_cfg: LoadConfig | None) -> tuple:
    """The detokenizer `benchmark.speech` names, made once: (a request's Speech for B rows, its PCM
    samples per code, serving's detokenizer (made when called), what benchmark.json says of it, a
    call that gives back what it holds between phases).

    codec: MOSS-Speech's codec decoder of `benchmark.codec`'s shape (random weights, or its
    checkpoint), its streams in `slots` flow slots (the rest re-running every frame each call); on
    CUDA each flow call and HiFT's network from a graph per shape, serving's batches padded to
    batch_bucket rows. stand-in: a code->mel table,
    then BigVGAN-v2 (`benchmark.vocoder`), whose mel does not match the decoder's (docs/codec.md)."""
    cuda = device.type == "cuda"
    bucket = functools.partial(batch_bucket, max_batch=1 << 16)
    below = bool(load_cfg and load_cfg.later_below_decode)  # the lanes' priorities (detokenize.lane_priorities)
    if p.get("speech", "codec") == "codec":
        if not p.get("codec"):
            raise SystemExit("benchmark.speech is codec: benchmark.codec must give the decoder's shape")
        t = CodecTiming.from_dict(p["codec"])
        decoder, voice = stream_decoder(t, device)
        graphs = t.graphs and cuda  # frames padded to multiples of pad_frames: a graph per bucket of them
        held = load_cfg.detokenize_hold * decoder.cfg.chunk * decoder.stride if load_cfg else 0  # a held batch's frames a stream
        batch = CodecBatch(
            decoder, voice, bucket if cuda else lambda n: n, pad_frames=t.pad_frames if graphs else 0, graphs=graphs,
            slots=t.slots, max_codes=max(p["num_tokens"], load_cfg.longest_codes if load_cfg else 0), later_frames=held,
            pool_codes=round(t.pool_seconds / SECONDS_PER_TOKEN), fp8_pages=t.fp8_pages, later_shapes=t.later_shapes,
        )  # fmt: skip
        slot_bytes = FlowSlots.size(decoder, t.slots, batch.slot_frames, batch.pages, t.fp8_pages) if t.slots else 0
        pool = f", pages for {t.pool_seconds:g} s of audio in all" if t.pool_seconds else ""
        pool += ", keys and values in float8" if t.fp8_pages else ""
        cached = (
            f"each call solves only its new frames against its stream's flow slot ({t.slots} slots{pool}, "
            f"{slot_bytes / 2**30:.1f} GiB; streams past them re-run every frame)"
            if t.slots
            else "every flow call re-runs the front end and the ODE over all frames so far"
        )
        said = {
            "kind": "codec",
            "first_codes": batch.first_codes,
            "preset": t.preset,
            "dtype": t.dtype,
            "weights": t.weights or "random",
            "prompt_codes": t.prompt_codes,
            "voice": t.voice or "random",
            "graphs": graphs,
            "compiled": decoder.compiled,
            "kernels": decoder.kernels,
            "slots": t.slots,
            "pool_seconds": t.pool_seconds,
            "fp8_pages": t.fp8_pages,
            "pad_frames": batch.pad_frames,
            "ode_steps": decoder.cfg.solver.steps,
            "cfg_rate": decoder.cfg.solver.cfg_rate,
            "hift_dtype": t.hift_dtype,
            "slots_bytes": slot_bytes,
            "mel_stage": f"MOSS-Speech's codec decoder (workflow/codec, preset {t.preset}, {t.weights or 'random'} weights, "
            f"{'the voice of ' + t.voice if t.voice else 'a random voice'}, {t.dtype}; "
            f"HiFT's convolutions in {t.hift_dtype}, a {decoder.cfg.solver.steps}-step ODE, "
            f"guidance {decoder.cfg.solver.cfg_rate:g}): {cached}; "
            f"the estimator's fast pass{' (its blocks compiled)' if decoder.compiled else ''}"
            + (", the slots' transformer blocks as Triton kernels" if decoder.kernels and t.slots else "")
            + (", HiFT's network channels-last, its Snakes and the sums around them in Triton kernels" if decoder.kernels else "")
            + (", the flow and HiFT's network from CUDA graphs" if graphs else ""),
        }
        return (
            (lambda n: CodecSpeech(batch, n)),
            decoder.samples_per_code,
            lambda: CodecLanes(batch, device, time.perf_counter, later_below=below),
            said,
            batch.release,
        )
    voc = p["vocoder"]
    model, vinfo = load_bigvgan(voc["name"], voc.get("weights"), device, dtype, voc.get("fused_kernel", False))
    compiled = voc.get("compile", False) and cuda
    if compiled:  # dynamic: chunks of 37 and 38 frames and every batch size share a compile or two
        model = torch.compile(model, dynamic=True)
    vocoder = Graphed(model, device) if voc.get("cuda_graph", True) else model
    mel = MelStandIn(ids.eosp + 1, vinfo.num_mels, vinfo.sampling_rate / vinfo.hop, device)
    spt = round(SECONDS_PER_TOKEN * vinfo.sampling_rate)

    def vocode(m: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return vocoder(m.to(dtype))

    def serving() -> Lanes:  # the load's clock never waits for the device
        return Batched(mel, vocode, spt, device, bucket, time.perf_counter, later_below=below)

    said = {
        "kind": "stand-in",
        "first_codes": 1,
        "vocoder": vinfo.__dict__ | {"compiled": compiled},
        "mel_stage": "STAND-IN (fixed random code->mel table), not MOSS-Speech's flow-matching decoder",
    }
    return (lambda n: StandIn(mel, vocode, spt)), spt, serving, said, lambda: None


def main(argv: list[str] | None = None) -> None:
    began = time.perf_counter()  # load.search_until_s counts from here
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--hf", type=Path, required=True, help="HF checkpoint for the eager baseline")
    ap.add_argument("--out", type=Path, required=True, help="directory: benchmark.json, .md, plots")
    ap.add_argument("--params", required=True, help="the benchmark section of the config, as JSON")
    ap.add_argument("--config-json", default="{}", help="the config that shaped the figures, recorded")
    args = ap.parse_args(argv)
    p = json.loads(args.params)
    meta = check_built_from(args.engine, args.ckpt)
    concurrency = sorted(p["concurrency"])
    load_cfg = LoadConfig.from_dict(p["load"]) if p.get("load") else None
    held = load_cfg.detokenize_hold if load_cfg else 1  # serving's held chunks: their one-round call timed too
    timing = dataclasses.replace(CodecTiming.from_dict(p["codec"]), held=held) if p.get("codec") else None
    device, spec = torch.device(meta["options"].device), ModelSpec(**meta["spec"])
    ids = Ids.of(spec)
    dtype = getattr(torch, meta["options"].dtype)
    speech, spt, serving, b_speech, idle = speech_of(p, device, dtype, ids, load_cfg)

    def measure(name: str, system: Engine) -> None:
        reply_len = p["num_tokens"] if name == "engine" else 0  # the eager baseline defers nothing: minutes saved
        rows = ROWS if name == "engine" else ()
        b["microbench"][name] = microbench(system, p["prompt_len"], ids, p["micro_repeat"], reply_len, rows)
        batches = concurrency if name == "engine" else [1]
        b["streams"][name] = {str(n): streams(system, p, speech, spt, ids, n) for n in batches}
        print(f"{name}: " + ", ".join(f"{n} streams RTF p50 {r['rtf']['p50']:.3f}" for n, r in b["streams"][name].items()))

    b: dict = {"streams": {}, "microbench": {}, "speech": b_speech}
    sections: dict[str, float] = {}  # wall seconds each part of the run took, in order

    def done(name: str, t0: float) -> None:
        sections[name] = time.perf_counter() - t0
        print(f"benchmark: {name} took {sections[name]:.0f} s", flush=True)

    t0 = time.perf_counter()
    if p["baseline"]:  # first, and gone before the engine's slots are allocated: a second copy of the weights
        ref = MossSpeechReference(load_spec(args.hf), load_hf_state(args.hf, device=str(device)), dtype, device)
        measure("eager_baseline", ReferenceEngine(ref, device))  # type: ignore[arg-type]
        del ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
        done("eager_baseline", t0)
    t0 = time.perf_counter()
    engine = load_engine(args.engine, max_batch=max([*concurrency, load_cfg.slots if load_cfg else 0]))
    measure("engine", engine)
    done("engine", t0)
    b = {k: {"engine": v.pop("engine"), **v} if k in ("streams", "microbench") else v for k, v in b.items()}  # the engine first
    bandwidth, peak = roofline.copy_bandwidth(device), roofline.matmul_peak(device)
    trunk_bytes = 1 if meta["options"].precision == "fp8" else dtype.itemsize
    b["machine"] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "matmul_peak_TFLOPs": peak / 1e12,
    }
    text_branch = not engine.defer_text_fill  # whether an audio-mode step reads the text branch
    b["floors"] = {
        "decode_audio_mode_ms": 1e3 * roofline.step_bytes(spec, trunk_bytes, dtype.itemsize, False, text_branch) / bandwidth,
        "decode_text_mode_ms": 1e3 * roofline.step_bytes(spec, trunk_bytes, dtype.itemsize, need_text=True) / bandwidth,
        "prefill_ms": 1e3 * roofline.prefill_flops(spec, p["prompt_len"]) / peak,
        "note": "decode: weight bytes / measured copy bandwidth (an audio-mode step of an engine that defers the "
        "text branch reads it not at all: its floor leaves it out); prefill: matmul FLOPs / measured bf16 "
        "(CPU: float32) matmul rate. FP8 prefill could run twice the bf16 rate: its floor here is the bf16 one.",
    }
    if timing:  # the codec's stage costs, before the load: its timing graphs hold tens of GB until freed
        t0 = time.perf_counter()
        idle()  # and the flow slots' tens of GB go meanwhile
        prompt = traffic.speech_prompt(1, p["prompt_len"], ids, seed=0)
        b["codec"] = codec_timing.measure(timing, device, first_codes(engine, prompt, ids))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        done("codec", t0)
    if load_cfg:
        t0 = time.perf_counter()
        b["load"] = load.run(engine, serving(), time.perf_counter, load_cfg, ids, p["chunk_tokens"], sampling_of(p), began)
        b["load"]["memory"] = slot_memory(engine, engine.defer_text_fill)
        done("load", t0)
    b["sections_s"] = sections
    b["summary"] = summarize(b, concurrency, p["num_tokens"])
    if load_cfg:
        b["summary"] |= {"streams_at_slo": b["load"]["streams_at_slo"], "ttfa_slo_ms": b["load"]["ttfa_slo_ms"]}
        b["summary"] |= {"streams_at_slo_at_least": lower_bound(b["load"])}  # the search capped or stopped: more may hold
        b["summary"] |= {"codec_gpu_share_at_slo": alone.detokenizer_share(b["load"])}
    b |= {
        "engine": {
            "path": str(args.engine),
            **{k: getattr(meta["options"], k) for k in ("backend", "precision")},
            "options": meta["options"].to_dict(),
        },
        "mel_stage": b_speech.pop("mel_stage"),
        **({"vocoder": b_speech.pop("vocoder")} if "vocoder" in b_speech else {}),
        "settings": p,
        "versions": versions(),
        "commit": commit(),
        "config": json.loads(args.config_json),
    }
    write_outputs(b, args.out)
    print(report.markdown(b))


def write_outputs(b: dict, out: Path) -> None:
    """benchmark.json, .md and the plots in `out`, once b keeps its schema. Otherwise every figure
    goes to <out>.failed.json, so that minutes of GPU time are not lost to a schema slip, and the
    rule fails; a later pass removes that file."""
    failed = out.with_name(out.name + ".failed.json")
    try:
        report.check_schema(b, SCHEMA)
    except InputError as e:
        artifacts.write_json(failed, b)
        raise InputError(failed, f"{e.problem} (every figure of the run is in this file)") from None
    with artifacts.atomic_dir(out) as tmp:
        (tmp / "benchmark.json").write_text(json.dumps(b, indent=2) + "\n")
        (tmp / "benchmark.md").write_text(report.markdown(b))
        report.plots(b, tmp)
    failed.unlink(missing_ok=True)


if __name__ == "__main__":
    run_main(main, teardown=False)
