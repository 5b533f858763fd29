"""build: a TensorRT-LLM checkpoint -> an engine directory with engine.json.

engine.json names the backend, precision and limits and carries the sha256 of the checkpoint
it came from, so verify and benchmark refuse an engine built from another checkpoint. For
the torch backend the directory holds the checkpoint's files as hard links (no 17 GB copy)
and the build ends with a smoke run: one prefill whose logits must be finite.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from workflow import artifacts, trtckpt
from workflow.engines import ENGINE_JSON, attention, check_engine_config, gemv, load_engine
from workflow.errors import InputError, run_main


def versions() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="calibrate's checkpoint directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="torch backend compute dtype")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="torch backend: decode without CUDA graphs")
    ap.add_argument("--compile", action="store_true", help="torch backend: fuse elementwise work with torch.compile")
    ap.add_argument("--gemv", action="store_true", help="torch backend: decode's matmuls through the fused Triton GEMV")
    ap.add_argument("--decode-attention", action="store_true", help="torch backend: decode's attention as one Triton kernel")
    ap.add_argument("--fp8-fast-accum", action="store_true", help="torch backend: FP8 GEMMs with fast accumulation")
    ap.add_argument(
        "--defer-text-fill", action="store_true", help="torch backend: audio mode leaves the text branch to the next text step"
    )
    args = ap.parse_args(argv)
    check_engine_config(args.backend, args.precision, args.device)
    for flag, on, kernel in (("gemv", args.gemv, gemv), ("decode_attention", args.decode_attention, attention)):
        if on and (args.backend != "torch" or args.device != "cuda"):
            where, why = f"config: engine.{flag}", "a Triton kernel of the torch backend on cuda"
            raise InputError(where, f"{why}, not {args.backend} on {args.device}")
        if on and not kernel.available():
            raise InputError(f"config: engine.{flag}", "needs Triton, which is not installed (pip install triton)")
    for flag, on in (("fp8_fast_accum", args.fp8_fast_accum), ("defer_text_fill", args.defer_text_fill)):
        if on and args.backend != "torch":
            raise InputError(f"config: engine.{flag}", f"an option of the torch backend, not {args.backend}")
    cfg, spec = trtckpt.read_config(args.ckpt)
    is_fp8 = trtckpt.quant_algo(cfg) == "FP8"
    if is_fp8 != (args.precision == "fp8"):
        raise InputError(
            args.ckpt / trtckpt.CONFIG, f"quant_algo {trtckpt.quant_algo(cfg)} does not fit precision {args.precision}"
        )
    meta = {
        "backend": args.backend,
        "precision": args.precision,
        "checkpoint": {"sha256": artifacts.read_manifest(args.ckpt)["sha256"], "path": str(args.ckpt)},
        "options": {
            "device": args.device,
            "dtype": args.dtype,
            "max_batch": args.max_batch,
            "max_seq_len": args.max_seq_len,
            "cuda_graphs": not args.no_cuda_graphs,
            "compile": args.compile,
            "gemv": args.gemv,
            "decode_attention": args.decode_attention,
            "fp8_fast_accum": args.fp8_fast_accum,
            "defer_text_fill": args.defer_text_fill,
        },
        "spec": spec.to_dict(),
        "versions": versions(),
    }
    with artifacts.atomic_dir(args.out) as tmp:
        if args.backend == "trtllm":
            from workflow.engines import trtllm_engine

            trtllm_engine.build(args.ckpt, tmp, meta)
        else:
            trtckpt.load_checkpoint(args.ckpt)  # every tensor present, right shape and dtype
            for name in (trtckpt.CONFIG, trtckpt.WEIGHTS):
                artifacts.link_or_copy(args.ckpt / name, tmp / name)
        (tmp / ENGINE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
        engine = load_engine(tmp)
        prompt = torch.tensor([[[spec.sosp_token_id, 512]] * 4])
        text, audio = engine.prefill(prompt)
        if not (torch.isfinite(text).all() and torch.isfinite(audio).all()):
            raise InputError(args.ckpt, "the built engine produces non-finite logits")
        if getattr(engine, "gemv_blocks", None):  # tuned on this GPU now: later loads reuse them
            meta["options"]["gemv_blocks"] = engine.gemv_blocks
            (tmp / ENGINE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    print(f"built {args.backend}/{args.precision} engine in {args.out}")


if __name__ == "__main__":
    run_main(main)
