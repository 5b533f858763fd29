"""MOSS-Speech as a TensorRT-LLM engine-flow model, and a plain-Python declaration of what it loads.

One embedding table (text rows, then audio rows), the trunk, then a text branch and an audio
branch of Qwen3 layers, each with its own final norm and head; `logits` (text) and
`audio_logits` are both engine outputs. Each layer's Attention gets `local_layer_idx` = its
layer index, which is its slot in the paged KV-cache pool: trunk 0-31, text 32-35, audio 36-39
for the full model, so the branches never share a cache.

tensorrt_llm is imported only inside `model_classes()`. The rest is plain Python, so the
checkpoint contract is tested where TensorRT-LLM cannot be installed: `weights()` lists every
module that owns a weight, `declared_parameters()` turns it into what the definition's load()
requires, and `load_model()` checks the built model against that declaration before loading,
so declaration and definition cannot drift.

API followed (NVIDIA/TensorRT-LLM, engine flow, 1.0 to 1.2.x):
- models/modeling_utils.py: PretrainedConfig(**fields); DecoderModelForCausalLM(config,
  transformer, lm_head), whose __init__ registers the rope constants that
  Attention.fill_attention_params reads; PretrainedModel.load(weights) requires every parameter
  that is not is_inited() and fails with "Required but not provided tensors".
- layers/attention.py: Attention(*, local_layer_idx, hidden_size, num_attention_heads,
  num_kv_heads, attention_head_size, qk_layernorm, layernorm_type, eps, ...): q/k RMSNorm per
  head, before the plugin's rope; the plugin addresses the KV pool by local_layer_idx.
- layers/mlp.py: GatedMLP: proj(act(fc(x)) * gate(x)), so fc is the SiLU side.
- quantization/quantize.py (quantize_layers): FP8 replaces every ColumnLinear/RowLinear whose
  name matches no exclude pattern (fnmatchcase) by FP8Linear: fp8 weight plus float32 (1,)
  weights_scaling_factor and activation_scaling_factor; embeddings are never FP8.
- models/qwen/model.py (QWenDecoderLayer): the Qwen3 layer layout followed here.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from workflow import tensorfile, trtckpt
from workflow.errors import InputError
from workflow.names import layer_plan
from workflow.spec import ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# The entries of TensorRT-LLM's default exclude list (used when a config gives none) that can
# match a module of this model (quantization/quantize.py, quantize_layers).
DEFAULT_EXCLUDES = ("*lm_head", "*vocab_embedding")
# Config fields this definition depends on, with the one value it implements.
FIXED_FIELDS = {
    "logits_dtype": "float32",
    "position_embedding_type": "rope_gpt_neox",
    "hidden_act": "silu",
    "qwen_type": "qwen3",
    "qk_layernorm": True,
    "rotary_scaling": None,
    "attn_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "use_parallel_embedding": False,
}


@dataclass(frozen=True)
class Weight:
    """A module of the definition that owns one weight tensor `<module>.weight`."""

    module: str
    kind: str  # "embedding", "norm" or "linear" (a ColumnLinear/RowLinear, so FP8-able)
    shape: tuple[int, ...]


def branches(cfg: dict) -> dict[str, list[int]]:
    """Layer indices of the trunk and each branch; each is also that layer's KV-cache slot."""
    return {"trunk": list(range(cfg["num_shared_layers"])), "text": list(cfg["text_layers"]), "audio": list(cfg["audio_layers"])}


def weights(cfg: dict) -> list[Weight]:
    """Every weight-owning module the definition creates, named as TensorRT-LLM names it."""
    h, d, inter = cfg["hidden_size"], cfg["head_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layer = {
        "input_layernorm": ("norm", (h,)),
        "attention.qkv": ("linear", (q + 2 * kv, h)),
        "attention.q_layernorm": ("norm", (d,)),
        "attention.k_layernorm": ("norm", (d,)),
        "attention.dense": ("linear", (h, q)),
        "post_layernorm": ("norm", (h,)),
        "mlp.fc": ("linear", (inter, h)),
        "mlp.gate": ("linear", (inter, h)),
        "mlp.proj": ("linear", (h, inter)),
    }
    out = [Weight("transformer.vocab_embedding", "embedding", (cfg["vocab_size"] + cfg["audio_vocab_size"], h))]
    for n in range(cfg["num_hidden_layers"]):
        out += [Weight(f"transformer.layers.{n}.{name}", kind, shape) for name, (kind, shape) in layer.items()]
    out += [
        Weight("transformer.ln_f", "norm", (h,)),
        Weight("transformer.audio_ln_f", "norm", (h,)),
        Weight("lm_head", "linear", (cfg["vocab_size"], h)),
        Weight("audio_lm_head", "linear", (cfg["audio_vocab_size"], h)),
    ]
    return out


def excluded(module: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """Whether TensorRT-LLM's FP8 pass leaves `module` alone (fnmatchcase, as quantize_layers)."""
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def fp8_modules(cfg: dict) -> list[str]:
    """The linears the definition makes FP8 under this config (none unless quant_algo is FP8)."""
    quant = cfg.get("quantization") or {}
    if quant.get("quant_algo") != "FP8":
        return []
    patterns = quant.get("exclude_modules") or DEFAULT_EXCLUDES
    return [w.module for w in weights(cfg) if w.kind == "linear" and not excluded(w.module, patterns)]


def declared_parameters(cfg: dict) -> tensorfile.TensorMeta:
    """Name -> (shape, dtype) of every parameter the definition requires from a checkpoint."""
    dtype, fp8 = DTYPES[cfg["dtype"]], set(fp8_modules(cfg))
    out: tensorfile.TensorMeta = {}
    for w in weights(cfg):
        if w.module in fp8:
            out[f"{w.module}.weight"] = (w.shape, torch.float8_e4m3fn)
            out[f"{w.module}.weights_scaling_factor"] = ((1,), torch.float32)
            out[f"{w.module}.activation_scaling_factor"] = ((1,), torch.float32)
        else:
            out[f"{w.module}.weight"] = (w.shape, dtype)
    return out


def check_trt_config(cfg: dict, source: str = trtckpt.CONFIG) -> ModelSpec:
    """The spec of a checkpoint config this definition can build, or InputError naming the field."""
    spec = trtckpt.spec_from_trt_config(cfg, source)
    for name, value in FIXED_FIELDS.items():
        if name not in cfg:
            raise InputError(source, f"field '{name}' is missing")
        if cfg[name] != value or type(cfg[name]) is not type(value):
            raise InputError(source, f"field '{name}' is {cfg[name]!r}; this model definition implements {value!r}")
    if cfg.get("dtype") not in DTYPES:
        raise InputError(source, f"field 'dtype' is {cfg.get('dtype')!r}, expected one of {sorted(DTYPES)}")
    if not isinstance(cfg.get("rotary_base"), int | float) or cfg["rotary_base"] <= 0:
        raise InputError(source, f"field 'rotary_base' is {cfg.get('rotary_base')!r}, expected rope_theta > 0")
    mapping = cfg.get("mapping") or {}
    if any(mapping.get(k) != 1 for k in ("world_size", "tp_size", "pp_size")):
        raise InputError(source, f"field 'mapping' is {mapping!r}; only world_size = tp_size = pp_size = 1 is supported")
    plan = layer_plan(spec)
    for branch in ("text", "audio"):
        if list(cfg.get(f"{branch}_layers", [])) != list(plan[f"{branch}_block"]):
            raise InputError(source, f"field '{branch}_layers' is not {list(plan[f'{branch}_block'])}")
    quant = cfg.get("quantization") or {}
    if quant.get("quant_algo") not in (None, "FP8") or quant.get("kv_cache_quant_algo") is not None:
        raise InputError(source, f"quantization {quant!r} is not supported (bf16, or FP8 without a quantized KV cache)")
    return spec


def check_checkpoint(ckpt_dir: str | Path) -> dict:
    """The checkpoint's config, once it and every tensor fit this definition (else InputError)."""
    cfg, _ = trtckpt.read_config(ckpt_dir)
    check_trt_config(cfg, str(Path(ckpt_dir) / trtckpt.CONFIG))
    path = Path(ckpt_dir) / trtckpt.WEIGHTS
    trtckpt.compare_tensors(tensorfile.read_header(path), declared_parameters(cfg), str(path))
    return cfg


@functools.cache
def model_classes():
    """(MossSpeechConfig, MossSpeechForCausalLM), defined on first use because they need tensorrt_llm."""
    from tensorrt_llm._common import default_net
    from tensorrt_llm.functional import LayerNormType, gather_last_token_logits
    from tensorrt_llm.layers import Attention, AttentionMaskType, ColumnLinear, Embedding, GatedMLP, RmsNorm
    from tensorrt_llm.models.modeling_utils import DecoderModelForCausalLM, PretrainedConfig
    from tensorrt_llm.module import Module, ModuleList

    base_fields = set(inspect.signature(PretrainedConfig.__init__).parameters)

    class MossSpeechConfig(PretrainedConfig):
        """Our checkpoint's config.json; fields PretrainedConfig does not take become attributes."""

        def __init__(self, **cfg):
            ours = {k: cfg.pop(k) for k in list(cfg) if k not in base_fields}
            super().__init__(**cfg)
            for k, v in ours.items():
                setattr(self, k, v)

    class MossSpeechLayer(Module):
        """One Qwen3 decoder layer; `layer_idx` is its slot in the paged KV-cache pool."""

        def __init__(self, config, layer_idx: int):
            super().__init__()
            h, eps, dtype = config.hidden_size, config.norm_epsilon, config.dtype
            self.input_layernorm = RmsNorm(normalized_shape=h, eps=eps, dtype=dtype)
            self.attention = Attention(
                local_layer_idx=layer_idx,
                hidden_size=h,
                attention_head_size=config.head_size,
                num_attention_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                max_position_embeddings=config.max_position_embeddings,
                dtype=dtype,
                attention_mask_type=AttentionMaskType.causal,
                bias=False,
                dense_bias=False,
                position_embedding_type=config.position_embedding_type,
                rotary_embedding_base=config.rotary_base,
                rotary_embedding_scaling=config.rotary_scaling,
                quant_mode=config.quant_mode,
                qk_layernorm=True,
                layernorm_type=LayerNormType.RmsNorm,
                eps=eps,
            )
            self.post_layernorm = RmsNorm(normalized_shape=h, eps=eps, dtype=dtype)
            self.mlp = GatedMLP(
                hidden_size=h,
                ffn_hidden_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                bias=False,
                dtype=dtype,
                quant_mode=config.quant_mode,
            )

        def forward(self, x, use_cache, kv_cache_params, attention_params):
            attn = self.attention(
                self.input_layernorm(x), use_cache=use_cache, kv_cache_params=kv_cache_params, attention_params=attention_params
            )
            if use_cache:
                attn = attn[0]  # paged cache: the "present" is the pool itself
            x = x + attn
            return x + self.mlp(self.post_layernorm(x))

    class MossSpeechTransformer(Module):
        def __init__(self, config):
            super().__init__()
            h, eps, dtype = config.hidden_size, config.norm_epsilon, config.dtype
            self.plan = branches(vars(config))
            self.vocab_embedding = Embedding(config.vocab_size + config.audio_vocab_size, h, dtype=dtype)
            self.layers = ModuleList([MossSpeechLayer(config, n) for n in range(config.num_hidden_layers)])
            self.ln_f = RmsNorm(normalized_shape=h, eps=eps, dtype=dtype)
            self.audio_ln_f = RmsNorm(normalized_shape=h, eps=eps, dtype=dtype)

        def forward(self, input_ids, use_cache, kv_cache_params, attention_params):
            """Hidden states after the text branch and after the audio branch (before their norms).

            With the paged cache every past_key_value entry is None (the cache lives in the pool,
            addressed by each Attention's local_layer_idx), so all layers share kv_cache_params."""
            if kv_cache_params is not None:
                kv_cache_params.fill_none_tensor_list(len(self.layers))

            def stack(x, branch: str):
                for n in self.plan[branch]:
                    x = self.layers[n](x, use_cache, kv_cache_params, attention_params)
                return x

            trunk = stack(self.vocab_embedding(input_ids), "trunk")
            return stack(trunk, "text"), stack(trunk, "audio")

    class MossSpeechForCausalLM(DecoderModelForCausalLM):
        config_class = MossSpeechConfig

        def __init__(self, config):
            lm_head = ColumnLinear(config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype, gather_output=True)
            super().__init__(config, MossSpeechTransformer(config), lm_head)
            self.audio_lm_head = ColumnLinear(
                config.hidden_size, config.audio_vocab_size, bias=False, dtype=config.dtype, gather_output=True
            )

        def forward(
            self,
            input_ids,
            position_ids=None,  # an engine input; the attention plugin derives rope positions itself
            use_cache=False,
            last_token_ids=None,
            attention_mask=None,
            kv_cache_params=None,
            attention_params=None,
            **features,
        ):
            """Both heads' logits; the arguments are what PretrainedModel.prepare_inputs supplies."""
            unsupported = sorted(k for k, v in features.items() if v is not None)
            if unsupported or attention_mask is not None:
                raise ValueError(f"build features this model does not support: {unsupported or ['attention_mask']}")
            if use_cache and not default_net().plugin_config.paged_kv_cache:
                raise ValueError("MossSpeechForCausalLM needs the paged KV cache")
            attention_params = Attention.fill_attention_params(self, attention_params)
            text, audio = self.transformer(input_ids, use_cache, kv_cache_params, attention_params)
            if last_token_ids is not None:  # absent when the engine gathers context logits
                packed = default_net().plugin_config.remove_input_padding
                text = gather_last_token_logits(text, last_token_ids, packed)
                audio = gather_last_token_logits(audio, last_token_ids, packed)
            logits = self.lm_head(self.transformer.ln_f(text))
            audio_logits = self.audio_lm_head(self.transformer.audio_ln_f(audio))
            logits.mark_output("logits", self.config.logits_dtype)
            audio_logits.mark_output("audio_logits", self.config.logits_dtype)
            return logits, audio_logits

    return MossSpeechConfig, MossSpeechForCausalLM


def required_parameters(model) -> tensorfile.TensorMeta:
    """Name -> (shape, dtype) of what a built (not yet loaded) model needs from a checkpoint."""
    from tensorrt_llm._utils import trt_dtype_to_torch

    return {n: (tuple(p.shape), trt_dtype_to_torch(p.dtype)) for n, p in model.named_parameters() if not p.is_inited()}


def load_model(ckpt_dir: str | Path):
    """The TensorRT-LLM model with the checkpoint's weights, after checking both against the declaration."""
    from safetensors.torch import load_file

    cfg = check_checkpoint(ckpt_dir)
    config_cls, model_cls = model_classes()
    model = model_cls(config_cls(**cfg))
    trtckpt.compare_tensors(
        required_parameters(model), declared_parameters(cfg), "MossSpeechForCausalLM (a bug: definition and declaration differ)"
    )
    model.load(load_file(Path(ckpt_dir) / trtckpt.WEIGHTS))
    return model
