"""benchmark.md (a table a person reads) and the benchmark's plots."""

from __future__ import annotations


def _row(name: str, streams: str, r: dict) -> str:
    s = r["stages"]
    return (
        f"| {name} | {streams} | {r['ttfa_ms']['p50']:.1f} / {r['ttfa_ms']['p99']:.1f} | {r['rtf']['p50']:.3f} | "
        f"{s['prefill_ms']['p50']:.1f} | {s['decode_step_ms']['p50']:.2f} / {s['decode_step_ms']['p99']:.2f} | "
        f"{s['mel_ms']['p50']:.2f} | {s['vocoder_ms']['p50']:.1f} | {r['tokens_per_s']['p50']:.0f} |"
    )


def markdown(b: dict) -> str:
    """The benchmark as a Markdown page: summary, then one row per system and stream count."""
    st, sm = b["settings"], b["summary"]
    lines = [
        f"# Streaming benchmark: {b['engine']['backend']} / {b['engine']['precision']} on {b['device']}",
        "",
        f"Prompt {st['prompt_len']} tokens ending in start-of-speech; {st['num_tokens']} audio codes "
        f"({st['num_tokens'] * 0.08:.1f} s of audio); a chunk every {st['chunk_tokens']} codes; "
        f"{st['warmup']} warm-up + {st['runs']} measured runs. Vocoder: {b['vocoder']['name']} "
        f"({b['vocoder']['weights']} weights, {b['vocoder']['parameters'] / 1e6:.1f} M params). "
        f"Mel stage: {b['mel_stage']}.",
        "",
        f"- time to first audio p50 {sm['ttfa_ms_p50']:.1f} ms, p99 {sm['ttfa_ms_p99']:.1f} ms; RTF {sm['rtf']:.3f}",
        f"- decode step p50 {sm['decode_step_ms_p50']:.3f} ms; floor {sm['decode_floor_ms']:.3f} ms "
        f"(weight bytes / {b['copy_bandwidth_GBps']:.0f} GB/s measured copy bandwidth): "
        f"{sm['decode_vs_floor']:.2f} x floor",
        f"- most concurrent streams with RTF < 1: {sm['max_streams_rtf_below_1']}",
        "",
        "| system | streams | TTFA ms p50 / p99 | RTF p50 | prefill ms | decode step ms p50 / p99 "
        "| mel ms | vocoder ms | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, per_n in b["results"].items():
        lines += [_row(name, n, r) for n, r in per_n.items()]
    return "\n".join(lines) + "\n"
