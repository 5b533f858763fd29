"""Which KV-cache rows hold which streams: an engine's slots, kept packed.

A stream is admitted into a free slot (an id the caller holds, 0..max_batch-1) and lives in a
row of the engine's caches. Rows 0..n-1 are the active ones, always, and a released row is
refilled by moving the last active row into it (`release` says which moves to make; the engine
copies that row's caches, or its block table). A decode step of k of them runs rows 0..k-1 (a
plain slice of every cache, one CUDA graph per row-count bucket): `front` says which rows to swap
so that the slots stepped hold those rows; a set that stays the same needs none. Each row keeps
its own length (positions cached) and how many of them the text branch has filled
(`defer_text_fill`). Both backends use this bookkeeping; it checks every request against it and
answers a ValueError in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workflow.engines.base import Engine


class Slots:
    def __init__(self, max_batch: int, max_seq_len: int):
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.row_of: dict[int, int] = {}  # slot -> row
        self.slot_at: list[int] = []  # row -> slot, rows 0..n-1
        self.length: list[int] = []  # row -> positions cached
        self.filled: list[int] = []  # row -> positions the text branch has filled

    @property
    def n(self) -> int:
        return len(self.slot_at)

    def active(self) -> list[int]:
        """The active slots, in row order."""
        return list(self.slot_at)

    def admit(self, slots: Sequence[int], prompt_len: int) -> range:
        """Rows for new streams of `prompt_len` positions in these free slots."""
        if len(set(slots)) != len(slots) or not slots:
            raise ValueError(f"admit: slots {list(slots)} must be distinct, at least one")
        bad = [s for s in slots if not 0 <= s < self.max_batch]
        if bad:
            raise ValueError(f"admit: slot(s) {bad} outside 0..{self.max_batch - 1}")
        taken = [s for s in slots if s in self.row_of]
        if taken:
            raise ValueError(f"admit: slot(s) {taken} hold a stream; release them first")
        if not 0 < prompt_len <= self.max_seq_len:
            raise ValueError(f"admit: a prompt of {prompt_len} positions does not fit a slot of {self.max_seq_len}")
        rows = range(self.n, self.n + len(slots))
        for s, r in zip(slots, rows, strict=True):
            self.row_of[s] = r
        self.slot_at += list(slots)
        self.length += [prompt_len] * len(slots)
        self.filled += [prompt_len] * len(slots)
        return rows

    def rows(self, slots: Sequence[int]) -> list[int]:
        """The rows of a decode step's slots, in the caller's order: active slots, each once."""
        if len(set(slots)) != len(slots) or not set(slots) <= set(self.row_of):
            raise ValueError(f"step: slots {list(slots)} are not distinct active ones {sorted(self.slot_at)}")
        full = [s for s in slots if self.length[self.row_of[s]] >= self.max_seq_len]
        if full:
            raise ValueError(f"step: slot(s) {full} reached the engine's max_seq_len {self.max_seq_len}")
        return [self.row_of[s] for s in slots]

    def front(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """The swaps of rows that put these active slots in rows 0..k-1: disjoint pairs (a row below k
        for one at or past it), so they may be made in any order, or at once."""
        k, swaps = len(slots), []
        outside = [self.row_of[s] for s in slots if self.row_of[s] >= k]
        inside = [r for r in range(k) if self.slot_at[r] not in set(slots)]
        for a, b in zip(inside, outside, strict=True):
            sa, sb = self.slot_at[a], self.slot_at[b]
            self.slot_at[a], self.slot_at[b], self.row_of[sa], self.row_of[sb] = sb, sa, b, a
            self.length[a], self.length[b] = self.length[b], self.length[a]
            self.filled[a], self.filled[b] = self.filled[b], self.filled[a]
            swaps.append((a, b))
        return swaps

    def stepped(self, rows: Sequence[int], filled: Sequence[int] = ()) -> None:
        """These rows gained a position; the text branch is filled to their length in rows `filled`."""
        for r in rows:
            self.length[r] += 1
        for r in filled:
            self.filled[r] = self.length[r]

    def release(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """Free these slots; the (from row, to row) moves that keep the active rows packed, to be
        made in order."""
        unknown = [s for s in slots if s not in self.row_of]
        if unknown:
            raise ValueError(f"release: slot(s) {unknown} hold no stream")
        moves = []
        for s in slots:
            row, last = self.row_of.pop(s), self.n - 1
            if row != last:
                moved = self.slot_at[last]
                self.row_of[moved], self.slot_at[row] = row, moved
                self.length[row], self.filled[row] = self.length[last], self.filled[last]
                moves.append((last, row))
            del self.slot_at[last], self.length[last], self.filled[last]
        return moves


def step_bucket(n: int, max_batch: int) -> int:
    """The rows a decode step of n active rows runs (one CUDA graph per bucket): n rounded up to a
    power of two, at most max_batch. Not `batch_bucket`'s 1.5 x ones: priced alone on an H200, FP8's
    step cost 5.0 ms at 12 rows and 4.5 at 16, and at 6 and 24 rows no less than at 8 and 32 (bf16
    the same at 12 and 16, at 6 and 8); fewer buckets are fewer graphs to make ahead
    (docs/levers.md, "H200 step buckets")."""
    return min(max_batch, 1 << (n - 1).bit_length())


def batch_bucket(n: int, max_batch: int) -> int:
    """The rows a detokenizer batch of n streams runs (one graph per bucket; the benchmark's): n rounded
    up to a power of two or 1.5 times one (so at most a third are padding), at most max_batch."""
    p = 1 << (n - 1).bit_length()
    return min(max_batch, p * 3 // 4 if n <= p * 3 // 4 and p >= 4 else p)


def slot_memory(engine: Engine, defer_text_fill: bool) -> dict:
    """KV bytes a slot holds at max_seq_len (every layer's K and V, and with defer_text_fill the
    trunk outputs held for the text branch), and how many slots fit in the device's memory
    beside the weights (CUDA: 90 % of it, the rest left to activations and graphs)."""
    spec, caches = engine.spec, getattr(engine, "caches", list)()
    itemsize = caches[0].element_size() if caches else 2
    per_token = spec.num_layers * 2 * spec.num_key_value_heads * spec.head_dim * itemsize
    per_token += spec.hidden_size * itemsize if defer_text_fill else 0
    slot = per_token * engine.max_seq_len
    out = {"kv_bytes_per_slot": slot, "max_seq_len": engine.max_seq_len, "slots": engine.max_batch}
    if engine.device.type == "cuda" and caches:
        total = torch.cuda.get_device_properties(engine.device).total_memory
        held = getattr(engine, "held", None)
        cache_bytes = sum(c.numel() for c in caches) * itemsize + (held.numel() * held.element_size() if held is not None else 0)
        weights = torch.cuda.memory_allocated(engine.device) - cache_bytes
        out |= {"weights_bytes": weights, "slots_fit": int((0.9 * total - weights) // slot)}
    return out
