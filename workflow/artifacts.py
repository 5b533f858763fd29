"""Atomic artifacts: everything is written to a temporary path beside its target and renamed
when complete, so a killed job leaves either nothing or the old artifact, never half a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

MANIFEST = "manifest.json"


def _tmp_path(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{os.getpid()}"


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: object) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def sha256_file(path: str | Path, progress: bool = False) -> str:
    """sha256 of a file, read in 16 MiB blocks (with a progress bar for big files)."""
    path = Path(path)
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"sha256 {path.name}",
            disable=not progress or size < 256 << 20,
        ) as bar,
    ):
        while block := f.read(16 << 20):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def write_manifest(root: Path) -> dict:
    """Write <root>/manifest.json: every file's size and sha256, and one digest over them all."""
    files = {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256_file(p, True)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    manifest = {"files": files, "sha256": digest}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(root: str | Path) -> dict:
    return json.loads((Path(root) / MANIFEST).read_text())


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link src to dst (no second copy of a 17 GB file), copying across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
