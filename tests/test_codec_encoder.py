"""The flow front end (workflow/codec/encoder.py): official names and size, mu's shape, the masks' reach, the lookahead."""

from __future__ import annotations

import math

import pytest
import torch

from workflow.codec.config import CodecConfig, EncoderConfig
from workflow.codec.encoder import FlowFrontEnd, RelPositionAttention, attention_mask, rel_positions

TINY = CodecConfig.tiny().encoder
CHUNK = 5  # flow-chunk-5.pt's static chunk, in tokens


def conformer_layer_parameters(d: int, hidden: int) -> int:
    attention = 4 * (d * d + d) + d * d + 2 * d  # linear_q/k/v/out with bias, linear_pos without, pos_bias_u/v (heads x d/heads)
    feed_forward = (d * hidden + hidden) + (hidden * d + d)
    return attention + feed_forward + 2 * 2 * d  # norm_mha, norm_ff


def front_end_parameters(c: EncoderConfig) -> int:
    """The constructor arithmetic of CausalMaskedDiffWithXvec minus its decoder."""
    d = c.size
    linear_input = d * d + d + 2 * d  # Linear + LayerNorm
    return (
        c.vocab_size * d  # input_embedding
        + c.spk_dim * c.mel + c.mel  # spk_embed_affine_layer
        + 2 * linear_input  # encoder.embed, encoder.up_embed
        + (d * d * (c.lookahead + 1) + d) + (d * d * 3 + d)  # pre_lookahead_layer conv1, conv2
        + (c.blocks + c.up_blocks) * conformer_layer_parameters(d, c.linear_units)
        + (d * d * (2 * c.stride + 1) + d)  # up_layer.conv
        + 2 * d  # after_norm
        + d * c.mel + c.mel  # encoder_proj
    )  # fmt: skip


LAYER_KEYS = [
    "self_attn.linear_q.weight", "self_attn.linear_q.bias", "self_attn.linear_k.weight", "self_attn.linear_k.bias",
    "self_attn.linear_v.weight", "self_attn.linear_v.bias", "self_attn.linear_out.weight", "self_attn.linear_out.bias",
    "self_attn.linear_pos.weight", "self_attn.pos_bias_u", "self_attn.pos_bias_v",
    "feed_forward.w_1.weight", "feed_forward.w_1.bias", "feed_forward.w_2.weight", "feed_forward.w_2.bias",
    "norm_ff.weight", "norm_ff.bias", "norm_mha.weight", "norm_mha.bias",
]  # fmt: skip
# Checked against OpenMOSS/MOSS-Speech @6b86ef6 cosyvoice/{flow/flow.py, transformer/*.py} and the tensor names a
# third-party flow.pt converter reads (tetherto/qvac-fabric-speech.cpp convert-moss-speech-codec-to-gguf.py).
OFFICIAL_SHAPES = {
    "input_embedding.weight": (20480, 512),
    "spk_embed_affine_layer.weight": (80, 192),
    "spk_embed_affine_layer.bias": (80,),
    "encoder.embed.out.0.weight": (512, 512),
    "encoder.embed.out.1.weight": (512,),
    "encoder.pre_lookahead_layer.conv1.weight": (512, 512, 4),
    "encoder.pre_lookahead_layer.conv2.weight": (512, 512, 3),
    "encoder.encoders.0.self_attn.linear_pos.weight": (512, 512),
    "encoder.encoders.0.self_attn.pos_bias_u": (8, 64),
    "encoder.encoders.5.feed_forward.w_1.weight": (2048, 512),
    "encoder.up_layer.conv.weight": (512, 512, 9),
    "encoder.up_embed.out.0.weight": (512, 512),
    "encoder.up_encoders.3.self_attn.pos_bias_v": (8, 64),
    "encoder.after_norm.weight": (512,),
    "encoder_proj.weight": (80, 512),
}


def test_true_shape_size_and_official_names():
    with torch.device("meta"):
        model = FlowFrontEnd(EncoderConfig())
    n = sum(p.numel() for p in model.parameters())
    assert n == front_end_parameters(EncoderConfig()) == 49_421_984
    # docs/codec.md infers the whole flow at ~121 M with a ~71 M estimator: the rest, this module, ~50 M.
    assert 49e6 < n < 51e6
    assert model.input_embedding.weight.numel() == 10_485_760  # docs/codec.md: "the embedding alone is 10.5 M"

    state = model.state_dict()
    expected = {
        "input_embedding.weight", "spk_embed_affine_layer.weight", "spk_embed_affine_layer.bias",
        "encoder_proj.weight", "encoder_proj.bias", "encoder.after_norm.weight", "encoder.after_norm.bias",
        "encoder.up_layer.conv.weight", "encoder.up_layer.conv.bias",
    }  # fmt: skip
    expected |= {f"encoder.{e}.out.{i}.{w}" for e in ("embed", "up_embed") for i in (0, 1) for w in ("weight", "bias")}
    expected |= {f"encoder.pre_lookahead_layer.conv{i}.{w}" for i in (1, 2) for w in ("weight", "bias")}
    expected |= {f"encoder.encoders.{i}.{k}" for i in range(6) for k in LAYER_KEYS}
    expected |= {f"encoder.up_encoders.{i}.{k}" for i in range(4) for k in LAYER_KEYS}
    assert set(state) == expected
    for key, shape in OFFICIAL_SHAPES.items():
        assert tuple(state[key].shape) == shape, key


def tiny_model(seed: int = 0) -> FlowFrontEnd:
    torch.manual_seed(seed)
    model = FlowFrontEnd(TINY).eval()
    with torch.no_grad():  # off the LayerNorm/bias defaults, so every parameter shapes the output
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def moved(x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
    """x with the tokens in [start, stop) replaced by different ones."""
    y = x.clone()
    y[:, start:stop] = (y[:, start:stop] + 1 + torch.arange(y[:, start:stop].size(1))) % TINY.vocab_size
    return y


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-3


@torch.no_grad()
def test_mu_has_stride_frames_per_token_and_speaker_projection_ignores_scale():
    model = tiny_model()
    mu = model(tokens(2, 7))
    assert mu.shape == (2, TINY.mel, 7 * TINY.stride)
    assert mu.isfinite().all()
    assert model(tokens(1, 11), chunk=CHUNK).shape == (1, TINY.mel, 11 * TINY.stride)

    xvector = torch.randn(2, TINY.spk_dim)
    spks = model.speaker(xvector)
    assert spks.shape == (2, TINY.mel)
    torch.testing.assert_close(model.speaker(3.0 * xvector), spks)  # CAM++ scale is dropped (L2-normalised)


@torch.no_grad()
def test_relative_attention_scores_use_distance_query_minus_key():
    torch.manual_seed(0)
    size, heads, t = 8, 2, 5
    attn = RelPositionAttention(size, heads).eval()
    x = torch.randn(1, t, size)
    mask = attention_mask(torch.tensor([t]), t, 2)
    got = attn(x, rel_positions(t, size), mask)

    d = size // heads
    q, k, v = (lin(x[0]).view(t, heads, d) for lin in (attn.linear_q, attn.linear_k, attn.linear_v))
    freq = torch.tensor([10000.0 ** (-2 * m / size) for m in range(size // 2)])

    def pos(r: int) -> torch.Tensor:  # sinusoid of the signed distance, sin/cos interleaved
        return torch.stack([torch.sin(r * freq), torch.cos(r * freq)], dim=-1).flatten()

    scores = torch.empty(heads, t, t)
    for i in range(t):
        for j in range(t):
            p = attn.linear_pos(pos(i - j)).view(heads, d)
            scores[:, i, j] = ((q[i] + attn.pos_bias_u) * k[j] + (q[i] + attn.pos_bias_v) * p).sum(-1) / math.sqrt(d)
    weights = scores.masked_fill(~mask[0], float("-inf")).softmax(-1)
    want = attn.linear_out(torch.einsum("hij,jhd->ihd", weights, v).reshape(t, size))
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_streaming_chunk_sees_its_prefix_plus_lookahead_only():
    model, x, s = tiny_model(), tokens(1, 23), TINY.stride
    mu = model(x, chunk=CHUNK)
    k = 2  # chunks 0 and 1: tokens 0..9, frames 0..39
    edge = k * CHUNK + TINY.lookahead  # first token they must not depend on
    after = model(moved(x, edge), chunk=CHUNK)
    torch.testing.assert_close(after[..., : k * CHUNK * s], mu[..., : k * CHUNK * s], atol=1e-5, rtol=1e-5)
    assert differs(after[..., k * CHUNK * s :], mu[..., k * CHUNK * s :])
    # the last lookahead token still counts, and within a chunk attention is two-way (not frame-causal)
    assert differs(model(moved(x, edge - 1, edge), chunk=CHUNK)[..., : k * CHUNK * s], mu[..., : k * CHUNK * s])
    last_of_chunk_1 = model(moved(x, 2 * CHUNK - 1, 2 * CHUNK), chunk=CHUNK)
    assert differs(last_of_chunk_1[..., CHUNK * s : CHUNK * s + s], mu[..., CHUNK * s : CHUNK * s + s])
    torch.testing.assert_close(last_of_chunk_1[..., : CHUNK * s], mu[..., : CHUNK * s], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_frame_rate_chunks_are_chunk_times_stride_frames():
    """With token-rate mixing switched off (lookahead convs and token-rate attention zeroed), only the
    frame-rate attention can carry a chunk's last token back to the chunk's first frame."""
    model, x, s = tiny_model(), tokens(1, 23), TINY.stride
    for p in model.encoder.pre_lookahead_layer.parameters():
        p.zero_()
    for layer in model.encoder.encoders:
        layer.self_attn.linear_out.weight.zero_()
        layer.self_attn.linear_out.bias.zero_()
    mu = model(x, chunk=CHUNK)
    changed = model(moved(x, 2 * CHUNK - 1, 2 * CHUNK), chunk=CHUNK)  # the last token of chunk 1
    assert differs(changed[..., CHUNK * s], mu[..., CHUNK * s])  # chunk 1's first frame
    torch.testing.assert_close(changed[..., : CHUNK * s], mu[..., : CHUNK * s], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_offline_attends_to_the_whole_utterance():
    model, x = tiny_model(), tokens(1, 23)
    first = slice(0, TINY.stride)
    assert differs(model(moved(x, 22))[..., first], model(x)[..., first])


@torch.no_grad()
def test_lookahead_context_equals_the_tokens_in_the_sequence_when_streaming():
    """flow.inference(finalize=False) splits the last `lookahead` tokens off as context: at a chunk boundary
    this must give exactly the frames the longer run gives, so emitted audio never changes."""
    model, x, s, la = tiny_model(), tokens(1, 23), TINY.stride, TINY.lookahead
    n = 2 * CHUNK
    with_context = model(x[:, :n], chunk=CHUNK, context=x[:, n : n + la])
    assert with_context.shape == (1, TINY.mel, n * s)
    torch.testing.assert_close(with_context, model(x[:, : n + la], chunk=CHUNK)[..., : n * s], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_context, model(x, chunk=CHUNK)[..., : n * s], atol=1e-5, rtol=1e-5)
    assert differs(model(x[:, :n], chunk=CHUNK), with_context)  # without it the lookahead reads zeros


@pytest.mark.parametrize("chunk", [0, CHUNK])
@torch.no_grad()
def test_padded_rows_give_what_they_give_alone(chunk):
    model, x, s = tiny_model(), tokens(2, 23), TINY.stride
    lengths = torch.tensor([23, 15])
    batch = model(x, lengths, chunk=chunk)
    torch.testing.assert_close(batch[1:, :, : 15 * s], model(x[1:, :15], chunk=chunk), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[:1], model(x[:1], chunk=chunk), atol=1e-5, rtol=1e-5)

    if chunk:  # context lands right after each row's own length
        lengths, ctx = torch.tensor([20, 15]), tokens(2, TINY.lookahead, seed=2)
        batch = model(x, lengths, chunk=chunk, context=ctx)
        alone = model(x[1:, :15], chunk=chunk, context=ctx[1:])
        torch.testing.assert_close(batch[1:, :, : 15 * s], alone, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_row_whose_context_is_minus_ones_ends_there_beside_a_row_with_context():
    """A last call (no codes follow) rides in a batch of calls with context: its context of -1s reads as the
    utterance's end, exactly what it gives with no context, while the other row still reads its context."""
    model, x, s, la = tiny_model(), tokens(2, 23), TINY.stride, TINY.lookahead
    ctx = torch.cat([tokens(1, la, seed=2), torch.full((1, la), -1)])
    lengths = torch.tensor([20, 23])
    batch = model(x, lengths, chunk=CHUNK, context=ctx)
    torch.testing.assert_close(batch[1:], model(x[1:], chunk=CHUNK), atol=1e-5, rtol=1e-5)
    with_context = model(x[:1, :20], chunk=CHUNK, context=ctx[:1])
    torch.testing.assert_close(batch[:1, :, : 20 * s], with_context, atol=1e-5, rtol=1e-5)
    assert differs(model(x[:1, :20], chunk=CHUNK), with_context)  # the first row's context counts


def test_load_flow_state_skips_the_estimator_and_training_counters():
    source, target = tiny_model(seed=0), tiny_model(seed=1)
    state = dict(source.state_dict()) | {"decoder.estimator.out.weight": torch.zeros(3), "epoch": 7, "step": 900}
    target.load_flow_state(state)
    x = tokens(1, 9)
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x))
    del state["encoder.up_layer.conv.bias"]
    with pytest.raises(RuntimeError, match=r"up_layer\.conv\.bias"):
        target.load_flow_state(state)


def test_bad_arguments_are_refused():
    model, x = tiny_model(), tokens(1, 8)
    with pytest.raises(ValueError, match="lengths"):
        model(x, torch.tensor([9]))
    with pytest.raises(ValueError, match="context"):
        model(x, chunk=CHUNK, context=x[:, :2])
