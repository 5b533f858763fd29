"""convert: a Hugging Face MOSS-Speech checkpoint -> our TensorRT-LLM checkpoint (bf16).

The work is the name table in names.py; this script reads, applies it, and writes
config.json + rank0.safetensors + manifest.json atomically.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from workflow import artifacts, trtckpt
from workflow.errors import run_main
from workflow.hfckpt import load_hf_state, validate
from workflow.names import hf_to_trt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", type=Path, required=True, help="checkpoint directory from download")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = validate(args.hf, check_finite=False)  # download checked the values already
    hf = {k: v.to(torch.bfloat16) for k, v in load_hf_state(args.hf).items()}
    tensors = hf_to_trt(hf, spec)
    with artifacts.atomic_dir(args.out) as tmp:
        trtckpt.save_checkpoint(tmp, trtckpt.trt_config(spec), tensors)
    print(f"converted {len(hf)} HF tensors into {len(tensors)} TensorRT-LLM tensors in {args.out}")


if __name__ == "__main__":
    run_main(main)
