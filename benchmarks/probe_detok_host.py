"""Probe (ledger: "H200 detokenizer host"): where serving's detokenizer call holds the loop's thread.
H200 run 14's slowest hundredth of iterations at 64 users each held 128 ms in that call on the host,
with no graph captured. Here, with no engine, serving's codec detokenizer (config's benchmark.codec
and load) made and warmed as `load.prepare` makes it, then:

- Python's full collection: objects tracked, and ms of a gc.collect() before and after gc.freeze();
- for N streams: the host ms of a held batch's call (each stream `detokenize_hold` chunks), of such
  calls issued back to back (the later lane's queue deep; profiled), and of a batch of last pieces (their HiFT
  eager), each with its pinned-pool blocks, cudaMallocs, full collections and graph-launch ms
  (serve/waits.py), and the device ms until its PCM is ready;
- a cProfile of the slowest kind of call, top functions by their own time.

    PYTHONPATH=/tmp/site:. python benchmarks/probe_detok_host.py <out.json> config/full.yaml config/h200.yaml
"""

import cProfile
import faulthandler
import gc
import io
import json
import os
import pstats
import signal
import sys
import time
from pathlib import Path

import torch
import yaml

from workflow.benchmark import speech_of
from workflow.detokenize import Piece
from workflow.serve import load
from workflow.serve.waits import Waits

STREAMS = tuple(int(n) for n in os.environ.get("PROBE_STREAMS", "1,8,16,24").split(",") if n)
WARM_ROWS = int(os.environ.get("PROBE_WARM_ROWS", "0"))  # graphs made for up to this many streams (0: load.slots)
LASTS = [int(n) for n in os.environ.get("PROBE_LASTS", "").split(",") if n]  # one stream's last pieces, in turn


def merged(a: dict, b: dict) -> dict:
    return {k: merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()} | {
        k: v for k, v in a.items() if k not in b
    }


def timed(detok, waits: Waits, batches: list[list[Piece]], urgent: bool = False) -> dict:
    """The batches issued back to back: each call's host ms and waits, then the device ms to the last PCM."""
    t0, host, readies = time.perf_counter(), [], []
    for pieces in batches:
        w0, t = waits.level(), time.perf_counter()
        ready, _ = detok(pieces, urgent)
        host.append((time.perf_counter() - t) * 1e3)
        w = waits.level() - w0
        readies.append(ready)
        host[-1] = {"host_ms": round(host[-1], 2), "pinned_allocs": w.pinned_allocs, "device_mallocs": w.device_mallocs,
                    "gc_runs": w.gc_runs, "replay_ms": round(w.replay_s * 1e3, 2), "captured": w.captured}  # fmt: skip
    done = max(r(True) for r in readies)
    return {"calls": host, "to_ready_ms": round((done - t0) * 1e3, 2)}


def chunks(keys: list[int], done: dict[int, int], count: int, k: int, codes, last: bool = False) -> list[Piece]:
    """`count` chunks of k codes a stream, each stream's in order (`done` advanced); with `last` its last
    of 1..k codes by stream, so that last pieces take HiFT passes of their own, as serving's do."""
    ps = []
    for i, s in enumerate(keys):
        for j in range(count):
            end = last and j == count - 1
            m = 1 + i % k if end else k
            ps.append(Piece(s, codes(m), done[s], end))
            done[s] += m
    return ps


def main() -> None:
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    out = Path(sys.argv[1])
    cfg: dict = {}
    for f in ["config/config.yaml", *sys.argv[2:]]:
        cfg = merged(cfg, yaml.safe_load(Path(f).read_text()))
    p, dev = cfg["benchmark"], torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lc = load.LoadConfig.from_dict(p["load"])
    hold, k = lc.detokenize_hold, p["chunk_tokens"]
    t0 = time.perf_counter()
    _, _, serving, _, _ = speech_of(p, dev, getattr(torch, cfg["engine"]["dtype"]), None, lc)
    detok = serving()
    batch = detok.batch
    made = detok.warm(WARM_ROWS or lc.slots, k, lc.longest_codes)
    res: dict = {"warm": {"batches": made, "s": round(time.perf_counter() - t0, 1)}, "hold": hold, "slots": lc.slots}
    print(f"made and warmed: {made} batches in {res['warm']['s']} s", flush=True)
    waits = Waits(dev, [batch.graphs] if batch.graphs is not None else [])

    gc.collect()
    tracked = len(gc.get_objects())
    ms = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        ms.append(round((time.perf_counter() - t) * 1e3, 1))
    gc.freeze()
    frozen = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        frozen.append(round((time.perf_counter() - t) * 1e3, 1))
    gc.unfreeze()
    res["gc"] = {"tracked": tracked, "full_ms": ms, "frozen_full_ms": frozen, "thresholds": gc.get_threshold(),
                 "python": sys.version.split()[0]}  # fmt: skip
    print(f"gc: {res['gc']}", flush=True)
    out.write_text(json.dumps(res, indent=1))

    g = torch.Generator().manual_seed(0)
    codes = lambda n: torch.randint(0, 4096, (n,), generator=g)  # noqa: E731
    res["lasts"] = []
    for i, m in enumerate(LASTS):  # a stream: its first piece, held chunks, then a last piece of m codes
        key = batch.new_key()
        timed(detok, waits, [[Piece(key, codes(detok.first_codes), 0)]], urgent=True)
        done = {key: detok.first_codes}
        timed(detok, waits, [chunks([key], done, hold, k, codes)])
        prof = cProfile.Profile()
        prof.enable()
        r = timed(detok, waits, [[Piece(key, codes(m), done[key], True)]])
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
        res["lasts"].append({"codes": m, **r} | ({"profile": text.getvalue()[-5000:]} if i < 2 or m == LASTS[0] else {}))
        print(f"last of {m} codes: {json.dumps(r)}", flush=True)
        out.write_text(json.dumps(res, indent=1))
    for x in res["lasts"][:2]:
        print(x.get("profile", ""), flush=True)
    fc, res["streams"] = detok.first_codes, {}
    for n in STREAMS:
        keys = [batch.new_key() for _ in range(n)]
        done = dict.fromkeys(keys, 0)

        # first pieces on the urgent lane where warm made its graphs (up to 8 streams), else the later one
        r = {"first": timed(detok, waits, [[Piece(s, codes(fc), 0) for s in keys]], urgent=n <= 8)}
        for s in keys:
            done[s] = fc
        r["held"] = timed(detok, waits, [chunks(keys, done, hold, k, codes)])
        prof = cProfile.Profile()  # two held batches back to back (the pages hold 24 streams' 167 codes here)
        prof.enable()
        r["held_x2"] = timed(detok, waits, [chunks(keys, done, hold, k, codes) for _ in range(2)])
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        r["profile"] = text.getvalue()[-6000:]
        r["last"] = timed(detok, waits, [chunks(keys, done, hold, k, codes, last=True)])
        res["streams"][n] = r
        print(f"{n} streams: " + json.dumps({a: b for a, b in r.items() if a != "profile"}), flush=True)
        out.write_text(json.dumps(res, indent=1))
    print(res["streams"][max(STREAMS)].get("profile", "") if STREAMS else "", flush=True)


if __name__ == "__main__":
    main()
