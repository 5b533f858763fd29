"""The versions of what computed an artifact, recorded beside it (engine.json, benchmark.json)."""

from __future__ import annotations

import platform


def versions() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
