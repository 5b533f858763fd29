"""Our PyTorch engine: reads the TensorRT-LLM checkpoint, three static KV caches, two heads.

gpt-fast in spirit: plain modules, static cache buffers written with index_copy_, masks
derived on the device from the positions, no host syncs in a step. Layers 0..S-1 are the
trunk, then the text branch, then the audio branch; each layer owns its cache, so branches
cannot alias. On CUDA each decode step is replayed from a CUDA graph (one per batch size,
text-head need and attention bucket); decode attends to the first `kv_len` cached positions,
a multiple of KV_BUCKET just past the sequence, rather than to the whole cache. A layer is a
pure function of its tensors (`layer_step`), so that with `compile` one torch.compile'd
version of it, with the elementwise work between the matmuls fused, serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workflow import fp8, trtckpt
from workflow.cudagraphs import Graphs
from workflow.engines import gemv
from workflow.engines.base import Engine, merged_ids
from workflow.names import layer_plan
from workflow.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_BUCKET = 128  # decode attends to the cache in steps of this many positions


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype: float32 on CPU (exact checks), bfloat16 on CUDA
    max_batch: int = 4
    max_seq_len: int = 1024
    cuda_graphs: bool = True  # CUDA only: replay each decode step from a captured graph
    compile: bool = False  # fuse the elementwise work between matmuls with torch.compile
    gemv: bool = False  # decode's matmuls (<= gemv.MAX_M rows) through the fused Triton GEMV
    gemv_blocks: dict | None = None  # its block shapes per weight shape, tuned at build (gemv.tune)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary embedding (rotate halves): x [B, T, heads, d], cos/sin [T, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def linear(
    x: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: tuple[torch.Tensor, ...] | None
) -> torch.Tensor:
    """x @ w^T, three ways. bf16: a_scale None. FP8 emulated exactly (CPU): w is the dequantized
    weight and x is rounded through FP8 with a_scale. FP8 on CUDA: torch._scaled_mm over x
    rounded to FP8, rows padded to a multiple of 16 (cuBLASLt's FP8 GEMM wants that). w_scale
    holds one scale tensor per part of w's rows: two where two checkpoint tensors were fused
    (fc|gate), each keeping its own scale (one GEMM per part: a row-wise-scaled GEMM is slower;
    separate tensors: cuBLASLt wants each scale's address aligned, which a slice is not)."""
    if a_scale is None:
        return F.linear(x, w)
    if w_scale is None:
        return F.linear(fp8.fake_quant(x, a_scale), w)
    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    m, pad = x.shape[0], -x.shape[0] % 16
    xq = fp8.quantize(F.pad(x, (0, 0, 0, pad)) if pad else x, a_scale)
    parts = [
        torch._scaled_mm(xq, part.t(), scale_a=a_scale, scale_b=scale, out_dtype=x.dtype)
        for part, scale in zip(w.chunk(len(w_scale)), w_scale, strict=True)
    ]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y[:m].reshape(*shape[:-1], -1)


class LinearArgs(NamedTuple):
    """A linear's tensors as `project` takes them. weight, a_scale, w_scale: what `linear`
    takes; fp8_weight and out_scale (a_scale x w_scale per part): what the FP8 GEMV reads."""

    weight: torch.Tensor
    a_scale: torch.Tensor | None = None
    w_scale: tuple[torch.Tensor, ...] | None = None
    fp8_weight: torch.Tensor | None = None
    out_scale: torch.Tensor | None = None


def project(
    x: torch.Tensor,
    lin: LinearArgs,
    fused: bool,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """[residual +] linear(prologue(x)), the prologue one of: rms_norm with `norm`; with
    silu_mul, x = [gate | up] -> silu(gate) * up. With `fused` and few rows (decode), one GEMV
    kernel does it all; FP8 quantizes x first (the prologue then runs here, fused by compile)."""
    if fused and x.numel() // x.shape[-1] <= gemv.MAX_M:
        if lin.a_scale is None:
            return gemv.gemv(x, lin.weight, x.dtype, norm=norm, eps=eps, residual=residual, silu_mul=silu_mul)
        xq = fp8.quantize(prologue(x, norm, eps, silu_mul), lin.a_scale)
        return gemv.gemv(xq, lin.fp8_weight, x.dtype, scale=lin.out_scale, residual=residual)
    y = linear(prologue(x, norm, eps, silu_mul), lin.weight, lin.a_scale, lin.w_scale)
    return y if residual is None else residual + y


def prologue(x: torch.Tensor, norm: torch.Tensor | None, eps: float, silu_mul: bool) -> torch.Tensor:
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x if norm is None else rms_norm(x, norm, eps)


class Linear(nn.Module):
    """A bf16 (or float32) linear; `args()` is what `project` takes."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def args(self) -> LinearArgs:
        return LinearArgs(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, *self.args()[:3])


class Fp8Linear(Linear):
    """y = fp8(x / a) @ fp8(W)^T * a * w with calibrated static scales (see `linear`);
    w_scale has one entry per part of the rows (fc|gate: two)."""

    def __init__(self, weight: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.register_buffer("weight", weight)
        self.register_buffer("w_scale", w_scale.float().reshape(-1))
        self.register_buffer("a_scale", a_scale.float().reshape(1))
        self.register_buffer("w_deq", None if weight.is_cuda else (weight.float() * self.row_scale()).to(dtype))
        self.register_buffer("out_scale", self.a_scale * self.w_scale)
        self.part_scales = tuple(s.clone().reshape(1) for s in self.w_scale)

    def row_scale(self) -> torch.Tensor:
        """[N, 1]: each output row's weight scale."""
        return self.w_scale.repeat_interleave(self.weight.shape[0] // self.w_scale.numel())[:, None]

    def args(self) -> LinearArgs:
        if self.w_deq is not None:  # CPU: exact emulation through the dequantized weight
            return LinearArgs(self.w_deq, self.a_scale, None, self.weight, self.out_scale)
        return LinearArgs(self.weight, self.a_scale, self.part_scales, self.weight, self.out_scale)


def layer_step(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    mask: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    norms: tuple[torch.Tensor, ...],
    qkv: LinearArgs,
    dense: LinearArgs,
    gate_up: LinearArgs,
    proj: LinearArgs,
    eps: float,
    head_dim: int,
    fused: bool = False,
) -> torch.Tensor:
    """One Qwen3 decoder layer, a pure function of its tensors, so that one compiled version
    serves every layer. mask None: prefill from an empty cache, causal over the new tokens;
    otherwise attend to the first mask.shape[-1] cached positions where mask is True.
    norms: input, post-attention, q, k; fused: decode's linears through the fused GEMV."""
    b, t, d = x.shape[0], x.shape[1], head_dim
    kv_size = k_cache.shape[1] * d
    qkv_out = project(x, qkv, fused, norms[0], eps)
    q, k, v = qkv_out.split([qkv_out.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
    q = rope(rms_norm(q.view(b, t, -1, d), norms[2], eps), cos, sin).transpose(1, 2)
    k = rope(rms_norm(k.view(b, t, -1, d), norms[3], eps), cos, sin).transpose(1, 2)
    v = v.view(b, t, -1, d).transpose(1, 2)
    k_cache, v_cache = k_cache[:b], v_cache[:b]
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        kv_len = mask.shape[-1]
        y = F.scaled_dot_product_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask, enable_gqa=True)
    h = project(y.transpose(1, 2).reshape(b, t, -1), dense, fused, residual=x)
    return project(project(h, gate_up, fused, norms[1], eps), proj, fused, residual=h, silu_mul=True)


class Layer(nn.Module):
    """One Qwen3 decoder layer's tensors and its own KV cache; `step` computes it."""

    def __init__(self, spec: ModelSpec, linears: dict[str, nn.Module], norms: dict[str, torch.Tensor], step, fused: bool = False):
        super().__init__()
        self.spec, self.step, self.fused = spec, step, fused
        self.qkv, self.dense = linears["attention.qkv"], linears["attention.dense"]
        self.gate_up, self.proj = linears["mlp.gate_up"], linears["mlp.proj"]
        self.norms = tuple(
            norms[k] for k in ("input_layernorm", "post_layernorm", "attention.q_layernorm", "attention.k_layernorm")
        )
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def setup_cache(self, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, self.spec.num_key_value_heads, seq, self.spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        return self.step(
            x, cos, sin, pos, mask, self.k_cache, self.v_cache, self.norms,
            self.qkv.args(), self.dense.args(), self.gate_up.args(), self.proj.args(),
            self.spec.rms_norm_eps, self.spec.head_dim, self.fused,
        )  # fmt: skip


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
    w_scale = torch.cat([w_fc.reshape(1), w_gate.reshape(1)])
    # fc and gate read the same input, so calibration gives them one activation amax;
    # should a checkpoint differ, the larger scale is the one that cannot overflow.
    gate_up = torch.cat([weight("mlp.fc"), weight("mlp.gate")])
    out["mlp.gate_up"] = Fp8Linear(gate_up, w_scale, torch.maximum(a_fc, a_gate), dtype)
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

        if options.compile:  # static shapes: a recompile per (batch, length) beats slower dynamic kernels
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        step = torch.compile(layer_step, dynamic=False, fullgraph=True) if options.compile else layer_step
        self.embedding = t("transformer.vocab_embedding.weight")
        norm_names = ("input_layernorm", "post_layernorm", "attention.q_layernorm", "attention.k_layernorm")
        self.layers = nn.ModuleList(
            Layer(
                spec,
                _linears(tensors, f"transformer.layers.{n}.", dt, dev),
                {k: t(f"transformer.layers.{n}.{k}.weight") for k in norm_names},
                step,
                options.gemv,
            )
            for n in range(spec.num_layers)
        )
        plan = layer_plan(spec)
        self.trunk = [self.layers[i] for i in plan["shared_block"]]
        self.text_block = [self.layers[i] for i in plan["text_block"]]
        self.audio_block = [self.layers[i] for i in plan["audio_block"]]
        self.ln_f, self.audio_ln_f = t("transformer.ln_f.weight"), t("transformer.audio_ln_f.weight")
        self.lm_head = Linear(t("lm_head.weight"))
        self.audio_lm_head = Linear(t("audio_lm_head.weight"))
        self.max_batch, self.max_seq_len = options.max_batch, options.max_seq_len
        self.gemv_blocks = dict(options.gemv_blocks or {})
        if options.gemv and self.device.type == "cuda":
            if not self.gemv_blocks:  # first load (build): choose each use's blocks on this GPU
                self.gemv_blocks = gemv.tune(self.gemv_uses())
            gemv.BLOCKS.update({k: tuple(v) for k, v in self.gemv_blocks.items()})
        inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, device=dev).float() / spec.head_dim)
        angles = torch.outer(torch.arange(options.max_seq_len, device=dev).float(), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.positions = torch.arange(options.max_seq_len, device=dev)  # persistent: graphs read it
        for layer in self.layers:
            layer.setup_cache(options.max_batch, options.max_seq_len, dt, self.device)
        self.batch = 0
        self.length = 0  # host-side count of cached positions (no device sync needed)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # device-side: the next position
        self.use_graphs = options.cuda_graphs and self.device.type == "cuda"
        self.graphs = Graphs(self.device) if self.use_graphs else None
        self.static_ids: dict[tuple[int, int], torch.Tensor] = {}  # (batch, tokens) -> input buffer

    def gemv_uses(self) -> list[tuple[torch.Tensor, str]]:
        """Each weight the GEMV reads in decode, with the prologue/epilogue flags it runs with
        (see `project`: FP8 inputs arrive normed and quantized, so no prologue)."""
        uses = []
        for layer in self.layers:
            for lin, norm, silu, res in (
                (layer.qkv, True, False, False),
                (layer.dense, False, False, True),
                (layer.gate_up, True, False, False),
                (layer.proj, False, True, True),
            ):
                a = lin.args()
                bf16 = a.a_scale is None
                w = a.weight if bf16 else a.fp8_weight
                uses.append((w, gemv.flags(norm and bf16, silu and bf16, res)))
        return uses + [(head.weight, gemv.flags(True, False, False)) for head in (self.lm_head, self.audio_lm_head)]

    def forward_ids(
        self, ids: torch.Tensor, pos: torch.Tensor, need_text: bool, all_logits: bool, kv_len: int | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """ids [B, T] rows of the embedding table at positions pos [T] -> both heads' logits.
        kv_len None: a prefill from an empty cache; else a decode attending to kv_len positions."""
        cos, sin = self.cos[pos], self.sin[pos]
        mask = None if kv_len is None else torch.arange(kv_len, device=ids.device)[None, :] <= pos[:, None]
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
        eps, fused = self.spec.rms_norm_eps, self.options.gemv
        text_logits = project(text, self.lm_head.args(), fused, self.ln_f, eps).float() if need_text else None
        return text_logits, project(audio, self.audio_lm_head.args(), fused, self.audio_ln_f, eps).float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = tokens.shape
        if b > self.max_batch or t > self.max_seq_len:
            raise ValueError(f"prefill of {b} x {t} exceeds the engine's limits {self.max_batch} x {self.max_seq_len}")
        self.batch, self.length = b, t
        self.pos.fill_(t)
        ids = merged_ids(tokens.to(self.device), self.spec)
        text, audio = self._step(ids, self.positions[:t], True, all_logits, None)
        assert text is not None
        return text, audio

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, need_text: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        b = tokens.shape[0]
        if b != self.batch:
            raise ValueError(f"decode of batch {b} after a prefill of batch {self.batch}")
        if self.length >= self.max_seq_len:
            raise ValueError(f"sequence reached the engine's max_seq_len {self.max_seq_len}")
        kv_len = min(self.max_seq_len, -(-(self.length + 1) // KV_BUCKET) * KV_BUCKET)
        ids = merged_ids(tokens.to(self.device), self.spec)[:, None]
        out = self._step(ids, self.pos, need_text, False, kv_len)
        self.pos += 1
        self.length += 1
        return out

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, need_text: bool, all_logits: bool, kv_len: int | None):
        """forward_ids, replayed on CUDA from a graph per (shape, text head, bucket)."""
        if not self.use_graphs:
            return self.forward_ids(ids, pos, need_text, all_logits, kv_len)
        static = self.static_ids.setdefault(tuple(ids.shape), torch.empty_like(ids))
        static.copy_(ids)
        key = (tuple(ids.shape), need_text, all_logits, kv_len)
        text, audio = self.graphs.run(key, lambda: self.forward_ids(static, pos, need_text, all_logits, kv_len))
        return (None if text is None else text.clone()), audio.clone()


def load(engine_dir: str | Path, meta: dict, device: str | None = None, max_batch: int | None = None) -> TorchEngine:
    """Open an engine directory written by build (its checkpoint files are hard links)."""
    opts = EngineOptions(**meta["options"])
    opts = replace(opts, device=device or opts.device, max_batch=max_batch or opts.max_batch)
    _, spec, tensors = trtckpt.load_checkpoint(engine_dir, device="cuda" if opts.device.startswith("cuda") else "cpu")
    return TorchEngine(spec, tensors, opts)
