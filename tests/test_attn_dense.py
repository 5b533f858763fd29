"""The fused attention + dense kernel (Triton's interpreter here, each phase a launch) against
the two kernels it replaces, decode_attention then the GEMV with its residual, and the FP8
arithmetic against torch's."""

import pytest
import torch
from test_attention import EPS, HKV, make

from workflow import fp8
from workflow.engines import attention, attn_dense, gemv

pytestmark = pytest.mark.skipif(not attn_dense.available(), reason="needs triton")


def inputs(g: int, d: int, kv_len: int, pos: int, n: int, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    a = make(1, g, d, kv_len, pos, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return a, torch.randn(n, g * HKV * d, generator=gen) / 8, torch.randn(1, 1, n, generator=gen)


@pytest.mark.parametrize(("g", "d", "kv_len", "pos", "splits", "n"), [
    (4, 32, 128, 70, 1, 64),  # one slice: no combine phase
    (4, 32, 256, 200, 4, 64),  # four slices, combined by the first H programs
    (2, 128, 256, 255, 2, 48),  # pos the last position; N not a multiple of ROWS
    (4, 32, 512, 300, 0, 2048),  # choose_splits; K 256 in PRE_K chunks when the byte budget is small
])  # fmt: skip
def test_equals_attention_then_the_gemv(g, d, kv_len, pos, splits, n, monkeypatch):
    if n == 2048:
        monkeypatch.setattr(attn_dense, "SHAPES", ((16, 8, 2, 16 * 64 * 4),))  # PRE_K 64 of K 256: the rest in a loop
    a, w, res = inputs(g, d, kv_len, pos, n)
    b = {k: v.clone() for k, v in a.items()}
    want = gemv.launch(attention.launch(**a, kv_len=kv_len, eps=EPS, splits=splits), w, torch.float32, residual=res)
    got = attn_dense.launch(**b, kv_len=kv_len, eps=EPS, w=w, residual=res, splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(b["k_cache"], a["k_cache"]) and torch.equal(b["v_cache"], a["v_cache"])  # the new row, once


def test_fp8_dense_reads_attention_quantized_and_scales_as_scaled_mm():
    """FP8: attention's output quantized with dense's activation scale in the kernel, dense's
    weight FP8 with its scale: acc * (a_scale * w_scale), then the residual, as project does."""
    a, w, res = inputs(4, 32, 256, 130, 64)
    b = {k: v.clone() for k, v in a.items()}
    a_scale, w_scale = torch.tensor([0.02]), torch.tensor([0.004])
    wq = fp8.quantize(w, w_scale)
    y = attention.launch(**a, kv_len=256, eps=EPS, quant=a_scale)
    want = gemv.launch(y, wq, torch.float32, scale=a_scale * w_scale, residual=res)
    got = attn_dense.launch(**b, kv_len=256, eps=EPS, w=wq, residual=res, scale=a_scale * w_scale, quant=a_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = res + (y.float() * a_scale) @ (wq.float() * w_scale).T  # the arithmetic of torch._scaled_mm, in float32
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)


def test_rejects_what_it_cannot_take():
    a, w, res = inputs(4, 32, 128, 5, 64)
    with pytest.raises(ValueError, match="does not fit"):
        attn_dense.launch(**a, kv_len=128, eps=EPS, w=w[:, :-1], residual=res)
    with pytest.raises(ValueError, match="does not fit"):
        attn_dense.launch(**a, kv_len=128, eps=EPS, w=fp8.quantize(w, torch.tensor([0.01])), residual=res)  # no scale
    two = make(2, 4, 32, 128, 5)
    with pytest.raises(ValueError, match="one sequence"):
        attn_dense.launch(**two, kv_len=128, eps=EPS, w=w, residual=torch.zeros(2, 1, 64))


def test_engine_decodes_like_the_reference_through_the_fused_kernel(tiny_engine_dir, tiny_hf, monkeypatch):
    """The tiny model at batch 1 across modality switches, attention + dense fused: against
    transformers, and the fused kernel did run (a path that silently fell back would pass too)."""
    from test_engine import assert_decode_matches_reference
    from test_gemv import engines

    from workflow.download import load_hf_state
    from workflow.reference import MossSpeechReference
    from workflow.spec import load_spec

    launches = []
    kernel = attn_dense._attn_dense

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attn_dense, "_attn_dense", Counted())
    ref = MossSpeechReference(load_spec(tiny_hf), load_hf_state(tiny_hf), torch.float32, "cpu")
    _, engine = engines(tiny_engine_dir, gemv=True, decode_attention=True, attention_dense=True)
    assert_decode_matches_reference(engine, ref, batch=1, prompt_len=20, steps=4, seed=31)
    assert launches


def test_fp8_engine_through_the_fused_kernel_matches_the_fp8_emulation(tiny_fp8_engine_dir):
    from test_gemv import engines

    from workflow import traffic
    from workflow.generate import Ids

    plain, fused = engines(tiny_fp8_engine_dir, gemv=True, decode_attention=True, attention_dense=True)
    ids = Ids.of(plain.spec)
    prompt, follow = traffic.batch(1, 24, ids, seed=5), traffic.batch(1, 5, ids, seed=6)
    for e in (plain, fused):
        e.prefill(prompt)
    for t in range(follow.shape[1]):
        (pt, pa), (ft, fa) = plain.decode(follow[:, t]), fused.decode(follow[:, t])
        assert (pt - ft).abs().max() < 1e-4 and (pa - fa).abs().max() < 1e-4


def test_engine_refuses_the_fusion_without_both_kernels(tiny_engine_dir):
    from test_gemv import engines

    with pytest.raises(ValueError, match="attention_dense"):
        engines(tiny_engine_dir, gemv=True, attention_dense=True)
