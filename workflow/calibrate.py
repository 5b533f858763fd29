"""calibrate: the checkpoint build will use, at the configured precision.

bf16: the converted checkpoint, passed through unchanged (hard links).
fp8: post-training quantization of the shared block only, with NVIDIA Model Optimizer
(E4M3, per-tensor, max calibration) on the reference model over the calibration set; text
block, audio block, norms, heads and embeddings stay bf16. Writes the calibration set
(`dataset/`, datasets.save_to_disk), the amax table (`amax.json`), modelopt's quantizer
summary, and the FP8 TensorRT-LLM checkpoint (`checkpoint/`): fp8 weights with
weights_scaling_factor and activation_scaling_factor = amax / 448, q/k/v merged by max and
requantized, and an explicit exclude_modules list (it replaces TensorRT-LLM's defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import torch
from tqdm import tqdm

from workflow import artifacts, dataset, fp8, trtckpt
from workflow.errors import InputError, run_main
from workflow.hfckpt import load_hf_state
from workflow.names import LAYER_TABLE, LINEARS, layer_plan
from workflow.reference import MossSpeechReference
from workflow.spec import ModelSpec

# TensorRT-LLM linear -> the HF linears it is made of (q/k/v merge into qkv), from the name table
PARTS = {lin: tuple(h.removesuffix(".weight") for h in dict(LAYER_TABLE)[f"{lin}.weight"]) for lin in LINEARS}


def quant_config() -> dict:
    """modelopt's FP8 config restricted to the trunk: its defaults only exclude `*lm_head*`
    (and, with TensorRT-style names, `*mlp.gate.*`, the up projection); our reference names the
    trunk `shared_block` and the branches `text_path` / `audio_path`, so both branches with
    their heads are disabled explicitly."""
    import modelopt.torch.quantization as mtq

    base = mtq.FP8_DEFAULT_CFG
    disable = [{"quantizer_name": p, "enable": False} for p in ("*text_path*", "*audio_path*", "*lm_head*", "*embed*")]
    return {"quant_cfg": [*base["quant_cfg"], *disable], "algorithm": base["algorithm"]}


def expected_quantizers(spec: ModelSpec) -> set[str]:
    """The enabled quantizers a trunk-only FP8 model must have: weight and input of each linear."""
    return {
        f"shared_block.{i}.{part}.{kind}_quantizer"
        for i in range(spec.num_shared_layers)
        for parts in PARTS.values()
        for part in parts
        for kind in ("weight", "input")
    }


def quantize(ref: MossSpeechReference, rows: list[torch.Tensor], device: str) -> str:
    """Calibrate `ref` in place over `rows`; return modelopt's quantizer summary."""
    import modelopt.torch.quantization as mtq

    def forward_loop(model):
        for row in tqdm(rows, desc="calibrating (FP8, max)", unit="sample"):
            model(row[None].to(device))

    mtq.quantize(ref, quant_config(), forward_loop)
    enabled = {n for n, m in ref.named_modules() if n.endswith("_quantizer") and m.is_enabled}
    want = expected_quantizers(ref.spec)
    if enabled != want:
        wrong = sorted(enabled - want)[:3] or sorted(want - enabled)[:3]
        raise RuntimeError(f"FP8 scope is not the trunk's linears: e.g. {wrong}")
    summary = io.StringIO()
    with contextlib.redirect_stdout(summary):
        mtq.print_quant_summary(ref)
    return summary.getvalue()


def amax_table(ref: MossSpeechReference) -> dict[str, dict[str, float]]:
    """'<layer>.<hf linear>' -> weight and input amax, as modelopt calibrated them."""
    out = {}
    for i, layer in enumerate(ref.shared_block):
        for parts in PARTS.values():
            for part in parts:
                module = layer.get_submodule(part)
                out[f"{i}.{part}"] = {
                    "weight": float(module.weight_quantizer.amax),
                    "input": float(module.input_quantizer.amax),
                }
    return out


def fp8_tensors(bf16: dict[str, torch.Tensor], amax: dict[str, dict[str, float]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's tensors: trunk linears quantized, everything else as it was.

    A TensorRT-LLM linear made of several HF linears (qkv) takes the max of their amaxes, and
    its concatenated weight is requantized with that one scale.
    """
    out = dict(bf16)
    for i in layer_plan(spec)["shared_block"]:
        for lin, parts in PARTS.items():
            name = f"transformer.layers.{i}.{lin}"
            w_scale = fp8.scale_of(max(amax[f"{i}.{p}"]["weight"] for p in parts))
            a_scale = fp8.scale_of(max(amax[f"{i}.{p}"]["input"] for p in parts))
            out[f"{name}.weight"] = fp8.quantize(bf16[f"{name}.weight"], w_scale)
            out[f"{name}.weights_scaling_factor"] = w_scale
            out[f"{name}.activation_scaling_factor"] = a_scale
    return out


def passthrough(ckpt: Path, out: Path) -> None:
    (out / "checkpoint").mkdir()
    for name in (trtckpt.CONFIG, trtckpt.WEIGHTS, artifacts.MANIFEST):
        artifacts.link_or_copy(ckpt / name, out / "checkpoint" / name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="convert's bf16 checkpoint")
    ap.add_argument("--hf", type=Path, required=True, help="HF checkpoint: the model modelopt calibrates")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--precision", required=True)
    ap.add_argument("--params", default="{}", help="the calibration section of the config, as JSON")
    args = ap.parse_args(argv)
    if args.precision not in ("bf16", "fp8"):
        raise InputError("config: engine.precision", f"unknown precision '{args.precision}'")
    _, spec, bf16 = trtckpt.load_checkpoint(args.ckpt)
    if args.precision == "bf16":
        with artifacts.atomic_dir(args.out) as tmp:
            passthrough(args.ckpt, tmp)
        print(f"bf16: passed {args.ckpt} through to {args.out}")
        return
    p = json.loads(args.params)
    device, dtype = p.pop("device", "cpu"), getattr(torch, p.pop("dtype", "float32"))
    settings = dataset.CalibrationSettings(**p)
    with artifacts.atomic_dir(args.out) as tmp:
        rows = dataset.as_tensors(dataset.build(settings, spec, tmp / "dataset"))
        ref = MossSpeechReference(spec, load_hf_state(args.hf), dtype, device)
        summary = quantize(ref, rows, device)
        (tmp / "quant_summary.txt").write_text(summary)
        amax = amax_table(ref)
        table = {"algorithm": "max", "format": "E4M3 per-tensor", "samples": len(rows), "amax": amax}
        (tmp / "amax.json").write_text(json.dumps(table, indent=2))
        (tmp / "checkpoint").mkdir()
        trtckpt.save_checkpoint(tmp / "checkpoint", trtckpt.trt_config(spec, fp8=True), fp8_tensors(bf16, amax, spec))
    print(f"fp8: calibrated the shared block on {len(rows)} samples into {args.out}")


if __name__ == "__main__":
    run_main(main)
