"""One Qwen3 decoder layer of our engine: its tensors, its KV cache, and `layer_step`, the pure
function that computes it (torch.compile'd once, it serves every layer; with the GEMV and the decode
attention, decode goes through our Triton kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workflow.engines import attention, blocks
from workflow.engines.linears import Linear, LinearArgs, gemv_path, project, rms_norm, rope

COMPILED_BATCH = 4  # with `compile`, batches of more sequences run the eager layer_step (Layer.forward)


class At(NamedTuple):
    """Where a step's tokens sit: rope's angles ([B or 1, T, d/2]), their positions ([B or 1, T])
    and cache rows ([B, 1]), and the attention mask (None: a prefill from an empty row, causal over
    the new tokens; else [B, 1, T, kv_len], which of its row's first kv_len cached positions each
    token attends to). A decode step and the text catch-up run rows 0..B-1."""

    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor
    mask: torch.Tensor | None


class LayerWeights(NamedTuple):
    """A layer's tensors as `layer_step` reads them; norms: input, post-attention, q, k."""

    norms: tuple[torch.Tensor, ...]
    qkv: LinearArgs
    dense: LinearArgs
    gate_up: LinearArgs
    proj: LinearArgs


class LayerConfig(NamedTuple):
    """How a layer computes. gemv: decode's linears through the fused GEMV; decode_attention:
    decode's attention (norms, rope, cache write included) in one kernel; glu: with the GEMV and
    bf16 weights, gate_up's ends in silu(gate) * up, so proj's programs read x once, not [gate |
    up] each (FP8 keeps the quantize kernel between them: there the epilogue cost more than the
    kernel it saves, probe 17)."""

    eps: float
    head_dim: int
    gemv: bool = False
    decode_attention: bool = False
    glu: bool = False


def layer_step(
    x: torch.Tensor, at: At, cache: tuple[torch.Tensor, torch.Tensor], w: LayerWeights, cfg: LayerConfig
) -> torch.Tensor:
    """One Qwen3 decoder layer, a pure function of its tensors, so that one compiled version
    serves every layer; writes the new tokens' keys and values into cache (k, v)."""
    b, t, d = x.shape[0], x.shape[1], cfg.head_dim
    k_cache, v_cache = cache
    kv_size = k_cache.shape[1] * d
    qkv_out = project(x, w.qkv, cfg.gemv, w.norms[0], cfg.eps)
    if cfg.decode_attention and at.mask is not None and t == 1:
        fp8_in = w.dense.a_scale is not None and gemv_path(x, cfg.gemv)  # dense's input as its FP8 GEMV reads it
        y = attention.decode_attention(
            qkv_out, w.norms[2], w.norms[3], at.cos.view(b, -1), at.sin.view(b, -1), k_cache, v_cache, at.pos.view(b),
            at.mask.shape[-1], cfg.eps, quant=w.dense.a_scale if fp8_in else None,
        )  # fmt: skip
    else:
        q, k, v = qkv_out.split([qkv_out.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
        q = rope(rms_norm(q.view(b, t, -1, d), w.norms[2], cfg.eps), at.cos, at.sin)
        k = rope(rms_norm(k.view(b, t, -1, d), w.norms[3], cfg.eps), at.cos, at.sin)
        v = v.view(b, t, -1, d)
        k_cache[at.rows, :, at.pos] = k  # each token's key at (its row, its position)
        v_cache[at.rows, :, at.pos] = v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if at.mask is None:  # prefill from an empty row: the new tokens see only each other
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            kv_len = at.mask.shape[-1]
            k_seen, v_seen = k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len]
            y = F.scaled_dot_product_attention(q, k_seen, v_seen, attn_mask=at.mask, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
    h = project(y, w.dense, cfg.gemv, residual=x)
    glu = cfg.glu and gemv_path(h, cfg.gemv) and w.gate_up.a_scale is None
    act = project(h, w.gate_up, cfg.gemv, w.norms[1], cfg.eps, glu=glu)
    return project(act, w.proj, cfg.gemv, residual=h, silu_mul=not glu)


class Layer(nn.Module):
    """One Qwen3 decoder layer's tensors and its own KV cache; `step` computes it."""

    def __init__(self, linears: dict[str, Linear], norms: tuple[torch.Tensor, ...], step: Callable, cfg: LayerConfig):
        super().__init__()
        self.step, self.cfg = step, cfg
        self.qkv, self.dense = linears["attention.qkv"], linears["attention.dense"]
        self.gate_up, self.proj = linears["mlp.gate_up"], linears["mlp.proj"]
        self.norms = norms
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def weights(self) -> LayerWeights:
        return LayerWeights(self.norms, self.qkv.args(), self.dense.args(), self.gate_up.args(), self.proj.args())

    def gemv_uses(self) -> list[tuple[Linear, blocks.Fuse]]:
        """Each linear's decode call as `layer_step` and `project` make it (FP8 inputs arrive
        normed and quantized: no prologue)."""
        uses = []
        for lin, norm, silu, res in (
            (self.qkv, True, False, False),
            (self.dense, False, False, True),
            (self.gate_up, True, False, False),
            (self.proj, False, not self.cfg.glu, True),
        ):
            bf16 = lin.args().a_scale is None
            glu = self.cfg.glu and bf16 and lin is self.gate_up
            uses.append((lin, blocks.fuse_of(norm and bf16, silu and bf16, res, glu)))
        return uses

    def forward(self, x: torch.Tensor, at: At, step: Callable | None = None) -> torch.Tensor:
        """step: layer_step itself where the compiled one would recompile per shape: the caller
        says so, or the batch is over COMPILED_BATCH (a serving batch takes a dozen sizes, each
        with every attention bucket: compiles for minutes; under its CUDA graph the eager step
        loses only the fusion of the elementwise work, a small share beside the matmuls there)."""
        step = step or (self.step if x.shape[0] <= COMPILED_BATCH else layer_step)
        return step(x, at, (self.k_cache, self.v_cache), self.weights(), self.cfg)
