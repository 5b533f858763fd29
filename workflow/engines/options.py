"""Engine options: one frozen dataclass, validated once, that travels unchanged from config
through build and engine.json to the engine; and `upgrade`, the one reader of older engine.json.

Pure Python (no torch): the Snakefile validates config with it on every start.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from workflow.engines.blocks import Block, Body
from workflow.errors import InputError

BACKENDS = ("torch", "trtllm")
PRECISIONS = ("bf16", "fp8")
DTYPES = ("float32", "bfloat16")
ENGINE_FORMAT = 2  # engine.json's layout: options (backend and precision among them) and tuning
TORCH_ONLY = ("compile", "gemv", "decode_attention", "fp8_fast_accum", "defer_text_fill", "timing_cache")
CUDA_KERNELS = ("gemv", "decode_attention")  # our Triton kernels: the torch backend on cuda
KINDS = {"str": (str, "a string"), "int": (int, "an integer"), "bool": (bool, "true or false")}  # by annotation


@dataclass(frozen=True)
class EngineOptions:
    """What an engine is built and run with (config's `engine` section, README's table)."""

    backend: str = "torch"  # torch | trtllm
    precision: str = "bf16"  # bf16 | fp8 (the shared block in FP8, calibrated)
    device: str = "cpu"
    dtype: str = "float32"  # torch backend compute dtype: float32 on CPU (exact checks), bfloat16 on CUDA
    max_batch: int = 4
    max_seq_len: int = 1024
    cuda_graphs: bool = True  # CUDA only: replay each decode step from a captured graph
    compile: bool = False  # fuse the elementwise work between matmuls with torch.compile
    gemv: bool = False  # decode's matmuls (<= gemv.MAX_M rows) through the fused Triton GEMV
    decode_attention: bool = False  # decode's q/k norm, rope, cache write and attention in one Triton kernel
    fp8_fast_accum: bool = False  # FP8 GEMMs accumulate without cuBLASLt's periodic fp32 promotion
    defer_text_fill: bool = False  # audio mode: no text branch; it catches up on every owed position when text is next needed
    timing_cache: str = ""  # build: a JSON file of the GEMV's tuned blocks by GPU, read and added to ("": tune every block)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, (kind, what) = getattr(self, f.name), KINDS[f.type]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"{f.name}: {value!r} is not {what}")
        problem = self.problem()
        if problem:
            raise ValueError(": ".join(problem))

    def problem(self) -> tuple[str, str] | None:
        """(field, why) for a combination no engine can run, else None."""
        if self.backend not in BACKENDS:
            return "backend", f"unknown backend '{self.backend}' (known: {', '.join(BACKENDS)})"
        if self.precision not in PRECISIONS:
            return "precision", f"unknown precision '{self.precision}' (known: {', '.join(PRECISIONS)})"
        if self.dtype not in DTYPES:
            return "dtype", f"unknown dtype '{self.dtype}' (known: {', '.join(DTYPES)})"
        if self.device != "cpu" and self.device.split(":")[0] != "cuda":
            return "device", f"unknown device '{self.device}' (cpu or cuda)"
        for name in ("max_batch", "max_seq_len"):
            if getattr(self, name) < 1:
                return name, f"must be at least 1, not {getattr(self, name)}"
        if self.backend == "trtllm" and not self.on_cuda:
            return "backend", f"backend trtllm runs on cuda only, not on device '{self.device}'"
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the tests' way to run the kernels on a CPU
        for name in CUDA_KERNELS:
            if getattr(self, name) and (self.backend != "torch" or not (self.on_cuda or interpreted)):
                return name, f"a Triton kernel of the torch backend on cuda, not {self.backend} on {self.device}"
        for name in TORCH_ONLY:
            if getattr(self, name) and self.backend != "torch":
                return name, f"an option of the torch backend, not {self.backend}"
        return None

    @property
    def on_cuda(self) -> bool:
        return self.device.split(":")[0] == "cuda"

    @classmethod
    def from_dict(cls, values: dict, where: str | Path = "config: engine") -> EngineOptions:
        """Options from config or engine.json, or an InputError naming `where` and the field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(where, f"unknown engine option(s) {', '.join(unknown)}")
        try:
            return cls(**values)
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            place = f"{where}.{field}" if str(where).startswith("config:") else where
            raise InputError(place, why if place != where else str(e)) from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def upgrade(meta: dict, path: str | Path) -> dict:
    """engine.json of any earlier format as the current one reads: backend and precision inside
    `options`; `late_text_fill` (the deferred fill's predecessor, the same function) as
    `defer_text_fill`; GEMV blocks, once `options.gemv_blocks` of 3 to 6 ints (BLOCK_N, BLOCK_K,
    warps[, defer[, per_sm[, dot stages]]]), as `tuning.gemv` of named blocks."""
    if meta.get("format") == ENGINE_FORMAT:
        return meta
    meta = dict(meta)
    options = dict(meta.get("options", {}))
    for key in ("backend", "precision"):
        if key in meta:
            options.setdefault(key, meta.pop(key))
    if options.pop("late_text_fill", False):
        options["defer_text_fill"] = True
    stored = options.pop("gemv_blocks", None) or {}
    tuning = dict(meta.get("tuning", {}))
    tuning["gemv"] = {use: old_block(list(block), path) for use, block in stored.items()}
    return meta | {"format": ENGINE_FORMAT, "options": options, "tuning": tuning}


def old_block(numbers: list[int], path: str | Path) -> dict:
    """A GEMV block stored as ints (the kernel body coded in the 4th to 6th) as a named one."""
    if not 3 <= len(numbers) <= 6 or not all(isinstance(n, int) for n in numbers):
        raise InputError(path, f"a GEMV block of 3 to 6 ints expected, not {numbers}")
    block_n, block_k, warps, defer, per_sm, stages = (*numbers, 0, 0, 0)[:6]
    body = Body.DOT if stages else Body.RESIDENT if per_sm else Body.DEFER if defer else Body.TILE
    return Block(body, block_n, block_k, warps, per_sm, stages).to_dict()
