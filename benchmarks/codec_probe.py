# ruff: noqa: B023  (a probe: closures read the loop variables of their own iteration only)
"""Probe: the codec decoder's stage costs at the true shape on one GPU (random weights).

Prints one table: per stage (front end, one estimator pass, the 10-step solve, HiFT) and per variant
(eager float32 as the official code runs, eager bf16, bf16 CUDA graph, bf16 compiled + graph), at
batch 1 and batched, for the first chunk (prompt + 8 codes) and for later calls of a long utterance.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from workflow.codec.config import CodecConfig
from workflow.codec.decoder import CodecDecoder
from workflow.codec.solver import cosine_schedule

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT = 50  # codes in the voice prompt (4 s)


def timed(fn, reps=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    if dev.type == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    out.sort()
    return out[len(out) // 2]


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    rows = []
    cfg = CodecConfig() if dev.type == "cuda" else CodecConfig.tiny()
    base = CodecDecoder(cfg).eval().to(dev)
    base.noise.buffer = base.noise.buffer.to(dev)
    variants = {"fp32": (torch.float32, False, False), "bf16": (torch.bfloat16, False, False),
                "bf16+graph": (torch.bfloat16, True, False), "bf16+compile+graph": (torch.bfloat16, True, True)}
    for name, (dtype, graph, comp) in variants.items():
        if dev.type == "cpu" and graph:
            continue
        dec = CodecDecoder(cfg).eval().to(dev)
        dec.load_state_dict(base.state_dict())
        dec = dec.to(dtype)
        dec.noise.buffer = base.noise.buffer
        est = torch.compile(dec.estimator, dynamic=False) if comp else dec.estimator
        enc = dec.flow.encoder
        for batch in (1, 8, 32, 64):
            for codes in (8, 58, 258):
                if name == "fp32" and batch > 8:
                    continue
                if codes > 58 and batch > 32:
                    continue
                if comp and (batch in (8, 64) or codes > 58):
                    continue
                t_tok = PROMPT + codes - 3  # body; the last 3 are the lookahead context
                frames = t_tok * 4
                tokens = torch.randint(0, 16384, (batch, t_tok), device=dev)
                ctx = torch.randint(0, 16384, (batch, 3), device=dev)
                lengths = torch.full((batch,), t_tok, device=dev)

                @torch.no_grad()
                def front():
                    x = dec.flow.input_embedding(tokens)
                    c = dec.flow.input_embedding(ctx)
                    return dec.flow.encoder_proj(enc(x, lengths, 5, c)).transpose(1, 2)

                mu = front()
                mask = torch.ones(batch, 1, frames, device=dev, dtype=dtype)
                spks = torch.randn(batch, 80, device=dev, dtype=dtype)
                cond = torch.zeros_like(mu)
                x2 = torch.randn(2 * batch, 80, frames, device=dev, dtype=dtype)
                m2, mu2, s2, c2 = (torch.cat([v, v]) for v in (mask, mu, spks, cond))
                t2 = torch.full((2 * batch,), 0.3, device=dev, dtype=dtype)

                @torch.no_grad()
                def one_pass():
                    return est(x2, m2, mu2, t2, s2, c2, streaming=True)

                @torch.no_grad()
                def solve():
                    x = dec.noise.buffer[:, :, :frames].to(dtype).expand(batch, -1, -1)
                    ts = cosine_schedule(10, dev, dtype)
                    for i in range(10):
                        v = est(torch.cat([x, x]), m2, mu2, ts[i].expand(2 * batch), s2, c2, streaming=True)
                        x = x + (ts[i + 1] - ts[i]) * (1.7 * v[:batch] - 0.7 * v[batch:])
                    return x

                new = 20 + 8  # HiFT over the 8 cached frames + 20 new
                mel = torch.randn(batch, 80, new, device=dev)
                src = torch.randn(batch, 1, new * 480, device=dev)

                @torch.no_grad()
                def hift():  # float32 in every variant (its STFTs)
                    f0 = base.hift.f0_predictor(mel)
                    return base.hift.decode(mel, src), f0

                fns = {"front_end": front, "estimator_pass": one_pass, "solve_10": solve, "hift": hift}
                for stage, fn in fns.items():
                    try:
                        f = graphed(fn) if graph and stage != "hift" else fn  # istft syncs: no graph
                        ms = timed(f, reps=10 if codes > 58 else 20)
                    except Exception as e:
                        ms = None
                        print(f"{name} {stage} b{batch} c{codes}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    rows.append(dict(variant=name, stage=stage, batch=batch, codes=codes, frames=frames, ms=ms))
                    print(f"{name:20s} {stage:15s} batch {batch:3d} codes {codes:3d} frames {frames:5d}: "
                          f"{'-' if ms is None else f'{ms:8.3f}'} ms", flush=True)
                torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "codec_probe.json"), "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)
