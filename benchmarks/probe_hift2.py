"""Probe (ledger: "H200 codec HiFT 2"): HiFT's pass at a held batch (8 streams' 8 held chunks, 64 calls of
20 new frames, as serving's later lane runs it) from a CUDA graph, with each ResBlock step's bias, residual
sum and Snakes fused into two kernels (hift.ResBlock.fused, kernels.residual_snake) against the Snake kernel
alone (the step as torch's ops around it: bias, Snake, bias, sum, Snake), in turn in one process; the PCM's
largest difference between the two; then the fused pass's kernels by device time (eager, profiled).

    PYTHONPATH=. python benchmarks/probe_hift2.py <out.json>
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from workflow.codec import hift, timing
from workflow.codec.stream import first_hop


def graph_ms(fn, replays: int = 20) -> list[float]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def stepwise(self, x):  # the ResBlock before: torch's bias and sum around the Snake kernel
    for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
        x = x + c2(a2(c1(a1(x))))
    return x


def main() -> None:
    out_path, t0, dev = Path(sys.argv[1]), time.perf_counter(), torch.device("cuda")
    t = timing.CodecTiming(preset="full", dtype="bfloat16", prompt_codes=46, later_codes=100, batches=(1, 8), repeat=5,
                           baseline=False, flow_cache=False, slots=8, held=8, compile=False, kernels=True)  # fmt: skip
    ours, _ = timing.decoders(t, dev)
    cfg, voice = ours.cfg, timing.voice_of(t, ours)
    la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
    hop0, cf = first_hop(t.prompt_codes, chunk, stride), chunk * stride
    later = t.prompt_codes + t.later_codes + hop0
    new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
    cached = (later - chunk) * stride // cf * cf
    run = timing.SlotRunner(ours, voice, 8, later, False, max(new, 8 * cf), cached - 8 * cf + cf)
    run.hift_rows(8)
    assert all(m.fused for m in ours.hift.modules() if isinstance(m, hift.Snake))
    fused_forward = hift.ResBlock.forward
    out = {"device": torch.cuda.get_device_name(), "mel": list(run.mel.shape), "ms": {"stepwise": [], "fused": []}}
    with torch.no_grad():
        pcm = {}
        for name, fwd in (("stepwise", stepwise), ("fused", fused_forward)):
            hift.ResBlock.forward = fwd
            pcm[name] = run.vocode().float().clone()
        out["pcm_max_abs_diff"] = float((pcm["fused"] - pcm["stepwise"]).abs().max())
        out["pcm_peak"] = float(pcm["stepwise"].abs().max())
        for _ in range(3):  # in turn, so that drift falls on both
            for name, fwd in (("stepwise", stepwise), ("fused", fused_forward)):
                hift.ResBlock.forward = fwd
                out["ms"][name] += graph_ms(run.vocode)
        out["median_ms"] = {k: statistics.median(v) for k, v in out["ms"].items()}
        hift.ResBlock.forward = fused_forward
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run.vocode()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(table, flush=True)
        out["kernels"] = table
    summary = {k: v for k, v in out.items() if k not in ("kernels", "ms")}
    print(json.dumps(summary), f"{time.perf_counter() - t0:.0f} s", flush=True)
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
