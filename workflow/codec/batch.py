"""Many streams through the codec decoder at once: `CodecBatch`, under serving's detokenizer
(lanes.py) and a request of B rows (`CodecSpeech`).

Each stream is a `CodecStream` (stream.py) in one voice. With `slots` (slots.py: the flow cache in
fixed buffers, ~2.3 MB a frame a stream at the true shape) a stream holds a slot while it speaks and
each of its calls solves only its new frames; a stream that finds every slot taken, or a batch with
no slots, re-runs every frame each call. A step adds every stream's new codes, takes the flow calls
now due (one per `chunk` codes, and a stream's last), and runs them together, the slotted streams'
and the others' apart:

- the flow: one front end over every call's codes, the rows right-padded, each with its own length
  and lookahead context (a stream's last call: -1s, read as the utterance's end), then one solve over
  their frames. Under chunk masks the padding after a row's end changes none of its frames (keys past
  a frame's chunk are never read, convolutions look left), so each row gives what its stream gives
  alone. With `pad_frames` the frames are padded to a multiple of it and the rows to
  `bucket(n)`: on CUDA the whole flow (front end and solve) is a graph per shape and lane;
- HiFT: every call at once, a stream's several (chunks that waited) too: first each call's F0 (its
  frames are known), then each stream's source phase carried from one of its calls to the next, then
  the calls of one shape (frames, F0 context, at a stream's start or not) in one pass of their NSF
  sources (each continued from its own stream's: stream.py) and network (on CUDA a graph per shape
  and lane; a stream's last call where `CodecLanes.warm` made one, else eager); then the cross-fades,
  a stream's in order (each stream's source noise is its seed's: NsfSource.noise). What is not in a
  pass goes rank by rank, the k-th calls of every stream at once, so a batch of held chunks launches
  about what one stream's does (~140 ops for 8 streams' 8 held chunks, not ~1,000 call by call).

Streams never share state, and a call's HiFT gives what it gives alone, so each stream's PCM is what
it gives alone, up to the rounding of batched arithmetic (tests/test_codec_batch.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.hift import DEFAULT_SEED
from workflow.codec.slots import PAGE, FlowSlots
from workflow.codec.stream import CodecStream, FlowCall, carry_all, first_hop, settle_all
from workflow.cudagraphs import Graphs
from workflow.detokenize import Piece
from workflow.engines.base import to_device

KEYS = 1 << 40  # new_key's first key, above any request id
Work = list[tuple[CodecStream, list[Tensor], bool]]  # per piece: its stream, its calls' frames, its end


class CodecBatch:
    """Streams by key, their calls batched. bucket(n): the rows a batch of n runs (padding)."""

    def __init__(
        self, decoder: CodecDecoder, voice: VoicePrompt, bucket: Callable[[int], int] = lambda n: n,
        pad_frames: int = 0, graphs: bool = False, slots: int = 0, max_codes: int = 0, later_frames: int = 0,
        pool_codes: int = 0, fp8_pages: bool = False, later_shapes: int = 1,
    ):  # fmt: skip
        """pad_frames: each batch's frames padded to a multiple (with masked zeros), so that calls share a
        shape per bucket; graphs (CUDA): each shape's flow (front end and solve) and HiFT network replayed
        from a CUDA graph, per lane; slots > 0: the flow cache in fixed buffers (slots.py) for that many
        streams at once, each of up to `max_codes` codes (a longer one gives its slot back when it outgrows
        it, and re-runs every frame from there): a call solves only its new frames, up to `new_frames` a
        row (the first call's), or where a stream's waiting chunks need more, `later_frames` (rounded up
        to whole chunks): a solve costs nearly the same for one chunk as for three (levers.md, "H100 codec
        11"), so serving's held chunks go as one round, not one per `new_frames`; with `later_shapes` > 1 also
        at its halves (whole chunks, above `new_frames`), so a call whose rows need fewer solves no more
        (a graph per shape on CUDA). pool_codes: the codes'
        frames the slots' pages hold in all (0: every slot its `max_codes`; fewer: more slots in the same
        memory, streams taking pages as they grow); fp8_pages: their keys and values in float8."""
        if pad_frames % decoder.stride:
            raise ValueError(f"pad_frames must be a multiple of {decoder.stride} frames (a code's), got {pad_frames}")
        self.decoder, self.voice, self.bucket, self.pad_frames = decoder, voice.to(decoder.device), bucket, pad_frames
        self.prompt = voice.codes.tolist()
        self.streams: dict[int, CodecStream] = {}
        self.keys = KEYS  # the last key handed out by new_key
        self.graphs = Graphs(decoder.device) if graphs and decoder.device.type == "cuda" else None
        self.slot_count, self.slot_frames, self.base, self.pages, self.fp8_pages = slots, 0, 0, 0, fp8_pages
        self.pass_rows = slots  # the most rows a HiFT pass takes (0: all); `CodecLanes.warm`: the rows it made graphs for
        self.make_last = False  # `CodecLanes.warm`: last calls' HiFT passes captured too (`_graphed`)
        self.last_rows = 0  # the most rows a last call's HiFT pass takes (0: as any other's); `warm`: its `few`
        self.frames_a_call: tuple[int, ...] = ()  # with slots: the frames a row a solve takes, fewest first
        self.slots: FlowSlots | None = None  # made when a stream first needs one (`release` gives them back)
        self.slot_of: dict[int, int] = {}  # each stream's slot
        self.solved: dict[int, int] = {}  # each stream's frames in its slot's past (absolute, the prompt's first)
        if slots:
            cf, stride = decoder.cfg.chunk * decoder.stride, decoder.stride
            base = decoder.past_frames(len(self.prompt))
            self.new_frames = -(-((len(self.prompt) + self.first_codes) * stride - base) // cf) * cf
            later = {-(-(later_frames >> k) // cf) * cf for k in range(later_shapes)}  # the held call's, its halves
            self.frames_a_call = (self.new_frames, *sorted(f for f in later if f > self.new_frames))  # the solve's shapes
            self.base = base
            self.slot_frames = self.frames_for(max_codes)
            self.pages = -(-pool_codes * stride // PAGE) if pool_codes else slots * -(-self.slot_frames // PAGE)

    def flow_slots(self) -> FlowSlots:
        """The slots (made at the first call)."""
        if self.slots is None:
            self.slots = FlowSlots(self.decoder, self.voice, self.slot_count, self.slot_frames, self.pages, self.fp8_pages)
        return self.slots

    def frames_for(self, codes: int) -> int:
        """The most frames a stream of `codes` codes holds in its slot (its last call's padding included)."""
        return (len(self.prompt) + codes + self.first_codes) * self.decoder.stride - self.base + self.frames_a_call[-1]

    def holds(self, codes: list[int]) -> bool:
        """Whether streams of these many codes each fit the flow slots at once: a slot each, and the
        pages their frames need at the most (serving admits by it: a stream that could not grow would
        re-run every frame)."""
        if not self.slot_count:
            return True
        pages = sum(-(-min(self.frames_for(c), self.slot_frames) // PAGE) for c in codes)
        return len(codes) <= self.slot_count and pages <= self.pages

    def release(self) -> None:
        """Give the slots' memory back while no stream speaks (the benchmark does, before it times the
        codec's stages): they are made again, and their graphs captured again, at the next call."""
        if self.streams:
            raise RuntimeError(f"{len(self.streams)} streams still speak: their slots cannot go")
        self.slots = None
        if self.graphs is not None:
            self.graphs.drop(lambda key: key[0] == "slots")  # they read and write the slots' pools

    @property
    def first_codes(self) -> int:
        """Codes a stream needs before its first PCM (its first hop + lookahead)."""
        cfg = self.decoder.cfg
        return first_hop(len(self.prompt), cfg.chunk, self.decoder.stride) + cfg.encoder.lookahead

    def new_key(self) -> int:
        """A stream key no caller uses (serving's keys are request ids, counted from 1)."""
        self.keys += 1
        return self.keys

    def stream(self, key: int) -> CodecStream:
        if key not in self.streams:
            self.streams[key] = CodecStream(self.decoder, self.voice, DEFAULT_SEED + key, flow_cache=False)
            if self.slot_count and self.flow_slots().free:  # with none free it re-runs every frame
                self.slot_of[key], self.solved[key] = self.flow_slots().take(), self.flow_slots().base
        return self.streams[key]

    def end(self, key: int) -> None:
        """A stream is done: its state goes, its slot is free."""
        del self.streams[key]
        if key in self.slot_of:
            self._unslot(key)

    @torch.inference_mode()
    def flows(self, pieces: list[Piece]) -> Work:
        """Stage one: add each piece's codes to its stream and run every flow call now due, last calls with
        the others. A stream may have several pieces in a batch (chunks that waited): its calls keep their
        order, and with a slot its consecutive calls run as one (`_jobs`), so a batch is one flow pass, or
        one a round where a stream's calls outgrow the largest of `frames_a_call`."""
        due, calls = [(self.stream(p.stream), p) for p in pieces], []
        for s, p in due:  # a piece must follow its stream's codes: one lost or out of order would give wrong audio
            if p.done != len(s.codes):
                raise ValueError(f"codec stream {p.stream}: a piece after {p.done} codes, where it has {len(s.codes)}")
            calls.append(s.calls(p.codes, p.last))
        for p, cs in zip(pieces, calls, strict=True):
            if cs and p.stream in self.slot_of and not self._grows(p.stream, cs[-1]):
                self._unslot(p.stream)  # from here on it re-runs every frame
        jobs = self._jobs(pieces, calls)
        mels: list[list[Tensor]] = [[] for _ in pieces]
        for r in range(max(map(len, jobs.values()), default=0)):
            now = [(k, js[r]) for k, js in jobs.items() if r < len(js)]
            for slotted in (True, False):
                batch = [(k, job) for k, job in now if (k in self.slot_of) == slotted]
                if not batch:
                    continue
                for (_, (_, parts)), m in zip(batch, self.mel([c for _, (c, _) in batch], [k for k, _ in batch]), strict=True):
                    for i, n in parts:  # the frames each call keeps, in order
                        mels[i].append(due[i][0].keep(m[:, :n]))
                        m = m[:, n:]
        for p in pieces:
            if p.last:
                self.end(p.stream)
        return [(s, m, p.last) for (s, p), m in zip(due, mels, strict=True)]

    def _grows(self, key: int, call: FlowCall) -> bool:
        """Whether the stream's slot holds the call's frames, taking pages for them: not past a slot's
        frames (a reply longer than `max_codes`) or the free pages."""
        la = 0 if call.finalize else self.decoder.cfg.encoder.lookahead
        end = (len(self.prompt) + len(call.codes) - la) * self.decoder.stride
        return self.flow_slots().grow(self.slot_of[key], end - self.base + self.frames_a_call[-1])

    def _unslot(self, key: int) -> None:
        """A stream gives its slot back and goes on without one."""
        self.flow_slots().release(self.slot_of.pop(key))
        del self.solved[key]

    def _jobs(self, pieces: list[Piece], calls: list[list[FlowCall]]) -> dict[int, list[tuple[FlowCall, list[tuple[int, int]]]]]:
        """Each stream's flow calls in order, as `mel` runs them, with the frames each call keeps and its
        piece: with a slot, consecutive calls (a last one too, after the others) go as one call while their
        new frames fit the largest of `frames_a_call` (chunk masks make the frames of one call over two
        chunks those of two calls)."""
        stride, p, la = self.decoder.stride, len(self.prompt), self.decoder.cfg.encoder.lookahead
        jobs: dict[int, list[tuple[FlowCall, list[tuple[int, int]]]]] = {}
        start: dict[int, int] = {}  # each stream's first frame of its last job
        for i, (piece, cs) in enumerate(zip(pieces, calls, strict=True)):
            k, js = piece.stream, jobs.setdefault(piece.stream, [])
            for c in cs:
                end = (p + len(c.codes) - (0 if c.finalize else la)) * stride
                kept = end - (p + c.offset) * stride
                last = js[-1][0] if js else None
                merge = k in self.slot_of and last is not None and not last.finalize
                if merge and end - start[k] <= self.frames_a_call[-1]:
                    js[-1] = (FlowCall(c.codes, last.offset, streaming=True, finalize=c.finalize), [*js[-1][1], (i, kept)])
                else:
                    if k in self.slot_of:  # where this call starts solving: the slot's end, or the last job's
                        start[k] = self.solved[k] if last is None else (p + len(last.codes) - la) * stride
                    js.append((c, [(i, kept)]))
        return jobs

    @torch.inference_mode()
    def vocodes(self, work: Work) -> list[Tensor]:
        """Stage two: HiFT over every call's new frames, a stream's calls in one pass with the others' (`hift`);
        the PCM each piece made final."""
        calls = [(s, m, last and j == len(ms) - 1, i) for i, (s, ms, last) in enumerate(work) for j, m in enumerate(ms)]
        pcm: list[list[Tensor]] = [[] for _ in work]
        for (*_, i), parts in zip(calls, self.hift([c[:3] for c in calls]), strict=True):
            pcm[i] += parts
        for i, (s, m, last) in enumerate(work):
            if last and not m:  # nothing left to decode: the held tail is final
                pcm[i].append(s.held)
                s.held = s.held[:0]
        flat = [t for parts in pcm for t in parts]
        if not flat:
            return [s.held.new_zeros(0) for s, *_ in work]
        return list(torch.cat(flat).split([sum(t.numel() for t in parts) for parts in pcm]))  # one copy, not one a piece

    @torch.inference_mode()  # also when warm() calls it: no autograd graph holding every step's activations
    def mel(self, calls: list[FlowCall], keys: list[int] | None = None, solve: int = 0) -> list[Tensor]:
        """The new frames [mels, n] of streaming calls, last ones (no lookahead: their context -1s) among
        the others, of the streams `keys`: in their slots if they have them, else re-running every frame.
        keys None: calls of no stream (`lanes.CodecLanes.warm`'s), in the scratch rows with slots, solving
        `solve` frames a row (0: the fewest of `frames_a_call`)."""
        dec, la, stride = self.decoder, self.decoder.cfg.encoder.lookahead, self.decoder.stride
        dev, n = dec.device, self.bucket(len(calls))
        rows = [self.prompt + c.codes for c in calls]
        bodies = [r if c.finalize else r[: len(r) - la] for r, c in zip(rows, calls, strict=True)]
        context = [[-1] * la if c.finalize else r[len(r) - la :] for r, c in zip(rows, calls, strict=True)]
        bodies += [bodies[-1]] * (n - len(calls))  # padding rows: copies of the last
        context += [context[-1]] * (n - len(calls))
        q = max(1, self.pad_frames // stride)
        tokens = torch.zeros(n, -(-max(map(len, bodies)) // q) * q, dtype=torch.long)
        for i, b in enumerate(bodies):
            tokens[i, : len(b)] = torch.tensor(b)
        args = [tokens, torch.tensor([len(b) for b in bodies]), torch.tensor(context, dtype=torch.long).reshape(n, la)]
        if self.slot_count and all(k in self.slot_of for k in keys or []):
            return self._solve_new(calls, keys, bodies, args, solve)
        args = [to_device(dev, a) for a in args]
        flow = functools.partial(dec.rows, self.voice, chunk=dec.cfg.chunk)
        if self.graphs is None:
            mel = flow(*args)
        else:  # its output lives in the graph's pool until the next replay: cloned
            key = ("flow", tuple(tokens.shape), torch.cuda.current_stream(dev).priority)
            mel = self.graphs.call(key, flow, *args).clone()
        p = self.voice.mel.shape[1]
        return [mel[i, :, p + c.offset * stride : len(bodies[i]) * stride] for i, c in enumerate(calls)]

    def _solve_new(
        self,
        calls: list[FlowCall],
        keys: list[int] | None,
        bodies: list[list[int]],
        args: list[Tensor],
        q: int = 0,
    ) -> list[Tensor]:
        """`mel` with slots: each row solves its frames from its slot's end on (a new stream's from the
        prompt's past), the fewest of `frames_a_call` that every row's fit (or q); every row's slot then
        holds its call's frames."""
        slots, stride = self.flow_slots(), self.decoder.stride
        ends = [len(b) * stride for b in bodies]
        row_slots: list[int | None] = [self.slot_of[k] for k in keys] if keys else []
        row_slots += [None] * (len(bodies) - len(row_slots))
        starts = [self.solved[k] for k in keys] if keys else []
        need = max((e - a for e, a in zip(ends, starts, strict=False)), default=0)
        q = q or next((f for f in self.frames_a_call if f >= need), self.frames_a_call[-1])  # more: index refuses
        starts += [max(slots.base, e - q) for e in ends[len(starts) :]]
        index = slots.index(row_slots, starts, ends, q, args[0].shape[1] * stride)
        tensors = [to_device(self.decoder.device, a) for a in (*args, *index.tensors())]
        if self.graphs is None:
            mel = slots.flow(*tensors)
        else:  # as in `mel`: the output lives in the graph's pool
            key = ("slots", tuple(args[0].shape), q, torch.cuda.current_stream(self.decoder.device).priority)
            mel = self.graphs.call(key, slots.flow, *tensors).clone()
        slots.advance(row_slots)
        for k, e in zip(keys or [], ends, strict=False):
            self.solved[k] = e
        p = self.voice.mel.shape[1]
        return [mel[i, :, p + c.offset * stride - starts[i] : ends[i] - starts[i]] for i, c in enumerate(calls)]

    def hift(self, calls: list[tuple[CodecStream, Tensor, bool]]) -> list[list[Tensor]]:
        """HiFT over calls (stream, new frames, final), a stream's in order, all in one pass. A call's F0
        reads only its frames, which are known, so every call's F0 is made first; each stream's source
        phase is then carried from one of its calls to the next (a running sum of that F0), and every
        call's NSF source (each continued from its own stream's) and network run at once: a stream's held
        chunks cost one pass, not one a chunk, and each call gives what it gives alone. Calls of one shape
        (frames, F0 context, last or not, at a stream's start or not) go together, at most `pass_rows` a
        pass, a last call's `last_rows` (the most `lanes.CodecLanes.warm` makes graphs for), each a graph
        on CUDA (`_graphed`); then every call's cross-fade (`settle_all`). Each call's final PCM, in parts."""
        news: dict[int, list[Tensor]] = {}  # each stream's new frames here, in order
        for s, m, _ in calls:
            news.setdefault(id(s), [s.mel_tail]).append(m)
        xs, joined = [], {}  # per stream: its tail and every new frames here in one copy, and its first frame
        for s, m, final in calls:  # each call's frames and F0 context, its stream moved past it
            if id(s) not in joined:
                joined[id(s)] = torch.cat(news[id(s)], dim=1), s.frames - s.mel_tail.shape[1]
            xs.append(s.prepare(m, *joined[id(s)]))
            s.advance(xs[-1], final)
        shapes = [(x.mel.shape[1], x.context, final) for x, (_, _, final) in zip(xs, calls, strict=True)]
        f0: list[Tensor] = [torch.empty(0)] * len(xs)
        for idx in self._passes(shapes):
            context, last = shapes[idx[0]][1:]
            fn = functools.partial(self.decoder.hift_f0, context=context)
            got = self._graphed(("f0", *shapes[idx[0]]), fn, last, torch.stack([xs[i].mel for i in self._rows(idx)]))
            for j, i in enumerate(idx):
                f0[i] = got[j]
        xs = carry_all(self.decoder.source.cycles, [s for s, _, _ in calls], xs, f0)
        shapes = [(*shape, x.before is None) for shape, x in zip(shapes, xs, strict=True)]
        out: list[tuple[Tensor, Tensor]] = [(torch.empty(0), torch.empty(0))] * len(xs)
        for idx in self._passes(shapes):
            _, context, last, fresh = shapes[idx[0]]
            padded = self._rows(idx)
            seeds, starts = to_device(xs[idx[0]].mel.device, [[calls[i][0].seed for i in padded], [xs[i].start for i in padded]])
            args = [torch.stack([xs[i].mel for i in padded]), torch.stack([f0[i] for i in padded]), seeds, starts]
            if not fresh:
                args.append(torch.stack([xs[i].before for i in padded]))  # type: ignore[misc]
            fn = functools.partial(self.decoder.hift_from_f0, context=context)
            pcm, cycles = self._graphed(("hift", *shapes[idx[0]]), fn, last, *args)
            for j, i in enumerate(idx):
                out[i] = pcm[j], cycles[j]
        return settle_all([(s, pcm, x, cycles, final) for (s, _, final), x, (pcm, cycles) in zip(calls, xs, out, strict=True)])

    def _passes(self, shapes: list[tuple]) -> list[list[int]]:
        """The calls of each shape (frames, context, last, ...), in passes of at most `pass_rows` rows, a
        last call's of at most `last_rows`."""
        by: dict[tuple, list[int]] = {}
        for i, shape in enumerate(shapes):
            by.setdefault(shape, []).append(i)
        most = {s: (self.last_rows if s[2] else 0) or self.pass_rows or len(shapes) for s in by}
        return [idx[a : a + most[s]] for s, idx in by.items() for a in range(0, len(idx), most[s])]

    def _rows(self, idx: list[int]) -> list[int]:
        """A pass's rows: on CUDA padded to bucket(n) with copies of the last."""
        n = self.bucket(len(idx)) if self.graphs is not None else len(idx)
        return idx + [idx[-1]] * (n - len(idx))

    def _graphed(self, key: tuple, fn: Callable, last: bool, *args: Tensor) -> Any:
        """fn(*args), on CUDA from a graph per key and lane, its outputs cloned out of the graph's pool. A last
        call (one of `chunk` lengths) replays the graph `CodecLanes.warm` made for its shape (`make_last`), else
        runs eager, never captured mid-serving (eager it held the host ~15 ms, ~80 at a new shape)."""
        if self.graphs is None:
            return fn(*args)
        key = (*key, tuple(args[0].shape), torch.cuda.current_stream(args[0].device).priority)
        if last and not (self.make_last or self.graphs.made(key)):
            return fn(*args)
        got = self.graphs.call(key, fn, *args)
        return got.clone() if isinstance(got, Tensor) else tuple(t.clone() for t in got)


class CodecSpeech:
    """A request's B rows through the codec decoder as the detokenizer's `Speech` (detokenize.py):
    the rows are B streams of one voice, each chunk's flow calls batched, then their HiFT."""

    def __init__(self, batch: CodecBatch, rows: int) -> None:
        self.batch = batch
        self.keys = [batch.new_key() for _ in range(rows)]
        self.first_codes = batch.first_codes

    def mel(self, codes: Tensor, done: int, last: bool) -> Work:
        return self.batch.flows([Piece(k, row, done, last) for k, row in zip(self.keys, codes.cpu(), strict=True)])

    def pcm(self, work: Work) -> Tensor:
        """[B, n]: every row has had as many codes, so as much PCM."""
        return torch.stack(self.batch.vocodes(work))
