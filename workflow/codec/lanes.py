"""Serving's detokenizer with the codec decoder: `CodecLanes`, each batch of pieces through
`CodecBatch` (batch.py) on a lane of its own (detokenize.Lanes), and the graphs serving will meet
made ahead (`warm`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from workflow.codec.batch import CodecBatch
from workflow.codec.stream import FlowCall
from workflow.detokenize import Clock, Lanes, Piece
from workflow.stream import device_clock


class CodecLanes(Lanes):
    """Serving's detokenizer with the codec decoder: each batch of pieces through `CodecBatch`, on a
    lane (detokenize.Lanes). A stream's pieces may go to both lanes (its first audible one urgent,
    the rest not): a lane waits for the other's last batch before it takes a stream from it, and
    the stream's tensors are marked as used there, so that the allocator keeps them for it."""

    def __init__(
        self, batch: CodecBatch, device: torch.device, clock: Clock, anchor_s: float = 2.0,
        sink: Callable[[int, Tensor], None] | None = None, later_below: bool = False,
    ):  # fmt: skip
        """sink(stream, pcm): where each piece's PCM goes (a server's audio out), called as the piece is
        launched: on CUDA the PCM is computed on the lane, to be read after the batch's `Ready`."""
        super().__init__(batch.decoder.cfg.hift.sampling_rate, device, clock, anchor_s, later_below)
        self.batch, self.sink = batch, sink
        self.first_codes = batch.first_codes
        self.max_streams = batch.slot_count  # streams served at full speed: one a flow slot (0: no slots, none faster)
        self.holds = batch.holds  # and whether the flow slots' pages hold streams of so many codes at once
        self.codes_a_call = batch.frames_a_call[-1] // batch.decoder.stride if batch.frames_a_call else 0  # a slot's most
        self.lane_of: dict[int, torch.cuda.Stream] = {}  # CUDA: each stream's last lane
        self.ends: dict[torch.cuda.Stream, torch.cuda.Event] = {}  # each lane's last batch
        self.warm_s: dict[int, dict[str, float]] = {}  # the last `warm`'s seconds by batch rows: its flows', its pieces'

    def confine_later(self, sms: int, setting: str = "later_sms") -> int:
        """The later lane's graphs on `sms` SMs from now on, 0: all (`Graphs.confine`): a held batch has its
        slack, while decode steps and first calls, which time to first audio waits on, keep the rest to
        themselves. The SMs they have. Without graphs (off CUDA) nothing changes."""
        if self.batch.graphs is None or not self.lanes:
            return 0
        later = self.priorities["later"]  # the last part of each of the batch's graph keys: the lane's
        return self.batch.graphs.confine(sms, lambda key: isinstance(key, tuple) and key[-1] == later, later, setting)

    def _run(self, pieces: list[Piece]) -> list[int]:
        if self.lanes:
            self._claim(pieces)
        pcm = self.batch.vocodes(self.batch.flows(pieces))
        if self.sink is not None:
            for p, x in zip(pieces, pcm, strict=True):
                self.sink(p.stream, x)
        if self.lanes:
            lane = torch.cuda.current_stream(self.device)
            self.ends[lane] = torch.cuda.Event()
            self.ends[lane].record(lane)
            for p in pieces:
                self.lane_of.pop(p.stream, None) if p.last else self.lane_of.__setitem__(p.stream, lane)
        return [x.numel() for x in pcm]

    def _claim(self, pieces: list[Piece]) -> None:
        lane = torch.cuda.current_stream(self.device)
        moved = [p.stream for p in pieces if self.lane_of.get(p.stream, lane) != lane]
        if moved:
            for other, end in self.ends.items():
                if other != lane:
                    lane.wait_event(end)
            for key in moved:
                for t in self.batch.streams[key].state():
                    t.record_stream(lane)

    def warm(self, rows: int, codes: int, max_codes: int = 0, few: int = 8) -> int:
        """Make now the graphs serving would meet, on the lane of later pieces: for a batch of every
        bucket up to `rows` streams, the solve at every frame bucket a reply of up to `max_codes` codes
        reaches (a last call's in the same graphs), and HiFT's network at a first, a second and a later
        call (three pieces, of first_codes, `codes` and `codes` codes: after a short first hop the second
        call's F0 context is shorter than every later one's, so its shape is its own; with slots, the
        solve at each of `frames_a_call`, on the urgent lane the fewest only) and at a last call after
        them (with graphs, for up to `few` streams, at each of the `codes` lengths a last call has: 0 ..
        codes - 1 codes after the last whole chunk); on the urgent lane the same for up to `few` streams'
        first two audible pieces (the second goes there too while the first made less than a chunk's
        audio: serve/scheduler.py), its last call at one length only (a reply that ends there is short:
        its last call's context is its own). The last calls of more streams ending in one batch than
        `few` go in HiFT passes of no more (`CodecBatch.last_rows`). Returns the batches run; `warm_s` then
        holds each batch size's seconds, its flows' (front end and solve; with slots, their graphs) and its
        pieces' (whole calls: HiFT's graphs, the flows replayed), the device waited for after each."""
        batch = self.batch
        batch.make_last = True
        try:
            calls = self._warm(rows, codes, max_codes, few)
        finally:
            batch.make_last = False
        batch.pass_rows = batch.bucket(rows)  # a HiFT pass of a stream's held calls too: no more rows than made here
        if batch.graphs is not None:  # streams' ends in passes of the most rows made for them (more would capture)
            batch.last_rows = max((b for b in {batch.bucket(i) for i in range(1, rows + 1)} if b <= few), default=0)
        if self.lanes:
            torch.cuda.synchronize(self.device)
        return calls

    def _warm(self, rows: int, codes: int, max_codes: int, few: int) -> int:
        batch, calls, now = self.batch, 0, device_clock(self.device)  # warm_s counts work the device has done
        dec, la = batch.decoder, batch.decoder.cfg.encoder.lookahead
        self.warm_s = {}
        for n in sorted({batch.bucket(i) for i in range(1, rows + 1)}):
            took = self.warm_s[n] = {"flow": 0.0, "pieces": 0.0}
            for urgent in (False, True) if n <= few and self.lanes else (False,):
                t0 = now()
                upto = self.first_codes + codes if urgent else max(max_codes, self.first_codes) + codes
                if batch.pad_frames:  # the flow at every frame bucket (a last call rides in the same graphs)
                    pad, frames = batch.pad_frames, (len(batch.prompt) + upto) * dec.stride
                    for end in range(pad, frames + pad, pad):
                        call = FlowCall([0] * (max(end // dec.stride - len(batch.prompt), la + 1) + la), 0, True, False)
                        for q in batch.frames_a_call[: 1 if urgent else None] or (0,):
                            with torch.cuda.stream(self.lanes[urgent]) if self.lanes else contextlib.nullcontext():
                                batch.mel([call] * n, solve=q)
                            calls += 1
                t1 = now()
                fc = self.first_codes
                lasts = codes if n <= few and not urgent and batch.graphs is not None else 1  # last calls to make (the CPU: none)
                for left in range(lasts):  # a last piece of `left` codes
                    keys = [batch.new_key() for _ in range(n)]
                    for done, k in ((0, fc), (fc, codes), (fc + codes, codes)):
                        self([Piece(s, torch.zeros(k, dtype=torch.long), done) for s in keys], urgent)[0](True)
                    self([Piece(s, torch.zeros(left, dtype=torch.long), fc + 2 * codes, True) for s in keys], urgent)[0](True)
                    calls += 4
                took["flow"], took["pieces"] = took["flow"] + t1 - t0, took["pieces"] + now() - t1
        return calls
