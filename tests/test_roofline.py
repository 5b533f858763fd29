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


def test_prefill_flops_are_two_per_weight_per_token_plus_attention():
    tokens = 512
    flops = roofline.prefill_flops(FULL, tokens)
    linears = 2 * tokens * FULL.num_layers * roofline.layer_params(FULL)
    assert linears < flops < 1.05 * linears  # attention at 512 tokens is a few per cent
    assert flops / 1e12 == pytest.approx(7.9, abs=0.2)
