"""benchmark.md (a table a person reads), the benchmark's plots, and its schema check."""

from __future__ import annotations

import json
from pathlib import Path

from workflow.errors import InputError
from workflow.load_report import load_markdown


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50, p90, p99, mean and count of timings (NaN where there are none)."""
    import torch

    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan"), "n": 0}
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"p50": q[0], "p90": q[1], "p99": q[2], "mean": float(t.mean()), "n": len(xs)}


def check_schema(b: dict, schema_path: Path) -> None:
    """benchmark.json must match its schema: a figure that goes missing fails the rule."""
    import jsonschema

    try:
        jsonschema.validate(b, json.loads(schema_path.read_text()))
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top)"
        raise InputError("benchmark.json", f"breaks {schema_path.name} at {where}: {e.message}") from None


def _row(name: str, streams: str, r: dict) -> str:
    s = r["stages"]
    return (
        f"| {name} | {streams} | {r['ttfa_ms']['p50']:.1f} / {r['ttfa_ms']['p99']:.1f} | {r['rtf']['p50']:.3f} | "
        f"{s['prefill_ms']['p50']:.1f} | {s['decode_step_ms']['p50']:.2f} / {s['decode_step_ms']['p99']:.2f} | "
        f"{s['mel_ms']['p50']:.2f} | {s['vocoder_ms']['p50']:.1f} | {r['tokens_per_s']['p50']:.0f} |"
    )


def detokenizer_line(stream: dict) -> str:
    """How the detokenizer ran in a stream result (`overlap`, `first_chunk_alone`)."""
    if not stream["overlap"]:
        return "in line with decoding (decoding waits for it)."
    first = "; decoding waits once, for the first chunk's PCM" if stream.get("first_chunk_alone") else ""
    return f"on a second CUDA stream of the highest priority, overlapped with decoding (chunk times from CUDA events){first}."


def speech_line(b: dict) -> str:
    """What made the PCM: the codec decoder, or the stand-in and its vocoder."""
    if "vocoder" not in b:
        return f"Detokenizer: {b['mel_stage']}."
    v = b["vocoder"]
    return (
        f"Vocoder: {v['name']} ({v['weights']} weights, {v['parameters'] / 1e6:.1f} M params, fused kernel "
        f"{'on' if v['fused_kernel'] else 'off'}{', torch.compile' if v.get('compiled') else ''}). Mel stage: {b['mel_stage']}."
    )


def first_chunk(b: dict) -> str:
    """How the first chunk differs, where it does: the codes the detokenizer's first PCM needs."""
    first, chunk = b["speech"].get("first_codes", 1), b["settings"]["chunk_tokens"]
    return f", the first of {first} (the detokenizer's first PCM needs them)" if first > chunk else ""


def markdown(b: dict) -> str:
    """The benchmark as a Markdown page: summary with ratios, micro-benchmark, streams."""
    st, sm, m, f = b["settings"], b["summary"], b["machine"], b["floors"]
    lines = [
        f"# Streaming benchmark: {b['engine']['backend']} / {b['engine']['precision']} on {m['device']}",
        "",
        f"Commit {b['commit']}. Prompt {st['prompt_len']} tokens ending in start-of-speech; {st['num_tokens']} audio "
        f"codes ({st['num_tokens'] * 0.08:.1f} s of audio) per stream, {st['sampling']} sampling; a chunk every "
        f"{st['chunk_tokens']} codes{first_chunk(b)}; {st['warmup']} warm-up + {st['runs']} measured runs. "
        f"{speech_line(b)} It runs " + detokenizer_line(b["streams"]["engine"]["1"]),
        "",
        f"Measured here: copy bandwidth {m['copy_bandwidth_GBps']:.0f} GB/s, matmul {m['matmul_peak_TFLOPs']:.1f} TFLOP/s.",
        "",
        f"- time to first audio p50 {sm['ttfa_ms_p50']:.1f} ms, p99 {sm['ttfa_ms_p99']:.1f} ms; RTF {sm['rtf']:.4f} (one stream)",
        f"- decode step (audio mode, batch 1) {sm['decode_step_ms']:.3f} ms; floor {sm['decode_floor_ms']:.3f} ms: "
        f"{sm['decode_vs_floor']:.2f} x floor"
        + (" (the text branch deferred: not read in audio mode)" if b["engine"]["options"].get("defer_text_fill") else ""),
        f"- the first text-mode step after a reply of {st['num_tokens']} audio steps costs {sm['text_catch_up_ms']:.3f} ms "
        f"more than a plain one; spread over the reply, a decode step {sm['decode_step_amortized_ms']:.3f} ms",
        f"- prefill of {st['prompt_len']} tokens {sm['prefill_ms']:.2f} ms; matmul floor {f['prefill_ms']:.2f} ms: "
        f"{100 * sm['prefill_matmul_efficiency']:.0f} % of the measured matmul rate",
        f"- most concurrent streams with RTF < 1: {sm['max_streams_rtf_below_1']} (of {st['concurrency']})",
    ]
    if "speedup_vs_eager_decode" in sm:
        lines.append(
            f"- against the eager transformers baseline: decode step {sm['speedup_vs_eager_decode']:.1f} x faster, "
            f"time to first audio {sm['speedup_vs_eager_ttfa']:.1f} x faster"
        )
    lines += [
        "",
        "| system | prefill ms p50 | decode step, audio mode, ms p50 / p99 | decode step, text mode, ms p50 "
        "| text mode after a reply, ms p50 |",
        "|---|---|---|---|---|",
    ]
    for name, mb in b["microbench"].items():
        a = mb["decode_audio_mode_ms"]
        text = mb["decode_text_mode_ms"]["p50"]
        after = f"{mb['decode_text_after_reply_ms']['p50']:.3f}" if "decode_text_after_reply_ms" in mb else "not timed"
        lines.append(f"| {name} | {mb['prefill_ms']['p50']:.2f} | {a['p50']:.3f} / {a['p99']:.3f} | {text:.3f} | {after} |")
    lines.append(f"| floor | {f['prefill_ms']:.2f} | {f['decode_audio_mode_ms']:.3f} | {f['decode_text_mode_ms']:.3f} | |")
    engine_mb = b["microbench"]["engine"]
    rows = {k.split("_")[3]: v["p50"] for k, v in engine_mb.items() if k.endswith("_rows_ms")}
    if rows:
        from workflow.engines.gemv import MAX_M  # the engine's limits the line states, as they are
        from workflow.engines.layer import COMPILED_BATCH

        lines += [
            "",
            "The engine's audio-mode decode step alone at 1 / "
            + " / ".join(rows)
            + " streams: "
            + " / ".join(f"{ms:.3f}" for ms in [engine_mb["decode_audio_mode_ms"]["p50"], *rows.values()])
            + f" ms p50 (serving's few-row steps, the layer step compiled to {COMPILED_BATCH} rows; the fused GEMV"
            + f" takes up to {MAX_M} rows, cuBLAS more).",
        ]
    lines += [
        "",
        "| system | streams | TTFA ms p50 / p99 | RTF p50 | prefill ms | token ms p50 / p99 | mel ms | vocoder ms | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, per_n in b["streams"].items():
        lines += [_row(name, n, r) for n, r in per_n.items()]
    lines += [
        "",
        "Token ms is request-loop time per step (engine step, sampling, host work), vocoder time excluded; "
        "overlapped, a step that runs beside a chunk's vocoder shares the GPU with it. With the codec decoder, mel ms "
        "is its flow calls (front end and ODE solve) and vocoder ms its HiFT, per chunk; a stream's first chunk is as many "
        "codes as its first PCM needs, so every chunk makes PCM.",
    ]
    if "load" in b:
        lines += load_markdown(b["load"])
    if "codec" in b:
        lines += codec_markdown(b["codec"])
    if b.get("sections_s"):
        parts = ", ".join(f"{name} {s:.0f} s" for name, s in b["sections_s"].items())
        lines += ["", f"Wall time of this run's parts: {parts}."]
    return "\n".join(lines) + "\n"


def codec_markdown(c: dict) -> list[str]:
    """The codec decoder's stage costs per flow call, and time to first audio with it."""
    cfg, n = c["config"], c["parameters"]
    lines = [
        "",
        "## MOSS-Speech's codec decoder (workflow/codec), per flow call",
        "",
        f"Preset `{cfg['preset']}`, {c['weights']} weights: front end {n['front_end'] / 1e6:.2f} M, estimator "
        f"{n['estimator'] / 1e6:.2f} M, HiFT {n['hift'] / 1e6:.2f} M parameters; {c['steps']} ODE steps, each one "
        f"estimator pass over 2 x batch rows (guidance). Ours: {cfg['dtype']}, the estimator's fast pass"
        + (" (its blocks compiled), " if c.get("compiled") else ", ")
        + ("CUDA graphs (HiFT: F0, its NSF source and its network in one)" if c["graphs"] else "eager")
        + "; baseline: the official structure, float32, eager, batch 1. A call runs the front end over every code so "
        "far; its ODE solve, with the flow cache, only the frames after the last call's end (the first call: after the "
        "voice prompt's past, made once per voice), and without it (ours, the baseline) every frame; `ours, slots` is "
        "the call as serving makes it, each stream in its flow slot solving only its new frames"
        + (", the slots' transformer blocks as Triton kernels (ours' HiFT fused). " if c.get("kernels") else ". ")
        + f"The first call comes after the {cfg['prompt_codes']}-code voice prompt and {c['first_codes']} codes, the "
        f"later {cfg['later_codes']} codes further on. HiFT runs every stream's frames in one call.",
    ]
    if "ttfa_ms" in c:
        lines += [
            "",
            f"Time to first audio with it, one stream (prefill, {c['first_codes'] - 1} decode steps, the first chunk's "
            f"decode): p50 {c['ttfa_ms']['p50']:.1f} ms, p99 {c['ttfa_ms']['p99']:.1f} ms.",
        ]
    lines += [
        "",
        "| variant | call | batch | codes | frames solved / all | cache MiB per stream | front end ms | ODE step ms | solve ms "
        "| HiFT ms | whole call ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in c["calls"]:
        lines.append(
            f"| {r['variant']} | {r['call']} | {r['batch']} | {r['codes']} | {r['solved_frames']} / {r['frames']} | "
            f"{r['past_mib'] / r['batch']:.1f} | {r['front_end_ms']:.2f} | "
            f"{r['ode_step_ms']:.2f} | {r['solve_ms']:.2f} | {r['hift_ms']:.2f} | {r['chunk_ms']:.2f} |"
        )
    return lines


def plots(b: dict, out: Path) -> None:
    """timeline.png (chunks against the playback deadline), latency_cdf.png, concurrency.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunk_s = b["settings"]["chunk_tokens"] * 0.08
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per_n in b["streams"].items():
        ready = per_n["1"]["chunk_ready_ms"]
        ax.plot(range(1, len(ready) + 1), ready, "o-", label=f"{name}: chunk ready")
    ready = b["streams"]["engine"]["1"]["chunk_ready_ms"]
    deadline = [ready[0] + 1e3 * chunk_s * i for i in range(len(ready))]
    ax.plot(range(1, len(ready) + 1), deadline, "k--", label="engine: playback needs it (after the first chunk)")
    ax.set(xlabel="chunk", ylabel="ms after the request", title="Per-chunk timeline, one stream")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per_n in b["streams"].items():
        xs = sorted(per_n["1"]["token_ms"])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name}: per-token latency")
    ax.set(xscale="log", xlabel="ms", ylabel="fraction of tokens", title="Per-token latency CDF, one stream")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ns = sorted(int(n) for n in b["streams"]["engine"])
    ax.plot(ns, [b["streams"]["engine"][str(n)]["rtf"]["p50"] for n in ns], "o-", label="engine: RTF p50 per stream")
    ax.axhline(1.0, color="k", ls="--", label="real time")
    ax2 = ax.twinx()
    ax2.plot(ns, [b["streams"]["engine"][str(n)]["ttfa_ms"]["p50"] for n in ns], "s:", color="tab:orange", label="TTFA p50 (ms)")
    ax.set(xscale="log", xlabel="concurrent streams (one batch)", ylabel="RTF", title="Concurrency")
    _save_twin(plt, fig, ax, ax2, "time to first audio, ms", out / "concurrency.png")
    if "load" in b:
        load_plots(b["load"], out, plt)


def _save_twin(plt, fig, ax, ax2, right_label: str, path: Path) -> None:
    """A plot with a second y axis: its label, both legends, written to path."""
    ax2.set_ylabel(right_label)
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_plots(load: dict, out: Path, plt) -> None:
    """load.png (TTFA p99 and underruns against offered load), load_timeline.png (one stream)."""
    closed = sorted((lv for lv in load["levels"] if lv["kind"] == "closed"), key=lambda lv: lv["value"])
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [lv["offered_streams"] for lv in closed]
    ax.plot(xs, [lv["ttfa_ms"]["p99"] for lv in closed], "o-", label="TTFA p99 (closed loop)")
    opened = [lv for lv in load["levels"] if lv["kind"] == "open"]
    if opened:
        ax.plot(
            [lv["offered_streams"] for lv in opened], [lv["ttfa_ms"]["p99"] for lv in opened], "s-", label="TTFA p99 (Poisson)"
        )
    ax.axhline(load["ttfa_slo_ms"], color="k", ls="--", label="SLO")
    ax2 = ax.twinx()
    ax2.bar(xs, [lv["underruns"] for lv in closed], width=max(xs) / 40, color="tab:red", alpha=0.4, label="underruns")
    ax.set(xlabel="offered concurrent streams", ylabel="ms", title="Time to first audio under load")
    _save_twin(plt, fig, ax, ax2, "underruns", out / "load.png")
    t = load.get("timeline")
    if not t:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    n = range(1, len(t["chunk_ready"]) + 1)
    ax.plot(n, [1e3 * x for x in t["chunk_ready"]], "o-", label="chunk ready")
    ax.plot(n, [1e3 * x for x in t["chunk_due"]], "k--", label="chunk due (playback)")
    ax.axhline(1e3 * t["admitted"], color="tab:gray", ls=":", label="admitted")
    ax.set(xlabel="chunk", ylabel="ms after arrival", title=f"One stream under load ({t['level']:g} users)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "load_timeline.png", dpi=110)
    plt.close(fig)
