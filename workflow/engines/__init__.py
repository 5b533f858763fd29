"""Engines behind one interface (base.Engine): our PyTorch engine and TensorRT-LLM.

An engine directory holds `engine.json` (backend, precision, limits, the sha256 of the
checkpoint it was built from) and whatever its backend needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from workflow import artifacts
from workflow.errors import InputError, read_json

if TYPE_CHECKING:  # base imports torch; the Snakefile imports this package on every start
    from workflow.engines.base import Engine

ENGINE_JSON = "engine.json"
BACKENDS = ("torch", "trtllm")
PRECISIONS = ("bf16", "fp8")


def check_engine_config(backend: str, precision: str, device: str, where: str = "config: engine") -> None:
    """Refuse a backend/precision/device combination no engine can run."""
    if backend not in BACKENDS:
        raise InputError(where, f"unknown backend '{backend}' (known: {', '.join(BACKENDS)})")
    if precision not in PRECISIONS:
        raise InputError(where, f"unknown precision '{precision}' (known: {', '.join(PRECISIONS)})")
    if backend == "trtllm" and device != "cuda":
        raise InputError(where, f"backend trtllm runs on cuda only, not on device '{device}'")


def read_engine_json(engine_dir: str | Path) -> dict:
    path = Path(engine_dir) / ENGINE_JSON
    meta = read_json(path, "file is missing: not an engine directory")
    return _require(meta, ("backend", "options"), path)


def _require(meta: object, keys: tuple[str, ...], path: Path) -> dict:
    missing = [k for k in keys if k not in meta] if isinstance(meta, dict) else list(keys)
    if missing:
        raise InputError(path, f"field(s) {', '.join(missing)} missing: not written by build")
    return meta  # type: ignore[return-value]


def check_built_from(engine_dir: str | Path, ckpt_dir: str | Path) -> dict:
    """The engine must come from this very checkpoint (manifest sha256), or InputError."""
    meta = _require(read_engine_json(engine_dir), ("precision", "checkpoint"), Path(engine_dir) / ENGINE_JSON)
    want = artifacts.read_manifest(ckpt_dir)["sha256"]
    got = meta.get("checkpoint", {}).get("sha256")
    if got != want:
        raise InputError(
            Path(engine_dir) / ENGINE_JSON,
            f"built from checkpoint {str(got)[:12]}, not from {ckpt_dir} ({want[:12]}): rebuild it",
        )
    return meta


def load_engine(engine_dir: str | Path, device: str | None = None, max_batch: int | None = None) -> Engine:
    """Open a built engine with its backend (device and batch limit may be overridden)."""
    meta = read_engine_json(engine_dir)
    if meta["backend"] == "torch":
        from workflow.engines.torch_engine import load

        return load(engine_dir, meta, device, max_batch)
    if meta["backend"] == "trtllm":
        from workflow.engines.trtllm_engine import load

        return load(engine_dir, meta, device, max_batch)
    raise InputError(Path(engine_dir) / ENGINE_JSON, f"unknown backend {meta['backend']!r}")
