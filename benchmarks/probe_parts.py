"""Parts of the GPU probe that time more than one engine call: the vocoder, and the streaming
loop itself (prefill, decode steps with their host work, the detokenizer's mel stage).

Kept apart from gpu_probe.py, which builds and checks the engine variants these time.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable
from pathlib import Path

import torch

from workflow import roofline, traffic
from workflow.benchmark import microbench
from workflow.generate import Ids, Sampling
from workflow.stream import SECONDS_PER_TOKEN, check_stream, device_clock, run_stream
from workflow.vocoder import Graphed, MelStandIn, load_bigvgan

LOOP = {"prompt_len": 512, "num_tokens": 50, "chunk_tokens": 5, "runs": 5}  # config/full.yaml's stream


def loop(engine, ids: Ids, dev: torch.device, trace: Path | None = None) -> dict:
    """The benchmark's stream (one, sampled, detokenizer overlapped) with a vocoder that returns
    a constant at once: TTFA less the vocoder, broken down (prefill, the first token's sampling,
    the decode steps before the first chunk, the chunk on the side stream), each decode step as
    the loop sees it, host work included, and one stream under the profiler: the GPU's busy
    time against the wall. trace: where to write a gzipped Chrome trace (host and GPU) of a
    short stream of two chunks."""
    from torch.profiler import ProfilerActivity, profile

    mel = MelStandIn(ids.eosp + 1, 100, 24000 / 256, dev)
    spt, k, n = round(SECONDS_PER_TOKEN * 24000), LOOP["chunk_tokens"], LOOP["num_tokens"]
    prompt = traffic.speech_prompt(1, LOOP["prompt_len"], ids, 0)
    clock = device_clock(dev)

    def constant(m: torch.Tensor) -> torch.Tensor:
        return torch.full((m.shape[0], 1, m.shape[-1] * 256), 1e-3, device=dev, dtype=m.dtype)

    def one(seed: int, n: int = n):
        g = torch.Generator(dev).manual_seed(seed)
        t, audio = run_stream(engine, mel, constant, prompt, n, k, spt, ids, clock, Sampling(), g, overlap=True, first_alone=True)
        assert not check_stream(t, audio, n, k, spt), check_stream(t, audio, n, k, spt)
        return t

    one(0)  # warm-up
    runs = [one(1 + i) for i in range(LOOP["runs"])]
    ms = 1e3
    out = {
        "ttfa_no_vocoder_ms": [t.ttfa_ms() for t in runs],
        "prefill_ms": [ms * (t.t_prefill - t.t_request) for t in runs],
        "first_sample_ms": [ms * (t.t_tokens[0] - t.t_prefill) for t in runs],
        "first_chunk_steps_ms": [t.stages()["decode_step_ms"][: k - 1] for t in runs],
        "first_chunk_side_ms": [ms * (t.chunks[0].t_ready - t.t_tokens[k - 1]) for t in runs],
        "decode_step_p50_ms": roofline.median([x for t in runs for x in t.stages()["decode_step_ms"]]),
        "wall_ms": [ms * t.wall_s() for t in runs],
    }
    with profile(activities=[ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU]) as p:
        t = one(99)
    out["profiled"] = {"wall_ms": ms * t.wall_s(), **kernel_summary(p, 16)}
    if trace is not None and dev.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            one(98, 2 * k)
        raw = trace.with_suffix(".tmp")
        p.export_chrome_trace(str(raw))
        trace.write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
    return out


def kernel_summary(p, top: int = 12) -> dict:
    """A profile's GPU time: in all (kernel_ms), kernel count, the `top` kernels by time, and all."""
    events = [e for e in p.key_averages() if e.device_time_total > 0]
    ranked = sorted(events, key=lambda e: -e.device_time_total)[:top]
    return {
        "kernel_ms": sum(e.device_time_total for e in events) / 1e3,
        "kernels": sum(e.count for e in events),
        "top": [(e.key[:90], round(e.device_time_total / 1e3, 3), e.count) for e in ranked],
        "all": sorted((e.key[:120], round(e.device_time_total / 1e3, 4), e.count) for e in events),
    }


def loop_line(name: str, lp: dict) -> str:
    """One line of the probe's closing summary."""
    med = roofline.median
    return (
        f"{name}: loop TTFA-less-vocoder {med(lp['ttfa_no_vocoder_ms']):.2f} = prefill {med(lp['prefill_ms']):.2f}"
        f" + first sample {med(lp['first_sample_ms']):.2f} + steps {[round(x, 2) for x in lp['first_chunk_steps_ms'][0]]}"
        f" + side {med(lp['first_chunk_side_ms']):.2f}; in-loop step p50 {lp['decode_step_p50_ms']:.3f} ms; profiled "
        f"stream {lp['profiled']['wall_ms']:.1f} ms wall, {lp['profiled']['kernel_ms']:.1f} ms kernels"
    )


def vocoder_times(dev: torch.device, dtype: torch.dtype, name: str, say: Callable[[str], None]) -> dict:
    """The exact BigVGAN-v2 24 kHz config, random weights: eager, graphed, fused kernel, compiled."""
    res: dict = {}
    for fused in (False, True):
        t = time.time()
        model, info = load_bigvgan(name, None, dev, dtype, fused_kernel=fused)
        say(f"vocoder loaded (fused requested {fused}, ran {info.fused_kernel}) in {time.time() - t:.1f} s")
        for b in (1, 32):
            mel = torch.randn(b, 100, 38, device=dev, dtype=dtype)
            graphed = Graphed(model, dev)
            eager = roofline.median(roofline.timed_ms(lambda m=model, x=mel: m(x), dev, 10))
            g = roofline.median(roofline.timed_ms(lambda m=graphed, x=mel: m(x), dev, 10))
            diff = float((graphed(mel).float() - model(mel).float()).abs().max())
            res[f"vocoder_fused{int(info.fused_kernel)}_b{b}"] = {
                "eager_ms": eager,
                "graph_ms": g,
                "graph_vs_eager_max_diff": diff,
            }
            say(f"vocoder b{b} fused={info.fused_kernel}: eager {eager:.2f} ms, graph {g:.2f} ms, diff {diff:.2e}")
        if not fused:  # the same model under torch.compile (dynamic shapes: chunk lengths, batch sizes)
            compiled = torch.compile(model, dynamic=True)
            for b, frames in ((1, 38), (1, 37), (32, 38)):
                mel = torch.randn(b, 100, frames, device=dev, dtype=dtype)
                t = time.time()
                with torch.no_grad():
                    compiled(mel)
                roofline.sync(dev)
                first_s = time.time() - t
                graphed = Graphed(compiled, dev)
                g = roofline.median(roofline.timed_ms(lambda m=graphed, x=mel: m(x), dev, 10))
                with torch.no_grad():
                    diff = float((graphed(mel).float() - model(mel).float()).abs().max())
                res[f"vocoder_compiled_b{b}_f{frames}"] = {"first_call_s": first_s, "graph_ms": g, "vs_eager_max_diff": diff}
                say(f"vocoder compiled b{b} f{frames}: first call {first_s:.1f} s, graph {g:.2f} ms, diff {diff:.2e}")
        if not info.fused_kernel and fused:
            break
    return res


def interleaved_ab(engine, ids: Ids, dev: torch.device, settings: dict[str, Callable[[], None]], rounds: int = 4) -> dict:
    """Audio-mode decode steps at batch 1 after a 512-token prompt under each setting (a
    function that puts it in force, its own graphs included), the settings timed in turn (drift
    within the process hits all alike); medians in ms. Then the first setting against each
    other: the max |logit diff| over 10 steps that switch mode. Leaves the first in force."""
    if dev.type != "cuda":
        return {}
    prompt, tok = traffic.speech_prompt(1, 512, ids, seed=0), torch.tensor([[ids.pad, 100]])
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, apply in settings.items():
            apply()
            engine.prefill(prompt)
            times[name] += roofline.timed_ms(lambda: engine.decode(tok, need_text=False), dev, 20)
    out: dict = {f"{name}_ms": roofline.median(ts) for name, ts in times.items()}
    follow = traffic.batch(1, 10, ids, seed=22)
    logits = {}
    for name, apply in reversed(settings.items()):
        apply()
        engine.prefill(prompt)
        modes = (False, False, True, False, True, True, False, False, False, True)
        logits[name] = [engine.decode(follow[:, t], need_text=nt) for t, nt in enumerate(modes)]
    first = next(iter(settings))
    for name in list(settings)[1:]:
        out[f"{name}_max_logit_diff"] = max(
            float((a - b).abs().max())
            for x, y in zip(logits[first], logits[name], strict=True)
            for a, b in zip(x, y, strict=True)
            if a is not None
        )
    return out


def defer_fill_ab(engine, ids: Ids, dev: torch.device, owed: int = LOOP["num_tokens"], repeat: int = 20) -> dict:
    """The text branch deferred to the next text-mode step (audio steps read none of its
    weights) against filled in step; then, for each, what the first text-mode step after `owed`
    audio steps costs (the deferred catch-up included), and a text-mode step with nothing owed,
    medians in ms, as the benchmark times them (`microbench`: repeat 20 times 5 replies after
    one warming up; probe 22; the late fill it replaced was measured against both there)."""
    from workflow.cudagraphs import Graphs

    def setting(defer: bool) -> Callable[[], None]:
        graphs = Graphs(dev)

        def apply() -> None:
            engine.defer_text_fill = defer
            engine.graphs = graphs

        return apply

    settings = {"deferred": setting(True), "in_step": setting(False)}
    out = interleaved_ab(engine, ids, dev, settings)
    if dev.type != "cuda":
        return out
    for name, apply in settings.items():
        apply()
        micro = microbench(engine, 512, ids, repeat, reply_len=owed)  # the benchmark's own timing of it
        out[f"{name}_text_after_{owed}_audio_ms"] = micro["decode_text_after_reply_ms"]["p50"]
        out[f"{name}_text_step_ms"] = micro["decode_text_mode_ms"]["p50"]
    settings["deferred"]()
    return out


def glu_ab(engine, ids: Ids, dev: torch.device) -> dict:
    """gate_up's GEMV ending in silu(gate) * up (bf16 layers: the branches in an FP8 engine)
    against proj's GEMV starting with it, each program re-reading [gate | up] (probe 17)."""
    from workflow.cudagraphs import Graphs
    from workflow.engines import gemv

    def setting(glu: bool) -> Callable[[], None]:
        graphs = Graphs(dev)

        def apply() -> None:
            for layer in engine.layers:
                layer.fused = (*layer.fused[:2], glu)
            engine.graphs = graphs

        return apply

    setting(False)()
    gemv.tune(engine.gemv_uses())  # the prologue's blocks, beside the epilogue's (tuned at build)
    return interleaved_ab(engine, ids, dev, {"glu": setting(True), "silu_prologue": setting(False)})


def body_ab(engine, ids: Ids, dev: torch.device, attr: str, labels: tuple[str, str]) -> dict:
    """The GEMV's blocks tuned with one body offered (as built) against tuned without it (`attr`,
    that body's choices in `gemv`, emptied for the retune), each setting's blocks captured in its
    own graphs; and each use's tuned time both ways."""
    from workflow.cudagraphs import Graphs
    from workflow.engines import gemv

    with_body, saved = dict(gemv.BLOCKS), getattr(gemv, attr)
    timed_with = {k: gemv.TUNED_MS.get(k) for k in engine.gemv_blocks}
    setattr(gemv, attr, ())
    gemv.tune(engine.gemv_uses())
    setattr(gemv, attr, saved)
    without = dict(gemv.BLOCKS)
    timed_without = {k: gemv.TUNED_MS.get(k) for k in engine.gemv_blocks}

    def setting(blocks: dict) -> Callable[[], None]:
        graphs = Graphs(dev)

        def apply() -> None:
            gemv.BLOCKS.clear()
            gemv.BLOCKS.update(blocks)
            engine.graphs = graphs

        return apply

    out = interleaved_ab(engine, ids, dev, {labels[0]: setting(with_body), labels[1]: setting(without)})
    out["tuned_us"] = {k: [round(1000 * (timed_with[k] or 0), 1), round(1000 * (timed_without[k] or 0), 1)] for k in timed_with}
    out["blocks"] = {k: [with_body.get(k), without.get(k)] for k in engine.gemv_blocks}
    return out


def resident_ab(engine, ids: Ids, dev: torch.device) -> dict:
    """The resident GEMV body offered to the tuner (as built) against not (probe 18)."""
    return body_ab(engine, ids, dev, "RESIDENT_N", ("resident", "tiled"))


def dot_ab(engine, ids: Ids, dev: torch.device) -> dict:
    """The tensor-core GEMV body offered to the tuner (as built) against not (probe 33)."""
    return body_ab(engine, ids, dev, "DOT_N", ("dot", "cuda-cores"))


def steady_key(engine) -> tuple:
    """The graph key of a steady audio-mode decode step at batch 1: (shape, need_text,
    all_logits, kv_len, hold); not a catch-up's ("catch-up", batch, rows, kv_len)."""
    return next(k for k in engine.graphs.graphs if k[0] != "catch-up" and k[0][:2] == (1, 1) and not k[1])


def call_split(engine, ids: Ids, dev: torch.device, repeat: int = 20) -> dict:
    """An engine call's time taken apart without a profiler (which slows graph launches
    tenfold): audio-mode decode at batch 1, each piece synchronised and timed alone, medians in
    ms: the bare replay; with the token copy from the pinned buffer before it; with the host
    write into that buffer too; `_step` (adds the outputs' clone); `decode` with host tokens (as
    the benchmark times it; adds the position's increment) and with device tokens (as the
    generation loop calls it) (probe 19)."""
    if dev.type != "cuda":
        return {}
    engine.prefill(traffic.speech_prompt(1, 512, ids, seed=0))
    tok = torch.tensor([[ids.pad, 100]])
    for _ in range(3):
        engine.decode(tok, need_text=False)
    key = steady_key(engine)
    graph = engine.graphs.graphs[key][0]
    static, pinned, _ = engine.static_tokens[key[0]]
    tok3, dev_tok = tok[:, None], tok.to(dev)

    def h2d() -> None:
        static.copy_(pinned, non_blocking=True)
        graph.replay()

    def host_write() -> None:
        pinned.copy_(tok3)
        h2d()

    pieces = {
        "replay": graph.replay,
        "h2d_replay": h2d,
        "write_h2d_replay": host_write,
        "step": lambda: engine._step(tok3, engine.pos, *key[1:]),
        "decode_host_tokens": lambda: engine.decode(tok, need_text=False),
        "decode_device_tokens": lambda: engine.decode(dev_tok, need_text=False),
    }
    out = {}
    for _ in range(2):  # twice in turn: the second pass is kept
        for name, fn in pieces.items():
            out[name] = round(roofline.median(roofline.timed_ms(fn, dev, repeat)), 4)
    return out
