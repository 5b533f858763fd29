"""The engine interface every backend implements, and the one input-embedding rule they share.

An engine holds its KV caches (trunk, text branch, audio branch: distinct layers) and answers:

    prefill(tokens [B, T, 2]) -> (text_logits | None, audio_logits)   starts B new sequences
    decode(tokens [B, 2])     -> (text_logits | None, audio_logits)   one step for each

Both take need_text: False when every sequence's next token is sampled in audio mode, whose
text logits are never read (FACTS.md section 1); the engine may then skip the text head (a
151 k x 4 k weight read) and return None, while the text branch still fills its KV cache, in
that step or (`defer_text_fill`) for all the positions owed at the next step that needs
text: the text branch's output is read nowhere else.

Each position carries (text id, audio id). Its embedding is the text one unless the text id
is modality_pad, then the audio one: `merged_ids` turns that choice into one row index of
the concatenated embedding table (text rows, then audio rows), so every backend makes it the
same way. The generation loop, verify and benchmark never know which backend they drive.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from workflow.spec import ModelSpec


def merged_ids(tokens: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[..., 2] (text id, audio id) -> [...] row of the concatenated embedding table."""
    text, audio = tokens[..., 0], tokens[..., 1]
    return torch.where(text == spec.modality_pad_token_id, spec.vocab_size + audio, text)


class Engine(ABC):
    """A built engine with its KV caches; see the module docstring."""

    spec: ModelSpec
    device: torch.device
    max_batch: int
    max_seq_len: int
    defer_text_fill: bool = False  # audio-mode decode leaves the text branch to the next text-mode step

    @abstractmethod
    def prefill(
        self, tokens: torch.Tensor, all_logits: bool = False, need_text: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Start len(tokens) new sequences. Logits of the last position ([B, V], [B, Va]), or of
        every position ([B, T, V], [B, T, Va]) with all_logits. float32. need_text: as decode."""

    @abstractmethod
    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step for each sequence. With need_text False (every sequence in audio mode) the
        text head is skipped and None returned; the text branch still fills its cache (or, with
        defer_text_fill, catches up at the next decode with need_text)."""

    def tuning_json(self) -> dict:
        """What the engine tuned on this GPU when first opened (build stores it in engine.json)."""
        return {}
