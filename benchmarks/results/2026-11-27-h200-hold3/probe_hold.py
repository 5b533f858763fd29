"""Probe (ledger: "H200 serving hold 3"): serving's held chunks and first audio first, A/B in one
process on one engine.
Each arm builds the codec detokenizer its hold implies (`later_frames`), prepares its graphs and
runs the same closed levels; a line per level as it ends, then every level's figures as JSON.

    python benchmarks/probe_hold.py <engine dir> <out.json> [config.yaml ...]
"""

import json
import sys
import time
from pathlib import Path

import torch
import yaml

from workflow.benchmark import sampling_of, speech_of
from workflow.engines import load_engine
from workflow.generate import Ids
from workflow.serve import load

ARMS = {
    "hold 3": {"detokenize_hold": 3},
    "hold 8, slack 0.5 s": {"detokenize_hold": 8, "detokenize_slack_s": 0.5},
    "hold 3, first audio first, slack 0.3 s": {"detokenize_hold": 3, "detokenize_slack_s": 0.3, "first_audio_first": True},
}
ARMS = {k: v for k, v in ARMS.items() if k in __import__("os").environ.get("PROBE_ARMS", "|".join(ARMS)).split("|")}
LEVELS = [int(n) for n in __import__("os").environ.get("PROBE_LEVELS", "24,32").split(",")]


def merged(a: dict, b: dict) -> dict:
    return {k: merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()} | {
        k: v for k, v in a.items() if k not in b
    }


def main() -> None:
    engine_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg: dict = {}
    for f in ["config/config.yaml", *sys.argv[3:]]:
        cfg = merged(cfg, yaml.safe_load(Path(f).read_text()))
    p = cfg["benchmark"]
    t0 = time.perf_counter()
    engine = load_engine(engine_dir, max_batch=max(p["load"]["slots"], 4))
    ids = Ids.of(engine.spec)
    dtype = getattr(torch, cfg["engine"]["dtype"])
    print(f"engine loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    results = {}
    for name, over in ARMS.items():
        q = p | {"load": p["load"] | over | {"closed": LEVELS, "search_step": 0}}
        t0 = time.perf_counter()
        _, _, serving, _, idle = speech_of(q, engine.device, dtype, ids)
        lc = load.LoadConfig.from_dict(q["load"])
        r = load.run(engine, serving(), time.perf_counter, lc, ids, q["chunk_tokens"], sampling_of(q))
        results[name] = {"prepared": r["prepared"], "levels": r["levels"]}
        for lv in r["levels"]:
            print(
                f"{name} | {lv['value']} users | TTFA p50/p90/p99 {lv['ttfa_ms']['p50']:.0f}/{lv['ttfa_ms']['p90']:.0f}/"
                f"{lv['ttfa_ms']['p99']:.0f} ms | underruns {lv['underruns']} | codes/s {lv['tokens_per_s']:.0f} | "
                f"busy {lv['busy_fraction']:.2f} | device {json.dumps({k: round(v, 2) for k, v in lv['device_busy'].items()})} | "
                f"slots {lv['mean_active_slots']:.1f} | queued p99 {lv['queued_ms']['p99']:.0f} ms",
                flush=True,
            )
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        out.write_text(json.dumps(results, indent=1))
        del serving
        idle()
        torch.cuda.empty_cache() if engine.device.type == "cuda" else None


if __name__ == "__main__":
    main()
