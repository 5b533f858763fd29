"""Model sources named by `model.source`, and the tag each one's artifacts live under.

Pure Python (no torch): the Snakefile imports it to name paths and to reject a bad source
before any job starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from workflow.errors import InputError

PRESET_NAMES = ("tiny", "full")


@dataclass(frozen=True)
class Source:
    kind: str  # "synthetic" | "local" | "hf"
    value: str  # preset name, directory, or repo id
    revision: str | None = None  # hf only: a pinned revision

    @property
    def tag(self) -> str:
        """Directory name under results/: several models live side by side."""
        if self.kind == "synthetic":
            return self.value
        if self.kind == "local":
            return "local-" + _safe(Path(self.value).resolve().name)
        return _safe(f"{self.value.split('/')[-1]}-{self.revision[:12]}")


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-") or "model"


def parse_source(source: str, where: str = "config: model.source") -> Source:
    """`synthetic:<preset>`, `local:<dir>` (or a plain existing directory), `hf:<repo>@<rev>`."""
    scheme, sep, rest = source.partition(":")
    if scheme == "synthetic" and sep:
        if rest not in PRESET_NAMES:
            raise InputError(where, f"unknown synthetic preset '{rest}' (known: {', '.join(PRESET_NAMES)})")
        return Source("synthetic", rest)
    if scheme == "hf" and sep:
        repo, at, rev = rest.partition("@")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise InputError(where, f"'{rest}' is not a hub repo id of the form owner/name")
        if not at or not rev:
            raise InputError(where, f"'{source}' has no pinned revision: write hf:{repo}@<commit or tag>")
        return Source("hf", repo, rev)
    if scheme == "local" and sep:
        return Source("local", rest)
    if not sep and Path(source).is_dir():
        return Source("local", source)
    raise InputError(where, f"unknown source '{source}': use synthetic:<preset>, local:<dir> or hf:<repo>@<revision>")
