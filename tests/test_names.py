"""The HF <-> TensorRT-LLM name table."""

import torch

from workflow.names import (
    GLOBAL_TABLE,
    LAYER_TABLE,
    fp8_exclude_modules,
    hf_shapes,
    hf_to_trt,
    layer_plan,
    name_table,
    trt_shapes,
    trt_to_hf,
    trunk_linears,
)
from workflow.spec import PRESETS

TINY, FULL = PRESETS["tiny"], PRESETS["full"]


def random_hf(spec):
    return {k: torch.randn(s) for k, s in hf_shapes(spec).items()}


def test_round_trip_is_identity():
    hf = random_hf(TINY)
    back = trt_to_hf(hf_to_trt(hf, TINY), TINY)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_table_uses_every_hf_tensor_exactly_once():
    used = [h for _, hfs in name_table(FULL) for h in hfs]
    assert sorted(used) == sorted(hf_shapes(FULL))
    assert len(trt_shapes(FULL)) == len(name_table(FULL))


def test_full_shape_counts_match_the_hub():
    shapes = hf_shapes(FULL)
    assert len(shapes) == 446  # FACTS.md: 446 tensors
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert abs(params / 1e9 - 9.096) < 0.01


def test_mlp_names_follow_tensorrt_llm():
    """TensorRT-LLM's fc is the SiLU side (gate_proj) and its gate is up_proj."""
    table = dict(LAYER_TABLE)
    assert table["mlp.fc.weight"] == ("mlp.gate_proj.weight",)
    assert table["mlp.gate.weight"] == ("mlp.up_proj.weight",)
    assert table["attention.qkv.weight"] == tuple(f"self_attn.{x}_proj.weight" for x in "qkv")


def test_qkv_and_embedding_concatenate_in_order():
    hf = random_hf(TINY)
    trt = hf_to_trt(hf, TINY)
    s = TINY.num_shared_layers
    qkv = trt[f"transformer.layers.{s}.attention.qkv.weight"]  # first text-branch layer
    q = hf["model.text_block.layers.0.self_attn.q_proj.weight"]
    k = hf["model.text_block.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[: q.shape[0]], q)
    assert torch.equal(qkv[q.shape[0] : q.shape[0] + k.shape[0]], k)
    emb = trt["transformer.vocab_embedding.weight"]
    assert emb.shape[0] == TINY.vocab_size + TINY.audio_vocab_size
    assert torch.equal(emb[TINY.vocab_size + 7], hf["model.audio_embed.weight"][7])
    assert torch.equal(emb[7], hf["model.embed_tokens.weight"][7])


def test_layer_plan_gives_each_branch_its_own_cache_indices():
    plan = layer_plan(FULL)
    assert list(plan["shared_block"]) == list(range(32))
    assert list(plan["text_block"]) == [32, 33, 34, 35]
    assert list(plan["audio_block"]) == [36, 37, 38, 39]
    tiny = layer_plan(TINY)
    assert not set(tiny["text_block"]) & set(tiny["audio_block"])
    assert len(tiny["text_block"]) >= 2


def test_global_names_of_ours_are_few_and_named():
    ours = {trt for trt, _ in GLOBAL_TABLE} - {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    assert ours == {"transformer.audio_ln_f.weight", "audio_lm_head.weight"}


def test_fp8_scope_is_the_trunk_and_exclusions_cover_the_rest():
    lin = trunk_linears(FULL)
    assert len(lin) == 32 * 5
    excl = fp8_exclude_modules(FULL)
    assert {"lm_head", "audio_lm_head", "transformer.vocab_embedding"} <= set(excl)
