"""The codec section of the benchmark: what it times is the decoder's own computation, at every
call position, variant and batch it was asked for."""

import gc
import weakref

import pytest
import torch

from workflow.codec.solver import solve
from workflow.codec.timing import CodecTiming, Runner, decoders, measure

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
    want, _ = ours.hift(run.mel, generator=torch.Generator().manual_seed(0))  # HiFT's own forward, the same noise
    assert torch.equal(run.hift(), want) and want.shape == (2, (8 + 20) * 480)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), ours.state_dict().values(), strict=True))
    cached = Runner(ours, batch=2, body=15, prompt_codes=10, graphs=False, past_frames=20)  # the flow cache
    torch.testing.assert_close(cached.solve(), run.solve()[..., 20:], rtol=0, atol=1e-5)
    assert cached.ode_step().shape == (4, 80, 40) and cached.past_bytes() > 0 == run.past_bytes()
    assert all(p.frames == 20 for p in cached.past)  # each timed call starts from the same past


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


def test_codec_settings_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown key"):
        CodecTiming.from_dict({"presets": "full"})
    with pytest.raises(ValueError, match="'huge' is not one of tiny, full"):
        CodecTiming.from_dict({"preset": "huge"})


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
