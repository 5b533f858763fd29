"""The fused Triton GEMV (run by Triton's interpreter here) against torch, alone and inside the engine."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from workflow import fp8, trtckpt
from workflow.engines import gemv
from workflow.engines.torch_engine import TorchEngine, rms_norm

pytestmark = pytest.mark.skipif(not gemv.available(), reason="needs triton")


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("block", [(16, 64, 4), (8, 32, 4)])
def test_norm_matmul_residual_in_float32_equals_torch(rows, block):
    """K and N not multiples of the blocks: the masked edges count too."""
    k, n = 200, 37
    x, w, g, r = torch.randn(rows, k), torch.randn(n, k) / 16, torch.rand(k) + 0.5, torch.randn(rows, n)
    got = gemv.launch(x, w, torch.float32, norm=g, eps=1e-6, residual=r, block=block)
    assert torch.allclose(got, r + F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
    assert torch.allclose(gemv.launch(x, w, torch.float32, block=block), F.linear(x, w), atol=1e-5, rtol=1e-5)


def ulp_bf16(t: torch.Tensor) -> torch.Tensor:
    return 2.0 ** (torch.frexp(t.abs().clamp_min(1e-30)).exponent - 8).double()


@pytest.mark.parametrize("rows", [1, 4])
def test_silu_mul_prologue_reads_gate_and_up_halves(rows):
    """proj's input is silu(gate) * up of gate_up's output [gate | up]: the kernel reads both halves."""
    k, n = 160, 24
    gu, w, r = torch.randn(rows, 2 * k), torch.randn(n, k) / 16, torch.randn(rows, n)
    got = gemv.launch(gu, w, torch.float32, residual=r, silu_mul=True, block=(8, 64, 4))
    gate, up = gu.chunk(2, dim=-1)
    assert torch.allclose(got, r + F.linear(F.silu(gate) * up, w), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="columns"):
        gemv.launch(gate, w, torch.float32, silu_mul=True)
    with pytest.raises(ValueError, match="do not combine"):
        gemv.launch(gu, w, torch.float32, norm=torch.ones(k), silu_mul=True)


@pytest.mark.parametrize("block_k", [32, 128])
def test_deferred_body_equals_torch(block_k):
    """One row, partial sums kept per column of the tile and reduced once: torch's result, with
    the norm prologue and residual epilogue, and with the silu prologue; K spans several tiles
    with a ragged end. Four rows asking for it fall back to the per-tile body."""
    k, n = 200, 37
    x, w, g, r = torch.randn(1, k), torch.randn(n, k) / 16, torch.rand(k) + 0.5, torch.randn(1, n)
    got = gemv.launch(x, w, torch.float32, norm=g, eps=1e-6, residual=r, block=(8, block_k, 4, 1))
    assert torch.allclose(got, r + F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
    gu = torch.randn(1, 2 * k)
    got = gemv.launch(gu, w, torch.float32, silu_mul=True, block=(4, block_k, 4, 1))
    assert torch.allclose(got, F.linear(F.silu(gu[:, :k]) * gu[:, k:], w), atol=1e-5, rtol=1e-5)
    x4 = torch.randn(4, k)
    assert torch.allclose(gemv.launch(x4, w, torch.float32, block=(8, block_k, 4, 1)), F.linear(x4, w), atol=1e-5)


def test_tuning_offers_fp8_both_bodies_within_the_register_budget():
    found = gemv.candidates(4096, 1)
    assert {c[3] for c in found} == {0, 1}
    assert all(bn * bk <= gemv.DEFER_REGS * 32 * w for bn, bk, w, defer, _, _ in found if defer)
    assert {c[3] for c in gemv.candidates(4096, 2)} == {0}  # bf16: per tile only (probe 11)
    assert all(bk <= 128 for _, bk, *_ in gemv.candidates(100, 2))  # no tile wider than K's power of two
    resident = [c for c in found if c[4]]  # x's whole row in registers: K up to RESIDENT_MAX_K
    assert resident and all(bk == 4096 and not defer for _, bk, _, defer, _, _ in resident)
    assert not any(c[4] for c in gemv.candidates(12288, 2))


def test_tensor_cores_are_offered_to_fp8_weights_read_as_stored():
    """The tensor-core body: FP8 weights whose input needs no prologue (qkv, gate_up: "", dense,
    proj: "res"), never bf16, a norm or silu prologue, or the GLU epilogue."""
    for fl in ("", "res"):
        dot = [c for c in gemv.candidates(4096, 1, fl) if c[5]]
        assert dot and all(not (defer or per_sm) for _, _, _, defer, per_sm, _ in dot)
        assert {c[0] >= 64 for c in dot} == {True, False}  # both operand orders
    for k, nbytes, fl in ((4096, 2, ""), (4096, 2, "res"), (4096, 1, "norm"), (12288, 1, "silu+res"), (4096, 1, "glu")):
        assert not any(c[5] for c in gemv.candidates(k, nbytes, fl))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("block", [(32, 64, 4, 0, 0, 2), (64, 128, 4, 0, 0, 3)])
def test_tensor_core_body_equals_torch(rows, block):
    """FP8 x and w multiplied as stored, each part of w's rows with its own scale, the residual
    added; N and K ragged against the blocks, x's rows padded to 16; a prologue is refused."""
    k, n = 200, 70
    w, a, ws = torch.randn(n, k), torch.tensor([0.02]), torch.tensor([0.004, 0.01])
    w8 = torch.cat([fp8.quantize(w[: n // 2], ws[:1]), fp8.quantize(w[n // 2 :], ws[1:])])
    xq, r = fp8.quantize(torch.randn(rows, k), a), torch.randn(rows, n)
    got = gemv.launch(xq, w8, torch.float32, scale=a * ws, residual=r, block=block)
    deq = torch.cat([w8[: n // 2].double() * ws[0].item(), w8[n // 2 :].double() * ws[1].item()])
    want = r.double() + (xq.double() * a.item()) @ deq.t()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="tensor-core"):
        gemv.launch(xq, w8, torch.float32, scale=a * ws, norm=torch.ones(k), block=block)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter rounds to bf16 by truncation")
def test_bf16_rounds_like_torch():
    """bf16 in and out, as `x + F.linear(rms_norm(h))` rounds: the normed input exactly, the
    product rounded to bf16, then the residual added and rounded again. Only the order of the
    float32 sums differs, so the result is torch's within one ulp of the product, and mostly
    bit-identical."""
    k, n = 256, 64
    x, w = torch.randn(2, k, dtype=torch.bfloat16), (torch.randn(n, k) / 16).to(torch.bfloat16)
    g, r = (torch.rand(k) + 0.5).to(torch.bfloat16), torch.randn(2, n, dtype=torch.bfloat16)
    x, w, g, r = (t.cuda() for t in (x, w, g, r))
    got = gemv.launch(x, w, torch.bfloat16, norm=g, eps=1e-6, residual=r, block=(16, 64, 4)).double()
    product = F.linear(rms_norm(x, g, 1e-6).float(), w.float())
    want = (product.to(torch.bfloat16) + r).double()
    assert ((got - want).abs() <= ulp_bf16(product) + ulp_bf16(want) / 2).all()
    assert (got == want).float().mean() > 0.9


def test_fp8_parts_take_their_own_scale():
    """fc|gate fused: each half of the rows has its own weight scale, as two _scaled_mm would."""
    k, n = 128, 32
    w, a, ws = torch.randn(n, k), torch.tensor([0.02]), torch.tensor([0.004, 0.01])
    w8 = torch.cat([fp8.quantize(w[: n // 2], ws[:1]), fp8.quantize(w[n // 2 :], ws[1:])])
    xq = fp8.quantize(torch.randn(1, k), a)
    got = gemv.launch(xq, w8, torch.float32, scale=a * ws, block=(8, 64, 4))
    deq = torch.cat([w8[: n // 2].double() * ws[0].item(), w8[n // 2 :].double() * ws[1].item()])
    assert torch.allclose(got.double(), (xq.double() * a.item()) @ deq.t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [(4, 64, 4), (4, 64, 4, 1)])
def test_glu_epilogue_is_silu_gate_times_up(block):
    """glu (bf16 gate_up, proj's input): w = [gate; up], the output silu(x @ gate^T) * (x @ up^T),
    half as many columns; one row (either body) and several."""
    k, n = 160, 12
    x, w = torch.randn(2, k), torch.randn(2 * n, k) / 16
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    got = gemv.launch(x[:1], w, torch.float32, glu=True, block=block)
    assert got.shape == (1, n)
    assert torch.allclose(got, (F.silu(gate) * up)[:1], rtol=1e-5, atol=1e-6)
    assert torch.allclose(gemv.launch(x, w, torch.float32, glu=True, block=block[:3]), F.silu(gate) * up, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("block_n", "per_sm"), [(1, 1), (4, 1), (2, 2)])
def test_resident_body_equals_torch(rows, block_n, per_sm):
    """The resident body: x's whole row (BLOCK_K >= K, ragged) read and prologued once, then each
    program strides over column blocks (per_sm programs a "multiprocessor": the interpreter has
    2), with every prologue and epilogue; BLOCK_K short of K is refused."""
    k, n = 200, 37
    x, w, g, r = torch.randn(rows, k), torch.randn(n, k) / 16, torch.rand(k) + 0.5, torch.randn(rows, n)
    block = (block_n, 256, 4, 0, per_sm)
    got = gemv.launch(x, w, torch.float32, norm=g, eps=1e-6, residual=r, block=block)
    assert torch.allclose(got, r + F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
    gu = torch.randn(rows, 2 * k)
    got = gemv.launch(gu, w, torch.float32, silu_mul=True, block=block)
    assert torch.allclose(got, F.linear(F.silu(gu[:, :k]) * gu[:, k:], w), atol=1e-5, rtol=1e-5)
    gate, up = F.linear(x, torch.cat([w, w.flip(0)])).chunk(2, dim=-1)
    got = gemv.launch(x, torch.cat([w, w.flip(0)]), torch.float32, glu=True, block=block)
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="whole row"):
        gemv.launch(x, w, torch.float32, block=(block_n, 128, 4, 0, 1))


def test_blocks_stored_before_the_deferred_body_still_load():
    """engine.json of older builds holds (BLOCK_N, BLOCK_K, num_warps[, defer]): one program a
    column block."""
    gemv.BLOCKS[gemv.key(64, 128, 1, "res")] = (8, 64, 4)
    assert gemv.config_for(64, 128, 1, "res") == (8, 64, 4, 0, 0, 0)
    gemv.BLOCKS[gemv.key(64, 128, 1, "res")] = (8, 64, 4, 1)
    assert gemv.config_for(64, 128, 1, "res") == (8, 64, 4, 1, 0, 0)
    gemv.BLOCKS[gemv.key(64, 128, 1, "res")] = (2, 128, 4, 0, 4)
    assert gemv.config_for(64, 128, 1, "res") == (2, 128, 4, 0, 4, 0)


def test_too_many_rows_is_refused():
    with pytest.raises(ValueError, match="at most"):
        gemv.launch(torch.randn(gemv.MAX_M + 1, 8), torch.randn(4, 8), torch.float32)


@pytest.fixture(autouse=True)
def _wide_head_blocks():
    """The heads (151 k rows) in 512-row programs: the interpreter's cost is per program."""
    saved = dict(gemv.BLOCKS)
    for vocab in (151680, 16512):
        gemv.BLOCKS[gemv.key(vocab, 128, 4, "norm")] = (512, 128, 4)
    yield
    gemv.BLOCKS.clear()
    gemv.BLOCKS.update(saved)


def engines(engine_dir, **fused):
    """The same checkpoint twice: plain, and with decode through our kernels (`fused` options)."""
    meta_opts = {"device": "cpu", "dtype": "float32", "max_batch": 4, "max_seq_len": 256}
    _, spec, tensors = trtckpt.load_checkpoint(engine_dir)
    from workflow.engines.torch_engine import EngineOptions

    opts = EngineOptions(**meta_opts)
    return TorchEngine(spec, tensors, opts), TorchEngine(spec, tensors, dataclasses.replace(opts, **fused))


@pytest.mark.parametrize("fused", [{"gemv": True}, {"decode_attention": True}, {"gemv": True, "decode_attention": True}])
def test_fused_engine_decodes_like_the_reference(tiny_engine_dir, tiny_hf, fused, monkeypatch):
    """Through the whole tiny model, both heads, across modality switches: against transformers;
    and the kernels asked for did run (a fused path that silently fell back would pass too)."""
    from workflow.engines import attention

    class Counted:  # the Triton kernels, counting their launches
        def __init__(self, kernel):
            self.kernel, self.n = kernel, 0

        def __getitem__(self, grid):
            self.n += 1
            return self.kernel[grid]

    kernels = {"gemv": (gemv, "_gemv"), "decode_attention": (attention, "_decode_attn")}
    counted = {name: Counted(getattr(module, attr)) for name, (module, attr) in kernels.items()}
    for name, (module, attr) in kernels.items():
        monkeypatch.setattr(module, attr, counted[name])

    from test_engine import assert_decode_matches_reference

    from workflow.download import load_hf_state
    from workflow.reference import MossSpeechReference
    from workflow.spec import load_spec

    ref = MossSpeechReference(load_spec(tiny_hf), load_hf_state(tiny_hf), torch.float32, "cpu")
    _, engine = engines(tiny_engine_dir, **fused)
    assert_decode_matches_reference(engine, ref, batch=2, prompt_len=20, steps=4, seed=31)
    assert {name for name, c in counted.items() if c.n} == set(fused)


def test_fp8_fused_engine_matches_the_fp8_emulation(tiny_fp8_engine_dir):
    """FP8 trunk: the kernel reads fp8 weights and FP8-rounded inputs; the emulation computes
    the same function in float32 through dequantized weights (checked against modelopt)."""
    from workflow import traffic
    from workflow.generate import Ids

    plain, fused = engines(tiny_fp8_engine_dir, gemv=True, decode_attention=True)
    ids = Ids.of(plain.spec)
    prompt, follow = traffic.batch(1, 24, ids, seed=5), traffic.batch(1, 5, ids, seed=6)
    for e in (plain, fused):
        e.prefill(prompt)
    for t in range(follow.shape[1]):
        (pt, pa), (ft, fa) = plain.decode(follow[:, t]), fused.decode(follow[:, t])
        assert (pt - ft).abs().max() < 1e-4 and (pa - fa).abs().max() < 1e-4
