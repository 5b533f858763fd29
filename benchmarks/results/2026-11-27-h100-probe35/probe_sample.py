"""Probe: a step's sampling on the critical path, eager against one CUDA graph (standalone, no model).
A stand-in decode graph (~3 ms of GEMVs) writes logits; then the loop's per-step work; per-step ms."""
import json
import sys
import time

import torch

from workflow.generate import Ids, Sampling, advance, sample_step

dev = torch.device("cuda")
VT, VA = 151680, 16512  # MOSS-Speech's (FACTS.md 1)
ids = Ids(sosp=151646, eosp=16384, pad=151667)
W = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) / 90
x0 = torch.randn(1, 8192, device=dev, dtype=torch.bfloat16)
base_text = torch.randn(1, VT, device=dev)
base_audio = torch.randn(1, VA, device=dev)
GEMVS = int(sys.argv[1]) if len(sys.argv) > 1 else 70


def decode():
    x = x0
    for _ in range(GEMVS):
        x = (x @ W).clamp(-1, 1)
    d = x[:, :1].float() * 0
    return base_text + d, base_audio + d


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


dg, (tl, al) = graph_of(decode)
out = {}
for greedy in (True, False):
    s = Sampling(greedy=greedy)
    seen_t = torch.zeros(1, VT, dtype=torch.bool, device=dev)
    seen_a = torch.zeros(1, VA, dtype=torch.bool, device=dev)
    mode = torch.ones(1, dtype=torch.bool, device=dev)

    def loop_work(text_logits):
        t, a = sample_step(text_logits, al, seen_t, seen_a, None, ids, s, None)
        tokens, nxt, stopped = advance(t, a, mode, ids)
        seen_t.scatter_(1, tokens[:, :1], True)
        seen_a.scatter_(1, tokens[:, 1:], True)
        return torch.stack([stopped, ~nxt]).long(), tokens

    for text in (False, True):
        tlog = tl if text else None
        sg, (flags, toks) = graph_of(lambda: loop_work(tlog))
        pinned = torch.empty(1, 2, dtype=torch.long, pin_memory=True)
        static = torch.empty(1, 2, dtype=torch.long, device=dev)
        for name in ("decode only", "eager sampling", "graphed sampling"):
            times = []
            for it in range(230):
                t0 = time.perf_counter()
                pinned.copy_(torch.tensor([[1, 2]]))
                static.copy_(pinned, non_blocking=True)
                dg.replay()
                if name == "eager sampling":
                    f, _ = loop_work(tlog)
                    f.tolist()
                elif name == "graphed sampling":
                    sg.replay()
                    flags.tolist()
                else:
                    tl[:, :1].tolist()
                times.append(time.perf_counter() - t0)
            ms = sorted(times[30:])[100] * 1e3
            key = f"{'greedy' if greedy else 'sampled'}, {'text' if text else 'audio'} mode, {name}"
            out[key] = ms
            print(f"{key}: {ms:.3f} ms", flush=True)
json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null", "w"), indent=1)
