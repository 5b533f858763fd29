"""The codec flow's ODE solver (workflow/codec/solver.py): its schedule, fixed noise, guidance and
Euler steps, against the estimator of test_codec_flow.py. CPU, float32, the tiny shape."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_codec_flow import CHUNK, TINY, inputs, tiny_estimator

from workflow.codec.config import SolverConfig
from workflow.codec.solver import FixedNoise, FlowSolver, cosine_schedule, solve


def test_cosine_schedule():
    t = cosine_schedule(10)
    assert t.shape == (11,)
    for k in range(11):
        assert t[k].item() == pytest.approx(1 - math.cos(k / 10 * math.pi / 2), abs=1e-6)
    assert t[0] == 0 and t[-1].item() == pytest.approx(1.0, abs=1e-6)
    steps = t.diff()
    assert (steps > 0).all() and (steps.diff() > 0).all()  # small steps first, near the noise
    assert steps[0].item() == pytest.approx(0.0123117, abs=1e-6)


def test_fixed_noise_is_the_seeded_buffer_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    noise = FixedNoise(500, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    with torch.random.fork_rng():  # the official buffer: set_all_random_seed(0); torch.randn([1, 80, N])
        torch.manual_seed(0)
        assert torch.equal(noise.buffer, torch.randn(1, 80, 500))
    assert not torch.equal(FixedNoise(500, seed=1).buffer, noise.buffer)
    assert torch.equal(noise.take(40), noise.take(300)[:, :, :40])
    with pytest.raises(ValueError, match="exceed the fixed noise buffer"):
        noise.take(501)


def test_solve_is_deterministic_and_config_changes_it():
    est, i = tiny_estimator(), inputs(b=2, t=25)
    cfg = TINY.solver
    with torch.inference_mode():
        a = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg)
        torch.manual_seed(1234)  # the global RNG has no say
        b = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg)
        c = FlowSolver(cfg)(est, i["mu"], i["mask"], i["spks"], i["cond"])
        more_steps = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], dataclasses.replace(cfg, steps=3))
        no_cfg = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], dataclasses.replace(cfg, cfg_rate=0.0))
        other_seed = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], dataclasses.replace(cfg, noise_seed=7))
    assert a.shape == (2, 80, 25) and a.dtype == torch.float32
    assert torch.equal(a, b) and torch.equal(a, c)
    for other in (more_steps, no_cfg, other_seed):
        assert (other - a).abs().max() > 1e-3
    n = cfg.noise_frames + 1  # longer than the fixed noise buffer
    with pytest.raises(ValueError, match="exceed"):
        solve(est, torch.zeros(1, 80, n), torch.ones(1, 1, n), torch.zeros(1, 80), torch.zeros(1, 80, n), cfg)


def euler_reference(est, i, steps: int, cfg_rate: float, frames: int, seed: int) -> torch.Tensor:
    """The guided Euler integration written out step by step, from the estimator's own outputs."""
    b = i["mu"].shape[0]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 80, frames, generator=g)[:, :, : i["mu"].shape[-1]].expand(b, -1, -1)
    times = [1 - math.cos(k / steps * math.pi / 2) for k in range(steps + 1)]
    zeros = {k: torch.zeros_like(v) for k, v in i.items()}
    for k in range(steps):
        t = torch.full((b,), times[k])
        v_c = est(x, i["mask"], i["mu"], t, i["spks"], i["cond"])
        v_u = est(x, i["mask"], zeros["mu"], t, zeros["spks"], zeros["cond"])
        x = x + (times[k + 1] - times[k]) * ((1 + cfg_rate) * v_c - cfg_rate * v_u)
    return x


@pytest.mark.parametrize("cfg_rate", [0.0, 0.7])
def test_solve_equals_the_written_out_euler_loop(cfg_rate):
    est, i = tiny_estimator(), inputs(b=2, t=30)
    cfg = dataclasses.replace(TINY.solver, steps=4, cfg_rate=cfg_rate)
    with torch.inference_mode():
        got = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg)
        want = euler_reference(est, i, cfg.steps, cfg_rate, cfg.noise_frames, cfg.noise_seed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.abs().max() > 0.1


class Recorder(torch.nn.Module):
    """A stand-in estimator returning a constant velocity 1 and recording what it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, x, mask, mu, t, spks, cond, streaming=False):
        self.calls.append({"x": x.clone(), "mu": mu, "t": t.clone(), "spks": spks, "cond": cond, "streaming": streaming})
        return torch.ones_like(x)


def test_guidance_batch_layout_and_step_times():
    rec, i = Recorder(), inputs(b=2, t=9)
    cfg = SolverConfig(steps=5, cfg_rate=0.7, noise_frames=100)
    out = solve(rec, i["mu"], i["mask"], i["spks"], i["cond"], cfg, streaming=True)
    assert len(rec.calls) == 5
    times = cosine_schedule(5)
    for k, call in enumerate(rec.calls):
        assert call["streaming"] is True
        assert call["x"].shape == (4, 80, 9)
        assert torch.equal(call["x"][:2], call["x"][2:])
        assert torch.equal(call["mu"][:2], i["mu"]) and not call["mu"][2:].any()
        assert torch.equal(call["spks"][:2], i["spks"]) and not call["spks"][2:].any()
        assert torch.equal(call["cond"][:2], i["cond"]) and not call["cond"][2:].any()
        torch.testing.assert_close(call["t"], times[k].expand(4), rtol=0, atol=1e-6)
    # v = 1.7 * 1 - 0.7 * 1 = 1 on every step, so x moves by the whole span: noise + 1
    torch.testing.assert_close(out, FixedNoise(100, 0).take(9).expand(2, -1, -1) + 1, rtol=0, atol=1e-5)
    unguided = Recorder()
    solve(unguided, i["mu"], i["mask"], i["spks"], i["cond"], dataclasses.replace(cfg, cfg_rate=0.0))
    assert unguided.calls[0]["x"].shape == (2, 80, 9)  # no unconditional half when its weight is 0


def test_streaming_solve_of_a_prefix_matches_the_longer_run():
    """Streaming re-runs the flow on a growing prefix; with fixed noise and chunk masks the finished
    chunks come out the same."""
    est, i = tiny_estimator(), inputs(t=3 * CHUNK)
    cfg = TINY.solver
    prefix = {k: (v[:, :, : 2 * CHUNK] if v.dim() == 3 else v) for k, v in i.items()}
    with torch.inference_mode():
        long = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg, streaming=True)
        short = solve(est, prefix["mu"], prefix["mask"], prefix["spks"], prefix["cond"], cfg, streaming=True)
        long_off = solve(est, i["mu"], i["mask"], i["spks"], i["cond"], cfg, streaming=False)
        short_off = solve(est, prefix["mu"], prefix["mask"], prefix["spks"], prefix["cond"], cfg, streaming=False)
    torch.testing.assert_close(short, long[:, :, : 2 * CHUNK], rtol=0, atol=1e-5)
    assert (short_off - long_off[:, :, : 2 * CHUNK]).abs().max() > 1e-3
