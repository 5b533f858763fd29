"""A ragged batch, teacher-forced: sequences that join at different steps, sit at different
lengths and modes, and leave part-way, all through one engine's slots at once.

verify's `ragged` check runs this and compares every logit with the reference's over each
sequence alone: a slot that read another slot's length, position or cache would show there and
nowhere in the lockstep checks, where every row has the same length.

The plan (`plan`): sequence i prefills its first `prompt_len[i]` positions, then feeds the rest
one decode step at a time, and leaves after its last. A new sequence is admitted whenever a slot
is free, at most one a step, so sequences start at different steps, slots are reused, and rows
move as others leave. Every third step of a sequence's slot it sits out while another steps (as
serving's paced streams do), so steps of some of the slots, and the rows moved for them, are
checked too. Each step asks for text logits per slot where that slot's next token is a
text one, as the serving loop does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workflow.engines.base import Engine
from workflow.generate import Ids, audio_mode_after


@dataclass(frozen=True)
class Plan:
    prompt_len: list[int]  # positions prefilled, per sequence
    length: list[int]  # positions fed in all (prompt + decode steps), per sequence


def plan(n: int, length: int) -> Plan:
    """n sequences from prompts of `length`: prompts of a quarter to a half of it, total lengths
    of three quarters to all of it, all different where they can be."""
    q = max(1, length // 4)
    return Plan([q + (7 * i) % q for i in range(n)], [length - (5 * i) % q for i in range(n)])


@dataclass
class Logits:
    """One sequence's logits from the engine, after positions prompt_len-1 .. length-2."""

    text: list[torch.Tensor]
    audio: list[torch.Tensor]
    asked: list[bool]  # text logits asked for (else a zeros row)


def run(engine: Engine, seqs: torch.Tensor, p: Plan, ids: Ids) -> list[Logits]:
    """Feed seqs [N, T, 2] through the engine's slots as the plan says."""
    engine.release(engine.active())
    mode = audio_mode_after(seqs, ids)  # [N, T]: the token after each position is an audio one
    out = [Logits([], [], []) for _ in range(len(seqs))]
    fed = [0] * len(seqs)  # positions fed so far
    slot_of: dict[int, int] = {}  # sequence -> slot
    waiting = list(range(len(seqs)))
    steps = 0
    while waiting or slot_of:
        free = [s for s in range(engine.max_batch) if s not in slot_of.values()]
        if waiting and free:
            i = waiting.pop(0)
            t = p.prompt_len[i]
            text, audio = engine.admit([free[0]], seqs[i : i + 1, :t], need_text=True)
            slot_of[i], fed[i] = free[0], t
            _record(out[i], text[0], audio[0], True)
        going = [i for i in slot_of if fed[i] < p.length[i]]
        leaving = [i for i in slot_of if fed[i] >= p.length[i]]
        if leaving:
            engine.release([slot_of.pop(i) for i in leaving])
        if not going:
            continue
        steps += 1
        resting = [i for i in going if (slot_of[i] + steps) % 3 == 0]
        going = [i for i in going if i not in resting] or going
        need = [not bool(mode[i, fed[i]]) for i in going]  # the token after the one fed is a text one
        tokens = torch.stack([seqs[i, fed[i]] for i in going])
        text, audio = engine.step([slot_of[i] for i in going], tokens, need)
        for row, i in enumerate(going):
            fed[i] += 1
            if fed[i] < p.length[i]:  # the last position's logits are read by no one
                asked = need[row] and text is not None
                _record(out[i], text[row] if asked else None, audio[row], asked)
    return out


def _record(acc: Logits, text: torch.Tensor | None, audio: torch.Tensor, asked: bool) -> None:
    acc.text.append(text if text is not None else torch.zeros(0))
    acc.audio.append(audio)
    acc.asked.append(asked)


def compare(engine: Engine, ref, seqs: torch.Tensor, ids: Ids, metrics, tie_margin: float = 0.0) -> dict[str, dict]:
    """Both heads' metrics (`metrics`: verify.head_metrics), the engine's ragged run against the
    reference run over each sequence alone; the text head where the engine was asked for it."""
    p = plan(len(seqs), seqs.shape[1])
    got = run(engine, seqs, p, ids)
    n_codes = ids.eosp + 1
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("rt", "et", "ra", "ea", "mode", "asked")}
    for i, logits in enumerate(got):
        rt, ra, _ = ref(seqs[i : i + 1, : p.length[i]])
        at = slice(p.prompt_len[i] - 1, p.length[i] - 1)
        asked = torch.tensor(logits.asked)
        parts["rt"].append(rt[0, at][asked].float().cpu())
        parts["et"] += [t.float().cpu()[None] for t, a in zip(logits.text, logits.asked, strict=True) if a]
        parts["ra"].append(ra[0, at, :n_codes].float().cpu())
        parts["ea"].append(torch.stack(logits.audio)[:, :n_codes].float().cpu())
        parts["mode"].append(audio_mode_after(seqs[i], ids)[at])
        parts["asked"].append(asked)
    cat = {k: torch.cat(v) for k, v in parts.items()}
    text_mode = ~cat["mode"][cat["asked"]]
    return {
        "text": metrics(cat["rt"], cat["et"], text_mode, tie_margin),
        "audio": metrics(cat["ra"], cat["ea"], cat["mode"], tie_margin),
        "sequences": len(seqs),
        "prompt_len": p.prompt_len,
        "length": p.length,
    }
