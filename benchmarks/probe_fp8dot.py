"""Probe 33: is the FP8 GEMV bound by its conversions on an H200, and do tensor cores lift it?

Probe 32 read the step's bytes with eight large GEMVs: bf16 weights at 4.55 TB/s on an H200,
FP8 weights at 4.17 (on an H100 both at 3.13). A CUDA-core FP8 GEMV converts every weight byte
to float32 before its multiply; at the H200's bandwidth that may be the limit. A tensor-core
body multiplies e4m3 by e4m3 as stored (x padded to 16 rows) and Triton pipelines loads that
feed a `tl.dot`. This times, per FP8 use of a decode step and for one large weight, the
engine's tuned block (from an engine.json) against tensor-core bodies, the way `gemv.tune`
times (one row of x, 20 calls from a CUDA graph cycling through weight copies that overflow
L2), after checking each against float32 arithmetic.

    PYTHONPATH=. python3 benchmarks/probe_fp8dot.py --out $OUT/fp8dot.json \\
        --engine-json benchmarks/results/2026-11-24-h200-full4/torch-fp8/engine/engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from workflow.engines import gemv
from workflow.roofline import median

H, FFN, QKV = 4096, 12288, 6144
USES = {"qkv": (QKV, H, ""), "dense": (H, H, "res"), "gate_up": (2 * FFN, H, ""), "proj": (H, FFN, "res")}
USES["large"] = (262144, H, "")  # 1 GB: the body's rate with its ramp and tail amortised


@triton.jit
def _dot_gemv(x_ptr, w_ptr, y_ptr, res_ptr, scale_ptr, M, N, K: tl.constexpr, HAS_RES: tl.constexpr, W_FIRST: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """y[m, n] = scale * sum_k x[m, k] w[n, k] (+ res) on tensor cores, x's rows padded to 16.
    W_FIRST: w [BLOCK_N, BLOCK_K] @ x^T (wgmma, BLOCK_N >= 64); else x @ w^T (mma, any BLOCK_N)."""
    rm = tl.arange(0, 16)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if W_FIRST:  # noqa: SIM108 (a constexpr branch: one shape compiled)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
    else:
        acc = tl.zeros((16, BLOCK_N), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm < M)[:, None], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn < N)[:, None], other=0.0, eviction_policy="evict_first")
        if W_FIRST:  # noqa: SIM108
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if W_FIRST:
        acc = tl.trans(acc)
    y = acc * tl.load(scale_ptr)
    ptrs = rm[:, None] * N + rn[None, :]
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    if HAS_RES:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(res_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + ptrs, y.to(y_ptr.dtype.element_ty), mask=ok)


def dot_launch(x, w, scale, residual, block) -> torch.Tensor:
    bn, bk, warps, stages, w_first = block
    m, (n, k) = x.shape[0], w.shape
    y = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    _dot_gemv[(triton.cdiv(n, bn),)](
        x, w, y, residual if residual is not None else y, scale, m, n, K=k, HAS_RES=residual is not None,
        W_FIRST=bool(w_first), BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


def dot_candidates() -> list[tuple[int, int, int, int, int]]:
    out = [(bn, bk, 4, s, 0) for bn in (16, 32, 64) for bk in (256, 512) for s in (2, 4)]
    out += [(bn, bk, 4, s, 1) for bn in (64, 128) for bk in (128, 256) for s in (2, 4)]
    return out


def timer(fn, copies: list[torch.Tensor], reps: int = 20, rounds: int = 3) -> float:
    """us a call: `reps` calls from one CUDA graph, cycling through the copies; median of rounds."""
    fn(copies[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(copies[i % len(copies)])
    return median([1e3 * gemv.replay_ms(graph) / reps for _ in range(rounds)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-json", type=Path, required=True, help="an FP8 engine.json: its gemv_blocks")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gemv.BLOCKS.update({k: tuple(v) for k, v in json.loads(args.engine_json.read_text())["options"]["gemv_blocks"].items()})
    out = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "commit": os.environ.get("MOSSBUILD_COMMIT", "unknown"), "command": "PYTHONPATH=. python3 " + shlex.join(sys.argv),
           "uses": {}}  # fmt: skip
    x = torch.randn(1, FFN, device=dev).to(torch.float8_e4m3fn)
    scale = torch.full((1,), 0.5, device=dev)
    for name, (n, k, fl) in USES.items():
        w = (torch.randn(n, k, device=dev) / 8).to(torch.float8_e4m3fn)
        copies = [w] + [w.clone() for _ in range(-(-gemv.L2_FLUSH // w.numel()) - 1)]
        res = torch.randn(1, n, device=dev, dtype=torch.bfloat16) if fl else None
        xk = x[:, :k].contiguous()
        want = (xk.float() @ w.float().T) * 0.5
        want = (want.to(torch.bfloat16).float() + res.float()) if res is not None else want
        eb = gemv.config_for(*((2 * FFN, H) if name == "large" else (n, k)), 1, fl)  # large: gate_up's block
        row = {"mb": n * k / 1e6, "engine_block": list(eb), "us": {}, "max_err": {}}
        row["us"]["engine"] = timer(
            lambda c, xk=xk, res=res, eb=eb: gemv.launch(xk, c, torch.bfloat16, scale=scale, residual=res, block=list(eb)),
            copies,
        )
        for block in dot_candidates():
            try:
                got = dot_launch(xk, w, scale, res, block).float()
            except Exception as e:  # a shape Triton cannot compile: note it, go on
                row["us"][str(block)] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            row["max_err"][str(block)] = (got - want).abs().max().item() / (want.abs().max().item() + 1e-6)
            row["us"][str(block)] = timer(lambda c, xk=xk, res=res, b=block: dot_launch(xk, c, scale, res, b), copies)
        timed = {b: t for b, t in row["us"].items() if isinstance(t, float)}
        best = min((b for b in timed if b != "engine"), key=timed.get, default="engine")
        row["best_dot"], row["best_dot_us"] = best, timed[best]
        out["uses"][name] = row
        eng = timed["engine"]
        print(f"{name} {n}x{k} ({row['mb']:.0f} MB): engine {row['engine_block']} {eng:.2f} us ({n * k / eng / 1e6:.2f} TB/s); "
              f"best dot {best} {timed[best]:.2f} us ({n * k / timed[best] / 1e6:.2f} TB/s), err {row['max_err'][best]:.1e}",
              flush=True)  # fmt: skip
        del copies, w
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
