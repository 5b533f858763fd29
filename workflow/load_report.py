"""benchmark.md's load section (serve/load.py's figures): the table of levels, its answer, and
each level's slowest iterations and what held them, in words."""

from __future__ import annotations

from workflow.serve import alone

FIRST = "detokenize first"  # the device_busy phase of the detokenizer's urgent lane (serve/scheduler.py)


def _prepared(made: dict | None) -> str:
    """What the load made ahead of its levels, if anything."""
    if not made or not (made["engine_graphs"] or made["detokenizer_batches"]):
        return ""
    held = f", holding {made['reserved_bytes'] / 2**30:.1f} GiB more" if made["reserved_bytes"] else ""
    admit = f", admissions {made['admission_seconds']:.0f}" if made.get("admission_seconds") is not None else ""
    engine = f" ({made['engine_seconds']:.0f} s{admit})" if "engine_seconds" in made else ""
    by_rows = made.get("detokenizer_seconds") or {}
    rows = ", ".join(f"{n}: {t['flow']:.0f} + {t['pieces']:.0f}" for n, t in by_rows.items())
    return (
        f" Made ahead of the levels: {made['engine_graphs']} engine graphs{engine} and {made['detokenizer_batches']} "
        f"detokenizer batches in {made['seconds']:.0f} s in all{held}."
        + (f" The detokenizer's seconds by batch rows, flows + pieces: {rows}." if rows else "")
        + (f" Decode steps on {made['decode_sms']} of the GPU's SMs (a green context)." if made.get("decode_sms") else "")
        + (f" The detokenizer's later lane on {made['later_sms']} of its SMs." if made.get("later_sms") else "")
        + _memory(made.get("memory"))
    )


def _memory(m: dict | None) -> str:
    """The device's memory after them, by pools (none: not CUDA, or a file from before the split)."""
    if not m:
        return ""
    gib = {k: {n: b / 2**30 for n, b in v.items()} for k, v in m.items() if isinstance(v, dict)}
    g, e, d, r = gib["graph_pools"], gib["engine_graphs"], gib["detokenizer_graphs"], gib["rest"]
    return (
        f" Graph pools then {g['reserved_bytes']:.1f} GiB ({g['allocated_bytes']:.1f} held by tensors; the engine's "
        f"captures added {e['reserved_bytes']:.1f}, the detokenizer's {d['reserved_bytes']:.1f}); the allocator's own pool "
        f"{r['reserved_bytes']:.1f} GiB (weights, caches, pages: {r['allocated_bytes']:.1f} held, the rest freed blocks "
        f"kept); the device {m['free_bytes'] / 2**30:.1f} GiB free."
    )


def host_cell(h: dict | None) -> str:
    """The loop's host time in the decode step's launch and the detokenizer's, per wall second ('-': not recorded)."""
    if h is None:
        return "-"
    return f"{h.get('decode', 0.0):.2f} / {h.get('detokenize', 0.0) + h.get(FIRST, 0.0):.2f}"


def parts_cell(lv: dict) -> str:
    """A level's time to first audio by part, in order (queued, first chunk, its PCM): each part's p50, then the
    slowest tenth's (its requests' means); '-': none (a file from before the p50s: the slowest tenth's alone)."""
    slowest = " / ".join(f"{v:.0f}" for v in s.values()) if (s := lv.get("slowest_ttfa_parts_ms")) else "-"
    if not (parts := lv.get("ttfa_parts_ms")):
        return slowest
    return " / ".join(f"{v['p50']:.0f}" for v in parts.values()) + f" · {slowest}"


def lower_bound(load: dict) -> bool:
    """Whether more streams may hold than the answer: it is the search's most (`load.search_max`), or the search
    stopped before its next level for `load.search_until_s`."""
    c = load["config"]
    return bool(c.get("search_step")) and (load["streams_at_slo"] == c.get("search_max") or bool(load.get("search_stopped")))


def _answer_bound(load: dict) -> str:
    """What the answer's line says when it is a lower bound."""
    if stop := load.get("search_stopped"):
        return (
            f"(the search stopped {stop['at_s']:.0f} s into the benchmark, before {stop['next']} users, whose level "
            f"would have ended past `load.search_until_s`: more may hold) "
        )
    return "(the most the search offers, `load.search_max`: more may hold) " if lower_bound(load) else ""


def load_markdown(load: dict) -> list[str]:
    """The load benchmark's table and its answer."""
    c, mem = load["config"], load["memory"]
    lines = [
        "",
        f"## Under load: streams per GPU at TTFA p99 <= {load['ttfa_slo_ms']:g} ms",
        "",
        f"**{load['streams_at_slo']} streams** held TTFA p99 <= {load['ttfa_slo_ms']:g} ms with no underrun "
        + _answer_bound(load)
        + "(closed loop: each user hears one reply at a time and asks again when it has played). Replies "
        f"{c['reply_seconds'][0]:g}-{c['reply_seconds'][1]:g} s of audio, prompts {c['prompt_len']} tokens, "
        f"{c['duration_s']:g} s of arrivals per level, {mem['slots']} engine slots of "
        f"{mem['kv_bytes_per_slot'] / 2**20:.1f} MiB each at {mem['max_seq_len']} positions"
        + (f" ({mem['slots_fit']} would fit beside the weights)" if "slots_fit" in mem else "")
        + f"; at most {c['prefill_tokens']} prompt tokens admitted per iteration."
        + _prepared(load.get("prepared")),
        "",
        "Busy: the loop's share of wall time with work; device: each phase's device time per wall second (prefill, "
        "sample, decode on the decoding stream; detokenizer on its own, beside it; in brackets its urgent lane, "
        "streams' chunks until each has a chunk's audio); host: the loop's own time per wall second in the decode "
        "step's launch and in the detokenizer's (both lanes), its one thread; streams: decoded a step on average "
        "(with pace, not those sitting out), the most open at once, and the most allowed (the engine's slots, load.slots and the "
        "detokenizer's flow slots); queued: arrival to admission; the slowest tenth's time to first audio (its "
        "requests' means) after each part's p50: queued, then to its first audible chunk's sending (prefill, decode "
        "steps), then to that chunk's PCM (the detokenizer).",
        "",
        "| traffic | offered streams | requests | TTFA ms p50 / p90 / p99 | underruns (stalled s) | codes/s | busy | "
        "device: prefill / sample / decode / detok. (first) | host: decode / detok. | streams: mean / most / allowed "
        "| queued ms p99 | TTFA parts ms, p50 · slowest tenth: queued / chunk / PCM | refused / failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    levels = sorted(load["levels"], key=lambda lv: (lv["kind"], lv["value"]))  # closed, then open; searched levels in place
    for lv in levels:
        t, d, what = lv["ttfa_ms"], lv["device_busy"], level_name(lv)
        lines.append(
            f"| {what} | {lv['offered_streams']:.0f} | {lv['requests']} | {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} "
            f"| {lv['underruns']} ({lv['stalled_s']:.2f}) | {lv['tokens_per_s']:.0f} | {lv['busy_fraction']:.2f} "
            f"| {' / '.join(f'{d.get(k, 0.0):.2f}' for k in ('prefill', 'sample', 'decode', 'detokenize'))}"
            f"{f' ({d[FIRST]:.2f})' if FIRST in d else ''} "
            f"| {host_cell(lv.get('host_busy'))} "
            f"| {lv['mean_active_slots']:.1f} / {lv.get('peak_streams', '-')} / {lv['max_streams']} "
            f"| {lv['queued_ms']['p99']:.1f} "
            f"| {parts_cell(lv)} "
            f"| {lv['refused']} / {lv['failed']} |"
        )
    priced = [lv for lv in levels if lv.get("device_alone")]
    if priced:
        lines += ["", "Each level's device time priced alone: every CUDA graph it replayed, timed by itself once the levels had "
                  "run, a second (its work with nothing beside it; sampling and eager calls not in it):", ""]  # fmt: skip
        lines += [f"- {level_name(lv)}: {alone_cell(lv)}" for lv in priced]
    slow = [(lv, s) for lv in levels if (s := lv.get("slow_iterations"))]
    if slow:
        lines += ["", "Each level's slowest hundredth of decoding iterations, and what they held against all its iterations:", ""]
        lines += [f"- {level_name(lv)}: {slow_line(s, lv['iterations'])}{held_note(lv)}{calls_note(lv)}" for lv, s in slow]
    return lines


def alone_cell(lv: dict) -> str:
    """A level's `device_alone` (serve/alone.py) in words: each phase's seconds a second, their sum, and the
    detokenizer's part of it."""
    a = lv["device_alone"]
    said = ", ".join(f"{k.replace('detokenize', 'detokenizer')} {v:.2f}" for k, v in a.items())
    unpriced = f" ({n} replays of graphs dropped before, not priced)" if (n := lv.get("device_alone_unpriced")) else ""
    return f"{said}: {sum(a.values()):.2f} in all, the detokenizer's {alone.share(a):.0%}{unpriced}"


def level_name(lv: dict) -> str:
    what = f"closed, {lv['value']:g} users" if lv["kind"] == "closed" else f"Poisson {lv['value']:g}/s"
    return what + (" (search)" if lv.get("searched") else "")


def slow_line(s: dict, iterations: int) -> str:
    """A level's slow iterations (serve.figures.slow_iterations) in words."""
    host = ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["host_ms"].items(), key=lambda kv: -kv[1]))
    return (
        f"{s['n']} of {iterations}, {s['threshold_ms']:.0f} ms and more (mean {s['mean_ms']:.0f}): "
        f"{100 * s['with_prompts']:.0f} % admitted prompts ({s['prompts']:.1f} on average; "
        f"of all {100 * s['all_with_prompts']:.0f} %), "
        f"{100 * s['beside_later']:.0f} % began beside a later codec batch (of all {100 * s['all_beside_later']:.0f} %); "
        f"{waits_words(s)}host ms each: {host or '-'}"
    )


def waits_words(s: dict) -> str:
    """The slow iterations' waits (serve/waits.py) in words, where any met one."""
    share, of_all = 100 * s.get("pinned_allocs", 0), 100 * s.get("all_pinned_allocs", 0)
    pinned = f"{share:.0f} % grew CUDA's pinned pool (of all {of_all:.0f} %); "
    gc = f"{100 * s.get('gc', 0):.0f} % met a full garbage collection; "
    launches = f"graph launches {s.get('replay_ms', 0):.1f} ms each (of all {s.get('all_replay_ms', 0):.1f}); "
    return (pinned if s.get("pinned_allocs") else "") + (gc if s.get("gc") else "") + (launches if s.get("replay_ms") else "")


def held_note(lv: dict) -> str:
    """What held the level beyond its work, where anything did: the detokenizer's clock anchor put off
    (its idle stream behind a lane's work, detokenize.Lanes), CUDA graphs captured mid-level, the
    allocator's retries (each a wait for the whole device), and the waits of serve/waits.py."""
    notes = waits_notes(lv.get("waits", {}))
    if n := lv.get("anchor_put_off", 0):
        notes.append(f"the detokenizer's clock anchor put off {n} times (its event queued behind a lane's work)")
    if (made := lv.get("graphs_captured", {})).get("n"):
        share = lv.get("slow_iterations", {}).get("captured", 0)
        notes.append(f"{made['n']} CUDA graphs captured mid-level ({made['seconds']:.2f} s), in {100 * share:.0f} % of these")
    if retries := lv.get("alloc_retries", 0):
        notes.append(f"the allocator's retries: {retries} (each a wait for the whole device)")
    return "".join(f"; {note}" for note in notes)


def calls_note(lv: dict) -> str:
    """The detokenizer's calls a second by lane, and the streams and chunks a call took, where recorded."""
    said = [f"{c['per_s']:.1f}/s {'first' if k == FIRST else 'later'} of {c['streams']:.1f} streams, {c['chunks']:.1f} chunks"
            for k, c in sorted(lv.get("detokenizer_calls", {}).items(), key=lambda kv: kv[0] != FIRST)]  # fmt: skip
    return f"; detokenizer calls: {', '.join(said)}" if said else ""


def waits_notes(waits: dict) -> list[str]:
    """A level's waits (serve/waits.py), where it met any."""
    said = {
        "pinned_allocs": "CUDA's pinned pool grew by {} blocks (cudaHostAlloc, ordered against every stream's work)",
        "device_mallocs": "{} cudaMalloc calls",
        "gc_runs": "{} full garbage collections",
    }
    return [text.format(waits[k]) for k, text in said.items() if waits.get(k)]
