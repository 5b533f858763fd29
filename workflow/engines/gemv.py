"""A fused GEMV for decode (a few rows of x against a whole weight), written in Triton.

At batch 1 a decoder layer is four weight reads and a dozen tiny kernels around them: the
norms before qkv and gate_up, the residual adds after dense and proj, the FP8 padding to 16
rows that cuBLASLt wants, the split-K reductions cuBLAS picks for the narrow matrices. Each
tiny kernel costs a couple of microseconds whatever it does. This kernel folds them into the
weight read: each program takes BLOCK_N output columns for all M (<= MAX_M) rows, and

- prologue: the input row's RMSNorm, recomputed by every program (x is a few KB; the weights
  are megabytes), rounded exactly as `linears.rms_norm` rounds; or silu(gate) * up from
  gate_up's output (proj's input);
- body: y = x @ W^T with W in bf16/float32 or float8_e4m3fn, float32 accumulation; for FP8
  x must already be FP8-rounded (the caller quantizes it with the calibrated scale, fused by
  torch.compile into the op before), and each part of W's rows (fc|gate: two) has its own
  scale, applied as acc * scale[part], the arithmetic of torch._scaled_mm. Four bodies, a
  tuning choice: reduce each [BLOCK_N, BLOCK_K] tile over K as it comes (a cross-thread sum
  per tile), or, for one row, keep the tile's float32 products as partial sums and reduce
  once after the loop (`defer`: no per-tile reduction, narrower tiles, fewer registers idle);
  or, `resident` (K up to RESIDENT_MAX_K), a few programs a multiprocessor that read x's whole
  row and run the prologue once, then stride over column blocks (bf16 decode -0.06 ms on an
  H100: docs/levers.md, probe 18); or, `dot`, tensor cores, x's rows padded to 16, loads
  pipelined over `dot` stages: FP8 weights times x as stored (no prologue or GLU), e4m3 times
  e4m3 with no conversion (a CUDA-core FP8 GEMV converts every weight byte before its
  multiply, which on an H200 caps it at 4.13 TB/s where tensor cores read 4.49: gate_up 28.4
  -> 25.4 us; docs/levers.md, probe 33); or bf16 weights times x through its prologue, for
  several rows, where a CUDA-core body's products grow with the rows and its time with them
  (probe 34);
- epilogue: the result rounded to the output dtype, then a residual added and rounded again,
  the same two roundings as `x + F.linear(...)`; or, `glu` (bf16 gate_up), silu(gate) * up: a
  program reads gate's rows and up's, so proj's programs need not each re-read [gate | up]
  (decode -0.05 to -0.16 ms a step on an H100; for FP8, whose quantize kernel stays between
  the two, it brought nothing: docs/levers.md, probe 17).

Each call is given its `Block` (body and sizes): chosen by `tuning.tune` on the target GPU at build,
per `Use` (weight shape, Fuse and row count), stored in engine.json and handed by the engine to
each linear.
Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1): how the tests check it.
"""

from __future__ import annotations

import functools

import torch

from workflow.engines.blocks import ROWS, Block, Body, default_block, fuse_of

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without it (engine.gemv: false)
    triton = None

MAX_M = ROWS[-1]  # rows handled here; more rows (batched decode, prefill) go to cuBLAS


def available() -> bool:
    return triton is not None


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's SM count (the resident body's grid); under the interpreter, a few."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


if triton is not None:

    @triton.jit
    def _load_x(x_ptr, rm, rk, m_ok, k_ok, K: tl.constexpr, SILU_MUL: tl.constexpr):
        """x's tile [M, BLOCK_K] as stored; with SILU_MUL (each row of x is [gate | up]) gate's
        and up's tiles."""
        stride = 2 * K if SILU_MUL else K
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride + rk[None, :], mask=x_ok, other=0.0)
        up = x
        if SILU_MUL:
            up = tl.load(x_ptr + rm[:, None] * stride + K + rk[None, :], mask=x_ok, other=0.0)
        return x, up

    @triton.jit
    def _prologue(x, up, rk, k_ok, norm_ptr, rstd, NORM: tl.constexpr, SILU_MUL: tl.constexpr):
        """x's tile through the prologue, as float32, rounded where the torch ops round."""
        if SILU_MUL:  # silu(gate) rounded to x's dtype, times up, rounded again
            gf = x.to(tl.float32)
            x = ((gf / (1.0 + tl.exp(-gf))).to(x.dtype).to(tl.float32) * up.to(tl.float32)).to(x.dtype)
        if NORM:  # (x * rstd) rounded to x's dtype, then times the weight, rounded again
            g = tl.load(norm_ptr + rk, mask=k_ok, other=0.0)
            xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            x = (g.to(tl.float32)[None, :] * xn.to(tl.float32)).to(x.dtype)
        return x.to(tl.float32)

    @triton.jit
    def _input(x_ptr, rm, rk, m_ok, k_ok, norm_ptr, rstd, K: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr):
        """x's tile [M, BLOCK_K] loaded and through the prologue, as float32."""
        x, up = _load_x(x_ptr, rm, rk, m_ok, k_ok, K, SILU_MUL)
        return _prologue(x, up, rk, k_ok, norm_ptr, rstd, NORM, SILU_MUL)

    @triton.jit
    def _rstd(x_ptr, rm, m_ok, eps, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """The rows' 1 / rms (RMSNorm's), in float32."""
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xf = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
            ss += _sum_sq(xf)
        return _inv_rms(ss, eps, K)

    @triton.jit
    def _sum_sq(x):
        """Each row's sum of squares, in float32."""
        return tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)

    @triton.jit
    def _inv_rms(ss, eps, K: tl.constexpr):
        """1 / rms from a row's sum of squares: one formula for both bodies' norms."""
        return 1.0 / tl.sqrt(ss / K + eps)

    @triton.jit
    def _rows(w_ptr, rn, rk, k_ok, N, K: tl.constexpr, GLU: tl.constexpr):
        """The weight tile of rows rn (GLU: and of rows N + rn, up's), masked past N; read once,
        so kept out of L2's way."""
        ok = (rn < N)[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        w2 = w
        if GLU:
            w2 = tl.load(w_ptr + (N + rn)[:, None] * K + rk[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        return w, w2

    @triton.jit
    def _accumulate(acc, x, w, DEFER: tl.constexpr):
        """One K tile into the float32 accumulator: per tile reduced ([M, N]) or, DEFER, the one
        row's products kept per column of the tile ([N, K]) and reduced after the loop."""
        if DEFER:
            acc += tl.sum(x, axis=0)[None, :] * w.to(tl.float32)
        else:
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _finish(acc, scale_ptr, rows, rows_per_part, n_ok, DEFER: tl.constexpr, HAS_SCALE: tl.constexpr):
        """The accumulator as [M, N], times each weight row's part scale (FP8)."""
        if DEFER:
            acc = tl.sum(acc, axis=1)[None, :]
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows // rows_per_part, mask=n_ok, other=0.0)[None, :]
        return acc

    @triton.jit
    def _store(acc, acc2, y_ptr, res_ptr, scale_ptr, rm, rn, m_ok, n_ok, N, rows_per_part,
               HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, GLU: tl.constexpr, DEFER: tl.constexpr):  # fmt: skip
        """The epilogue: rounded to y's dtype; GLU: silu(gate) * up, rounded as gate_up's output,
        silu's and the product are; then the residual added and rounded again."""
        out_ptrs = rm[:, None] * N + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        dt = y_ptr.dtype.element_ty
        y = _finish(acc, scale_ptr, rn, rows_per_part, n_ok, DEFER, HAS_SCALE).to(dt)
        if GLU:
            u = _finish(acc2, scale_ptr, N + rn, rows_per_part, n_ok, DEFER, HAS_SCALE).to(dt)
            gf = y.to(tl.float32)
            y = ((gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt)
        if HAS_RES:
            r = tl.load(res_ptr + out_ptrs, mask=ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(y_ptr + out_ptrs, y, mask=ok)

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b on tensor cores; IEEE (float32 inputs): exact float32, not TF32."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _dot(x_ptr, w_ptr, y_ptr, res_ptr, scale_ptr, norm_ptr, rm, m_ok, N, rows_per_part, eps, K: tl.constexpr,
             NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
             GLU: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
        """The tensor-core body: x's rows (padded to BLOCK_M = 16) times the weight tile as stored,
        loads pipelined over STAGES; x as stored (FP8: quantized by the caller), or through the
        prologue and rounded to w's dtype as torch rounds it (bf16); GLU: gate's and up's tiles,
        two products. From 64 rows the weight is the left operand (Hopper's wgmma wants M >= 64),
        else x is. Hopper's FP8 tensor cores accumulate with fewer bits than float32, as
        cuBLASLt's fast accumulation (the FP8 prefill's) does: 1-2.5 bf16 ulps of the largest
        output in probe 33, and verify passed on an H200 with it."""
        W_FIRST: tl.constexpr = BLOCK_N >= 64
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rstd = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:
            rstd = _rstd(x_ptr, rm, m_ok, eps, K, BLOCK_M, BLOCK_K)
        if W_FIRST:  # noqa: SIM108 (constexpr: one branch compiled)
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = acc
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            if NORM or SILU_MUL:
                x = _input(x_ptr, rm, rk, m_ok, k_ok, norm_ptr, rstd, K, NORM, SILU_MUL).to(w_ptr.dtype.element_ty)
            else:
                x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w, w2 = _rows(w_ptr, rn, rk, k_ok, N, K, GLU)
            if W_FIRST:
                acc = _mma(w, tl.trans(x), acc, IEEE)
                if GLU:
                    acc2 = _mma(w2, tl.trans(x), acc2, IEEE)
            else:
                acc = _mma(x, tl.trans(w), acc, IEEE)
                if GLU:
                    acc2 = _mma(x, tl.trans(w2), acc2, IEEE)
        if W_FIRST:
            acc = tl.trans(acc)
            if GLU:
                acc2 = tl.trans(acc2)
        _store(acc, acc2, y_ptr, res_ptr, scale_ptr, rm, rn, m_ok, n_ok, N, rows_per_part, HAS_RES, HAS_SCALE, GLU, False)

    @triton.jit
    def _gemv(
        x_ptr, w_ptr, y_ptr, res_ptr, scale_ptr, norm_ptr,
        M, N, rows_per_part, eps, programs,
        K: tl.constexpr, STRIDES: tl.constexpr,
        NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
        GLU: tl.constexpr, DEFER: tl.constexpr, RESIDENT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        if DOT:  # tensor cores, DOT pipeline stages
            _dot(x_ptr, w_ptr, y_ptr, res_ptr, scale_ptr, norm_ptr, rm, m_ok, N, rows_per_part, eps, K, NORM, SILU_MUL,
                 HAS_RES, HAS_SCALE, GLU, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, DOT)  # fmt: skip
        elif RESIDENT:  # BLOCK_K >= K: x read and prologued once, kept in registers; the program strides over column blocks
            rk = tl.arange(0, BLOCK_K)
            k_ok = rk < K
            first = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # its first column block; GLU: rows rn and N + rn
            x, up = _load_x(x_ptr, rm, rk, m_ok, k_ok, K, SILU_MUL)  # one read of x: the norm's sum and the prologue
            rstd = tl.zeros((BLOCK_M,), tl.float32)
            if NORM:
                rstd = _inv_rms(_sum_sq(x), eps, K)
            xf = _prologue(x, up, rk, k_ok, norm_ptr, rstd, NORM, SILU_MUL)
            for i in range(0, STRIDES):  # column block pid + i * programs (the last ones may be past N: masked)
                rn = first + i * programs * BLOCK_N
                w, w2 = _rows(w_ptr, rn, rk, k_ok, N, K, GLU)
                acc = tl.sum(xf[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
                acc2 = acc
                if GLU:
                    acc2 = tl.sum(xf[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
                n_ok = rn < N
                _store(acc, acc2, y_ptr, res_ptr, scale_ptr, rm, rn, m_ok, n_ok, N, rows_per_part, HAS_RES, HAS_SCALE, GLU, False)
        else:
            if NORM:  # noqa: SIM108 (every program recomputes the rows' 1/rms: x is tiny)
                rstd = _rstd(x_ptr, rm, m_ok, eps, K, BLOCK_M, BLOCK_K)
            else:
                rstd = tl.zeros((BLOCK_M,), tl.float32)
            rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns; GLU: rows rn and N + rn of w
            n_ok = rn < N
            if DEFER:  # noqa: SIM108
                acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = acc  # GLU's second half (up)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_ok = rk < K
                xf = _input(x_ptr, rm, rk, m_ok, k_ok, norm_ptr, rstd, K, NORM, SILU_MUL)
                w, w2 = _rows(w_ptr, rn, rk, k_ok, N, K, GLU)
                acc = _accumulate(acc, xf, w, DEFER)
                if GLU:
                    acc2 = _accumulate(acc2, xf, w2, DEFER)
            _store(acc, acc2, y_ptr, res_ptr, scale_ptr, rm, rn, m_ok, n_ok, N, rows_per_part, HAS_RES, HAS_SCALE, GLU, DEFER)


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    block: Block | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """[norm](x) @ w^T [* scale per part of w's rows] [+ residual], for x [..., K] with at most
    MAX_M rows. norm: the RMSNorm weight to apply to x first; silu_mul: x is [..., 2K] = [gate |
    up] and the product reads silu(gate) * up; scale: float32 [parts] (FP8); glu: w is [gate;
    up] and the output silu(x @ gate^T) * (x @ up^T), N / 2 columns; block: the launch shape
    (default_block if None). DEFER takes one row only (more run TILE's reduction); RESIDENT holds
    x's whole row (BLOCK_K >= K); DOT takes x of w's dtype, and FP8 x as stored (no prologue, no GLU)."""
    if norm is not None and silu_mul:
        raise ValueError("gemv: norm and silu_mul do not combine")
    shape, k, n = x.shape, w.shape[1], w.shape[0] // (2 if glu else 1)
    if x.shape[-1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: x has {x.shape[-1]} columns for a weight of {k}{' (x2: silu_mul)' if silu_mul else ''}")
    x = x.reshape(-1, x.shape[-1]).contiguous()  # dense rows (a head's x[:, -1] is not)
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"gemv takes at most {MAX_M} rows, got {m}")
    block = block or default_block(k)
    resident, dot = block.body == Body.RESIDENT, block.body == Body.DOT
    if resident and block.block_k < k:
        raise ValueError(f"gemv: the resident body holds x's whole row: BLOCK_K {block.block_k} < K {k}")
    if dot and (x.dtype != w.dtype or (w.element_size() == 1 and (norm is not None or silu_mul or glu))):
        fuse = fuse_of(norm is not None, silu_mul, residual is not None, glu)
        why = "the tensor-core body takes x of w's dtype, FP8 as stored: no prologue, no GLU"
        raise ValueError(f"gemv: {why} ({fuse}, {x.dtype})")
    blocks = triton.cdiv(n, block.block_n)
    programs = min(blocks, block.per_sm * multiprocessors(x.device)) if resident else blocks
    y = torch.empty(m, n, device=x.device, dtype=out_dtype)
    res = residual.reshape(m, n).contiguous() if residual is not None else x  # x: an unread stand-in
    parts = scale.numel() if scale is not None else 1
    _gemv[(programs,)](
        x, w, y, res, scale if scale is not None else x, norm if norm is not None else x,
        m, n, w.shape[0] // parts, eps, programs,
        K=k, STRIDES=triton.cdiv(blocks, programs) if resident else 1,
        NORM=norm is not None, SILU_MUL=silu_mul, HAS_RES=residual is not None, HAS_SCALE=scale is not None,
        GLU=glu, DEFER=block.body == Body.DEFER and m == 1, RESIDENT=resident, DOT=block.stages if dot else 0,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=16 if dot else max(1, triton.next_power_of_2(m)), BLOCK_N=block.block_n, BLOCK_K=block.block_k,
        num_warps=block.warps,
    )  # fmt: skip
    return y.reshape(*shape[:-1], n)


def _launch_op(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
    norm: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    silu_mul: bool,
    glu: bool,
    body: str,
    sizes: list[int],
) -> torch.Tensor:
    """launch with the block as an op's schema can carry it: the body's name and its sizes."""
    return launch(x, w, out_dtype, scale, norm, eps, residual, silu_mul, Block(Body(body), *sizes), glu)


if triton is not None:  # an opaque op to torch.compile and CUDA graphs: one kernel, a fresh output
    _op = torch.library.custom_op("mossbuild::gemv", _launch_op, mutates_args=())

    @_op.register_fake
    def _(x, w, out_dtype, scale, norm, eps, residual, silu_mul, glu, body, sizes):
        return x.new_empty(*x.shape[:-1], w.shape[0] // (2 if glu else 1), dtype=out_dtype)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    block: Block | None = None,
    scale: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    glu: bool = False,
) -> torch.Tensor:
    """`launch` as one opaque op (what the engine calls, compiled or not)."""
    block = block or default_block(w.shape[1])
    sizes = [block.block_n, block.block_k, block.warps, block.per_sm, block.stages]
    return _op(x, w, out_dtype, scale, norm, eps, residual, silu_mul, glu, block.body.value, sizes)
