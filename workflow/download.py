"""download: put a MOSS-Speech checkpoint under results/<tag>/hf/, checked, with a manifest.

Sources: a synthetic preset (generated here), a local directory (hard-linked), or the hub at
a pinned revision (workflow/hub.py: only the files needed, downloaded resumably into our cache,
each checked against the hub's own hash, then hard-linked). Whatever the source, the checkpoint
is validated structurally: config fields, index, every expected tensor with its shape and
dtype, no unexpected tensor, no NaN or Inf.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from workflow import artifacts, hfckpt, synthetic
from workflow.errors import InputError, run_main
from workflow.sources import Source, parse_source
from workflow.spec import PRESETS

HUB_PATTERNS = ["config.json", "generation_config.json", hfckpt.INDEX, "*.safetensors"]
HUB_IGNORE = ["*/*"]  # top-level files only: fnmatch's * crosses '/', so *.safetensors alone takes subfolders'


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
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ("config.json", "generation_config.json", hfckpt.INDEX)):
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
        spec = hfckpt.validate(src, check_finite=not args.no_finite_check)
        if src != tmp:
            link_files(src, tmp)
        source_of = {"source": {"hub": args.source, "commit": src.name}} if source.kind == "hf" else {}
        artifacts.write_manifest(tmp, source_of, sha256s)
    print(f"{args.source}: {spec.num_layers} decoder layers, hidden {spec.hidden_size}; checkpoint in {args.out}")


if __name__ == "__main__":
    run_main(main)
