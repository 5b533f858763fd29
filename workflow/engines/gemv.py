"""A fused GEMV for decode (a few rows of x against a whole weight), written in Triton.

At batch 1 a decoder layer is four weight reads and a dozen tiny kernels around them: the
norms before qkv and gate_up, the residual adds after dense and proj, the FP8 padding to 16
rows that cuBLASLt wants, the split-K reductions cuBLAS picks for the narrow matrices. Each
tiny kernel costs a couple of microseconds whatever it does. This kernel folds them into the
weight read: each program takes BLOCK_N output columns for all M (<= MAX_M) rows, and

- prologue: the input row's RMSNorm, recomputed by every program (x is a few KB; the weights
  are megabytes), rounded exactly as `torch_engine.rms_norm` rounds;
- body: y = x @ W^T with W in bf16/float32 or float8_e4m3fn, float32 accumulation; for FP8
  x must already be FP8-rounded (the caller quantizes it with the calibrated scale, fused by
  torch.compile into the op before), and each part of W's rows (fc|gate: two) has its own
  scale, applied as acc * scale[part], the arithmetic of torch._scaled_mm;
- epilogue: the result rounded to the output dtype, then a residual added and rounded again,
  the same two roundings as `x + F.linear(...)`.

The block sizes come from `config_for` (measured per shape on the GPU; see NOTES.md). Without
a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests
check it against torch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without it (gemv: cublas)
    triton = None

MAX_M = 4  # rows handled here; more rows (batched decode, prefill) go to cuBLAS


def available() -> bool:
    return triton is not None


BLOCKS: dict[str, tuple[int, int, int]] = {}  # "NxK:bytes" -> (BLOCK_N, BLOCK_K, num_warps), from `tune`
CANDIDATES = [(bn, bk, w) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)]


def key(n: int, k: int, weight_bytes: int) -> str:
    return f"{n}x{k}:{weight_bytes}"


def config_for(n: int, k: int, weight_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an N x K weight: the tuned one, else a default."""
    return BLOCKS.get(key(n, k, weight_bytes), (8, min(512, triton.next_power_of_2(k)), 4))


def tune(weights: list[torch.Tensor], reps: int = 50) -> dict[str, tuple[int, int, int]]:
    """Time every candidate block shape on each distinct weight shape (one row of x, on the
    weight's own device) and keep the fastest in BLOCKS. Like a TensorRT tactic choice: run
    once at build on the target GPU, stored with the engine, reloaded by `BLOCKS.update`."""
    found = {}
    for w in weights:
        n, k = w.shape
        name = key(n, k, w.element_size())
        if name in found:
            continue
        x = torch.randn(1, k, device=w.device).to(w.dtype)
        scale = torch.ones(1, device=w.device) if w.element_size() == 1 else None
        times = {}
        for block in CANDIDATES:
            if block[1] > triton.next_power_of_2(k):
                continue
            run = lambda: launch(x, w, torch.bfloat16, scale=scale, block=block)  # noqa: B023, E731
            run()  # compile the kernel outside the capture
            graph = torch.cuda.CUDAGraph()  # launch gaps would hide the kernel's own time
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    run()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[block] = start.elapsed_time(end) / reps
        found[name] = min(times, key=times.get)
    BLOCKS.update(found)
    return found


if triton is not None:

    @triton.jit
    def _gemv(
        x_ptr, w_ptr, y_ptr, res_ptr, scale_ptr, norm_ptr,
        M, N, rows_per_part, eps,
        K: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        if NORM:  # every program recomputes the rows' 1/rms: x is tiny
            ss = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                xf = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
                ss += tl.sum(xf.to(tl.float32) * xf.to(tl.float32), axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:  # (x * rstd) rounded to x's dtype, then times the weight, rounded again
                g = tl.load(norm_ptr + rk, mask=k_ok, other=0.0)
                xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
                x = (g.to(tl.float32)[None, :] * xn.to(tl.float32)).to(x.dtype)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rn // rows_per_part, mask=n_ok, other=0.0)[None, :]
        out_ptrs = rm[:, None] * N + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        y = acc.to(y_ptr.dtype.element_ty)
        if HAS_RES:
            r = tl.load(res_ptr + out_ptrs, mask=ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + out_ptrs, y, mask=ok)


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    block: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """[norm](x) @ w^T [* scale per part of w's rows] [+ residual], for x [..., K] with at most
    MAX_M rows. norm: the RMSNorm weight to apply to x first; scale: float32 [parts] (FP8);
    block: (BLOCK_N, BLOCK_K, num_warps), else `config_for` the shape."""
    shape, k, n = x.shape, x.shape[-1], w.shape[0]
    x = x.reshape(-1, k).contiguous()  # the kernel assumes dense rows (a head's x[:, -1] is not)
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"gemv takes at most {MAX_M} rows, got {m}")
    block_n, block_k, warps = block or config_for(n, k, w.element_size())
    y = torch.empty(m, n, device=x.device, dtype=out_dtype)
    res = residual.reshape(m, n).contiguous() if residual is not None else x  # x: an unread stand-in
    parts = scale.numel() if scale is not None else 1
    _gemv[(triton.cdiv(n, block_n),)](
        x, w, y, res, scale if scale is not None else x, norm if norm is not None else x,
        m, n, n // parts, eps,
        K=k, NORM=norm is not None, HAS_RES=residual is not None, HAS_SCALE=scale is not None,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return y.reshape(*shape[:-1], n)


if triton is not None:  # an opaque op to torch.compile and CUDA graphs: one kernel, a fresh output

    @torch.library.custom_op("mossbuild::gemv", mutates_args=())
    def gemv(
        x: torch.Tensor,
        w: torch.Tensor,
        out_dtype: torch.dtype,
        scale: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        eps: float = 1e-6,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`launch` with the tuned block shape."""
        return launch(x, w, out_dtype, scale, norm, eps, residual)

    @gemv.register_fake
    def _(x, w, out_dtype, scale=None, norm=None, eps=1e-6, residual=None):
        return x.new_empty(*x.shape[:-1], w.shape[0], dtype=out_dtype)
