"""HiFT's Snake activation (hift.Snake) with the convolution's bias and the residual sum around it, in one
Triton kernel (`snake`, `residual_snake`), for CUDA (Triton's interpreter runs it on the CPU in the tests).

Why: torch launches six kernels for a Snake (its multiply, sine, square, the alpha's epsilon, division
and sum) and one more for the bias, and a ResBlock step is bound by how many it launches."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path runs without it
    triton = None

BLOCK = 1024  # values a program

if triton is not None:

    @triton.jit
    def _snake(
        x_ptr,
        b_ptr,
        r_ptr,
        a_ptr,
        s_ptr,
        y_ptr,
        n,
        C,
        CSTRIDE,
        BIAS: tl.constexpr,
        RESIDUAL: tl.constexpr,
        SNAKE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Over x (flat, its channel c = i // CSTRIDE % C): s = x (+ b[c]) (+ r), stored where RESIDUAL;
        y = s + sin(a s)^2 / (a + 1e-9), a [C], stored where SNAKE. HiFT's Snake, and the convolution's bias
        and the residual sum before it, in one pass. The sums go in torch's order (the bias, then the residual),
        in float32 whatever the tensors' dtypes; each store rounds to its tensor's."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        c = (i // CSTRIDE) % C
        x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
        if BIAS:
            x = x + tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
        if RESIDUAL:
            x = tl.load(r_ptr + i, mask=ok, other=0.0).to(tl.float32) + x
            tl.store(s_ptr + i, x, mask=ok)
        if SNAKE:
            a = tl.load(a_ptr + c, mask=ok, other=1.0)
            sn = tl.sin(a * x)
            tl.store(y_ptr + i, x + sn * sn / (a + 1e-9), mask=ok)


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """HiFT's Snake (hift.Snake) over x [B, C, T] or [B, C, 1, T] channels-last (`hift.rows`), a convolution's
    bias [C] added first, in one kernel where torch launches six (its multiply, sine, square, the alpha's
    epsilon, division and sum) and the bias one more; its output in `dtype` (default x's): the next
    convolution's."""
    return _elementwise(x, alpha, bias, None, dtype)[1]


def residual_snake(
    x: Tensor, bias: Tensor, residual: Tensor, alpha: Tensor | None, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor | None]:
    """A ResBlock's step end: s = residual + (x + bias) (x a convolution's output without its bias [C]) and
    the next step's Snake of s (None where `alpha` is None), in one pass where torch makes three (bias, sum,
    then the Snake's one kernel) -> (s, snake(s)); s in float32 (the residual sum, whatever x's dtype), the
    Snake in `dtype` (default x's)."""
    return _elementwise(x, alpha, bias, residual, dtype)


def _elementwise(
    x: Tensor, alpha: Tensor | None, bias: Tensor | None, residual: Tensor | None, dtype: torch.dtype | None
) -> tuple:
    """The kernel over x as laid out: contiguous, or [B, C, 1, T] channels-last (its channels innermost);
    the outputs and the residual in x's layout."""
    if not (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        x = x.contiguous()
    s = torch.empty_like(x, dtype=torch.float32) if residual is not None else None
    y = torch.empty_like(x, dtype=dtype or x.dtype) if alpha is not None else None
    r = residual
    if residual is not None and residual.stride() != x.stride():
        r = torch.empty_like(x, dtype=residual.dtype).copy_(residual)
    n = x.numel()
    _snake[(triton.cdiv(n, BLOCK),)](
        x, x if bias is None else bias, x if r is None else r, x if alpha is None else alpha,
        x if s is None else s, x if y is None else y, n, x.shape[1], x.stride(1),
        BIAS=bias is not None, RESIDUAL=r is not None, SNAKE=alpha is not None, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return s, y
