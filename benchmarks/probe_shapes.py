"""Probe 25: two tactic studies at the full shape, outside the engine (no checkpoint, no wheels).

- FP8 prefill GEMMs, M = 512 rows, the four trunk shapes: cuBLASLt through torch._scaled_mm
  (as the engine calls it: x @ W^T, fast accumulation), the same product computed transposed
  (W @ x^T, so cuBLASLt sees M = N and N = 512), and inductor's max-autotune choice between
  its Triton templates and cuBLAS; bf16 F.linear beside them. Weights are read from HBM every
  call (do_bench flushes L2), as in a prefill.
- Decode attention at batch 1 (workflow.engines.attention.decode_attention): splits, BLOCK_S
  and warps, 36 layers' calls back to back in a CUDA graph, each with its own cache (the step's
  L2 behaviour), per kv bucket; bf16 output and FP8 (dense's input quantized in the kernel).

Usage (on the GPU machine, repository root; [--skip-gemm] [--skip-attention]):
    PYTHONPATH=. python3 benchmarks/probe_shapes.py --out $OUT/shapes.json
(Probe 25's run1 also timed each attention config with a block's V loaded beside its K: the
script of commit 3b71bd9 with benchmarks/results/2026-11-24-h100-probe25/early-v.patch.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from workflow.spec import PRESETS

FULL = PRESETS["full"]
SHAPES = {  # name: (N, K) of the trunk's linears
    "qkv": (FULL.qkv_size, FULL.hidden_size),
    "dense": (FULL.hidden_size, FULL.num_attention_heads * FULL.head_dim),
    "gate_up": (2 * FULL.intermediate_size, FULL.hidden_size),
    "proj": (FULL.hidden_size, FULL.intermediate_size),
}


def bench_us(fn, rep: int = 300) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=25, rep=rep, return_mode="median")


def gemms(m: int, say) -> dict:
    """Each trunk shape's product of m rows, several ways (us and TFLOP/s)."""
    dev, out = torch.device("cuda"), {}
    one, one_b = torch.ones((), device=dev), torch.ones((), device=dev)  # inductor's template wants two 0-d scales
    for name, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)

        def plain(xq=xq, wq=wq):
            return torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one_b, out_dtype=torch.bfloat16, use_fast_accum=True)

        def transposed(xq=xq, wq=wq):
            return torch._scaled_mm(wq, xq.t(), scale_a=one, scale_b=one_b, out_dtype=torch.bfloat16, use_fast_accum=True)

        def transposed_back(xq=xq, wq=wq):
            return transposed(xq, wq).t().contiguous()

        torch._dynamo.reset()
        tuned = torch.compile(plain, options={"max_autotune": True, "max_autotune_gemm_backends": "TRITON,ATEN"})
        t0 = time.perf_counter()
        ref = plain().float()
        try:
            err = (tuned().float() - ref).abs().max().item() / ref.abs().max().item()
        except Exception as e:  # torch 2.11's scaled_mm template fails to render for some layouts
            say(f"gemm {name}: max-autotune failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            tuned, err = plain, float("nan")
        compile_s = time.perf_counter() - t0
        assert (transposed().t().float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
        row = {
            "bf16_linear": bench_us(lambda x=x, w=w: F.linear(x, w)),
            "fp8_plain": bench_us(plain),
            "fp8_transposed": bench_us(transposed),
            "fp8_transposed_back": bench_us(transposed_back),
            "fp8_max_autotune": bench_us(tuned),
            "max_autotune_compile_s": compile_s,
            "max_autotune_rel_err": err,
        }
        flop = 2 * m * n * k
        row["tflops"] = {key: flop / v / 1e6 for key, v in row.items() if key.startswith(("bf16", "fp8"))}
        out[name] = row
        say(f"gemm {name} m={m} n={n} k={k}: " + ", ".join(f"{key} {v:.1f}" for key, v in row.items() if key != "tflops"))
    return out


def attention_configs(kv_len: int, quant: bool, say, only: list[str] | None = None, layers: int = 36) -> dict:
    """Per-call time of decode attention at batch 1 over a kv bucket, every config (or those in
    `only`), 36 calls (each its own cache) replayed from one CUDA graph. Keys:
    s{splits}_b{BLOCK_S}_w{warps}."""
    from workflow.engines import attention

    dev, d, width, kv_heads = torch.device("cuda"), FULL.head_dim, FULL.qkv_size, FULL.num_key_value_heads
    seq = max(1024, kv_len)
    qkv = torch.randn(1, 1, width, device=dev, dtype=torch.bfloat16)
    norms = torch.ones(d, device=dev, dtype=torch.bfloat16)
    cos, sin = torch.ones(1, d, device=dev, dtype=torch.bfloat16), torch.zeros(1, d, device=dev, dtype=torch.bfloat16)
    caches = [torch.randn(2, 1, kv_heads, seq, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    pos = torch.tensor([kv_len - 100], device=dev)
    scale = torch.ones(1, device=dev) if quant else None
    out, ref = {}, None
    for splits, block_s, warps in itertools.product((1, 2, 4, 8, 16), (32, 64, 128), (4, 8)):
        key = f"s{splits}_b{block_s}_w{warps}"
        if only is not None and key not in only:
            continue
        if splits * block_s > kv_len * 2 or (splits > 1 and kv_len // splits < block_s // 2):
            continue

        def calls(splits=splits, block_s=block_s, warps=warps):
            return [
                attention.decode_attention(
                    qkv, norms, norms, cos, sin, c[0], c[1], pos, kv_len, 1e-6, splits, block_s, warps, scale
                )
                for c in caches
            ]

        try:
            y = calls()[0].float()
            torch.cuda.synchronize()
        except Exception as e:  # a config Triton cannot build (registers, shared memory)
            say(f"attn kv {kv_len} s{splits} b{block_s} w{warps}: {type(e).__name__}")
            continue
        ref = y if ref is None else ref
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        us = bench_us(g.replay, rep=100) / layers
        out[key] = {"us": us, "max_diff": (y - ref).abs().max().item()}
    best = min(out, key=lambda k: out[k]["us"])
    default = f"s{attention.choose_splits(1, kv_heads, kv_len, dev)}_b{attention.BLOCK_S}_w{attention.NUM_WARPS}"
    say(f"attn kv {kv_len} quant {quant}: default {default} {out.get(default, {}).get('us', float('nan')):.2f} us, "
        f"best {best} {out[best]['us']:.2f} us")  # fmt: skip
    return {"configs": out, "best": best, "default": default}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    result["commit"] = os.environ.get("MOSSBUILD_COMMIT", "unknown")

    def save() -> None:  # after each part: a call cut at its time limit keeps what it measured
        result["lines"] = lines
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    att = result["attention"] = {}
    for kv in () if args.skip_attention else (640, 1024):
        att[f"{kv}_bf16"] = a = attention_configs(kv, False, say)
        ranked = sorted(a["configs"], key=lambda k: a["configs"][k]["us"])
        att[f"{kv}_fp8"] = attention_configs(kv, True, say, only=[*ranked[:4], a["default"]])
        save()
        if kv == 640 and not args.skip_gemm:
            result["gemm_m512"] = gemms(512, say)
            save()
    if args.skip_attention and not args.skip_gemm:
        result["gemm_m512"] = gemms(512, say)
        save()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
