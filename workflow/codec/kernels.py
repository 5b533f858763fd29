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
a GEMM's output with its bias, the GELU, the residual sum), so the two agree to that rounding.

On Hopper and later they launch as programmatic dependent launches (`dependent_launch`): a GEMM
fetches its weights (which no kernel writes) before it waits for the kernel before it to finish, so
their latency hides behind that kernel. Nothing else (activations, the pool, the indices) is read or
written before the wait. A kernel lets the next launch only once its own wait is over: a next one
launched at once would let the one after it launch too, and a block's kernels would all sit waiting
on the SMs at once."""

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

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


BLOCK_KEYS, ATTENTION_WARPS = 128, 4  # attention: keys a step of a program's loop


def available() -> bool:
    return triton is not None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _linear(
        x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, g_ptr, be_ptr, pool_ptr, wr_ptr, ps_ptr, M, eps,
        N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        NORM: tl.constexpr, BIAS: tl.constexpr, GELU: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, GDC: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """y = [GELU](LayerNorm?(x) @ w.T + b) [+ r] over x [M, K], w [N, K]. SPLIT > 0: columns < SPLIT
        go to y [M, SPLIT], the rest to the pool's frame wr[m] (N - SPLIT values a frame); FP8: divided by
        ps [N - SPLIT] (the pool's scale, a frame's layout) and saturated to e4m3 first. NORM: the
        whole row in one block (BK >= K). GDC: a dependent launch (the weights fetched before the wait;
        without NORM, the program's weight rows into L2, LINES lines of LINE values each)."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        m_ok, n_ok = m < M, n < N
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), tl.float32)
        if NORM:  # the whole row in one block (BK >= K): its mean and variance, then the GEMM
            k = tl.arange(0, BK)
            k_ok = k < K
            w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            gamma = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            beta = tl.load(be_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if GDC:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=1) / K
            xc = tl.where(k_ok[None, :], x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / K + eps)
            xn = (xc * rstd[:, None] * gamma[None, :] + beta[None, :]).to(dt)
            acc = tl.dot(xn, w, acc, input_precision=PRECISION)
        else:
            if GDC:
                line = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
                _prefetch(w_ptr + tl.minimum(n, N - 1)[:, None] * K + line[None, :])
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
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
            to_pool = ok & (n >= SPLIT)[None, :]
            if FP8:
                sc = tl.load(ps_ptr + (n - SPLIT), mask=n_ok & (n >= SPLIT), other=1.0)
                f8 = tl.minimum(tl.maximum(y.to(tl.float32) / sc[None, :], -448.0), 448.0)
                tl.store(at, f8.to(pool_ptr.dtype.element_ty), mask=to_pool)
            else:
                tl.store(at, y, mask=to_pool)
        else:
            tl.store(y_ptr + m[:, None] * N + n[None, :], y, mask=ok)

    @triton.jit
    def _prefetch(ptrs):
        """Each pointer's line into L2 (no value returned: its dummy result is unused)."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit
    def _keys(q, kv, ks, vs, keys, j0, hi, sees, scale, m_i, l_i, acc, inner: tl.constexpr, D: tl.constexpr,
              DP: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
        """One block of keys j0 .. j0 + BK (those < hi) into the online softmax of q [BQ, DP]: key j's k
        at kv + keys[j] * 2 * inner, its v `inner` values on; query i sees keys j < sees[i]. FP8: k and v
        times their scales ks and vs [DP]."""
        d = tl.arange(0, DP)
        d_ok = d < D
        j = j0 + tl.arange(0, BK)
        j_ok = j < hi
        frame = tl.load(keys + j, mask=j_ok, other=0)
        kt = tl.load(kv + frame[None, :] * (2 * inner) + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        if FP8:
            kt = (kt.to(tl.float32) * ks[:, None]).to(q.dtype)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        ok = j_ok[None, :] & (j[None, :] < sees[:, None])
        s = tl.where(ok, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(ok, tl.exp2(s - m_new[:, None]), 0.0)
        v = tl.load(kv + frame[:, None] * (2 * inner) + inner + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        if FP8:
            v = (v.to(tl.float32) * vs[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc

    @triton.jit
    def _attention(
        q_ptr, pool_ptr, ps_ptr, keys_ptr, starts_ptr, valid_ptr, y_ptr, Q, KEYS, scale,
        H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CHUNK: tl.constexpr,
        BQ: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, STOP: tl.constexpr, KMAX: tl.constexpr,
        GDC: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        """y [R * Q, H * D] of q [R * Q, H * D] against each row's keys: pool frame keys[r, j] holds
        key j's k (its first H * D values) and v (the next H * D); FP8: in e4m3, times ps (a frame's
        layout) as read. STOP: the loop ends at the last key
        the program's queries see, else (Triton's interpreter, which cannot loop to a bound it did not
        get as a constant) over all KMAX keys, the later ones masked. GDC: a dependent launch (every
        input is an activation or an index: it waits first)."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
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
        if FP8:  # the head's key and value scales, read once a program
            ks = tl.load(ps_ptr + h * D + d, mask=d_ok, other=0.0)
            vs = tl.load(ps_ptr + inner + h * D + d, mask=d_ok, other=0.0)
        else:
            ks = tl.zeros((DP,), tl.float32)
            vs = ks
        if STOP:
            for j0 in range(0, hi, BK):
                m_i, l_i, acc = _keys(q, kv, ks, vs, keys, j0, hi, sees, scale, m_i, l_i, acc, inner, D, DP, BK, PRECISION, FP8)
        else:
            for j0 in range(0, KMAX, BK):
                m_i, l_i, acc = _keys(q, kv, ks, vs, keys, j0, hi, sees, scale, m_i, l_i, acc, inner, D, DP, BK, PRECISION, FP8)
        y = acc / l_i[:, None]
        out = y_ptr + (r * Q + i)[:, None] * inner + h * D + d[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])


def _precision(x: Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def dependent_launch(x: Tensor) -> bool:
    """Whether kernels over x launch as programmatic dependent launches: on CUDA devices of compute
    capability 9.0 or later (Hopper), where griddepcontrol exists."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


def _launch(x: Tensor) -> dict:
    """The launch options and constants of a dependent launch over x, or of a plain one."""
    gdc = dependent_launch(x)
    return {"GDC": gdc, "launch_pdl": True} if gdc else {"GDC": False}


def tile(m: int, n: int, k: int, norm: bool) -> Tile:
    """The blocking for x [m, k] @ w [n, k].T (norm: the whole row of k in one block, unpipelined):
    small blocks while the rows are few, so more programs share the work, as the fastest blockings
    timed on an H100 at the true shape's GEMMs (docs/levers.md, "H100 codec 6"); past 1,024 rows (a
    held batch's), 8 warps and, unnormed, 128-row blocks pipelined over 64-wide K steps: each GEMM
    within 17 % of the fastest of 832 blockings timed at 1,280 to 7,680 rows on an H100, most within
    5 % ("H100 codec tiles")."""
    if norm:
        if m <= 1024:
            return Tile(16, min(64, _pow2(n)), _pow2(k), 4, 1) if m <= 256 else Tile(64, min(128, _pow2(n)), _pow2(k), 4, 1)
        return Tile(64, min(256 if n > 1024 else 128, _pow2(n)), _pow2(k), 8, 1)
    if m <= 1024:
        bm, bn = (16, 32) if m <= 256 else (64, 32)
        return Tile(bm, min(bn, _pow2(n)), min(128, _pow2(k)), 4, 3)
    if m <= 2048:
        return Tile(64, min(64, _pow2(n)), min(64, _pow2(k)), 4, 4)
    return Tile(128, min(64 if m <= 4096 else 128, _pow2(n)), min(64, _pow2(k)), 8, 4)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm: torch.nn.LayerNorm | None = None, gelu: bool = False,
    residual: Tensor | None = None, pool: Tensor | None = None, writes: Tensor | None = None, blocking: Tile | None = None,
    pool_scale: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x [M, K] -> [M, N]: LayerNorm `norm` first, then x @ weight.T + bias, then GELU, then + residual.
    With `pool` and `writes` [M]: only the first N - (pool's frame width) columns are returned, the rest
    go to pool frame writes[m] (flat index into the pool's first dimension); an fp8 pool's values
    divided by `pool_scale` (a frame's layout, slots.to_page)."""
    m, k = x.shape
    n = weight.shape[0]
    split = n - pool[0].numel() if pool is not None else 0
    y = x.new_empty(m, split or n)
    blk = blocking or tile(m, n, k, norm is not None)
    grid = (triton.cdiv(m, blk.bm), triton.cdiv(n, blk.bn))
    dummy = weight
    line = max(1, 128 // weight.element_size())  # values a 128-byte line
    _linear[grid](
        x, weight, bias if bias is not None else dummy, residual if residual is not None else dummy, y,
        norm.weight if norm is not None else dummy, norm.bias if norm is not None else dummy,
        pool if pool is not None else dummy, writes if writes is not None else dummy,
        pool_scale if pool_scale is not None else dummy, m,
        norm.eps if norm is not None else 0.0, N=n, K=k, BM=blk.bm, BN=blk.bn, BK=blk.bk, NORM=norm is not None,
        BIAS=bias is not None, GELU=gelu, RES=residual is not None, SPLIT=split, PRECISION=_precision(x),
        LINE=line, LINES=_pow2(triton.cdiv(k, line), 1), FP8=pool_scale is not None, num_warps=blk.warps,
        num_stages=blk.stages, **_launch(x),
    )  # fmt: skip
    return y


def attention(
    q: Tensor, pool: Tensor, keys: Tensor, starts: Tensor, valid: Tensor, chunk: int,
    bq: int = 0, bk: int = BLOCK_KEYS, warps: int = ATTENTION_WARPS, scale: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """q [R, Q, H, D]; pool [frames, 2, H, D]; keys [R, K] (pool frames), starts and valid [R] -> [R, Q, H * D].
    scale [2, H, D]: an fp8 pool's (slots.from_page).
    bq: queries a program (0: 16 for a few rows, 64 for many, the faster on an H100)."""
    r, nq, h, d = q.shape
    bq = bq or (16 if r * nq <= 256 else 64)
    y = q.new_empty(r, nq, h * d)
    grid = (r, h, triton.cdiv(nq, bq))
    _attention[grid](
        q, pool, pool if scale is None else scale, keys, starts, valid, y, nq, keys.shape[1], d**-0.5 * 1.4426950408889634,
        H=h, D=d, DP=_pow2(d), CHUNK=chunk, BQ=bq, BK=bk, PRECISION=_precision(q),
        STOP=q.is_cuda, KMAX=0 if q.is_cuda else keys.shape[1], FP8=scale is not None, num_warps=warps, **_launch(q),
    )  # fmt: skip
    return y


def block(
    b: torch.nn.Module, h: Tensor, pool: Tensor, keys: Tensor, writes: Tensor, starts: Tensor, valid: Tensor, chunk: int,
    scale: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """A TransformerBlock (estimator.py) over h [R, Q, C], as slots.SlotPass.transformer computes it:
    the new keys and values written to pool frames `writes` [R, Q], every key read from pool frames `keys`
    (an fp8 pool: `scale` its scale).
    The LayerNorms stay in their GEMMs at any rows: apart (torch's LayerNorm, then a GEMM pipelined
    over K) they never won on an H100 from 80 to 7,680 rows (levers.md, "H100 codec tiles")."""
    r, nq, c = h.shape
    a, ff = b.attn1, b.ff.net
    x = h.reshape(r * nq, c).contiguous()
    q = linear(x, a.qkv.weight, norm=b.norm1, pool=pool, writes=writes.reshape(-1), pool_scale=scale)
    y = attention(q.view(r, nq, a.heads, -1), pool, keys, starts, valid, chunk, scale=scale)
    h = linear(y.view(r * nq, -1), a.to_out[0].weight, a.to_out[0].bias, residual=x)
    g = linear(h, ff[0].proj.weight, ff[0].proj.bias, norm=b.norm3, gelu=True)
    return linear(g, ff[2].weight, ff[2].bias, residual=h).view(r, nq, c)
