"""TensorRT-LLM backend (engine flow, TensorRT-LLM 0.13 to 1.2.x).

Not installable on this project's machines (NVIDIA's own index only): everything here is
importable without tensorrt_llm, and fails at once with one line when it is needed.
"""

from __future__ import annotations

from pathlib import Path

from workflow.errors import InputError

SUPPORTED = "0.13 to 1.2.x"
INSTALL_HINT = (
    "tensorrt_llm is not installed: on a CUDA machine run "
    "'pip install tensorrt-llm==1.2.0 --extra-index-url https://pypi.nvidia.com' "
    f"(or use envs/trtllm.yaml); supported versions: {SUPPORTED}"
)


def require_tensorrt_llm(where: str = "engine.backend: trtllm"):
    """Import tensorrt_llm or raise the one-line install hint."""
    try:
        import tensorrt_llm
    except ImportError:
        raise InputError(where, INSTALL_HINT) from None
    return tensorrt_llm


def build(ckpt_dir: Path, out: Path, options: dict) -> None:
    require_tensorrt_llm()
    raise InputError("engine.backend: trtllm", "the TensorRT-LLM build is not implemented yet")


def load(engine_dir: str | Path, meta: dict, device: str | None = None, max_batch: int | None = None):
    require_tensorrt_llm()
    raise InputError(engine_dir, "the TensorRT-LLM runtime is not implemented yet")
