"""The slot pass's resnets (slots.resnet) in three Triton kernels and the time embedding's GEMM, for
CUDA (Triton's interpreter runs them on the CPU in the tests).

Why: at batch 1 an ODE step is bound by how many kernels it launches (kernels.py says so of the
transformer blocks), and a compiled resnet launched ~13: the left context's concatenations, the
windows' copies, three GEMMs, the fused LayerNorm + Mish + adds, the tails' gathers. A LayerNorm over
channels needs a whole row of the convolution's output, so a kernel that does GEMM and LayerNorm
together has one program a block of rows, too few to fill the GPU at a few rows (levers.md, "H100
codec 7": 22 us a convolution). Here each GEMM is split over its columns too, and the LayerNorm moves
to the kernel that reads the output:

1. conv1: the k = 3 causal convolution of [tail | x], its bias; per row and block of columns the
   output's mean and squared deviations (`_stats`), stored beside it;
2. conv2, its input made as it is read: Mish(LayerNorm(conv1's output)) + the time embedding's
   projection, the row's statistics combined from conv1's blocks (Chan's formula);
3. the 1x1 residual convolution of x, then + Mish(LayerNorm(conv2's output)).

Each convolution reads its weight as it lies ([N, C_in, 3]: the reduction runs over (channel, tap)
pairs, so a block of it is contiguous), and the programs of the first column block write the row's
next tails (its last two valid input frames) as they read them. Results are rounded where the torch
path rounds (a GEMM's output with its bias, LayerNorm's output, Mish, each sum)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from workflow.codec.kernels import Tile, _precision, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _mish(y):
        soft = tl.where(y > 20.0, y, tl.log(1.0 + tl.exp(tl.minimum(y, 20.0))))  # softplus, torch's threshold
        e = tl.exp(-2.0 * soft)
        return y * (1.0 - e) / (1.0 + e)  # y tanh(softplus(y)), softplus >= 0

    @triton.jit
    def _row_stats(s_ptr, rows, ok, NB: tl.constexpr, N: tl.constexpr, eps):
        """Mean and 1/std of whole rows of N values from their NB column blocks' (mean, squared deviations)
        at s [rows, NB, 2] (Chan's formula: blocks of N / NB values)."""
        b = tl.arange(0, NB)
        at = s_ptr + rows[:, None] * (NB * 2) + b[None, :] * 2
        ok2 = ok[:, None] & (b < NB)[None, :]
        means = tl.load(at, mask=ok2, other=0.0)
        m2 = tl.load(at + 1, mask=ok2, other=0.0)
        mean = tl.sum(means, axis=1) / NB
        dev = tl.where(ok2, means - mean[:, None], 0.0)
        var = (tl.sum(m2, axis=1) + (N // NB) * tl.sum(dev * dev, axis=1)) / N
        return mean, 1.0 / tl.sqrt(var + eps)

    @triton.jit
    def _conv(
        x_ptr, t_ptr, w_ptr, b_ptr, y_ptr, s_ptr, kept_ptr, valid_ptr, st_ptr, g_ptr, be_ptr, a_ptr,
        M, Q, t_stride, eps,
        CIN: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        PRO: tl.constexpr, SNB: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """y [M = R * Q, N] = conv(x1) + b and its block statistics s [M, N / BN, 2]: a causal convolution
        (k = 3, weight [N, CIN, 3]) over row r's input frames x1 = [tail t (2 frames) | x's Q frames].
        PRO: x holds the previous convolution's output, each input value is Mish(LayerNorm(x)) + a[r]
        (statistics st [M, SNB, 2], weight g, bias be); the tail is input as it is. The first column block's programs
        write the row's input frames valid[r] - 2 and valid[r] - 1 (counted from x's first) to kept [R, 2, CIN]."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        m_ok, n_ok = m < M, n < N
        r, t = m // Q, m % Q
        valid = tl.load(valid_ptr + r, mask=m_ok, other=0)
        dt = x_ptr.dtype.element_ty
        if PRO:  # the statistics of the three frames each output frame reads
            mean0, rstd0 = _row_stats(st_ptr, m - 2, m_ok & (t >= 2), SNB, CIN, eps)
            mean1, rstd1 = _row_stats(st_ptr, m - 1, m_ok & (t >= 1), SNB, CIN, eps)
            mean2, rstd2 = _row_stats(st_ptr, m, m_ok, SNB, CIN, eps)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, 3 * CIN, BK):
            kk = k0 + tl.arange(0, BK)
            c, j = kk // 3, kk % 3
            k_ok = kk < 3 * CIN
            u = t[:, None] + j[None, :] - 2  # the input frame, < 0 in the tail
            ok = m_ok[:, None] & k_ok[None, :]
            from_x = u >= 0
            xa = tl.load(x_ptr + (r[:, None] * Q + u) * CIN + c[None, :], mask=ok & from_x, other=0.0)
            ta = tl.load(t_ptr + r[:, None] * t_stride + (u + 2) * CIN + c[None, :], mask=ok & ~from_x, other=0.0)
            if PRO:
                jj = j[None, :]
                mean = tl.where(jj == 0, mean0[:, None], tl.where(jj == 1, mean1[:, None], mean2[:, None]))
                rstd = tl.where(jj == 0, rstd0[:, None], tl.where(jj == 1, rstd1[:, None], rstd2[:, None]))
                gamma = tl.load(g_ptr + c, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                beta = tl.load(be_ptr + c, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                yn = ((xa.to(tl.float32) - mean) * rstd * gamma + beta).to(dt).to(tl.float32)
                add = tl.load(a_ptr + r[:, None] * CIN + c[None, :], mask=ok, other=0.0).to(tl.float32)
                xa = (_mish(yn).to(dt).to(tl.float32) + add).to(dt)
            a = tl.where(from_x, xa, ta)
            once = ((j[None, :] == 2) & from_x) | ((j[None, :] == 0) & ~from_x)  # each input frame once
            keep = ok & once & (u >= valid[:, None] - 2) & (u < valid[:, None]) & (tl.program_id(1) == 0)
            tl.store(kept_ptr + (r[:, None] * 2 + u - valid[:, None] + 2) * CIN + c[None, :], a, mask=keep)
            w = tl.load(w_ptr + n[None, :] * (3 * CIN) + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        y = (acc + tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt)
        tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])
        f = y.to(tl.float32)
        mean = tl.sum(f, axis=1) / BN
        d = f - mean[:, None]
        at = s_ptr + m * (N // BN * 2) + tl.program_id(1) * 2
        tl.store(at, mean, mask=m_ok)
        tl.store(at + 1, tl.sum(d * d, axis=1), mask=m_ok)

    @triton.jit
    def _finish(
        x_ptr, w_ptr, b_ptr, y_ptr, st_ptr, g_ptr, be_ptr, o_ptr, M, eps,
        CIN: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        SNB: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """o [M, N] = Mish(LayerNorm(y)) + (x @ w.T + b): y [M, N] with its block statistics st [M, SNB, 2], x [M, CIN]."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        m_ok, n_ok = m < M, n < N
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, CIN, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < CIN
            x = tl.load(x_ptr + m[:, None] * CIN + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[None, :] * CIN + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        res = (acc + tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        ok = m_ok[:, None] & n_ok[None, :]
        mean, rstd = _row_stats(st_ptr, m, m_ok, SNB, N, eps)
        y = tl.load(y_ptr + m[:, None] * N + n[None, :], mask=ok, other=0.0).to(tl.float32)
        gamma = tl.load(g_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        beta = tl.load(be_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        yn = ((y - mean[:, None]) * rstd[:, None] * gamma + beta).to(dt).to(tl.float32)
        o = (_mish(yn).to(dt).to(tl.float32) + res).to(dt)
        tl.store(o_ptr + m[:, None] * N + n[None, :], o, mask=ok)


def tile(m: int) -> Tile:
    """The blocking of a resnet's GEMMs over m rows (columns split so that a few rows still make many
    programs; the statistics' blocks are the column blocks)."""
    return Tile(16, 32, 64, 4, 3) if m <= 256 else Tile(64, 32, 64, 4, 3) if m <= 1024 else Tile(64, 64, 64, 4, 3)


def conv(
    c: torch.nn.Conv1d, x: Tensor, tail: Tensor, valid: Tensor, blocking: Tile,
    pro: tuple[Tensor, torch.nn.LayerNorm, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """A k = 3 causal convolution over x [R, Q, C_in] after its left context `tail` [R, 2, C_in] (each
    frame's channels contiguous) -> (its output [R, Q, N] with bias, the output's block statistics
    [R * Q, N / bn, 2], the row's last two valid input frames [R, 2, C_in]). pro: (statistics, norm,
    add [R, C_in]): the input is Mish(norm(x)) + add, x the previous convolution's output."""
    r, q, cin = x.shape
    n = c.out_channels
    if c.kernel_size[0] != 3 or tail.shape[1:] != (2, cin) or tail.stride(2) != 1 or tail.stride(1) != cin:
        raise ValueError(
            f"resnets.conv: a k=3 convolution after a [R, 2, {cin}] tail, got {c.kernel_size} and {tuple(tail.shape)}"
        )
    blk = blocking
    nb = n // blk.bn
    y, stats, kept = x.new_empty(r, q, n), x.new_empty(r * q, nb, 2, dtype=torch.float32), x.new_empty(r, 2, cin)
    st, norm, add = pro if pro is not None else (stats, None, x)
    _conv[(triton.cdiv(r * q, blk.bm), nb)](
        x.contiguous(), tail, c.weight, c.bias, y, stats, kept, valid, st, norm.weight if norm else c.bias,
        norm.bias if norm else c.bias, add, r * q, q, tail.stride(0), norm.eps if norm else 0.0,
        CIN=cin, N=n, BM=blk.bm, BN=blk.bn, BK=blk.bk, PRO=pro is not None, SNB=st.shape[1],
        PRECISION=_precision(x), num_warps=blk.warps, num_stages=blk.stages,
    )  # fmt: skip
    return y, stats, kept


def resnet(
    r: torch.nn.Module, x: Tensor, temb: Tensor, tails: tuple[Tensor, Tensor], valid: Tensor, blocking: Tile | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """slots.resnet (a CausalResnetBlock1D over x [R, Q, C_in] after its convolutions' tails, temb the
    time embedding's Mish [R, 4C]) in three kernels and the time embedding's GEMM: (out [R, Q, C], each
    convolution's next tail)."""
    (c1, _, n1), (c2, _, n2) = r.block1.block, r.block2.block
    rows, q, cin = x.shape
    n = c1.out_channels
    blk = blocking or tile(rows * q)
    if n % blk.bn or (n // blk.bn) & (n // blk.bn - 1):
        raise ValueError(f"resnets: {n} channels in a power-of-two number of blocks of {blk.bn}")
    x = x.contiguous()
    add = F.linear(temb, r.mlp[1].weight, r.mlp[1].bias)
    y1, s1, kept1 = conv(c1, x, tails[0], valid, blk)
    y2, s2, kept2 = conv(c2, y1, tails[1], valid, blk, pro=(s1, n1, add))
    out = torch.empty_like(y2)
    res = r.res_conv
    _finish[(triton.cdiv(rows * q, blk.bm), n // blk.bn)](
        x, res.weight, res.bias, y2, s2, n2.weight, n2.bias, out, rows * q, n2.eps,
        CIN=cin, N=n, BM=blk.bm, BN=blk.bn, BK=blk.bk, SNB=s2.shape[1], PRECISION=_precision(x),
        num_warps=blk.warps, num_stages=blk.stages,
    )  # fmt: skip
    return out, kept1, kept2
