"""The calibration dataset: rows of (text ids, audio ids), saved with `datasets`.

Sources (`calibration.dataset`): `synthetic` (MOSS-Speech-like traffic from the calibration
seed), `local:<dir>` (a directory written by `datasets.Dataset.save_to_disk`), or
`hf:<dataset id>@<revision>` (`datasets.load_dataset`, revision pinned). Each row has two
equal-length integer columns, `text_ids` and `audio_ids`. Validated before use: at least
`num_samples` rows (the first num_samples are kept; fewer is an error, not a warning), every
id inside its vocabulary, every length in range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from workflow import traffic
from workflow.errors import InputError
from workflow.generate import Ids
from workflow.spec import ModelSpec

COLUMNS = ("text_ids", "audio_ids")


@dataclass(frozen=True)
class CalibrationSettings:
    dataset: str = "synthetic"
    split: str = "train"
    num_samples: int = 500
    min_len: int = 32
    max_len: int = 256
    seed: int = 1234


def synthetic_rows(s: CalibrationSettings, ids: Ids) -> dict[str, list[list[int]]]:
    """num_samples rows of synthetic traffic with lengths uniform in [min_len, max_len]."""
    g = torch.Generator().manual_seed(s.seed)
    rows = []
    for _ in range(s.num_samples):
        length = int(torch.randint(s.min_len, s.max_len + 1, (1,), generator=g))
        rows.append(traffic.sequence(length, ids, g))
    return {"text_ids": [r[:, 0].tolist() for r in rows], "audio_ids": [r[:, 1].tolist() for r in rows]}


def load_rows(s: CalibrationSettings, ids: Ids):
    """The source as a `datasets.Dataset` (not yet validated)."""
    import datasets

    scheme, _, rest = s.dataset.partition(":")
    if s.dataset == "synthetic":
        return datasets.Dataset.from_dict(synthetic_rows(s, ids))
    if scheme == "local":
        if _saved_empty(Path(rest)):  # load_from_disk fails on it with a bare IndexError
            raise InputError(rest, f"has 0 rows, calibration.num_samples needs {s.num_samples}")
        try:
            return datasets.load_from_disk(rest)
        except Exception as e:  # datasets raises many kinds
            raise InputError(rest, f"cannot be loaded as a save_to_disk dataset ({type(e).__name__}: {e})") from None
    if scheme == "hf":
        name, at, rev = rest.partition("@")
        if not at or not rev:
            raise InputError("config: calibration.dataset", f"'{s.dataset}' has no pinned revision: write hf:{name}@<revision>")
        return datasets.load_dataset(name, revision=rev, split=s.split)
    raise InputError("config: calibration.dataset", f"unknown dataset '{s.dataset}': use synthetic, local:<dir> or hf:<id>@<rev>")


def _saved_empty(path: Path) -> bool:
    """A save_to_disk directory of an empty dataset: its state.json lists no data files."""
    try:
        return json.loads((path / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def validate(ds, s: CalibrationSettings, spec: ModelSpec, source: str):
    """The first num_samples rows, checked; InputError names the source, row and problem."""
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise InputError(source, f"missing column(s) {', '.join(missing)} (need {', '.join(COLUMNS)})")
    if len(ds) < s.num_samples:
        raise InputError(source, f"has {len(ds)} rows, calibration.num_samples needs {s.num_samples}")
    ds = ds.select(range(s.num_samples))
    for i, (text, audio) in enumerate(zip(ds["text_ids"], ds["audio_ids"], strict=True)):
        if len(text) != len(audio):
            raise InputError(source, f"row {i}: text_ids has {len(text)} ids but audio_ids {len(audio)}")
        if not s.min_len <= len(text) <= s.max_len:
            raise InputError(source, f"row {i}: length {len(text)} outside [{s.min_len}, {s.max_len}]")
        for column, values, vocab in (("text_ids", text, spec.vocab_size), ("audio_ids", audio, spec.audio_vocab_size)):
            bad = next((v for v in values if not (isinstance(v, int) and 0 <= v < vocab)), None)
            if bad is not None:
                raise InputError(source, f"row {i}: {column} holds {bad!r}, outside the vocabulary [0, {vocab})")
    return ds


def build(s: CalibrationSettings, spec: ModelSpec, out: Path):
    """Load, validate and save_to_disk the calibration set; returns the saved dataset."""
    scheme, _, rest = s.dataset.partition(":")
    ds = validate(load_rows(s, Ids.of(spec)), s, spec, rest if scheme == "local" else s.dataset)
    ds.save_to_disk(str(out))
    return ds


def as_tensors(ds) -> list[torch.Tensor]:
    """Rows as [T, 2] tensors of (text id, audio id)."""
    return [torch.tensor([text, audio]).T.contiguous() for text, audio in zip(ds["text_ids"], ds["audio_ids"], strict=True)]
