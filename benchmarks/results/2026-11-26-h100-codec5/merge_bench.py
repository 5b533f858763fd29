"""A/B on CUDA: serving's codec batch re-running every frame (compiled fast pass) vs the flow slots.
Each variant: n streams pushed chunk by chunk to CODES codes; ms of each flows() round (synchronized)."""

import dataclasses
import functools
import json
import os
import sys
import time

import torch

from workflow.codec import timing as ct
from workflow.codec.batch import CodecBatch
from workflow.detokenize import Piece
from workflow.engines.slots import batch_bucket

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PRESET = os.environ.get("PRESET", "full")
full = PRESET == "full"
t = ct.CodecTiming(preset=PRESET, dtype="bfloat16" if full else "float32", prompt_codes=50 if full else 12, baseline=False)
CODES = int(sys.argv[1]) if len(sys.argv) > 1 else 108
STEP = int(sys.argv[2]) if len(sys.argv) > 2 else 5  # codes a piece after the first: 15 = three chunks that waited
bucket = functools.partial(batch_bucket, max_batch=1 << 16)


def sync() -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def trajectory(batch: CodecBatch, n: int, key0: int) -> list[float]:
    keys = list(range(key0, key0 + n))
    ms, done = [], 0
    g = torch.Generator().manual_seed(n)
    while done < CODES:
        k = batch.first_codes if done == 0 else STEP
        pieces = [Piece(s, torch.randint(0, 16384, (k,), generator=g), done, False) for s in keys]
        sync()
        t0 = time.perf_counter()
        batch.flows(pieces)
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
        done += k
    batch.flows([Piece(s, torch.zeros(0, dtype=torch.long), done, True) for s in keys])
    sync()
    return ms


out = {}
variants = [("slots", True, 32, (1, 8, 32))]
for name, compiled, slots, ns in variants:
    dec, voice = ct.stream_decoder(dataclasses.replace(t, compile=compiled), dev)
    batch = CodecBatch(dec, voice, bucket, pad_frames=160, graphs=dev.type == "cuda", slots=slots, max_codes=CODES + 10)
    for n in ns:
        t0 = time.perf_counter()
        trajectory(batch, n, 1000 * n)  # graphs made
        made = time.perf_counter() - t0
        ms = trajectory(batch, n, 1000 * n + 500)
        out[f"{name} b{n}"] = ms
        later = ms[1:]
        print(
            f"{name} b{n}: first {ms[0]:.1f} ms, 2nd {ms[1]:.1f}, at {CODES} codes {ms[-1]:.1f}, "
            f"mean later {sum(later) / len(later):.1f} (first pass {made:.0f} s)",
            flush=True,
        )
    if batch.slots is not None:
        print(f"{name}: slots {batch.slots.nbytes() / 2**30:.1f} GiB, new_frames {batch.new_frames}", flush=True)
    if dev.type == "cuda":
        print(f"{name}: max memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    del batch, dec
    torch.cuda.empty_cache() if dev.type == "cuda" else None
print(json.dumps({k: [round(x, 1) for x in v] for k, v in out.items()}))
