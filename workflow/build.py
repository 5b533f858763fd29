"""build: a TensorRT-LLM checkpoint -> an engine directory with engine.json.

engine.json holds the engine's options (EngineOptions, as config gave them), the sha256 of the
checkpoint it came from (so verify and benchmark refuse an engine built from another
checkpoint), what build tuned on this GPU (or took from `engine.timing_cache`), the model spec
and the versions. For the torch backend the directory holds the checkpoint's files as hard links
(no 17 GB copy) and the build ends with a smoke run: one prefill whose logits must be finite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from workflow import artifacts, trtckpt
from workflow.engines import attention, gemv, load_engine, timing_cache, write_engine_json
from workflow.engines.options import ENGINE_FORMAT, EngineOptions
from workflow.errors import InputError, run_main
from workflow.versions import versions

KERNELS = {"gemv": gemv, "decode_attention": attention}  # option -> its Triton module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="calibrate's checkpoint directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--options-json", default="{}", help="the engine section of the config, as JSON (defaults: EngineOptions)")
    args = ap.parse_args(argv)
    try:
        values = json.loads(args.options_json)
    except json.JSONDecodeError as e:
        raise InputError("--options-json", f"not valid JSON ({e.msg})") from None
    options = EngineOptions.from_dict(values)
    for name, kernel in KERNELS.items():
        if getattr(options, name) and not kernel.available():
            raise InputError(f"config: engine.{name}", "needs Triton, which is not installed (pip install triton)")
    cfg, spec = trtckpt.read_config(args.ckpt)
    is_fp8 = trtckpt.quant_algo(cfg) == "FP8"
    if is_fp8 != (options.precision == "fp8"):
        raise InputError(
            args.ckpt / trtckpt.CONFIG, f"quant_algo {trtckpt.quant_algo(cfg)} does not fit precision {options.precision}"
        )
    meta = {
        "format": ENGINE_FORMAT,
        "options": options,
        "checkpoint": {"sha256": artifacts.read_manifest(args.ckpt)["sha256"], "path": str(args.ckpt)},
        "tuning": {},
        "spec": spec.to_dict(),
        "versions": versions(),
    }
    with artifacts.atomic_dir(args.out) as tmp:
        if options.backend == "trtllm":
            from workflow.engines import trtllm_engine

            trtllm_engine.build(args.ckpt, tmp, meta)
        else:
            trtckpt.load_checkpoint(args.ckpt)  # every tensor present, right shape and dtype
            for name in (trtckpt.CONFIG, trtckpt.WEIGHTS):
                artifacts.link_or_copy(args.ckpt / name, tmp / name)
        write_engine_json(tmp, meta)
        cache = options.timing_cache if options.backend == "torch" and options.gemv and options.on_cuda else ""
        key = timing_cache.device_key(torch.device(options.device)) if cache else ""
        known = timing_cache.read(cache, key) if cache else None
        engine = load_engine(tmp, known=known)
        prompt = torch.tensor([[[spec.sosp_token_id, 512]] * 4])
        text, audio = engine.prefill(prompt)
        if not (torch.isfinite(text).all() and torch.isfinite(audio).all()):
            raise InputError(args.ckpt, "the built engine produces non-finite logits")
        tuned = engine.tuning_json()
        if tuned:  # tuned on this GPU now: later loads reuse it
            write_engine_json(tmp, meta | {"tuning": tuned})
        if cache:  # the torch engine's blocks, as tuned or taken from the cache
            chosen = engine.tuning
            timing_cache.write(cache, key, chosen)
            print(f"the GEMV's blocks: {sum(u in known for u in chosen)} of {len(chosen)} from the timing cache {cache}")
    print(f"built {options.backend}/{options.precision} engine in {args.out}")


if __name__ == "__main__":
    run_main(main)
