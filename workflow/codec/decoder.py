"""The whole codec decoder, offline: codes -> mel (the flow) -> 24 kHz PCM (HiFT); docs/codec.md.

    tokens = prompt codes + codes                         the prompt fixes the voice and the chunk grid
    mu     = FlowFrontEnd(tokens)                         4 mel frames per token; chunk masks when streaming;
                                                          not final: the last `lookahead` codes are context only
    cond   = prompt mel, then zeros                       the flow continues the prompt's spectrum
    mel    = solve(estimator, mu, spks, cond)[prompt:]    fixed noise, Euler, CFG; the prompt's frames dropped
    pcm    = HiFT(mel, source)                            1920 samples per code

The flow follows `CausalMaskedDiffWithXvec.inference` (OpenMOSS/MOSS-Speech @6b86ef6, `cosyvoice/flow/flow.py`).
HiFT's network is `hift.py`'s, but its excitation (the NSF source) is made here, by `NsfSource`, for one reason:
so that a stream (stream.py) can continue it exactly. HiFT's own `SineGen2` restarts the sine phase at zero on
every call and draws its noise as one [harmonics, samples] block, so a chunk's source depends on where the call
started and on the total length; CosyVoice2 hides the phase jump by overwriting the head of each new source with
the last one's tail, which leaves a jump a little later and a different waveform from the one-call decode. Here
the phase is the running sum over all frames (kept in float64, carried across calls) and each noise value is
a function of the stream's seed and its place (`NsfSource.noise`), so a frame's source is the same whether it
was made in one call or many. The deterministic part equals `SineGen2`'s up to float32 rounding of its phase;
the noise has the same distribution but other draws than `HiFT.forward` for the same seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from workflow.codec import kernels as kernels_module
from workflow.codec.config import CodecConfig, HiftConfig, MelConfig
from workflow.codec.encoder import FlowFrontEnd
from workflow.codec.estimator import CausalConditionalDecoder, Past
from workflow.codec.fast import FastEstimator
from workflow.codec.hift import DEFAULT_SEED, ELU_CONVS, HiFT, excitation
from workflow.codec.mel import LogMel
from workflow.codec.solver import Estimator, FixedNoise, solve
from workflow.engines.base import to_device

F0_RADIUS = ELU_CONVS  # the F0 predictor's five k=3 convolutions: f0 at frame i reads mel frames i-5 .. i+5


MASK32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """PCG's output permutation of 32-bit values held in int64 (every product stays below 2^63)."""
    state = (x * 747796405 + 2891336453) & MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & MASK32
    return (word >> 22) ^ word


@dataclass(frozen=True)
class VoicePrompt:
    """The voice the flow continues: prompt codes [P], their log-mel [mels, stride * P], a CAM++ x-vector [192]."""

    codes: Tensor
    mel: Tensor
    xvector: Tensor

    def __post_init__(self) -> None:
        if self.codes.dim() != 1 or self.mel.dim() != 2 or self.xvector.dim() != 1:
            raise ValueError("prompt codes [P], mel [mels, frames] and xvector [dim] expected")
        if self.codes.numel() and self.mel.shape[1] % self.codes.numel():
            raise ValueError(f"prompt mel frames {self.mel.shape[1]} are not a multiple of {self.codes.numel()} codes")

    @classmethod
    def from_wav(cls, wav: Tensor, codes: Tensor, xvector: Tensor, mel: MelConfig | None = None, stride: int = 4) -> VoicePrompt:
        """The prompt from its 24 kHz waveform: log-mel, then codes and mel trimmed to the same length,
        min(frames // stride, codes) codes, as the official voice conditioning does."""
        feats = LogMel(mel).to(wav.device)(wav.float())[0]
        n = min(feats.shape[1] // stride, codes.numel())
        return cls(codes[:n].long(), feats[:, : n * stride], xvector.float())

    @classmethod
    def empty(cls, mels: int = 80, spk_dim: int = 192) -> VoicePrompt:
        """No prompt at all: no codes, no frames, a zero x-vector (the speaker projection's bias alone)."""
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(mels, 0), torch.zeros(spk_dim))

    def to(self, device: torch.device | str) -> VoicePrompt:
        return VoicePrompt(self.codes.to(device), self.mel.to(device), self.xvector.to(device))


class NsfSource:
    """HiFT's harmonic-plus-noise excitation, continuable: frames of f0 in, source samples out.

    Harmonic k (1..harmonics+1) advances hop * ((k f0 / sr) mod 1) cycles per frame; the cycle count at
    each frame's centre is the running sum (float64), linearly interpolated to the samples between centres
    as `F.interpolate(align_corners=False)` does, held flat past the first and last centre when no
    neighbour is given. Voiced frames (f0 > threshold): alpha sin + N(0, sigma); unvoiced: N(0, alpha / 3).
    `l_linear` (HiFT's weights) merges the harmonics, then tanh."""

    def __init__(self, hift: HiFT) -> None:
        self.cfg: HiftConfig = hift.cfg
        self.merge = hift.m_source.l_linear
        self.width = self.cfg.harmonics + 1

    def noise(self, seeds: Tensor, first: Tensor, frames: int) -> Tensor:
        """Standard normals [n, frames * hop, width] for frames first[i] .. first[i] + frames of stream i.
        Each value is a function of its stream's seed and its place (frame, sample, harmonic) alone: a
        counter-based draw (PCG's hash of the place, mixed with the seed's, then Box-Muller), so a frame's
        noise is the same however a stream's calls split its frames, and it is made on the device, many
        streams at once, inside a CUDA graph (a generator's draws are made on the host, stream by stream)."""
        per = self.cfg.hop * self.width
        dev = first.device
        place = (first[:, None, None] + torch.arange(frames, device=dev)[:, None]) * per + torch.arange(per, device=dev)
        key = _hash32(seeds.to(dev, torch.long)[:, None, None] & MASK32)
        u1, u2 = ((_hash32(_hash32(2 * place + j) ^ key).double() + 0.5) / 2**32 for j in (0, 1))
        z = torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)
        return z.float().reshape(-1, frames * self.cfg.hop, self.width)

    def cycles(self, f0: Tensor, before: Tensor | None = None) -> Tensor:
        """Cycles of each harmonic at each frame's centre, [..., F, width] float64 from f0 [..., F], counted
        on from `before` (the cycles at the previous frame, [..., width]) or from zero at the utterance start."""
        k = torch.arange(1, self.width + 1, device=f0.device, dtype=torch.float64)
        per_frame = self.cfg.hop * ((f0.double()[..., None] * k / self.cfg.sampling_rate) % 1)
        c = per_frame.cumsum(-2)
        return c if before is None else c + before[..., None, :]

    def __call__(self, f0: Tensor, noise: Tensor, before: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """f0 [..., F] (Hz), noise [..., F * hop, width], `before` as in `cycles` -> (source [..., F * hop],
        cycles [..., F, width]); leading dimensions are streams, each its own."""
        cfg, hop = self.cfg, self.cfg.hop
        c = self.cycles(f0, before)
        left = c[..., :1, :] if before is None else before[..., None, :]
        ext = torch.cat([left, c, c[..., -1:, :]], dim=-2)  # centres -1 .. F: the first and last with their neighbour or held
        pos = (torch.arange(c.shape[-2] * hop, device=f0.device, dtype=torch.float64) + 0.5) / hop + 0.5
        i = pos.floor().long()
        w = (pos - i)[:, None]
        phase = ext[..., i, :] * (1 - w) + ext[..., i + 1, :] * w
        sines = torch.sin(2 * torch.pi * (phase - phase.floor())).to(noise.dtype)
        return torch.tanh(self.merge(excitation(sines, f0, noise.to(f0.device), cfg)))[..., 0], c


class CodecDecoder(nn.Module):
    """MOSS-Speech's codec decoder (one utterance at a time, as the official code): the flow's front end
    (`flow`), its velocity estimator, the fixed noise, HiFT. `cfg.chunk` > 0 means chunk-trained weights
    (flow-chunk-<chunk>.pt) and chunk masks by default; 0 the offline flow.pt. `official`: the solves run
    the estimator's own forward (the published structure: the benchmark's baseline), not its fast pass;
    `compiled`: the fast pass's blocks through torch.compile (fast.py); `kernels`: the flow slots' transformer
    blocks and HiFT's Snake activations as Triton kernels (kernels.py, snake.py, CUDA)."""

    def __init__(
        self, cfg: CodecConfig | None = None, *, official: bool = False, compiled: bool = False, kernels: bool = False
    ) -> None:
        super().__init__()
        if kernels and not kernels_module.available():
            raise RuntimeError("the codec decoder's kernels need triton (benchmark.codec.kernels)")
        self.official, self.kernels = official, kernels
        self.cfg = cfg = cfg or CodecConfig()
        self.flow = FlowFrontEnd(cfg.encoder)
        self.estimator = CausalConditionalDecoder.from_codec(cfg)
        self.fast = FastEstimator(self.estimator, compiled)  # reads the estimator's weights at each call
        self.noise = FixedNoise(cfg.solver.noise_frames, cfg.solver.noise_seed, cfg.encoder.mel)
        self.hift = HiFT(cfg.hift)
        self.hift.fuse(kernels)
        self.source = NsfSource(self.hift)

    @property
    def velocity(self) -> Estimator:
        """What the solves call: the estimator's fast pass (fast.py), or its own forward if `official`.
        A `Past` is made and read by the same one."""
        return self.estimator if self.official else self.fast

    @property
    def compiled(self) -> bool:
        """Whether the fast pass runs its blocks compiled."""
        return self.fast.compiled

    @property
    def stride(self) -> int:
        """Mel frames per code (4)."""
        return self.cfg.encoder.stride

    @property
    def samples_per_code(self) -> int:
        """PCM samples per code: stride x HiFT's hop (4 x 480 = 1920, 80 ms at 24 kHz)."""
        return self.stride * self.cfg.hift.hop

    def load_flow_state(self, state: dict[str, Tensor]) -> None:
        """Load an official flow.pt / flow-chunk-*.pt state dict (front end and estimator, strictly)."""
        self.flow.load_flow_state(state)
        self.estimator.load_flow_state(state)

    def mel(
        self,
        codes: Tensor | Sequence[int],
        prompt: VoicePrompt,
        *,
        streaming: bool,
        finalize: bool = True,
        offset_frames: int = 0,
        past: list[Past] | None = None,
    ) -> Tensor:
        """The flow: log-mel [mels, frames] of `codes` in `prompt`'s voice, from frame `offset_frames` on.

        streaming: chunk masks (the grid starts at the prompt's first code). finalize False: the last
        `lookahead` codes only feed the lookahead convolution and give no frames, so the frames returned
        are final (with chunk masks and a chunk-aligned end they never change as more codes come).
        past (streaming only, one per ODE step): the flow's state over the frames before its end, which
        the solve then skips, extended to this call's end (which must be chunk-aligned unless finalize).
        Many streams' calls at once, padded and from CUDA graphs: codec/batch.py."""
        if streaming and self.cfg.chunk <= 0:
            raise ValueError("streaming needs a chunk-trained config (cfg.chunk > 0)")
        device = self.device
        codes = torch.as_tensor(codes, dtype=torch.long, device=device).reshape(-1)
        la, p, prompt_frames = self.cfg.encoder.lookahead, prompt.codes.numel(), prompt.codes.numel() * self.stride
        if codes.numel() < (1 if finalize else la + 1):
            raise ValueError(f"{codes.numel()} codes: need at least {1 if finalize else la + 1}")
        if prompt.mel.shape[1] != prompt_frames:
            raise ValueError(f"prompt mel has {prompt.mel.shape[1]} frames, its {p} codes need {prompt_frames}")
        tokens = torch.cat([prompt.codes.to(device), codes])[None]
        body, context = (tokens, None) if finalize else (tokens[:, :-la], tokens[:, -la:])
        frames = body.shape[1] * self.stride
        start = past[0].frames if past is not None else 0
        if start > prompt_frames + offset_frames:
            raise ValueError(f"the flow's past ends at frame {start}, after the first one asked for")
        if past is not None and not finalize and frames % (self.cfg.chunk * self.stride):
            raise ValueError(f"a past must end on a chunk boundary; this call ends at frame {frames}")
        chunk = self.cfg.chunk if streaming else 0
        mel = self.rows(prompt, body, torch.tensor([body.shape[1]]), context, chunk=chunk, past=past)
        return mel[0, :, prompt_frames + offset_frames - start :]

    def rows(
        self, prompt: VoicePrompt, tokens: Tensor, lengths: Tensor, context: Tensor | None = None, *, chunk: int,
        past: list[Past] | None = None,
    ) -> Tensor:  # fmt: skip
        """The flow over rows in one voice: tokens [n, T] (the prompt's codes first; a row's end past
        its `lengths` is padding), context [n, lookahead] or None (the rows end there), chunk 0
        (offline) or the chunk masks' -> mel [n, mels, T * stride - s], float32, from the frame s
        where `past` ends (0 without it). `mel` runs one row; codec/batch.py many, padded."""
        mu = self.flow(tokens, lengths, chunk=chunk, context=context)
        start = past[0].frames if past is not None else 0
        frames = torch.arange(start, mu.shape[-1], device=mu.device)
        mask = (frames[None] < to_device(mu.device, lengths)[:, None] * self.stride)[:, None].to(mu.dtype)
        cond = torch.zeros_like(mu)
        cond[:, :, : prompt.mel.shape[1]] = prompt.mel.to(mu)
        spks = self.flow.speaker(prompt.xvector.to(mu)[None]).expand(len(tokens), -1)
        mu, cond = mu[:, :, start:], cond[:, :, start:]
        return solve(self.velocity, mu, mask, spks, cond, self.cfg.solver, streaming=chunk > 0, noise=self.noise, past=past)

    def past_frames(self, prompt_codes: int) -> int:
        """The frames `prompt_past` covers for a prompt of that many codes (`CodecConfig.past_frames`)."""
        return self.cfg.past_frames(prompt_codes)

    @torch.inference_mode()
    def prompt_past(self, prompt: VoicePrompt) -> list[Past]:
        """The flow's past (one per ODE step) over the prompt frames no reply can change: the whole chunks
        whose codes and lookahead are all the prompt's. Made once per voice; each stream starts from a copy."""
        cfg, frames = self.cfg, self.past_frames(prompt.codes.numel())
        past = [Past() for _ in range(cfg.solver.steps)]
        la = cfg.encoder.lookahead
        if frames <= 0:
            return past
        prompt = prompt.to(self.device)
        tokens = prompt.codes[None]
        body, context = (tokens[:, :-la], tokens[:, -la:]) if la else (tokens, None)
        mu = self.flow(body, chunk=cfg.chunk, context=context)[:, :, :frames]
        mask = torch.ones(1, 1, frames, device=mu.device, dtype=mu.dtype)
        spks = self.flow.speaker(prompt.xvector.to(mu)[None])
        solve(self.velocity, mu, mask, spks, prompt.mel[None, :, :frames].to(mu), cfg.solver, True, self.noise, past)
        return past

    def vocode(self, mel: Tensor, seed: int = DEFAULT_SEED) -> Tensor:
        """HiFT over a whole utterance's mel [mels, F] -> PCM [F * hop], its source noise `seed`'s."""
        pcm, _ = self.hift_calls(mel[None], to_device(mel.device, [seed]), to_device(mel.device, [0]))
        return pcm[0]

    def hift_calls(
        self, mel: Tensor, seeds: Tensor, first: Tensor, before: Tensor | None = None, *, context: int = 0
    ) -> tuple[Tensor, Tensor]:
        """HiFT calls of one shape, one a stream: mel [n, mels, context + F] (the first `context` frames only
        for the F0 predictor's reach), each stream's noise seed and first frame vocoded [n], the source's
        cycles before it [n, width] (None: at the utterance start) -> (PCM [n, F * hop], cycles [n, F, width])."""
        return self.hift_from_f0(mel, self.hift_f0(mel, context=context), seeds, first, before, context=context)

    def hift_f0(self, mel: Tensor, *, context: int = 0) -> Tensor:
        """hift_calls' first part, the F0 predictor: f0 [n, F] of the vocoded frames (`codec.batch` makes every
        call's first, to carry a stream's source phase from one of its calls to the next before the rest)."""
        return self.hift.f0_predictor(mel)[:, context:]

    def hift_from_f0(
        self, mel: Tensor, f0: Tensor, seeds: Tensor, first: Tensor, before: Tensor | None = None, *, context: int = 0
    ) -> tuple[Tensor, Tensor]:
        """hift_calls' rest, from the calls' f0 [n, F]: each stream's NSF source, the network and the iSTFT."""
        source, cycles = self.source(f0, self.source.noise(seeds, first, f0.shape[1]), before)
        return self.hift.decode(mel[:, :, context:], source[:, None]), cycles

    @torch.inference_mode()
    def whole(
        self,
        codes: Tensor | Sequence[int],
        prompt: VoicePrompt,
        seed: int = DEFAULT_SEED,
        *,
        streaming: bool | None = None,
    ) -> Tensor:
        """All codes in one call -> PCM [codes * 1920], the source noise `seed`'s. streaming defaults to the
        config (chunk masks for a chunk-trained flow, which is what a stream of it equals); False is the
        official offline decode."""
        streaming = self.cfg.chunk > 0 if streaming is None else streaming
        return self.vocode(self.mel(codes, prompt, streaming=streaming, finalize=True), seed)

    @property
    def device(self) -> torch.device:
        """Where the model lives (the fixed noise buffer stays on the CPU; `solve` copies what it needs)."""
        return self.hift.conv_pre.weight.device
