"""Each phase's device time priced alone (`device_alone`): every CUDA graph a level replayed, timed by
itself once the levels have ended, times the replays the level made, over its wall time.

Why: serving's device time by phase (`device_busy`) is each stream's span while the phases share the
GPU, so a phase beside a busy one is stretched and the phases sum past one second a second. Priced
alone, they sum to the work each second asked of the GPU: near one, the GPU's time binds, whatever the
overlap. Only graphs are priced: sampling and anything run eager (a codec call of a shape not made
ahead) are not in it, and `unpriced` counts replays of graphs dropped before the pricing."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Hashable

from workflow.cudagraphs import Graphs

Replays = Counter[tuple[str, Hashable]]  # (owner, the graph's key) -> replays


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
    its graphs' replays take, each priced alone (`Graphs.alone_ms`), and `device_alone_unpriced`: replays of
    graphs no longer there to time. Each graph is timed once, for every level."""
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
        result["device_alone_unpriced"] = sum(n for k, n in took.items() if k not in ms)
    print(f"load: {len(ms)} graphs priced alone in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def detokenizer_share(load: dict) -> float | None:
    """The detokenizer's work priced alone (both lanes), a second, at the closed level of `streams_at_slo`
    users: what issue 32 asks to stay within a third of the GPU at serving's load. None where that level
    was not priced (the CPU, no level held, or a file from before the pricing)."""
    at = [lv for lv in load["levels"] if lv["kind"] == "closed" and lv["value"] == load["streams_at_slo"]]
    priced = at[0].get("device_alone") if at else None
    return sum(v for k, v in priced.items() if k.startswith("detokenize")) if priced else None
