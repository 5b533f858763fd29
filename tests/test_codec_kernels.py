"""The slot pass's transformer block in Triton kernels (workflow/codec/kernels.py) against its torch
path (slots.SlotPass.transformer), and a stream decoded through the slots with them against one
without. On the CPU Triton's interpreter runs the kernels, in float32 (held to 1e-5); on CUDA in
bfloat16 (held to bfloat16's rounding, a few units of its last place)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from workflow.codec import hift as hift_module
from workflow.codec import kernels, slots, snake
from workflow.codec.config import CodecConfig
from workflow.codec.estimator import TransformerBlock
from workflow.codec.hift import HiFT, ResBlock, Snake
from workflow.codec.slots import SlotIndex, SlotPass, row_bias

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # the interpreter runs only where no GPU is (conftest)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", [False, True])
def test_linear_is_layernorm_gemm_gelu_and_residual(device, norm):
    """Every part of the fused GEMM against torch's: rows and columns that do not fill a block, a
    reduction over several blocks (K 320 in blocks of 128) or one (with the LayerNorm), the bias, GELU,
    the residual; and the q/k/v split, its last columns written to pool frames in place."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    atol = 1e-4 if dtype == torch.float32 else 0.05
    g = torch.Generator().manual_seed(3)
    x, w, b, r = (torch.randn(*s, generator=g).to(device, dtype) for s in ((37, 320), (48, 320), (48,), (37, 48)))
    w = w / 16
    ln = torch.nn.LayerNorm(320).to(device, dtype) if norm else None
    if ln is not None:
        ln.weight.data, ln.bias.data = (torch.randn(320, generator=g).to(device, dtype) for _ in range(2))
    xin = ln(x) if ln is not None else x
    want = torch.nn.functional.gelu(torch.nn.functional.linear(xin, w, b)) + r
    got = kernels.linear(x, w, b, norm=ln, gelu=True, residual=r)
    assert got.shape == (37, 48) and (got.float() - want.float()).abs().max() <= atol
    pool = torch.zeros(50, 2, 2, 4, device=device, dtype=dtype)  # frames of 16 values: the last 16 columns
    writes = torch.randperm(50, generator=g)[:37].to(device)
    q = kernels.linear(x, w, norm=ln, pool=pool, writes=writes)
    plain = torch.nn.functional.linear(xin, w)
    assert q.shape == (37, 32) and (q.float() - plain[:, :32].float()).abs().max() <= atol
    assert (pool.view(50, 16)[writes].float() - plain[:, 32:].float()).abs().max() <= atol
    assert pool.view(50, 16)[[i for i in range(50) if i not in writes.tolist()]].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1300, 2500, 4500])
def test_held_batch_blockings_give_torchs_linear(device, m):
    """The blockings past 1,024 rows (a held batch's: kernels.tile) over rows that fill no block,
    normed and not: the LayerNorm GEMM with GELU, and the plain one pipelined over K with its
    residual, against torch's."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    atol = 1e-4 if dtype == torch.float32 else 0.05
    g = torch.Generator().manual_seed(m)
    x, w, b, r = (torch.randn(*s, generator=g).to(device, dtype) for s in ((m, 192), (80, 192), (80,), (m, 80)))
    w = w / 16
    ln = torch.nn.LayerNorm(192).to(device, dtype)
    normed = kernels.linear(x, w, b, norm=ln, gelu=True)
    assert (normed.float() - torch.nn.functional.gelu(torch.nn.functional.linear(ln(x), w, b)).float()).abs().max() <= atol
    plain = kernels.linear(x, w, b, residual=r)
    assert (plain.float() - (torch.nn.functional.linear(x, w, b) + r).float()).abs().max() <= atol
    assert kernels.tile(m, 80, 192, False).bm in (64, 128) and kernels.tile(m, 80, 192, True).warps == 8


def call(c: int, heads: int, d: int, device: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    """A block, a call's rows and a pool as FlowSlots makes them: 3 rows x 2 halves; the prompt's 20
    frames (pool rows 0-1) then each row's own; rows start at frames 20, 27 and 40 with 13, 5 and 0
    valid new frames (the last a padding row) of Q = 16, chunks of 8 frames."""
    g = torch.Generator().manual_seed(seed)
    b = TransformerBlock(c, heads, d)
    for p in b.parameters():
        p.data = torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 1.0) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1)
    b = b.to(device, dtype)
    frames, base, q = 64, 20, 16
    rows = 2 * (2 + 3)  # prompt, scratch, three slots
    pool = torch.randn(rows * frames, 2, heads, d, generator=g).to(device, dtype)
    starts, valid = torch.tensor([20, 27, 40] * 2), torch.tensor([13, 5, 0] * 2)
    row = torch.tensor([2, 3, 4] * 2) * 2 + torch.arange(2).repeat_interleave(3)
    prompt = torch.arange(2).repeat_interleave(3)
    j = torch.arange(60)[None]
    keys = torch.where(j < base, prompt[:, None] * frames + j, row[:, None] * frames + (j - base).clamp(0, frames - 1))
    writes = row[:, None] * frames + (starts[:, None] - base + torch.arange(q)).clamp(0, frames - 1)
    ix = SlotIndex(*(t.to(device) for t in (starts, valid, keys, writes, starts, starts)))
    h = torch.randn(6, q, c, generator=g).to(device, dtype)
    return b, h, pool, ix


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("c", "heads", "d"), [(32, 2, 16), (32, 2, 8), (64, 4, 32)])
def test_block_in_kernels_is_the_torch_slot_pass(device, c, heads, d):
    """Output of every valid frame, and the pool after the call (the new keys and values written
    where the call writes, nothing else touched), for head widths of 16, 8 (padded to the 16 a
    Triton dot needs) and 32."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, h, pool, ix = call(c, heads, d, device, dtype)
    theirs_pool, ours_pool = pool.clone(), pool.clone()
    torch_path = types.SimpleNamespace(kernels=False, qkv=slots.qkv, out=slots.out)
    view = types.SimpleNamespace(kv={b.attn1: theirs_pool}, ix=ix, scale={})
    with torch.no_grad():
        theirs = SlotPass.transformer(torch_path, b, h, row_bias(ix, h.shape[1], 8, dtype), view)
        ours = kernels.block(b, h, ours_pool, ix.keys, ix.writes, ix.starts, ix.valid, 8)
    atol = 1e-5 if dtype == torch.float32 else 0.05
    for r, n in enumerate(ix.valid.tolist()):
        assert n == 0 or (ours[r, :n].float() - theirs[r, :n].float()).abs().max() <= atol, r
    assert (ours_pool.float() - theirs_pool.float()).abs().max() <= atol
    written = torch.zeros(pool.shape[0], dtype=torch.bool, device=device)
    written[ix.writes.flatten()] = True
    assert torch.equal(ours_pool[~written], pool[~written]) and not torch.equal(ours_pool[written], pool[written])


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_bug_fails_it(device):
    """The check can fail: attention that lets a query see its whole row (no chunk mask) gives other
    values for the frames of every chunk but the row's last."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, h, pool, ix = call(32, 2, 16, device, dtype)
    torch_path = types.SimpleNamespace(kernels=False, qkv=slots.qkv, out=slots.out)
    with torch.no_grad():
        view = types.SimpleNamespace(kv={b.attn1: pool.clone()}, ix=ix, scale={})
        theirs = SlotPass.transformer(torch_path, b, h, row_bias(ix, h.shape[1], 8, dtype), view)
        ours = kernels.block(b, h, pool.clone(), ix.keys, ix.writes, ix.starts, ix.valid, 1 << 20)
    assert (ours[0, :4].float() - theirs[0, :4].float()).abs().max() > 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_a_convolutions_bias_and_the_residual_sum_go_with_the_snake(device):
    """A ResBlock's elementwise work in one kernel against torch's: the bias [C] (a channel's own: the
    flipped bias fails), then the Snake; the residual sum kept and the next Snake made of it, or the
    sum alone."""
    g = torch.Generator().manual_seed(6)
    act = Snake(3).to(device)
    act.alpha.data = torch.tensor([0.5, 1.0, 3.0], device=device)
    x, r = ((4 * torch.randn(2, 3, 700, generator=g)).to(device) for _ in range(2))
    b = torch.tensor([-1.0, 0.25, 2.0], device=device)
    biased = x + b[:, None]
    assert (snake.snake(x, act.alpha, b) - act(biased)).abs().max() <= 1e-5
    assert (snake.snake(x, act.alpha, b.flip(0)) - act(biased)).abs().max() > 0.1
    total, y = snake.residual_snake(x, b, r, act.alpha)
    assert (total - (r + biased)).abs().max() <= 1e-6 and (y - act(r + biased)).abs().max() <= 1e-5
    alone, none = snake.residual_snake(x, b, r, None)
    assert none is None and torch.equal(alone, total)


@pytest.mark.parametrize("device", DEVICES)
def test_snake_in_one_kernel_is_hifts_snake_and_hift_gives_the_same_pcm(device, monkeypatch):
    """HiFT's Snake (x + sin^2(alpha x) / alpha, an alpha per channel) in one kernel, against torch's ops:
    a tensor that fills no whole block and channels of other alphas (a kernel reading the wrong
    channel's alpha fails); then HiFT's PCM with its network fused (`HiFT.fuse`: channels-last, each ResBlock
    step's elementwise work in the Snake kernels) against torch's, the tiny shape, float32 (HiFT's; on
    CUDA with TF32 off, so that the convolutions do not round the two apart): fused, fused then loaded
    with a state dict (its weights stay channels-last), and unfused again (the plain PCM exactly)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    g = torch.Generator().manual_seed(5)
    act = Snake(3).to(device)
    act.alpha.data = torch.tensor([0.5, 1.0, 3.0], device=device)
    x = (4 * torch.randn(2, 3, 700, generator=g)).to(device)
    want = act(x)
    assert (snake.snake(x, act.alpha) - want).abs().max() <= 1e-5
    assert (snake.snake(x, act.alpha.flip(0)) - want).abs().max() > 0.1  # the alphas' order matters
    hift = HiFT(CodecConfig.tiny().hift).to(device).eval()
    for m in hift.modules():
        if isinstance(m, Snake):  # alphas of their own, not the initial ones
            m.alpha.data = (0.5 + torch.rand(m.alpha.shape, generator=g)).to(device)
    mel = torch.randn(1, 80, 12, generator=g).to(device)
    with torch.no_grad():
        source = hift.source(mel)
        plain = hift.decode(mel, source)
        hift.fuse()
        fused = hift.decode(mel, source)
        other = HiFT(CodecConfig.tiny().hift).to(device).eval()
        other.fuse()
        other.load_state_dict(hift.state_dict())  # loaded after fuse: the channels-last layout stays
        loaded = other.decode(mel, source)
        hift.fuse(False)
        unfused = hift.decode(mel, source)
    blocks = [m for m in hift.modules() if isinstance(m, ResBlock)]
    assert blocks and not any(m.fused for m in blocks) and all(m.fused for m in other.modules() if isinstance(m, ResBlock))
    assert (fused - plain).abs().max() <= 1e-5 and (loaded - plain).abs().max() <= 1e-5 and torch.equal(unfused, plain)
    for name, m in other.named_modules():  # the network's convolutions go to cuDNN channels-last (NHWC)
        if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d) and not name.startswith("f0_predictor"):
            assert m.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last), name
            assert hift.get_submodule(name).weight.is_contiguous(), name  # unfused: as loaded
            assert m.weight.shape[-1] == 1 or not m.weight.is_contiguous(), name


def test_hifts_convolutions_in_float16_round_their_inputs_and_outputs_only(monkeypatch):
    """`HiFT.convs_to(float16)`: the network's convolutions in fp16 (the F0 predictor's and conv_post in
    float32, the Snakes' alphas too), each convolution's input, weights and output rounded to fp16 and
    the rest in float32, so its PCM is float32 HiFT's with every convolution's I/O rounded (emulated in
    float32 here), near float32's; fused (the Snake kernels reading and writing fp16 around float32 sums,
    through Triton's interpreter) likewise, a fused HiFT's channels-last layout kept. Tiny shape, on the CPU:
    where a GPU is, the interpreter is off (conftest) and Triton cannot read CPU tensors."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's Triton interpreter is on only where no GPU is (conftest)")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    hift = HiFT(CodecConfig.tiny().hift).eval()
    for m in hift.modules():
        if isinstance(m, Snake):
            m.alpha.data = 0.5 + torch.rand(m.alpha.shape, generator=g)
    mel = torch.randn(1, 80, 12, generator=g)
    snr = lambda a, b: (10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum())).item()  # noqa: E731
    rnd = lambda v: v.half().float()  # noqa: E731
    emulated = copy.deepcopy(hift)  # float32, its network's weights and biases rounded to fp16
    convs = (torch.nn.Conv1d, torch.nn.ConvTranspose1d)
    network = [m for n, m in emulated.named_modules() if isinstance(m, convs) and not n.startswith(("f0_predictor", "conv_post"))]
    for m in network:
        m.weight.data, m.bias.data = rnd(m.weight.data), rnd(m.bias.data)
    conv = hift_module.conv

    def rounded(m, x, *, bias=True):  # a float32 convolution of fp16 values, its output rounded to fp16
        return rnd(conv(m, rnd(x), bias=bias)) if m in network else conv(m, x, bias=bias)

    half = copy.deepcopy(hift)
    half.fuse()  # as CodecDecoder does, before `convs_to` (settings.decoders)
    half.convs_to(torch.float16)
    for name, m in half.named_modules():
        if isinstance(m, convs):
            kept = name.startswith(("f0_predictor", "conv_post"))
            assert m.weight.dtype == (torch.float32 if kept else torch.float16), name
            assert kept or m.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last), name
    assert all(m.alpha.dtype == torch.float32 for m in half.modules() if isinstance(m, Snake))
    with torch.no_grad():
        source = hift.source(mel)
        want, got, like = hift.decode(mel, source), {}, {}
        for fused in (False, True):
            half.fuse(fused)
            emulated.fuse(fused)
            got[fused] = half.decode(mel, source)
            monkeypatch.setattr(hift_module, "conv", rounded)
            like[fused] = emulated.decode(mel, source)
            monkeypatch.setattr(hift_module, "conv", conv)
    for fused in (False, True):  # observed 67.4 / 68.5 dB; residual sums rounded to fp16 (a seeded bug) 61.8 / 63.5
        assert got[fused].dtype == torch.float32 and snr(got[fused], like[fused]) >= 65 and snr(got[fused], want) >= 55
