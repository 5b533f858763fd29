"""The codec decoder's log-mel (Matcha-TTS `mel_spectrogram`; docs/codec.md, "Mel"): PCM -> [B, mels, frames].

Reflect-pad (n_fft - hop) / 2 on each side, STFT with center=False and a periodic Hann window,
magnitude sqrt(re^2 + im^2 + 1e-9), a slaney-scale, slaney-normalised mel filterbank (what
`librosa.filters.mel` builds by default), then ln(clamp(x, 1e-5)). For a length that is a multiple of
hop this gives exactly length // hop frames (24 kHz, hop 480: 50 Hz). The filterbank is computed here
in float64 (as librosa does) and stored as float32; librosa is not needed at run time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workflow.codec.config import MelConfig

# The slaney mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per factor 6.4).
F_SP = 200.0 / 3
MIN_LOG_HZ = 1000.0
MIN_LOG_MEL = MIN_LOG_HZ / F_SP  # 15
LOG_STEP = math.log(6.4) / 27.0
LOG_FLOOR = 1e-5
MAG_EPS = 1e-9


def hz_to_mel(hz: Tensor) -> Tensor:
    """Slaney mel of frequencies in Hz (librosa's hz_to_mel with htk=False)."""
    linear = hz / F_SP
    log = MIN_LOG_MEL + torch.log(torch.clamp(hz, min=MIN_LOG_HZ) / MIN_LOG_HZ) / LOG_STEP
    return torch.where(hz >= MIN_LOG_HZ, log, linear)


def mel_to_hz(mel: Tensor) -> Tensor:
    """Inverse of hz_to_mel."""
    linear = mel * F_SP
    log = MIN_LOG_HZ * torch.exp(LOG_STEP * (torch.clamp(mel, min=MIN_LOG_MEL) - MIN_LOG_MEL))
    return torch.where(mel >= MIN_LOG_MEL, log, linear)


def mel_filterbank(sampling_rate: int, n_fft: int, mels: int, fmin: float, fmax: float) -> Tensor:
    """[mels, n_fft // 2 + 1] triangles with corners evenly spaced in slaney mels from fmin to fmax, each
    scaled by 2 / (its upper corner - its lower corner) in Hz (slaney normalisation: equal area)."""
    f64 = torch.float64
    fft_hz = torch.linspace(0, sampling_rate / 2, n_fft // 2 + 1, dtype=f64)
    lo, hi = (float(hz_to_mel(torch.tensor(f, dtype=f64))) for f in (fmin, fmax))
    corners = mel_to_hz(torch.linspace(lo, hi, mels + 2, dtype=f64))  # [mels + 2]
    width = corners.diff()  # [mels + 1]
    rising = (fft_hz[None, :] - corners[:-2, None]) / width[:-1, None]
    falling = (corners[2:, None] - fft_hz[None, :]) / width[1:, None]
    tri = torch.clamp(torch.minimum(rising, falling), min=0)
    return (tri * (2.0 / (corners[2:] - corners[:-2]))[:, None]).float()


class LogMel(nn.Module):
    """PCM [B, N] or [N] (float, nominally in [-1, 1]) -> log-mel [B, mels, frames]."""

    def __init__(self, cfg: MelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or MelConfig()
        if (cfg.n_fft - cfg.hop) % 2:
            raise ValueError("n_fft - hop must be even: it is split evenly between the two sides")
        fb = mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.mels, cfg.fmin, cfg.fmax)
        self.register_buffer("filterbank", fb, persistent=False)
        self.register_buffer("window", torch.hann_window(cfg.win), persistent=False)

    def forward(self, wav: Tensor) -> Tensor:
        cfg = self.cfg
        x = wav[None] if wav.dim() == 1 else wav
        pad = (cfg.n_fft - cfg.hop) // 2
        x = F.pad(x[:, None], (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(x, cfg.n_fft, cfg.hop, cfg.win, self.window.to(x.dtype), center=False, return_complex=True)
        magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + MAG_EPS)
        return torch.log(torch.clamp(self.filterbank.to(x.dtype) @ magnitude, min=LOG_FLOOR))


def log_mel(wav: Tensor, cfg: MelConfig | None = None) -> Tensor:
    """Functional form of LogMel (builds the filterbank on each call; keep a LogMel for repeated use)."""
    return LogMel(cfg).to(wav.device)(wav)
