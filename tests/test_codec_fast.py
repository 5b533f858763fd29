"""The estimator's fast pass (workflow/codec/fast.py) computes what its official forward computes.

CPU, float32, the tiny shape; the official forward is itself checked against values from the
official code (test_codec_flow.py), and so is the fast pass there."""

from __future__ import annotations

import pytest
import torch

from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder, VoicePrompt
from workflow.codec.estimator import CausalConditionalDecoder, Past, attention_mask
from workflow.codec.fast import ALIGN, FastEstimator, attention_bias
from workflow.codec.solver import cosine_schedule

TINY = CodecConfig.tiny()
CHUNK = TINY.chunk * TINY.encoder.stride


def estimator() -> CausalConditionalDecoder:
    torch.manual_seed(0)
    return CausalConditionalDecoder.from_codec(TINY).eval()


def inputs(b: int, t: int, seed: int = 1) -> list[torch.Tensor]:
    """x, mask (ones), mu, t, spks, cond."""
    g = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(b, 80, t, generator=g) for _ in range(3))
    return [x, torch.ones(b, 1, t), mu, torch.rand(b, generator=g), torch.randn(b, 80, generator=g), cond]


@pytest.mark.parametrize("streaming", [False, True])
def test_right_padded_rows_give_the_official_forwards_frames(streaming):
    """Two rows, the second right-padded after 45 frames, with large values in its padding: the fast
    pass masks only its output, and still equals the official forward (which masks every block)."""
    est = estimator()
    x, mask, mu, t, spks, cond = inputs(2, 57)
    mask[1, :, 45:] = 0
    for v in (x, mu, cond):
        v[1, :, 45:] = 100.0
    with torch.inference_mode():
        want = est(x, mask, mu, t, spks, cond, streaming=streaming)
        got = FastEstimator(est)(x, mask, mu, t, spks, cond, streaming=streaming)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got[1, :, 45:], torch.zeros(80, 12))
    assert (got[0] - got[1]).abs().max() > 1e-2  # the rows are not the same computation


def test_against_a_past_it_gives_the_official_forwards_frames():
    """Frames in pieces, each against the past its earlier pieces left (the flow cache)."""
    est = estimator()
    fast = FastEstimator(est)
    x, mask, mu, t, spks, cond = inputs(2, 2 * CHUNK + 13)
    ours, theirs, got, want, a = Past(), Past(), [], [], 0
    with torch.inference_mode():
        for n in (CHUNK, CHUNK, 13):
            piece = [v[:, :, a : a + n] for v in (x, mask, mu)]
            got.append(fast(*piece, t, spks, cond[:, :, a : a + n], True, ours))
            want.append(est(*piece, t, spks, cond[:, :, a : a + n], True, theirs))
            a += n
    torch.testing.assert_close(torch.cat(got, -1), torch.cat(want, -1), rtol=0, atol=1e-5)
    assert ours.frames == theirs.frames == a and set(ours.keys) == set(theirs.keys)


def test_the_attention_bias_is_the_mask_additive_with_aligned_rows():
    mask = torch.ones(2, 1, 27)
    mask[1, :, 20:] = 0
    for start in (0, 20):
        bias = attention_bias(mask, CHUNK, start, torch.bfloat16)
        allowed = attention_mask(mask, CHUNK, start)
        assert bias.shape == (2, 1, 27, 27 + start) and bias.dtype == torch.bfloat16
        assert torch.equal(bias[:, 0] == 0, allowed) and torch.isinf(bias[:, 0][~allowed]).all()
        assert bias.stride(-2) % ALIGN == 0 and bias.stride(-1) == 1


def test_q_k_v_load_in_order_and_save_under_their_own_names():
    est = estimator()
    attn = est.transformer_blocks()[0].attn1
    prefix = "down_blocks.0.1.0.attn1."
    state = est.state_dict()
    for i, name in enumerate(("to_q", "to_k", "to_v")):
        state[prefix + name + ".weight"] = torch.full_like(state[prefix + name + ".weight"], float(i))
    est.load_state_dict(state)
    rows = attn.qkv.weight.shape[0] // 3
    assert [attn.qkv.weight[i * rows : (i + 1) * rows].unique().tolist() for i in range(3)] == [[0.0], [1.0], [2.0]]
    saved = est.state_dict()
    assert prefix + "qkv.weight" not in saved and torch.equal(saved[prefix + "to_k.weight"], state[prefix + "to_k.weight"])


def test_the_decoder_solves_with_the_fast_pass_unless_official():
    """The same mel either way (within float rounding), the decoder's own flow call."""
    torch.manual_seed(0)
    fast = CodecDecoder(TINY).eval()
    official = CodecDecoder(TINY, official=True).eval()
    official.load_state_dict(fast.state_dict())
    assert isinstance(fast.velocity, FastEstimator) and official.velocity is official.estimator
    g = torch.Generator().manual_seed(2)
    voice = VoicePrompt(torch.randint(0, 16384, (10,), generator=g), torch.randn(80, 40, generator=g), torch.randn(192))
    codes = torch.randint(0, 16384, (13,), generator=g)
    with torch.inference_mode():
        got = fast.mel(codes, voice, streaming=True, finalize=False)
        want = official.mel(codes, voice, streaming=True, finalize=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_solve_makes_every_steps_time_inputs_once_with_the_same_mel():
    """The fast pass offers `time_inputs`: a solve makes every ODE step's resnet time inputs in one
    call before the first step (they depend on the step's time alone), and gets the mel each pass
    making its own gives, and the official forward's."""
    torch.manual_seed(0)
    dec = CodecDecoder(TINY).eval()
    official = CodecDecoder(TINY, official=True).eval()
    official.load_state_dict(dec.state_dict())
    g = torch.Generator().manual_seed(2)
    voice = VoicePrompt(torch.randint(0, 16384, (10,), generator=g), torch.randn(80, 40, generator=g), torch.randn(192))
    codes = torch.randint(0, 16384, (13,), generator=g)
    made = []
    ahead = dec.velocity.time_inputs
    dec.velocity.time_inputs = lambda t: made.append(t.clone()) or ahead(t)  # type: ignore[method-assign]
    with torch.inference_mode():
        got = dec.mel(codes, voice, streaming=True, finalize=False)
        dec.velocity.time_inputs = None  # type: ignore[method-assign, assignment]  # each pass makes its own
        per_pass = dec.mel(codes, voice, streaming=True, finalize=False)
        want = official.mel(codes, voice, streaming=True, finalize=False)
    steps = TINY.solver.steps
    assert len(made) == 1 and made[0].shape == (steps,)  # one call a solve, every step's time
    torch.testing.assert_close(made[0], cosine_schedule(steps)[:-1], rtol=0, atol=1e-6)
    torch.testing.assert_close(got, per_pass, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only"))]
)
def test_compiled_blocks_give_the_official_forwards_frames_at_any_shape(device, monkeypatch):
    """torch.compile with dynamic shapes: one compile serves other batches and lengths, same result
    (float32: the official forward's convolutions without TF32 on CUDA)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    est = estimator().to(device)
    fast = FastEstimator(est, compiled=True)
    for b, t, streaming in ((2, 57, True), (3, 33, True), (1, 41, False)):
        x, mask, mu, tt, spks, cond = (v.to(device) for v in inputs(b, t, seed=b))
        mask[-1, :, t - 5 :] = 0
        with torch.inference_mode():
            want = est(x, mask, mu, tt, spks, cond, streaming=streaming)
            got = fast(x, mask, mu, tt, spks, cond, streaming=streaming)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("wrap", ["compile_block", "torch.compile"])
def test_compiled_blocks_stay_compiled_at_every_shape_serving_makes(wrap):
    """Dynamic shapes still compile a block again per input channel count and where a row count of
    1 or 2 specializes: the slots' three resnet kinds at rows 1, 2 and more are 9 versions. Past
    torch's default limit of 8 the next one would run eager, silently; `compile_block` keeps them all
    (here a hit of the limit raises). torch.compile alone, the seeded bug, hits it."""
    from workflow.codec import slots
    from workflow.codec.estimator import CausalResnetBlock1D
    from workflow.codec.fast import compile_block

    torch._dynamo.reset()
    block = compile_block(slots.resnet) if wrap == "compile_block" else torch.compile(slots.resnet, dynamic=True)
    g = torch.Generator().manual_seed(0)

    def run_all() -> None:
        mods = [CausalResnetBlock1D(cin, 8, 16) for cin in (12, 8, 16)]  # the down resnet's input, the mid ones', the up one's
        for rows in (2, 4, 1):  # as serving meets them: one stream (2 rows with guidance), more, a lone row (no guidance)
            for r in mods:
                cin = r.block1.block[0].in_channels
                x, time = torch.randn(rows, 5, cin, generator=g), torch.randn(1, 8, generator=g)  # a solve's: one row
                tails = (torch.randn(rows, 2, cin, generator=g), torch.randn(rows, 2, 8, generator=g))
                with torch.no_grad():
                    got = block(r, x, time, tails, torch.full((rows,), 3))
                    want = slots.resnet(r, x, time, tails, torch.full((rows,), 3))
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        if wrap == "compile_block":
            run_all()
        else:
            with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
                run_all()
