"""FP8 decode's input in one kernel: a linear's prologue (RMSNorm, or silu(gate) * up) and x / scale
rounded to float8_e4m3fn, saturating at +-448 (`fp8.quantize(linears.prologue(x))`).

The FP8 GEMV reads x as stored (its tensor-core body multiplies e4m3 by e4m3), so x is quantized
before it. As torch ops that is a dozen small kernels (the norm's float32 cast, square, mean, rsqrt,
two products and their casts; the division, clamp and cast), three sites a layer. torch.compile fuses
them into the op before, and `linears.project` leaves them to it; but serving's decode graphs are
captured from the eager step (`ahead.capture`: a compile per shape costs seconds), where they cost an
FP8 step 1.6-2 ms on an H100 (docs/levers.md, probe 36). Each program here reads the few rows whole
for the norm (x is a few KB) and writes its block of columns, rounding where the torch ops round (the
GEMV's prologue, `gemv._input`). Without a GPU it runs under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from workflow.engines.gemv import MAX_M
from workflow.fp8 import FP8_MAX

try:
    import triton
    import triton.language as tl

    from workflow.engines.gemv import _input, _rstd
except ImportError:  # the engine works without it (engine.gemv: false)
    triton = None

BLOCK_K = 1024  # columns a program


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _quantize(x_ptr, norm_ptr, scale_ptr, y_ptr, M, eps, K: tl.constexpr, NORM: tl.constexpr,
                  SILU_MUL: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """y [M, K] = the prologue of x [M, K] (SILU_MUL: [M, 2K]) / scale, clamped, as e4m3."""
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        rstd = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:
            rstd = _rstd(x_ptr, rm, m_ok, eps, K, BLOCK_M, BLOCK_K)
        rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = _input(x_ptr, rm, rk, m_ok, k_ok, norm_ptr, rstd, K, NORM, SILU_MUL)
        q = tl.math.div_rn(x, tl.load(scale_ptr))
        q = _e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
        tl.store(y_ptr + rm[:, None] * K + rk[None, :], q.to(tl.float8e4nv), mask=m_ok[:, None] & k_ok[None, :])

    @triton.jit
    def _e4m3(q):
        """q (float32, |q| <= 448) rounded to the nearest e4m3 value, ties to even, as float32: its
        cast to e4m3 is then exact. (Triton's interpreter casts a value whose rounding carries into
        the exponent, 125.5, to 64; the GPU's cast would round right by itself.) Normal values
        keep 3 of float32's 23 mantissa bits; below 2^-6 the grid is subnormal, steps of 2^-9."""
        bits = q.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
        normal = bits.to(tl.float32, bitcast=True)
        sub = (q + 24576.0) - 24576.0  # 1.5 x 2^14: the sum's last bit is 2^-9
        return tl.where(tl.abs(q) < 0.015625, sub, normal)


def quantize(
    x: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False
) -> torch.Tensor:
    """x [..., K] (silu_mul: [..., 2K] = [gate | up]) -> float8_e4m3fn [..., K], at most gemv.MAX_M rows.
    Called on the eager path only (`linears.project`), so no op for torch.compile wraps it."""
    if norm is not None and silu_mul:
        raise ValueError("quantize: norm and silu_mul do not combine")
    shape = x.shape
    k = shape[-1] // (2 if silu_mul else 1)
    x = x.reshape(-1, shape[-1]).contiguous()
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"quantize: takes at most {MAX_M} rows (the GEMV's), got {m}")
    y = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    _quantize[(triton.cdiv(k, BLOCK_K),)](
        x, norm if norm is not None else x, scale.float().contiguous(), y, m, eps, K=k, NORM=norm is not None,
        SILU_MUL=silu_mul, FP8_MAX=FP8_MAX, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    return y.reshape(*shape[:-1], k)
