"""FP8 decode's input kernel (workflow/engines/quant.py) against the torch ops it replaces,
`fp8.quantize(prologue(x))`: on the CPU under Triton's interpreter in float32, on CUDA in bf16 too."""

import pytest
import torch
import torch.nn.functional as F

from workflow import fp8
from workflow.engines import gemv, quant
from workflow.engines.linears import rms_norm

pytestmark = pytest.mark.skipif(not quant.available(), reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def same_or_next(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 codes alike, but for a few one e4m3 step apart: where the float32 norm's last bit (its
    sum's order, rsqrt against 1 / sqrt) moves a value across a rounding boundary."""
    assert got.dtype == want.dtype == torch.float8_e4m3fn and got.shape == want.shape
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    assert ((g == w) | ((g - w).abs() == 1)).all()
    assert (g == w).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_norm_then_quantize_rounds_like_torch(dtype, rows):
    """RMSNorm with its weight, then x / scale as e4m3: K over several programs, the last one partly
    filled; a scale that puts the largest values past 448 (saturated, not NaN)."""
    g = torch.Generator().manual_seed(rows)
    k = 2 * quant.BLOCK_K + 96
    x = (torch.randn(rows, k, generator=g) * 3).to(DEVICE, dtype)
    w = (torch.rand(k, generator=g) + 0.5).to(DEVICE, dtype)
    scale = torch.tensor([0.006], device=DEVICE)
    got = quant.quantize(x, scale, norm=w, eps=1e-6)
    want = fp8.quantize(rms_norm(x, w, 1e-6), scale)
    same_or_next(got, want)
    assert got.float().abs().max() == fp8.FP8_MAX and not got.float().isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_then_quantize_reads_gate_and_up(dtype):
    """x = [gate | up]: silu(gate) * up, each rounded to x's dtype as torch's ops round, then quantized."""
    g = torch.Generator().manual_seed(7)
    k = quant.BLOCK_K + 40
    x = torch.randn(4, 2 * k, generator=g).to(DEVICE, dtype)
    scale = torch.tensor([0.01], device=DEVICE)
    got = quant.quantize(x, scale, silu_mul=True)
    gate, up = x.chunk(2, dim=-1)
    same_or_next(got, fp8.quantize(F.silu(gate) * up, scale))
    swapped = fp8.quantize(F.silu(up) * gate, scale)  # halves read the other way round
    assert (got.view(torch.uint8) != swapped.view(torch.uint8)).float().mean() > 0.5


def test_plain_quantize_keeps_leading_dims():
    x = torch.randn(2, 1, 300, device=DEVICE)
    scale = torch.tensor([0.02], device=DEVICE)
    got = quant.quantize(x, scale)
    assert got.shape == (2, 1, 300)
    same_or_next(got, fp8.quantize(x, scale))


def test_refuses_what_it_cannot_do():
    scale = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="do not combine"):
        quant.quantize(torch.randn(1, 16, device=DEVICE), scale, norm=torch.ones(8, device=DEVICE), silu_mul=True)
    with pytest.raises(ValueError, match=f"at most {gemv.MAX_M} rows"):
        quant.quantize(torch.randn(gemv.MAX_M + 1, 16, device=DEVICE), scale)
