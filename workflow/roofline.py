"""The two ceilings of the machine, measured, and what one step of the model must do.

Decode at batch 1 is bound by reading the weights once per step: its floor is the weight
bytes the step needs over the copy bandwidth measured in the same run. Prefill is bound by
matmul arithmetic: its floor is its FLOPs over the measured bf16 matmul rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from workflow.spec import ModelSpec


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 2) -> list[float]:
    """Wall time of each call in ms, with the device synchronised around every call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(1e3 * (time.perf_counter() - t))
    return out


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes read + written per second by a large device copy (median of 10)."""
    nbytes = nbytes or (4 << 30 if device.type == "cuda" else 512 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median(timed_ms(lambda: dst.copy_(src), device, 10)) / 1e3)


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a large matrix product in the compute dtype (bf16 on CUDA, float32 on CPU), on random data."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (median(timed_ms(lambda: a @ b, device, 10)) / 1e3)


def layer_params(spec: ModelSpec) -> int:
    """Weights of the linears of one decoder layer."""
    h = spec.hidden_size
    return h * spec.qkv_size + h * spec.num_attention_heads * spec.head_dim + 3 * h * spec.intermediate_size


def step_bytes(spec: ModelSpec, trunk_bytes: float, other_bytes: float, need_text: bool, text_branch: bool = True) -> int:
    """Weight bytes one decode step reads: every layer and norm, the audio head, and the text
    head only when needed (audio mode skips it); text_branch False: an audio-mode step that
    leaves the text branch to the next text-mode step (its read is then the catch-up's, once
    for all the positions owed). The embedding is one row a token: left out."""
    h, d = spec.hidden_size, spec.head_dim
    norms = 2 * h + 2 * d
    trunk = spec.num_shared_layers * (layer_params(spec) * trunk_bytes + norms * other_bytes)
    branch = spec.num_modality_layers * (layer_params(spec) + norms) * other_bytes + h * other_bytes
    heads = spec.audio_vocab_size * h + (spec.vocab_size * h if need_text else 0)
    return int(trunk + branch * (2 if text_branch or need_text else 1) + heads * other_bytes)


def prefill_flops(spec: ModelSpec, tokens: int) -> int:
    """Matmul FLOPs of a prefill of `tokens` positions: every layer's linears, causal attention
    (QK^T and AV over half the square), both heads at the last position only."""
    layers = spec.num_layers
    linears = 2 * tokens * layers * layer_params(spec)
    attention = layers * 2 * 2 * spec.num_attention_heads * spec.head_dim * tokens * tokens // 2
    heads = 2 * spec.hidden_size * (spec.vocab_size + spec.audio_vocab_size)
    return linears + attention + heads
