"""The FP8 linear's GEMM path (torch._scaled_mm, CUDA's path; it runs on the CPU too) against
exact arithmetic on the same FP8 numbers."""

import pytest
import torch

from workflow import fp8
from workflow.engines.linears import Fp8Linear, LinearArgs, layer_linears, linear, project, prologue, rms_norm


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fused_parts_in_one_gemm_run_at_the_first_parts_scale(fast_accum):
    """fc|gate fused: one GEMM at fc's scale for every row, equal to fp8(x/a)*a @ (fp8(W)*w_fc)^T
    to bf16 rounding; the gate half is left at fc's scale (proj's in_scale folds its own in, see
    the MLP test below), not rescaled to its own."""
    torch.manual_seed(0)
    k, n, rows = 64, 48, 16
    ws, a = torch.tensor([0.004, 0.011]), torch.tensor([0.02])
    w = torch.randn(n, k)
    w8 = torch.cat([fp8.quantize(w[: n // 2], ws[:1]), fp8.quantize(w[n // 2 :], ws[1:])])
    lin = Fp8Linear(w8, ws, a, torch.bfloat16, fast_accum)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    got = linear(x, lin.gemm_args()).double()
    exact = (fp8.quantize(x, a).double() * a.item()) @ (w8.double() * ws[0].item()).t()
    assert got.dtype == torch.float64 and got.shape == (rows, n)
    ulp = exact.abs() * 2**-8 + 1e-6
    assert ((got - exact).abs() <= 2 * ulp).all()
    # the gate half really is at fc's scale: at its own it would be larger by 0.011 / 0.004
    own = exact[:, n // 2 :] * ws[1] / ws[0]
    assert ((got[:, n // 2 :] - own).abs() > 10 * ulp[:, n // 2 :]).any()


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
    assert torch.equal(lin.gemm_args().w_scale, ws.reshape(1)) and lin.gemm_args().in_scale is None  # its own scales


def test_mlp_gemm_path_folds_ups_scale_into_projs_input():
    """gate_up's GEMM leaves up at fc's scale and proj's quantization divides by a_proj / r
    instead: in float32 the MLP equals the exact emulation (every part at its own scale, proj's
    input at a_proj), and without the fold up would be short by r = w_gate / w_fc."""
    torch.manual_seed(2)
    d, f, rows = 64, 96, 16
    ws = {"attention.qkv": 1e-3, "attention.dense": 1e-3, "mlp.fc": 4e-4, "mlp.gate": 1.1e-3, "mlp.proj": 6e-4}
    shapes = {"attention.qkv": (3 * d, d), "attention.dense": (d, d), "mlp.fc": (f, d), "mlp.gate": (f, d), "mlp.proj": (d, f)}
    tensors = {}
    for name, (n, k) in shapes.items():
        tensors[f"l.{name}.weight"] = fp8.quantize(0.05 * torch.randn(n, k), torch.tensor(ws[name]))
        tensors[f"l.{name}.weights_scaling_factor"] = torch.tensor(ws[name])
        tensors[f"l.{name}.activation_scaling_factor"] = torch.tensor(3e-3 if name == "mlp.proj" else 0.02)
    lins = layer_linears(tensors, "l.", torch.float32, "cpu")
    gate_up, proj = lins["mlp.gate_up"], lins["mlp.proj"]
    assert torch.equal(gate_up.gemm_args().w_scale, torch.tensor([4e-4])) and torch.allclose(
        proj.in_scale, torch.tensor([3e-3 * 4 / 11])
    )
    h, norm = torch.randn(rows, d), 1 + 0.1 * torch.randn(d)

    def mlp(gu: LinearArgs, pj: LinearArgs) -> torch.Tensor:
        return project(project(h, gu, False, norm, 1e-6), pj, False, residual=h, silu_mul=True)

    exact = mlp(gate_up.args(), proj.args())  # the CPU's emulation: dequantized weights, proj at a_proj
    assert gate_up.args().w_scale is None and proj.args().in_scale is None
    got = mlp(gate_up.gemm_args(), proj.gemm_args())
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5)
    unfolded = mlp(gate_up.gemm_args(), proj.gemm_args()._replace(in_scale=None))
    act = prologue(project(h, gate_up.args(), False, norm, 1e-6), None, 0.0, True)  # proj's input
    assert (rms_norm(h, norm, 1e-6).abs().max() / 0.02 < fp8.FP8_MAX) and (act.abs().max() / 3e-3 < fp8.FP8_MAX)
    assert (unfolded - h).abs().mean() < 0.5 * (exact - h).abs().mean()  # up short by 4 / 11
