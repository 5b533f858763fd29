"""Conditional flow matching at inference: CosyVoice2's `CausalConditionalCFM` (docs/codec.md, "Confirmed").

    z   = noise[:, :, :T]          a FIXED buffer [1, 80, noise_frames] drawn once from seed noise_seed, so
                                   a frame's starting noise is the same whatever the length or the call
    t   = 1 - cos(linspace(0, 1, steps + 1) * pi / 2)                    (cosine schedule)
    x  += dt * v,  dt = t[k+1] - t[k]                                    (Euler)
    v   = (1 + cfg_rate) * v(x | mu, spks, cond) - cfg_rate * v(x | 0, 0, 0)   (classifier-free guidance,
                                   both halves in one estimator call of batch 2B)

The buffer is drawn from a private `torch.Generator`, never the global RNG; a CPU generator seeded s gives
the same numbers as `torch.manual_seed(s); torch.randn(...)`, which is how the official constructor makes it."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from workflow.codec.config import SolverConfig

if TYPE_CHECKING:
    from workflow.codec.estimator import Past

MEL = 80  # the official buffer is 80 bands; the estimator's x/mu/cond width


class Estimator(Protocol):
    def __call__(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        past: Past | None = None,
    ) -> Tensor: ...


class FixedNoise:
    """The flow's starting noise: one [1, mel, frames] standard normal buffer, fixed by its seed."""

    def __init__(self, frames: int, seed: int, mel: int = MEL) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.seed = seed
        self.buffer = torch.randn(1, mel, frames, generator=gen)

    @classmethod
    def for_config(cls, cfg: SolverConfig, mel: int = MEL) -> FixedNoise:
        return _cached_noise(cfg.noise_frames, cfg.noise_seed, mel)

    @property
    def frames(self) -> int:
        return self.buffer.shape[-1]

    def take(
        self, frames: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None, start: int = 0
    ) -> Tensor:
        """Frames start .. start + frames, [1, mel, frames]; past the buffer's end is an error (the official
        buffer caps prompt + output at 15000 frames, 300 s)."""
        if start + frames > self.frames:
            raise ValueError(f"{start + frames} mel frames exceed the fixed noise buffer ({self.frames} frames)")
        return self.buffer[:, :, start : start + frames].to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=4)
def _cached_noise(frames: int, seed: int, mel: int) -> FixedNoise:
    return FixedNoise(frames, seed, mel)


def cosine_schedule(steps: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The steps + 1 ODE times, 0 to 1, denser near 0: 1 - cos(linspace(0, 1, steps + 1) * pi / 2)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return 1 - torch.cos(torch.linspace(0, 1, steps + 1, device=device, dtype=dtype) * 0.5 * math.pi)


def solve(
    estimator: Estimator,
    mu: Tensor,
    mask: Tensor,
    spks: Tensor,
    cond: Tensor,
    cfg: SolverConfig,
    streaming: bool = False,
    noise: FixedNoise | None = None,
    past: Sequence[Past] | Sequence[object] | None = None,
    x0: Tensor | None = None,
) -> Tensor:
    """Integrate the flow from the fixed noise to a mel: mu, cond [B, 80, T]; mask [B, 1, T]; spks [B, 80]
    -> mel [B, 80, T] float32. Every batch row starts from the same noise frames (as the official code).
    With `past` (one per step: each step's estimator pass sees other x), the T frames follow its frames.
    x0: the starting noise [B, 80, T] when the rows start at different frames (slots.py), else taken here.
    An estimator with `time_inputs` (fast.py's, slots.py's) is given every step's resnet time inputs,
    made at once before the first step (~24 kernels a step fewer); a one-step solve makes its own.
    cfg_rate 0 skips the unconditional half (its weight is 0, so the result is the same) and halves the work."""
    noise = noise if noise is not None else FixedNoise.for_config(cfg, mel=mu.shape[1])
    b, _, frames = mu.shape
    if past is not None and len(past) != cfg.steps:
        raise ValueError(f"{len(past)} pasts for {cfg.steps} ODE steps")
    if x0 is None:
        start = past[0].frames if past is not None else 0  # type: ignore[union-attr]
        x = noise.take(frames, mu.device, mu.dtype, start).expand(b, -1, -1)
    else:
        x = x0
    t_span = cosine_schedule(cfg.steps, mu.device, mu.dtype)
    guided = cfg.cfg_rate != 0
    if guided:  # batch 2B: rows [0, B) conditioned, rows [B, 2B) with mu, spks and cond zeroed
        mask_in = torch.cat([mask, mask])
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
    else:
        mask_in, mu_in, spks_in, cond_in = mask, mu, spks, cond
    # t advances by dt and the next dt is measured from it, as the official loop does
    t, dt, times = t_span[0], t_span[1] - t_span[0], []
    for step in range(1, cfg.steps + 1):
        times.append((t, dt))
        t = t + dt
        if step < cfg.steps:
            dt = t_span[step + 1] - t
    # an estimator that offers it takes every step's time inputs made at once: they depend on t alone
    ahead = getattr(estimator, "time_inputs", None) if cfg.steps > 1 else None
    table = ahead(torch.stack([t for t, _ in times])) if ahead is not None else None
    for step, (t, dt) in enumerate(times):
        x_in = torch.cat([x, x]) if guided else x
        kw = {"past": past[step]} if past is not None else {}  # an estimator without a past is called as before
        if table is not None:
            kw["times"] = [row[step : step + 1] for row in table]
        v = estimator(x_in, mask_in, mu_in, t.expand(x_in.shape[0]), spks_in, cond_in, streaming=streaming, **kw)
        if guided:
            v_cond, v_uncond = v[:b], v[b:]
            v = (1.0 + cfg.cfg_rate) * v_cond - cfg.cfg_rate * v_uncond
        x = x + dt * v
    return x.float()


class FlowSolver:
    """`solve` bound to a config and its noise buffer (made once)."""

    def __init__(self, cfg: SolverConfig, mel: int = MEL) -> None:
        self.cfg = cfg
        self.noise = FixedNoise(cfg.noise_frames, cfg.noise_seed, mel)

    def __call__(
        self, estimator: Estimator, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, streaming: bool = False
    ) -> Tensor:
        return solve(estimator, mu, mask, spks, cond, self.cfg, streaming=streaming, noise=self.noise)
