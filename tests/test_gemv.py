"""The fused Triton GEMV (run by Triton's interpreter here) against torch, alone and inside the engine."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from workflow import fp8, trtckpt
from workflow.engines import blocks, gemv, tuning
from workflow.engines.blocks import Block, Body, Fuse
from workflow.engines.linears import rms_norm
from workflow.engines.options import EngineOptions
from workflow.engines.torch_engine import TorchEngine

pytestmark = pytest.mark.skipif(not gemv.available(), reason="needs triton")


def tile(block_n: int, block_k: int, warps: int = 4) -> blocks.Block:
    return Block(Body.TILE, block_n, block_k, warps)


def defer(block_n: int, block_k: int, warps: int = 4) -> blocks.Block:
    return Block(Body.DEFER, block_n, block_k, warps)


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("block", [tile(16, 64), tile(8, 32)])
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
    got = gemv.launch(gu, w, torch.float32, residual=r, silu_mul=True, block=tile(8, 64))
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
    got = gemv.launch(x, w, torch.float32, norm=g, eps=1e-6, residual=r, block=defer(8, block_k))
    assert torch.allclose(got, r + F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
    gu = torch.randn(1, 2 * k)
    got = gemv.launch(gu, w, torch.float32, silu_mul=True, block=defer(4, block_k))
    assert torch.allclose(got, F.linear(F.silu(gu[:, :k]) * gu[:, k:], w), atol=1e-5, rtol=1e-5)
    x4 = torch.randn(4, k)
    assert torch.allclose(gemv.launch(x4, w, torch.float32, block=defer(8, block_k)), F.linear(x4, w), atol=1e-5)


def test_tuning_offers_fp8_both_bodies_within_the_register_budget():
    found = blocks.candidates(4096, 1)
    assert {b.body for b in found} == {Body.TILE, Body.DEFER, Body.RESIDENT, Body.DOT}
    assert all(b.block_n * b.block_k <= blocks.DEFER_REGS * 32 * b.warps for b in found if b.body == Body.DEFER)
    assert {b.body for b in blocks.candidates(4096, 2)} == {Body.TILE, Body.RESIDENT}  # bf16: no deferred body (probe 11)
    assert all(b.block_k <= 128 for b in blocks.candidates(100, 2))  # no tile wider than K's power of two
    resident = [b for b in found if b.body == Body.RESIDENT]  # x's whole row in registers: K up to RESIDENT_MAX_K
    assert resident and all(b.block_k == 4096 and b.per_sm for b in resident)
    assert not any(b.body == Body.RESIDENT for b in blocks.candidates(12288, 2))


def test_tensor_cores_are_offered_to_fp8_weights_read_as_stored():
    """The tensor-core body: FP8 weights whose input needs no prologue (qkv, gate_up: NONE, dense,
    proj: RES), never bf16, a norm or silu prologue, or the GLU epilogue."""
    for fuse in (Fuse.NONE, Fuse.RES):
        dot = [b for b in blocks.candidates(4096, 1, fuse) if b.body == Body.DOT]
        assert dot and all(b.stages and not b.per_sm for b in dot)
        assert {b.block_n >= 64 for b in dot} == {True, False}  # both operand orders
    for k, nbytes, fuse in (
        (4096, 2, Fuse.NONE), (4096, 2, Fuse.RES), (4096, 1, Fuse.NORM), (12288, 1, Fuse.SILU | Fuse.RES), (4096, 1, Fuse.GLU)
    ):  # fmt: skip
        assert not any(b.body == Body.DOT for b in blocks.candidates(k, nbytes, fuse))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("block", [Block(Body.DOT, 32, 64, 4, stages=2), Block(Body.DOT, 64, 128, 4, stages=3)])
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


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("block", [Block(Body.DOT, 32, 64, 4, stages=2), Block(Body.DOT, 64, 32, 4, stages=2)])
def test_tensor_core_body_with_prologue_and_glu_equals_torch(rows, block):
    """bf16's tensor-core body (float32 here, exact): x through the norm or silu prologue, rounded
    to w's dtype, then the products; the residual and GLU epilogues; N and K ragged, both
    operand orders (BLOCK_N from 64: the weight first)."""
    k, n = 200, 70
    x, w, g, r = torch.randn(rows, k), torch.randn(n, k) / 16, torch.rand(k) + 0.5, torch.randn(rows, n)
    got = gemv.launch(x, w, torch.float32, norm=g, eps=1e-6, residual=r, block=block)
    assert torch.allclose(got, r + F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
    gu = torch.randn(rows, 2 * k)
    got = gemv.launch(gu, w, torch.float32, residual=r, silu_mul=True, block=block)
    assert torch.allclose(got, r + F.linear(F.silu(gu[:, :k]) * gu[:, k:], w), atol=1e-5, rtol=1e-5)
    w2 = torch.cat([w, w.flip(0)])
    gate, up = F.linear(rms_norm(x, g, 1e-6), w2).chunk(2, dim=-1)
    got = gemv.launch(x, w2, torch.float32, norm=g, eps=1e-6, glu=True, block=block)
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tensor-core"):  # x of another dtype than w's
        gemv.launch(x.double(), w, torch.float32, block=block)


def test_bf16_tensor_core_blocks_past_one_row_fit_shared_memory():
    """Offered past one row to bf16 weights with any prologue or epilogue (GLU: two weight tiles
    a stage), never at one row, each within DOT_SMEM; FP8's rows past one: its own only."""
    for fuse, tiles in ((Fuse.NORM, 1), (Fuse.NORM | Fuse.GLU, 2), (Fuse.RES, 1), (Fuse.SILU | Fuse.RES, 1)):
        assert not any(b.body == Body.DOT for b in blocks.candidates(4096, 2, fuse))
        dot = [b for b in blocks.candidates(4096, 2, fuse, 4) if b.body == Body.DOT]
        assert dot and all(b.stages * b.block_k * (tiles * b.block_n + 16) * 2 <= blocks.DOT_SMEM for b in dot)
        assert {b.block_k for b in dot} == set(blocks.DOT_K_BF16)
    assert len([b for b in blocks.candidates(4096, 2, Fuse.NORM | Fuse.GLU, 4) if b.body == Body.DOT]) < len(
        [b for b in blocks.candidates(4096, 2, Fuse.NORM, 4) if b.body == Body.DOT]
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter rounds to bf16 by truncation")
@pytest.mark.parametrize("block", [tile(16, 64), Block(Body.DOT, 32, 64, 4, stages=2), Block(Body.DOT, 64, 128, 4, stages=4)])
def test_bf16_rounds_like_torch(block):
    """bf16 in and out, as `x + F.linear(rms_norm(h))` rounds: the normed input exactly, the
    product rounded to bf16, then the residual added and rounded again. Only the order of the
    float32 sums differs, so the result is torch's within one ulp of the product, and mostly
    bit-identical; on CUDA cores and on tensor cores (both operand orders)."""
    k, n = 256, 64
    x, w = torch.randn(2, k, dtype=torch.bfloat16), (torch.randn(n, k) / 16).to(torch.bfloat16)
    g, r = (torch.rand(k) + 0.5).to(torch.bfloat16), torch.randn(2, n, dtype=torch.bfloat16)
    x, w, g, r = (t.cuda() for t in (x, w, g, r))
    got = gemv.launch(x, w, torch.bfloat16, norm=g, eps=1e-6, residual=r, block=block).double()
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
    got = gemv.launch(xq, w8, torch.float32, scale=a * ws, block=tile(8, 64))
    deq = torch.cat([w8[: n // 2].double() * ws[0].item(), w8[n // 2 :].double() * ws[1].item()])
    assert torch.allclose(got.double(), (xq.double() * a.item()) @ deq.t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [tile(4, 64), defer(4, 64)])
def test_glu_epilogue_is_silu_gate_times_up(block):
    """glu (bf16 gate_up, proj's input): w = [gate; up], the output silu(x @ gate^T) * (x @ up^T),
    half as many columns; one row (either body) and several."""
    k, n = 160, 12
    x, w = torch.randn(2, k), torch.randn(2 * n, k) / 16
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    got = gemv.launch(x[:1], w, torch.float32, glu=True, block=block)
    assert got.shape == (1, n)
    assert torch.allclose(got, (F.silu(gate) * up)[:1], rtol=1e-5, atol=1e-6)
    assert torch.allclose(
        gemv.launch(x, w, torch.float32, glu=True, block=block._replace(body=Body.TILE)), F.silu(gate) * up, atol=1e-6
    )


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("block_n", "per_sm"), [(1, 1), (4, 1), (2, 2)])
def test_resident_body_equals_torch(rows, block_n, per_sm):
    """The resident body: x's whole row (BLOCK_K >= K, ragged) read and prologued once, then each
    program strides over column blocks (per_sm programs a "multiprocessor": the interpreter has
    2), with every prologue and epilogue; BLOCK_K short of K is refused."""
    k, n = 200, 37
    x, w, g, r = torch.randn(rows, k), torch.randn(n, k) / 16, torch.rand(k) + 0.5, torch.randn(rows, n)
    block = Block(Body.RESIDENT, block_n, 256, 4, per_sm)
    got = gemv.launch(x, w, torch.float32, norm=g, eps=1e-6, residual=r, block=block)
    assert torch.allclose(got, r + F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
    gu = torch.randn(rows, 2 * k)
    got = gemv.launch(gu, w, torch.float32, silu_mul=True, block=block)
    assert torch.allclose(got, F.linear(F.silu(gu[:, :k]) * gu[:, k:], w), atol=1e-5, rtol=1e-5)
    gate, up = F.linear(x, torch.cat([w, w.flip(0)])).chunk(2, dim=-1)
    got = gemv.launch(x, torch.cat([w, w.flip(0)]), torch.float32, glu=True, block=block)
    assert torch.allclose(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="whole row"):
        gemv.launch(x, w, torch.float32, block=Block(Body.RESIDENT, block_n, 128, 4, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times on a GPU")
def test_tuning_keeps_a_block_per_row_count_and_passes_over_what_cannot_launch(monkeypatch):
    """A block at each row count, from that count's candidates; a block too big for the GPU's
    shared memory (8 stages of 512 x 128 weight tiles, twice: 2 MB) is passed over, not fatal."""
    w = (torch.randn(2 * 512, 1024, device="cuda") / 32).to(torch.bfloat16)
    huge = Block(Body.DOT, 128, 512, 4, stages=8)
    real = blocks.candidates
    monkeypatch.setattr(tuning, "candidates", lambda *a: [huge, *real(*a)])
    found = tuning.tune([(w, Fuse.NORM | Fuse.GLU)], reps=2)
    assert set(found) == {blocks.Use.of(w, Fuse.NORM | Fuse.GLU, m) for m in blocks.ROWS}
    for use, tuned in found.items():
        assert tuned.block in real(use.k, use.weight_bytes, use.fuse, use.rows) and tuned.ms > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times on a GPU")
def test_tuning_times_only_what_the_timing_cache_lacks(monkeypatch):
    """Blocks known for one weight (`engine.timing_cache`) are taken as they are; only the other weight's are timed."""
    w1, w2 = ((torch.randn(n, 1024, device="cuda") / 32).to(torch.bfloat16) for n in (512, 768))
    known = tuning.tune([(w1, Fuse.NORM)], reps=2)
    timed, real = [], tuning.tune_use
    monkeypatch.setattr(tuning, "tune_use", lambda w, fuse, m, *a: timed.append((w.shape[0], m)) or real(w, fuse, m, *a))
    found = tuning.tune([(w1, Fuse.NORM), (w2, Fuse.NORM)], reps=2, known=known)
    assert {use: found[use] for use in known} == known and sorted(timed) == [(768, m) for m in blocks.ROWS]


def test_blocks_stored_as_ints_by_earlier_builds_still_load(tmp_path):
    """engine.json of earlier builds held `options.gemv_blocks`: (BLOCK_N, BLOCK_K, warps[, defer[,
    per_sm[, dot stages]]]), the body coded in the 4th to 6th int; upgrade names each body."""
    import json

    from workflow.engines import read_engine_json

    old = {"8x64:1:res": [8, 64, 4], "9x64:1:res": [8, 64, 4, 1], "10x128:2:norm": [2, 128, 4, 0, 4],
           "11x64:1:": [32, 128, 4, 0, 0, 2], "12x64:2:silu+res": [8, 64, 8, 0, 0, 0]}  # fmt: skip
    meta = {"backend": "torch", "precision": "bf16", "options": {"device": "cpu", "late_text_fill": True, "gemv_blocks": old}}
    (tmp_path / "engine.json").write_text(json.dumps(meta))
    got = read_engine_json(tmp_path)
    assert got["options"].defer_text_fill and got["options"].backend == "torch"
    tuned = blocks.read_tuning(got["tuning"]["gemv"])
    assert {use: t.block for use, t in tuned.items()} == {
        blocks.Use(8, 64, 1, Fuse.RES): tile(8, 64),
        blocks.Use(9, 64, 1, Fuse.RES): defer(8, 64),
        blocks.Use(10, 128, 2, Fuse.NORM): Block(Body.RESIDENT, 2, 128, 4, per_sm=4),
        blocks.Use(11, 64, 1, Fuse.NONE): Block(Body.DOT, 32, 128, 4, stages=2),
        blocks.Use(12, 64, 2, Fuse.SILU | Fuse.RES): tile(8, 64, 8),
    }
    assert blocks.read_tuning(blocks.tuning_json(tuned)).keys() == tuned.keys()


def test_a_call_takes_the_block_tuned_for_its_row_count(monkeypatch):
    """Tuning keeps a block per row count (blocks.ROWS); a call of m rows takes the block of the
    fewest tuned rows >= m (an engine built with other ROWS, its own), the default where none was
    tuned. engine.json of builds that tuned one row only (keys without rows) reads as one row's:
    their calls of more rows take the default."""
    from workflow.engines.linears import Linear, project

    assert blocks.ROWS == (1, 2, 4, 8, gemv.MAX_M) == (1, 2, 4, 8, 16)
    a, b, c, d, e = (tile(n, 64) for n in (2, 4, 8, 16, 32))
    tuned = {1: a, 2: b, 4: c, 8: d, 16: e}
    assert [blocks.block_for(tuned, m) for m in range(1, gemv.MAX_M + 1)] == [a, b, c, c] + [d] * 4 + [e] * 8
    assert [blocks.block_for({1: a, 4: c}, m) for m in range(1, 6)] == [a, c, c, c, None]  # built with (1, 4)
    assert [blocks.block_for(found, 2) for found in ({1: a}, {}, None)] == [None, None, None]
    w, g = torch.randn(24, 64) / 8, torch.rand(64) + 0.5
    one, two, four = tile(8, 64), tile(2, 64), tile(4, 32, 8)
    launched = []
    real = gemv.launch
    monkeypatch.setattr(gemv, "launch", lambda *a, **kw: launched.append(a[8]) or real(*a, **kw))
    for stored, want in (
        ({f"24x64:4:norm:{m}": b.to_dict() for m, b in ((1, one), (2, two), (4, four))}, [one, two, four, four]),
        ({"24x64:4:norm": one.to_dict()}, [one] + [gemv.default_block(64)] * 3),
    ):
        tuned = blocks.read_tuning(stored)
        assert blocks.read_tuning(blocks.tuning_json(tuned)) == tuned
        assert blocks.blocks_for(tuned, w, Fuse.NONE) == {}
        lin = Linear(w)
        lin.blocks = blocks.blocks_for(tuned, w, Fuse.NORM)
        launched.clear()
        for m in (1, 2, 3, 4):
            x = torch.randn(m, 64)
            got = project(x, lin.args(), fused=True, norm=g, eps=1e-6)
            assert torch.allclose(got, F.linear(rms_norm(x, g, 1e-6), w), atol=1e-5, rtol=1e-5)
        assert launched == want


def test_candidates_past_one_row_are_the_kinds_that_won_there():
    """Past one row: no deferred body (launch runs it as the tile's); FP8 read as stored, the
    tensor-core body alone; else the resident body and tiles of ROWS_TILE_WARPS warps at the
    widest BLOCK_K that K allows, and for bf16 the tensor-core body; from WIDE_ROWS rows that
    body alone where it fits."""
    for rows in blocks.ROWS[1:]:
        assert {b.body for b in blocks.candidates(4096, 1, Fuse.RES, rows)} == {Body.DOT}
        if rows >= blocks.WIDE_ROWS:
            assert {b.body for b in blocks.candidates(4096, 2, Fuse.NORM | Fuse.GLU, rows)} == {Body.DOT}
            assert {b.body for b in blocks.candidates(4096, 4, Fuse.NORM, rows)} == {Body.TILE, Body.RESIDENT}  # float32: none
            continue
        bf16 = blocks.candidates(4096, 2, Fuse.NORM, rows)
        assert {b.body for b in bf16} == {Body.TILE, Body.RESIDENT, Body.DOT}
        assert {(b.block_k, b.warps) for b in bf16 if b.body == Body.TILE} == {(2048, blocks.ROWS_TILE_WARPS)}
        assert {b.block_n for b in bf16 if b.body == Body.TILE} == set(blocks.BLOCK_N_CHOICES)
        assert {b.body for b in blocks.candidates(200, 2, Fuse.NORM, rows)} == {Body.RESIDENT, Body.DOT}  # no tile fits K
        assert {b.block_k for b in blocks.candidates(1000, 2, Fuse.NORM, rows) if b.body == Body.TILE} == {1024}
        assert {b.body for b in blocks.candidates(12288, 1, Fuse.NORM, rows)} == {Body.TILE}
    assert Body.DEFER in {b.body for b in blocks.candidates(4096, 1, Fuse.RES)}


def test_too_many_rows_is_refused():
    with pytest.raises(ValueError, match="at most"):
        gemv.launch(torch.randn(gemv.MAX_M + 1, 8), torch.randn(4, 8), torch.float32)


def engines(engine_dir, **fused):
    """The same checkpoint twice: plain, and with decode through our kernels (`fused` options),
    the heads (151 k rows) in 512-row programs: the interpreter's cost is per program."""
    _, spec, tensors = trtckpt.load_checkpoint(engine_dir)
    opts = EngineOptions(device="cpu", dtype="float32", max_batch=4, max_seq_len=256)
    plain, kernels = TorchEngine(spec, tensors, opts), TorchEngine(spec, tensors, dataclasses.replace(opts, **fused))
    for head in (kernels.lm_head, kernels.audio_lm_head):
        head.blocks = {m: tile(512, 128) for m in blocks.ROWS}
    return plain, kernels


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

    from workflow.hfckpt import load_hf_state
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
