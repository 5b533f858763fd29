"""The GPU configs' benchmark settings, run on the CPU before a GPU sees them: config/full.yaml's
`benchmark` section (and config/h200.yaml's over it) merged over the embedded default's, as
Snakemake merges them, with only its sizes shrunk to the tiny model (the codec's preset and dtype,
the levels, durations and repeats), through workflow.benchmark and its schema. So every setting
only the GPU configs turn on (held chunks, the search, the paged flow slots, their counts) meets its
code and the schema here: H100 run 20 lost its bf16 benchmark, after minutes of GPU time, to held
chunks that the schema did not know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from workflow import benchmark

# what a GPU config sizes for a GPU, as the tiny model on two cores can run it; nothing else changes
TINY = {
    "num_tokens": 12,
    "runs": 1,
    "concurrency": [1, 2],
    "micro_repeat": 2,
    "codec": {"preset": "tiny", "dtype": "float32", "prompt_codes": 11, "later_codes": 40, "batches": [1, 2], "repeat": 1},
    "load": {"closed": [2], "duration_s": 1.5, "search_max": 4, "reply_seconds": [1, 2], "ttfa_slo_ms": 60000},
}  # the SLO too: a GPU's; on the CPU a level holds it, so that the search runs. later_codes: 8 chunks, h200.yaml's hold


def merged(base: dict, over: dict) -> dict:
    """`over`'s keys over `base`'s, nested mappings merged key by key (Snakemake's --configfile)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def benchmark_settings(*files: str) -> dict:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for name in files:
        config = merged(config, yaml.safe_load((ROOT / "config" / name).read_text()))
    return config["benchmark"]


@pytest.mark.parametrize("files", [("full.yaml",), ("full.yaml", "h200.yaml")], ids=["full", "h200"])
def test_the_gpu_configs_benchmark_settings_run_and_keep_the_schema(files, tiny_hf, tiny_ckpt, tiny_engine_dir, tmp_path):
    gpu = benchmark_settings(*files)
    p = merged(gpu, TINY)
    assert {k: p["load"][k] for k in ("slots", "detokenize_hold", "search_step")} == {
        k: gpu["load"][k] for k in ("slots", "detokenize_hold", "search_step")
    } and (p["codec"]["slots"], p["codec"]["pool_seconds"]) == (gpu["codec"]["slots"], gpu["codec"]["pool_seconds"])
    out = tmp_path / "benchmark"
    benchmark.main(
        ["--engine", str(tiny_engine_dir), "--ckpt", str(tiny_ckpt), "--hf", str(tiny_hf), "--out", str(out),
         "--params", json.dumps(p)]
    )  # fmt: skip
    b = json.loads((out / "benchmark.json").read_text())  # written only once it kept the schema
    held = f"later, {gpu['load']['detokenize_hold']} held"
    assert ("ours, slots", held) in {(r["variant"], r["call"]) for r in b["codec"]["calls"]}
    assert b["speech"]["slots"] == gpu["codec"]["slots"] and b["speech"]["pool_seconds"] == gpu["codec"]["pool_seconds"]
    assert [lv["searched"] for lv in b["load"]["levels"]][:1] == [False]  # the given level, then what the search ran
    assert not Path(f"{out}.failed.json").exists()


def test_a_catch_up_measured_below_zero_spreads_as_nothing():
    """The text branch's catch-up is two medians' difference: on a busy CPU it came out at -120 ms
    (a preflight run beside other work), which spread over the reply made the amortized step
    negative and broke the schema. Measured below zero it adds nothing; above, its share per step."""

    def summary(after_reply_ms: float) -> dict:
        pct = lambda ms: {"p50": ms}  # noqa: E731
        b = {
            "streams": {"engine": {"1": {"ttfa_ms": pct(40.0) | {"p99": 41.0}, "rtf": pct(0.1)}}},
            "microbench": {"engine": {"decode_audio_mode_ms": pct(2.0), "prefill_ms": pct(9.0),
                                      "decode_text_mode_ms": pct(3.0), "decode_text_after_reply_ms": pct(after_reply_ms)}},
            "floors": {"decode_audio_mode_ms": 1.0, "prefill_ms": 6.0},
            "machine": {"copy_bandwidth_GBps": 3000.0, "matmul_peak_TFLOPs": 700.0},
            "speech": {"kind": "codec"},
        }  # fmt: skip
        return benchmark.summarize(b, [1], reply_len=50)

    noisy, real = summary(after_reply_ms=-117.0), summary(after_reply_ms=8.0)
    assert noisy["text_catch_up_ms"] == -120.0 and noisy["decode_step_amortized_ms"] == 2.0  # as measured; spread as 0
    assert real["text_catch_up_ms"] == 5.0 and real["decode_step_amortized_ms"] == 2.0 + 5.0 / 50
