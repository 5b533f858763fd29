"""The whole decoder (workflow/codec/decoder.py) and its stream (workflow/codec/stream.py): the stream gives the
one-call decode however the codes arrive. CPU, float32, the tiny shape.

Tolerances, and why:
- mel: a streamed chunk's frames equal `CodecDecoder.mel` over all codes (chunk masks) to atol 1e-5 on values of
  about 5 (observed <= 2e-6). Not bit-exact: each flow call runs the estimator over a different number of frames,
  and scaled_dot_product_attention's softmax and weighted sum over a longer key axis round differently (masked
  keys add exact zeros but change the summation blocking); linear, conv and LayerNorm rows do not change.
- PCM: equal to `whole()` to atol 1e-5 (observed <= 1e-6) except near each flow call's end frame E (E = 4 x the
  codes decoded after the call): the cross-faded overlap, frames [E - 8, E), and 4 frames either side of it.
  In the overlap the stream is a cross-fade of two HiFT calls with weights summing to 1; the falling call's last
  frames, next to its zero-padded end, differ from the one-call PCM (measured up to 0.018 on a peak of 0.86),
  so the overlap is held to 2.5 % of the peak (CosyVoice2's Hamming halves, summing to ~1.08, fail that). The 4
  frames around it: HiFT's reach is wider than the 8 cached/held frames (conv_pre +-3, the first stage's ResBlocks
  +-7.5, the rest +-2 frames in theory; at the tiny shape a change in one mel frame shows above 1e-6 up to 9 frames
  away, and the source through the F0 predictor up to 7), so a call's zero-padded edges leak a little past the
  overlap (measured about 1e-3, 1e-4, 3e-5, 5e-6 at 0..3 frames out; float noise, <= 1e-6, from 4 on).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder, NsfSource, VoicePrompt
from workflow.codec.hift import HiFT
from workflow.codec.solver import solve
from workflow.codec.stream import MEL_CACHE, CodecStream

TINY = CodecConfig.tiny()
HOP = TINY.hift.hop  # 480 samples a mel frame
SPC = TINY.encoder.stride * HOP  # 1920 samples a code
MARGIN = 4  # frames either side of a cross-fade excluded from the tight comparison (see the docstring)
ATOL_PCM = 1e-5
ATOL_MEL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder(codec_decoder) -> CodecDecoder:
    return codec_decoder


def prompt(codes: int = 7, seed: int = 1) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    vocab = TINY.encoder.vocab_size
    return VoicePrompt(
        torch.randint(0, vocab, (codes,), generator=g), torch.randn(80, 4 * codes, generator=g), torch.randn(192, generator=g)
    )


def codes(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY.encoder.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


SEED = 5  # the streams' source noise


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(dec: CodecDecoder, voice: VoicePrompt, x: torch.Tensor, step: int, **kw) -> tuple[list[torch.Tensor], CodecStream]:
    """Push x `step` codes at a time, then finish: the PCM of every call (finish last)."""
    s = CodecStream(dec, voice, SEED, **kw)
    out = [s.push(x[i : i + step]) for i in range(0, x.numel(), step)]
    return [*out, s.finish()], s


def call_ends(n: int, prompt_codes: int, chunk: int = TINY.chunk, lookahead: int = TINY.encoder.lookahead) -> list[int]:
    """The mel frame where each non-final flow call ends (my own count of the schedule: CosyVoice2's, but a first
    hop of just the codes that end the prompt's last chunk where their 4 frames a code outnumber the held 8)."""
    pad = (chunk - prompt_codes % chunk) % chunk
    ends, offset, hop = [], 0, (pad if 4 * pad > MEL_CACHE else chunk + pad)
    while n - offset >= hop + lookahead:
        offset += hop
        ends.append(4 * offset)
        hop = chunk
    return ends


# ---------------------------------------------------------------- the flow call


@pytest.mark.parametrize("streaming", [False, True])
def test_mel_is_flow_inference_prompt_first_then_trimmed(decoder, streaming):
    """flow.inference: prompt codes + codes through the front end, cond = prompt mel then zeros, solve, drop
    the prompt's frames; written out here from the parts."""
    voice, x = prompt(), codes(9)
    with torch.inference_mode():
        got = decoder.mel(x, voice, streaming=streaming, offset_frames=4)
        mu = decoder.flow(torch.cat([voice.codes, x])[None], chunk=TINY.chunk if streaming else 0)
        cond = torch.cat([voice.mel, torch.zeros(80, 4 * 9)], dim=1)[None]
        spks = decoder.flow.speaker(voice.xvector[None])
        mask = torch.ones(1, 1, mu.shape[-1])
        want = solve(decoder.velocity, mu, mask, spks, cond, TINY.solver, streaming=streaming, noise=decoder.noise)
        other = decoder.mel(x, dataclasses.replace(voice, mel=voice.mel + 1.0), streaming=streaming)
    assert got.shape == (80, 4 * 9 - 4)
    assert torch.equal(got, want[0, :, 4 * 7 + 4 :])
    assert (other[:, 4:] - got).abs().max() > 1e-3  # the prompt mel conditions the output


# ---------------------------------------------------------------- stream == whole


@pytest.mark.parametrize("n", [13, 17, 25])
@pytest.mark.parametrize("prompt_codes", [7, 10, 11])  # first hops of 3 codes, 5 (CosyVoice2's) and 4
def test_stream_equals_whole_away_from_the_cross_fades(decoder, n, prompt_codes):
    voice, x = prompt(prompt_codes), codes(n)
    ref = decoder.whole(x, voice, SEED)
    assert ref.shape == (n * SPC,)
    streams = {step: torch.cat(run(decoder, voice, x, step)[0]) for step in (1, 3, n)}
    for pcm in streams.values():  # the same output however the codes arrive
        assert torch.equal(pcm, streams[1])
    pcm = streams[1]
    assert pcm.shape == ref.shape

    ends = call_ends(n, voice.codes.numel())
    assert ends, "every case must cross at least one call boundary"
    frame = torch.arange(n * 4).repeat_interleave(HOP)
    near = torch.zeros_like(frame, dtype=torch.bool)
    for e in ends:
        overlap = (frame >= e - MEL_CACHE) & (frame < e)
        assert (pcm - ref)[overlap].abs().max() <= 0.025 * ref.abs().max()  # a cross-fade, not a swell or a glitch
        near |= (frame >= e - MEL_CACHE - MARGIN) & (frame < e + MARGIN)
    torch.testing.assert_close(pcm[~near], ref[~near], rtol=0, atol=ATOL_PCM)
    assert (pcm - ref)[near].abs().max() > ATOL_PCM  # the exclusion is needed (the cross-fade is there)


def test_short_utterance_is_one_call_and_bit_identical(decoder):
    voice, x = prompt(), codes(5)  # fewer than the first hop + lookahead (6 with a 7-code prompt)
    out, _ = run(decoder, voice, x, 1)
    assert all(o.numel() == 0 for o in out[:-1])
    assert torch.equal(out[-1], decoder.whole(x, voice, SEED))


def test_streamed_mel_is_the_whole_decodes_mel(decoder):
    voice, x = prompt(), codes(25)
    _, s = run(decoder, voice, x, 2, keep_mel=True)
    with torch.inference_mode():
        ref = decoder.mel(x, voice, streaming=True)
    ends = call_ends(25, voice.codes.numel())
    assert [m.shape[1] for m in s.mels] == [b - a for a, b in zip([0, *ends], [*ends, 4 * 25], strict=True)]
    torch.testing.assert_close(torch.cat(s.mels, dim=1), ref, rtol=0, atol=ATOL_MEL)
    with torch.inference_mode():  # and the chunk masks are what make it so: offline attention differs
        offline = decoder.mel(x, voice, streaming=False)
    assert (offline[:, : ends[0]] - ref[:, : ends[0]]).abs().max() > 1e-2


def test_final_offline_tail_is_the_offline_decodes_tail(decoder):
    """CosyVoice2's last call (streaming=False): finished chunks as before, the tail from offline attention."""
    voice, x = prompt(), codes(17)
    _, s = run(decoder, voice, x, 17, keep_mel=True, final_offline=True)
    last = call_ends(17, voice.codes.numel())[-1]
    with torch.inference_mode():
        chunked, offline = (decoder.mel(x, voice, streaming=m) for m in (True, False))
    torch.testing.assert_close(torch.cat(s.mels[:-1], dim=1), chunked[:, :last], rtol=0, atol=ATOL_MEL)
    torch.testing.assert_close(s.mels[-1], offline[:, last:], rtol=0, atol=ATOL_MEL)


# ---------------------------------------------------------------- the flow cache


@pytest.mark.parametrize("prompt_codes", [13, 15, 0])
def test_the_flow_cache_solves_only_new_frames_and_gives_the_prefix_reruns_mel(decoder, prompt_codes):
    """With the cache each flow call's solve runs only the frames past the last call's end (and the first
    call past the voice prompt's past: its whole chunks that no reply reaches, lookahead included), and the
    mel is the one the stream gives re-running the whole prefix. The voice's past is left as it was."""
    voice, x = (VoicePrompt.empty() if prompt_codes == 0 else prompt(prompt_codes)), codes(26)
    past = decoder.prompt_past(voice)
    cached = (prompt_codes - TINY.encoder.lookahead) * 4 // 20 * 20 if prompt_codes else 0
    assert [p.frames for p in past] == [cached] * TINY.solver.steps
    kept = [dict(p.keys) for p in past]
    widths: list[int] = []
    first = decoder.estimator.transformer_blocks()[0]  # run once a pass, on [B, T, C]
    hook = first.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    try:
        _, s = run(decoder, voice, x, 2, keep_mel=True, past=past)
    finally:
        hook.remove()
    _, rerun = run(decoder, voice, x, 2, keep_mel=True, flow_cache=False)
    torch.testing.assert_close(torch.cat(s.mels, dim=1), torch.cat(rerun.mels, dim=1), rtol=0, atol=ATOL_MEL)
    ends = [4 * prompt_codes + e for e in call_ends(26, prompt_codes)] + [4 * (prompt_codes + 26)]
    assert widths == [b - a for a, b in zip([cached, *ends[:-1]], ends, strict=True) for _ in range(TINY.solver.steps)]
    assert [p.frames for p in past] == [cached] * TINY.solver.steps
    assert all(dict(p.keys) == k for p, k in zip(past, kept, strict=True))


def test_a_past_must_end_on_a_chunk_and_before_the_frames_asked_for(decoder):
    voice = prompt(15)  # its past: 40 frames (12 codes' worth, 2 whole chunks)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="chunk boundary"):
            decoder.mel(codes(9), voice, streaming=True, finalize=False, past=decoder.prompt_past(voice))
        with pytest.raises(ValueError, match="after the first"):
            decoder.mel(codes(8), voice, streaming=True, finalize=False, offset_frames=-30, past=decoder.prompt_past(voice))


# ---------------------------------------------------------------- when and how much PCM comes


@pytest.mark.parametrize(("prompt_codes", "first"), [(10, 8), (0, 8), (7, 6), (11, 7), (13, 10), (9, 9)])
def test_first_pcm_after_exactly_first_codes(decoder, prompt_codes, first):
    """The first hop + lookahead 3; pad = (-P) mod 5 codes end the prompt's last chunk, and are the first hop
    alone where they make PCM (pad 3 or 4: 12 or 16 frames, more than the 8 held), else 5 + pad is."""
    voice = VoicePrompt.empty() if prompt_codes == 0 else prompt(prompt_codes)
    s = CodecStream(decoder, voice, SEED)
    assert s.first_codes == first
    x = codes(first)
    for i in range(first - 1):
        assert s.push(x[i : i + 1]).numel() == 0
    pcm = s.push(x[first - 1 :])
    assert pcm.numel() == (first - TINY.encoder.lookahead) * SPC - MEL_CACHE * HOP


@pytest.mark.parametrize("step", [1, 4])
def test_each_push_emits_whole_chunks_less_the_held_tail(decoder, step):
    voice, n = prompt(), 23
    s = CodecStream(decoder, voice, SEED)
    x, total = codes(n), 0
    for i in range(0, n, step):
        total += s.push(x[i : i + step]).numel()
        decoded = ([0] + [e // 4 for e in call_ends(min(i + step, n), 7)])[-1]  # codes through the flow so far
        assert total == max(0, decoded * SPC - MEL_CACHE * HOP) == s.emitted
    total += s.finish().numel()
    assert total == n * SPC == s.emitted


def test_finish_without_codes_is_empty_and_stream_is_single_use(decoder):
    s = CodecStream(decoder, prompt(), SEED)
    assert s.finish().numel() == 0
    with pytest.raises(RuntimeError):
        s.push([1])
    with pytest.raises(RuntimeError):
        s.finish()
    with pytest.raises(ValueError, match="codes must lie"):
        CodecStream(decoder, prompt(), SEED).push([TINY.encoder.vocab_size])


def test_offline_config_cannot_stream():
    dec = CodecDecoder(dataclasses.replace(TINY, chunk=0))
    with pytest.raises(ValueError, match="chunk"):
        CodecStream(dec, prompt())
    with pytest.raises(ValueError, match="chunk"):
        dec.mel(codes(5), prompt(), streaming=True)


# ---------------------------------------------------------------- randomness


def test_reproducible_with_the_same_seed_and_global_rng_untouched(decoder):
    voice, x = prompt(), codes(17)
    rng = torch.get_rng_state()
    a = torch.cat(run(decoder, voice, x, 3)[0])
    b = torch.cat(run(decoder, voice, x, 3)[0])
    s = CodecStream(decoder, voice, 6)
    c = torch.cat([s.push(x), s.finish()])
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-4  # the source noise reaches the PCM
    assert torch.equal(decoder.whole(x, voice, 6), decoder.whole(x, voice, 6))


# ---------------------------------------------------------------- the continued NSF source


def test_source_noise_is_standard_normal_a_function_of_seed_and_place():
    """A stream's noise for frames 0..30 is the same drawn in one call or in two (12 then 18 frames) or in a
    batch beside another stream; seeds differ, so do their draws; and it is standard normal (50 frames x
    hop x width values: mean and std within 4 standard errors, no value past 6.5)."""
    src = NsfSource(HiFT(TINY.hift))
    one = src.noise(torch.tensor([2]), torch.tensor([0]), 30)[0]
    head, tail = (src.noise(torch.tensor([2]), torch.tensor([a]), n)[0] for a, n in ((0, 12), (12, 18)))
    both = src.noise(torch.tensor([7, 2]), torch.tensor([12, 12]), 18)
    assert one.shape == (30 * HOP, src.width) and one.dtype == torch.float32
    assert torch.equal(torch.cat([head, tail]), one) and torch.equal(both[1], tail)
    assert not torch.equal(both[0], tail)
    z = src.noise(torch.tensor([11]), torch.tensor([1000]), 50)[0].double()
    se = 1 / z.numel() ** 0.5
    assert abs(z.mean()) < 4 * se and abs(z.std() - 1) < 4 * se * 0.75**0.5 and z.abs().max() < 6.5


def test_source_continues_across_calls_and_matches_hifts_own_without_noise():
    hift = HiFT(dataclasses.replace(TINY.hift, nsf_sigma=0.0)).eval()
    src = NsfSource(hift)
    f0 = 100.0 + 80.0 * torch.rand(30, generator=gen(1))
    noise = src.noise(torch.tensor([2]), torch.zeros(1, dtype=torch.long), 30)[0]
    with torch.inference_mode():
        whole, cycles = src(f0, noise)
        head, _ = src(f0[:12], noise[: 12 * HOP])
        tail, _ = src(f0[12:], noise[12 * HOP :], before=cycles[11])
        # HiFT's SineGen2 source from the same f0, all frames voiced and sigma 0, so no noise on either side
        hift.f0_predictor.forward = lambda mel: f0[None]  # type: ignore[method-assign]
        official = hift.source(torch.zeros(1, TINY.hift.mel, 30), gen(3))[0, 0]
    # the head's last half frame is held flat (frame 12 was not known yet); the rest is the one-call source
    torch.testing.assert_close(head[: 12 * HOP - HOP // 2], whole[: 12 * HOP - HOP // 2], rtol=0, atol=1e-6)
    torch.testing.assert_close(tail, whole[12 * HOP :], rtol=0, atol=1e-6)
    assert (head[-HOP // 2 :] - whole[12 * HOP - HOP // 2 : 12 * HOP]).abs().max() > 1e-4
    torch.testing.assert_close(whole, official, rtol=0, atol=1e-4)  # SineGen2 keeps its phase in float32


def test_voice_prompt_from_wav_trims_codes_and_mel_to_each_other():
    wav = 0.1 * torch.randn(24000, generator=gen(1))  # 50 frames: room for 12 codes
    voice = VoicePrompt.from_wav(wav, codes(20), torch.randn(192))
    assert voice.codes.shape == (12,) and voice.mel.shape == (80, 48)
    short = VoicePrompt.from_wav(wav, codes(9), torch.randn(192))
    assert short.codes.shape == (9,) and short.mel.shape == (80, 36)
    with pytest.raises(ValueError, match="multiple"):
        VoicePrompt(codes(3), torch.zeros(80, 10), torch.zeros(192))
