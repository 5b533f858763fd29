"""The versions of what computed an artifact, recorded beside it (engine.json, benchmark.json): Python, torch and the
CUDA it was built for, transformers, and Triton where it is installed (the compiler of our kernels)."""

from __future__ import annotations

import importlib.util
import platform


def versions() -> dict:
    import torch
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    if importlib.util.find_spec("triton") is not None:
        import triton

        found["triton"] = triton.__version__
    return found
