"""Throwaway: the tail kernel against kernels 3-5 at the true shape, per block, 56 blocks chained in a CUDA graph
(as an ODE step chains them). PYTHONPATH=/tmp/site:. python3 .devtree/tail_probe.py"""
import torch

from workflow.codec import kernels
from workflow.codec.estimator import TransformerBlock

K = kernels
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
b = TransformerBlock(256, 8, 64).to(dev, dt).eval()
for p in b.parameters():
    p.data.normal_(0, 0.02)
ff, out = b.ff.net, b.attn1.to_out[0]
BLOCKINGS = {"default": None} | {f"bm{t.bm} bk{t.bk} w{t.warps} s{t.stages}": t for t in [
    K.Tile(16, 256, 64, 4, 1), K.Tile(16, 256, 32, 4, 2), K.Tile(16, 256, 32, 8, 2), K.Tile(32, 256, 64, 8, 1),
    K.Tile(32, 256, 32, 8, 2), K.Tile(64, 256, 32, 8, 2), K.Tile(64, 256, 64, 8, 1)]}


def three(y, x):
    h = K.linear(y, out.weight, out.bias, residual=x)
    g = K.linear(h, ff[0].proj.weight, ff[0].proj.bias, norm=b.norm3, gelu=True)
    return K.linear(g, ff[2].weight, ff[2].bias, residual=h)


def timed(fn, y, x, n=56, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(y, x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        h = x
        for _ in range(n):
            h = fn(y, h)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps / n * 1000  # us a block


with torch.no_grad():
    print("rows | three kernels us | " + " | ".join(BLOCKINGS))
    for m in (120, 160, 320, 1280, 2560):
        y, x = torch.randn(m, 512, device=dev, dtype=dt), torch.randn(m, 256, device=dev, dtype=dt)
        ref = three(y, x)
        row = [f"{timed(three, y, x):.1f}"]
        for name, t in BLOCKINGS.items():
            try:
                got = K.tail(y, x, out, b.norm3, ff[0].proj, ff[2], t)
                err = (got.float() - ref.float()).abs().max().item()
                us = timed(lambda y_, x_, t=t: K.tail(y_, x_, out, b.norm3, ff[0].proj, ff[2], t), y, x)
                row.append(f"{us:.1f} ({err:.3f})")
            except Exception as e:  # noqa: BLE001
                row.append(f"fail {type(e).__name__}")
        print(f"{m} | " + " | ".join(row), flush=True)

# the resnets: slots.resnet compiled (as serving runs it) against resnets.resnet, per resnet
from workflow.codec import resnets, slots  # noqa: E402
from workflow.codec.estimator import CausalResnetBlock1D  # noqa: E402
from workflow.codec.fast import compile_block  # noqa: E402

RB = {"default": None} | {f"bm{t.bm} bk{t.bk} w{t.warps} s{t.stages}": t for t in [
    K.Tile(16, 256, 64, 4, 1), K.Tile(16, 256, 32, 4, 2), K.Tile(32, 256, 64, 8, 1), K.Tile(32, 256, 32, 8, 2)]}
compiled = compile_block(slots.resnet)
with torch.no_grad():
    print("resnet cin | rows x frames | compiled us | " + " | ".join(RB))
    for cin in (320, 256, 512):
        r = CausalResnetBlock1D(cin, 256, 1024).to(dev, dt).eval()
        for rows, q in ((2, 60), (4, 80), (16, 160)):
            x = torch.randn(rows, q, cin, device=dev, dtype=dt)
            time = torch.randn(rows, 256, device=dev, dtype=dt)
            tails = (torch.randn(rows, 2, cin, device=dev, dtype=dt), torch.randn(rows, 2, 256, device=dev, dtype=dt))
            valid = torch.full((rows,), q, device=dev)
            ref = compiled(r, x, time, tails, valid)[0]
            row = [f"{timed(lambda y_, x_: compiled(r, x, time, tails, valid)[0], None, x):.1f}"]  # calls back to back
            for name, t in RB.items():
                try:
                    got = resnets.resnet(r, x, time, tails, valid, t)[0]
                    err = (got.float() - ref.float()).abs().max().item()
                    us = timed(lambda y_, x_, t=t: resnets.resnet(r, x, time, tails, valid, t)[0], None, x)
                    row.append(f"{us:.1f} ({err:.3f})")
                except Exception as e:  # noqa: BLE001
                    row.append(f"fail {type(e).__name__}")
            print(f"{cin} | {rows} x {q} | " + " | ".join(row), flush=True)
