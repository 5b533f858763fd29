"""The FP8 linear's GEMM path (torch._scaled_mm, CUDA's path; it runs on the CPU too) against
exact arithmetic on the same FP8 numbers."""

import pytest
import torch

from workflow import fp8
from workflow.engines.linears import Fp8Linear, linear


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fused_parts_in_one_gemm_keep_their_own_scales(fast_accum):
    """fc|gate fused: one GEMM at fc's scale, the gate half rescaled to its own scale, equals
    fp8(x/a)*a @ (fp8(W)*w_part)^T to bf16 rounding (twice for the rescaled half)."""
    torch.manual_seed(0)
    k, n, rows = 64, 48, 16
    ws, a = torch.tensor([0.004, 0.011]), torch.tensor([0.02])
    w = torch.randn(n, k)
    w8 = torch.cat([fp8.quantize(w[: n // 2], ws[:1]), fp8.quantize(w[n // 2 :], ws[1:])])
    lin = Fp8Linear(w8, ws, a, torch.bfloat16, fast_accum)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    got = linear(x, lin.gemm_args()).double()
    exact = (fp8.quantize(x, a).double() * a.item()) @ (w8.double() * lin.row_scale().double()).t()
    assert got.dtype == torch.float64 and got.shape == (rows, n)
    ulp = exact.abs() * 2**-8 + 1e-6
    assert ((got - exact).abs() <= 2 * ulp).all()
    # the gate half really is rescaled: at fc's scale it would be off by 0.011 / 0.004
    assert ((got[:, n // 2 :] - exact[:, n // 2 :] * ws[0] / ws[1]).abs() > 10 * ulp[:, n // 2 :]).any()


def test_gemm_path_pads_rows_and_keeps_the_leading_shape():
    """Rows not a multiple of 16 (cuBLASLt's FP8 GEMM wants that) are padded, then cut off."""
    torch.manual_seed(1)
    k, n = 32, 16
    ws, a = torch.tensor([0.01]), torch.tensor([0.03])
    w8 = fp8.quantize(torch.randn(n, k), ws)
    lin = Fp8Linear(w8, ws, a, torch.bfloat16)
    x = torch.randn(1, 5, k, dtype=torch.bfloat16)
    got = linear(x, lin.gemm_args())
    assert got.shape == (1, 5, n) and got.dtype == torch.bfloat16
    exact = (fp8.quantize(x, a).double() * a.item()) @ (w8.double() * ws.item()).t()
    assert torch.allclose(got.double(), exact, rtol=2**-7, atol=1e-6)
    assert lin.part_scale is None  # one part: no rescaling
