"""The logits each open stream's next token waits to be sampled from, by slot.

A stream's logits come from its admission's prefill or its last decode step. Every stream is
sampled and stepped in the same iteration unless `pace` lets some sit out (scheduler.py), so
logits made at different steps wait side by side until their streams are next sampled."""

from __future__ import annotations

from collections.abc import Collection

import torch

from workflow.engines.base import to_device

Logits = tuple[list[int], torch.Tensor | None, torch.Tensor]  # slots, text [n, V] or None, audio [n, Va]


class Pending:
    def __init__(self) -> None:
        self.slots: list[int] = []
        self.text: torch.Tensor | None = None
        self.audio: torch.Tensor | None = None

    def add(self, slots: list[int], text: torch.Tensor | None, audio: torch.Tensor) -> None:
        """New streams' or newly stepped streams' logits (text None: no slot of theirs needs it)."""
        if not self.slots:
            self.slots, self.text, self.audio = list(slots), text, audio
            return
        old = self.text
        if old is None and text is not None:
            old = text.new_zeros(len(self.slots), text.shape[-1])
        elif text is None and old is not None:
            text = old.new_zeros(len(slots), old.shape[-1])
        self.text = None if text is None else torch.cat([old, text])
        self.slots, self.audio = self.slots + list(slots), torch.cat([self.audio, audio])

    def take(self, slots: Collection[int]) -> Logits:
        """These slots' logits, in the order they wait; they wait no more."""
        taken, kept = self._split(slots)
        out = self._rows(taken)
        self.slots, self.text, self.audio = self._rows(kept)
        return out

    def drop(self, slots: Collection[int]) -> None:
        """Streams that ended: their logits are read by no one."""
        self.take(slots)

    def _split(self, slots: Collection[int]) -> tuple[list[int], list[int]]:
        taken = [i for i, s in enumerate(self.slots) if s in slots]
        return taken, [i for i, s in enumerate(self.slots) if s not in slots]

    def _rows(self, index: list[int]) -> Logits:
        if len(index) == len(self.slots):
            return list(self.slots), self.text, self.audio
        if not index:
            return [], None, None
        rows = to_device(self.audio.device, index)
        return [self.slots[i] for i in index], None if self.text is None else self.text[rows], self.audio[rows]
