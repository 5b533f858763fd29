"""Seeded bugs, in one table: each must make verify fail, on the metric named here.

A bug changes a correct checkpoint (as convert or calibrate writes it) before build, a loaded
engine (faults that live only in a running engine), or the generation loop (`loop` replaces
workflow.generate.advance). `fails` is the start of the verify failure that must report it:
`config.` (a field differs from the HF config), `teacher_forced.` (prefill logits differ),
`teacher_forced_decode.` (only logits read through the KV caches differ), `ragged.` (only
logits of slots at different lengths differ) or `greedy.`. A bug
whose checkpoint build must refuse names the one-line message instead (`refused_at_build`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workflow.engines.torch_engine import TorchEngine
from workflow.generate import advance
from workflow.names import layer_plan
from workflow.spec import ModelSpec

Mutate = Callable[[dict[str, torch.Tensor], dict, ModelSpec], None]


@dataclass(frozen=True)
class SeededBug:
    name: str
    precision: str  # bf16: applied to convert's checkpoint; fp8: to calibrate's
    fails: str = "teacher_forced."
    checkpoint: Mutate | None = None
    engine: Callable[[TorchEngine], None] | None = None
    loop: Callable | None = None  # in place of workflow.generate.advance
    refused_at_build: str | None = None  # the problem build reports, for a checkpoint it must refuse


def _layer(spec: ModelSpec, block: str = "shared_block", i: int = -1) -> str:
    return f"transformer.layers.{layer_plan(spec)[block][i]}."


def _swap(t: dict[str, torch.Tensor], a: str, b: str) -> None:
    t[a], t[b] = t[b], t[a]


def swap_mlp_halves(t, cfg, spec):
    """fc (SiLU side, gate_proj) and gate (up_proj) exchanged: TensorRT-LLM's confusing names."""
    p = _layer(spec)
    _swap(t, p + "mlp.fc.weight", p + "mlp.gate.weight")


def drop_qk_norm(t, cfg, spec):
    """Qwen3's q/k norms replaced by identity (a Qwen2 converter would do this)."""
    for name in t:
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            t[name] = torch.ones_like(t[name])


def transpose_dense(t, cfg, spec):
    """One square weight written transposed (attention.dense of the tiny model is 128 x 128)."""
    name = _layer(spec, i=1) + "attention.dense.weight"
    assert t[name].shape[0] == t[name].shape[1], "needs a square weight to still load"
    t[name] = t[name].T.contiguous()


def wrong_rope_base(t, cfg, spec):
    """rope_theta lost in conversion: Qwen2's default base instead of 1e6."""
    cfg["rotary_base"] = 10_000.0


def swap_final_norms(t, cfg, spec):
    """The text and audio branches' final norms exchanged (same shape, so it loads)."""
    _swap(t, "transformer.ln_f.weight", "transformer.audio_ln_f.weight")


def norm_epsilon_10x(t, cfg, spec):
    """The norm epsilon written 10 times too large: on the tiny model's activations the logits
    move less than the thresholds allow, so only the config check can see it."""
    assert cfg["norm_epsilon"] == 1e-6
    cfg["norm_epsilon"] = 1e-5


def swap_heads(t, cfg, spec):
    """The text and audio heads exchanged: different shapes, so build must refuse it."""
    _swap(t, "lm_head.weight", "audio_lm_head.weight")


def double_fp8_weight_scale(t, cfg, spec):
    """One FP8 weight scale off by 2x (amax / 224 instead of amax / 448)."""
    t[_layer(spec, i=1) + "mlp.proj.weights_scaling_factor"] *= 2


def alias_branch_kv_cache(engine: TorchEngine) -> None:
    """The audio branch's layers use the text branch's KV cache, as a public 32+4+4 TensorRT-LLM
    build did by starting both branches at layer 32. Prefill still computes every logit right
    (each branch writes its keys before reading them); decoding, the text branch reads the
    audio branch's history (the audio branch writes last, so it reads its own)."""
    for text, audio in zip(engine.text_block, engine.audio_block, strict=True):
        audio.k_cache, audio.v_cache = text.k_cache, text.v_cache


def deferred_fill_skips_a_position(engine: TorchEngine) -> None:
    """The text branch deferred in audio mode, and its catch-up starting one position late: the
    text cache keeps a hole there (stale keys, not this sequence's), which only text logits
    after a spoken reply read, as greedy generation does."""
    engine.defer_text_fill = True
    catch_up = engine._catch_up_text

    def skipping(b: int) -> None:
        slots = engine.slots
        slots.filled = [f + (f < n) for f, n in zip(slots.filled, slots.length, strict=True)]
        catch_up(b)

    engine._catch_up_text = skipping


def slot_reads_another_slots_length(engine: TorchEngine) -> None:
    """Decode attention masked by the first row's length for every row: in lockstep, where all
    rows have one length, nothing shows; in a ragged batch a slot reads positions past its own
    length (stale keys of an earlier stream) or misses its last ones."""
    at = engine.at

    def shared(pos, rows, kv_len):
        a = at(pos, rows, kv_len)
        return a if a.mask is None else a._replace(mask=a.mask[:1].expand_as(a.mask))

    engine.at = shared


def swap_leaves_positions(engine: TorchEngine) -> None:
    """A step of some of the slots swaps their rows' caches to the front but not their positions:
    with every slot stepping no row moves so, and nothing shows; a slot that sat out a step and
    then steps from another row writes and reads at the other stream's position."""

    def caches_only(swaps: list[tuple[int, int]]) -> None:
        for a, b in swaps:
            ab, ba = torch.tensor([a, b]), torch.tensor([b, a])
            for t in engine.caches():
                t[ab] = t[ba]

    engine._swap = caches_only


def switch_fed_in_its_new_mode(text_tok, audio_tok, audio_mode, ids):
    """The step that switches modality fed as if sampled in the mode it switches to: the
    start-of-speech step embedded as an audio position, the end-of-speech step as the text token
    sampled beside it. Every other step is fed right, so only runs that switch can see it."""
    next_mode = torch.where(audio_mode, audio_tok != ids.eosp, text_tok == ids.sosp)
    tokens, _, stopped = advance(text_tok, audio_tok, next_mode, ids)
    return tokens, next_mode, stopped


BUGS = [
    SeededBug("mlp_halves_swapped", "bf16", checkpoint=swap_mlp_halves),
    SeededBug("qk_norm_dropped", "bf16", checkpoint=drop_qk_norm),
    SeededBug("weight_transposed", "bf16", checkpoint=transpose_dense),
    SeededBug("rope_base_wrong", "bf16", checkpoint=wrong_rope_base),
    SeededBug("norm_epsilon_10x", "bf16", fails="config.norm_epsilon 1e-05 vs 1e-06", checkpoint=norm_epsilon_10x),
    SeededBug("final_norms_swapped", "bf16", checkpoint=swap_final_norms),
    SeededBug(
        "heads_swapped",
        "bf16",
        checkpoint=swap_heads,
        refused_at_build="tensor 'lm_head.weight' has shape [16512, 128], expected [151680, 128]",
    ),
    SeededBug("branch_kv_cache_aliased", "bf16", fails="teacher_forced_decode.text.", engine=alias_branch_kv_cache),
    SeededBug("fp8_weight_scale_2x", "fp8", checkpoint=double_fp8_weight_scale),
    SeededBug(
        "deferred_text_fill_skips_a_position", "bf16", fails="teacher_forced_decode.text.", engine=deferred_fill_skips_a_position
    ),
    SeededBug("slot_reads_another_slots_length", "bf16", fails="ragged.", engine=slot_reads_another_slots_length),
    SeededBug("swap_leaves_positions", "bf16", fails="ragged.", engine=swap_leaves_positions),
    SeededBug("switch_embedded_wrong", "bf16", fails="greedy.match_fraction", loop=switch_fed_in_its_new_mode),
]
