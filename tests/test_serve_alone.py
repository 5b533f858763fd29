"""Each phase's device time priced alone (serve/alone.py): the load's levels count their graphs' replays,
and once every level has run each graph is timed by itself, once. Graphs are CUDA's, so here a stand-in
with the same counts and prices (test_cudagraphs.py times real ones on the GPU machine)."""

from collections import Counter

import pytest

from workflow.generate import Ids, Sampling
from workflow.serve import alone, load
from workflow.spec import PRESETS

URGENT, LATER = -3, -2
PREFILL = ((2, 512, 2), "admit", True, False)  # the engine's keys: (tokens' shape, kind, ...), or the catch-up's
STEP, CATCH_UP = ((8, 1, 2), "step", True, 256, False), ("catch-up", 8, 3, 256)
FIRST, HELD, HIFT = ("slots", (2, 60), 60, URGENT), ("slots", (8, 160), 160, LATER), ("hift", 8, 160, LATER)


class Priced:
    """A Graphs' stand-in: the replays so far, and each key's ms alone (None: dropped, not there to time)."""

    def __init__(self, ms: dict):
        self.ms, self.replays, self.timed = ms, Counter(), []

    def alone_ms(self, keys, repeat=3):
        self.timed.append(set(keys))
        return {k: self.ms[k] for k in keys if self.ms.get(k) is not None}


def test_each_replay_is_priced_alone_in_its_phase():
    """Two levels: each phase's seconds a second are its replays times their graphs' ms alone over the
    level's wall time; the engine's admissions are prefill, its steps and catch-ups decode, the
    detokenizer's urgent-lane graphs its first pieces'. Each graph is timed once for both levels, and a
    dropped graph's replays are counted as unpriced. Each level lists its graphs by their priced seconds,
    most first."""
    engine = Priced({PREFILL: 10.0, STEP: 4.0, CATCH_UP: 1.0})
    detok = Priced({FIRST: 18.0, HELD: 50.0, HIFT: 9.0, ("slots", (1, 20), 20, LATER): None})
    sets = {"engine": engine, "detokenizer": detok}
    one = Counter({("engine", PREFILL): 2, ("engine", STEP): 100, ("detokenizer", FIRST): 3})
    two = Counter({("engine", STEP): 50, ("engine", CATCH_UP): 4, ("detokenizer", HELD): 2, ("detokenizer", HIFT): 2})
    two[("detokenizer", ("slots", (1, 20), 20, LATER))] = 5
    levels = [({"wall_s": 2.0}, one), ({"wall_s": 0.5}, two)]
    alone.price(levels, sets, URGENT)
    (a, _), (b, _) = levels
    assert a["device_alone"] == pytest.approx({"prefill": 0.010, "decode": 0.200, "detokenize first": 0.027})
    assert b["device_alone"] == pytest.approx({"decode": 0.408, "detokenize": 0.236})
    assert (a["device_alone_unpriced"], b["device_alone_unpriced"]) == (0, 5)
    assert [(g["owner"], g["phase"], g["replays"], g["ms"]) for g in b["device_alone_graphs"]] == [
        ("engine", "decode", 50, 4.0), ("detokenizer", "detokenize", 2, 50.0), ("detokenizer", "detokenize", 2, 9.0),
        ("engine", "decode", 4, 1.0)]  # fmt: skip
    assert a["device_alone_graphs"][0]["key"] == repr(STEP)
    assert engine.timed == [{PREFILL, STEP, CATCH_UP}] and len(detok.timed) == 1  # once, every level's keys


def test_without_lanes_every_detokenizer_graph_is_a_later_ones():
    assert alone.phase("detokenizer", FIRST, None) == "detokenize" and alone.phase("vocoder", (4, 2), URGENT) == "detokenize"
    assert alone.phase("engine", CATCH_UP, URGENT) == "decode" and alone.phase("engine", PREFILL, None) == "prefill"


def test_the_load_prices_each_levels_replays_once_every_level_has_run(monkeypatch):
    """`load.run`: a level's replays are those made while it ran (the readings' difference), and the
    graphs are timed after the last level, the search's included, not between levels."""
    engine = Priced({STEP: 5.0})
    order = []

    def level(engine_, detokenize, clock, lv, chunk_tokens, sampling):
        assert not engine.timed  # nothing timed while levels run
        engine.replays[STEP] += 10 * lv.value
        order.append(lv.value)
        return {"kind": lv.kind, "value": lv.value, "ttfa_ms": {"p99": 100.0}, "underruns": 0, "failed": 0,
                "tokens_per_s": 1.0, "busy_fraction": 0.5, "wall_s": 1.0}, []  # fmt: skip

    monkeypatch.setattr(load, "run_level", level)
    monkeypatch.setattr(load, "prepare", lambda *a: {})
    monkeypatch.setattr(alone, "graph_sets", lambda engine_, detokenize: {"engine": engine})
    cfg = load.LoadConfig(closed=(2, 4), search_step=2, search_max=6)
    out = load.run(None, None, lambda: 0.0, cfg, Ids.of(PRESETS["tiny"]), 5, Sampling())
    assert order == [2, 4, 6] and len(engine.timed) == 1
    assert [lv["device_alone"] for lv in out["levels"]] == [{"decode": pytest.approx(0.005 * 10 * n)} for n in order]


def test_the_detokenizers_share_is_read_at_the_level_of_streams_at_the_slo():
    """Both lanes' part of all the work priced alone at the closed level of `streams_at_slo` users, not another
    level's (nor seconds a second: phases side by side can sum past one); None where that level was not
    priced or none held."""
    levels = [
        {"kind": "closed", "value": 32, "device_alone": {"decode": 0.3, "detokenize": 0.2, "detokenize first": 0.1}},
        {"kind": "closed", "value": 64, "device_alone": {"decode": 0.4, "detokenize": 0.3, "detokenize first": 0.15}},
        {"kind": "open", "value": 64, "device_alone": {"detokenize": 0.9}},
    ]
    assert alone.detokenizer_share({"levels": levels, "streams_at_slo": 64}) == pytest.approx(0.45 / 0.85)
    assert alone.detokenizer_share({"levels": levels, "streams_at_slo": 32}) == pytest.approx(0.5)
    assert alone.detokenizer_share({"levels": levels, "streams_at_slo": 0}) is None
    assert alone.detokenizer_share({"levels": [{"kind": "closed", "value": 4}], "streams_at_slo": 4}) is None
