"""Synthetic MOSS-Speech checkpoints, written exactly as the hub lays them out.

Random weights with a planted "noisy bigram" structure, so that next-token distributions are
peaked with a margin, as a trained model's are (plain Gaussian heads give distributions whose
top-1 flips under any small perturbation, which would make agreement metrics meaningless):

- each head row is a scaled copy of one input embedding (a random permutation), so the head
  predicts a fixed successor of the current token; random decoder layers perturb that by context;
- a few percent of text tokens carry a "trigger" direction that the start-of-speech row of the
  text head reads, and likewise some audio codes for end-of-speech, so greedy generation
  switches modality every few dozen steps, as real traffic does;
- start-of-speech shares its embedding with an audio code and end-of-speech with a text token,
  so the first token after a switch is predictable too.

Every tensor is random, norm weights included (never all ones, so a dropped norm shows).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from workflow.names import hf_shapes, layer_plan
from workflow.spec import FIRST_SPECIAL_TEXT_ID, ModelSpec, hf_config


@dataclass(frozen=True)
class Planting:
    """Constants of the planted structure (see the module docstring)."""

    logit_scale: float = 20.0  # logit of a perfectly aligned row
    switch_boost: float = 1.5  # start/end-of-speech rows, relative to a successor row
    trigger_strength: float = 1.0  # trigger component, relative to the embedding's norm
    text_trigger_fraction: float = 0.04
    audio_trigger_fraction: float = 0.03
    residual_gain: float = 1.0  # rms of all layer outputs summed, relative to the embedding


def synthetic_state(spec: ModelSpec, seed: int, device: str = "cpu", plant: Planting = Planting()) -> dict[str, torch.Tensor]:
    """All tensors of a MOSS-Speech checkpoint (float32, on `device`), seeded."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, v, va, eosp = spec.hidden_size, spec.vocab_size, spec.audio_vocab_size, spec.eosp_token_id

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * std

    def uniform(*shape: int, lo: float = 0.7, hi: float = 1.3) -> torch.Tensor:
        return torch.rand(*shape, generator=g, device=device) * (hi - lo) + lo

    def unit() -> torch.Tensor:
        u = randn(h)
        return u / u.norm()

    c = plant.logit_scale
    text_emb, audio_emb = randn(v, h), randn(va, h)
    # Heads: row succ[t] is a copy of token t's embedding -> the head predicts succ[t] after t.
    text_head = torch.zeros(v, h, device=device)
    text_head[torch.randperm(v, generator=g, device=device)] = text_emb * (c / h)
    audio_head = randn(va, h, std=0.1 * c / h)  # padding rows stay small: never predicted
    codes = torch.arange(eosp, device=device)
    audio_head[codes[torch.randperm(eosp, generator=g, device=device)]] = audio_emb[:eosp] * (c / h)
    # Modality switches: trigger tokens carry a direction that the switch rows read.
    u_text, u_audio = unit(), unit()
    text_head[spec.sosp_token_id] = u_text * (c * plant.switch_boost / math.sqrt(h))
    audio_head[eosp] = u_audio * (c * plant.switch_boost / math.sqrt(h))
    a = plant.trigger_strength * math.sqrt(h)
    n_text = int(plant.text_trigger_fraction * FIRST_SPECIAL_TEXT_ID)
    n_audio = int(plant.audio_trigger_fraction * eosp)
    text_emb[torch.randperm(FIRST_SPECIAL_TEXT_ID, generator=g, device=device)[:n_text]] += a * u_text
    audio_emb[torch.randperm(eosp, generator=g, device=device)[:n_audio]] += a * u_audio
    text_emb[spec.sosp_token_id] = audio_emb[int(torch.randint(eosp, (1,), generator=g, device=device))]
    audio_emb[eosp] = text_emb[int(torch.randint(FIRST_SPECIAL_TEXT_ID, (1,), generator=g, device=device))]

    state = {
        "model.embed_tokens.weight": text_emb,
        "model.audio_embed.weight": audio_emb,
        "model.text_norm.weight": uniform(h),
        "model.audio_norm.weight": uniform(h),
        "text_lm_head.weight": text_head,
        "audio_lm_head.weight": audio_head,
    }
    # Each sublayer adds an output of rms `gain`, so a whole path adds about residual_gain.
    path_layers = spec.num_shared_layers + spec.num_modality_layers
    gain = plant.residual_gain / math.sqrt(2 * path_layers)
    q, kv, i = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim, spec.intermediate_size
    for block, layers in layer_plan(spec).items():
        for n in range(len(layers)):
            p = f"model.{block}.layers.{n}."
            state |= {
                p + "self_attn.q_proj.weight": randn(q, h, std=h**-0.5),
                p + "self_attn.k_proj.weight": randn(kv, h, std=h**-0.5),
                p + "self_attn.v_proj.weight": randn(kv, h, std=h**-0.5),
                p + "self_attn.o_proj.weight": randn(h, q, std=gain * q**-0.5),
                p + "self_attn.q_norm.weight": uniform(spec.head_dim),
                p + "self_attn.k_norm.weight": uniform(spec.head_dim),
                p + "mlp.gate_proj.weight": randn(i, h, std=h**-0.5),
                p + "mlp.up_proj.weight": randn(i, h, std=h**-0.5),
                # silu(x) * y for unit normals has rms about 0.6
                p + "mlp.down_proj.weight": randn(h, i, std=gain / 0.6 * i**-0.5),
                p + "input_layernorm.weight": uniform(h),
                p + "post_attention_layernorm.weight": uniform(h),
            }
    assert {k: tuple(t.shape) for k, t in state.items()} == hf_shapes(spec)
    return state


def shard_names(state: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Split tensor names into shards of about equal bytes, in checkpoint order."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for name, t in state.items():
        shards[min(num_shards - 1, done * num_shards // total)].append(name)
        done += t.numel() * t.element_size()
    return [s for s in shards if s]


def write_hf_checkpoint(out: Path, spec: ModelSpec, state: dict[str, torch.Tensor], num_shards: int, dtype: torch.dtype) -> None:
    """Write config.json, model-0000i-of-0000n.safetensors and model.safetensors.index.json."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: t.to(dtype).contiguous().cpu() for k, t in state.items()}
    groups = shard_names(state, num_shards)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n] for n in names}, out / fname, metadata={"format": "pt"})
        weight_map |= {n: fname for n in names}
    size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    dtype_name = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config(spec, dtype_name), indent=2))
