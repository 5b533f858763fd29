"""The load benchmark's answer: which closed levels held the SLO, and which level the search runs next.

With `search_step`, closed levels follow the given ones until streams at the SLO is known to within search_step
users or `search_within` of it, so the answer is not capped by the levels a config happened to offer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workflow.serve.load import LoadConfig

WITHIN = 0.25  # the search ends once the answer is known to within this share of it (LoadConfig.search_within)


def holds(level: dict, slo_ms: float) -> bool:
    """A level at the SLO: TTFA p99 within it, no underrun, no failed stream."""
    return level["ttfa_ms"]["p99"] <= slo_ms and not level["underruns"] and not level["failed"]


def past_budget(cfg: LoadConfig, levels: list[dict], at_s: float, n: int) -> dict | None:
    """Where the search stops for `search_until_s`: `at_s` into the benchmark, the level of n users would end
    past it (a level taking the levels so far's mean wall time); None: it runs (or no budget is set)."""
    if not cfg.search_until_s:
        return None
    level_s = sum(lv["wall_s"] for lv in levels) / len(levels) if levels else cfg.duration_s
    return {"next": n, "at_s": at_s, "level_s": level_s} if at_s + level_s > cfg.search_until_s else None


def next_search_level(held: dict[int, bool], step: int, most: int, within: float = WITHIN) -> int | None:
    """The closed level (users) to run next, from those run ({users: held the SLO}), or None when the
    answer is known: lo, the most users that held, and hi, the fewest above lo that did not. While
    no level above lo failed, twice lo (at most `most`); else halfway, in multiples of `step`, until
    hi - lo is at most `step` or `within` of lo."""
    lo = max((n for n, ok in held.items() if ok), default=0)
    above = [n for n, ok in held.items() if n > lo]  # all failed: lo is the most that held
    if not above:
        return min(2 * lo, most) if 0 < lo < most else None
    hi = min(above)
    if hi - lo <= max(step, int(lo * within)):
        return None
    return lo + max(1, (hi - lo) // 2 // step * step)
