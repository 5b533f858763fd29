"""The floors' arithmetic, checked against FACTS.md's independent figures."""

import pytest

from workflow import roofline
from workflow.spec import PRESETS

FULL = PRESETS["full"]


def test_decode_step_bytes_match_the_published_floors():
    # FACTS.md 5: one step reads trunk + both branches + both heads = 16.8 GB in bf16; skipping
    # the text head in audio mode saves 1.24 GB; an FP8 trunk brings the whole step to about 10.6 GB
    assert roofline.step_bytes(FULL, 2, 2, need_text=True) / 1e9 == pytest.approx(16.8, abs=0.1)
    text_head = roofline.step_bytes(FULL, 2, 2, True) - roofline.step_bytes(FULL, 2, 2, False)
    assert text_head / 1e9 == pytest.approx(1.24, abs=0.01)
    assert roofline.step_bytes(FULL, 1, 2, need_text=True) / 1e9 == pytest.approx(10.6, abs=0.2)


def test_an_audio_step_that_defers_the_text_branch_reads_one_branch_less():
    # 4 Qwen3-8B-shaped layers (FACTS.md 1: 4096 hidden, 12288 intermediate, 32 x 128 queries,
    # 8 x 128 keys and values): 4 x 192.9 M weights = 1.54 GB in bf16, whatever the trunk's precision
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288
    for trunk in (2, 1):
        branch = roofline.step_bytes(FULL, trunk, 2, False) - roofline.step_bytes(FULL, trunk, 2, False, text_branch=False)
        assert branch == pytest.approx(4 * layer * 2, rel=1e-3)
    assert roofline.step_bytes(FULL, 2, 2, True, text_branch=False) == roofline.step_bytes(FULL, 2, 2, True)  # text mode: read


def test_prefill_flops_are_two_per_weight_per_token_plus_attention():
    tokens = 512
    flops = roofline.prefill_flops(FULL, tokens)
    linears = 2 * tokens * FULL.num_layers * roofline.layer_params(FULL)
    assert linears < flops < 1.05 * linears  # attention at 512 tokens is a few per cent
    assert flops / 1e12 == pytest.approx(7.9, abs=0.2)
