"""Probe 26: can a Triton kernel stream the next GEMV's weights while attention runs?

The feasibility question under a persistent decode kernel, asked without building one. A
stand-in for decode attention (ATT programs run a dependent float chain of ITERS steps, then
write their share of x) is followed by a GEMV y = W x, N = K = 4096 (dense's shape), two ways:

- separate: two kernels, as the engine runs attention and dense's GEMV today;
- fused: one kernel of NPROG programs (all resident: at most 2 a multiprocessor). Every program
  first loads its rows of W (PRE_K of the K columns) into registers, the ATT programs then run
  the chain and write x, all meet at a grid barrier (one atomic counter, reset by the last
  program out), and each then finishes its rows from registers.

36 such pairs (each with its own W: no L2 hits) replay from one CUDA graph; x is zeroed before
each pair, so a barrier that let a program through early gives a wrong y (checked every
variant). A spin limit makes a barrier that could never open (programs not all resident) end
the kernel with a flag instead of hanging it. Prints a table, writes JSON. The barrier's reset
as the last program leaves it holds for one barrier a launch only: with two, a fast program's
arrival at the second could be erased (probe 27's run0).

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/probe_overlap.py --out $OUT/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from benchmarks.probe_shapes import FULL, bench_us

N = K = FULL.hidden_size  # dense's shape
LAYERS = 36
SPIN_LIMIT = tl.constexpr(1 << 22)  # a global a kernel reads must be a constexpr


@triton.jit
def _chain(pid, ITERS: tl.constexpr):
    """A dependent float chain: latency, like attention's, with no memory traffic."""
    v = pid.to(tl.float32) * 1e-3 + 1.0
    for _ in range(ITERS):
        v = v * 0.9999 + 1e-4
    return v


@triton.jit
def _grid_barrier(bar_ptr, nprog, err_ptr):
    """Every program waits here until all NPROG have arrived. Counter bar[0] counts arrivals;
    bar[1] counts departures, and the last program out resets both (the next launch finds 0)."""
    tl.debug_barrier()  # this program's stores are done (bar.sync), then one release atomic
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    n = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (n < nprog) & (spins < SPIN_LIMIT):
        n = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.atomic_add(err_ptr, 1)
    tl.debug_barrier()
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _pair(
    w_ptr, x_ptr, y_ptr, bar_ptr, err_ptr,
    ATT: tl.constexpr, ITERS: tl.constexpr, ROWS: tl.constexpr, K: tl.constexpr, PRE_K: tl.constexpr,
    DO_ATT: tl.constexpr, DO_GEMV: tl.constexpr, BARRIER: tl.constexpr,
):  # fmt: skip
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    if DO_GEMV and PRE_K > 0:
        kp = tl.arange(0, PRE_K)
        w_pre = tl.load(w_ptr + r[:, None] * K + kp[None, :])
    if DO_ATT:  # noqa: SIM102 (a compile-time branch around a run-time one: Triton keeps them apart)
        if pid < ATT:
            share: tl.constexpr = K // ATT
            v = _chain(pid, ITERS)
            tl.store(x_ptr + pid * share + tl.arange(0, share), (v + tl.arange(0, share) * 1e-3).to(x_ptr.dtype.element_ty))
    if BARRIER:
        _grid_barrier(bar_ptr, nprog, err_ptr)
    if DO_GEMV:
        acc = tl.zeros((ROWS,), tl.float32)
        if PRE_K > 0:
            xp = tl.load(x_ptr + kp, cache_modifier=".cg")
            acc += tl.sum(w_pre.to(tl.float32) * xp.to(tl.float32)[None, :], axis=1)
        if PRE_K < K:
            kr = PRE_K + tl.arange(0, K - PRE_K)
            w_rest = tl.load(w_ptr + r[:, None] * K + kr[None, :])
            xr = tl.load(x_ptr + kr, cache_modifier=".cg")
            acc += tl.sum(w_rest.to(tl.float32) * xr.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + r, acc)


def run(dtype: torch.dtype, att: int, iters: int, nprog: int, pre_k: int, warps: int, fused: bool) -> dict:
    dev = torch.device("cuda")
    rows = N // nprog
    ws = [torch.randn(N, K, device=dev).to(dtype) for _ in range(LAYERS)]
    x = torch.zeros(K, device=dev, dtype=dtype)
    ys = [torch.empty(N, device=dev) for _ in range(LAYERS)]
    bar = torch.zeros(2, device=dev, dtype=torch.int32)
    err = torch.zeros(1, device=dev, dtype=torch.int32)
    meta = {}

    def pair(i: int) -> None:
        x.zero_()
        common = dict(ATT=att, ITERS=iters, ROWS=rows, K=K, num_warps=warps)
        if fused:
            k = _pair[(nprog,)](ws[i], x, ys[i], bar, err, PRE_K=pre_k, DO_ATT=True, DO_GEMV=True, BARRIER=True, **common)
        else:
            _pair[(att,)](ws[i], x, ys[i], bar, err, PRE_K=0, DO_ATT=True, DO_GEMV=False, BARRIER=False, **common)
            k = _pair[(nprog,)](ws[i], x, ys[i], bar, err, PRE_K=0, DO_ATT=False, DO_GEMV=True, BARRIER=False, **common)
        meta.update(regs=k.n_regs, spills=k.n_spills)

    pair(0)  # compile; the register count tells whether NPROG programs can all be resident
    torch.cuda.synchronize()
    props = torch.cuda.get_device_properties(dev)
    sms, per_sm = props.multi_processor_count, props.regs_per_multiprocessor // (meta["regs"] * 32 * warps)
    if fused and per_sm * sms < nprog:
        return {"skipped": f"{meta['regs']} registers a thread: {per_sm} programs a multiprocessor, {nprog} needed", **meta}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            pair(i)
    g.replay()
    torch.cuda.synchronize()
    xs = x.float()
    worst = max((ys[i] - ws[i].float() @ xs).abs().max().item() for i in range(LAYERS))
    us = bench_us(g.replay, rep=200) / LAYERS
    return {"us": us, "max_err": worst, "barrier_timeouts": int(err.item()), **meta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MOSSBUILD_COMMIT", "unknown"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "runs": [],
    }
    lines = []
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    cases = []
    for iters in (0, 1500, 3500):
        cases += [
            (fp8, 64, iters, 256, 0, 8, False),
            (fp8, 64, iters, 256, 0, 8, True),
            (fp8, 64, iters, 256, K, 8, True),
            (fp8, 64, iters, 256, K, 16, True),
            (fp8, 64, iters, 256, K // 2, 8, True),
            (bf16, 64, iters, 256, 0, 8, False),
            (bf16, 64, iters, 256, K // 2, 8, True),
            (bf16, 64, iters, 256, K // 2, 16, True),
            (bf16, 64, iters, 256, K // 4, 8, True),
        ]
    for dtype, att, iters, nprog, pre_k, warps, fused in cases:
        name = f"{str(dtype)[6:]} iters={iters} {'fused pre_k=' + str(pre_k) if fused else 'separate'}"
        try:
            r = run(dtype, att, iters, nprog, pre_k, warps, fused)
        except Exception as e:  # a config Triton cannot build
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r.update(name=name, dtype=str(dtype), att=att, iters=iters, nprog=nprog, pre_k=pre_k, warps=warps, fused=fused)
        result["runs"].append(r)
        if "us" in r:
            line = f"{name:42s} {r['us']:7.2f} us  err {r['max_err']:.3g}  timeouts {r['barrier_timeouts']}"
            line += f"  regs {r['regs']} spills {r['spills']}"
        else:
            line = f"{name:42s} {r.get('skipped') or r.get('error')}"
        print(line, flush=True)
        lines.append(line)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
