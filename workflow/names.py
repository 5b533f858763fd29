"""The Hugging Face -> TensorRT-LLM name table and the decoder-layer plan.

One table, read in both directions. Each row says: this TensorRT-LLM tensor is the row-wise
concatenation of these Hugging Face tensors (q/k/v -> qkv; text + audio embedding -> one
table). Names that are ours, not TensorRT-LLM's: `transformer.audio_ln_f` (audio_norm) and
`audio_lm_head` (the second head). The audio embedding has no name of its own: its rows
follow the text rows in `transformer.vocab_embedding`, so an audio id a is row vocab_size + a.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from workflow.spec import ModelSpec

# (TensorRT-LLM suffix, Hugging Face suffixes concatenated along dim 0), per decoder layer.
# Note the MLP: TensorRT-LLM's `fc` is the SiLU side (gate_proj), its `gate` is up_proj.
LAYER_TABLE: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "attention.qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    ("attention.dense.weight", ("self_attn.o_proj.weight",)),
    ("attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    ("attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
    ("mlp.fc.weight", ("mlp.gate_proj.weight",)),
    ("mlp.gate.weight", ("mlp.up_proj.weight",)),
    ("mlp.proj.weight", ("mlp.down_proj.weight",)),
    ("input_layernorm.weight", ("input_layernorm.weight",)),
    ("post_layernorm.weight", ("post_attention_layernorm.weight",)),
)

GLOBAL_TABLE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("transformer.vocab_embedding.weight", ("model.embed_tokens.weight", "model.audio_embed.weight")),
    ("transformer.ln_f.weight", ("model.text_norm.weight",)),
    ("transformer.audio_ln_f.weight", ("model.audio_norm.weight",)),
    ("lm_head.weight", ("text_lm_head.weight",)),
    ("audio_lm_head.weight", ("audio_lm_head.weight",)),
)

# The linear layers of a decoder layer, by TensorRT-LLM module suffix (FP8 quantizes these).
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")

BLOCKS = ("shared_block", "text_block", "audio_block")


def layer_plan(spec: ModelSpec) -> dict[str, range]:
    """TensorRT-LLM layer indices (= KV-cache layer indices) of each block: trunk 0..S-1,
    text S..S+M-1, audio S+M..S+2M-1. Distinct, so no branch touches another's cache."""
    s, m = spec.num_shared_layers, spec.num_modality_layers
    return {
        "shared_block": range(0, s),
        "text_block": range(s, s + m),
        "audio_block": range(s + m, s + 2 * m),
    }


def name_table(spec: ModelSpec) -> list[tuple[str, tuple[str, ...]]]:
    """Every TensorRT-LLM tensor of the bf16 checkpoint with the HF tensors it is made of."""
    rows = list(GLOBAL_TABLE)
    for block, layers in layer_plan(spec).items():
        for i, n in enumerate(layers):
            for trt, hfs in LAYER_TABLE:
                rows.append(
                    (
                        f"transformer.layers.{n}.{trt}",
                        tuple(f"model.{block}.layers.{i}.{h}" for h in hfs),
                    )
                )
    return rows


def _layer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    return {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a MOSS-Speech HF checkpoint with its shape (FACTS.md section 1)."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.audio_embed.weight": (spec.audio_vocab_size, h),
        "model.text_norm.weight": (h,),
        "model.audio_norm.weight": (h,),
        "text_lm_head.weight": (spec.vocab_size, h),
        "audio_lm_head.weight": (spec.audio_vocab_size, h),
    }
    per_layer = _layer_shapes(spec)
    for block, layers in layer_plan(spec).items():
        for i in range(len(layers)):
            for suffix, shape in per_layer.items():
                shapes[f"model.{block}.layers.{i}.{suffix}"] = shape
    return shapes


def trt_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of our bf16 TensorRT-LLM checkpoint with its shape."""
    hf = hf_shapes(spec)
    return {trt: (sum(hf[n][0] for n in hfs), *hf[hfs[0]][1:]) for trt, hfs in name_table(spec)}


def hf_to_trt(hf: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Apply the table: each TensorRT-LLM tensor is its HF tensors concatenated on dim 0."""
    return {
        trt: torch.cat([hf[n] for n in hfs], dim=0).contiguous() if len(hfs) > 1 else hf[hfs[0]] for trt, hfs in name_table(spec)
    }


def trt_to_hf(trt: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The table read backwards: split each TensorRT-LLM tensor into its HF tensors."""
    shapes = hf_shapes(spec)
    out: dict[str, torch.Tensor] = {}
    for name, hfs in name_table(spec):
        parts = torch.split(trt[name], [shapes[n][0] for n in hfs], dim=0)
        out.update({n: p.contiguous() for n, p in zip(hfs, parts, strict=True)})
    return out


def trunk_linears(spec: ModelSpec) -> list[str]:
    """TensorRT-LLM module names of the shared block's linear layers (what FP8 quantizes)."""
    return [f"transformer.layers.{n}.{lin}" for n in layer_plan(spec)["shared_block"] for lin in LINEARS]


def fp8_exclude_modules(spec: ModelSpec) -> list[str]:
    """TensorRT-LLM `exclude_modules` for a trunk-only FP8 checkpoint.

    It replaces TensorRT-LLM's defaults, so both heads, the embedding and every branch layer
    are listed explicitly (fnmatch patterns over module names).
    """
    plan = layer_plan(spec)
    branch = [*plan["text_block"], *plan["audio_block"]]
    return [
        "lm_head",
        "audio_lm_head",
        "transformer.vocab_embedding",
        *(f"transformer.layers.{n}.*" for n in branch),
    ]
