"""The GEMV's timing cache (`engine.timing_cache`): the blocks build tuned, kept in a JSON file by device, so that
the next build on the same kind of GPU skips the minutes of tuning, like TensorRT's timing cache.

A block's choice depends on its use (tuning.py's `Use`: the weight's shape and element size, its Fuse, the rows)
and on the device key: the GPU's model, SM count and compute capability, the Triton and torch versions and the
GEMV's own source (gemv.py, blocks.py). A file holds entries for any number of device keys; entries under another
key are kept, never used. Its layout: {"format": 1, "devices": {key: {use key: block, as engine.json's
`tuning.gemv`}}}."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from workflow import artifacts
from workflow.engines import blocks, gemv
from workflow.engines.blocks import Tuned, Use
from workflow.errors import InputError

FORMAT = 1


def device_key(device: torch.device) -> str:
    """What a tuned block depends on besides its use (module docstring)."""
    p = torch.cuda.get_device_properties(device)
    source = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (gemv, blocks))).hexdigest()[:16]
    triton = getattr(gemv.triton, "__version__", "none")
    gpu = f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
    return f"{gpu}, triton {triton}, torch {torch.__version__}, gemv {source}"


def _read(path: Path) -> dict:
    """The file's contents (an empty cache where there is no file yet), or an InputError naming it."""
    if not path.exists():
        return {"format": FORMAT, "devices": {}}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(path, f"not a GEMV timing cache: not JSON ({e}); delete it to start a new one") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("devices"), dict):
        raise InputError(path, f"not a GEMV timing cache of format {FORMAT}; delete it to start a new one")
    return data


def read(path: str | Path, key: str) -> dict[Use, Tuned]:
    """The blocks the file holds for this device key (none where it holds none)."""
    stored = _read(Path(path))["devices"].get(key, {})
    try:
        return blocks.read_tuning(stored)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(path, f"an entry under '{key}' is not a block ({e}); delete it to start a new one") from None


def write(path: str | Path, key: str, tuning: dict[Use, Tuned]) -> None:
    """Add these blocks under the device key (the file's other entries kept), written whole or not at all
    (`artifacts.write_json`: a build killed part-way leaves the old file)."""
    data = _read(Path(path))
    data["devices"][key] = data["devices"].get(key, {}) | blocks.tuning_json(tuning)
    artifacts.write_json(path, data)
