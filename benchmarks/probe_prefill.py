"""Probe 28: the trunk's prefill of 512 rows, FP8 against bf16, layer by layer (no checkpoint).

The engine's own `Layer` and compiled `layer_step` over `--layers` layers of the full shape with
random weights (FP8: per-tensor scales, fc's and gate's apart, so the fused gate_up has two
parts), bf16 and FP8, replayed from one CUDA graph each, timed in turns within the process;
FP8's layer 0 checked against the same layer in float32 over its dequantized weights.
(Probe 28's runs 1-3 also timed FP8 with gate_up's output rescaled part by part, the engine
before up's ratio was folded into proj's input quantization: this script as of 976f703.)

Then one compiled (eager, not graphed) pass of each under the profiler: every kernel's time per
layer, so the work FP8 adds around its GEMMs shows by name. Prints a short table last.

With --elementwise, first: proj's input kernel alone (gate_up's output [rows, 2 x intermediate]
-> silu(fc) * up, bf16 or rounded to FP8) written several ways, each compiled, timed from a CUDA
graph of 20 calls on one input (L2 warm, as after gate_up's GEMM) and with L2 flushed, and the
generated Triton code kept (--code-dir).

Usage (on the GPU machine, repository root):
    PYTHONPATH=. python3 benchmarks/probe_prefill.py --out $OUT/prefill.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.probe_parts import kernel_summary
from workflow import fp8, roofline
from workflow.cudagraphs import Graphs
from workflow.engines.linears import Fp8Linear, LinearArgs, layer_linears
from workflow.engines.torch_engine import Layer, layer_step
from workflow.spec import PRESETS

FULL = PRESETS["full"]
NORMS = ("input_layernorm", "post_layernorm", "attention.q_layernorm", "attention.k_layernorm")


def layer_tensors(precision: str, dev: torch.device) -> dict[str, torch.Tensor]:
    """One trunk layer's checkpoint tensors under the prefix `l.`, random, of the full shape."""
    s, out = FULL, {}
    shapes = {
        "attention.qkv": (s.qkv_size, s.hidden_size),
        "attention.dense": (s.hidden_size, s.num_attention_heads * s.head_dim),
        "mlp.fc": (s.intermediate_size, s.hidden_size),
        "mlp.gate": (s.intermediate_size, s.hidden_size),
        "mlp.proj": (s.hidden_size, s.intermediate_size),
    }
    w_scale = {"mlp.fc": 2.0e-4, "mlp.gate": 5.5e-4}  # apart: gate_up's parts differ by 2.75
    for name, shape in shapes.items():
        w = 0.02 * torch.randn(shape, device=dev, dtype=torch.bfloat16)
        if precision == "bf16":
            out[f"l.{name}.weight"] = w
            continue
        ws = torch.tensor(w_scale.get(name, 2.0e-4), device=dev)
        out[f"l.{name}.weight"] = fp8.quantize(w, ws)
        out[f"l.{name}.weights_scaling_factor"] = ws
        out[f"l.{name}.activation_scaling_factor"] = torch.tensor(0.02, device=dev)
    return out


def stack(precision: str, n: int, dev: torch.device) -> list[Layer]:
    step = torch.compile(layer_step, dynamic=False, fullgraph=True)
    layers = []
    for _ in range(n):
        lins = layer_linears(layer_tensors(precision, dev), "l.", torch.bfloat16, str(dev), fast_accum=True)
        size = {k: FULL.head_dim if k.startswith("attention.") else FULL.hidden_size for k in NORMS}
        norms = {k: 1 + 0.1 * torch.randn(size[k], device=dev, dtype=torch.bfloat16) for k in NORMS}
        layer = Layer(FULL, lins, norms, step, (True, True, True))
        layer.setup_cache(1, 1024, torch.bfloat16, dev)
        layers.append(layer)
    return layers


def elementwise(rows: int, code_dir: str | None, say) -> dict:
    """silu(fc) * up -> proj's input, six ways; us warm and flushed."""
    from torch._inductor.utils import run_and_get_code

    from benchmarks.probe_shapes import bench_us

    dev = torch.device("cuda")
    y = torch.randn(rows, 2 * FULL.intermediate_size, device=dev, dtype=torch.bfloat16)
    s, r = torch.tensor([0.02], device=dev), torch.tensor([2.75], device=dev)
    rs = 1 / s

    def act(y: torch.Tensor) -> torch.Tensor:
        g, u = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    ways = {
        "bf16 silu*up": lambda y: act(y),
        "fp8 divide (engine)": lambda y: fp8.quantize(act(y), s),
        "fp8 times reciprocal": lambda y: (act(y).float() * rs).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn),
        "fp8 divide, float32 silu": lambda y: fp8.quantize(act(y.float()), s),
        "fp8 divide, no clamp": lambda y: (act(y).float() / s).to(torch.float8_e4m3fn),
        "fp8 rescale + divide (before)": lambda y: fp8.quantize(
            act(torch.cat([y[:, : y.shape[1] // 2], (y[:, y.shape[1] // 2 :] * r).to(y.dtype)], -1)), s
        ),
    }
    out = {}
    for i, (name, fn) in enumerate(ways.items()):
        f = torch.compile(fn, dynamic=False, fullgraph=True)
        _, code = run_and_get_code(f, y)
        if code_dir:
            with open(f"{code_dir}/elementwise{i}.py", "w") as fh:
                fh.write(f"# {name}\n" + "\n".join(code))
        g = torch.cuda.CUDAGraph()
        f(y)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(20):
                f(y)
        warm = roofline.median(roofline.timed_ms(g.replay, dev, 20)) * 1e3 / 20
        out[name] = {"warm_us": warm, "flushed_us": bench_us(lambda f=f: f(y))}
        say(f"elementwise {name}: warm {warm:.2f} us, flushed {out[name]['flushed_us']:.2f} us")
    return out


def emulated(layer: Layer, x: torch.Tensor, cos, sin, pos) -> torch.Tensor:
    """The layer in float32 over its FP8 weights dequantized, x rounded through FP8 at each
    linear's own a_scale (the engine's CPU emulation, `linear`'s fake_quant path): the function
    both FP8 variants must compute."""

    def deq(lin: Fp8Linear) -> LinearArgs:
        return LinearArgs(lin.weight.float() * lin.row_scale(), lin.a_scale)

    k, v = layer.k_cache.float(), layer.v_cache.float()
    norms = tuple(n.float() for n in layer.norms)
    lins = (deq(layer.qkv), deq(layer.dense), deq(layer.gate_up), deq(layer.proj))
    return layer_step(x.float(), cos, sin, pos, None, k, v, norms, *lins, FULL.rms_norm_eps, FULL.head_dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=FULL.num_layers - 8)  # the trunk: 32
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--elementwise", action="store_true")
    ap.add_argument("--code-dir")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    say = lambda m: print(m, flush=True)  # noqa: E731
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers, "rows": args.rows}
    say(f"{res['gpu']}, torch {res['torch']}, {args.layers} layers x {args.rows} rows")
    if args.elementwise:
        res["elementwise"] = elementwise(args.rows, args.code_dir, say)
    torch.manual_seed(0)
    x0 = torch.randn(1, args.rows, FULL.hidden_size, device=dev, dtype=torch.bfloat16)
    inv_freq = 1.0 / FULL.rope_theta ** (torch.arange(0, FULL.head_dim, 2, device=dev).float() / FULL.head_dim)
    pos = torch.arange(args.rows, device=dev)
    angles = torch.outer(pos.float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    stacks = {p: stack(p, args.layers, dev) for p in ("bf16", "fp8")}

    def run(layers: list[Layer]) -> torch.Tensor:
        x = x0
        for layer in layers:
            x = layer(x, cos, sin, pos, None)
        return x

    graphs, times = Graphs(dev), {v: [] for v in stacks}
    for v in stacks:
        t = time.time()
        graphs.run(v, lambda v=v: run(stacks[v]))
        say(f"{v}: compiled and captured in {time.time() - t:.1f} s")
    # 32 random layers are chaotic (an FP8 rounding flip in one layer may grow through the
    # rest), so the function is checked on one layer
    layer0 = stacks["fp8"][0]
    emu = emulated(layer0, x0, cos, sin, pos)
    y = layer0(x0, cos, sin, pos, None).float()
    res["layer0_rel_err"] = ((y - emu).norm() / (emu - x0.float()).norm()).item()
    for _ in range(args.rounds):
        for v in stacks:
            times[v] += roofline.timed_ms(lambda v=v: graphs.run(v, lambda: None), dev, 10)
    res["ms"] = {v: roofline.median(ts) for v, ts in times.items()}
    res["ms_all"] = times
    from torch.profiler import ProfilerActivity, profile

    res["profile"] = {}
    for v, layers in stacks.items():
        run(layers)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(layers)
            torch.cuda.synchronize()
        s = kernel_summary(prof, top=40)
        res["profile"][v] = s
        say(f"\nprofile {v}: {s['kernel_ms']:.3f} ms in {s['kernels']} kernels; per layer (us, calls):")
        for key, ms, n in s["top"]:
            say(f"  {1e3 * ms / args.layers:8.2f}  x{n // args.layers:<3d} {key}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    say(f"\nFP8 layer 0 against its float32 emulation, |y - emu| / |emu - x|: {res['layer0_rel_err']:.4f}")
    say("| variant | graph ms | per layer us | vs bf16 |")
    say("|---|---|---|---|")
    for v, ms in res["ms"].items():
        say(f"| {v} | {ms:.3f} | {1e3 * ms / args.layers:.1f} | {res['ms']['bf16'] / ms:.3f} x |")


if __name__ == "__main__":
    main()
