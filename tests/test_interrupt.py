"""Killed runs: SIGKILL at any moment leaves the old artifact or nothing, never half a new one;
the next run clears what the killed one left and makes the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT

from workflow import convert, download
from workflow.artifacts import atomic_dir, atomic_file


def tree(root: Path) -> dict[str, str] | None:
    """relative path -> sha256 of every file under root (None if root does not exist)."""
    if not root.exists():
        return None
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def kill_when(module: str, argv: list[str], out: Path, ready: Callable[[Path], bool]) -> Path:
    """Run `python -m module argv`; SIGKILL it the moment ready(its temporary) holds. Returns
    the temporary it was writing."""
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = out.parent / f".{out.name}.tmp-{proc.pid}"
    try:
        while proc.poll() is None and not ready(tmp):
            time.sleep(0.0002)
        if proc.poll() is None:  # not yet reaped, so the pid is still this process
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill point"
    return tmp


def created(tmp: Path) -> bool:
    return tmp.is_dir()


def writing_safetensors(tmp: Path) -> bool:
    """safetensors writes each file as .tmpXXXX in the same directory, then renames it."""
    return any(p.stat().st_size > 0 for p in tmp.glob(".tmp*") if p.exists())


def manifest_written(tmp: Path) -> bool:
    return (tmp / "manifest.json").exists()


def shards_linked(tmp: Path) -> bool:
    return any(tmp.glob("*.safetensors"))


def linked_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        os.link(p, dst / p.name)
    return dst


@pytest.mark.parametrize(
    "point, ready, old",
    [
        ("temporary_created", created, False),
        ("mid_write_of_rank0", writing_safetensors, True),
        ("manifest_written", manifest_written, True),
    ],
)
def test_killed_convert_leaves_old_or_nothing_and_rerun_matches(point, ready, old, tiny_hf, tiny_ckpt, tmp_path):
    out = tmp_path / "ckpt-bf16"
    if old:  # an earlier artifact, told apart by an extra file
        linked_copy(tiny_ckpt, out)
        (out / "OLD").write_text("from an earlier run\n")
    before = tree(out)
    tmp = kill_when("workflow.convert", ["--hf", str(tiny_hf), "--out", str(out)], out, ready)
    allowed = [before, None] + ([tree(tiny_ckpt)] if point == "manifest_written" else [])
    assert tree(out) in allowed, "a killed convert left half an artifact"
    if point == "mid_write_of_rank0":
        (partial,) = tmp.glob(".tmp*")
        assert hashlib.sha256(partial.read_bytes()).hexdigest() != tree(tiny_ckpt)["rank0.safetensors"], "killed after the write"
    convert.main(["--hf", str(tiny_hf), "--out", str(out)])
    assert tree(out) == tree(tiny_ckpt), "the rerun must make the same bytes as an uninterrupted run"
    assert leftovers(out) == [], "the rerun must clear what the killed run left"


@pytest.mark.parametrize(
    "source, ready",
    [("synthetic:tiny", writing_safetensors), ("local", shards_linked)],
    ids=["synthetic_mid_write_of_a_shard", "local_source_mid_linking"],
)
def test_killed_download_reruns_to_the_same_checkpoint(source, ready, tiny_hf, tmp_path):
    """A local source is linked again from the start (hard links: nothing to resume). The hub
    source killed mid-shard is test_hub.py's: the rerun resumes the partial shard where the
    killed run left it, and gives the same manifest."""
    source = f"local:{tiny_hf}" if source == "local" else source
    out = tmp_path / "hf"
    kill_when("workflow.download", ["--source", source, "--out", str(out)], out, ready)
    assert not out.exists()
    assert len(leftovers(out)) == 1
    download.main(["--source", source, "--out", str(out)])
    assert tree(out) == tree(tiny_hf)
    assert leftovers(out) == []


@pytest.fixture
def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(p.stdout)


@pytest.fixture
def live_pid():
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_stale_temporaries_are_cleared_and_live_ones_kept(kind, tmp_path, dead_pid, live_pid):
    for name in (f".art.tmp-{dead_pid}", f".art.old-{dead_pid}", f".art.tmp-{live_pid}", ".art.tmp-x", f".other.tmp-{dead_pid}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "half-written").write_text("junk")
    if kind == "dir":
        with atomic_dir(tmp_path / "art") as t:
            (t / "f").write_text("new")
    else:
        with atomic_file(tmp_path / "art") as t:
            t.write_text("new")
    # a live run's temporary (it may be writing) and names that are not ours stay
    kept = ["art", f".art.tmp-{live_pid}", ".art.tmp-x", f".other.tmp-{dead_pid}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
