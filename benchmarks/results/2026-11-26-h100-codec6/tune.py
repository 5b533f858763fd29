"""Time the codec kernels' blockings inside CUDA graphs at serving's shapes; print the best per shape."""
import itertools
import sys
import time

import torch

from workflow.codec import kernels
from workflow.codec.kernels import Tile

dev, dt = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)


def timed(fn, n=20, reps=5):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / n)
    return best


norm = torch.nn.LayerNorm(256).to(dev, dt)
only = sys.argv[1] if len(sys.argv) > 1 else "all"
t0 = time.time()
if only in ("all", "linear"):
    for m in (120, 960, 3840):
        pool = torch.zeros(4096 * 4, 1024, device=dev, dtype=dt).view(-1, 2, 8, 64)
        writes = torch.randperm(pool.shape[0], device=dev)[:m]
        shapes = {
            "qkv": (256, 1536, dict(norm=norm, pool=pool, writes=writes), False),
            "out": (512, 256, dict(residual=torch.randn(m, 256, device=dev, dtype=dt)), True),
            "ff1": (256, 1024, dict(norm=norm, gelu=True), True),
            "ff2": (1024, 256, dict(residual=torch.randn(m, 256, device=dev, dtype=dt)), True),
        }
        for name, (k, n, kw, bias) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / 16
            b = torch.randn(n, device=dev, dtype=dt) if bias else None
            isnorm = "norm" in kw
            res = []
            bms = {120: (16, 32), 960: (32, 64), 3840: (64, 128)}[m]
            for bm, bn, bk, warps, stages in itertools.product(bms, (32, 64, 128), (64, 128), (4,), (2, 3)):
                try:
                    us = timed(lambda: kernels.linear(x, w, b, blocking=Tile(bm, bn, bk, warps, stages), **kw))
                except Exception as e:  # out of resources
                    continue
                res.append((us, (bm, bn, bk, warps, stages)))
            res.sort()
            default = timed(lambda: kernels.linear(x, w, b, **kw))
            ref = timed(lambda: torch.nn.functional.linear(x, w, b))
            print(f"linear {name} m={m}: default {default:.2f} us, cuBLAS plain {ref:.2f}; best {[(round(u, 2), c) for u, c in res[:4]]}", flush=True)
    print(f"linear tuned in {time.time() - t0:.0f} s", flush=True)
if only in ("all", "attention"):
    for r, q, nk in ((2, 60, 220), (16, 60, 220), (2, 60, 620), (64, 60, 620)):
        pool = torch.randn(r * 700 + 2000, 2, 8, 64, device=dev, dtype=dt)
        keys = torch.randint(0, pool.shape[0], (r, nk), device=dev)
        starts = torch.full((r,), nk - 40, device=dev)
        valid = torch.full((r,), 40, device=dev)
        qq = torch.randn(r, q, 8, 64, device=dev, dtype=dt)
        res = []
        for bq, bk, warps in itertools.product((16, 32, 64), (32, 64, 128), (2, 4, 8)):
            try:
                us = timed(lambda: kernels.attention(qq, pool, keys, starts, valid, 20, bq, bk, warps))
            except Exception:
                continue
            res.append((us, (bq, bk, warps)))
        res.sort()
        default = timed(lambda: kernels.attention(qq, pool, keys, starts, valid, 20))
        print(f"attention R={r} Q={q} K={nk}: default {default:.2f} us; best {[(round(u, 2), c) for u, c in res[:4]]}", flush=True)
print(f"done in {time.time() - t0:.0f} s")
