"""The estimator's pass in fewer kernels: the function `CausalConditionalDecoder.forward` computes (the
official structure, which stays the baseline and the reference), for the decoder's own solves.

Why: at the true shape one pass is ~1,300 small kernels, so an ODE step is bound by their number at
batch 1 (even from a CUDA graph) and by the elementwise ones' memory traffic at batch 32. Here:

- activations stay [B, T, C], time-major, through the whole U-Net: LayerNorm over channels and the
  attention blocks read them as they are, with no transposed copies;
- a causal convolution (k = 3) is one GEMM: each frame's window of k frames, [B, T, k * C_in], against
  the weight viewed [C_out, C_in * k]; a 1x1 convolution is a Linear;
- the frame mask multiplies the output only. The official code multiplies before and after every
  block, which changes padded frames only: rows must be right-padded (each row's valid frames first,
  as every caller here makes them), convolutions look left and attention reads valid keys only, so a
  padded frame never reaches a valid one;
- the attention mask is made once a pass, additive in the activations' dtype and its rows aligned
  for the memory-efficient kernel (a boolean mask is converted, and an unaligned one padded, by every
  attention call);
- the time embedding's Mish, the first op of every resnet's time MLP, runs once, and every resnet's
  time input (its time MLP) comes from `time_inputs`: a solve makes every ODE step's at once, since
  they depend on the step's time alone (solver.solve), ~24 kernels a step fewer.

On an H100 that is 885 kernels a step, 717 with the blocks compiled, against 1,287 (docs/levers.md,
"H100 codec 3").

Weights are read from the module at each call (nothing derived is kept), so loading or casting the
estimator needs nothing redone. A `Past` made here keeps its convolutions' frames time-major: a past is
used by the pass that made it (CodecDecoder runs one or the other)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workflow.codec.estimator import (
    CausalBlock1D,
    CausalConditionalDecoder,
    CausalConv1d,
    CausalResnetBlock1D,
    Past,
    attention_mask,
)

ALIGN = 8  # elements: the memory-efficient attention kernel's alignment of its mask's rows
COMPILES = 64  # compiled versions kept per block function (torch's default, 8, is fewer than serving's shapes)


class Tails(Protocol):
    """Where a causal convolution's left context comes from and goes: a `Past`, or a call's view of the
    flow slots (slots.py)."""

    def tail(self, conv: nn.Module, x: Tensor) -> Tensor: ...
    def keep(self, conv: nn.Module, x: Tensor) -> None: ...


def conv(c: nn.Conv1d, x: Tensor, past: Tails | None = None) -> Tensor:
    """A Conv1d (causal: left context from `past`, or zeros at the sequence start) over x [B, T, C_in]
    -> [B, T, C_out]."""
    k = c.kernel_size[0]
    if k == 1:
        return F.linear(x, c.weight[:, :, 0], c.bias)
    if not isinstance(c, CausalConv1d):
        raise TypeError(f"only causal convolutions run time-major here, not {type(c).__name__}")
    if past is None:
        x = F.pad(x, (0, 0, c.left, 0))
    else:
        x = torch.cat([past.tail(c, x), x], dim=1)
        past.keep(c, x)
    return windowed(c, x)


def windowed(c: nn.Conv1d, x: Tensor) -> Tensor:
    """A causal convolution over x [B, left + T, C_in], its first `left` frames the left context -> [B, T, C_out]."""
    windows = x.unfold(1, c.kernel_size[0], 1)  # [B, T, C_in, k]: frame t's window, t - left .. t
    return F.linear(windows.reshape(*windows.shape[:2], -1), c.weight.flatten(1), c.bias)


def block(b: CausalBlock1D, x: Tensor, past: Tails | None) -> Tensor:
    """Causal conv -> LayerNorm over channels -> Mish, [B, T, C]."""
    c, _, norm = b.block
    return F.mish(norm(conv(c, x, past)))


def resnet(r: CausalResnetBlock1D, x: Tensor, time: Tensor, past: Tails | None) -> Tensor:
    """time: the resnet's time input [B or 1, C] (`CausalConditionalDecoder.resnet_times`)."""
    h = block(r.block1, x, past) + time[:, None]
    return block(r.block2, h, past) + conv(r.res_conv, x)


def attention_bias(mask: Tensor, chunk_frames: int, start: int, dtype: torch.dtype) -> Tensor:
    """`attention_mask` as SDPA's additive mask [B, 1, T, keys]: 0 where a query may attend, -inf
    elsewhere, each row's start aligned (the tensor is a slice of a wider one)."""
    allowed = attention_mask(mask, chunk_frames, start)
    keys = allowed.shape[-1]
    bias = allowed.new_zeros(*allowed.shape[:2], -(-keys // ALIGN) * ALIGN, dtype=dtype)[..., :keys]
    return bias.masked_fill_(~allowed, float("-inf"))[:, None]


def transformer(b: nn.Module, h: Tensor, bias: Tensor, past: Past | None = None) -> Tensor:
    """One transformer block over [B, T, C], `bias` [B, 1, T, keys] (its official forward)."""
    return b(h, bias[:, 0], past)


def compile_block(fn: Callable) -> Callable:
    """fn through torch.compile with dynamic shapes. A block is still compiled once per input channel
    count, and again where a row count of 1 or 2 specializes (2 also equals a convolution's left
    context): the three resnet kinds at serving's row counts need 9 versions. Past torch's default
    limit of 8 a new shape runs eager, silently, so up to COMPILES are kept."""
    return torch._dynamo.config.patch(recompile_limit=COMPILES)(torch.compile(fn, dynamic=True))


class FastEstimator:
    """Called like the estimator (solver.Estimator), with the same result: see the module docstring.

    compiled: each resnet and transformer block through torch.compile (dynamic shapes, so one compile
    serves every batch and length; the blocks' weights are its inputs, so one compile serves every
    block of a kind), which fuses the elementwise work around the GEMMs. Passes against a `Past` run
    eager (it is written as they go)."""

    def __init__(self, est: CausalConditionalDecoder, compiled: bool = False) -> None:
        self.est = est  # wrapped here, not at import: importing torch.compile's machinery costs seconds
        self.blocks = (compile_block(resnet), compile_block(transformer)) if compiled else None

    @property
    def compiled(self) -> bool:
        return self.blocks is not None

    def __call__(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor | None = None,
        cond: Tensor | None = None,
        streaming: bool = False,
        past: Past | None = None,
        times: Sequence[Tensor] | None = None,
    ) -> Tensor:
        """x, mu, cond [B, 80, T]; mask [B, 1, T], right-padded; t [B]; spks [B, 80] -> velocity [B, 80, T].
        times: the resnets' time inputs at t, made ahead (`time_inputs`: a solve makes every step's at once)."""
        est = self.est
        parts = est.inputs(x, mu, spks, cond, streaming, past)
        h = torch.cat([p.transpose(1, 2) for p in parts], dim=2)  # [B, T, in_channels]
        bias = attention_bias(mask, est.chunk_frames if streaming else 0, past.frames if past else 0, h.dtype)
        res, tb = self.blocks if self.blocks is not None and past is None else (resnet, transformer)
        out = self.unet(h, est.resnet_times(t) if times is None else times, bias, past, res, tb)
        if past is not None:
            past.frames += x.shape[-1]
        return out.transpose(1, 2) * mask

    def time_inputs(self, t: Tensor) -> list[Tensor]:
        """The resnets' time inputs at times t [N] (`CausalConditionalDecoder.resnet_times`)."""
        return self.est.resnet_times(t)

    def unet(self, h: Tensor, times: Sequence[Tensor], bias: Tensor, past: Tails | None, res: Callable, tb: Callable) -> Tensor:
        """The U-Net over h [B, T, in_channels] (times: each resnet's time input, in the order met) ->
        [B, T, 80], its resnets and transformer blocks run by `res` and `tb`, each given `past` as it is."""
        est, time = self.est, iter(times)

        def attend(h: Tensor, blocks: nn.ModuleList) -> Tensor:
            for b in blocks:
                h = tb(b, h, bias, past)
            return h

        skips = []
        for r, blocks, down in est.down_blocks:
            h = attend(res(r, h, next(time), past), blocks)
            skips.append(h)
            h = conv(down, h, past)
        for r, blocks in est.mid_blocks:
            h = attend(res(r, h, next(time), past), blocks)
        for r, blocks, up in est.up_blocks:
            skip = skips.pop()
            h = torch.cat([h[:, : skip.shape[1]], skip], dim=2)
            h = conv(up, attend(res(r, h, next(time), past), blocks), past)
        return conv(est.final_proj, block(est.final_block, h, past))
