"""The engine interface every backend implements, and the one input-embedding rule they share.

An engine holds max_batch KV slots (each with caches for the trunk, the text branch and the
audio branch: distinct layers) and answers:

    admit(slots, tokens [B, T, 2]) -> (text_logits | None, audio_logits)  B new streams, in free slots
    step(slots, tokens [B, 2], need_text) -> (text_logits | None, audio_logits)  one position each
    release(slots)                                                        their streams end

admit prefills the new streams while the other slots keep their caches; step advances the
active slots it is given (any of them; the others keep their caches and positions) at once,
each at its own position (lengths are ragged: each slot attends to its own
history only); logits come in the order of `slots`. need_text says, per slot, whether its next
token is sampled in text mode: in audio mode the text logits are never read (FACTS.md section 1).
When no slot needs them the engine may skip the text head (a 151 k x 4 k weight read) and return
None, while the text branch still fills its KV cache, in that step or (`defer_text_fill`) for
all the positions owed at the next step that needs text: its output is read nowhere else.

prefill and decode are the lockstep form the one-request paths use (generate, verify, the
micro-benchmark): prefill releases every slot and admits B streams into slots 0..B-1, decode
steps them.

Each position carries (text id, audio id). Its embedding is the text one unless the text id
is modality_pad, then the audio one: `merged_ids` turns that choice into one row index of
the concatenated embedding table (text rows, then audio rows), so every backend makes it the
same way. The generation loop, verify and benchmark never know which backend they drive.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from workflow.spec import ModelSpec


def merged_ids(tokens: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[..., 2] (text id, audio id) -> [...] row of the concatenated embedding table."""
    text, audio = tokens[..., 0], tokens[..., 1]
    return torch.where(text == spec.modality_pad_token_id, spec.vocab_size + audio, text)


def any_text(need_text: bool | Sequence[bool]) -> bool:
    """Whether a step's text head runs: some slot needs its logits."""
    return need_text if isinstance(need_text, bool) else any(need_text)


class Engine(ABC):
    """A built engine with its KV caches; see the module docstring."""

    spec: ModelSpec
    device: torch.device
    max_batch: int
    max_seq_len: int
    defer_text_fill: bool = False  # audio-mode decode leaves the text branch to the next text-mode step

    @abstractmethod
    def admit(
        self, slots: Sequence[int], tokens: torch.Tensor, need_text: bool = True, all_logits: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Prefill len(slots) new streams [B, T, 2] into these free slots. Logits of the last
        position ([B, V], [B, Va]), or of every position ([B, T, V], [B, T, Va]) with all_logits.
        float32."""

    @abstractmethod
    def step(
        self, slots: Sequence[int], tokens: torch.Tensor, need_text: bool | Sequence[bool] = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One decode step [B, 2] for these active slots (any of them, each once, in the order of
        the rows of tokens and of the logits). need_text: per slot, or one for all; text logits
        None when no slot needs them."""

    @abstractmethod
    def release(self, slots: Sequence[int]) -> None:
        """End these slots' streams: the slots are free at once."""

    @abstractmethod
    def active(self) -> list[int]:
        """The slots holding a stream."""

    def prefill(
        self, tokens: torch.Tensor, all_logits: bool = False, need_text: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Start len(tokens) new sequences in slots 0..B-1, every slot released first."""
        b, t, _ = tokens.shape
        if b > self.max_batch or t > self.max_seq_len:
            raise ValueError(f"prefill of {b} x {t} exceeds the engine's limits {self.max_batch} x {self.max_seq_len}")
        self.release(self.active())
        return self.admit(range(tokens.shape[0]), tokens, need_text, all_logits)

    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step for each sequence prefill started."""
        if tokens.shape[0] != len(self.active()):
            raise ValueError(f"decode of batch {tokens.shape[0]} after a prefill of batch {len(self.active())}")
        return self.step(range(tokens.shape[0]), tokens, need_text)

    def tuning_json(self) -> dict:
        """What the engine tuned on this GPU when first opened (build stores it in engine.json)."""
        return {}


def to_device(device: torch.device, host: torch.Tensor | Sequence) -> torch.Tensor:
    """Host ints (a tensor, or nested lists of ints or bools, as long) on the device, copied
    through pinned memory without waiting: a plain copy from pageable memory first waits for
    the stream's work (a running decode step) and holds back every launch behind it. A tensor
    already on a device is returned as it is."""
    host = host if isinstance(host, torch.Tensor) else torch.tensor(host, dtype=torch.long)
    if host.device.type != "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
