"""MOSS-Speech's modality-switching generation loop and its samplers, engine-agnostic.

Every step samples a text token and an audio token (FACTS.md section 1, official `_sample`):
- text mode: the text token is kept; start-of-speech on the text channel switches to audio;
- audio mode: the text token is replaced by modality_pad; end-of-speech on the audio channel
  switches back to text;
- the next input is (text, audio): embedded by the text id unless it is modality_pad;
- a stop id on the text channel (in text mode) ends the sequence.
A switch can also be forced at chosen steps (`force_switch_at`): the sampled token is replaced
by start-of-speech (text mode) or end-of-speech (audio mode) and then goes through the same
`advance` as a sampled one. verify uses this so that every checkpoint crosses switches, whether
or not its weights switch by themselves within a few dozen greedy steps.
In audio mode the text logits are never read, so the engine may skip the text head, at the
prefill (a prompt ending in start-of-speech) and at every decode step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workflow.spec import ModelSpec

if TYPE_CHECKING:  # a type only: the loop must not depend on any engine's code
    from workflow.engines.base import Engine


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; the defaults are MOSS-Speech's. greedy=True takes the argmax."""

    greedy: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    repetition_penalty: float = 1.1


@dataclass(frozen=True)
class Ids:
    """The special ids the loop needs: from the model config, plus the generation config's."""

    sosp: int
    eosp: int
    pad: int  # modality_pad on the text channel
    audio_pad: int = 512  # what the audio channel carries at text positions
    stop: tuple[int, ...] = (151645, 151643)  # <|im_end|>, <|endoftext|>

    @classmethod
    def of(cls, spec: ModelSpec, audio_pad: int = 512, stop: tuple[int, ...] = (151645, 151643)) -> Ids:
        return cls(spec.sosp_token_id, spec.eosp_token_id, spec.modality_pad_token_id, audio_pad, tuple(stop))


def audio_mode_after(tokens: torch.Tensor, ids: Ids) -> torch.Tensor:
    """[..., T, 2] -> [..., T] bool: is the step after each position in audio mode?

    After start-of-speech, or after an audio code that is not end-of-speech: audio.
    """
    text, audio = tokens[..., 0], tokens[..., 1]
    return (text == ids.sosp) | ((text == ids.pad) & (audio != ids.eosp))


@functools.cache
def _stop_ids(ids: Ids, device: torch.device) -> torch.Tensor:
    """The stop ids as a tensor on `device`, made once, not at every step."""
    return torch.tensor(ids.stop, device=device)


@functools.cache
def _padding_rows(ids: Ids, size: int, device: torch.device) -> torch.Tensor:
    """[size] bool: the audio head's rows past end-of-speech, made once, not at every step."""
    return torch.arange(size, device=device) > ids.eosp


def advance(
    text_tok: torch.Tensor, audio_tok: torch.Tensor, audio_mode: torch.Tensor, ids: Ids
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the loop after sampling: (next input [B, 2], next audio mode, stopped)."""
    text_tok = torch.where(audio_mode, torch.full_like(text_tok, ids.pad), text_tok)
    audio_tok = torch.where(audio_mode, audio_tok, torch.full_like(audio_tok, ids.audio_pad))
    next_mode = torch.where(audio_mode, audio_tok != ids.eosp, text_tok == ids.sosp)
    stopped = ~audio_mode & torch.isin(text_tok, _stop_ids(ids, text_tok.device))
    return torch.stack([text_tok, audio_tok], dim=-1), next_mode, stopped


def force_switch(
    text_tok: torch.Tensor, audio_tok: torch.Tensor, audio_mode: torch.Tensor, ids: Ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled tokens with the switch out of each sequence's mode put in their place:
    start-of-speech on the text channel in text mode, end-of-speech on the audio channel in
    audio mode."""
    text_tok = torch.where(audio_mode, text_tok, torch.full_like(text_tok, ids.sosp))
    audio_tok = torch.where(audio_mode, torch.full_like(audio_tok, ids.eosp), audio_tok)
    return text_tok, audio_tok


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Repetition penalty (CTRL / Hugging Face): divide positive, multiply negative logits."""
    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] float logits -> [B] ids: temperature, then top-k, then top-p (nucleus).

    The logits are sorted once, most likely first: top-k and top-p are then masks on the
    sorted row, with no top-k kernel of their own (torch's, for one row of a 16k vocabulary, is
    a single-block select: about 70 us a step on an H100, more than the sort)."""
    if s.greedy:
        return logits.argmax(-1)
    ranked, order = (logits / max(s.temperature, 1e-5)).sort(dim=-1, descending=True)
    if 0 < s.top_k < logits.shape[-1]:  # ties with the k-th logit stay in, as in transformers
        ranked = ranked.masked_fill(ranked < ranked[:, s.top_k - 1 : s.top_k], float("-inf"))
    probs = ranked.softmax(-1)
    if s.top_p < 1.0:  # keep the token that crosses top_p
        probs = probs.masked_fill(probs.cumsum(-1) - probs > s.top_p, 0.0)
    # An exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i / sum(p)
    # (no renormalising needed), as torch.multinomial does, but without its host-side check,
    # which waits for the GPU (here: for the whole decode step) and leaves every later launch
    # of the step on the critical path.
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return order.gather(-1, (probs / race).argmax(-1, keepdim=True)).squeeze(-1)


def sample_step(
    text_logits: torch.Tensor | None,
    audio_logits: torch.Tensor,
    seen_text: torch.Tensor,
    seen_audio: torch.Tensor,
    hold_eosp: torch.Tensor | None,
    ids: Ids,
    s: Sampling,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's sampled (text id [B], audio id [B]), before `advance`: each head with the
    repetition penalty over the ids its channel has carried (seen_*), the audio head over the
    real codes and end-of-speech only (its padding rows are never sampled), end-of-speech held
    back where hold_eosp [B] is set; no text logits (every sequence in audio mode): modality_pad."""
    if text_logits is None:
        text_tok = torch.full(audio_logits.shape[:1], ids.pad, dtype=torch.long, device=audio_logits.device)
    else:
        text_tok = sample(penalize(text_logits, seen_text, s.repetition_penalty), s, generator)
    audio_logits = audio_logits.masked_fill(_padding_rows(ids, audio_logits.shape[-1], audio_logits.device), float("-inf"))
    if hold_eosp is not None:
        audio_logits[:, ids.eosp] = torch.where(hold_eosp, float("-inf"), audio_logits[:, ids.eosp])
    return text_tok, sample(penalize(audio_logits, seen_audio, s.repetition_penalty), s, generator)


@dataclass
class Generation:
    """What a generate() call produced, per sequence."""

    tokens: torch.Tensor  # [B, N, 2] the inputs fed back at each step (text, audio)
    audio_mode: torch.Tensor  # [B, N] the mode each token was sampled in
    stopped_at: list[int | None] = field(default_factory=list)  # step of the stop id, if any

    def audio_codes(self, b: int, ids: Ids) -> list[int]:
        """Audio codes of sequence b, in order (end-of-speech excluded)."""
        mode, audio = self.audio_mode[b], self.tokens[b, :, 1]
        return [int(a) for a, m in zip(audio, mode, strict=True) if m and a != ids.eosp]


def generate(
    engine: Engine,
    prompt: torch.Tensor,
    max_new_tokens: int,
    ids: Ids,
    sampling: Sampling = Sampling(greedy=True),
    generator: torch.Generator | None = None,
    min_speech_tokens: int = 0,
    skip_text_head: bool = True,
    on_step: Callable[[int, torch.Tensor, list[bool]], None] | None = None,
    force_switch_at: frozenset[int] = frozenset(),
) -> Generation:
    """Run the loop from a prompt [B, T, 2] for up to max_new_tokens steps.

    min_speech_tokens suppresses end-of-speech until an audio segment has that many codes
    (like min_new_tokens for an end-of-sequence id). on_step(step, tokens [B, 2], audio_mode
    [B] as host booleans: the mode each token was sampled in) streams audio chunks, say: it is
    called as soon as the step's sampling is enqueued, before the host waits for it, so what
    it enqueues runs right behind it; it must not wait for the device itself.
    force_switch_at: steps at which every sequence switches modality (`force_switch`).

    The host waits for the device once a step, for the few flags its decisions need (stop,
    text head): everything else is queued behind the running decode step, so the next step
    is launched as soon as those flags are known.
    """
    device = engine.device
    audio_mode = audio_mode_after(prompt, ids)[:, -1]  # where the prompt is (the host, usually): no wait
    mode_now: list[bool] = audio_mode.tolist()  # the host's copy, for on_step and need_text
    prompt, audio_mode = prompt.to(device), audio_mode.to(device)
    b, v_text, v_audio = prompt.shape[0], engine.spec.vocab_size, engine.spec.audio_vocab_size
    text_logits, audio_logits = engine.prefill(prompt, need_text=not skip_text_head or not all(mode_now))
    seen_text = torch.zeros(b, v_text, dtype=torch.bool, device=device).scatter_(1, prompt[..., 0], True)
    seen_audio = torch.zeros(b, v_audio, dtype=torch.bool, device=device).scatter_(1, prompt[..., 1], True)
    run = torch.zeros(b, dtype=torch.long, device=device)  # codes in the current audio segment
    done = [False] * b
    stopped_at: list[int | None] = [None] * b
    out_tokens, out_modes = [], []
    for step in range(max_new_tokens):
        hold = run < min_speech_tokens if min_speech_tokens else None
        text_tok, audio_tok = sample_step(text_logits, audio_logits, seen_text, seen_audio, hold, ids, sampling, generator)
        if step in force_switch_at:
            text_tok, audio_tok = force_switch(text_tok, audio_tok, audio_mode, ids)
        tokens, next_mode, stopped = advance(text_tok, audio_tok, audio_mode, ids)
        out_tokens.append(tokens)
        out_modes.append(audio_mode)
        if on_step is not None:
            on_step(step, tokens, mode_now)
        seen_text.scatter_(1, tokens[:, :1], True)
        seen_audio.scatter_(1, tokens[:, 1:], True)
        run = torch.where(audio_mode & next_mode, run + 1, torch.zeros_like(run))
        stopped_now, text_next = torch.stack([stopped, ~next_mode]).tolist()  # the step's one wait
        for i in range(b):
            if stopped_now[i] and not done[i]:
                stopped_at[i], done[i] = step, True
        audio_mode, mode_now = next_mode, [not t for t in text_next]
        if all(done) or step == max_new_tokens - 1:
            break
        need_text = not skip_text_head or any(t and not d for t, d in zip(text_next, done, strict=True))
        text_logits, audio_logits = engine.decode(tokens, need_text=need_text)
    return Generation(torch.stack(out_tokens, 1), torch.stack(out_modes, 1), stopped_at)
