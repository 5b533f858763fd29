"""The linears of a decoder layer, bf16 or FP8, and the one way the engine applies them.

`project` is a layer's matmul with what surrounds it: an RMSNorm or silu(gate) * up before,
a residual add after. For many rows (prefill, batched decode) that is torch ops around cuBLAS
(or torch._scaled_mm for the FP8 trunk); for a few rows, with `fused`, one call of our Triton
GEMV (workflow.engines.gemv). The checkpoint's fc (SiLU side) and gate (up) are fused into one
gate_up = [fc; gate] weight, FP8 scales kept per part: the GEMV applies each part's own; the
GEMM runs at fc's, and up's ratio to it is folded into proj's input quantization (`in_scale`),
since silu(fc) * (r * up) / a = silu(fc) * up / (a / r): no rescaling pass over gate_up's output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workflow import fp8
from workflow.engines import gemv, quant
from workflow.engines.blocks import Block, block_for


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary embedding (rotate halves): x [B, T, heads, d], cos/sin [T, d/2] or, a
    position per row, [B, T, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LinearArgs(NamedTuple):
    """A linear's tensors as `linear` and `project` take them. weight: bf16, FP8, or (CPU
    emulation) FP8 dequantized; a_scale: FP8's activation scale; w_scale: the GEMM's weight
    scale (a fused weight's first part's); fast_accum: cuBLASLt's FP8 fast accumulation;
    fp8_weight and out_scale (a_scale x w_scale per part): what the FP8 GEMV reads; in_scale:
    what the GEMM path divides x by before rounding it to FP8, where x arrives scaled otherwise
    than a_scale assumes (proj's, see `layer_linears`); blocks: the fused GEMV's launch shape
    for this linear's decode call, by row count (blocks.ROWS, tuned at build; none: gemv.default_block)."""

    weight: torch.Tensor
    a_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None
    fast_accum: bool = False
    fp8_weight: torch.Tensor | None = None
    out_scale: torch.Tensor | None = None
    in_scale: torch.Tensor | None = None
    blocks: dict[int, Block] | None = None


def linear(x: torch.Tensor, lin: LinearArgs) -> torch.Tensor:
    """x @ w^T, three ways. bf16: no a_scale. FP8 emulated exactly (CPU): weight is the
    dequantized weight, w_scale None, and x is rounded through FP8 with a_scale. FP8 on CUDA: one
    torch._scaled_mm over x / in_scale (a_scale unless given) rounded to FP8, rows padded to a
    multiple of 16 (cuBLASLt's FP8 GEMM wants that), at a_scale and w_scale; where two checkpoint
    tensors were fused (fc|gate), each keeping its own scale, the one GEMM runs at the first
    part's (one launch less than two; a row-wise-scaled GEMM is slower), and the output's other
    parts stay at that scale for the consumer to fold in (gate_up's up: proj's in_scale)."""
    if lin.a_scale is None:
        return F.linear(x, lin.weight)
    if lin.w_scale is None:
        return F.linear(fp8.fake_quant(x, lin.a_scale), lin.weight)
    shape, x = x.shape, x.reshape(-1, x.shape[-1])
    m, pad = x.shape[0], -x.shape[0] % 16
    in_scale = lin.a_scale if lin.in_scale is None else lin.in_scale
    xq = fp8.quantize(F.pad(x, (0, 0, 0, pad)) if pad else x, in_scale)
    y = torch._scaled_mm(
        xq, lin.weight.t(), scale_a=lin.a_scale, scale_b=lin.w_scale, out_dtype=x.dtype, use_fast_accum=lin.fast_accum
    )
    return y[:m].reshape(*shape[:-1], -1)


def project(
    x: torch.Tensor,
    lin: LinearArgs,
    fused: bool,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    glu: bool = False,
) -> torch.Tensor:
    """[residual +] linear(prologue(x)), the prologue one of: rms_norm with `norm`; with
    silu_mul, x = [gate | up] -> silu(gate) * up. With `fused` and few rows (decode), one GEMV
    kernel does it all; FP8 quantizes x first, the prologue with it (fused by compile; eager, one
    kernel: quant.py), unless x arrives quantized (float8: dense's input, from decode attention).
    glu (fused bf16 or float32 path only): lin is gate_up, and the output is silu(gate) * up."""
    if gemv_path(x, fused):
        block = block_for(lin.blocks, x.numel() // x.shape[-1])
        if lin.a_scale is None:
            return gemv.gemv(x, lin.weight, x.dtype, block, norm=norm, eps=eps, residual=residual, silu_mul=silu_mul, glu=glu)
        if glu:
            raise ValueError("project: glu is for bf16 / float32 weights")
        if x.dtype == torch.float8_e4m3fn:  # quantized where it was made (decode attention's output)
            return gemv.gemv(x, lin.fp8_weight, residual.dtype, block, scale=lin.out_scale, residual=residual)
        if torch.compiler.is_compiling():  # inductor fuses these ops into the op before: faster than a kernel of its own
            xq = fp8.quantize(prologue(x, norm, eps, silu_mul), lin.a_scale)
        else:  # eager, as serving's graphs run (ahead.capture): one kernel, not a dozen
            xq = quant.quantize(x, lin.a_scale, norm, eps, silu_mul)
        return gemv.gemv(xq, lin.fp8_weight, x.dtype, block, scale=lin.out_scale, residual=residual)
    if glu:
        raise ValueError("project: glu needs the fused GEMV path")
    y = linear(prologue(x, norm, eps, silu_mul), lin)
    return y if residual is None else residual + y


def gemv_path(x: torch.Tensor, fused: bool) -> bool:
    """Whether `project` takes x through the fused GEMV: fused asked for, few enough rows."""
    return fused and x.numel() // x.shape[-1] <= gemv.MAX_M


def prologue(x: torch.Tensor, norm: torch.Tensor | None, eps: float, silu_mul: bool) -> torch.Tensor:
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x if norm is None else rms_norm(x, norm, eps)


class Linear(nn.Module):
    """A bf16 (or float32) linear; `args()` is what `project` takes. `blocks`: its decode call's
    GEMV launch shape by row count, which the engine sets from its tuning."""

    blocks: dict[int, Block] | None = None

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def args(self) -> LinearArgs:
        return LinearArgs(self.weight, blocks=self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.args())


class Fp8Linear(Linear):
    """y = fp8(x / a) @ fp8(W)^T * a * w with calibrated static scales (see `linear`);
    w_scale has one entry per part of the rows (fc|gate: two; the GEMM path runs at the first's,
    see `layer_linears`); in_scale: what the GEMM path divides x by instead of a_scale (proj:
    a_scale / up's ratio)."""

    def __init__(
        self,
        weight: torch.Tensor,
        w_scale: torch.Tensor,
        a_scale: torch.Tensor,
        dtype: torch.dtype,
        fast_accum: bool = False,
        in_scale: torch.Tensor | None = None,
    ):
        nn.Module.__init__(self)
        self.fast_accum = fast_accum
        self.register_buffer("weight", weight)
        self.register_buffer("w_scale", w_scale.float().reshape(-1))
        self.register_buffer("a_scale", a_scale.float().reshape(1))
        self.register_buffer("in_scale", None if in_scale is None else in_scale.float().reshape(1))
        self.register_buffer("w_deq", None if weight.is_cuda else (weight.float() * self.row_scale()).to(dtype))
        self.register_buffer("out_scale", self.a_scale * self.w_scale)
        self.register_buffer("gemm_scale", self.w_scale[:1].clone())

    def row_scale(self) -> torch.Tensor:
        """[N, 1]: each output row's weight scale."""
        return self.w_scale.repeat_interleave(self.weight.shape[0] // self.w_scale.numel())[:, None]

    def args(self) -> LinearArgs:
        if self.w_deq is not None:  # CPU: exact emulation through the dequantized weight
            return LinearArgs(self.w_deq, self.a_scale, fp8_weight=self.weight, out_scale=self.out_scale, blocks=self.blocks)
        return self.gemm_args()

    def gemm_args(self) -> LinearArgs:
        """What the FP8 GEMM (torch._scaled_mm) reads: CUDA's path, also runnable on CPU."""
        return LinearArgs(
            self.weight, self.a_scale, self.gemm_scale, self.fast_accum, self.weight, self.out_scale, self.in_scale, self.blocks
        )


def layer_linears(
    tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, device: str, fast_accum: bool = False
) -> dict[str, nn.Module]:
    """The layer's linear modules; fc (SiLU side) and gate (up) fused as gate_up = [fc; gate].
    fast_accum: FP8 GEMMs accumulate the fast way (see EngineOptions)."""

    def weight(name: str) -> torch.Tensor:
        return tensors[f"{prefix}{name}.weight"].to(device)

    if tensors[f"{prefix}mlp.fc.weight"].dtype != torch.float8_e4m3fn:
        out = {n: Linear(weight(n).to(dtype)) for n in ("attention.qkv", "attention.dense", "mlp.proj")}
        out["mlp.gate_up"] = Linear(torch.cat([weight("mlp.fc"), weight("mlp.gate")]).to(dtype))
        return out

    def scales(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            tensors[f"{prefix}{name}.weights_scaling_factor"].to(device),
            tensors[f"{prefix}{name}.activation_scaling_factor"].to(device),
        )

    out = {n: Fp8Linear(weight(n), *scales(n), dtype, fast_accum) for n in ("attention.qkv", "attention.dense")}
    (w_fc, a_fc), (w_gate, a_gate) = scales("mlp.fc"), scales("mlp.gate")
    w_scale = torch.cat([w_fc.reshape(1), w_gate.reshape(1)])
    # fc and gate read the same input, so calibration gives them one activation amax;
    # should a checkpoint differ, the larger scale is the one that cannot overflow.
    gate_up = torch.cat([weight("mlp.fc"), weight("mlp.gate")])
    out["mlp.gate_up"] = Fp8Linear(gate_up, w_scale, torch.maximum(a_fc, a_gate), dtype, fast_accum)
    # the GEMM path's gate_up output has up at fc's scale, short of its own by r = w_gate / w_fc;
    # proj's input is silu(fc) * up, linear in up, so dividing it by a_proj / r restores it
    w_proj, a_proj = scales("mlp.proj")
    in_scale = a_proj.float() / (w_gate.float() / w_fc.float())
    out["mlp.proj"] = Fp8Linear(weight("mlp.proj"), w_proj, a_proj, dtype, fast_accum, in_scale=in_scale)
    return out
