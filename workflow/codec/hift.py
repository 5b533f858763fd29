"""HiFT, the codec's vocoder: 80-band log-mel at 50 Hz -> 24 kHz PCM (docs/codec.md, "Vocoder", "HiFT inference").

An own implementation of CosyVoice's `HiFTGenerator` as MOSS-Speech configures it (the 24 kHz path,
`SourceModuleHnNSF2` with its `SineGen2`). Module and parameter names follow the official code
(OpenMOSS/MOSS-Speech @6b86ef6, `cosyvoice/hifigan/{generator,f0_predictor}.py`,
`cosyvoice/transformer/activation.py`), so that `hift_state_dict(torch.load("hift.pt"))` loads with
`strict=True`. The convolutions are plain: `fold_weight_norm` turns the checkpoint's weight-norm pairs
into weights.

    mel [B, 80, F] -> f0 predictor -> f0 [B, F] (Hz) -> NSF source [B, 1, F*hop]
    mel -> conv_pre -> (lrelu, ups[i], + source_resblocks[i](source_downs[i](STFT(source))), mean of 3 ResBlocks) x 3
        -> lrelu(0.01) -> conv_post -> exp magnitude, sin phase -> iSTFT (n_fft 16, hop 4) -> clamp -> PCM [B, F*hop]

The random parts (the source's additive noise) come from a `torch.Generator`, never the global RNG.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from functools import reduce

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workflow.codec import snake
from workflow.codec.config import HiftConfig

DEFAULT_SEED = 0  # HiftConfig has no seed field: used when forward() gets no generator
ELU_CONVS = 5  # ConvRNNF0Predictor: five Conv1d(k=3) + ELU pairs, then Linear(channels, 1)


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one alpha per channel (linear scale, not log), on [B, C, T]; a fused
    ResBlock (`HiFT.fuse`) reads its alpha into one Triton kernel (snake.snake) in place of torch's six."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        a = self.alpha[None, :, None]
        return x + torch.sin(a * x).pow(2) / (a + 1e-9)


class ResBlock(nn.Module):
    """Per dilation d: x += conv2(snake(conv1_d(snake(x)))), both convs 'same' length. `fused` (`HiFT.fuse`):
    a step is four kernels where torch's ops and the Snake kernel were seven: each
    convolution runs without its bias, which the kernel after it adds (with the Snake after conv1; with
    the residual sum and the next step's first Snake after conv2)."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2) for d in dilations
        )
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return self.kernel_forward(x)
        x = x.float()  # the residual sum in float32 whatever the convolutions' dtype (`HiFT.convs_to`)
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = x + conv(c2, a2(conv(c1, a1(x))))
        return x

    def kernel_forward(self, x: Tensor) -> Tensor:
        steps = list(zip(self.convs1, self.convs2, self.activations2, strict=True))
        h = snake.snake(x, self.activations1[0].alpha, dtype=self.convs1[0].weight.dtype)
        for j, (c1, c2, a2) in enumerate(steps):
            h = snake.snake(conv(c1, h, bias=False), a2.alpha, c1.bias, dtype=c2.weight.dtype)
            after = self.activations1[j + 1].alpha if j + 1 < len(steps) else None
            x, h = snake.residual_snake(conv(c2, h, bias=False), c2.bias, x, after, dtype=c1.weight.dtype)
        return x


def rows(x: Tensor) -> Tensor:
    """[B, C, T] -> [B, C, 1, T] channels-last (memory [B, T, C]), as `conv` takes it."""
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)


def conv(m: nn.Conv1d | nn.ConvTranspose1d, x: Tensor, *, bias: bool = True) -> Tensor:
    """m(x), without its bias where `bias` is False. x [B, C, 1, T] channels-last (`rows`) goes as the 2-D
    convolution over its one row, which cuDNN runs channels-last (NHWC) with no conversions around it
    where the weight is channels-last too (`channels_last`). x goes in the weight's dtype (`HiFT.convs_to`)."""
    b, (s,), (p,), (d,) = m.bias if bias else None, m.stride, m.padding, m.dilation
    x = x.to(m.weight.dtype)
    if isinstance(m, nn.ConvTranspose1d):
        if x.dim() == 3:
            return F.conv_transpose1d(x, m.weight, b, s, p, m.output_padding, 1, d)
        return F.conv_transpose2d(x, m.weight.unsqueeze(2), b, (1, s), (0, p), (0, m.output_padding[0]), 1, (1, d))
    if x.dim() == 3:
        return F.conv1d(x, m.weight, b, s, p, d)
    return F.conv2d(x, m.weight.unsqueeze(2), b, (1, s), (0, p), (1, d))


def channels_last(w: Tensor, on: bool) -> Tensor:
    """A convolution's weight [A, B, k] in memory [A, k, B], so that its [A, B, 1, k] view is channels-last
    (on), or contiguous again. Loading a state dict (copy_) and .to() keep the layout."""
    return w.transpose(1, 2).contiguous().transpose(1, 2) if on else w.contiguous()


class F0Predictor(nn.Module):
    """ConvRNNF0Predictor: `condnet` (Conv1d k3 + ELU) x 5, then `classifier` Linear -> |f0| in Hz, [B, F]."""

    def __init__(self, mel: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(ELU_CONVS):  # keys condnet.0, .2, .4, .6, .8 (the ELUs sit at the odd indices)
            layers += [nn.Conv1d(mel if i == 0 else channels, channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


def excitation(sines: Tensor, f0: Tensor, noise: Tensor, cfg: HiftConfig) -> Tensor:
    """The NSF excitation from the harmonics' sines [..., F*hop, harmonics+1], the frames' f0 [..., F] and
    standard normals shaped like the sines: voiced (f0 > threshold) alpha sin + N(0, sigma), unvoiced
    N(0, alpha / 3)."""
    voiced = (f0 > cfg.voiced_threshold).to(sines.dtype).repeat_interleave(cfg.hop, dim=-1)[..., None]
    std = voiced * cfg.nsf_sigma + (1 - voiced) * cfg.nsf_alpha / 3
    return cfg.nsf_alpha * sines * voiced + std * noise


class SourceNSF(nn.Module):
    """The harmonic-plus-noise source at 24 kHz (SourceModuleHnNSF2 + SineGen2): f0 [B, F] -> [B, 1, F*hop].

    Harmonic k (1..harmonics+1) has per-frame phase increment rad = (k f0 / sr) mod 1; the phase is the
    cumulative sum over frames times 2 pi, linearly upsampled (align_corners=False) after scaling by hop,
    so it is held constant over the first and last half frame.
    SineGen2 computes rad at the sample rate from the nearest-upsampled f0, adds a random initial phase
    to sample 0 only and linearly downsamples by 1/hop: those taps read samples hop*i + hop/2 -/+ 0.5 of
    constant frames, so the result is the per-frame rad computed here and, for hop >= 3, the random
    initial phase never reaches the output. Voiced (f0 > threshold) samples get alpha * sin + N(0, sigma);
    unvoiced ones N(0, alpha/3). `l_linear` merges the harmonics, then tanh."""

    def __init__(self, cfg: HiftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.harmonics + 1, 1)

    def sines(self, f0: Tensor, generator: torch.Generator) -> Tensor:
        """f0 [B, F] (Hz) -> the excitation before merging, [B, F*hop, harmonics+1]."""
        cfg, hop = self.cfg, self.cfg.hop
        k = torch.arange(1, cfg.harmonics + 2, device=f0.device, dtype=f0.dtype)
        rad = (f0[:, :, None] * k / cfg.sampling_rate) % 1  # [B, F, H+1]
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * hop, scale_factor=hop, mode="linear").transpose(1, 2)
        # Draw as SineGen2 does, so that a seed gives the official noise: first its initial phases [B, H+1]
        # (inert, see above), then randn_like of its sines, a [B, T, H+1] view of [B, H+1, T] memory; the
        # strided fill takes a different path from a contiguous randn, hence normal_ on the same view.
        b, t, h = phase.shape
        dev = generator.device
        torch.rand(b, h, generator=generator, device=dev)
        noise = torch.empty(b, h, t, device=dev, dtype=phase.dtype).transpose(1, 2).normal_(generator=generator)
        return excitation(torch.sin(phase), f0, noise.to(phase.device), cfg)

    def forward(self, f0: Tensor, generator: torch.Generator) -> Tensor:
        return torch.tanh(self.l_linear(self.sines(f0, generator))).transpose(1, 2)


class HiFT(nn.Module):
    """HiFTGenerator (inference): forward(mel [B, mels, F], cache_source) -> (pcm [B, F*hop], source [B, 1, F*hop])."""

    def __init__(self, cfg: HiftConfig) -> None:
        super().__init__()
        if cfg.sampling_rate == 22050:
            raise ValueError("22.05 kHz HiFT uses the older SourceModuleHnNSF/SineGen, which is not implemented")
        if len(cfg.upsample_rates) != len(cfg.source_resblock_kernels):
            raise ValueError("one source fusion branch per upsampling stage")
        self.cfg = cfg
        n_fft, c = cfg.istft_n_fft, cfg.base_channels
        self.m_source = SourceNSF(cfg)
        self.conv_pre = nn.Conv1d(cfg.mel, c, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(c >> i, c >> (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernels, strict=True))
        )
        # The source's STFT (hop istft_hop) is strided down to each stage's rate: stage i keeps
        # prod(upsample_rates[i+1:]) STFT frames per output frame.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (k, d) in enumerate(zip(cfg.source_resblock_kernels, cfg.source_resblock_dilations, strict=True)):
            s = math.prod(cfg.upsample_rates[i + 1 :])
            ch = c >> (i + 1)
            conv = nn.Conv1d(n_fft + 2, ch, 1) if s == 1 else nn.Conv1d(n_fft + 2, ch, 2 * s, s, padding=s // 2)
            self.source_downs.append(conv)
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(c >> (i + 1), k, d)
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernels, cfg.resblock_dilations, strict=True)
        )
        self.conv_post = nn.Conv1d(c >> len(cfg.upsample_rates), n_fft + 2, 7, padding=3)
        self.f0_predictor = F0Predictor(cfg.mel, cfg.f0_channels)
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)  # periodic, as scipy's fftbins=True
        self.fused = False

    def fuse(self, on: bool = True) -> None:
        """The network (`decode`) channels-last, each ResBlock step's Snakes and elementwise work in Triton
        kernels (on CUDA, or Triton's interpreter); or torch's ops over [B, C, T]. The F0 predictor stays."""
        self.fused = on
        for name, m in self.named_modules():
            if isinstance(m, ResBlock):
                m.fused = on
            if isinstance(m, nn.Conv1d | nn.ConvTranspose1d) and not name.startswith("f0_predictor"):
                m.weight.data = channels_last(m.weight.data, on)

    def convs_to(self, dtype: torch.dtype) -> None:
        """The network's convolutions (weights, biases, inputs and outputs) in `dtype`: float32, or float16,
        which halves their bytes and doubles tensor-core rates. Everything between them stays float32 (the
        bias adds, Snakes and residual sums, in the kernels or torch), as do the F0 predictor and conv_post,
        whose output goes to exp and sin: at the true shape fp16 so moved the PCM 60.7 dB from float32's,
        TF32 (as CUDA serves float32) 62.1 (docs/levers.md, "CPU HiFT fp16")."""
        for name, m in self.named_modules():
            if isinstance(m, nn.Conv1d | nn.ConvTranspose1d) and not name.startswith(("f0_predictor", "conv_post")):
                m.to(dtype)  # keeps a channels-last weight's layout

    def snr_to_float32(self, mel: Tensor) -> float:
        """This HiFT's PCM of mel [mels, F] against a float32 copy's (`convs_to`), in dB: where its convolutions
        run in float16, how far they move it (an activation past fp16's range, 65,504, makes it inf or NaN)."""
        ref = copy.deepcopy(self)
        ref.convs_to(torch.float32)
        m = mel[None].to(self.conv_pre.weight.device, torch.float32)
        with torch.no_grad():
            source = ref.source(m)
            want, got = ref.decode(m, source), self.decode(m, source)
        return (10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum())).item()

    def source(self, mel: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """mel [B, mels, F] -> the NSF source [B, 1, F*hop]."""
        if generator is None:
            generator = torch.Generator(mel.device).manual_seed(DEFAULT_SEED)
        return self.m_source(self.f0_predictor(mel), generator)

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel [B, mels, F] + source [B, 1, F*hop] -> PCM [B, F*hop], within +-audio_limit."""
        cfg, n_fft = self.cfg, self.cfg.istft_n_fft
        spec = torch.stft(source[:, 0], n_fft, cfg.istft_hop, n_fft, self.window, return_complex=True)
        s = torch.cat([spec.real, spec.imag], dim=1)  # [B, n_fft + 2, T/istft_hop + 1]
        if self.fused:  # [B, C, 1, T] channels-last
            s, mel = rows(s), rows(mel)
        x = conv(self.conv_pre, mel)
        n = len(cfg.resblock_kernels)
        for i, up in enumerate(self.ups):
            x = conv(up, F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:  # one more frame, to match the STFT's T/hop + 1
                x = F.pad(x.flatten(2), (1, 0), mode="reflect")
                x = rows(x) if self.fused else x
            x = x + self.source_resblocks[i](conv(self.source_downs[i], s))
            # the blocks' mean; sum() would add 0 to the first, one more pass over it
            x = reduce(torch.add, (block(x) for block in self.resblocks[i * n : (i + 1) * n])) / n
        x = conv(self.conv_post, F.leaky_relu(x)).flatten(2)  # default slope 0.01 here, as in the official code
        magnitude = torch.exp(x[:, : n_fft // 2 + 1]).clamp(max=1e2)
        phase = torch.sin(x[:, n_fft // 2 + 1 :])
        pcm = istft(torch.polar(magnitude, phase), cfg.istft_hop, self.window)
        return pcm.clamp(-cfg.audio_limit, cfg.audio_limit)

    def forward(
        self, mel: Tensor, cache_source: Tensor | None = None, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """mel [B, mels, F] -> (pcm [B, F*hop], source [B, 1, F*hop]). `cache_source` [B, 1, S] (the previous
        call's source tail, S <= F*hop) overwrites the head of the source, so that a streamed chunk's
        excitation continues the last one's."""
        s = self.source(mel, generator)
        if cache_source is not None and cache_source.shape[-1]:
            s = torch.cat([cache_source.to(s), s[:, :, cache_source.shape[-1] :]], dim=-1)
        return self.decode(mel, s), s


def istft(spec: Tensor, hop: int, window: Tensor) -> Tensor:
    """torch.istft(spec, n_fft, hop, window=window) (centred, onesided, win_length n_fft) for spec [B,
    n_fft/2+1, T] -> [B, hop * (T - 1)], with no host synchronisation, so that a CUDA graph can hold
    it: torch.istft checks the window's overlap on the host. The window's squared overlap-add, which
    the frames are divided by, is made from the window alone; this one's (a Hann window, hop n_fft/4)
    is never near zero inside the trimmed span."""
    n_fft, frames = window.numel(), spec.shape[-1]
    length = n_fft + hop * (frames - 1)

    def overlap_add(x: Tensor) -> Tensor:  # [B, n_fft, T] -> [B, length]
        return F.fold(x, (1, length), (1, n_fft), stride=(1, hop)).reshape(x.shape[0], length)

    x = torch.fft.irfft(spec, n=n_fft, dim=1) * window[:, None]
    envelope = overlap_add((window**2)[None, :, None].expand(1, n_fft, frames))
    half = n_fft // 2
    return overlap_add(x)[:, half : length - half] / envelope[:, half : length - half]


def fold_weight_norm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Replace weight-norm pairs by plain weights: `X.weight_g` + `X.weight_v` (torch.nn.utils.weight_norm) or
    `X.parametrizations.weight.original0` + `.original1` (torch.nn.utils.parametrizations.weight_norm) ->
    `X.weight` = g * v / ||v||, the norm over every dim where g has size 1. Both APIs default to dim=0 for
    every module, which for ConvTranspose1d (weight [in, out, k]) is the input channel, so g is [in, 1, 1]
    there and [out, 1, 1] for Conv1d; reading the dims off g's shape covers both. Other keys pass through."""
    pairs = {"weight_g": "weight_v", "parametrizations.weight.original0": "parametrizations.weight.original1"}

    def split(key: str, suffixes: Iterable[str]) -> tuple[str, str] | None:  # -> (module prefix with its dot, suffix)
        return next(((key[: -len(s)], s) for s in suffixes if key == s or key.endswith("." + s)), None)

    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if split(key, pairs.values()):
            continue  # consumed with its g
        if (found := split(key, pairs)) is None:
            out[key] = value
            continue
        prefix, g_suffix = found
        g, v = value.float(), state[prefix + pairs[g_suffix]]
        dims = [d for d in range(v.dim()) if g.dim() == 0 or g.shape[d] == 1]
        out[prefix + "weight"] = (v.float() * (g / v.float().norm(dim=dims, keepdim=True))).to(v.dtype)
    return out


def hift_state_dict(checkpoint: dict[str, Tensor]) -> dict[str, Tensor]:
    """The official `hift.pt` -> a state dict for `HiFT`: the `generator.` prefix dropped (CosyVoice's loader does
    the same, for HiFi-GAN-style checkpoints), weight norm folded."""
    return fold_weight_norm({k.replace("generator.", ""): v for k, v in checkpoint.items()})
