"""The codec flow's velocity estimator (workflow/codec/estimator.py); its ODE solver: test_codec_solver.py.

CPU, float32, the tiny shape except where the true shape is built on the meta device."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from workflow.codec.config import CodecConfig, EstimatorConfig
from workflow.codec.estimator import PREFIX, CausalConditionalDecoder, Past, attention_mask, sinusoidal
from workflow.codec.fast import FastEstimator
from workflow.codec.solver import solve

TINY = CodecConfig.tiny()
CHUNK = TINY.chunk * TINY.encoder.stride  # 20 mel frames: flow-chunk-5's estimator chunk


def tiny_estimator(seed: int = 0) -> CausalConditionalDecoder:
    torch.manual_seed(seed)
    return CausalConditionalDecoder.from_codec(TINY).eval()


def inputs(b: int = 1, t: int = 3 * CHUNK, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "mu": torch.randn(b, 80, t, generator=g),
        "mask": torch.ones(b, 1, t),
        "spks": torch.randn(b, 80, generator=g),
        "cond": torch.randn(b, 80, t, generator=g),
    }


# ---------------------------------------------------------------- the estimator at its true shape


def expected_parameters(cfg: EstimatorConfig) -> int:
    """The estimator's parameter count from its constructor arithmetic (docs/codec.md's ~71 M)."""
    c, cin, temb, inner, ff = cfg.channels, cfg.in_channels, 4 * cfg.channels, cfg.heads * cfg.head_dim, 4 * cfg.channels

    def linear(i: int, o: int) -> int:
        return i * o + o

    def conv(i: int, o: int, k: int) -> int:
        return i * o * k + o

    def causal_block(i: int, o: int) -> int:  # conv k3 + LayerNorm
        return conv(i, o, 3) + 2 * o

    def resnet(i: int, o: int) -> int:  # time mlp, two causal blocks, 1x1 residual
        return linear(temb, o) + causal_block(i, o) + causal_block(o, o) + conv(i, o, 1)

    # norm1, norm3; q, k, v without bias; out with bias; GELU feed-forward c -> 4c -> c
    transformer = 2 * 2 * c + 3 * c * inner + linear(inner, c) + linear(c, ff) + linear(ff, c)
    return (
        linear(cin, temb)
        + linear(temb, temb)  # time_mlp
        + resnet(cin, c)
        + conv(c, c, 3)  # down level
        + cfg.mid_blocks * resnet(c, c)
        + resnet(2 * c, c)
        + conv(c, c, 3)  # up level
        + (2 + cfg.mid_blocks) * cfg.blocks * transformer
        + causal_block(c, c)
        + conv(c, cfg.out_channels, 1)  # final_block, final_proj
    )


@pytest.fixture(scope="module")
def true_estimator() -> CausalConditionalDecoder:
    with torch.device("meta"):
        return CausalConditionalDecoder(EstimatorConfig(), chunk_frames=20)


def test_true_shape_parameter_count_and_blocks(true_estimator):
    cfg = EstimatorConfig()
    n = sum(p.numel() for p in true_estimator.parameters())
    assert n == expected_parameters(cfg) == 71_302_480
    assert len(true_estimator.transformer_blocks()) == 56 == (1 + cfg.mid_blocks + 1) * cfg.blocks
    # the tiny shape follows the same arithmetic
    tiny = tiny_estimator()
    assert sum(p.numel() for p in tiny.parameters()) == expected_parameters(TINY.estimator)
    assert len(tiny.transformer_blocks()) == 3


# Names and shapes as listed for CosyVoice2-0.5B's flow.pt (same estimator hyper-parameters), below
# "decoder.estimator." (tensor schema in ayutaz/vokra crates/vokra-models/src/cosyvoice2/flow_weights.rs);
# module names from cosyvoice/flow/decoder.py and matcha/models/components/{decoder,transformer}.py.
OFFICIAL = {
    "time_mlp.linear_1.weight": (1024, 320),
    "time_mlp.linear_2.weight": (1024, 1024),
    "down_blocks.0.0.block1.block.0.weight": (256, 320, 3),
    "down_blocks.0.0.block1.block.2.weight": (256,),
    "down_blocks.0.0.block2.block.0.weight": (256, 256, 3),
    "down_blocks.0.0.mlp.1.weight": (256, 1024),
    "down_blocks.0.0.res_conv.weight": (256, 320, 1),
    "down_blocks.0.1.0.norm1.weight": (256,),
    "down_blocks.0.1.0.attn1.to_q.weight": (512, 256),
    "down_blocks.0.1.0.attn1.to_k.weight": (512, 256),
    "down_blocks.0.1.0.attn1.to_v.weight": (512, 256),
    "down_blocks.0.1.0.attn1.to_out.0.weight": (256, 512),
    "down_blocks.0.1.0.attn1.to_out.0.bias": (256,),
    "down_blocks.0.1.0.norm3.bias": (256,),
    "down_blocks.0.1.0.ff.net.0.proj.weight": (1024, 256),
    "down_blocks.0.1.0.ff.net.0.proj.bias": (1024,),
    "down_blocks.0.1.3.ff.net.2.weight": (256, 1024),
    "down_blocks.0.2.weight": (256, 256, 3),
    "mid_blocks.0.0.block1.block.0.weight": (256, 256, 3),
    "mid_blocks.0.1.0.attn1.to_q.weight": (512, 256),
    "mid_blocks.11.0.res_conv.weight": (256, 256, 1),
    "mid_blocks.11.1.3.norm3.weight": (256,),
    "up_blocks.0.0.block1.block.0.weight": (256, 512, 3),
    "up_blocks.0.0.res_conv.weight": (256, 512, 1),
    "up_blocks.0.1.3.attn1.to_out.0.weight": (256, 512),
    "up_blocks.0.2.weight": (256, 256, 3),
    "up_blocks.0.2.bias": (256,),
    "final_block.block.0.weight": (256, 256, 3),
    "final_block.block.2.bias": (256,),
    "final_proj.weight": (80, 256, 1),
    "final_proj.bias": (80,),
}


def test_true_shape_state_dict_matches_official_names(true_estimator):
    sd = true_estimator.state_dict()
    for key, shape in OFFICIAL.items():
        assert key in sd, key
        assert tuple(sd[key].shape) == shape, key
    # 1121 flow.pt tensors, 910 of them the estimator's: 66 down, 12 x 64 mid, 66 up, 4 time, 6 final
    assert len(sd) == 910
    # no projection biases on q/k/v, no cross-attention, no GroupNorm, no mid-level down/upsampling
    assert not [k for k in sd if k.endswith(("to_q.bias", "to_k.bias", "to_v.bias")) or ".norm2." in k or ".attn2." in k]
    assert not [k for k in sd if k.startswith("mid_blocks.") and k.split(".")[2] == "2"]
    assert {k.split(".")[0] for k in sd} == {"time_mlp", "down_blocks", "mid_blocks", "up_blocks", "final_block", "final_proj"}


def test_load_flow_state_strips_the_prefix():
    src, dst = tiny_estimator(0), tiny_estimator(1)
    flow = {PREFIX + k: v for k, v in src.state_dict().items()}
    flow["encoder_proj.weight"] = torch.zeros(80, 32)  # other parts of flow.pt are ignored
    dst.load_flow_state(flow)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))
    del flow[PREFIX + "final_proj.bias"]
    with pytest.raises(RuntimeError, match=r"final_proj\.bias"):
        dst.load_flow_state(flow)


# ---------------------------------------------------------------- the estimator's computation


def test_input_channels_are_x_mu_spks_cond():
    est = tiny_estimator()
    seen = {}

    def grab(_module: torch.nn.Module, args: tuple) -> None:
        seen["h"] = args[0]

    est.down_blocks[0][0].register_forward_pre_hook(grab)
    i = inputs(b=2, t=7)
    x = torch.randn(2, 80, 7)
    with torch.inference_mode():
        est(x, i["mask"], i["mu"], torch.tensor([0.3, 0.6]), i["spks"], i["cond"])
    h = seen["h"]
    assert h.shape == (2, 320, 7)
    assert torch.equal(h[:, :80], x)
    assert torch.equal(h[:, 80:160], i["mu"])
    assert torch.equal(h[:, 160:240], i["spks"].unsqueeze(-1).expand(-1, -1, 7))
    assert torch.equal(h[:, 240:], i["cond"])


def test_time_embedding_is_matchas_sinusoid():
    t = torch.tensor([0.0, 0.25, 1.0])
    emb = sinusoidal(t, 320)
    half = 160
    for row, tv in enumerate(t.tolist()):
        for i in (0, 1, 80, 159):
            arg = 1000.0 * tv * math.exp(-math.log(10000.0) * i / (half - 1))
            assert emb[row, i].item() == pytest.approx(math.sin(arg), abs=1e-4)
            assert emb[row, half + i].item() == pytest.approx(math.cos(arg), abs=1e-4)


def test_chunk_attention_mask():
    mask = torch.ones(2, 1, 7)
    mask[1, :, 5:] = 0
    full = attention_mask(mask)
    assert full[0].all()
    assert full[1, :5, :5].all() and not full[1, :5, 5:].any()
    assert torch.equal(full[1, 5:], full[1, :2])  # padded queries see the valid frames (zeroed later)
    assert attention_mask(torch.zeros(1, 1, 4)).all()  # nothing valid: opened fully, keeps the softmax finite
    chunked = attention_mask(mask, chunk_frames=3)
    # query i sees every key before the end of its own chunk: keys < 3, < 6, < 7
    expected = torch.tensor([[j < (i // 3 + 1) * 3 for j in range(7)] for i in range(7)])
    assert torch.equal(chunked[0], expected)
    assert torch.equal(chunked[1, :5], expected[:5] & mask[1].bool().expand(5, -1))


def test_streaming_estimator_is_chunk_causal_and_offline_is_not():
    est = tiny_estimator()
    i = inputs(t=3 * CHUNK)
    x, t = torch.randn(1, 80, 3 * CHUNK), torch.tensor([0.4])
    changed = {k: v.clone() for k, v in i.items()}
    x2 = x.clone()
    cut = 2 * CHUNK  # change everything from the third chunk on
    for v in (x2, changed["mu"], changed["cond"]):
        v[:, :, cut:] = torch.randn(1, 80, CHUNK)
    with torch.inference_mode():
        run = {
            (s, which): est(xx, d["mask"], d["mu"], t, d["spks"], d["cond"], streaming=s)
            for s in (True, False)
            for which, xx, d in (("a", x, i), ("b", x2, changed))
        }
    stream_a, stream_b = run[(True, "a")], run[(True, "b")]
    torch.testing.assert_close(stream_a[:, :, :cut], stream_b[:, :, :cut], rtol=0, atol=1e-6)
    assert (stream_a[:, :, cut:] - stream_b[:, :, cut:]).abs().max() > 1e-2
    off_a, off_b = run[(False, "a")], run[(False, "b")]
    assert (off_a[:, :, :CHUNK] - off_b[:, :, :CHUNK]).abs().max() > 1e-3  # full attention sees the future
    assert not torch.allclose(stream_a[:, :, :cut], off_a[:, :, :cut])  # the chunk mask changes the result


@pytest.mark.parametrize("pieces", [[3 * CHUNK], [CHUNK, 2 * CHUNK], [2 * CHUNK, 13]])
def test_frames_run_against_their_past_equal_one_streaming_pass(pieces):
    """The flow cache: the frames run in pieces, each against the past the earlier pieces left (pieces end
    on chunk boundaries but the last, as a stream's calls do), give the one pass's velocities; the past
    holds every frame, and a copy taken before a piece is left as it was."""
    total = sum(pieces)
    est, i = tiny_estimator(), inputs(b=2, t=total)
    x, t = torch.randn(2, 80, total, generator=torch.Generator().manual_seed(3)), torch.tensor([0.4, 0.4])
    past, got, a = Past(), [], 0
    with torch.inference_mode():
        whole = est(x, i["mask"], i["mu"], t, i["spks"], i["cond"], streaming=True)
        for n in pieces:
            kept = past.copy()
            piece = {k: v[:, :, a : a + n] if v.dim() == 3 else v for k, v in i.items()}
            got.append(est(x[:, :, a : a + n], piece["mask"], piece["mu"], t, piece["spks"], piece["cond"], True, past))
            assert kept.frames == a and all(kept.keys[m][0].shape[2] == a for m in kept.keys)
            a += n
    torch.testing.assert_close(torch.cat(got, dim=-1), whole, rtol=0, atol=1e-5)
    assert past.frames == total and len(past.keys) == len(est.transformer_blocks())
    assert all(k.shape[2] == total for k, _ in past.keys.values())


def test_a_past_needs_chunk_masks():
    est, i = tiny_estimator(), inputs(t=CHUNK)
    with pytest.raises(ValueError, match="chunk masks"), torch.inference_mode():
        est(torch.randn(1, 80, CHUNK), i["mask"], i["mu"], torch.tensor([0.4]), i["spks"], i["cond"], False, Past())


def test_attention_mask_after_a_past_is_the_whole_masks_last_rows():
    whole = attention_mask(torch.ones(1, 1, 50), CHUNK)
    for start in (20, 33):
        torch.testing.assert_close(attention_mask(torch.ones(1, 1, 50 - start), CHUNK, start), whole[:, start:])


def test_solve_against_a_past_continues_the_one_solve():
    """Each ODE step has its own past; the later frames start from their own frames of the fixed noise."""
    est, i, cfg = tiny_estimator(), inputs(t=3 * CHUNK), dataclasses.replace(TINY.solver, steps=3)
    past = [Past() for _ in range(cfg.steps)]
    with torch.inference_mode():
        whole = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg, streaming=True)
        head = solve(est, *(v[..., :CHUNK] if v.dim() == 3 else v for v in i.values()), cfg, True, None, past)
        tail = solve(est, *(v[..., CHUNK:] if v.dim() == 3 else v for v in i.values()), cfg, True, None, past)
        with pytest.raises(ValueError, match="2 pasts for 3"):
            solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg, True, None, past[:2])
    torch.testing.assert_close(torch.cat([head, tail], dim=-1), whole, rtol=0, atol=1e-5)


def test_masked_frames_are_zero_and_padding_does_not_leak():
    est = tiny_estimator()
    i = inputs(b=2, t=30)
    i["mask"][1, :, 22:] = 0
    x = torch.randn(2, 80, 30)
    with torch.inference_mode():
        out = est(x, i["mask"], i["mu"], torch.tensor([0.5, 0.5]), i["spks"], i["cond"])
        garbage = x.clone()
        garbage[1, :, 22:] = 100.0
        out2 = est(garbage, i["mask"], i["mu"], torch.tensor([0.5, 0.5]), i["spks"], i["cond"])
    assert out.shape == (2, 80, 30)
    assert torch.equal(out[1, :, 22:], torch.zeros(80, 8))
    torch.testing.assert_close(out, out2, rtol=0, atol=1e-5)


def fill_deterministic(model: torch.nn.Module) -> None:
    """Weights from a formula of each tensor's name (no RNG): a sinusoid over the elements / sqrt(fan-in),
    plus 1 for the LayerNorm scales."""
    with torch.no_grad():
        for name, p in model.state_dict().items():
            n = p.numel()
            fan_in = n // p.shape[0] if p.dim() > 1 else 1
            phase = sum(name.encode()) % 97
            w = torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + phase).float().reshape(p.shape) / math.sqrt(fan_in)
            is_norm_scale = name.endswith("weight") and ((p.dim() == 1 and "norm" in name) or ".block.2." in name)
            p.copy_(w + 1 if is_norm_scale else w)


# Computed with the official CosyVoice CausalConditionalDecoder (OpenMOSS/MOSS-Speech @6b86ef6,
# cosyvoice/flow/decoder.py + Matcha-TTS + diffusers 0.42) built with the tiny shape, act_fn gelu,
# dropout 0, static_chunk_size 20, num_decoding_left_chunks -1, filled by fill_deterministic.
# (channel, frame) -> value; then the sum of |output|.
REFERENCE = {
    False: ({(0, 0): 0.458923, (5, 3): -0.851445, (40, 19): -0.331637, (79, 23): 0.331096, (17, 21): 0.680149}, 1778.0249),
    True: ({(0, 0): 0.458933, (5, 3): -0.851558, (40, 19): -0.331717, (79, 23): 0.331092, (17, 21): 0.680174}, 1778.0063),
}


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_tiny_estimator_matches_official_reference_values(streaming, fast):
    """Its own forward and its fast pass (fast.py) alike."""
    est = CausalConditionalDecoder.from_codec(TINY).eval()
    fill_deterministic(est)
    run = FastEstimator(est) if fast else est
    frames = 24  # one full chunk of 20 and a partial one
    grid = torch.arange(80 * frames, dtype=torch.float64).reshape(1, 80, frames)
    x, mu, cond = (torch.sin(grid * 0.11).float(), torch.cos(grid * 0.07).float(), torch.sin(grid * 0.05 + 1).float())
    spks = torch.cos(torch.arange(80, dtype=torch.float64) * 0.3).float()[None]
    with torch.inference_mode():
        out = run(x, torch.ones(1, 1, frames), mu, torch.tensor([0.37]), spks, cond, streaming=streaming)
    values, total = REFERENCE[streaming]
    for (c, f), want in values.items():
        assert out[0, c, f].item() == pytest.approx(want, abs=2e-5), (c, f)
    assert out.abs().sum().item() == pytest.approx(total, rel=1e-5)
