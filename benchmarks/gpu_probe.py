"""GPU probe: the machine's ceilings and every engine variant on the exact full MOSS-Speech shape.

Random weights of the full shape are generated on the GPU and kept in memory (no disk), so one
call can build, check and time all variants: eager, CUDA graphs, compile + graphs, in bf16 and
with an FP8 trunk (calibrated by modelopt on synthetic traffic), plus the vocoder. Each
variant is checked against the transformers reference (teacher-forced top-1 and KL) before
it is timed. This informs the engine's defaults; the numbers that claims rest on come from the
pipeline itself (benchmark rule), run by benchmarks/gpu_pipeline.sh.

    python benchmarks/gpu_probe.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.probe_parts import (
    call_split,
    defer_fill_ab,
    dot_ab,
    glu_ab,
    kernel_summary,
    loop,
    loop_line,
    resident_ab,
    steady_key,
    vocoder_times,
)
from workflow import calibrate, roofline, traffic, verify
from workflow.engines import gemv
from workflow.engines.torch_engine import EngineOptions, TorchEngine
from workflow.generate import Ids
from workflow.names import hf_to_trt
from workflow.reference import MossSpeechReference
from workflow.spec import PRESETS
from workflow.synthetic import synthetic_state

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a local smoke run on tiny
LOG: list[str] = []
OUT_DIR = Path(".")  # --out's folder: traces go beside it


def say(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    LOG.append(line)
    print(line, flush=True)


def agreement(engine, ref, prompts, ids) -> dict:
    """verify's teacher-forced metrics of both heads, engine vs reference: the prefill path, and
    under "decode" the decode path (the first prompt alone: the rows the fused GEMV takes)."""
    m = verify.teacher_forced(engine, ref, prompts, ids)

    def pick(path: str) -> dict:
        return {h: {k: m[path][h][k] for k in ("top1", "kl_mean", "max_abs_diff")} for h in ("text", "audio")}

    return {**pick("prefill"), "decode": pick("decode")}


def decode_matches(engine, ids, prompt, steps: int = 8) -> float:
    """Max |logit diff| between graph-replayed and eager decode steps of the same engine."""
    if DEV.type != "cuda":
        return float("nan")
    worst = 0.0
    tok = torch.tensor([[ids.pad, 123]] * prompt.shape[0])
    for use_graphs in (False, True):
        engine.use_graphs = use_graphs
        engine.prefill(prompt)
        outs = [engine.decode(tok, need_text=True) for _ in range(steps)]
        if not use_graphs:
            eager = outs
    for (a_t, a_a), (b_t, b_a) in zip(eager, outs, strict=True):
        worst = max(worst, float((a_t - b_t).abs().max()), float((a_a - b_a).abs().max()))
    engine.use_graphs = True
    return worst


def micro(engine, ids, batches: tuple[int, ...] = (1,), repeat: int = 20) -> dict:
    out = {}
    prompt = traffic.speech_prompt(1, 512, ids, seed=0)
    out["prefill512_ms"] = roofline.median(roofline.timed_ms(lambda: engine.prefill(prompt), DEV, 5))
    for b in batches:
        p = traffic.speech_prompt(b, 512, ids, seed=0)
        engine.prefill(p)
        audio, text = torch.tensor([[ids.pad, 100]] * b), torch.tensor([[100, ids.audio_pad]] * b)
        for mode, tok, need_text in (("audio", audio, False), ("text", text, True)):
            step = lambda tok=tok, need_text=need_text: engine.decode(tok, need_text=need_text)  # noqa: E731
            out[f"decode_{mode}_b{b}_ms"] = roofline.median(roofline.timed_ms(step, DEV, repeat))
    return out


def replay_split(engine, ids, repeat: int = 20) -> dict:
    """Where a timed decode step (audio, batch 1) goes: the engine call as the benchmark times
    it, its graph replayed alone (synchronised each time), and replayed 20 times back to back
    (no host work between), per step."""
    if DEV.type != "cuda":
        return {}
    engine.prefill(traffic.speech_prompt(1, 512, ids, seed=0))
    tok = torch.tensor([[ids.pad, 100]])
    call = roofline.median(roofline.timed_ms(lambda: engine.decode(tok, need_text=False), DEV, repeat))
    graph = engine.graphs.graphs[steady_key(engine)][0]

    def burst() -> None:
        for _ in range(20):
            graph.replay()

    out = {
        "engine_call_ms": call,
        "replay_ms": roofline.median(roofline.timed_ms(graph.replay, DEV, repeat)),
        "replay_burst_ms": roofline.median(roofline.timed_ms(burst, DEV, 5)) / 20,
    }
    say(f"decode step split: {json.dumps(out)}")
    return out


def decode_after(engine, ids, rounds: int = 3) -> dict:
    """One decode step (audio, batch 1) timed right after a burst of prefills, as `micro` and
    the benchmark time it, and again after 200 untimed steps, in turn: a transient left by the
    heavy prefills (clocks, power) shows as a difference. Wall-clock stamps (ms) go to the log,
    to line up with a clock trace taken beside the probe."""
    if DEV.type != "cuda":
        return {}
    prompt, tok = traffic.speech_prompt(1, 512, ids, seed=0), torch.tensor([[ids.pad, 100]])

    def step() -> None:
        engine.decode(tok, need_text=False)

    out: dict[str, list[float]] = {"after_prefills_ms": [], "after_steps_ms": []}
    for _ in range(rounds):
        for _ in range(8):
            engine.prefill(prompt)
        say(f"  t={time.time():.3f} after prefills")
        out["after_prefills_ms"].append(roofline.median(roofline.timed_ms(step, DEV, 20)))
        for _ in range(200):
            step()
        say(f"  t={time.time():.3f} after steps")
        out["after_steps_ms"].append(roofline.median(roofline.timed_ms(step, DEV, 20)))
    say(f"decode after prefills / after steps: {json.dumps(out)}")
    return out


def profile(engine, ids) -> dict:
    """Where the time goes: the top kernels of one prefill of 512 and one eager decode step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    out = {}
    prompt = traffic.speech_prompt(1, 512, ids, seed=0)
    step = torch.tensor([[ids.pad, 100]])
    for name, fn in (
        ("prefill512", lambda: engine.prefill(prompt)),
        ("decode_eager", lambda: engine.decode(step, need_text=False)),
    ):
        engine.prefill(prompt)
        engine.use_graphs = False
        fn()
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        engine.use_graphs = True
        summary = kernel_summary(p)
        out[name] = {"gpu_ms": summary.pop("kernel_ms"), **summary}
        say(f"profile {name}: {out[name]['gpu_ms']:.2f} ms GPU time in {out[name]['kernels']} kernels")
        for key, ms, n in out[name]["top"]:
            say(f"    {ms:8.3f} ms  x{n:<4d} {key}")
    return out


def prefill_ab(engine, ids, rounds: int = 4) -> dict:
    """Prefill of 512 with FP8 fast accumulation off and on, timed in turn (A, B, A, B: drift
    within the process hits both alike), each setting replayed from its own graph."""
    from workflow.cudagraphs import Graphs
    from workflow.engines.linears import Fp8Linear

    prompt = traffic.speech_prompt(1, 512, ids, seed=0)
    graphs, times = {}, {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            for m in engine.modules():
                if isinstance(m, Fp8Linear):
                    m.fast_accum = on
            engine.graphs = graphs.setdefault(on, Graphs(DEV))
            times[on] += roofline.timed_ms(lambda: engine.prefill(prompt), DEV, 5)
    out = {f"fast_accum_{int(on)}_ms": roofline.median(ts) for on, ts in times.items()}
    say(f"prefill512 A/B fast accumulation: {json.dumps(out)}")
    return out


def per_call_ms(fn, reps: int = 50) -> float:
    """One call's time, from a CUDA graph of `reps` calls (no launch gaps)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return roofline.median(roofline.timed_ms(graph.replay, DEV, 10)) / reps


def gemm_times(spec) -> dict:
    """Each trunk matrix alone: bf16 at M=1 and 16, FP8 _scaled_mm at M=16 (the padded decode
    step). GB/s counts the weight bytes once."""
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = {"qkv": (spec.qkv_size, h), "dense": (h, h), "gate_up": (2 * i, h), "proj": (h, i)}
    one = torch.tensor([1.0], device=DEV)
    out = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        w8 = w.to(torch.float8_e4m3fn)
        x1, x16 = torch.randn(1, k, device=DEV, dtype=torch.bfloat16), torch.randn(16, k, device=DEV, dtype=torch.bfloat16)
        x8 = x16.to(torch.float8_e4m3fn)
        row = {
            "bf16_m1": (per_call_ms(lambda: torch.nn.functional.linear(x1, w)), 2 * n * k),  # noqa: B023
            "bf16_m16": (per_call_ms(lambda: torch.nn.functional.linear(x16, w)), 2 * n * k),  # noqa: B023
            "fp8_m16": (per_call_ms(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16)), n * k),  # noqa: B023
        }
        if gemv.available():
            gemv.tune([(w, ""), (w8, "")])
            x81 = x1.to(torch.float8_e4m3fn)
            row["gemv_bf16_m1"] = (per_call_ms(lambda: gemv.gemv(x1, w, torch.bfloat16)), 2 * n * k)  # noqa: B023
            row["gemv_fp8_m1"] = (per_call_ms(lambda: gemv.gemv(x81, w8, torch.bfloat16, scale=one)), n * k)  # noqa: B023
            out[name + "_blocks"] = {"bf16": gemv.config_for(n, k, 2), "fp8": gemv.config_for(n, k, 1)}
        out[name] = {lab: {"us": 1e3 * ms, "GBps": b / ms / 1e6} for lab, (ms, b) in row.items()}
        say(
            f"gemm {name} {n}x{k}: " + ", ".join(f"{lab} {r['us']:.1f} us ({r['GBps']:.0f} GB/s)" for lab, r in out[name].items())
        )
        say(f"     tuned gemv blocks (BLOCK_N, BLOCK_K, warps): {out.get(name + '_blocks')}")
    return out


def variant(name: str, spec, tensors, options: EngineOptions, ref, prompts, ids, with_profile: bool) -> dict:
    """Build one engine variant, check it against the reference, then time it."""
    t = time.time()
    try:
        return _variant(name, spec, tensors, options, ref, prompts, ids, with_profile, t)
    except Exception as e:  # one variant failing must not cost the others' measurements
        say(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
        free()
        return {"failed": f"{type(e).__name__}: {str(e)[:2000]}"}


def _variant(name: str, spec, tensors, options: EngineOptions, ref, prompts, ids, with_profile: bool, t: float) -> dict:
    eng = TorchEngine(spec, tensors, options)
    v = {"agreement": agreement(eng, ref, prompts, ids)}
    if options.cuda_graphs:
        v["graph_vs_eager_max_diff"] = decode_matches(eng, ids, traffic.speech_prompt(1, 64, ids, seed=3))
    v |= micro(eng, ids, (1, 32) if options.cuda_graphs else (1,))
    v["decode_split"] = replay_split(eng, ids) if options.cuda_graphs else {}
    v["decode_after"] = decode_after(eng, ids) if options.cuda_graphs else {}
    v["gemv_blocks"] = eng.gemv_blocks
    v["gemv_tuned_ms"] = {k: gemv.TUNED_MS[k] for k in eng.gemv_blocks if k in gemv.TUNED_MS}
    v["build_and_check_s"] = time.time() - t
    if with_profile and options.compile:
        v["profile"] = profile(eng, ids)
    if name.startswith("fp8") and "ab" in name.split()[-1].split("+"):  # the A/B of fast accumulation
        v["prefill_ab"] = prefill_ab(eng, ids)
    parts = {"deferab": defer_fill_ab, "gluab": glu_ab, "resab": resident_ab, "dotab": dot_ab, "callsplit": call_split}
    for word, part in parts.items():
        if word in name.split()[-1].split("+"):
            try:  # one part failing must not cost the variant's other measurements
                v[word] = part(eng, ids, DEV)
            except Exception as e:
                v[word] = {"failed": f"{type(e).__name__}: {str(e)[:2000]}"}
            say(f"{word}: {json.dumps(v[word])}")
    if "loop" in name.split()[-1].split("+"):
        v["loop"] = loop(eng, ids, DEV, OUT_DIR / f"loop-trace-{name.split()[0]}.json.gz")
    say(f"{name}: {json.dumps(v)}")
    del eng
    free()
    return v


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--preset", default="full")
    ap.add_argument(
        "--variants",
        default="bf16 eager,bf16 graphs,bf16 compile+graphs,bf16 compile+graphs+gemv,fp8 graphs,fp8 compile+graphs,"
        "fp8 compile+graphs+gemv",
        help="comma-separated; each name's +-words pick the options: graphs, compile, gemv, attn (decode_attention), "
        "nodefer (no deferred GEMV body offered to the tuner), "
        "defer (the text branch deferred to the next text-mode step), "
        "deferab / gluab / resab / dotab (decode A/Bs: deferred text fill, GLU, resident GEMV, tensor-core GEMV), "
        "callsplit (an engine call's pieces timed), "
        "fastacc (FP8 fast accumulation), ab (FP8: "
        "prefill timed with fast accumulation off and on in turn), "
        "loop (the benchmark's stream, its vocoder left out: "
        "TTFA less the vocoder, decode steps with their host work)",
    )
    ap.add_argument("--vocoder", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile", action="store_true", help="kernel profile of one prefill and one decode step")
    ap.add_argument("--gemm", action="store_true", help="bare bf16 GEMV and FP8 _scaled_mm times of the trunk shapes")
    args = ap.parse_args()
    global OUT_DIR
    OUT_DIR = args.out.parent
    dtype, vocoder_name = (
        ("bfloat16", "bigvgan_v2_24khz_100band_256x") if DEV.type == "cuda" else ("float32", "reduced_24khz_100band_256x")
    )
    torch._dynamo.config.cache_size_limit = 256  # variants add up: each engine compiles its own shapes
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    res: dict = {"gpu": name, "torch": torch.__version__, "preset": args.preset, "variants": {}}
    say(f"{res['gpu']}, torch {torch.__version__}")
    res["copy_bandwidth_GBps"] = roofline.copy_bandwidth(DEV) / 1e9
    res["matmul_peak_TFLOPs"] = roofline.matmul_peak(DEV) / 1e12
    say(f"copy {res['copy_bandwidth_GBps']:.0f} GB/s, matmul {res['matmul_peak_TFLOPs']:.0f} TFLOP/s")
    spec, ids = PRESETS[args.preset], Ids.of(PRESETS[args.preset])
    t = time.time()
    state = synthetic_state(spec, 0, DEV.type)
    hf = {}
    for k in list(state):
        hf[k] = state.pop(k).to(torch.bfloat16)
    free()
    trt = hf_to_trt(hf, spec)
    say(f"full synthetic weights on the GPU in {time.time() - t:.1f} s")
    bw = res["copy_bandwidth_GBps"] * 1e9
    floors = {
        "bf16_audio": 1e3 * roofline.step_bytes(spec, 2, 2, False) / bw,
        "bf16_text": 1e3 * roofline.step_bytes(spec, 2, 2, True) / bw,
        "fp8_audio": 1e3 * roofline.step_bytes(spec, 1, 2, False) / bw,
        "fp8_text": 1e3 * roofline.step_bytes(spec, 1, 2, True) / bw,
        "bf16_audio_deferred": 1e3 * roofline.step_bytes(spec, 2, 2, False, text_branch=False) / bw,
        "fp8_audio_deferred": 1e3 * roofline.step_bytes(spec, 1, 2, False, text_branch=False) / bw,
        "prefill512": 1e3 * roofline.prefill_flops(spec, 512) / (res["matmul_peak_TFLOPs"] * 1e12),
    }
    res["floors_ms"] = floors
    ref = MossSpeechReference(spec, hf, getattr(torch, dtype), DEV)
    prompts = traffic.batch(2, 96, ids, seed=7001)
    if args.gemm:
        res["gemm"] = gemm_times(spec)

    tuned: dict[tuple[str, bool], dict] = {}  # (precision, deferred body offered) -> blocks: tune once

    def tune_key(name: str) -> tuple[str, bool]:
        return name.split()[0], "nodefer" not in name.split()[-1].split("+")

    def options(name: str) -> EngineOptions:
        words = name.split()[-1].split("+")
        return EngineOptions(
            DEV.type, dtype, 32, 1024, "graphs" in words, "compile" in words, "gemv" in words,
            gemv_blocks=tuned.get(tune_key(name)), decode_attention="attn" in words, fp8_fast_accum="fastacc" in words,
            defer_text_fill="defer" in words,
        )  # fmt: skip

    def run(name: str, tensors) -> dict:
        saved = gemv.DEFER_N_CHOICES
        gemv.DEFER_N_CHOICES = saved if tune_key(name)[1] else ()
        try:
            v = variant(name, spec, tensors, options(name), ref, prompts, ids, args.profile)
        finally:
            gemv.DEFER_N_CHOICES = saved
        if v.get("gemv_blocks"):
            tuned[tune_key(name)] = v["gemv_blocks"]
        return v

    def label(name: str) -> str:
        """A variant named twice (timed again, to see drift) keeps both results."""
        n = sum(k.split(" #")[0] == name for k in res["variants"])
        return f"{name} #{n + 1}" if n else name

    for name in [n for n in args.variants.split(",") if n.startswith("bf16")]:
        res["variants"][label(name)] = run(name, trt)
    fp8_variants = [n for n in args.variants.split(",") if n.startswith("fp8")]
    if fp8_variants:  # FP8: modelopt on the reference over synthetic traffic, then the checkpoint's tensors
        t = time.time()
        rows = list(traffic.batch(args.calib_samples, 256, ids, seed=1234))
        qref = MossSpeechReference(spec, hf, getattr(torch, dtype), DEV)
        calibrate.quantize(qref, rows, DEV.type)
        amax = calibrate.amax_table(qref)
        del qref
        free()
        fp8 = calibrate.fp8_tensors(trt, amax, spec)
        res["fp8_calibration_s"] = time.time() - t
        say(f"FP8 calibration ({args.calib_samples} samples) {res['fp8_calibration_s']:.1f} s")
    for name in fp8_variants:
        res["variants"][label(name)] = run(name, fp8)
    if args.vocoder:
        res |= vocoder_times(DEV, getattr(torch, dtype), vocoder_name, say)
    args.out.write_text(json.dumps(res, indent=2))
    print(
        "\n| variant | top1 text/audio | KL text/audio | prefill512 ms | decode b1 audio ms (x floor) | text ms | b32 audio ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, v in res["variants"].items():
        if "failed" in v:
            print(f"| {name} | FAILED: {v['failed'][:100]} |")
            continue
        a = v["agreement"]
        deferred = "_deferred" if "defer" in name.split()[-1].split("+") else ""
        floor = floors[("fp8_audio" if name.startswith("fp8") else "bf16_audio") + deferred]
        print(
            f"| {name} | {a['text']['top1']:.4f}/{a['audio']['top1']:.4f} | "
            f"{a['text']['kl_mean']:.2e}/{a['audio']['kl_mean']:.2e} | "
            f"{v['prefill512_ms']:.2f} | {v['decode_audio_b1_ms']:.3f} ({v['decode_audio_b1_ms'] / floor:.2f}) | "
            f"{v['decode_text_b1_ms']:.3f} | {v.get('decode_audio_b32_ms', float('nan')):.3f} |"
        )
    for name, v in res["variants"].items():
        if "loop" in v:
            print(loop_line(name, v["loop"]))
    print(f"floors ms: {json.dumps({k: round(x, 3) for k, x in floors.items()})}")


if __name__ == "__main__":
    main()
