"""The slot pass's transformer blocks (slots.py) in five Triton kernels, for CUDA (Triton's interpreter
runs them on the CPU in the tests).

Why: at batch 1 an ODE step is bound by how many kernels it launches, ~3.5 us each even from a CUDA
graph (docs/levers.md, "H100 codec 3" and "H100 codec 4"), and the slot pass's transformer block,
56 of them a step, launched about ten: LayerNorm, the q/k/v GEMM, the pool's write and gather, SDPA
and the copies around it, the out GEMM, the residual, LayerNorm, the two feed-forward GEMMs. Here:

1. LayerNorm (norm1) and the q/k/v GEMM: q to a buffer, k and v straight into the pool frames the
   call writes (`SlotIndex.writes`);
2. attention: a program per (row, head, block of queries) reads its keys and values from the pool
   through the row's key index (`SlotIndex.keys`), under its chunk mask computed in place (query
   frame start + i sees key j < its chunk's end and < the row's valid end: `slots.row_bias`), with
   an online softmax over blocks of keys, stopping at the last key its queries may see;
3. the out projection, its bias and the residual;
4. LayerNorm (norm3), the feed-forward's first GEMM and its exact GELU;
5. the feed-forward's second GEMM, its bias and the residual.

Each result is rounded to the activations' dtype where the torch path rounds it (LayerNorm's output,
a GEMM's output with its bias, the GELU, the residual sum), so the two agree to that rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path runs without it
    triton = None


@dataclass(frozen=True)
class Tile:
    """A launch's blocking: rows (bm), columns (bn) and reduction (bk) a program, warps, pipeline stages."""

    bm: int = 16
    bn: int = 128
    bk: int = 64
    warps: int = 4
    stages: int = 3


BLOCK_KEYS, ATTENTION_WARPS = 128, 4  # attention: keys a step of a program's loop


def available() -> bool:
    return triton is not None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _linear(
        x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, g_ptr, be_ptr, pool_ptr, wr_ptr, M, eps,
        N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        NORM: tl.constexpr, BIAS: tl.constexpr, GELU: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """y = [GELU](LayerNorm?(x) @ w.T + b) [+ r] over x [M, K], w [N, K]. SPLIT > 0: columns < SPLIT
        go to y [M, SPLIT], the rest to the pool's frame wr[m] (N - SPLIT values a frame). NORM: the
        whole row in one block (BK >= K)."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        m_ok, n_ok = m < M, n < N
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), tl.float32)
        if NORM:  # the whole row in one block (BK >= K): its mean and variance, then the GEMM
            k = tl.arange(0, BK)
            k_ok = k < K
            x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=1) / K
            xc = tl.where(k_ok[None, :], x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / K + eps)
            gamma = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            beta = tl.load(be_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            xn = (xc * rstd[:, None] * gamma[None, :] + beta[None, :]).to(dt)
            w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(xn, w, acc, input_precision=PRECISION)
        else:
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                k_ok = k < K
                x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt)
        if GELU:
            f = y.to(tl.float32)
            y = (0.5 * f * (1.0 + tl.math.erf(f * 0.7071067811865476))).to(dt)
        ok = m_ok[:, None] & n_ok[None, :]
        if RES:
            y = (y.to(tl.float32) + tl.load(r_ptr + m[:, None] * N + n[None, :], mask=ok, other=0.0).to(tl.float32)).to(dt)
        if SPLIT > 0:
            tl.store(y_ptr + m[:, None] * SPLIT + n[None, :], y, mask=ok & (n < SPLIT)[None, :])
            frame = tl.load(wr_ptr + m, mask=m_ok, other=0)
            at = pool_ptr + frame[:, None] * (N - SPLIT) + (n - SPLIT)[None, :]
            tl.store(at, y, mask=ok & (n >= SPLIT)[None, :])
        else:
            tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=ok)

    @triton.jit
    def _keys(q, kv, keys, j0, hi, sees, scale, m_i, l_i, acc, inner: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
              BK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        """One block of keys j0 .. j0 + BK (those < hi) into the online softmax of q [BQ, DP]: key j's k
        at kv + keys[j] * 2 * inner, its v `inner` values on; query i sees keys j < sees[i]."""
        d = tl.arange(0, DP)
        d_ok = d < D
        j = j0 + tl.arange(0, BK)
        j_ok = j < hi
        frame = tl.load(keys + j, mask=j_ok, other=0)
        kt = tl.load(kv + frame[None, :] * (2 * inner) + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        ok = j_ok[None, :] & (j[None, :] < sees[:, None])
        s = tl.where(ok, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(ok, tl.exp2(s - m_new[:, None]), 0.0)
        v = tl.load(kv + frame[:, None] * (2 * inner) + inner + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc

    @triton.jit
    def _attention(
        q_ptr, pool_ptr, keys_ptr, starts_ptr, valid_ptr, y_ptr, Q, KEYS, scale,
        H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CHUNK: tl.constexpr,
        BQ: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, STOP: tl.constexpr, KMAX: tl.constexpr,
    ):  # fmt: skip
        """y [R * Q, H * D] of q [R * Q, H * D] against each row's keys: pool frame keys[r, j] holds
        key j's k (its first H * D values) and v (the next H * D). STOP: the loop ends at the last key
        the program's queries see, else (Triton's interpreter, which cannot loop to a bound it did not
        get as a constant) over all KMAX keys, the later ones masked."""
        r, h = tl.program_id(0), tl.program_id(1)
        i = tl.program_id(2) * BQ + tl.arange(0, BQ)
        d = tl.arange(0, DP)
        i_ok, d_ok = i < Q, d < D
        inner: tl.constexpr = H * D
        q = tl.load(q_ptr + (r * Q + i)[:, None] * inner + h * D + d[None, :], mask=i_ok[:, None] & d_ok[None, :], other=0.0)
        start = tl.load(starts_ptr + r)
        end = start + tl.load(valid_ptr + r)
        sees = tl.minimum(((start + i) // CHUNK + 1) * CHUNK, end)  # each query's keys: j < sees
        last = tl.minimum(tl.program_id(2) * BQ + BQ, Q) - 1
        hi = tl.minimum(tl.minimum(((start + last) // CHUNK + 1) * CHUNK, end), KEYS).to(tl.int32)
        m_i = tl.zeros((BQ,), tl.float32) - 1.0e30
        l_i = tl.zeros((BQ,), tl.float32)
        acc = tl.zeros((BQ, DP), tl.float32)
        keys, kv = keys_ptr + r * KEYS, pool_ptr + h * D
        if STOP:
            for j0 in range(0, hi, BK):
                m_i, l_i, acc = _keys(q, kv, keys, j0, hi, sees, scale, m_i, l_i, acc, inner, D, DP, BK, PRECISION)
        else:
            for j0 in range(0, KMAX, BK):
                m_i, l_i, acc = _keys(q, kv, keys, j0, hi, sees, scale, m_i, l_i, acc, inner, D, DP, BK, PRECISION)
        y = acc / l_i[:, None]
        out = y_ptr + (r * Q + i)[:, None] * inner + h * D + d[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _conv(
        x_ptr, t_ptr, w_ptr, b_ptr, g_ptr, be_ptr, a_ptr, rx_ptr, rw_ptr, rb_ptr, y_ptr, kept_ptr, valid_ptr,
        M, Q, t_stride, eps,
        CIN: tl.constexpr, RIN: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
        ADD: tl.constexpr, RES: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """y [M = R * Q, N] = Mish(LayerNorm(conv(x) + b)) [+ a[r]] [+ rx @ rw.T + rb]: conv, a causal
        convolution (k = 3, weight [N, CIN, 3]) over row r's frames [its 2 tail frames | x's Q frames],
        x1 frame v being tail frame v (v < 2) or x frame v - 2; it also writes x1 frames valid[r] and
        valid[r] + 1 (the row's last two valid input frames, its next call's tail) to kept [R, 2, CIN]."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.arange(0, NP)
        m_ok, n_ok = m < M, n < N
        r, t = m // Q, m % Q
        valid = tl.load(valid_ptr + r, mask=m_ok, other=0)
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BM, NP), tl.float32)
        for j in tl.static_range(3):
            v = t + j
            from_x = (v >= 2)[:, None]
            keep = m_ok & (v >= valid) & (v < valid + 2)
            for c0 in range(0, CIN, BK):
                c = c0 + tl.arange(0, BK)
                ok = m_ok[:, None] & (c < CIN)[None, :]
                at = tl.where(from_x, x_ptr + (r * Q + v - 2)[:, None] * CIN, t_ptr + r[:, None] * t_stride + v[:, None] * CIN)
                xa = tl.load(at + c[None, :], mask=ok, other=0.0)
                tl.store(kept_ptr + (r * 2 + v - valid)[:, None] * CIN + c[None, :], xa, mask=ok & keep[:, None])
                w = tl.load(
                    w_ptr + n[None, :] * (CIN * 3) + c[:, None] * 3 + j, mask=n_ok[None, :] & (c < CIN)[:, None], other=0.0
                )
                acc = tl.dot(xa, w, acc, input_precision=PRECISION)
        y = (acc + tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        mean = tl.sum(tl.where(n_ok[None, :], y, 0.0), axis=1) / N
        yc = tl.where(n_ok[None, :], y - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(yc * yc, axis=1) / N + eps)
        gamma = tl.load(g_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        beta = tl.load(be_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        y = (yc * rstd[:, None] * gamma[None, :] + beta[None, :]).to(dt).to(tl.float32)
        soft = tl.where(y > 20.0, y, tl.log(1.0 + tl.exp(tl.minimum(y, 20.0))))  # softplus, torch's threshold
        e = tl.exp(-2.0 * soft)
        y = (y * (1.0 - e) / (1.0 + e)).to(dt)  # Mish: y tanh(softplus(y)), softplus >= 0
        ok = m_ok[:, None] & n_ok[None, :]
        if ADD:
            y = (y.to(tl.float32) + tl.load(a_ptr + r[:, None] * N + n[None, :], mask=ok, other=0.0).to(tl.float32)).to(dt)
        if RES:  # the resnet's 1x1 convolution of its input, added
            acc = tl.zeros((BM, NP), tl.float32)
            for c0 in range(0, RIN, BK):
                c = c0 + tl.arange(0, BK)
                xr = tl.load(rx_ptr + m[:, None] * RIN + c[None, :], mask=m_ok[:, None] & (c < RIN)[None, :], other=0.0)
                wr = tl.load(rw_ptr + n[None, :] * RIN + c[:, None], mask=n_ok[None, :] & (c < RIN)[:, None], other=0.0)
                acc = tl.dot(xr, wr, acc, input_precision=PRECISION)
            res = (acc + tl.load(rb_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt)
            y = (y.to(tl.float32) + res.to(tl.float32)).to(dt)
        tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=ok)


def _precision(x: Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def tile(m: int, n: int, k: int, norm: bool) -> Tile:
    """The blocking for x [m, k] @ w [n, k].T (norm: the whole row of k in one block, unpipelined):
    small blocks while the rows are few, so more programs share the work, as the fastest blockings
    timed on an H100 at the true shape's GEMMs (docs/levers.md, "H100 codec 6")."""
    if norm:
        return Tile(16, min(64, _pow2(n)), _pow2(k), 4, 1) if m <= 256 else Tile(64, min(128, _pow2(n)), _pow2(k), 4, 1)
    bm, bn = (16, 32) if m <= 256 else (64, 32) if m <= 1024 else (64, 128)
    return Tile(bm, min(bn, _pow2(n)), min(128, _pow2(k)), 4, 3)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm: torch.nn.LayerNorm | None = None, gelu: bool = False,
    residual: Tensor | None = None, pool: Tensor | None = None, writes: Tensor | None = None, blocking: Tile | None = None,
) -> Tensor:  # fmt: skip
    """x [M, K] -> [M, N]: LayerNorm `norm` first, then x @ weight.T + bias, then GELU, then + residual.
    With `pool` and `writes` [M]: only the first N - (pool's frame width) columns are returned, the rest
    go to pool frame writes[m] (flat index into the pool's first dimension)."""
    m, k = x.shape
    n = weight.shape[0]
    split = n - pool[0].numel() if pool is not None else 0
    y = x.new_empty(m, split or n)
    blk = blocking or tile(m, n, k, norm is not None)
    grid = (triton.cdiv(m, blk.bm), triton.cdiv(n, blk.bn))
    dummy = weight
    _linear[grid](
        x, weight, bias if bias is not None else dummy, residual if residual is not None else dummy, y,
        norm.weight if norm is not None else dummy, norm.bias if norm is not None else dummy,
        pool if pool is not None else dummy, writes if writes is not None else dummy, m,
        norm.eps if norm is not None else 0.0, N=n, K=k, BM=blk.bm, BN=blk.bn, BK=blk.bk, NORM=norm is not None,
        BIAS=bias is not None, GELU=gelu, RES=residual is not None, SPLIT=split, PRECISION=_precision(x),
        num_warps=blk.warps, num_stages=blk.stages,
    )  # fmt: skip
    return y


def attention(
    q: Tensor, pool: Tensor, keys: Tensor, starts: Tensor, valid: Tensor, chunk: int,
    bq: int = 0, bk: int = BLOCK_KEYS, warps: int = ATTENTION_WARPS,
) -> Tensor:  # fmt: skip
    """q [R, Q, H, D]; pool [frames, 2, H, D]; keys [R, K] (pool frames), starts and valid [R] -> [R, Q, H * D].
    bq: queries a program (0: 16 for a few rows, 64 for many, the faster on an H100)."""
    r, nq, h, d = q.shape
    bq = bq or (16 if r * nq <= 256 else 64)
    y = q.new_empty(r, nq, h * d)
    grid = (r, h, triton.cdiv(nq, bq))
    _attention[grid](
        q, pool, keys, starts, valid, y, nq, keys.shape[1], d**-0.5 * 1.4426950408889634, H=h, D=d, DP=_pow2(d),
        CHUNK=chunk, BQ=bq, BK=bk, PRECISION=_precision(q),
        STOP=q.is_cuda, KMAX=0 if q.is_cuda else keys.shape[1], num_warps=warps,
    )  # fmt: skip
    return y


def block(
    b: torch.nn.Module, h: Tensor, pool: Tensor, keys: Tensor, writes: Tensor, starts: Tensor, valid: Tensor, chunk: int
) -> Tensor:
    """A TransformerBlock (estimator.py) over h [R, Q, C], as slots.SlotPass.transformer computes it:
    the new keys and values written to pool frames `writes` [R, Q], every key read from pool frames `keys`."""
    r, nq, c = h.shape
    a, ff = b.attn1, b.ff.net
    x = h.reshape(r * nq, c).contiguous()
    q = linear(x, a.qkv.weight, norm=b.norm1, pool=pool, writes=writes.reshape(-1))
    y = attention(q.view(r, nq, a.heads, -1), pool, keys, starts, valid, chunk)
    h = linear(y.view(r * nq, -1), a.to_out[0].weight, a.to_out[0].bias, residual=x)
    g = linear(h, ff[0].proj.weight, ff[0].proj.bias, norm=b.norm3, gelu=True)
    return linear(g, ff[2].weight, ff[2].bias, residual=h).view(r, nq, c)


def conv_block(
    conv: torch.nn.Conv1d, norm: torch.nn.LayerNorm, x: Tensor, tail: Tensor, valid: Tensor,
    add: Tensor | None = None, res: tuple[torch.nn.Conv1d, Tensor] | None = None, bm: int = 0, bk: int = 64, warps: int = 4,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """A CausalBlock1D (k = 3 causal convolution, LayerNorm, Mish) over x [R, Q, C_in] after its left
    context `tail` [R, 2, C_in] (frames and channels contiguous), then + add [R, N] per row, then +
    res's 1x1 convolution of its input [R, Q, C_res] -> (y [R, Q, N], the row's last two valid input
    frames [R, 2, C_in]: its next call's tail)."""
    r, q, cin = x.shape
    n = conv.out_channels
    if conv.kernel_size[0] != 3 or tail.shape[1:] != (2, cin) or tail.stride(2) != 1 or tail.stride(1) != cin:
        raise ValueError(
            f"conv_block: a k=3 convolution after a [R, 2, {cin}] tail, got {conv.kernel_size} and {tuple(tail.shape)}"
        )
    x = x.contiguous()
    y, kept = x.new_empty(r, q, n), x.new_empty(r, 2, cin)
    rconv, rx = res if res is not None else (conv, x)
    rx = rx.contiguous()
    bm = bm or (16 if r * q <= 1024 else 64)
    _conv[(triton.cdiv(r * q, bm),)](
        x, tail, conv.weight, conv.bias, norm.weight, norm.bias, add if add is not None else x, rx, rconv.weight,
        rconv.bias, y, kept, valid, r * q, q, tail.stride(0), norm.eps, CIN=cin, RIN=rx.shape[-1], N=n, NP=_pow2(n),
        BM=bm, BK=bk, ADD=add is not None, RES=res is not None, PRECISION=_precision(x), num_warps=warps,
    )  # fmt: skip
    return y, kept


def resnet(
    r: torch.nn.Module, x: Tensor, temb: Tensor, tails: tuple[Tensor, Tensor], valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """slots.resnet (a CausalResnetBlock1D against its convolutions' tails) in two kernels, and the time
    embedding's projection: (out, each convolution's next tail)."""
    (c1, _, n1), (c2, _, n2) = r.block1.block, r.block2.block
    add = torch.nn.functional.linear(temb, r.mlp[1].weight, r.mlp[1].bias)
    h, kept1 = conv_block(c1, n1, x, tails[0], valid, add=add)
    out, kept2 = conv_block(c2, n2, h, tails[1], valid, res=(r.res_conv, x))
    return out, kept1, kept2
