"""Collect one GPU run of the pipeline (bf16 and FP8 variants) into a result file.

Reads each variant's verify.json and benchmark/benchmark.json as the pipeline wrote them and
writes summary.json: the figures the performance goals are judged by, each variant's
verify metrics, and the goals met, missed or, for a run of one variant only, not measured
(the ratios between the two need both from one machine). Nothing is measured here.

    python benchmarks/collect.py --bf16 <dir> --fp8 <dir> --calibrate-tsv <tsv> --out summary.json \
        --command "<how the runs were made>"
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

GOALS = [  # (figure, comparison, limit, what the issue asks)
    ("decode_vs_floor.bf16", "<=", 1.10, "bf16 decode step <= 1.10 x its floor"),
    ("decode_vs_floor.fp8", "<=", 1.15, "FP8 decode step <= 1.15 x its floor"),
    ("fp8_decode_speedup", ">=", 1.45, "FP8-trunk decode >= 1.45 x faster than bf16 (amortized steps where measured)"),
    ("prefill_matmul_efficiency.bf16", ">=", 0.65, "bf16 prefill of 512 >= 65 % of the measured matmul peak"),
    ("fp8_prefill_speedup", ">=", 1.40, "FP8 prefill >= 1.4 x bf16"),
    ("ttfa_ms_p50.fp8", "<=", 50.0, "time to first audio p50 <= 50 ms (FP8)"),
    ("ttfa_ms_p50.bf16", "<=", 50.0, "time to first audio p50 <= 50 ms (bf16)"),
    ("rtf.fp8", "<=", 0.08, "RTF <= 0.08 for one stream (FP8)"),
]
STREAMS_GOAL = {"H200": 32, "H100": 24}  # concurrent streams at RTF < 1 on one GPU of that kind
SLO_GOAL = {"H200": 128}  # streams served at TTFA p99 <= ttfa_slo_ms with no underrun (serving, benchmark.load)
CODEC_GOALS = [  # one stream with MOSS-Speech's codec decoder as the detokenizer (benchmark.codec.stream)
    ("ttfa_ms_p50_codec.fp8", "<=", 50.0, "time to first audio p50 <= 50 ms with the codec decoder (FP8)"),
    ("ttfa_ms_p50_codec.bf16", "<=", 60.0, "time to first audio p50 <= 60 ms with the codec decoder (bf16)"),
]


def figure(summary: dict, path: str) -> float | None:
    """The figure at a dotted path; None where this run did not measure it."""
    out = summary
    for key in path.split("."):
        if key not in out:
            return None
        out = out[key]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16", type=Path, help="results/<tag>/torch-bf16 (or a copy of its files)")
    ap.add_argument("--fp8", type=Path, help="results/<tag>/torch-fp8")
    ap.add_argument("--calibrate-tsv", type=Path, required=True, help="the calibrate rule's Snakemake benchmark TSV")
    ap.add_argument("--command", action="append", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ran = [p for p in ("bf16", "fp8") if getattr(args, p)]
    if not ran:
        ap.error("give --bf16, --fp8 or both")
    runs = {p: json.loads(bench_json(getattr(args, p)).read_text()) for p in ran}
    checks = {p: json.loads((getattr(args, p) / "verify.json").read_text()) for p in ran}
    with open(args.calibrate_tsv) as f:
        calib_s = float(next(csv.DictReader(f, delimiter="\t"))["s"])

    def per(key: str) -> dict:  # None where a run lacks it (the fp8 run leaves the eager baseline to bf16)
        return {p: runs[p]["summary"].get(key) for p in runs}

    has_catch_up = all("decode_step_amortized_ms" in r["summary"] for r in runs.values())  # runs since the deferred text fill
    amortized = {k: per(k) for k in ("decode_step_amortized_ms", "text_catch_up_ms")} if has_catch_up else {}

    s = {
        "gpu": runs[ran[0]]["machine"]["device"],
        "date": args.date,
        "commit": per_commit(runs),
        "command": args.command,
        "copy_bandwidth_TBps": per("copy_bandwidth_TBps"),
        "matmul_peak_TFLOPs": per("matmul_peak_TFLOPs"),
        "decode_step_ms": per("decode_step_ms"),
        "decode_floor_ms": per("decode_floor_ms"),
        "decode_vs_floor": per("decode_vs_floor"),
        **amortized,
        "prefill512_ms": per("prefill_ms"),
        "prefill_matmul_efficiency": per("prefill_matmul_efficiency"),
        "ttfa_ms_p50": per("ttfa_ms_p50"),
        "ttfa_ms_p99": per("ttfa_ms_p99"),
        "rtf": per("rtf"),
        "max_streams_rtf_below_1": per("max_streams_rtf_below_1"),
        "speedup_vs_eager_decode": per("speedup_vs_eager_decode"),
        "speedup_vs_eager_ttfa": per("speedup_vs_eager_ttfa"),
        "calibration_rule_s": calib_s,
        "calibration_samples": checks["fp8"]["held_out"]["calibration_rows"] if "fp8" in checks else None,
        "verify": {
            p: {
                "passed": c["passed"],
                "thresholds": c["thresholds"],
                **{sec: c[sec] for sec in ("teacher_forced", "teacher_forced_decode", "greedy", "held_out") if sec in c},
            }
            for p, c in checks.items()
        },
    }
    if all("ttfa_ms_p50_codec" in r["summary"] for r in runs.values()):  # runs with the codec decoder streaming
        s["ttfa_ms_p50_codec"], s["rtf_codec"] = per("ttfa_ms_p50_codec"), per("rtf_codec")
    if all("streams_at_slo" in r["summary"] for r in runs.values()):  # runs with the load benchmark
        s["streams_at_slo"] = per("streams_at_slo")
        if any("streams_at_slo_at_least" in r["summary"] for r in runs.values()):  # a search capped or stopped: more may hold
            s["streams_at_slo_at_least"] = per("streams_at_slo_at_least")
        s["ttfa_slo_ms"] = runs[ran[0]]["summary"]["ttfa_slo_ms"]
    if all("codec_gpu_share_at_slo" in r["summary"] for r in runs.values()):  # the load's levels priced alone
        s["codec_gpu_share_at_slo"] = per("codec_gpu_share_at_slo")
    if len(runs) == 2:
        step = s.get("decode_step_amortized_ms", s["decode_step_ms"])  # a reply's steps, the text catch-up spread over them
        s["fp8_decode_speedup"] = step["bf16"] / step["fp8"]
        s["fp8_prefill_speedup"] = s["prefill512_ms"]["bf16"] / s["prefill512_ms"]["fp8"]
    s["goals"] = []
    kind = next((k for k in STREAMS_GOAL if k in s["gpu"]), None)
    limit = STREAMS_GOAL.get(kind, 0)
    streams = [("max_streams_rtf_below_1.fp8", ">=", limit, f">= {limit} streams at RTF < 1 on one {kind}")] if kind else []
    if kind in SLO_GOAL and "streams_at_slo" in s:
        n, slo = SLO_GOAL[kind], s["ttfa_slo_ms"]
        streams += [(f"streams_at_slo.{p}", ">=", n, f">= {n} streams at TTFA p99 <= {slo:g} ms ({p})") for p in ran]
    codec = [g for g in CODEC_GOALS if g[0].split(".")[1] in ran] if "ttfa_ms_p50_codec" in s else []
    if "codec_gpu_share_at_slo" in s:  # its part of the work priced alone at the level of streams at the SLO (alone.py)
        third = "the codec decoder's work <= a third of the GPU at streams at the SLO"
        codec += [(f"codec_gpu_share_at_slo.{p}", "<=", 1 / 3, f"{third} ({p})") for p in ran]
    for path, op, limit, text in GOALS + streams + codec:
        got = figure(s, path)
        met = None if got is None else got <= limit if op == "<=" else got >= limit
        s["goals"].append({"goal": text, "figure": path, "measured": got, "limit": limit, "met": met})
    args.out.write_text(json.dumps(s, indent=2) + "\n")
    for g in s["goals"]:
        word = {True: "met   ", False: "MISSED", None: "no run"}[g["met"]]
        print(f"{word} {g['goal']}: " + ("not measured" if g["measured"] is None else f"{g['measured']:.3f}"))


def bench_json(variant: Path) -> Path:
    """benchmark.json of a variant: in the pipeline's layout (benchmark/) or copied flat beside verify.json."""
    nested = variant / "benchmark" / "benchmark.json"
    return nested if nested.exists() else variant / "benchmark.json"


def per_commit(runs: dict) -> dict:
    return {p: r["commit"] for p, r in runs.items()}


if __name__ == "__main__":
    main()
