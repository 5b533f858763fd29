"""Time the resnet conv kernel's blockings (BM, BK, warps) in CUDA graphs at serving's row counts."""
import itertools
import sys

import torch

from workflow.codec import kernels  # noqa: E402
from workflow.codec.estimator import CausalResnetBlock1D  # noqa: E402

dev, dt = torch.device("cuda"), torch.bfloat16


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


for cin in (256, 512):
    r = CausalResnetBlock1D(cin, 256, 1024).to(dev, dt)
    c1, _, n1 = r.block1.block
    for rows in (2, 16, 64):
        x = torch.randn(rows, 60, cin, device=dev, dtype=dt)
        tail = torch.randn(rows, 2, cin, device=dev, dtype=dt)
        valid = torch.full((rows,), 40, device=dev)
        add = torch.randn(rows, 256, device=dev, dtype=dt)
        res = []
        for bm, bk, warps in itertools.product((16, 64), (64, 128), (4, 8)):
            us = timed(lambda: kernels.conv_block(c1, n1, x, tail, valid, add=add, bm=bm, bk=bk, warps=warps))
            res.append((round(us, 2), (bm, bk, warps)))
        res.sort()
        print(f"conv cin={cin} rows={rows}x60: default {timed(lambda: kernels.conv_block(c1, n1, x, tail, valid, add=add)):.2f} us; best {res[:4]}", flush=True)
