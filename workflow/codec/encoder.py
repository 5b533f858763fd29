"""The flow's front end: codec tokens -> mu, the 50 Hz mel-rate condition of the flow matching.

MOSS-Speech's flow is CosyVoice2's `CausalMaskedDiffWithXvec` (docs/codec.md). This is that model
minus its decoder (the CFM estimator): the token embedding, the `UpsampleConformerEncoder`,
`encoder_proj`, and the x-vector projection. Written from the facts of the official source
(OpenMOSS/MOSS-Speech @6b86ef6: `cosyvoice/flow/flow.py`, `cosyvoice/transformer/*.py`,
`cosyvoice/utils/mask.py`); the parameter names are the official ones, so the non-`decoder.`
tensors of `flow.pt` load strictly (`FlowFrontEnd.load_flow_state`).

Inference only: the official dropouts (identity in eval) are left out; they hold no weights.

Masks. Offline (chunk 0) every position attends to the whole utterance. Streaming (chunk > 0, the
static chunk masks `flow-chunk-{5,25}.pt` were trained with) a position attends to its own chunk and
everything before it: `chunk` tokens before the upsampler, `chunk * stride` frames after. Together
with the lookahead convolution this makes mu for the first k chunks a function of
`tokens[:k * chunk + lookahead]` only, which is what lets streaming re-run the flow on a growing
prefix and keep the frames it already emitted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workflow.codec.config import EncoderConfig
from workflow.engines.base import to_device

LAYER_NORM_EPS = 1e-12  # the conformer layers' norm_mha / norm_ff (official)
INPUT_NORM_EPS = 1e-5  # the linear input layers' LayerNorm and after_norm (official)


def rel_positions(length: int, dim: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """ESPnet's relative sinusoids, [2 * length - 1, dim]: row r is distance `length - 1 - r`.

    Distance i - j is positive when the key j lies left of the query i; the sign only flips the
    sines, as in EspnetRelPositionalEncoding (computed in float32, then cast)."""
    dist = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / dim))
    angle = dist * freq
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).to(dtype)


def attention_mask(lengths: Tensor, size: int, chunk: int) -> Tensor:
    """Keys each query may see, bool [B, 1 or size, size].

    chunk 0: every valid key (offline, bidirectional). chunk > 0: valid keys up to the end of the
    query's own chunk, all left chunks included (num_decoding_left_chunks -1, as trained)."""
    pos = torch.arange(size, device=lengths.device)
    valid = (pos[None, :] < lengths[:, None])[:, None, :]
    if chunk <= 0:
        return valid
    seen = pos[None, :] < (pos[:, None] // chunk + 1) * chunk
    return valid & seen[None]


class LinearInput(nn.Module):
    """ESPnet's LinearNoSubsampling with the `rel_pos_espnet` scale: Linear, LayerNorm, x sqrt(size).

    `out` keeps the official Sequential indices (0 Linear, 1 LayerNorm; the dropout at 2 has no
    weights), so the keys read `...embed.out.0.weight`."""

    def __init__(self, size: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(size, size), nn.LayerNorm(size, eps=INPUT_NORM_EPS))
        self.xscale = math.sqrt(size)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Transformer-XL self-attention with ESPnet relative positions (RelPositionMultiHeadedAttention).

    score(i, j) = ((q_i + u) . k_j + (q_i + v) . P(i - j)) / sqrt(head_dim), P = linear_pos(sinusoids)."""

    def __init__(self, size: int, heads: int):
        super().__init__()
        if size % heads:
            raise ValueError(f"size {size} is not a multiple of heads {heads}")
        self.heads, self.head_dim = heads, size // heads
        self.linear_q = nn.Linear(size, size)
        self.linear_k = nn.Linear(size, size)
        self.linear_v = nn.Linear(size, size)
        self.linear_out = nn.Linear(size, size)
        self.linear_pos = nn.Linear(size, size, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.head_dim))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        """x [B, T, C]; pos = rel_positions(T, C); mask [B, 1 or T, T] (True: may attend)."""
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        q = self.linear_q(x).view(b, t, h, d)
        k = self.linear_k(x).view(b, t, h, d).transpose(1, 2)
        v = self.linear_v(x).view(b, t, h, d).transpose(1, 2)
        p = self.linear_pos(pos).view(-1, h, d).transpose(0, 1)  # [H, 2T-1, d]: column c is distance T-1-c
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        i = torch.arange(t, device=x.device)
        column = (t - 1 - i[:, None] + i[None, :]).expand(b, h, t, t)  # distance i - j
        position = (q_v @ p.transpose(-2, -1)).gather(-1, column) / math.sqrt(d)
        bias = position.masked_fill(~mask[:, None], float("-inf"))
        out = F.scaled_dot_product_attention(q_u, k, v, attn_mask=bias)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, h * d))


class FeedForward(nn.Module):
    """PositionwiseFeedForward with the encoder's default activation (swish: the yaml sets none)."""

    def __init__(self, size: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """ConformerEncoderLayer as configured: pre-norm attention then pre-norm feed-forward.

    No macaron feed-forward and no convolution module (so no norm_conv / norm_final)."""

    def __init__(self, size: int, heads: int, hidden: int):
        super().__init__()
        self.self_attn = RelPositionAttention(size, heads)
        self.feed_forward = FeedForward(size, hidden)
        self.norm_ff = nn.LayerNorm(size, eps=LAYER_NORM_EPS)
        self.norm_mha = nn.LayerNorm(size, eps=LAYER_NORM_EPS)

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos, mask)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Gives each token a look at the next `lookahead` tokens before the chunk-masked conformer.

    conv1 (kernel lookahead + 1) reads ahead, leaky ReLU, conv2 (kernel 3) is causal, residual.
    What lies ahead of the last token is the real next tokens when given (`context`, streaming),
    else zeros (the end of the utterance). Padded positions count as zeros too, so a padded row
    of a batch gives what it gives alone (the official code runs batch 1 only)."""

    def __init__(self, size: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(size, size, lookahead + 1)
        self.conv2 = nn.Conv1d(size, size, 3)

    def forward(self, x: Tensor, lengths: Tensor, context: Tensor | None = None) -> Tensor:
        """x [B, T, C]; context [B, lookahead, C], the tokens right after each row's `lengths`."""
        b, t, c = x.shape
        valid = torch.arange(t, device=x.device)[None, :] < lengths[:, None]
        ahead = x.new_zeros(b, t + self.lookahead, c)
        ahead[:, :t] = x * valid[..., None]
        if context is not None:
            rows = torch.arange(b, device=x.device)[:, None]
            ahead[rows, lengths[:, None] + torch.arange(self.lookahead, device=x.device)] = context
        y = F.leaky_relu(self.conv1(ahead.transpose(1, 2)))
        y = self.conv2(F.pad(y, (self.conv2.kernel_size[0] - 1, 0)))
        return x + y.transpose(1, 2)


class Upsample1D(nn.Module):
    """Token rate -> mel frame rate: repeat each vector `stride` times (nearest), then a causal
    Conv1d (kernel 2 * stride + 1, left pad 2 * stride) that blends across token boundaries
    without looking ahead."""

    def __init__(self, size: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(size, size, 2 * stride + 1)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, C] -> [B, T * stride, C]."""
        y = x.repeat_interleave(self.stride, dim=1).transpose(1, 2)
        return self.conv(F.pad(y, (2 * self.stride, 0))).transpose(1, 2)


class UpsampleConformer(nn.Module):
    """CosyVoice2's UpsampleConformerEncoder: linear input + rel-pos, lookahead, `blocks` conformer
    layers at the token rate, x stride upsampling, linear input + rel-pos again, `up_blocks` layers
    at the frame rate, after_norm. Attribute names and order follow the official module."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.embed = LinearInput(cfg.size)
        self.after_norm = nn.LayerNorm(cfg.size, eps=INPUT_NORM_EPS)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.size, cfg.lookahead)
        self.encoders = nn.ModuleList(ConformerLayer(cfg.size, cfg.heads, cfg.linear_units) for _ in range(cfg.blocks))
        self.up_layer = Upsample1D(cfg.size, cfg.stride)
        self.up_embed = LinearInput(cfg.size)
        self.up_encoders = nn.ModuleList(ConformerLayer(cfg.size, cfg.heads, cfg.linear_units) for _ in range(cfg.up_blocks))

    def forward(
        self, x: Tensor, lengths: Tensor, chunk: int = 0, context: Tensor | None = None, ends: Tensor | None = None
    ) -> Tensor:
        """x [B, T, C] token embeddings -> [B, T * stride, C]; context [B, lookahead, C] or None; ends [B]
        bool or None: rows whose context is not read (they end there, as with no context)."""
        x = self.embed(x)
        ctx = None if context is None else self.embed(context)
        if ctx is not None and ends is not None:
            ctx = ctx * ~ends[:, None, None]  # what lies past the end reads zeros after the input layer
        x = self.pre_lookahead_layer(x, lengths, ctx)
        x = self._layers(self.encoders, x, lengths, chunk)
        x = self.up_embed(self.up_layer(x))
        stride = self.up_layer.stride
        x = self._layers(self.up_encoders, x, lengths * stride, chunk * stride)
        return self.after_norm(x)

    @staticmethod
    def _layers(layers: nn.ModuleList, x: Tensor, lengths: Tensor, chunk: int) -> Tensor:
        mask = attention_mask(lengths, x.size(1), chunk)
        pos = rel_positions(x.size(1), x.size(2), x.device, x.dtype)
        for layer in layers:
            x = layer(x, pos, mask)
        return x


class FlowFrontEnd(nn.Module):
    """CausalMaskedDiffWithXvec minus its decoder: tokens -> mu [B, mel, frames], x-vector -> spks.

    `state_dict()` keys are flow.pt's own (`input_embedding.weight`, `encoder.encoders.0...`)."""

    def __init__(self, cfg: EncoderConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or EncoderConfig()
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_dim, cfg.mel)
        self.encoder = UpsampleConformer(cfg)
        self.encoder_proj = nn.Linear(cfg.size, cfg.mel)

    def forward(self, tokens: Tensor, lengths: Tensor | None = None, *, chunk: int = 0, context: Tensor | None = None) -> Tensor:
        """mu [B, mel, T * stride] for tokens [B, T] (prompt tokens first, as the flow takes them).

        lengths [B]: valid tokens per row (default all T); frames past lengths * stride are padding.
        chunk: 0 offline (bidirectional, the official final decode); > 0 streaming with chunk masks,
        which needs the flow-chunk-<chunk>.pt weights. context [B, lookahead]: the tokens that follow
        (streaming's not-yet-final call: they feed only the lookahead and give no frames); a row whose
        context is -1s ends there (a last call), as with no context: so last and other calls share a
        batch. With chunk-aligned T, mu equals the first T * stride frames of the same run with context
        appended."""
        b, t = tokens.shape
        if lengths is None:
            lengths = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        if lengths.shape != (b,) or (not lengths.is_cuda and (bool((lengths < 1).any()) or bool((lengths > t).any()))):
            raise ValueError(f"lengths must be [{b}] in 1..{t}, got {lengths.tolist()}")
        if chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {chunk}")
        if context is not None and context.shape != (b, self.cfg.lookahead):
            raise ValueError(f"context must be [{b}, {self.cfg.lookahead}], got {list(context.shape)}")
        x = self.input_embedding(tokens.clamp(min=0))  # the official clamp: padding ids may be -1
        ctx = None if context is None else self.input_embedding(context.clamp(min=0))
        ends = None if context is None else (context < 0).all(dim=1)
        h = self.encoder(x, to_device(tokens.device, lengths), chunk, ctx, ends)
        return self.encoder_proj(h).transpose(1, 2)

    def speaker(self, xvector: Tensor) -> Tensor:
        """spks [B, mel] for the estimator from a CAM++ x-vector [B, spk_dim]: only its direction
        counts (L2-normalised first)."""
        return self.spk_embed_affine_layer(F.normalize(xvector, dim=1))

    def load_flow_state(self, state: Mapping[str, object]) -> None:
        """Load strictly from an official flow.pt state dict. Its `decoder.*` tensors belong to the
        estimator and non-tensors (`epoch`, `step` in flow-chunk-*.pt) to training; both are skipped."""
        mine = {k: v for k, v in state.items() if isinstance(v, Tensor) and not k.startswith("decoder.")}
        self.load_state_dict(mine, strict=True)
