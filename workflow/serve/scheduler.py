"""The serving loop: requests arrive at any time, speak in engine slots beside each other, and leave.

One thread owns the engine. Each `iterate`:

1. admits queued requests into free slots, at most `prefill_tokens` prompt tokens an iteration
   (always at least one prompt), prompts of one length in one batched prefill, while fewer than
   `max_streams` streams are open and the detokenizer `holds` their replies (the codec decoder's flow
   slots and pages: past them a stream would re-run every frame of its reply each call). Prompts are
   admitted whole, not chunked: a 512-token prefill costs about two decode steps of a full batch,
   far inside the 80 ms each running stream has per code, and the token budget keeps a burst of
   arrivals from stacking more than that in front of one step;
2. samples the next token of every stream it steps (all but those sitting out: 4)
   from its logits (MOSS-Speech's loop: `generate`'s sampling, penalty and modality switches, per
   stream), with one wait for the device: the iteration's only one;
3. retires streams that are done (their codes spoken, a stop id, their step budget) or that
   failed (non-finite logits), freeing their slots at once;
4. launches one decode step for every remaining stream, text-mode and audio-mode ones together
   (`need_text` per slot), each at its own position. With `pace`, not while every stream is ahead:
   once its first PCM is ready, a stream needs decoding only while its codes' audio is less than
   `pace_lead_s` + `pace` x the time since (`Request.decode_due_at`); once one is due, every stream
   steps, and while none is, only those awaiting their first audio do (the engine steps any of its
   slots), so a new stream's first chunk is made by narrow steps. A reply made at pace x real time
   keeps its stream open longer, so more streams share each step and each detokenizer call (and
   hold their slots and the codec's pages meanwhile). With `first_audio_lead_s`, while a stream
   makes its first chunk (time to first audio waits on its steps), the streams with that much audio
   made past their playback sit out, so its steps stay narrow; the rest have that much in hand;
5. while the device decodes, sends the streams' finished chunks (K codes each, the first as many
   as the detokenizer needs for its first PCM, `detokenize.chunk_due`; a `Piece`) to the
   detokenizer, as one batch across streams. It returns at once (on CUDA it runs on a side
   stream, beside decoding) with a `Ready` and the PCM samples each chunk made final. While
   `detokenize_batches` later batches run, new chunks wait and go together later (a batch's cost per
   chunk falls steeply with its size). Which waiting chunks go when (a stream's first ones urgent,
   later ones held, joined, at most a flow call's codes, at least `detokenize_least` codes a batch)
   is `serve/outbox.py`'s; docs/serving.md says why each, and what each measured.

The clock is the host's and never waits for the device; `phases` sums the device time of each
phase (prefill, sampling, decode, detokenizer), `sent` counts the detokenizer's calls by lane (and
the streams and chunks they took), and `last` says what the last iteration held (the prompts it
admitted, the later-chunk batches running as it began): what the load benchmark reports.

A request the engine cannot take is refused at `submit` with a one-line reason (an id outside
the vocabularies, a prompt or reply longer than a slot, every slot busy when `when_full` is
"refuse"), and `cancel` ends a stream and frees its slot at once: no request ever stops the
others.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from workflow.detokenize import Piece, Ready, chunk_due
from workflow.engines.base import Engine, to_device
from workflow.generate import Ids, advance, audio_mode_after, sample_step
from workflow.serve.outbox import Chunk, Outbox
from workflow.serve.pending import Pending
from workflow.serve.phases import Phases
from workflow.serve.request import Detokenize, Request, ServeConfig
from workflow.serve.waits import Counts


@dataclass(frozen=True)
class Iteration:
    """What one iteration held beside its work: the prompts it admitted, the detokenizer's later batches
    running as it began (beside its step), the streams its step decoded, and what the load's loop counts
    around it: CUDA graphs captured and what else could hold its thread (serve/waits.py)."""

    prompts: int = 0
    later: int = 0
    stepped: int = 0
    waits: Counts = field(default_factory=Counts)


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        ids: Ids,
        cfg: ServeConfig,
        detokenize: Detokenize | None = None,
        clock: Callable[[], float] = time.perf_counter,
        generator: torch.Generator | None = None,
    ):
        self.engine, self.ids, self.cfg = engine, ids, cfg
        engine.release(engine.active())  # the scheduler owns every slot from now on
        self.detokenize, self.clock, self.generator = detokenize, clock, generator
        self.first_codes: int = getattr(detokenize, "first_codes", 1)  # codes before a stream's first PCM
        limits = (engine.max_batch, cfg.max_streams, getattr(detokenize, "max_streams", 0))
        self.max_streams = min(n for n in limits if n)  # streams open at once at most (`streams_open`)
        spec, dev, slots = engine.spec, engine.device, engine.max_batch
        self.seen_text = torch.zeros(slots, spec.vocab_size, dtype=torch.bool, device=dev)
        self.seen_audio = torch.zeros(slots, spec.audio_vocab_size, dtype=torch.bool, device=dev)
        self.queue: deque[Request] = deque()
        self.streams: dict[int, Request] = {}  # slot -> request
        self.mode: dict[int, bool] = {}  # slot -> next token sampled in audio mode
        self.logits = Pending()  # each open stream's logits, its next token not yet sampled
        self.done: list[Request] = []
        self.outbox = Outbox(cfg, detokenize, clock)  # chunks made, not yet sent
        self.unready: deque[tuple[Ready, list[Request], bool]] = deque()  # batches sent, in order, not yet stamped (urgent?)
        self.phases = Phases(dev, clock)
        self.sent: dict[str, Counter] = {}  # by lane's phase: calls, streams, chunks
        self.last = Iteration()  # what the last iteration held

    def submit(self, req: Request) -> bool:
        """Queue a request, or refuse it (req.error says why, req is done): False."""
        why = self._refusal(req)
        if why:
            req.error, req.finished = f"refused: {why}", True
            self.done.append(req)
            return False
        self.queue.append(req)
        return True

    def _refusal(self, req: Request) -> str | None:
        if why := req.fault(self.engine.spec.vocab_size, self.engine.spec.audio_vocab_size, self.engine.max_seq_len):
            return why
        if not self._holds([req]):
            return f"a reply of {req.max_steps} codes is more than the detokenizer's flow slots hold"
        waiting = [*self._open_requests(), *self.queue, req]
        if self.cfg.when_full == "refuse" and len(waiting) > self.max_streams:
            return f"all {self.max_streams} slots are busy"
        if self.cfg.when_full == "refuse" and not self._holds(waiting):
            return "the detokenizer's flow slots hold no more replies now"
        return None

    def cancel(self, rid: int) -> None:
        """End a request now, queued or speaking: its slot is free at once."""
        for req in list(self.queue):
            if req.rid == rid:
                self.queue.remove(req)
                self._end(req, "cancelled")
        for slot, req in list(self.streams.items()):
            if req.rid == rid:
                self._retire([slot], {slot: "cancelled"})

    def idle(self) -> bool:
        return not self.streams and not self.queue

    def iterate(self) -> bool:
        """One admission, sampling, retirement, decode step and detokenization (module docstring);
        whether it decoded (with `pace`, not while every stream is ahead of it: `wait_s`)."""
        self._stamp(wait=False)
        later = self._later_running()
        self.last = Iteration(self._admit(), later)
        if not self.streams:
            self._send(due=True)
            return False
        if self.wait_s() > 0:
            self._send(due=self._batch_free())
            return False
        slots, tokens, failed = self._sample(self._going())
        for req, codes, done, last in self._chunks(slots):  # before retirement: a stream that ends sends its last codes
            req.chunk_codes.append(len(codes))
            self.outbox.append((req, codes, done, last))
        ending = {s: failed[s] for s in slots if s in failed} | {
            s: None for s in slots if s not in failed and self._finished(self.streams[s])
        }
        self._retire(list(ending), ending)
        keep = [i for i, s in enumerate(slots) if s not in ending]
        if keep:
            going = [slots[i] for i in keep]
            with self.phases("decode"):
                text, audio = self.engine.step(going, tokens[to_device(tokens.device, keep)], [not self.mode[s] for s in going])
            self.logits.add(going, text, audio)
            self.last = replace(self.last, stepped=len(going))
        self._send(due=self._batch_free())
        return True

    def _going(self) -> list[int]:
        """The streams sampled and stepped now: all but, with `first_audio_lead_s` while a stream makes its
        first chunk, those with that much audio made past their playback; with `pace` while no speaking
        stream is due, only those awaiting their first audio. Either way a new stream's steps stay narrow."""
        slots, now = self.logits.slots, self.clock()
        lead = self.cfg.first_audio_lead_s
        if lead and any(not self.streams[s].chunk_codes for s in slots):
            return [s for s in slots if not self.streams[s].chunk_codes or self.streams[s].ahead_s(now) < lead]
        waiting = [s for s in slots if self.streams[s].playback_start is None]
        if not self.cfg.pace or not waiting:
            return slots
        due = [s for s in slots if self.streams[s].decode_due_at(self.cfg.pace, self.cfg.pace_lead_s) <= now]
        return waiting if set(due) == set(waiting) else slots

    def wait_s(self) -> float:
        """Seconds until a speaking stream must be decoded (`pace`: each one's `Request.decode_due_at`);
        0 when one must be now, or a queued request may be admitted, or there is no stream."""
        if not self.cfg.pace or not self.streams or (self.queue and self._free_slots()):
            return 0.0
        due = min(r.decode_due_at(self.cfg.pace, self.cfg.pace_lead_s) for r in self.streams.values())
        return max(0.0, due - self.clock())

    def _later_running(self) -> int:
        """The batches of later chunks sent and not yet known ready."""
        return sum(not urgent for _, _, urgent in self.unready)

    def _batch_free(self) -> bool:
        """Whether fewer than `detokenize_batches` batches of later chunks are running."""
        return self._later_running() < self.cfg.detokenize_batches

    def flush(self) -> None:
        """Send what waits (in as many batches as `Outbox.codes_a_call` takes), then wait for the detokenizer
        and the device: every chunk made is stamped, every phase timed."""
        while self.outbox:
            self._send(due=True, hold=False)
        self._stamp(wait=True)

    def _send(self, due: bool, hold: bool = True) -> None:
        """The urgent chunks in a batch of their own (`first_chunks_apart`), then, if `due`, a batch of
        later ones (`Outbox.later`; hold: False sends every waiting chunk, up to `Outbox.codes_a_call` a stream)."""
        if self.cfg.first_chunks_apart and self._urgent_free() and (go := self.outbox.urgent()):
            self._batch(go, urgent=True)
        if due and (go := self.outbox.later({r.rid for r in self.streams.values()}, self._first_audio_waits(), hold)):
            self._batch(go, urgent=False)

    def _urgent_free(self) -> bool:
        """Whether fewer than `urgent_batches` urgent batches are running (always, without a limit): on one
        lane a batch waits for those before it, so chunks made meanwhile wait on the host and go as one."""
        most = self.cfg.urgent_batches
        return not most or sum(urgent and ready(False) is None for ready, _, urgent in self.unready) < most

    def _first_audio_waits(self) -> bool:
        """With `first_audio_first`: whether a speaking stream's first PCM is not yet ready."""
        return self.cfg.first_audio_first and any(r.ttfa_s is None for r in self.streams.values())

    def _batch(self, chunks: list[Chunk], urgent: bool) -> None:
        t = self.clock()
        if self.detokenize is None:  # no detokenizer: a chunk is ready when made, a "sample" a code
            ready: Ready = lambda wait: t  # noqa: E731
            samples = [len(codes) for _, codes, _, _ in chunks]
        else:
            lane = getattr(self.detokenize, "lanes", {}).get(urgent)  # its stream, on CUDA
            pieces = [Piece(req.rid, torch.tensor(codes, dtype=torch.long), done, last) for req, codes, done, last in chunks]
            phase = "detokenize first" if urgent else "detokenize"
            with self.phases(phase, lane):
                ready, samples = self.detokenize(pieces, urgent)
            self.sent.setdefault(phase, Counter()).update(calls=1, streams=len({p.stream for p in pieces}), chunks=len(pieces))
        for (req, _, _, _), n in zip(chunks, samples, strict=True):
            req.chunk_samples.append(n)
            req.chunk_sent.append(t)
        self.unready.append((ready, [req for req, _, _, _ in chunks], urgent))

    def _stamp(self, wait: bool) -> None:
        """Stamp the chunks whose PCM is known to be ready, in the order they were sent."""
        while self.unready:
            ready, reqs, _ = self.unready[0]
            t = ready(wait)
            if t is None:
                break
            for req in reqs:
                req.chunk_ready.append(t)
            self.unready.popleft()
        self.phases.collect(wait)

    def _admit(self) -> int:
        """Admit queued requests into free slots (module docstring, 1.) and prefill them; how many."""
        free, budget, admitted = self._free_slots(), self.cfg.prefill_tokens, []
        while self.queue and free and (not admitted or budget >= self.queue[0].prompt.shape[0]):
            if not self._holds([*self._open_requests(), *admitted, self.queue[0]]):
                break  # its reply does not fit the flow slots' pages beside the open streams': it waits
            req = self.queue.popleft()
            req.slot, req.t_admit = free.pop(0), self.clock()
            budget -= req.prompt.shape[0]
            admitted.append(req)
        by_len: dict[int, list[Request]] = {}
        for req in admitted:
            by_len.setdefault(req.prompt.shape[0], []).append(req)
        for group in by_len.values():
            slots = [r.slot for r in group]
            prompts = torch.stack([r.prompt for r in group])
            mode = audio_mode_after(prompts, self.ids)[:, -1].tolist()
            with self.phases("prefill"):
                text, audio = self.engine.admit(slots, prompts, need_text=not all(mode))
            dev = self.engine.device
            rows, prompts = to_device(dev, slots), to_device(dev, prompts)
            self.seen_text[rows] = False
            self.seen_audio[rows] = False
            self.seen_text[rows[:, None], prompts[..., 0]] = True
            self.seen_audio[rows[:, None], prompts[..., 1]] = True
            for req, m in zip(group, mode, strict=True):
                self.streams[req.slot], self.mode[req.slot] = req, m
            self.logits.add(slots, text, audio)
        return len(admitted)

    def streams_open(self) -> int:
        """Streams open: from admission until the last chunk is sent (so long the detokenizer keeps a
        stream's state: the codec decoder a flow slot, past which a stream re-runs every frame of its
        reply each call)."""
        return len(self._open_requests())

    def _open_requests(self) -> list[Request]:
        speaking = {r.rid for r in self.streams.values()}
        return [*self.streams.values(), *{c[0].rid: c[0] for c in self.outbox if c[0].rid not in speaking}.values()]

    def _holds(self, reqs: list[Request]) -> bool:
        """Whether the detokenizer holds these streams at once (the codec decoder: their flow slots'
        pages at their replies' longest, `CodecBatch.holds`)."""
        holds = getattr(self.detokenize, "holds", None)
        return holds is None or holds([r.max_steps for r in reqs])

    def _free_slots(self) -> list[int]:
        """The engine slots queued requests may take now: at most `max_streams` streams are open."""
        busy = set(self.streams)
        return [s for s in range(self.engine.max_batch) if s not in busy][: max(0, self.max_streams - self.streams_open())]

    def _sample(self, go: list[int]) -> tuple[list[int], torch.Tensor, dict[int, str]]:
        """These streams' next tokens: (slots, tokens [n, 2] on the device, {slot: why} for streams
        whose logits are not finite); each stream's mode moves to its next token's."""
        slots, text_logits, audio_logits = self.logits.take(go)
        dev, ids, s = self.engine.device, self.ids, self.cfg.sampling
        hold = [len(self.streams[x].codes) < (self.streams[x].reply_codes or 0) for x in slots]
        idx, audio_mode, hold_eosp = to_device(dev, [slots, [self.mode[x] for x in slots], hold]).unbind(0)
        audio_mode, hold_eosp = audio_mode.bool(), (hold_eosp.bool() if self.cfg.hold_speech else None)
        with self.phases("sample"):
            bad = ~torch.isfinite(audio_logits).all(-1)
            if text_logits is not None:
                bad |= ~audio_mode & ~torch.isfinite(text_logits).all(-1)
            seen = self.seen_text[idx], self.seen_audio[idx]
            text_tok, audio_tok = sample_step(text_logits, audio_logits, *seen, hold_eosp, ids, s, self.generator)
            tokens, next_mode, stopped = advance(text_tok, audio_tok, audio_mode, ids)
            self.seen_text[idx, tokens[:, 0]] = True
            self.seen_audio[idx, tokens[:, 1]] = True
            rows = torch.stack([tokens[:, 0], tokens[:, 1], next_mode.long(), stopped.long(), bad.long()], 1)
        rows = rows.tolist()  # the wait
        failed = {}
        for x, (text, audio, nxt, stop, nan) in zip(slots, rows, strict=True):
            req = self.streams[x]
            if nan:
                failed[x] = f"failed: non-finite logits at step {len(req.tokens)}"
                continue
            req.tokens.append((text, audio))
            req.modes.append(self.mode[x])
            if self.mode[x] and audio != ids.eosp:
                req.codes.append(audio)
            req.finished = bool(stop)
            self.mode[x] = bool(nxt)
        return slots, tokens, failed

    def _finished(self, req: Request) -> bool:
        return req.finished or len(req.tokens) >= req.max_steps or len(req.codes) >= (req.reply_codes or 1 << 62)

    def _chunks(self, slots: list[int]) -> list[Chunk]:
        """Each stream's chunk that is complete now: K new codes, or the last codes of a stream
        that ends this iteration (last: True; none if it ends right after a whole chunk, so that a
        detokenizer with lookahead decodes the codes it held back)."""
        out = []
        for x in slots:
            req = self.streams[x]
            sent = sum(req.chunk_codes)  # made, sent or not
            pending, last = len(req.codes) - sent, self._finished(req)
            due = chunk_due(sent, pending, self.cfg.chunk_tokens, self.first_codes)
            if due or (last and (pending or req.chunk_codes)):  # an end after a whole chunk: empty
                out.append((req, req.codes[sent:], sent, last))
        return out

    def _retire(self, slots: list[int], why: dict[int, str | None]) -> None:
        if not slots:
            return
        self.engine.release(slots)
        self.logits.drop(why)
        for s in slots:
            req = self.streams.pop(s)
            self.mode.pop(s)
            self._end(req, why[s])

    def _end(self, req: Request, error: str | None) -> None:
        req.error, req.finished = error, True
        if error is not None and req.chunk_codes and not any(c[0] is req and c[3] for c in self.outbox):
            # cut short after sending codes: an empty last chunk, so that a detokenizer's state for it ends
            req.chunk_codes.append(0)
            self.outbox.append((req, [], sum(req.chunk_codes), True))
        self.done.append(req)
