"""A Hugging Face MOSS-Speech checkpoint directory (config.json, safetensors shards, their
index): its shard map, its structural check, and its tensors. Read by download (to check what
it fetched) and by every stage that needs the original weights (convert, calibrate, verify,
benchmark's eager baseline).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from workflow import tensorfile
from workflow.errors import InputError
from workflow.names import hf_shapes
from workflow.spec import ModelSpec, load_spec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def shard_map(hf_dir: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index (or the single model.safetensors)."""
    index = hf_dir / INDEX
    if not index.exists():
        if (hf_dir / SINGLE).exists():
            return {name: SINGLE for name in tensorfile.read_header(hf_dir / SINGLE)}
        raise InputError(hf_dir, f"neither {INDEX} nor {SINGLE} is present")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise InputError(index, f"not a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(index, "weight_map is not a table of tensor name -> shard file")
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise InputError(index, f"names shard '{shard}', which is not a file of this directory")
        if not (hf_dir / shard).is_file():
            raise InputError(index, f"names shard '{shard}', which is missing")
    return weight_map


def validate(hf_dir: str | Path, check_finite: bool = True) -> ModelSpec:
    """Check a HF MOSS-Speech checkpoint; InputError names the file and tensor at fault."""
    hf_dir = Path(hf_dir)
    spec = load_spec(hf_dir)
    weight_map = shard_map(hf_dir)
    expected = hf_shapes(spec)
    found: dict[str, tuple[str, tuple[int, ...], torch.dtype | str]] = {}
    for shard in sorted(set(weight_map.values())):
        for name, (shape, dtype) in tensorfile.read_header(hf_dir / shard).items():
            found[name] = (shard, shape, dtype)
    for name, shard in weight_map.items():
        if name not in found:
            raise InputError(hf_dir / shard, f"tensor '{name}' is listed in the index but not in the shard")
    for name, shape in expected.items():
        if name not in found:
            raise InputError(hf_dir / weight_map.get(name, INDEX), f"tensor '{name}' is missing")
        shard, got, dtype = found[name]
        if got != shape:
            raise InputError(hf_dir / shard, f"tensor '{name}' has shape {list(got)}, expected {list(shape)}")
        if dtype not in FLOAT_DTYPES:
            raise InputError(hf_dir / shard, f"tensor '{name}' has dtype {_name(dtype)}, expected bfloat16/float16/float32")
    for name, (shard, _, _) in found.items():
        if name not in expected:
            raise InputError(hf_dir / shard, f"unexpected tensor '{name}'")
    if check_finite:
        for shard in tqdm(sorted(set(weight_map.values())), desc="checking weights are finite"):
            for name, t in _tensors(hf_dir / shard):
                if not torch.isfinite(t).all():
                    raise InputError(hf_dir / shard, f"tensor '{name}' holds NaN or Inf")
    return spec


def _name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(path: Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of one shard, one at a time."""
    try:
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise InputError(path, f"not a readable safetensors file ({e})") from None


def load_hf_state(hf_dir: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a (validated) HF checkpoint."""
    hf_dir = Path(hf_dir)
    state = {}
    for shard in sorted(set(shard_map(hf_dir).values())):
        state.update(_tensors(hf_dir / shard, device))
    return state
