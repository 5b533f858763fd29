"""Synthetic MOSS-Speech traffic: token sequences shaped like real requests.

Alternating text segments and speech segments: text tokens, start-of-speech, audio codes
(each paired with modality_pad on the text channel), end-of-speech, more text, ... Used for
the calibration set, the held-out verify prompts and the benchmark prompts, each from its
own seed so they never share a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workflow.generate import Ids
from workflow.spec import FIRST_SPECIAL_TEXT_ID


@dataclass(frozen=True)
class Segments:
    """Segment lengths (uniform in [lo, hi]): a sentence of text, a few seconds of speech."""

    text: tuple[int, int] = (4, 40)
    speech: tuple[int, int] = (12, 100)  # 12.5 codes per second: 1 to 8 s


def sequence(length: int, ids: Ids, g: torch.Generator, seg: Segments = Segments()) -> torch.Tensor:
    """One [length, 2] sequence of (text id, audio id), starting with text."""
    rows: list[tuple[int, int]] = []

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    while len(rows) < length:
        rows += [(randint(0, FIRST_SPECIAL_TEXT_ID - 1), ids.audio_pad) for _ in range(randint(*seg.text))]
        rows.append((ids.sosp, ids.audio_pad))
        rows += [(ids.pad, randint(0, ids.eosp - 1)) for _ in range(randint(*seg.speech))]
        rows.append((ids.pad, ids.eosp))
    return torch.tensor(rows[:length], dtype=torch.long)


def batch(n: int, length: int, ids: Ids, seed: int, seg: Segments = Segments()) -> torch.Tensor:
    """[n, length, 2] sequences from one seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([sequence(length, ids, g, seg) for _ in range(n)])


def speech_prompt(n: int, length: int, ids: Ids, seed: int) -> torch.Tensor:
    """[n, length, 2]: a request for a spoken reply, i.e. text that ends in start-of-speech."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, FIRST_SPECIAL_TEXT_ID, (n, length), generator=g)
    text[:, -1] = ids.sosp
    return torch.stack([text, torch.full_like(text, ids.audio_pad)], dim=-1)
