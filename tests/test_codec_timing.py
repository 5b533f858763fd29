"""The codec section of the benchmark: what it times is the decoder's own computation, at every
call position, variant and batch it was asked for."""

import gc
import json
import weakref

import jsonschema
import pytest
import torch

from workflow.benchmark import SCHEMA
from workflow.codec.settings import CodecTiming, decoders, voice_of
from workflow.codec.solver import solve
from workflow.codec.timing import Runner, SlotRunner, measure

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def test_the_timed_stages_are_the_decoders_own_computation():
    ours, base = decoders(CodecTiming(), torch.device("cpu"))
    run = Runner(ours, batch=2, body=15, prompt_codes=10, graphs=False)
    mu = ours.flow(run.tokens, chunk=ours.cfg.chunk, context=run.context)  # with its argument checks
    assert torch.equal(run.front_end(), mu) and mu.shape == (2, 80, 60)
    want = solve(ours.velocity, mu, run.mask, run.spks, run.cond, ours.cfg.solver, True, ours.noise)
    assert torch.equal(run.solve(), want)
    assert run.ode_step().shape == (4, 80, 60)  # guidance: the conditioned and unconditioned halves
    ctx = run.mel.shape[2] - (8 + 20)  # the F0 predictor's context frames, then the cached and the new
    for i, got in enumerate(run.hift()):  # each stream's call as CodecStream makes it: F0, its source continued, the network
        f0 = ours.hift.f0_predictor(run.mel[i : i + 1])[0, ctx:]
        noise = ours.source.noise(run.seeds[i : i + 1], run.first[i : i + 1], f0.shape[0])[0]
        source, _ = ours.source(f0, noise, run.before[i])
        want = ours.hift.decode(run.mel[i : i + 1, :, ctx:], source[None, None])[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert want.shape == ((8 + 20) * 480,)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), ours.state_dict().values(), strict=True))
    cached = Runner(ours, batch=2, body=15, prompt_codes=10, graphs=False, past_frames=20)  # the flow cache
    torch.testing.assert_close(cached.solve(), run.solve()[..., 20:], rtol=0, atol=1e-5)
    assert cached.ode_step().shape == (4, 80, 40) and cached.past_bytes() > 0 == run.past_bytes()
    assert all(p.frames == 20 for p in cached.past)  # each timed call starts from the same past


@torch.no_grad()
@pytest.mark.parametrize(("body", "start"), [(15, 20), (35, 120)])
def test_the_slots_call_is_a_streams_frames_from_its_slot(body, start):
    """SlotRunner's call (the first after the voice prompt's past of 20 frames; a later one, the slots
    holding 20..120) gives the frames re-running every frame gives, from its start: the voice's codes
    first, its mel the condition, its speaker; so its ODE step is one step of that call."""
    t = CodecTiming()
    ours, _ = decoders(t, torch.device("cpu"))
    voice = voice_of(t, ours)
    run = SlotRunner(ours, voice, batch=2, body=body, graphs=False, new=60, start=start)
    assert torch.equal(run.tokens[:, :10], voice.codes.expand(2, -1)) and run.frames == 4 * body
    cond = torch.zeros(2, 80, run.frames)
    cond[:, :, :40] = voice.mel
    spks = ours.flow.speaker(voice.xvector[None]).expand(2, -1)
    want = solve(ours.velocity, run.mu, torch.ones(2, 1, run.frames), spks, cond, ours.cfg.solver, True, ours.noise)
    got = run.stages["solve"]()
    assert got.shape == (2, 80, 60)
    torch.testing.assert_close(got[..., : run.frames - start], want[..., start:], rtol=0, atol=1e-5)
    assert torch.equal(run.stages["solve"](), got)  # run again, as timed: the same call
    assert run.stages["ode_step"]().shape == (2, 80, 60) and run.past_bytes() == run.slots.nbytes()


def test_every_call_variant_and_batch_is_timed_and_first_audio_includes_the_engine():
    reached = []
    out = measure(CodecTiming(batches=(1, 3), repeat=1), torch.device("cpu"), reached.append)
    got = {(r["variant"], r["call"], r["batch"]) for r in out["calls"]}
    ours = {(v, c, b) for v in ("ours", "ours, flow cache") for c in ("first", "later") for b in (1, 3)}
    assert got == ours | {("baseline", c, 1) for c in ("first", "later")}
    row = {(r["variant"], r["call"]): r for r in out["calls"] if r["batch"] == 1}
    first, later = row["ours, flow cache", "first"], row["ours, flow cache", "later"]
    assert first["codes"] == 10 + 5 + 3 and later["codes"] == first["codes"] + 20 and first["frames"] == 4 * 15
    # cached: the prompt's whole chunks without the lookahead's (20 frames), then the last call's end
    assert first["solved_frames"] == 60 - 20 and later["solved_frames"] == 20 and later["past_mib"] > first["past_mib"]
    assert row["ours", "later"]["solved_frames"] == row["baseline", "later"]["solved_frames"] == 4 * 35
    assert all(r[k] > 0 for r in out["calls"] for k in r if k.endswith("_ms"))
    assert out["first_codes"] == 8 and set(reached) == {8} and out["ttfa_ms"]["n"] == 1
    t = CodecTiming(batches=(1, 3), repeat=1, slots=2, baseline=False, flow_cache=False, held=3)
    held_out = measure(t, torch.device("cpu"))
    got = {(r["variant"], r["call"], r["batch"]): r for r in held_out["calls"]}
    assert set(got) == {
        (v, c, b) for v in ("ours", "ours, slots") for c in ("first", "later") for b in (1, 3) if b <= 2 or v == "ours"
    } | {("ours, slots", "later, 3 held", 1)}  # three chunks a row in one call, as serving's held chunks
    assert got["ours, slots", "first", 1]["solved_frames"] == 40 and got["ours, slots", "later", 1]["solved_frames"] == 20
    held, later = got["ours, slots", "later, 3 held", 1], got["ours, slots", "later", 1]
    assert held["solved_frames"] == 60 and held["frames"] == later["frames"] and held["solve_ms"] > 0
    codec_schema = json.loads(SCHEMA.read_text())["properties"]["codec"]  # what benchmark.json holds of them
    for section in (out, held_out):
        jsonschema.validate(section, codec_schema)


def test_codec_settings_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown key"):
        CodecTiming.from_dict({"presets": "full"})
    with pytest.raises(ValueError, match="'huge' is not one of tiny, full"):
        CodecTiming.from_dict({"preset": "huge"})
    with pytest.raises(ValueError, match="later_codes: 22 is not a multiple of the chunk"):
        CodecTiming.from_dict({"later_codes": 22})  # the later call would end off the chunk grid
    with pytest.raises(ValueError, match="later_codes: 20 codes hold fewer than the 8 chunks"):
        CodecTiming.from_dict({"later_codes": 20, "slots": 2, "held": 8})  # the held call would start in the voice prompt
    assert CodecTiming.from_dict({"later_codes": 40, "slots": 2, "held": 8}).held == 8
    with pytest.raises(ValueError, match=r"fp8_pages: it stores the flow slots' pages, and benchmark\.codec\.slots is 0"):
        CodecTiming.from_dict({"fp8_pages": True})
    with pytest.raises(ValueError, match="fp8_pages: its scales come from the voice prompt's past, and 6 codes"):
        CodecTiming.from_dict({"fp8_pages": True, "slots": 2, "prompt_codes": 6})  # the tiny chunk 5, lookahead 3
    assert CodecTiming.from_dict({"fp8_pages": True, "slots": 2, "prompt_codes": 8}).fp8_pages
    with pytest.raises(ValueError, match="hift_dtype: 'bfloat16' is not one of float32, float16"):
        CodecTiming.from_dict({"hift_dtype": "bfloat16"})  # 35.7 dB from float32 (docs/levers.md, "CPU HiFT bf16")
    with pytest.raises(ValueError, match=r"pad_frames: 162 is not a positive multiple of 4 frames \(a code's\)"):
        CodecTiming.from_dict({"pad_frames": 162})  # a padded call would end inside a code
    assert CodecTiming.from_dict({"pad_frames": 160}).pad_frames == 160
    with pytest.raises(ValueError, match="ode_steps: 0 is under 1"):
        CodecTiming.from_dict({"ode_steps": 0})
    with pytest.raises(ValueError, match=r"later_shapes: 0 is under 1 \(the held call's shape alone\)"):
        CodecTiming.from_dict({"later_shapes": 0})
    with pytest.raises(ValueError, match=r"cfg_rate: -0\.1 is negative"):
        CodecTiming.from_dict({"cfg_rate": -0.1})
    tiny = CodecTiming.from_dict({}).config().solver  # unset: the preset's (tiny: 2 steps; full: MOSS-Speech's 10, 0.7)
    assert (tiny.steps, tiny.cfg_rate) == (2, 0.7) and CodecTiming.from_dict({"preset": "full"}).config().solver.steps == 10


def test_each_runner_and_its_graphs_are_gone_before_the_next(monkeypatch):
    """A runner's CUDA graphs die with it, and it must die when measure is done with it, not when
    the garbage collector next runs: a graph destroyed inside another's capture (serving's, made
    ahead of the load) invalidates that capture. Checked with the collector off."""
    alive: weakref.WeakSet = weakref.WeakSet()
    made = []
    init = Runner.__init__

    def tracked(self, *args, **kwargs):
        made.append(len(alive))  # runners still alive when a new one is made
        init(self, *args, **kwargs)
        alive.add(self)

    monkeypatch.setattr(Runner, "__init__", tracked)
    gc.disable()
    try:
        measure(CodecTiming(batches=(1, 2), repeat=1), torch.device("cpu"), lambda k: None)
        assert made == [0] * 11 and len(alive) == 0  # 4 ours, 4 with the flow cache, 2 baseline, 1 for first audio
    finally:
        gc.enable()


def test_a_prompt_of_5k_plus_2_codes_times_a_first_call_of_3_codes():
    """The first hop is the stream's (stream.first_hop): a 12-code prompt's last chunk ends 3 codes into the
    reply, and those 3 (12 frames, more than the 8 held back) make the first PCM, so the first call and time to
    first audio take 3 + 3 codes, and the later call stays on the chunk grid."""
    reached = []
    t = CodecTiming(prompt_codes=12, batches=(1,), repeat=1, slots=1, baseline=False, flow_cache=False)
    out = measure(t, torch.device("cpu"), reached.append)
    row = {(r["variant"], r["call"]): r for r in out["calls"]}
    assert out["first_codes"] == 6 and set(reached) == {6}
    assert row["ours", "first"]["codes"] == 12 + 3 + 3 and row["ours", "later"]["codes"] == 12 + 3 + 20 + 3
    assert row["ours, slots", "first"]["solved_frames"] == 4 * 15 - 20 and row["ours, slots", "later"]["solved_frames"] == 20


def test_float16_hift_is_refused_where_it_moves_the_voice_prompts_pcm_too_far():
    """`hift_dtype: float16` is checked on the voice prompt as the decoder is made: the tiny decoder's passes
    (~70 dB from float32's), and with activations past fp16's range (conv_pre's weights x 1e4) the same
    check refuses it in one line that names the weights and says what to set."""
    from workflow.codec.settings import HIFT_LEAST_DB, check_hift, stream_decoder
    from workflow.errors import InputError

    t = CodecTiming(hift_dtype="float16")
    dec, voice = stream_decoder(t, torch.device("cpu"))  # checked there
    assert dec.hift.conv_pre.weight.dtype == torch.float16 and dec.hift.snr_to_float32(voice.mel) >= HIFT_LEAST_DB
    dec.hift.conv_pre.weight.data *= 1e4
    with pytest.raises(InputError, match=r"random weights: benchmark\.codec\.hift_dtype float16 moves .* under 50: set float32"):
        check_hift(t, dec, voice)
