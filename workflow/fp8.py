"""FP8 E4M3 per-tensor arithmetic, shared by calibration (writing) and the engines (reading).

A tensor x with calibrated amax is stored as fp8(x / s) with s = amax / 448, and read back as
fp8 * s (FACTS.md sections 3 and 4): the same rounding modelopt's fake quantization applies.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def scale_of(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scaling factor, float32 shape (1,): amax / 448."""
    return (torch.as_tensor(amax, dtype=torch.float32).reshape(1) / FP8_MAX).clamp_min(1e-12)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to float8_e4m3fn, saturating at +-448 (a plain cast would give NaN)."""
    return (x.float() / scale.to(x.device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.to(q.device)).to(dtype)


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round x through FP8 and back, in x's dtype: the exact value an FP8 matmul sees."""
    return dequantize(quantize(x, scale), scale, x.dtype)
