"""Probe (ledger: "H100 codec HiFT 3"): HiFT's pass at a held batch (8 streams' 8 held chunks, 64 calls of
20 new frames, as serving's later lane runs it) from a CUDA graph, its network channels-last (`HiFT.fuse`:
[B, C, 1, T] activations and weights, 2-D convolutions) against the same fused kernels over [B, C, T] (H100
codec HiFT 2's), in turn in one process; the PCM's largest difference and signal-to-difference ratio
between the two (TF32 convolutions of other algorithms); then the channels-last pass's kernels by device
time (eager, profiled).

    PYTHONPATH=. python benchmarks/probe_hift3.py <out.json>
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


def layout(h, channels_last: bool) -> None:
    """The network channels-last (fuse's), or the same kernels over [B, C, T] with contiguous weights."""
    h.fuse()
    if not channels_last:
        h.fused = False
        for name, m in h.named_modules():
            if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d) and not name.startswith(("f0_predictor", "m_source")):
                m.weight.data = hift.channels_last(m.weight.data, False)


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
    variants = (("nct", False), ("channels_last", True))
    out = {"device": torch.cuda.get_device_name(), "mel": list(run.mel.shape), "ms": {k: [] for k, _ in variants}}
    with torch.no_grad():
        pcm = {}
        for name, on in variants:
            layout(ours.hift, on)
            pcm[name] = run.vocode().float().clone()
        d, ref = pcm["channels_last"] - pcm["nct"], pcm["nct"]
        out["pcm_max_abs_diff"] = float(d.abs().max())
        out["pcm_snr_db"] = float(10 * torch.log10(ref.pow(2).sum() / d.pow(2).sum().clamp_min(1e-30)))
        out["pcm_peak"] = float(ref.abs().max())
        for _ in range(3):  # in turn, so that drift falls on both
            for name, on in variants:
                layout(ours.hift, on)
                out["ms"][name] += graph_ms(run.vocode)
        out["median_ms"] = {k: statistics.median(v) for k, v in out["ms"].items()}
        layout(ours.hift, True)
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
