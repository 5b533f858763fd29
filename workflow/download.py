"""download: put a MOSS-Speech checkpoint under results/<tag>/hf/, checked, with a manifest.

Sources: a synthetic preset (generated here), a local directory (hard-linked), or the hub at
a pinned revision (workflow/hub.py: only the files needed, downloaded resumably into our cache,
each checked against the hub's own hash, then hard-linked). Whatever the source, the checkpoint
is validated structurally: config fields, index, every expected tensor with its shape and
dtype, no unexpected tensor, no NaN or Inf.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from workflow import artifacts, synthetic, tensorfile
from workflow.errors import InputError, run_main
from workflow.names import hf_shapes
from workflow.sources import Source, parse_source
from workflow.spec import PRESETS, ModelSpec, load_spec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HUB_PATTERNS = ["config.json", "generation_config.json", INDEX, "*.safetensors"]
HUB_IGNORE = ["*/*"]  # top-level files only: fnmatch's * crosses '/', so *.safetensors alone takes subfolders'


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


def fetch(source: Source, out: Path, seed: int, device: str, cache_dir: Path) -> tuple[Path, dict[str, str]]:
    """Bring the source's files within reach; return the directory that holds them, and the
    sha256 of those already hashed (the hub's, checked on the way: not read twice).

    A synthetic checkpoint is written straight into `out`; a local or hub one is returned
    where it lies, so that validation errors name the user's own files.
    """
    if source.kind == "synthetic":
        spec = PRESETS[source.value]
        shards = 4 if source.value == "full" else 2
        state = synthetic.synthetic_state(spec, seed, device)
        synthetic.write_hf_checkpoint(out, spec, state, shards, torch.bfloat16)
        return out, {}
    if source.kind == "hf":
        from workflow import hub  # huggingface_hub is imported only for a hub source

        return hub.fetch(source.value, source.revision, cache_dir, HUB_PATTERNS, HUB_IGNORE)
    src = Path(source.value)
    if not src.is_dir():
        raise InputError(src, "local model directory does not exist")
    return src, {}


def link_files(src: Path, out: Path) -> None:
    """Hard-link (or copy) the checkpoint's files from src into out."""
    for p in sorted(src.iterdir()):
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ("config.json", "generation_config.json", INDEX)):
            artifacts.link_or_copy(p.resolve(), out / p.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-dir", type=Path, default=Path("results/.hub-cache"))
    ap.add_argument("--no-finite-check", action="store_true")
    args = ap.parse_args(argv)
    source = parse_source(args.source, "--source")
    with artifacts.atomic_dir(args.out) as tmp:
        src, sha256s = fetch(source, tmp, args.seed, args.device, args.cache_dir)
        spec = validate(src, check_finite=not args.no_finite_check)
        if src != tmp:
            link_files(src, tmp)
        source_of = {"source": {"hub": args.source, "commit": src.name}} if source.kind == "hf" else {}
        artifacts.write_manifest(tmp, source_of, sha256s)
    print(f"{args.source}: {spec.num_layers} decoder layers, hidden {spec.hidden_size}; checkpoint in {args.out}")


if __name__ == "__main__":
    run_main(main)
