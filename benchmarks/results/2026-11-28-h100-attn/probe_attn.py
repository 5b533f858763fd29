# ruff: noqa: B023  (each closure is timed at once, inside its loop)
"""Probe (ledger: "H100 codec attention stages"): the flow slots' attention kernel at a held batch's
shape (8 streams' 8 held chunks: 16 rows x 160 queries, ~600 keys; and at 48 rows), its key loop's
software pipelining (the launch's num_stages: 1 to 5; today's launch takes Triton's default) by
blocking. In H100 codec tiles no blocking beat today's by more than 7 %: the loop's loads are gathers
through each key's pool index, a latency chain if not pipelined.

    PYTHONPATH=. python benchmarks/probe_attn.py <out.json>
"""

import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

from workflow.codec import kernels, timing
from workflow.codec.stream import first_hop

sys.path.insert(0, str(Path(__file__).parent))
from probe_tiles_lib import graph_us, rows


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
    got, real = {}, kernels.attention

    def record(q, pool, keys, starts, valid, chunk, **kw):
        got.setdefault("a", (q.clone(), pool, keys.clone(), starts.clone(), valid.clone(), chunk))
        return real(q, pool, keys, starts, valid, chunk, **kw)

    kernels.attention = record
    run.slot_solve(cfg.solver.steps // 2)
    kernels.attention = real
    q0, pool, keys0, starts0, valid0, chunk = got["a"]
    print(f"recorded {tuple(q0.shape)}, {keys0.shape[1]} keys, {time.perf_counter() - t0:.0f} s", flush=True)
    out = {"device": torch.cuda.get_device_name(), "cases": {}}
    for r in (16, 48):
        q, keys, starts, valid = rows(q0, r), rows(keys0, r), rows(starts0, r), rows(valid0, r)
        _, nq, h, d = q.shape
        case = out["cases"].setdefault(f"{r}x{nq}", {"today": graph_us(lambda: real(q, pool, keys, starts, valid, chunk))})
        timed = []
        for bq, bk, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4, 5)):
            y = q.new_empty(r, nq, h * d)

            def launch():
                kernels._attention[(r, h, triton.cdiv(nq, bq))](
                    q, pool, keys, starts, valid, y, nq, keys.shape[1], d**-0.5 * 1.4426950408889634, H=h, D=d,
                    DP=d, CHUNK=chunk, BQ=bq, BK=bk, PRECISION="tf32", STOP=True, KMAX=0, GDC=True, launch_pdl=True,
                    num_warps=warps, num_stages=stages,
                )  # fmt: skip

            try:
                timed.append((graph_us(launch), [bq, bk, warps, stages]))
            except Exception as e:  # out of resources
                print(f"  {bq} {bk} {warps} {stages}: {type(e).__name__}", flush=True)
        timed.sort()
        case["best"] = timed[:10]
        case["by_stages"] = {s: min(t for t, b in timed if b[3] == s) for s in (1, 2, 3, 4, 5)}
        print(f"{r} rows: today {case['today']:.1f} us; best {timed[0][0]:.1f} {timed[0][1]}; by stages "
              + ", ".join(f"{s}: {v:.1f}" for s, v in case["by_stages"].items())
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
