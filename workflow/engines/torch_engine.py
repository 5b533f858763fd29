"""Our PyTorch engine: reads the TensorRT-LLM checkpoint, three static KV caches, two heads.

gpt-fast in spirit: plain modules, static cache buffers written with index_copy_, the
attention mask derived on the device from the positions, no host syncs in a step, so that a
decode step can be captured in a CUDA graph. Layers 0..S-1 are the trunk, then the text
branch, then the audio branch; each layer owns its cache, so branches cannot alias.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workflow import fp8, trtckpt
from workflow.engines.base import Engine, merged_ids
from workflow.names import layer_plan
from workflow.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype: float32 on CPU (exact checks), bfloat16 on CUDA
    max_batch: int = 4
    max_seq_len: int = 1024


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Fp8Linear(nn.Module):
    """y = fp8(x / a) @ fp8(W)^T * a * w with calibrated static scales.

    `w_scale` is one scale, or one per output row (where two checkpoint tensors with their own
    scales were fused, e.g. fc|gate). On CUDA: torch._scaled_mm. Elsewhere: the same rounding
    emulated exactly through dequantisation, so CPU tests check the numerics.
    """

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("w_scale", w_scale.float().reshape(-1, 1))
        self.register_buffer("a_scale", a_scale.float().reshape(1))
        self.dtype = dtype
        self.register_buffer("w_deq", None if weight.is_cuda else (weight.float() * self.w_scale).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_deq is not None:
            return F.linear(fp8.fake_quant(x, self.a_scale), self.w_deq)
        shape = x.shape
        xq = fp8.quantize(x.reshape(-1, shape[-1]), self.a_scale)
        m = xq.shape[0]
        if self.w_scale.numel() == 1:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=self.a_scale, scale_b=self.w_scale.reshape(1), out_dtype=self.dtype)
        else:  # row-wise: scale_a [M, 1], scale_b [1, N]
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=self.a_scale.expand(m, 1).contiguous(),
                scale_b=self.w_scale.reshape(1, -1).contiguous(),
                out_dtype=self.dtype,
            )
        return y.reshape(*shape[:-1], -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary embedding (rotate halves): x [B, T, heads, d], cos/sin [T, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Layer(nn.Module):
    """One Qwen3 decoder layer with its own KV cache."""

    def __init__(self, spec: ModelSpec, linears: dict[str, nn.Module], norms: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.qkv, self.dense = linears["attention.qkv"], linears["attention.dense"]
        self.gate_up, self.proj = linears["mlp.gate_up"], linears["mlp.proj"]
        eps = spec.rms_norm_eps
        self.input_layernorm = RMSNorm(norms["input_layernorm"], eps)
        self.post_layernorm = RMSNorm(norms["post_layernorm"], eps)
        self.q_norm = RMSNorm(norms["attention.q_layernorm"], eps)
        self.k_norm = RMSNorm(norms["attention.k_layernorm"], eps)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def setup_cache(self, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, self.spec.num_key_value_heads, seq, self.spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        s, b, t = self.spec, x.shape[0], x.shape[1]
        q_size, kv_size = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        q, k, v = self.qkv(self.input_layernorm(x)).split([q_size, kv_size, kv_size], dim=-1)
        q = rope(self.q_norm(q.view(b, t, -1, s.head_dim)), cos, sin).transpose(1, 2)
        k = rope(self.k_norm(k.view(b, t, -1, s.head_dim)), cos, sin).transpose(1, 2)
        v = v.view(b, t, -1, s.head_dim).transpose(1, 2)
        k_cache, v_cache = self.k_cache[:b], self.v_cache[:b]
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        h = x + self.dense(y.transpose(1, 2).reshape(b, t, q_size))
        gate, up = self.gate_up(self.post_layernorm(h)).chunk(2, dim=-1)
        return h + self.proj(F.silu(gate) * up)


def _linears(tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    """The layer's linear modules; fc (SiLU side) and gate (up) fused as gate_up = [fc; gate]."""

    def weight(name: str) -> torch.Tensor:
        return tensors[f"{prefix}{name}.weight"].to(device)

    if tensors[f"{prefix}mlp.fc.weight"].dtype != torch.float8_e4m3fn:
        out = {n: Linear(weight(n).to(dtype)) for n in ("attention.qkv", "attention.dense", "mlp.proj")}
        out["mlp.gate_up"] = Linear(torch.cat([weight("mlp.fc"), weight("mlp.gate")]).to(dtype))
        return out

    def scales(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            tensors[f"{prefix}{name}.weights_scaling_factor"].to(device),
            tensors[f"{prefix}{name}.activation_scaling_factor"].to(device),
        )

    out = {n: Fp8Linear(weight(n), *scales(n), dtype) for n in ("attention.qkv", "attention.dense", "mlp.proj")}
    (w_fc, a_fc), (w_gate, a_gate) = scales("mlp.fc"), scales("mlp.gate")
    rows = tensors[f"{prefix}mlp.fc.weight"].shape[0]
    w_scale = torch.cat([w_fc.expand(rows), w_gate.expand(rows)])
    # fc and gate read the same input, so calibration gives them one activation amax;
    # should a checkpoint differ, the larger scale is the one that cannot overflow.
    out["mlp.gate_up"] = Fp8Linear(torch.cat([weight("mlp.fc"), weight("mlp.gate")]), w_scale, torch.maximum(a_fc, a_gate), dtype)
    return out


class TorchEngine(Engine, nn.Module):
    """The whole dual-head model over a TensorRT-LLM checkpoint's tensors."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], options: EngineOptions):
        nn.Module.__init__(self)
        self.spec, self.options = spec, options
        self.device = torch.device(options.device)
        self.dtype = DTYPES[options.dtype]
        dev, dt = options.device, self.dtype

        def t(name: str) -> torch.Tensor:
            return tensors[name].to(device=dev, dtype=dt)

        self.embedding = t("transformer.vocab_embedding.weight")
        layers = []
        for n in range(spec.num_layers):
            p = f"transformer.layers.{n}."
            norms = {
                k: t(p + k + ".weight")
                for k in ("input_layernorm", "post_layernorm", "attention.q_layernorm", "attention.k_layernorm")
            }
            layers.append(Layer(spec, _linears(tensors, p, dt, dev), norms))
        self.layers = nn.ModuleList(layers)
        plan = layer_plan(spec)
        self.trunk = [self.layers[i] for i in plan["shared_block"]]
        self.text_block = [self.layers[i] for i in plan["text_block"]]
        self.audio_block = [self.layers[i] for i in plan["audio_block"]]
        self.ln_f = RMSNorm(t("transformer.ln_f.weight"), spec.rms_norm_eps)
        self.audio_ln_f = RMSNorm(t("transformer.audio_ln_f.weight"), spec.rms_norm_eps)
        self.lm_head = Linear(t("lm_head.weight"))
        self.audio_lm_head = Linear(t("audio_lm_head.weight"))
        self.max_batch, self.max_seq_len = options.max_batch, options.max_seq_len
        inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, device=dev).float() / spec.head_dim)
        angles = torch.outer(torch.arange(options.max_seq_len, device=dev).float(), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()
        for layer in self.layers:
            layer.setup_cache(options.max_batch, options.max_seq_len, dt, self.device)
        self.batch = 0
        self.length = 0  # host-side count of cached positions (no device sync needed)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # device-side: the next position

    def forward_ids(
        self, ids: torch.Tensor, pos: torch.Tensor, need_text: bool, all_logits: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """ids [B, T] rows of the embedding table at positions pos [T] -> both heads' logits."""
        cos, sin = self.cos[pos], self.sin[pos]
        mask = torch.arange(self.max_seq_len, device=ids.device)[None, :] <= pos[:, None]
        x = F.embedding(ids, self.embedding)
        for layer in self.trunk:
            x = layer(x, cos, sin, pos, mask)
        text, audio = x, x
        for layer in self.text_block:
            text = layer(text, cos, sin, pos, mask)
        for layer in self.audio_block:
            audio = layer(audio, cos, sin, pos, mask)
        if not all_logits:
            text, audio = text[:, -1], audio[:, -1]
        text_logits = self.lm_head(self.ln_f(text)).float() if need_text else None
        return text_logits, self.audio_lm_head(self.audio_ln_f(audio)).float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = tokens.shape
        if b > self.max_batch or t > self.max_seq_len:
            raise ValueError(f"prefill of {b} x {t} exceeds the engine's limits {self.max_batch} x {self.max_seq_len}")
        self.batch, self.length = b, t
        self.pos.fill_(t)
        ids = merged_ids(tokens.to(self.device), self.spec)
        text, audio = self.forward_ids(ids, torch.arange(t, device=self.device), True, all_logits)
        assert text is not None
        return text, audio

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        if tokens.shape[0] != self.batch:
            raise ValueError(f"decode of batch {tokens.shape[0]} after a prefill of batch {self.batch}")
        if self.length >= self.max_seq_len:
            raise ValueError(f"sequence reached the engine's max_seq_len {self.max_seq_len}")
        ids = merged_ids(tokens.to(self.device), self.spec)[:, None]
        out = self.forward_ids(ids, self.pos, need_text, False)
        self.pos += 1
        self.length += 1
        return out


def load(engine_dir: str | Path, meta: dict, device: str | None = None, max_batch: int | None = None) -> TorchEngine:
    """Open an engine directory written by build (its checkpoint files are hard links)."""
    opts = EngineOptions(**meta["options"])
    opts = replace(opts, device=device or opts.device, max_batch=max_batch or opts.max_batch)
    _, spec, tensors = trtckpt.load_checkpoint(engine_dir)
    return TorchEngine(spec, tensors, opts)
