"""Engines behind one interface (base.Engine): our PyTorch engine and TensorRT-LLM.

An engine directory holds `engine.json` (its EngineOptions, the sha256 of the checkpoint it was
built from, what build tuned) and whatever its backend needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from workflow import artifacts
from workflow.engines.options import EngineOptions, upgrade
from workflow.errors import InputError, read_json

if TYPE_CHECKING:  # base imports torch; the Snakefile imports this package on every start
    from workflow.engines.base import Engine

ENGINE_JSON = "engine.json"


def read_engine_json(engine_dir: str | Path) -> dict:
    """engine.json in the current format (older ones upgraded), with `options` read into
    EngineOptions (checked)."""
    path = Path(engine_dir) / ENGINE_JSON
    meta = upgrade(_require(read_json(path, "file is missing: not an engine directory"), ("options",), path), path)
    return meta | {"options": EngineOptions.from_dict(meta["options"], path)}


def write_engine_json(engine_dir: str | Path, meta: dict) -> None:
    """engine.json as read_engine_json reads it (options as a plain dict)."""
    text = json.dumps(meta | {"options": meta["options"].to_dict()}, indent=2)
    (Path(engine_dir) / ENGINE_JSON).write_text(text + "\n")


def _require(meta: object, keys: tuple[str, ...], path: Path) -> dict:
    missing = [k for k in keys if k not in meta] if isinstance(meta, dict) else list(keys)
    if missing:
        raise InputError(path, f"field(s) {', '.join(missing)} missing: not written by build")
    return meta  # type: ignore[return-value]


def check_built_from(engine_dir: str | Path, ckpt_dir: str | Path) -> dict:
    """The engine must come from this very checkpoint (manifest sha256), or InputError."""
    meta = _require(read_engine_json(engine_dir), ("checkpoint",), Path(engine_dir) / ENGINE_JSON)
    want = artifacts.read_manifest(ckpt_dir)["sha256"]
    got = meta.get("checkpoint", {}).get("sha256")
    if got != want:
        raise InputError(
            Path(engine_dir) / ENGINE_JSON,
            f"built from checkpoint {str(got)[:12]}, not from {ckpt_dir} ({want[:12]}): rebuild it",
        )
    return meta


def load_engine(
    engine_dir: str | Path, device: str | None = None, max_batch: int | None = None, known: dict | None = None
) -> Engine:
    """Open a built engine with its backend (device and batch limit may be overridden). known: the torch backend's
    GEMV blocks from build's timing cache, for an engine not yet tuned (the other backend has none)."""
    meta = read_engine_json(engine_dir)
    asked = {k: v for k, v in (("device", device), ("max_batch", max_batch)) if v}
    options = EngineOptions.from_dict(meta["options"].to_dict() | asked, Path(engine_dir) / ENGINE_JSON)
    if options.backend == "torch":
        from workflow.engines.torch_engine import load

        return load(engine_dir, meta, options, known)
    from workflow.engines.trtllm_engine import load

    return load(engine_dir, meta, options)
