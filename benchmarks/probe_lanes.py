"""Serving's A/B (`gpu_pair.sh` p2, p3; ledger: "H200 serving join", "H200 serving pace 3"): settings of the
load benchmark against the config as it is, at chosen closed levels, in one process on one engine and
detokenizer's batch. Arms: `load.detokenize_join` (a speaking stream with PROBE_JOIN chunks waiting goes
along with a held batch that goes anyway: streams' calls fall together), `load.pace` (PROBE_PACE, a lead of
PROBE_LEAD s: streams past their first PCM decoded at that many times real time, new streams stepping alone
while none is due: wider steps and calls) and `load.later_below_decode` (the detokenizer's later lane one
priority below the decode graphs: a decode step goes before a held codec batch where both wait for SMs),
`load.detokenize_least` (PROBE_LEAST codes at least a later batch, unless a chunk is due within the slack:
fewer, wider codec calls), `load.first_audio_lead_s` (PROBE_FIRST_LEAD s: while a stream makes its first
chunk, streams that far ahead of their playback sit out), `load.urgent_batches` 1 (urgent chunks made while
an urgent batch runs wait, then go as one), `load.first_audio_first` (while a stream awaits its first audio,
later chunks wait but for those due within the slack: the first call without a later batch beside it) and
`load.prefill_tokens` (PROBE_PREFILL prompt tokens admitted an iteration: fewer prompts stretch each decode
step), `load.decode_sms` (PROBE_DECODE_SMS: the decode steps on a green context of that many SMs) and
`load.later_sms` (PROBE_LATER_SMS: the detokenizer's later lane on that many). The "below" arms run last: their
lane's graphs are new, in a pool of their own, which stays; an SMs arm drops its graphs and makes them again
on its green context (and the arm after it, back on the whole GPU). A line
per level as it ends, then every level's figures as JSON, memory after the graphs made ahead (`prepared`)
included.

    PROBE_ARMS="base|join|least|first|urgent|audio_first|prefill|pace|below" PROBE_LEVELS=48,64 PROBE_JOIN=4 PROBE_LEAST=320 \
        PROBE_FIRST_LEAD=1.5 PROBE_PACE=3 PROBE_LEAD=1.5 PROBE_PREFILL=512 PROBE_DECODE_SMS=104 PROBE_LATER_SMS=64 \
        python benchmarks/probe_lanes.py <engine dir> <out.json> [config.yaml ...]
"""

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import yaml

from workflow.benchmark import sampling_of, speech_of
from workflow.codec.lanes import CodecLanes
from workflow.engines import load_engine
from workflow.generate import Ids
from workflow.serve import load

JOIN = int(os.environ.get("PROBE_JOIN", "4"))  # under h200.yaml's hold of 8
PACE = {"pace": float(os.environ.get("PROBE_PACE", "3")), "pace_lead_s": float(os.environ.get("PROBE_LEAD", "1.5"))}
PREFILL = {"prefill_tokens": int(os.environ.get("PROBE_PREFILL", "512"))}  # one 512-token prompt an iteration
LEAST = {"detokenize_least": int(os.environ.get("PROBE_LEAST", "320"))}  # h200.yaml: 8 streams' 8 held chunks
FIRST = {"first_audio_lead_s": float(os.environ.get("PROBE_FIRST_LEAD", "1.5"))}  # streams this far ahead sit out
URGENT = {"urgent_batches": 1}  # urgent chunks made while an urgent batch runs go as one
SMS = {"decode_sms": int(os.environ.get("PROBE_DECODE_SMS", "104")), "later_sms": int(os.environ.get("PROBE_LATER_SMS", "64"))}
ARMS = {"base": {}, "join": {"detokenize_join": JOIN}, "pace": PACE, "prefill": PREFILL, "least": LEAST,
        "first": FIRST, "urgent": URGENT, "first+urgent": FIRST | URGENT, "audio_first": {"first_audio_first": True},
        "join+prefill": {"detokenize_join": JOIN} | PREFILL, "below": {"later_below_decode": True},
        "join+below": {"detokenize_join": JOIN, "later_below_decode": True},
        "decode_sms": {"decode_sms": SMS["decode_sms"]}, "later_sms": {"later_sms": SMS["later_sms"]}}  # fmt: skip
ARMS = {k: v for k, v in ARMS.items() if k in os.environ.get("PROBE_ARMS", "|".join(ARMS)).split("|")}
LEVELS = [int(n) for n in os.environ.get("PROBE_LEVELS", "48,64").split(",")]
WATCH_S = float(os.environ.get("PROBE_WATCH_S", "420"))  # an arm's first prepare takes 150-300 s on an H200


def merged(a: dict, b: dict) -> dict:
    return {k: merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()} | {
        k: v for k, v in a.items() if k not in b
    }


def costliest(lv: dict, n: int = 4) -> str:
    """The level's graphs that took the most device time priced alone: key, replays x ms each."""
    return "; ".join(f"{g['key']} {g['replays']} x {g['ms']:.1f} ms" for g in lv.get("device_alone_graphs", [])[:n])


def line(name: str, lv: dict) -> str:
    r = lambda d: json.dumps({k: round(v, 2) for k, v in d.items()})  # noqa: E731
    parts = "/".join(f"{v['p50']:.0f}" for v in lv["ttfa_parts_ms"].values())  # queued, first chunk, its PCM
    return (
        f"{name} | {lv['value']} users | TTFA p50/p90/p99 {lv['ttfa_ms']['p50']:.0f}/{lv['ttfa_ms']['p90']:.0f}/"
        f"{lv['ttfa_ms']['p99']:.0f} ms | underruns {lv['underruns']} | codes/s {lv['tokens_per_s']:.0f} | "
        f"busy {lv['busy_fraction']:.2f} | device {r(lv['device_busy'])} | alone {r(lv.get('device_alone', {}))} | "
        f"costliest alone {costliest(lv)} | "
        f"host {r(lv['host_busy'])} | "
        f"rows a step {lv['mean_active_slots']:.1f} | steps {lv['iterations']} | peak {lv['peak_streams']} | "
        f"queued p99 {lv['queued_ms']['p99']:.0f} ms | iteration p50/p99/max {lv['iteration_ms']['p50']:.1f}/"
        f"{lv['iteration_ms']['p99']:.1f}/{lv['iteration_ms']['max']:.0f} ms | slowest tenth queued/chunk/PCM "
        f"{'/'.join(f'{v:.0f}' for v in lv['slowest_ttfa_parts_ms'].values())} ms | p50 {parts} ms | served {lv['served']} | "
        f"anchor put off {lv['anchor_put_off']} | "
        f"slow iterations {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in lv['slow_iterations'].items()})}"
    )


def main() -> None:
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # stopped at its limit: where it waited
    engine_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg: dict = {}
    for f in ["config/config.yaml", *sys.argv[3:]]:
        cfg = merged(cfg, yaml.safe_load(Path(f).read_text()))
    p = cfg["benchmark"]
    p = p | {"load": p["load"] | {"closed": LEVELS, "search_step": 0}}
    t0 = time.perf_counter()
    engine = load_engine(engine_dir, max_batch=max(p["load"]["slots"], 4))
    ids = Ids.of(engine.spec)
    dtype = getattr(torch, cfg["engine"]["dtype"])
    _, _, serving, _, _ = speech_of(p, engine.device, dtype, ids, load.LoadConfig.from_dict(p["load"]))
    detokenize = serving()
    print(f"engine and detokenizer made in {time.perf_counter() - t0:.0f} s", flush=True)
    results, below = {}, False
    for name, over in ARMS.items():
        t0 = time.perf_counter()
        faulthandler.dump_traceback_later(WATCH_S, repeat=True)  # an arm that stalls says where, every WATCH_S
        if over.get("later_below_decode") and not below:  # made once, for every "below" arm
            if not detokenize.lanes:
                raise SystemExit("the 'below' arm needs CUDA: a lane's priority")
            detokenize, below = CodecLanes(detokenize.batch, engine.device, time.perf_counter, later_below=True), True
        print(f"{name}: lane priorities {detokenize.priorities}", flush=True)
        lc = load.LoadConfig.from_dict(p["load"] | over)
        r = load.run(engine, detokenize, time.perf_counter, lc, ids, p["chunk_tokens"], sampling_of(p))
        results[name] = {"prepared": r["prepared"], "levels": r["levels"], "lane_priorities": r["lane_priorities"]}
        if "memory" in r["prepared"]:  # CUDA only: where the device's memory went, graphs made ahead
            print(f"{name}: memory after prepare {json.dumps(r['prepared']['memory'])}", flush=True)
        for lv in r["levels"]:
            print(line(name, lv), flush=True)
        faulthandler.cancel_dump_traceback_later()
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
