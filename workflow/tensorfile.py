"""Reading tensor files with one-line errors: a safetensors file's header, and torch pickles.

A corrupt header or a truncated copy (the common fault of an interrupted transfer) is named as
such, in our words, before any tensor is read: safetensors' own messages ("incomplete
metadata, file not fully covered") do not say which.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from workflow.errors import InputError

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100_000_000  # bytes: safetensors refuses longer headers too

TensorMeta = dict[str, tuple[tuple[int, ...], torch.dtype | str]]


def read_header(path: str | Path) -> TensorMeta:
    """Tensor name -> (shape, dtype) from the header, once the header parses and the file's
    size is exactly what the header declares. An unknown dtype is kept as its string."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little")
            raw = f.read(n) if len(prefix) == 8 and 0 < n <= MAX_HEADER else b""
    except FileNotFoundError:
        raise InputError(path, "file is missing") from None
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror})") from None
    if len(prefix) < 8:
        raise InputError(path, f"truncated: the file has {size} bytes, less than a safetensors header")
    if not 0 < n <= MAX_HEADER:
        raise InputError(path, f"corrupt safetensors header: it declares a header of {n} bytes")
    if len(raw) < n:
        raise InputError(path, f"truncated: the file has {size} bytes, its header alone declares {8 + n}")
    try:
        entries = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
        meta = {k: (tuple(int(d) for d in v["shape"]), DTYPES.get(v["dtype"], v["dtype"])) for k, v in entries.items()}
        end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError, ValueError):
        raise InputError(path, "corrupt safetensors header: not a JSON table of tensors") from None
    declared = 8 + n + end
    if declared != size:
        what = "truncated" if size < declared else "corrupt"
        raise InputError(path, f"{what}: the file has {size} bytes, its header declares {declared}")
    return meta


def load_pickle(path: str | Path) -> object:
    """A torch pickle's content (on the CPU) with `weights_only`: tensors and plain containers only,
    so a pickle that would run code, or build any other object, is refused, not executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(path, "file is missing") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        lines = [line.strip() for line in str(e).splitlines()]
        why = next((line for line in lines if "GLOBAL" in line or "nsupported" in line), type(e).__name__)
        raise InputError(path, f"refused: not a plain tensor file ({why})") from None
