"""The slot pass's resnet blocks (slots.resnet) in two Triton kernels where the compiled pass launches
about nine (its convolutions' windows, GEMMs, LayerNorms, Mish, the time input, the 1x1 residual, the
new tails), for CUDA (Triton's interpreter runs them on the CPU in the tests); `benchmark.codec.resnet_kernel`.

Why: at one stream an ODE step is its launch chain (~3.2 us a kernel on an H200: docs/levers.md, "H200
codec step"), and its 14 resnets are ~125 of its ~490 kernels. Each kernel holds a program's frames
whole (every output channel, for the LayerNorm) and reads the causal convolution's window from the
slot's kept frames (`SlotView.tail`) for the first two, from the call's frames after:

1. h = Mish(LayerNorm1(conv1([tail1 | x]))) + time;
2. out = Mish(LayerNorm2(conv2([tail2 | h]))) + res_conv(x), and each row's new tails, the last two
   valid frames of [tail1 | x] and of [tail2 | h] (`slots.tail_at`), written by the row's first program.

Each result is rounded to the activations' dtype where the eager pass rounds it."""

from __future__ import annotations

from torch import Tensor

from workflow.codec.estimator import CausalResnetBlock1D
from workflow.codec.kernels import Tile, _launch, _pow2, _precision, whole_rows_tile

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path runs without it
    triton = None

LEFT = 2  # a causal convolution's left context (kernel 3): the kernels' literal 2

if triton is not None:
    from workflow.codec.kernels import layernorm

    @triton.jit
    def _mish(x):
        """x tanh(softplus(x)) in float32, softplus as torch's (x itself past 20)."""
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        e = tl.exp(-2.0 * sp)  # softplus >= 0: tanh(sp) = (1 - e) / (1 + e), no overflow
        return x * (1.0 - e) / (1.0 + e)

    @triton.jit
    def _block(
        in_ptr, tail_ptr, w_ptr, b_ptr, g_ptr, be_ptr, Q, TAIL_STRIDE, eps,
        CI: tl.constexpr, CO: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
        PRECISION: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        """A causal block, Mish(LayerNorm(conv(window))), over the program's BM frames t of row r, in float32
        (the conv's output, its norm and the Mish each rounded to the activations' dtype) -> (it, r, t, co):
        frame t's window is [tail | in] frames t .. t + 2, the row's tail (2 frames, rows TAIL_STRIDE apart)
        before its Q frames of `in`; w [CO, CI, 3]."""
        r = tl.program_id(0)
        t = tl.program_id(1) * BM + tl.arange(0, BM)
        co = tl.arange(0, CP)
        t_ok, co_ok = t < Q, co < CO
        dt = in_ptr.dtype.element_ty
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BM, CP), tl.float32)
        for k in range(3):
            j = t + k  # in [tail | in]
            from_tail, from_in = t_ok & (j < 2), t_ok & (j >= 2)
            for c0 in range(0, CI, BK):
                ci = c0 + tl.arange(0, BK)
                ci_ok = ci < CI
                a = tl.load(tail_ptr + r * TAIL_STRIDE + j[:, None] * CI + ci[None, :],
                            mask=from_tail[:, None] & ci_ok[None, :], other=0.0).to(dt)  # fmt: skip
                a += tl.load(in_ptr + (r * Q + j - 2)[:, None] * CI + ci[None, :],
                             mask=from_in[:, None] & ci_ok[None, :], other=0.0)  # fmt: skip
                w = tl.load(w_ptr + co[None, :] * (CI * 3) + ci[:, None] * 3 + k, mask=co_ok[None, :] & ci_ok[:, None], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
        acc += tl.load(b_ptr + co, mask=co_ok, other=0.0).to(tl.float32)[None, :]
        h = layernorm(acc.to(dt).to(tl.float32), co, co_ok, CO, g_ptr, be_ptr, eps).to(dt).to(tl.float32)
        return _mish(h).to(dt).to(tl.float32), r, t, co

    @triton.jit
    def _first(
        x_ptr, tail_ptr, w_ptr, b_ptr, g_ptr, be_ptr, time_ptr, h_ptr, Q, TAIL_STRIDE, TIME_STRIDE, eps,
        CI: tl.constexpr, CO: tl.constexpr, CP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
        PRECISION: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        """h = Mish(LayerNorm1(conv1([tail1 | x]))) + time[r] over a program's BM frames of row r."""
        h, r, t, co = _block(x_ptr, tail_ptr, w_ptr, b_ptr, g_ptr, be_ptr, Q, TAIL_STRIDE, eps, CI, CO, CP, BM, BK,
                             PRECISION, GDC)  # fmt: skip
        h += tl.load(time_ptr + r * TIME_STRIDE + co, mask=co < CO, other=0.0).to(tl.float32)[None, :]
        tl.store(h_ptr + (r * Q + t)[:, None] * CO + co[None, :], h.to(x_ptr.dtype.element_ty),
                 mask=(t < Q)[:, None] & (co < CO)[None, :])  # fmt: skip

    @triton.jit
    def _second(
        x_ptr, tail1_ptr, h_ptr, tail2_ptr, w_ptr, b_ptr, g_ptr, be_ptr, wr_ptr, br_ptr, valid_ptr, out_ptr, kept1_ptr,
        kept2_ptr, Q, TAIL1_STRIDE, TAIL2_STRIDE, eps,
        CI: tl.constexpr, CO: tl.constexpr, CP: tl.constexpr, CIP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
        PRECISION: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        """out = Mish(LayerNorm2(conv2([tail2 | h]))) + res_conv(x) over a program's BM frames of row r; the
        row's first program also writes its new tails: frames valid[r] .. + 2 of [tail1 | x] and [tail2 | h]."""
        y, r, t, co = _block(h_ptr, tail2_ptr, w_ptr, b_ptr, g_ptr, be_ptr, Q, TAIL2_STRIDE, eps, CO, CO, CP, BM, BK,
                             PRECISION, GDC)  # fmt: skip
        t_ok, co_ok = t < Q, co < CO
        dt = x_ptr.dtype.element_ty
        res = tl.zeros((BM, CP), tl.float32)
        for c0 in range(0, CI, BK):
            ci = c0 + tl.arange(0, BK)
            ci_ok = ci < CI
            a = tl.load(x_ptr + (r * Q + t)[:, None] * CI + ci[None, :], mask=t_ok[:, None] & ci_ok[None, :], other=0.0)
            w = tl.load(wr_ptr + co[None, :] * CI + ci[:, None], mask=co_ok[None, :] & ci_ok[:, None], other=0.0)
            res = tl.dot(a, w, res, input_precision=PRECISION)
        res += tl.load(br_ptr + co, mask=co_ok, other=0.0).to(tl.float32)[None, :]
        y += res.to(dt).to(tl.float32)
        tl.store(out_ptr + (r * Q + t)[:, None] * CO + co[None, :], y.to(dt), mask=t_ok[:, None] & co_ok[None, :])
        if tl.program_id(1) == 0:
            v = tl.load(valid_ptr + r)
            ci = tl.arange(0, CIP)
            for i in range(2):
                j = v + i  # in [tail | x] and [tail | h]
                x1 = tl.load(tail1_ptr + r * TAIL1_STRIDE + j * CI + ci, mask=(ci < CI) & (j < 2), other=0.0).to(dt)
                x1 += tl.load(x_ptr + (r * Q + j - 2) * CI + ci, mask=(ci < CI) & (j >= 2), other=0.0)
                tl.store(kept1_ptr + (r * 2 + i) * CI + ci, x1, mask=ci < CI)
                h1 = tl.load(tail2_ptr + r * TAIL2_STRIDE + j * CO + co, mask=co_ok & (j < 2), other=0.0).to(dt)
                h1 += tl.load(h_ptr + (r * Q + j - 2) * CO + co, mask=co_ok & (j >= 2), other=0.0)
                tl.store(kept2_ptr + (r * 2 + i) * CO + co, h1, mask=co_ok)


def resnet(
    r: CausalResnetBlock1D, x: Tensor, time: Tensor, tails: tuple[Tensor, Tensor], valid: Tensor,
    blocking: Tile | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """slots.resnet in two kernels: x [R, Q, C_in], time [R or 1, C_out], tails ([R, 2, C_in], [R, 2, C_out],
    rows of each contiguous), valid [R] -> (out [R, Q, C_out], the two new tails)."""
    (c1, _, n1), (c2, _, n2) = r.block1.block, r.block2.block
    rows, q, ci = x.shape
    co = c1.out_channels
    blk = blocking or whole_rows_tile(rows * q, co)
    if blk.bn < co:
        raise ValueError(f"resnet: a program holds its frames whole, {co} channels, not {blk.bn}")
    for tail in tails:
        if tail.stride(2) != 1 or tail.stride(1) != tail.shape[2]:
            raise ValueError(f"resnet: each row's tail must be contiguous, got strides {tail.stride()}")
    x, time = x.contiguous(), time.contiguous()
    h, out = x.new_empty(rows, q, co), x.new_empty(rows, q, co)
    kept1, kept2 = x.new_empty(rows, LEFT, ci), x.new_empty(rows, LEFT, co)
    grid = (rows, triton.cdiv(q, blk.bm))
    consts = {"CI": ci, "CO": co, "CP": blk.bn, "BM": blk.bm, "BK": blk.bk, "PRECISION": _precision(x),
              "num_warps": blk.warps, "num_stages": blk.stages, **_launch(x)}  # fmt: skip
    time_stride = 0 if time.shape[0] == 1 else time.stride(0)
    _first[grid](x, tails[0], c1.weight, c1.bias, n1.weight, n1.bias, time, h, q, tails[0].stride(0), time_stride,
                 n1.eps, **consts)  # fmt: skip
    _second[grid](x, tails[0], h, tails[1], c2.weight, c2.bias, n2.weight, n2.bias, r.res_conv.weight, r.res_conv.bias,
                  valid, out, kept1, kept2, q, tails[0].stride(0), tails[1].stride(0), n2.eps,
                  CIP=_pow2(ci), **consts)  # fmt: skip
    return out, kept1, kept2
