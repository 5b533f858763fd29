"""Streaming the codec decoder: codes in as the LM makes them, 24 kHz PCM out chunk by chunk (docs/codec.md,
"Streaming design notes").

Which design. Of the options docs/codec.md lists (the CosyVoice2 recipe with a fixed hop; CosyVoice's newer
geometrically growing hop; GLM-4-Voice's growing blocks with the last output passed back as the prompt; a
sliding window that re-encodes only the last tokens), this is the CosyVoice2 recipe with a fixed hop, as the
MOSS-vendored `CosyVoice2Model.tts` runs it. It is the one the chunk checkpoints (flow-chunk-5.pt) were trained
for, and its emitted mel frames are final: every flow call re-runs the flow on all codes so far
with chunk masks, its last `lookahead` codes as context only, and keeps just the new frames, which (chunk masks
+ fixed noise + a chunk-aligned end) are exactly the frames a one-call decode gives. The price is that each
call redoes the whole prefix, so a call costs more as the utterance grows (the fixed noise caps it at 300 s).

When PCM comes. The chunk grid starts at the prompt's first code, so the prompt's last chunk ends pad =
(-prompt codes) mod chunk codes into the reply, and a hop is decoded once `hop + lookahead` codes past the
last decoded one are in. The first hop (`first_hop`) is those pad codes alone where their frames make PCM
(more than the mel cache held back for the cross-fade: pad 3 or 4 for chunk 5), else chunk + pad, as
CosyVoice2 runs it. So the first PCM comes after `first_hop + lookahead` codes (`first_codes`): 8 for a prompt
of a multiple of 5 codes, and that first PCM is 5 x 1920 - 3840 samples (240 ms; the last 160 ms are held for
the cross-fade); 6 for a prompt of 5k + 2 codes, its first PCM 80 ms, 7 for 5k + 1, 160 ms. A voice prompt
trimmed by a few codes thus trades a shorter first PCM for one or two fewer codes to wait for. Then one
flow call, 400 ms of PCM, per `chunk` codes. `finish()` decodes
the rest (fewer than hop + lookahead codes) with the lookahead read as the end of the utterance.

HiFT across calls (CosyVoice2's cache, one part changed). Each call vocodes [the last `mel_cache` (8) frames
of the previous call | the new frames], cross-fades its first 8 x 480 samples with the previous call's last
8 x 480 (weights sin^2 and cos^2, summing to 1), and holds its own last 8 x 480 back until the next
call or `finish()`. So after every call the PCM out is exactly (codes decoded) x 1920 - 3840 samples, whole
chunks less the held tail, and `finish()` brings the total to codes x 1920. The changed part is the source
cache: CosyVoice2 overwrites the head of each call's fresh NSF source with the last call's source tail, which
hides the phase restart only until the cache runs out. Here the source is continued instead (decoder.py's
`NsfSource`: the phase sum carried over, each frame's noise a function of the stream's seed and the frame),
so away from the cross-faded overlaps the stream gives the one-call PCM up to what HiFT's receptive field,
wider than the 8-frame cache on each side, lets through (measured in tests/test_codec_stream.py: float noise
from 4 frames past each overlap on). The cross-fade's weights sum to 1, not CosyVoice2's Hamming halves
(which sum to about 1.08 and make every cross-faded 160 ms ~8 % louder, a swell each 400 ms): the two calls
overlapping are nearly the same signal here, so an amplitude-complementary fade gives the one-call PCM.

The flow cache. Chunk masks make every frame a call keeps final, so the next call need not run it
again: the stream keeps the flow's `Past` (per ODE step, each causal convolution's last input frames and
each attention's keys and values) and each call solves only its new frames against it, starting from the
voice prompt's past (`CodecDecoder.prompt_past`, made once per voice). A call then costs the same
however late it comes, at ~2.3 MB of keys and values a frame at the true shape in bfloat16
(docs/codec.md, "The flow cache"); `flow_cache=False` re-runs the whole prefix instead.

The last flow call uses chunk masks too, so the stream equals `CodecDecoder.whole()` whatever the way the codes
arrive. CosyVoice2 (and the third-party MOSS port) run that last call with streaming=False; `final_offline`
does that, at the price of the tail not being the one-call decode's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from workflow.codec.decoder import F0_RADIUS, CodecDecoder, VoicePrompt
from workflow.codec.estimator import Past
from workflow.codec.hift import DEFAULT_SEED
from workflow.engines.base import to_device


@dataclass(frozen=True)
class FlowCall:
    """One flow call of a stream: every code so far (the last `lookahead` only as context unless
    finalize), and `offset`, the codes whose frames earlier calls gave."""

    codes: list[int]
    offset: int
    streaming: bool
    finalize: bool


@dataclass(frozen=True)
class Excitation:
    """One stream's part of a HiFT call: its mel frames [mels, context + F] from frame `first` (the first
    `context` only for the F0 predictor's reach), the source's cycles before the F vocoded frames (None at
    the utterance start), and the frame after them (`end`)."""

    mel: Tensor
    context: int
    before: Tensor | None
    first: int
    end: int

    @property
    def start(self) -> int:
        """The first frame vocoded."""
        return self.first + self.context


def rise(n: int, device: torch.device) -> Tensor:
    """The cross-fade's rising weights over n samples, sin^2: the falling ones (1 - rise) sum with them to 1."""
    return torch.sin(torch.pi / 2 * (torch.arange(n, device=device, dtype=torch.float64) + 0.5) / n) ** 2


MEL_CACHE = 8  # frames of mel carried into the next HiFT call; 8 x 480 samples cross-faded (CosyVoice2)


def first_hop(prompt_codes: int, chunk: int, stride: int, mel_cache: int = MEL_CACHE) -> int:
    """Codes a stream's first flow call decodes (its lookahead aside): the pad codes that end the prompt's last
    chunk where their frames outnumber the mel cache held back (so the call makes PCM), else chunk + pad."""
    pad = -prompt_codes % chunk
    return pad if pad * stride > mel_cache else chunk + pad


class CodecStream:
    """One utterance: `push(codes)` -> the PCM now final, `finish()` -> the rest. Not thread-safe."""

    def __init__(
        self,
        decoder: CodecDecoder,
        prompt: VoicePrompt,
        seed: int = DEFAULT_SEED,
        *,
        mel_cache: int = MEL_CACHE,
        final_offline: bool = False,
        keep_mel: bool = False,
        flow_cache: bool = True,
        past: list[Past] | None = None,
    ) -> None:
        """past: the voice prompt's flow past (`decoder.prompt_past(prompt)`), copied; made here if not
        given. Unused with flow_cache False."""
        cfg = decoder.cfg
        if cfg.chunk <= 0:
            raise ValueError("streaming needs a chunk-trained config (cfg.chunk > 0)")
        if mel_cache <= F0_RADIUS:
            raise ValueError(f"mel_cache must exceed the F0 predictor's reach ({F0_RADIUS} frames), got {mel_cache}")
        self.decoder, self.mel_cache, self.final_offline = decoder, mel_cache, final_offline
        device = decoder.device
        self.prompt = prompt.to(device)
        self.seed = seed  # the source noise's (NsfSource.noise)
        self.chunk, self.lookahead = cfg.chunk, cfg.encoder.lookahead
        self.hop0 = first_hop(prompt.codes.numel(), cfg.chunk, decoder.stride, mel_cache)
        self.codes: list[int] = []
        self.offset = 0  # codes whose frames went to HiFT
        self.finished = False
        self.emitted = 0  # PCM samples returned so far
        self.mels: list[Tensor] | None = [] if keep_mel else None  # each flow call's new frames, if kept
        self.past = None if not flow_cache else [p.copy() for p in past or decoder.prompt_past(prompt)]
        # HiFT state; frames count from the first code (the prompt's are never vocoded)
        self.frames = 0  # mel frames vocoded so far
        self.start = 0  # first frame of the next HiFT call (the cached frames)
        mels = cfg.encoder.mel
        self.mel_tail = torch.zeros(mels, 0, device=device)  # frames [start - F0 context, frames)
        self.cycles: Tensor | None = None  # source phase (cycles) at frame start - 1; None at frame 0
        self.held = torch.zeros(0, device=device)  # PCM of frames [start, frames), to cross-fade
        self.fade = rise(mel_cache * cfg.hift.hop, device)  # the cross-fade's weights, made once

    @property
    def first_codes(self) -> int:
        """Codes needed before the first PCM: the first hop + lookahead."""
        return self.hop0 + self.lookahead

    def _hop(self) -> int:
        return self.hop0 if self.offset == 0 else self.chunk

    def push(self, codes: Sequence[int] | Tensor) -> Tensor:
        """Add codes; returns the PCM that became final (possibly empty), [n * 1920 - held] samples."""
        return self.vocode(self.flow(codes))

    def finish(self) -> Tensor:
        """Decode the codes left (the lookahead now reads the end) and return all PCM still held."""
        return self.vocode(self.flow_rest(), final=True)

    @torch.inference_mode()
    def flow(self, codes: Sequence[int] | Tensor) -> list[Tensor]:
        """push's first stage: add codes and run the flow calls now due; their new mel frames."""
        return [self.run(call) for call in self.calls(codes)]

    @torch.inference_mode()
    def flow_rest(self) -> list[Tensor]:
        """finish's first stage: the last flow call, over the codes left (none if there are none)."""
        return [self.run(call) for call in self.calls([], last=True)]

    def calls(self, codes: Sequence[int] | Tensor, last: bool = False) -> list[FlowCall]:
        """Add codes (last: none follow) and return the flow calls now due, in order, without running
        them: `run` runs one, or `codec.batch` runs many streams' together."""
        if self.finished:
            raise RuntimeError("push() after finish()" if not last else "finish() called twice")
        new = torch.as_tensor(codes).reshape(-1).tolist()
        vocab = self.decoder.cfg.encoder.vocab_size
        if any(not 0 <= c < vocab for c in new):
            raise ValueError(f"codes must lie in [0, {vocab})")
        self.codes += new
        out = []
        while len(self.codes) - self.offset >= self._hop() + self.lookahead:
            hop = self._hop()
            out.append(FlowCall(self.codes[: self.offset + hop + self.lookahead], self.offset, streaming=True, finalize=False))
            self.offset += hop
        if last:
            self.finished = True
            if len(self.codes) > self.offset:  # a flow call always leaves lookahead codes, so none left: nothing pushed
                out.append(FlowCall(self.codes, self.offset, streaming=not self.final_offline, finalize=True))
        return out

    def run(self, call: FlowCall) -> Tensor:
        """One flow call, alone: its new mel frames [mels, n]."""
        streaming = call.streaming
        mel = self.decoder.mel(
            call.codes,
            self.prompt,
            streaming=streaming,
            finalize=call.finalize,
            offset_frames=call.offset * self.decoder.stride,
            past=self.past if streaming else None,  # an offline last call reads every frame
        )
        return self.keep(mel)

    def keep(self, mel: Tensor) -> Tensor:
        """A flow call's frames, kept if asked (keep_mel)."""
        if self.mels is not None:
            self.mels.append(mel)
        return mel

    @torch.inference_mode()
    def vocode(self, mels: list[Tensor], final: bool = False) -> Tensor:
        """The second stage: HiFT over each flow call's frames in turn; the PCM that became final (final:
        the last call's, the held tail included)."""
        out = [self._vocode(m, final and i == len(mels) - 1) for i, m in enumerate(mels)]
        if final and not mels:
            out.append(self.held)
            self.held = self.held[:0]
        return self._emit(out)

    def _emit(self, parts: list[Tensor]) -> Tensor:
        pcm = torch.cat(parts) if parts else self.held.new_zeros(0)
        self.emitted += pcm.numel()
        return pcm

    def _vocode(self, new: Tensor, final: bool) -> Tensor:
        """HiFT over [cached frames | new frames]; cross-fade the head, hold back the tail unless final."""
        x = self.prepare(new)
        self.advance(x, final)
        seed, start = to_device(new.device, [[self.seed], [x.start]])
        before = None if x.before is None else x.before[None]
        pcm, cycles = self.decoder.hift_calls(x.mel[None], seed, start, before, context=x.context)
        return self.settle(pcm[0], x, cycles[0], final)

    def prepare(self, new: Tensor, joined: Tensor | None = None, at: int = 0) -> Excitation:
        """What a HiFT call over the new frames [mels, n] needs of this stream (`_vocode` runs it for this
        stream alone; `codec.batch` many streams' calls at once). joined: [mels, F], frames `at` on, this
        stream's tail and new frames already joined (`codec.batch`: its calls' in one copy), read as views."""
        a, end = self.start, self.frames + new.shape[1]
        first = self.frames - self.mel_tail.shape[1]
        mel = torch.cat([self.mel_tail, new], dim=1) if joined is None else joined[:, first - at : end - at]  # [first, end)
        return Excitation(mel, a - first, self.cycles, first, end)

    def advance(self, x: Excitation, final: bool) -> None:
        """Move the HiFT cache past call `x` (made by `prepare`) before its PCM is known: the frames vocoded
        and, unless final, the next call's first frame and F0 context, which the next `prepare` reads. So
        `codec.batch` prepares a stream's calls one after another and runs their HiFT in one pass."""
        self.frames = x.end
        if not final:
            nxt = max(0, x.end - self.mel_cache)  # the next call's first frame
            self.mel_tail = x.mel[:, max(0, nxt - F0_RADIUS - 1) - x.first :]
            self.start = nxt

    def settle(self, pcm: Tensor, x: Excitation, cycles: Tensor, final: bool) -> Tensor:
        """After HiFT's call `x` (its PCM, its source's cycles [F, width]), in the order of the stream's calls:
        cross-fade the head with the held tail, hold back the new tail unless final; the PCM now final."""
        return torch.cat(settle_all([(self, pcm, x, cycles, final)])[0])

    def _keep(self, pcm: Tensor, head: Tensor, x: Excitation, cycles: Tensor, final: bool) -> list[Tensor]:
        """`settle` once the head [n] is cross-faded (pcm's first n samples, n the tail held before): the
        new tail held back unless final, the source's phase kept; the PCM now final, in parts."""
        n = head.numel()
        if final:
            self.held = pcm[:0]
            return [head, pcm[n:]]
        a, nxt = x.start, max(0, x.end - self.mel_cache)
        keep = (nxt - a) * self.decoder.cfg.hift.hop
        self.held = pcm[keep:] if keep >= n else torch.cat([head[keep:], pcm[n:]])
        self.cycles = cycles[nxt - a - 1] if nxt > 0 else None
        return [head[:keep], pcm[n:keep]]

    def state(self) -> list[Tensor]:
        """The device tensors a stream carries between calls (for a caller moving it between CUDA streams)."""
        return [t for t in (self.mel_tail, self.cycles, self.held, self.fade) if t is not None]


def ranks(streams: list[CodecStream]) -> tuple[list[int], dict[int, int]]:
    """Of calls by stream, in order: each call's rank among its stream's (0: its first here), and each
    later call's predecessor (its stream's call before it)."""
    rank, prev, last = [], {}, {}
    for n, s in enumerate(streams):
        if id(s) in last:
            prev[n] = last[id(s)]
        rank.append(rank[prev[n]] + 1 if n in prev else 0)
        last[id(s)] = n
    return rank, prev


def settle_all(calls: list[tuple[CodecStream, Tensor, Excitation, Tensor, bool]]) -> list[list[Tensor]]:
    """`CodecStream.settle` of many HiFT calls (stream, PCM, call, cycles, final), a stream's in order: the
    PCM each made final, in parts (to be joined). The k-th calls of all streams cross-fade together, in one
    set of ops a held tail's length (a stream's next call fades against the tail this one holds back): a
    batch of a few streams' held chunks would otherwise launch six kernels a call."""
    rank, _ = ranks([s for s, *_ in calls])
    out: list[list[Tensor]] = [[] for _ in calls]
    for r in range(max(rank, default=-1) + 1):
        by_n: dict[int, list[int]] = {}
        for i, (s, *_) in enumerate(calls):
            if rank[i] == r:
                by_n.setdefault(s.held.numel(), []).append(i)
        for n, group in by_n.items():
            heads = [calls[i][1][:n] for i in group]
            if n:  # each new head rises as its old tail falls, the two weights summing to 1
                s0 = calls[group[0]][0]
                up = s0.fade if n == s0.fade.numel() else rise(n, heads[0].device)
                h, held = torch.stack(heads), torch.stack([calls[i][0].held for i in group])
                heads = list((h * up + held * (1 - up)).to(h.dtype).unbind(0))
            for i, head in zip(group, heads, strict=True):
                s, pcm, x, cycles, final = calls[i]
                out[i] = s._keep(pcm, head, x, cycles, final)
    return out


def carry_all(
    cycles: Callable[[Tensor], Tensor], streams: list[CodecStream], xs: list[Excitation], f0: list[Tensor]
) -> list[Excitation]:
    """HiFT calls `xs` of `streams` (a stream's in order), each after its stream's first here counting its
    source's cycles on from the call before it: that call's cycles (`cycles`, NsfSource's, of its F0) at its
    last kept frame, its own `before` added, as `CodecStream.settle` keeps them, or from zero where it kept
    none. The cycles of every call with a successor come from its F0 alone, calls of one length at once;
    then the k-th calls of all streams add theirs together: a held batch's calls would otherwise launch a
    dozen kernels each."""
    rank, prev = ranks(streams)
    cut: dict[int, int] = {}  # a predecessor's frame its cycles are carried from (none where it kept none)
    for p in prev.values():
        if (nxt := max(0, xs[p].end - streams[p].mel_cache)) > 0:
            cut[p] = nxt - xs[p].start - 1
    at: dict[int, Tensor] = {}  # those cycles, [width] float64
    by_len: dict[int, list[int]] = {}
    for p in cut:
        by_len.setdefault(f0[p].shape[-1], []).append(p)
    for group in by_len.values():
        rows, frames = to_device(f0[group[0]].device, [list(range(len(group))), [cut[p] for p in group]])
        got = cycles(torch.stack([f0[p] for p in group]))[rows, frames]
        at.update(zip(group, got.unbind(0), strict=True))
    xs = list(xs)
    for r in range(1, max(rank, default=0) + 1):
        now = [n for n in prev if rank[n] == r]
        add = [n for n in now if prev[n] in at and xs[prev[n]].before is not None]
        summed = {}
        if add:
            total = torch.stack([xs[prev[n]].before for n in add]) + torch.stack([at[prev[n]] for n in add])
            summed = dict(zip(add, total.unbind(0), strict=True))
        for n in now:
            xs[n] = dataclasses.replace(xs[n], before=summed.get(n, at.get(prev[n])))
    return xs
