"""Our TensorRT-LLM checkpoint: `config.json` + `rank0.safetensors` (FACTS.md section 3).

Both engines read this one format. Fields beyond TensorRT-LLM's Qwen set (flat, so that
`PretrainedConfig` keeps them as attributes): audio_vocab_size, num_shared_layers,
num_modality_layers, and the three special ids.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from workflow import artifacts, tensorfile
from workflow.errors import InputError, read_json
from workflow.names import fp8_exclude_modules, layer_plan, trt_shapes, trunk_linears
from workflow.spec import ModelSpec
from workflow.tensorfile import TensorMeta

CONFIG, WEIGHTS = "config.json", "rank0.safetensors"
ARCHITECTURE = "MossSpeechForCausalLM"


def trt_config(spec: ModelSpec, fp8: bool = False) -> dict:
    """config.json of a TensorRT-LLM checkpoint for the whole dual-head model."""
    plan = layer_plan(spec)
    quant = {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": None}
    if fp8:
        quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": fp8_exclude_modules(spec)}
    return {
        "architecture": ARCHITECTURE,
        "dtype": "bfloat16",
        "logits_dtype": "float32",
        "vocab_size": spec.vocab_size,
        "audio_vocab_size": spec.audio_vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_shared_layers": spec.num_shared_layers,
        "num_modality_layers": spec.num_modality_layers,
        "text_layers": list(plan["text_block"]),
        "audio_layers": list(plan["audio_block"]),
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_size": spec.head_dim,
        "hidden_act": "silu",
        "norm_epsilon": spec.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": spec.rope_theta,
        "rotary_scaling": None,
        "max_position_embeddings": spec.max_position_embeddings,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": quant,
        "qwen_type": "qwen3",
        "qk_layernorm": True,
        "attn_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_parallel_embedding": False,
        "sosp_token_id": spec.sosp_token_id,
        "eosp_token_id": spec.eosp_token_id,
        "modality_pad_token_id": spec.modality_pad_token_id,
    }


# ModelSpec field -> its name in a TensorRT-LLM config (the rest are spelled alike)
TRT_NAMES = {"head_dim": "head_size", "rms_norm_eps": "norm_epsilon", "rope_theta": "rotary_base"}


def spec_from_trt_config(cfg: dict, source: str = CONFIG) -> ModelSpec:
    """The ModelSpec a TensorRT-LLM checkpoint config describes (InputError if it doesn't)."""
    if cfg.get("architecture") != ARCHITECTURE:
        raise InputError(source, f"architecture is {cfg.get('architecture')!r}, expected {ARCHITECTURE}")
    kwargs = {}
    for f in fields(ModelSpec):
        name = TRT_NAMES.get(f.name, f.name)
        if name not in cfg:
            raise InputError(source, f"field '{name}' is missing")
        kwargs[f.name] = float(cfg[name]) if f.type == "float" else cfg[name]
    spec = ModelSpec(**kwargs)
    if cfg.get("num_hidden_layers") != spec.num_layers:
        raise InputError(source, f"num_hidden_layers {cfg.get('num_hidden_layers')} != {spec.num_layers}")
    return spec


def quant_algo(cfg: dict) -> str | None:
    return (cfg.get("quantization") or {}).get("quant_algo")


def expected_tensors(spec: ModelSpec, fp8: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a checkpoint must hold, with shape and dtype: what the loader requires."""
    out = {name: (shape, torch.bfloat16) for name, shape in trt_shapes(spec).items()}
    if fp8:
        for module in trunk_linears(spec):
            shape, _ = out[f"{module}.weight"]
            out[f"{module}.weight"] = (shape, torch.float8_e4m3fn)
            out[f"{module}.weights_scaling_factor"] = ((1,), torch.float32)
            out[f"{module}.activation_scaling_factor"] = ((1,), torch.float32)
    return out


def check_tensors(tensors: TensorMeta, spec: ModelSpec, fp8: bool, source: str) -> None:
    """InputError naming the first missing, unexpected, mis-shaped or mis-typed tensor."""
    compare_tensors(tensors, expected_tensors(spec, fp8), source)


def compare_tensors(tensors: TensorMeta, want: TensorMeta, source: str) -> None:
    """`tensors` must be exactly `want` (name -> shape, dtype); InputError names the first difference."""
    for name, (shape, dtype) in want.items():
        if name not in tensors:
            raise InputError(source, f"tensor '{name}' is missing")
        got_shape, got_dtype = tensors[name]
        if tuple(got_shape) != shape:
            raise InputError(source, f"tensor '{name}' has shape {list(got_shape)}, expected {list(shape)}")
        if got_dtype != dtype:
            raise InputError(source, f"tensor '{name}' has dtype {got_dtype}, expected {dtype}")
    for name in tensors:
        if name not in want:
            raise InputError(source, f"unexpected tensor '{name}'")


def read_config(ckpt_dir: str | Path) -> tuple[dict, ModelSpec]:
    path = Path(ckpt_dir) / CONFIG
    cfg = read_json(path)
    return cfg, spec_from_trt_config(cfg, str(path))


def load_checkpoint(ckpt_dir: str | Path, device: str = "cpu") -> tuple[dict, ModelSpec, dict[str, torch.Tensor]]:
    """Read and check a checkpoint: config, spec and every tensor (InputError on any defect).

    The header is checked first (names, shapes, dtypes, size), so a bad file is refused before
    any tensor is read."""
    cfg, spec = read_config(ckpt_dir)
    path = Path(ckpt_dir) / WEIGHTS
    check_tensors(tensorfile.read_header(path), spec, quant_algo(cfg) == "FP8", str(path))
    try:
        with safe_open(path, framework="pt", device=device) as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise InputError(path, f"not a readable safetensors file ({e})") from None
    return cfg, spec, tensors


def save_checkpoint(out: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write config.json, rank0.safetensors and manifest.json into `out` (an atomic_dir)."""
    (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, out / WEIGHTS, metadata={"format": "pt"})
    artifacts.write_manifest(out)
