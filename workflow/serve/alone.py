"""Each phase's device time priced alone (`device_alone`): every CUDA graph a level replayed, timed by
itself once the levels have ended, times the replays the level made, over its wall time.

Why: serving's device time by phase (`device_busy`) is each stream's span while the phases share the
GPU, so a phase beside a busy one is stretched and the phases sum past one second a second. Priced
alone, each phase's figure is its own work, whatever ran beside it. They can still sum past one: graphs
of a few rows leave most of the GPU idle, and two lanes' graphs side by side take less than one after
the other (an H200's 80 FP8 users: 1.29 in all, the loop busy 0.98; levers.md, "H200 serving priced").
So a phase's share of the GPU is its part of the sum (`share`). Only graphs are priced: sampling and
anything run eager (a codec call of a shape not made ahead) are not in it, and `unpriced` counts replays
of graphs dropped before the pricing."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Hashable

from workflow.cudagraphs import Graphs

Replays = Counter[tuple[str, Hashable]]  # (owner, the graph's key) -> replays
TOP = 8  # the graphs a level lists by their priced seconds (`device_alone_graphs`)


def graph_sets(engine: object, detokenize: object) -> dict[str, Graphs]:
    """The CUDA graphs a level replays, by owner: the engine's and its detokenizer's (the codec decoder's
    batch, or the stand-in's vocoder)."""
    owners = {"engine": engine, "detokenizer": getattr(detokenize, "batch", None)}
    owners["vocoder"] = getattr(detokenize, "vocoder", None)
    return {name: g for name, o in owners.items() if isinstance(g := getattr(o, "graphs", None), Graphs)}


def replays(sets: dict[str, Graphs]) -> Replays:
    """The replays so far of every graph of `sets` (a level takes the difference of two readings)."""
    return Counter({(name, key): n for name, g in sets.items() for key, n in g.replays.items()})


def phase(owner: str, key: Hashable, urgent: int | None) -> str:
    """The loop's phase a graph's replay belongs to: the engine's admissions are prefill, its steps (and the
    text branch's catch-up) decode; the detokenizer's graphs on the urgent lane (keyed last by the lane's
    priority, detokenize.Lanes) are its first pieces', the rest its later ones'."""
    if owner == "engine":
        return "prefill" if isinstance(key, tuple) and key[1:2] == ("admit",) else "decode"
    return "detokenize first" if urgent is not None and isinstance(key, tuple) and key[-1:] == (urgent,) else "detokenize"


def price(levels: list[tuple[dict, Replays]], sets: dict[str, Graphs], urgent: int | None, repeat: int = 3) -> None:
    """Adds to each level (its result, the replays it made) `device_alone`: by phase, the seconds a second
    its graphs' replays take, each priced alone (`Graphs.alone_ms`); `device_alone_graphs`: the TOP graphs
    that took most of them (which shapes the work went to); and `device_alone_unpriced`: replays of graphs
    no longer there to time. Each graph is timed once, for every level."""
    ms: dict[tuple[str, Hashable], float] = {}
    t0 = time.perf_counter()
    for name, g in sets.items():
        keys = {key for _, took in levels for owner, key in took if owner == name}
        ms |= {(name, key): t for key, t in g.alone_ms(keys, repeat).items()}
    for result, took in levels:
        seconds: Counter[str] = Counter()
        for (owner, key), n in took.items():
            if (owner, key) in ms:
                seconds[phase(owner, key, urgent)] += n * ms[owner, key] / 1e3
        result["device_alone"] = {p: s / result["wall_s"] for p, s in sorted(seconds.items())}
        top = sorted((k for k in took if k in ms), key=lambda k: -took[k] * ms[k])[:TOP]
        result["device_alone_graphs"] = [
            {"owner": o, "key": repr(key), "phase": phase(o, key, urgent), "replays": took[o, key], "ms": ms[o, key]}
            for o, key in top
        ]
        result["device_alone_unpriced"] = sum(n for k, n in took.items() if k not in ms)
    print(f"load: {len(ms)} graphs priced alone in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def share(priced: dict[str, float]) -> float:
    """The detokenizer's two lanes as a part of all the work priced alone (`device_alone`)."""
    return sum(v for k, v in priced.items() if k.startswith("detokenize")) / sum(priced.values())


def detokenizer_share(load: dict) -> float | None:
    """The detokenizer's part of the GPU's work (`share`) at the closed level of `streams_at_slo` users: what
    issue 32 asks to stay within a third at serving's load. None where that level was not priced (the CPU,
    no level held, or a file from before the pricing)."""
    at = [lv for lv in load["levels"] if lv["kind"] == "closed" and lv["value"] == load["streams_at_slo"]]
    priced = at[0].get("device_alone") if at else None
    return share(priced) if priced else None
