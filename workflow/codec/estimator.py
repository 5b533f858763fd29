"""The flow's velocity estimator: CosyVoice2's `CausalConditionalDecoder`, a causal 1-D U-Net (docs/codec.md).

Shape, from `EstimatorConfig` (true shape: C = 256, 4 blocks a level, 12 mid levels, 8 x 64 heads):

    [x | mu | spks (broadcast over time) | cond]  (4 x 80 = 320 channels)
    down:  CausalResnetBlock1D(320 -> C) + `blocks` transformer blocks + CausalConv1d(C, C, 3)   -> skip
    mid:   `mid_blocks` x (CausalResnetBlock1D(C -> C) + `blocks` transformer blocks)
    up:    concat(x, skip) -> CausalResnetBlock1D(2C -> C) + `blocks` transformer blocks + CausalConv1d(C, C, 3)
    out:   CausalBlock1D(C -> C) + Conv1d(C -> 80, 1)

With one U-Net level the "downsample" and "upsample" are stride-1 causal convolutions (the official code
uses them on its last level), so every part runs at the mel frame rate. Every resnet block adds the time
embedding: sinusoidal(in_channels) -> Linear -> SiLU -> Linear (4 x C). Attention is full over the valid
frames offline; streaming, each frame sees every earlier chunk and its own chunk of `chunk_frames` frames.
Convolutions only look left, so with the chunk mask an output frame never depends on a later chunk.

That makes a stream's earlier frames final, so a call need not run them again: given a `Past` (what one
pass saw of the frames before it: each causal convolution's last two input frames, each attention's keys
and values), `forward` runs only the new frames against it and extends it (docs/codec.md, "The flow cache").

Module and parameter names follow the official ones, so `state_dict()` keys are the checkpoint's keys
below `decoder.estimator.` (e.g. `mid_blocks.0.1.0.attn1.to_q.weight`); `load_flow_state` loads them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workflow.codec.config import CodecConfig, EstimatorConfig

PREFIX = "decoder.estimator."  # where the estimator's tensors sit in the official flow.pt


@dataclass
class Past:
    """One estimator pass's view of the `frames` frames before a call, by module: each causal
    convolution's last kernel - 1 input frames, each attention's keys and values [B, heads, frames, d].
    A call extends it with its own frames; the entries are replaced, never written in place, so a
    copy (one voice prompt's past, shared by its streams) stays as it was."""

    frames: int = 0
    convs: dict[nn.Module, Tensor] = field(default_factory=dict)
    keys: dict[nn.Module, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def copy(self) -> Past:
        return Past(self.frames, dict(self.convs), dict(self.keys))

    def tail(self, conv: nn.Module, x: Tensor) -> Tensor:
        """The `left` input frames before x's [B, T, C] (time-major, as fast.py runs): zeros at the start."""
        before = self.convs.get(conv)
        return x.new_zeros(x.shape[0], conv.left, x.shape[2]) if before is None else before

    def keep(self, conv: nn.Module, x: Tensor) -> None:
        """After a time-major convolution over x [B, left + T, C] (its tail, then its frames): the last `left`."""
        self.convs[conv] = x[:, -conv.left :]

    def nbytes(self) -> int:
        tensors = [*self.convs.values(), *(t for kv in self.keys.values() for t in kv)]
        return sum(t.numel() * t.element_size() for t in tensors)


class CausalConv1d(nn.Conv1d):
    """Conv1d padded with kernel_size - 1 zeros on the left only: output frame i sees input frames <= i.
    With a `past`, the frames before come from it instead of the zeros (which stand for the sequence start)."""

    def __init__(self, cin: int, cout: int, kernel_size: int) -> None:
        super().__init__(cin, cout, kernel_size)
        self.left = kernel_size - 1

    def forward(self, x: Tensor, past: Past | None = None) -> Tensor:
        if past is None:
            return super().forward(F.pad(x, (self.left, 0)))
        before = past.convs.get(self)
        x = torch.cat([x.new_zeros(*x.shape[:2], self.left) if before is None else before, x], dim=-1)
        past.convs[self] = x[..., -self.left :]
        return super().forward(x)


class CausalBlock1D(nn.Module):
    """Causal conv k3 -> LayerNorm over channels -> Mish, on masked input and output.

    `block` is indexed like the official Sequential (0: conv, 1: a transpose, 2: the LayerNorm), so the
    weights are `block.0.*` and `block.2.*`; slot 1 holds no parameters."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([CausalConv1d(cin, cout, 3), nn.Identity(), nn.LayerNorm(cout)])

    def forward(self, x: Tensor, mask: Tensor, past: Past | None = None) -> Tensor:
        conv, _, norm = self.block
        h = conv(x * mask, past)
        h = norm(h.transpose(1, 2)).transpose(1, 2)
        return F.mish(h) * mask


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with the time embedding added between them, plus a 1x1 residual projection."""

    def __init__(self, cin: int, cout: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, cout))  # weights: mlp.1.*
        self.block1 = CausalBlock1D(cin, cout)
        self.block2 = CausalBlock1D(cout, cout)
        self.res_conv = nn.Conv1d(cin, cout, 1)

    def forward(self, x: Tensor, mask: Tensor, temb: Tensor, past: Past | None = None) -> Tensor:
        h = self.block1(x, mask, past) + self.mlp(temb).unsqueeze(-1)
        h = self.block2(h, mask, past)
        return h + self.res_conv(x * mask)


class Attention(nn.Module):
    """Multi-head self-attention. q, k and v come from one GEMM (`qkv`, the three weights stacked); the
    state dict holds diffusers' names (to_q/to_k/to_v without bias, to_out.0 with), split and joined by hooks."""

    PARTS = ("to_q", "to_k", "to_v")

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # (diffusers' to_out.1 is a parameter-free dropout)
        self._register_state_dict_hook(Attention._split)
        self._register_load_state_dict_pre_hook(Attention._join)

    @staticmethod
    def _split(module: nn.Module, state: dict, prefix: str, _meta: object) -> None:
        for name, part in zip(Attention.PARTS, state.pop(prefix + "qkv.weight").chunk(3), strict=True):
            state[prefix + name + ".weight"] = part

    @staticmethod
    def _join(state: dict, prefix: str, *_: object) -> None:
        names = [prefix + name + ".weight" for name in Attention.PARTS]
        if all(n in state for n in names):  # else strict loading reports qkv.weight missing
            state[prefix + "qkv.weight"] = torch.cat([state.pop(n) for n in names])

    def forward(self, x: Tensor, allowed: Tensor, past: Past | None = None) -> Tensor:
        """x [B, T, dim]; allowed [B, T, keys], True (or an additive 0) where query row may attend to key
        column; the keys are the past's frames (if any), then x's."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if past is not None:
            if self in past.keys:
                k, v = (torch.cat([old, new], dim=2) for old, new in zip(past.keys[self], (k, v), strict=True))
            past.keys[self] = (k.contiguous(), v.contiguous())  # not views of the qkv output, 3x their size
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        return self.to_out[0](y.transpose(1, 2).reshape(b, t, -1))


class GeluProj(nn.Module):
    """Linear then exact GELU (diffusers' `GELU` activation module, weights `proj.*`)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """dim -> 4 dim (GELU) -> dim; `net` is indexed like the official one (0: proj + gelu, 1: dropout, 2: out)."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    """Matcha/diffusers BasicTransformerBlock as used here: pre-norm self-attention and GELU feed-forward
    (no cross-attention, so no norm2/attn2; the timestep argument is unused by layer_norm blocks)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, allowed: Tensor, past: Past | None = None) -> Tensor:
        x = x + self.attn1(self.norm1(x), allowed, past)
        return x + self.ff(self.norm3(x))


class TimestepEmbedding(nn.Module):
    """Linear -> SiLU -> Linear over the sinusoidal embedding of t."""

    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """Matcha's SinusoidalPosEmb: [sin | cos] of scale * t * 10000^(-i / (dim/2 - 1)), i < dim/2. t [B] -> [B, dim]."""
    if dim % 2:
        raise ValueError(f"the time embedding width must be even, got {dim}")
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    arg = scale * t.reshape(-1, 1).float() * freqs
    return torch.cat([arg.sin(), arg.cos()], dim=-1).to(t.dtype)


def attention_mask(mask: Tensor, chunk_frames: int = 0, start: int = 0) -> Tensor:
    """Which keys each query may attend to: [B, 1, T] frame mask of the queries, frames start .. start + T
    (the `start` frames before them are valid keys too) -> [B, T, start + T] bool.

    chunk_frames 0: every valid frame (offline). chunk_frames n > 0: key j is visible from query i when
    j < (i // n + 1) * n, i.e. all left chunks and the query's own chunk (num_decoding_left_chunks -1).
    A row with nothing visible (a padded query) is opened fully, as the official mask helper does; such
    frames are zeroed by the frame mask afterwards, this only keeps the softmax finite."""
    valid = mask.bool()
    if start:
        valid = torch.cat([valid.new_ones(valid.shape[0], 1, start), valid], dim=-1)
    t = mask.shape[-1]
    allowed = valid.expand(-1, t, -1)
    if chunk_frames > 0:
        keys = torch.arange(start + t, device=mask.device)
        chunk_end = ((keys[start:] // chunk_frames) + 1) * chunk_frames
        allowed = allowed & (keys.unsqueeze(0) < chunk_end.unsqueeze(1))
    return allowed | ~allowed.any(dim=-1, keepdim=True)


class CausalConditionalDecoder(nn.Module):
    """The velocity estimator v(x, t | mu, spks, cond); `chunk_frames` is the streaming chunk in mel frames
    (the official `static_chunk_size`: chunk codes x token_mel_ratio, 20 for flow-chunk-5)."""

    def __init__(self, cfg: EstimatorConfig, chunk_frames: int = 0) -> None:
        super().__init__()
        c, time_dim = cfg.channels, 4 * cfg.channels
        self.cfg = cfg
        self.chunk_frames = chunk_frames

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(c, cfg.heads, cfg.head_dim) for _ in range(cfg.blocks))

        self.time_mlp = TimestepEmbedding(cfg.in_channels, time_dim)
        # each level is a ModuleList so the keys read down_blocks.0.{0: resnet, 1.i: transformer i, 2: conv}
        self.down_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(cfg.in_channels, c, time_dim), transformers(), CausalConv1d(c, c, 3)])]
        )
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(c, c, time_dim), transformers()]) for _ in range(cfg.mid_blocks)
        )
        self.up_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(2 * c, c, time_dim), transformers(), CausalConv1d(c, c, 3)])]
        )
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = nn.Conv1d(c, cfg.out_channels, 1)

    @classmethod
    def from_codec(cls, cfg: CodecConfig) -> CausalConditionalDecoder:
        """The estimator of a codec config: chunk_frames = chunk (codes) x encoder.stride (mel frames per code)."""
        return cls(cfg.estimator, chunk_frames=cfg.chunk * cfg.encoder.stride)

    def transformer_blocks(self) -> list[TransformerBlock]:
        return [m for m in self.modules() if isinstance(m, TransformerBlock)]

    def load_flow_state(self, flow_state: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load the estimator's tensors out of a whole flow.pt state dict (keys under `decoder.estimator.`)."""
        own = {k[len(PREFIX) :]: v for k, v in flow_state.items() if k.startswith(PREFIX)}
        self.load_state_dict(own, strict=strict)

    def inputs(
        self, x: Tensor, mu: Tensor, spks: Tensor | None, cond: Tensor | None, streaming: bool, past: Past | None
    ) -> list[Tensor]:
        """A pass's input's parts [B, C_i, T] in the order its first layer reads them (x, mu, spks
        broadcast over time, cond); a past only with chunk masks."""
        if past is not None and not (streaming and self.chunk_frames > 0):
            raise ValueError("a past needs chunk masks (streaming with a chunk-trained estimator)")
        parts = [x, mu]
        if spks is not None:
            parts.append(spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        if cond is not None:
            parts.append(cond)
        return parts

    def time_embedding(self, t: Tensor) -> Tensor:
        """t [N] -> [N, 4C]: what every resnet's time MLP reads."""
        return self.time_mlp(sinusoidal(t, self.cfg.in_channels))

    def resnets(self) -> list[CausalResnetBlock1D]:
        """The resnets in the order a pass meets them: down, mid, up."""
        return [level[0] for blocks in (self.down_blocks, self.mid_blocks, self.up_blocks) for level in blocks]

    def resnet_times(self, t: Tensor) -> list[Tensor]:
        """t [N] -> each resnet's time input [N, C] (its time MLP over the time embedding), in `resnets`
        order. The fast passes take them made ahead (fast.py, `FastEstimator.time_inputs`): a solve makes
        every ODE step's at once, since they depend on t alone."""
        temb = F.mish(self.time_embedding(t))  # the first op of every resnet's time MLP, once
        return [F.linear(temb, r.mlp[1].weight, r.mlp[1].bias) for r in self.resnets()]

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor | None = None,
        cond: Tensor | None = None,
        streaming: bool = False,
        past: Past | None = None,
    ) -> Tensor:
        """x, mu, cond [B, 80, T]; mask [B, 1, T]; t [B]; spks [B, 80] -> velocity [B, 80, T] (zero where masked).
        With a past (streaming only: offline attention would read later frames), the T frames come after its
        frames, which it supplies, and it is extended by them."""
        temb, parts = self.time_embedding(t), self.inputs(x, mu, spks, cond, streaming, past)
        h = torch.cat(parts, dim=1)
        allowed = attention_mask(mask, self.chunk_frames if streaming else 0, past.frames if past else 0)

        def attend(h: Tensor, blocks: nn.ModuleList) -> Tensor:
            h = h.transpose(1, 2)
            for block in blocks:
                h = block(h, allowed, past)
            return h.transpose(1, 2)

        skips = []
        for resnet, blocks, down in self.down_blocks:
            h = attend(resnet(h, mask, temb, past), blocks)
            skips.append(h)
            h = down(h * mask, past)
        for resnet, blocks in self.mid_blocks:
            h = attend(resnet(h, mask, temb, past), blocks)
        for resnet, blocks, up in self.up_blocks:
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
            h = attend(resnet(h, mask, temb, past), blocks)
            h = up(h * mask, past)
        h = self.final_block(h, mask, past)
        if past is not None:
            past.frames += x.shape[-1]
        return self.final_proj(h * mask) * mask
