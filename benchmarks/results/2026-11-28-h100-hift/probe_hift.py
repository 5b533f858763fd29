"""Probe (ledger: "H100 codec HiFT"): HiFT's pass at a held batch (8 streams' 8 held chunks, 64 calls
of 20 new frames, as serving's later lane runs it): its kernels by device time (eager, profiled), and
the pass from a CUDA graph as it runs (float32, TF32 convolutions as cuDNN's default) against the
same under bf16 autocast, with the PCM's signal-to-error ratio against float32's.

    PYTHONPATH=. python benchmarks/probe_hift.py <out.json>
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from workflow.codec import timing
from workflow.codec.stream import first_hop


def graph_ms(fn, replays: int = 10) -> float:
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
    return statistics.median(times)


def main() -> None:
    out_path, t0, dev = Path(sys.argv[1]), time.perf_counter(), torch.device("cuda")
    t = timing.CodecTiming(preset="full", dtype="bfloat16", prompt_codes=46, later_codes=100, batches=(1, 8), repeat=5,
                           baseline=False, flow_cache=False, slots=8, held=8, compile=False)  # fmt: skip
    ours, _ = timing.decoders(t, dev)
    cfg, voice = ours.cfg, timing.voice_of(t, ours)
    la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
    hop0, cf = first_hop(t.prompt_codes, chunk, stride), chunk * stride
    later = t.prompt_codes + t.later_codes + hop0
    new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
    cached = (later - chunk) * stride // cf * cf
    run = timing.SlotRunner(ours, voice, 8, later, False, max(new, 8 * cf), cached - 8 * cf + cf)
    run.hift_rows(8)
    out = {"device": torch.cuda.get_device_name(), "mel": list(run.mel.shape)}
    with torch.no_grad():
        ref = run.vocode().float().clone()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run.vocode()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(table, flush=True)
        out["kernels"] = table
        out["fp32_ms"] = graph_ms(run.vocode)
        try:
            with torch.autocast("cuda", torch.bfloat16):
                low = run.vocode().float().clone()
                out["bf16_autocast_ms"] = graph_ms(run.vocode)
            err = (low - ref).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30)
            out["bf16_snr_db"] = float(-10 * torch.log10(err))
            out["bf16_max_abs_err"] = float((low - ref).abs().max())
            out["pcm_peak"] = float(ref.abs().max())
        except Exception as e:  # an op without bf16
            out["bf16_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(json.dumps({k: v for k, v in out.items() if k != "kernels"}), f"{time.perf_counter() - t0:.0f} s", flush=True)
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
