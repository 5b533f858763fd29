"""Atomic artifacts: everything is written to a temporary path beside its target and renamed
when complete, so a killed job leaves either nothing or the old artifact, never half a new one.

A temporary is named `.<name>.tmp-<pid>` (and the replaced artifact `.<name>.old-<pid>` for the
instant between the two renames). Those a killed run left behind are removed by the next write
of the same artifact, once their process is gone; nothing ever reads them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from workflow.errors import InputError, read_json

MANIFEST = "manifest.json"


def _side_path(path: Path, kind: str, pid: int | None = None) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid() if pid is None else pid}"


def stale_temporaries(path: Path) -> list[Path]:
    """Temporaries beside `path` left by runs whose process is gone (killed, crashed)."""
    out = []
    for p in path.parent.glob(f".{glob.escape(path.name)}.*-*"):
        kind, _, pid = p.name[len(path.name) + 2 :].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _alive(int(pid)):
            out.append(p)
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _prepare(path: Path) -> Path:
    """Make the parent, clear what killed runs left, and return this run's temporary path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in stale_temporaries(path):
        _remove(p)
    tmp = _side_path(path, "tmp")
    _remove(tmp)
    return tmp


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `path` in one rename.

    Replacing an existing directory takes two renames (old aside, new in): a kill between them
    leaves nothing at `path` (the old one waits in `.<name>.old-<pid>` until the next run).
    """
    path = Path(path)
    tmp = _prepare(path)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        old = _side_path(path, "old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        _remove(old)
    except BaseException:
        _remove(tmp)
        raise


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path; on success it replaces `path` in one rename."""
    path = Path(path)
    tmp = _prepare(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
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


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a power cut must not undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write_manifest(root: Path, extra: dict | None = None, sha256s: dict[str, str] | None = None) -> dict:
    """Write <root>/manifest.json: every file's size and sha256, and one digest over them all
    (then `extra`'s keys, which the digest does not cover: where the files came from).
    `sha256s`: those already computed, by relative path (not read a second time)."""
    known = sha256s or {}
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            name = str(p.relative_to(root))
            files[name] = {"bytes": p.stat().st_size, "sha256": known.get(name) or sha256_file(p, True)}
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    manifest = {"files": files, "sha256": digest, **(extra or {})}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    manifest = read_json(path, "file is missing: not a complete artifact")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sha256"), str):
        raise InputError(path, "has no sha256: not a manifest")
    return manifest


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link src to dst (no second copy of a 17 GB file), copying across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
