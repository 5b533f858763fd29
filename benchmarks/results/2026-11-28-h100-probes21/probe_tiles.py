# ruff: noqa: B023  (each closure is timed at once, inside its loop)
"""Probe (ledger: "H200 codec tiles"): the flow slots' Triton kernels' blockings at the rows serving runs.

H200 run 12's held step (8 streams x 160 frames, 2,560 rows with guidance) took 5.16 ms, ~8 x its
GEMMs' compute floor; its GEMMs (17.6 us each) and attention (31.5 us) were 80 % of it, with
blockings tuned on an H100 at up to 3,840 rows (levers.md, "H200 codec step"). Here:

1. one block's four GEMMs and its attention are recorded as the slots' pass calls them (one eager
   ODE step each of three calls: one stream's first, eight streams' first, eight streams' held
   batch), then every blocking of a grid is timed on them at rows MS (the recorded rows repeated),
   each kernel 20 times in a CUDA graph, as dependent launches; the LayerNorm GEMMs also apart
   (torch's LayerNorm, then the plain GEMM), and cuBLAS (F.linear, with torch's LayerNorm) beside;
   the grid is compiled first by worker processes (Triton's disk cache);
2. (`whole`) the calls timed whole (front end, solve, HiFT) with kernels.tile's blockings before
   the held batch's were taken from 1 and now, on one warm decoder; also 16 streams' held batch.

    PYTHONPATH=. python benchmarks/probe_tiles.py sweep <sweep.json> [workers (12)]
    PYTHONPATH=. python benchmarks/probe_tiles.py whole <whole.json>
"""

import itertools
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import astuple
from pathlib import Path

import torch
import torch.nn.functional as F

from workflow.codec import kernels, timing
from workflow.codec.kernels import Tile
from workflow.codec.stream import first_hop

MS = (80, 320, 640, 1280, 2560, 5120, 7680)  # rows a pass: 1 stream's first call .. 24 streams' held batch
ATTN_ROWS = (32, 48)  # the held batch's attention at more rows (2 x streams) than recorded
ROLES = ("qkv", "out", "ff1", "ff2")
NORMED = ("qkv", "ff1")


def grid(norm: bool) -> list[Tile]:
    if norm:  # the whole row of K in one block
        return [
            Tile(bm, bn, 256, w, s) for bm, bn, w, s in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (4, 8), (1,))
        ]
    return [Tile(bm, bn, bk, w, s) for bm, bn, bk, w, s in
            itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (64, 128), (4, 8), (2, 3, 4))]  # fmt: skip


ATTN_GRID = list(itertools.product((16, 32, 64, 128), (32, 64, 128), (2, 4, 8)))


def graph_us(fn, reps: int = 20, replays: int = 7) -> float:
    """fn's device time per launch, from a CUDA graph of `reps` launches replayed (median)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del g
    return statistics.median(times)


def role_of(weight: torch.Tensor, gelu: bool, pool) -> str:
    """Which of a block's GEMMs: q/k/v (writes the pool), the first feed-forward (GELU), the second (K = 4 N), out."""
    return "qkv" if pool is not None else "ff1" if gelu else "ff2" if weight.shape[1] >= 4 * weight.shape[0] else "out"


class Recorder:
    """Wraps kernels.linear and kernels.attention: the first call of each role, its inputs kept."""

    def __init__(self) -> None:
        self.linear, self.attention, self.got = kernels.linear, kernels.attention, {}

    def __enter__(self):
        def linear(x, weight, bias=None, **kw):
            role = role_of(weight, kw.get("gelu", False), kw.get("pool"))
            if role not in self.got:
                self.got[role] = {"x": x.clone(), "weight": weight, "bias": bias} | {
                    k: (v.clone() if isinstance(v, torch.Tensor) and k != "pool" else v) for k, v in kw.items()
                }
            return self.linear(x, weight, bias, **kw)

        def attention(q, pool, keys, starts, valid, chunk, **kw):
            self.got.setdefault("attention", {"q": q.clone(), "pool": pool, "keys": keys.clone(), "starts": starts.clone(),
                                              "valid": valid.clone(), "chunk": chunk})  # fmt: skip
            return self.attention(q, pool, keys, starts, valid, chunk, **kw)

        kernels.linear, kernels.attention = linear, attention
        return self

    def __exit__(self, *exc) -> None:
        kernels.linear, kernels.attention = self.linear, self.attention


def rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """t's rows repeated to m."""
    return t.repeat(math.ceil(m / len(t)), *[1] * (t.dim() - 1))[:m].contiguous()


def linear_args(rec: dict, m: int, apart: bool) -> tuple[tuple, dict]:
    kw = {k: v for k, v in rec.items() if k not in ("x", "weight", "bias")}
    x = rows(rec["x"], m)
    if kw.get("residual") is not None:
        kw["residual"] = rows(kw["residual"], m)
    if kw.get("writes") is not None:
        kw["writes"] = rows(kw["writes"], m)
    if apart:
        x = kw["norm"](x)
        kw["norm"] = None
    return (x, rec["weight"], rec["bias"]), kw


def cublas(role: str, x, w, b, kw: dict) -> torch.Tensor:
    """The same GEMM through torch (cuBLAS), its LayerNorm, GELU and residual as torch's kernels."""
    y = F.linear(kw["norm"](x) if kw.get("norm") is not None else x, w, b)
    y = F.gelu(y) if kw.get("gelu") else y
    return y + kw["residual"] if kw.get("residual") is not None else y


def spec(rec: dict) -> dict:
    """What a worker needs to compile this role's kernels as the recorded call launches them."""
    pool = rec.get("pool")
    return {"k": rec["x"].shape[1], "n": rec["weight"].shape[0], "bias": rec["bias"] is not None,
            "gelu": rec.get("gelu", False), "res": rec.get("residual") is not None,
            "pool": pool[0].numel() if pool is not None else 0,
            "writes": str(rec["writes"].dtype) if rec.get("writes") is not None else ""}  # fmt: skip


def compile_some(jobs: list[tuple[dict, bool, Tile]]) -> int:
    """Launch each (spec, norm, tile) once on made-up inputs of the recorded kinds: into Triton's cache."""
    dev, dt, done = torch.device("cuda"), torch.bfloat16, 0
    for s, norm, tile in jobs:
        x = torch.randn(64, s["k"], device=dev, dtype=dt)
        w = torch.randn(s["n"], s["k"], device=dev, dtype=dt)
        kw = {"norm": torch.nn.LayerNorm(s["k"]).to(dev, dt) if norm else None, "gelu": s["gelu"], "blocking": tile}
        kw["residual"] = torch.randn(64, s["n"], device=dev, dtype=dt) if s["res"] else None
        if s["pool"]:
            kw["pool"] = torch.zeros(64, s["pool"], device=dev, dtype=dt)
            kw["writes"] = torch.arange(64, device=dev, dtype=getattr(torch, s["writes"].split(".")[-1]))
        try:
            kernels.linear(x, w, torch.randn(s["n"], device=dev, dtype=dt) if s["bias"] else None, **kw)
            done += 1
        except Exception:  # out of resources: the timing skips it too
            pass
    torch.cuda.synchronize()
    return done


def sweep(cases: dict, out: dict, workers: int, t0: float, out_path: Path) -> None:
    recs = cases["later, 8 streams, 8 held"]
    jobs = [
        (spec(recs[r]), norm, tile) for r in ROLES for norm in ((True, False) if r in NORMED else (False,)) for tile in grid(norm)
    ]
    with ProcessPoolExecutor(workers, mp.get_context("spawn")) as pool:
        compiled = sum(pool.map(compile_some, [jobs[i::workers] for i in range(workers)]))
    print(f"compiled {compiled} of {len(jobs)} blockings, {time.perf_counter() - t0:.0f} s", flush=True)
    lin = out.setdefault("linear", {})
    for r in ROLES:
        rec = recs[r]
        for m in MS:
            case = lin.setdefault(r, {}).setdefault(str(m), {})
            args, kw = linear_args(rec, m, False)
            case["today"] = (
                graph_us(lambda: kernels.linear(*args, **kw)),
                list(astuple(kernels.tile(m, args[1].shape[0], args[0].shape[1], r in NORMED))),
            )
            case["cublas"] = graph_us(lambda: cublas(r, *args, kw))
            norm, x = kw.get("norm"), args[0]
            if norm is not None:
                case["layernorm"] = graph_us(lambda: norm(x))
            for apart in (False, True) if r in NORMED else (False,):
                a_args, a_kw = linear_args(rec, m, apart)
                timed = []
                for tile in grid(r in NORMED and not apart):
                    try:
                        timed.append((graph_us(lambda: kernels.linear(*a_args, **a_kw, blocking=tile)), list(astuple(tile))))
                    except Exception:
                        continue
                timed.sort()
                case["apart" if apart else "fused" if r in NORMED else "plain"] = timed[:5]
            best = {k: v[0] for k, v in case.items() if isinstance(v, list)}
            print(f"{r} {m} rows: today {case['today'][0]:.1f} us, cublas {case['cublas']:.1f}, "
                  + ", ".join(f"{k} {v[0]:.1f} {v[1]}" for k, v in best.items())
                  + (f", layernorm {case['layernorm']:.1f}" if "layernorm" in case else "")
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        out_path.write_text(json.dumps(out, indent=1))
    att = out.setdefault("attention", {})
    shapes = [(c["attention"], None) for c in cases.values()] + [(recs["attention"], r) for r in ATTN_ROWS]
    for a, r in shapes:  # each call's own, then the held batch's at more rows
        r = r or len(a["q"])
        q = rows(a["q"], r)
        keys, starts, valid = (rows(a[k], r) for k in ("keys", "starts", "valid"))
        case = att.setdefault(f"{r}x{q.shape[1]}", {"keys": keys.shape[1]})
        case["today"] = graph_us(lambda: kernels.attention(q, a["pool"], keys, starts, valid, a["chunk"]))
        timed = []
        for bq, bk, w in ATTN_GRID:
            try:
                timed.append(
                    (
                        graph_us(lambda: kernels.attention(q, a["pool"], keys, starts, valid, a["chunk"], bq=bq, bk=bk, warps=w)),
                        [bq, bk, w],
                    )
                )
            except Exception:
                continue
        timed.sort()
        case["best"] = timed[:5]
        print(f"attention {r} rows x {q.shape[1]} queries, {keys.shape[1]} keys: today {case['today']:.1f} us, "
              f"best {timed[0][0]:.1f} {timed[0][1]}  ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip


def setup(compiled: bool):
    """The full-shape decoder (random weights), its voice, and the three calls: (streams, codes, new frames, start)."""
    dev = torch.device("cuda")
    t = timing.CodecTiming(preset="full", dtype="bfloat16", prompt_codes=46, later_codes=100, batches=(1, 8), repeat=5,
                           baseline=False, flow_cache=False, slots=16, held=8, compile=compiled)  # fmt: skip
    ours, _ = timing.decoders(t, dev)
    cfg, voice = ours.cfg, timing.voice_of(t, ours)
    la, chunk, stride = cfg.encoder.lookahead, cfg.chunk, cfg.encoder.stride
    hop0, cf = first_hop(t.prompt_codes, chunk, stride), chunk * stride
    first, later = t.prompt_codes + hop0, t.prompt_codes + t.later_codes + hop0
    new = -(-((t.prompt_codes + hop0 + la) * stride - ours.past_frames(t.prompt_codes)) // cf) * cf
    cached = (later - chunk) * stride // cf * cf
    start0 = max(0, (t.prompt_codes - la) * stride // cf * cf)
    cases = {"first, 1 stream": (1, first, new, start0), "first, 8 streams": (8, first, new, start0),
             "later, 8 streams, 8 held": (8, later, max(new, 8 * cf), cached - 8 * cf + cf)}  # fmt: skip
    return ours, voice, cases, t, dev


def main() -> None:
    mode, out_path = sys.argv[1], Path(sys.argv[2])
    t0 = time.perf_counter()
    if mode == "sweep":  # the kernels' inputs from eager calls (no torch.compile needed), then the grid
        ours, voice, cases, t, dev = setup(compiled=False)
        out: dict = {"device": torch.cuda.get_device_name(), "cases": {}}
        recs: dict = {}
        for name, (batch, body, frames, start) in cases.items():
            run = timing.SlotRunner(ours, voice, batch, body, False, frames, start)
            with Recorder() as rec:
                run.slot_solve(ours.cfg.solver.steps // 2)
            recs[name] = rec.got
            out["cases"][name] = {"rows": 2 * batch * frames}
            timing.close(run)
            del run
        print(f"recorded, {time.perf_counter() - t0:.0f} s", flush=True)
        sweep(recs, out, int(sys.argv[3]) if len(sys.argv) > 3 else 12, t0, out_path)
    else:  # whole: the calls with the blockings before and now
        out = {"device": torch.cuda.get_device_name(), "cases": {}}
        ours, voice, cases, t, dev = setup(compiled=True)
        whole(ours, voice, cases, out, t, dev, t0)
    out_path.write_text(json.dumps(out, indent=1))


def before_tile(m: int, n: int, k: int, norm: bool) -> Tile:
    """kernels.tile before the held batch's blockings (H100 codec 6's, at every row count)."""
    p2 = kernels._pow2
    if norm:
        return Tile(16, min(64, p2(n)), p2(k), 4, 1) if m <= 256 else Tile(64, min(128, p2(n)), p2(k), 4, 1)
    bm, bn = (16, 32) if m <= 256 else (64, 32) if m <= 1024 else (64, 128)
    return Tile(bm, min(bn, p2(n)), min(128, p2(k)), 4, 3)


def whole(ours, voice, cases: dict, out: dict, t, dev, t0: float) -> None:
    """The three calls whole with the blockings before and now (kernels.tile), on one warm decoder."""
    now = kernels.tile
    cases = cases | {"later, 16 streams, 8 held": (16, *cases["later, 8 streams, 8 held"][1:])}
    out["cases"]["later, 16 streams, 8 held"] = {"rows": 2 * 16 * cases["later, 16 streams, 8 held"][2]}
    for name, (batch, body, frames, start) in cases.items():
        for variant, tile in (("before", before_tile), ("now", now)):
            kernels.tile = tile
            run = timing.SlotRunner(ours, voice, batch, body, True, frames, start)
            if "held" in name:
                run.hift_rows(8)
            ms = timing.stage_ms(run, dev, t.repeat)
            out["cases"].setdefault(name, {})[variant] = ms
            print(f"{name}, {variant}: {json.dumps({k: round(v, 3) for k, v in ms.items()})}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
            timing.close(run)
            del run
    kernels.tile = now


if __name__ == "__main__":
    main()
