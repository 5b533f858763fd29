"""A MOSS-Speech checkpoint made the way a user's arrives, independently of workflow/: the hub's
layout (config.json, three safetensors shards and their index, with shard boundaries inside a
layer), plain random weights (no planted structure: greedy output switches modality rarely, if
ever) and sizes unlike any preset. Tensor names are written here from FACTS.md section 1, not
taken from workflow.names, so a wrong name table fails download's validation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Real vocabularies and special ids; everything else unlike the tiny and full presets.
CONFIG = {
    "architectures": ["MossSpeechForCausalLM"],
    "model_type": "moss_speech",
    "vocab_size": 151680,
    "audio_vocab_size": 16512,
    "hidden_size": 160,
    "intermediate_size": 352,
    "num_hidden_layers": 6,
    "num_shared_layers": 4,
    "num_modality_layers": 2,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "sosp_token_id": 151646,
    "eosp_token_id": 16384,
    "modality_pad_token_id": 151667,
    "torch_dtype": "bfloat16",
}
SHARDS = 3
STD = 0.02  # transformers' initializer_range


def tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor, in the hub's order: embeddings, then block by block, then norms and heads."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * STD

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    out = {
        "model.embed_tokens.weight": normal(cfg["vocab_size"], h),
        "model.audio_embed.weight": normal(cfg["audio_vocab_size"], h),
    }
    branch = cfg["num_modality_layers"]
    for block, layers in (("shared_block", cfg["num_shared_layers"]), ("text_block", branch), ("audio_block", branch)):
        for n in range(layers):
            p = f"model.{block}.layers.{n}."
            out |= {
                p + "input_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": normal(q, h),
                p + "self_attn.k_proj.weight": normal(kv, h),
                p + "self_attn.v_proj.weight": normal(kv, h),
                p + "self_attn.o_proj.weight": normal(h, q),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "post_attention_layernorm.weight": norm(h),
                p + "mlp.gate_proj.weight": normal(i, h),
                p + "mlp.up_proj.weight": normal(i, h),
                p + "mlp.down_proj.weight": normal(h, i),
            }
    out |= {
        "model.text_norm.weight": norm(h),
        "model.audio_norm.weight": norm(h),
        "text_lm_head.weight": normal(cfg["vocab_size"], h),
        "audio_lm_head.weight": normal(cfg["audio_vocab_size"], h),
    }
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def write(out: Path, seed: int = 5) -> Path:
    """The checkpoint in `out`; shard k starts at the k-th third of the tensor list, which
    falls inside a layer (asserted)."""
    out.mkdir(parents=True)
    state = tensors(CONFIG, seed)
    names = list(state)
    cuts = [len(names) * k // SHARDS for k in range(SHARDS + 1)]
    weight_map = {}
    for k in range(SHARDS):
        first = names[cuts[k]]
        assert k == 0 or (".layers." in first and not first.endswith("input_layernorm.weight")), "a split inside a layer"
        fname = f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file({n: state[n] for n in names[cuts[k] : cuts[k + 1]]}, out / fname, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names[cuts[k] : cuts[k + 1]], fname)
    size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    return out
