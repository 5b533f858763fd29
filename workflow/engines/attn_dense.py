"""Decode attention and dense's GEMV as one persistent Triton kernel (engine.attention_dense).

At batch 1, decode attention is latency, not bandwidth: ~7.8 us a layer on an H100 whatever
its splits, blocks or warps, while HBM idles (benchmarks/results/2026-11-24-h100-probe25). Here
every program first loads its rows of dense's weight (up to a budget of bytes, SHAPES) into
registers; then the attention programs run `attention._attend` (one per kv head and slice), all
programs meet at a grid barrier, the first H combine the slices (`attention._combine_head`) and
all meet again; then each finishes its rows: h = x + attn @ W^T with the GEMV's epilogue
(`gemv._store`: the roundings of `x + F.linear`, FP8's scale). With a stand-in for attention
this took 4 us a layer off the two kernels it replaces, FP8 and bf16 (probe 26).

A grid barrier needs every program resident at once. `launch` compiles the kernel first and
takes the first of SHAPES whose grid the GPU can hold (its registers decide), or refuses,
rather than risk a hang; a barrier that still never opened ends after SPIN_LIMIT polls and
counts itself in `errors(device)`, which verify reads. The barrier's counters (one pair a
device: launches on one stream never overlap) count up through a launch and are zeroed by its
last program, so a CUDA graph replays it as is. Triton's interpreter (no GPU) runs programs one after another, where a
barrier would wait forever: there each phase is its own launch of the same kernel.
"""

from __future__ import annotations

import os

import torch

from workflow.engines import attention, gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without it
    triton = None

# program shapes, tried in turn on a GPU, the first whose grid it can hold at once wins: (dense rows
# a program, warps, programs a multiprocessor, weight bytes a program holds in registers through
# attention: FP8 dense's 16 x 4096 all of them, bf16's half)
SHAPES = ((16, 8, 2, 64 << 10), (32, 16, 1, 128 << 10))
_STATE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (barrier counters, barrier timeouts)
_CHOSEN: dict[tuple, tuple[int, int, int] | None] = {}  # compile-time arguments -> (rows, warps, bytes) or None
TRIED: list[dict] = []  # each program shape tried on a GPU: its registers and whether its grid was resident


def available() -> bool:
    return triton is not None


def state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The barrier's two counters and its timeout count on a device; made outside any graph
    capture (the engine calls this when it loads)."""
    if str(device) not in _STATE:
        _STATE[str(device)] = (torch.zeros(2, device=device, dtype=torch.int32), torch.zeros(1, device=device, dtype=torch.int32))
    return _STATE[str(device)]


def errors(device: torch.device) -> int:
    """Barriers that timed out on this device so far: 0, or the fused results are not to be trusted."""
    return int(state(device)[1].item())


if triton is not None:
    SPIN_LIMIT = tl.constexpr(1 << 22)  # polls before a barrier gives up (seconds: never, if all programs run)

    @triton.jit
    def grid_barrier(bar_ptr, target, err_ptr):
        """Wait until bar[0] counts target arrivals: the k-th barrier of a launch of nprog programs
        waits for k * nprog (a count reset between two barriers could erase an early arrival)."""
        tl.debug_barrier()  # the program's stores are done (bar.sync); the release below publishes them
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        n = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (n < target) & (spins < SPIN_LIMIT):
            n = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if spins >= SPIN_LIMIT:
            tl.atomic_add(err_ptr, 1)
        tl.debug_barrier()

    @triton.jit
    def barrier_reset(bar_ptr, nprog):
        """After a launch's last barrier: the last program past it zeroes the counters, so the
        next launch (stream order: after this one ends) finds zeros."""
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _attn_dense(
        qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, m_ptr, l_ptr, acc_ptr, quant_ptr,
        qkv_stride, c_sb, c_sh, c_ss, eps, qk_scale,
        w_ptr, scale_ptr, res_ptr, out_ptr, bar_ptr, err_ptr, N,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        KV_LEN: tl.constexpr, SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_S: tl.constexpr,
        PRECISION: tl.constexpr, QUANT: tl.constexpr,
        K: tl.constexpr, ROWS: tl.constexpr, PRE_K: tl.constexpr, HAS_SCALE: tl.constexpr, ACT: tl.constexpr,
        SP: tl.constexpr, EVEN: tl.constexpr, PHASES: tl.constexpr, BARRIER: tl.constexpr,
    ):  # fmt: skip
        """PHASES: 1 attention, 2 the slices' combine, 4 dense; all three with BARRIER on a GPU.
        Programs below HKV * SPLITS run attention and hold no weights through it (registers:
        both at once would leave room for one program a multiprocessor); the rest load theirs."""
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        rn, kp = pid * ROWS + tl.arange(0, ROWS), tl.arange(0, PRE_K)
        if pid < HKV * SPLITS:
            if PHASES & 1:
                attention._attend(
                    0, pid // SPLITS, pid % SPLITS,
                    qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, m_ptr, l_ptr, acc_ptr,
                    quant_ptr, qkv_stride, c_sb, c_sh, c_ss, eps, qk_scale,
                    H, HKV, G, GP, D, KV_LEN, SPLITS, SPLIT_LEN, BLOCK_S, PRECISION, QUANT,
                )  # fmt: skip
            _meet(
                pid,
                nprog,
                y_ptr,
                m_ptr,
                l_ptr,
                acc_ptr,
                quant_ptr,
                bar_ptr,
                err_ptr,
                H,
                D,
                SPLITS,
                SP,
                ACT,
                QUANT,
                PHASES,
                BARRIER,
            )
            if PHASES & 4:
                acc = tl.zeros((ROWS,), tl.float32)
                _dense(acc, 0, rn, kp, w_ptr, y_ptr, scale_ptr, res_ptr, out_ptr, N, K, PRE_K, HAS_SCALE, EVEN)
        else:
            if PHASES & 4:  # dense's first PRE_K columns, loaded before attention ends and held
                w_pre = _tile(w_ptr, rn, kp, N, K, EVEN)
            _meet(
                pid,
                nprog,
                y_ptr,
                m_ptr,
                l_ptr,
                acc_ptr,
                quant_ptr,
                bar_ptr,
                err_ptr,
                H,
                D,
                SPLITS,
                SP,
                ACT,
                QUANT,
                PHASES,
                BARRIER,
            )
            if PHASES & 4:
                x = tl.load(y_ptr + kp, mask=kp < K, other=0.0, cache_modifier=".cg").to(tl.float32)
                acc = tl.sum(w_pre.to(tl.float32) * x[None, :], axis=1)
                _dense(acc, PRE_K, rn, kp, w_ptr, y_ptr, scale_ptr, res_ptr, out_ptr, N, K, PRE_K, HAS_SCALE, EVEN)

    @triton.jit
    def _meet(pid, nprog, y_ptr, m_ptr, l_ptr, acc_ptr, quant_ptr, bar_ptr, err_ptr,
              H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr, ACT: tl.constexpr,
              QUANT: tl.constexpr, PHASES: tl.constexpr, BARRIER: tl.constexpr):  # fmt: skip
        """After attention: with slices, all wait, the first H programs combine them; all wait."""
        if SPLITS > 1:
            if BARRIER:
                grid_barrier(bar_ptr, nprog, err_ptr)
            if PHASES & 2:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if pid < H:
                    attention._combine_head(pid, y_ptr, m_ptr, l_ptr, acc_ptr, quant_ptr, D, SPLITS, SP, ACT, QUANT)
        if BARRIER:
            grid_barrier(bar_ptr, nprog * (1 + (SPLITS > 1)), err_ptr)
            barrier_reset(bar_ptr, nprog)

    @triton.jit
    def _tile(w_ptr, rn, rk, N, K: tl.constexpr, EVEN: tl.constexpr):
        """Rows rn, columns rk of the weight; EVEN (every tile whole): no mask, whose [ROWS, PRE_K]
        predicates would cost a program its registers (255 of them for FP8's 16 x 4096)."""
        if EVEN:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], eviction_policy="evict_first")
        else:
            w, _ = gemv._rows(w_ptr, rn, rk, rk < K, N, K, False)
        return w

    @triton.jit
    def _dense(acc, k_start, rn, kp, w_ptr, y_ptr, scale_ptr, res_ptr, out_ptr, N,
               K: tl.constexpr, PRE_K: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
        """The program's dense rows from column k_start on (attention's output read past L1:
        other programs wrote it), then the GEMV's epilogue: scale, rounding, residual."""
        for k0 in tl.range(k_start, K, PRE_K, num_stages=1):  # not pipelined: one tile in registers at a time
            rk = k0 + kp
            k_ok = rk < K
            w = _tile(w_ptr, rn, rk, N, K, EVEN)
            x = tl.load(y_ptr + rk, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        rm = tl.arange(0, 1)
        acc = acc[None, :]
        gemv._store(acc, acc, out_ptr, res_ptr, scale_ptr, rm, rn, rm < 1, rn < N, N, N, True, HAS_SCALE, False, False)


def resident(kernel, device: torch.device, per_sm: int) -> bool:
    """Whether per_sm programs of a compiled kernel fit a multiprocessor at once (registers,
    threads, shared memory), so that a grid of per_sm a multiprocessor is resident."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * kernel.metadata.num_warps
    fits = min(
        props.regs_per_multiprocessor // max(kernel.n_regs * threads, 1),
        props.max_threads_per_multi_processor // threads,
        props.shared_memory_per_multiprocessor // max(kernel.metadata.shared, 1),
    )
    return fits >= per_sm


def launch(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    eps: float,
    w: torch.Tensor,
    residual: torch.Tensor,
    scale: torch.Tensor | None = None,
    quant: torch.Tensor | None = None,
    splits: int = 0,
) -> torch.Tensor:
    """residual + dense(decode_attention(...)) for one sequence: qkv [1, 1, (H + 2 Hkv) D] and
    the caches as `attention.launch` takes them (the caches written at pos), dense's weight w
    [N, H D] (bf16, or float8_e4m3fn with `scale` and `quant`: dense's FP8 scales, as `project`
    passes them), residual [1, 1, N]."""
    if qkv.shape[0] != 1:
        raise ValueError(f"attn_dense: one sequence at a time, not {qkv.shape[0]}")
    _, args, c = attention.plan(
        qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, kv_len, eps, splits, attention.BLOCK_S, quant
    )
    n, k = w.shape
    if k != c["H"] * c["D"] or residual.numel() != n or (w.dtype == torch.float8_e4m3fn) != (scale is not None):
        raise ValueError(f"attn_dense: dense weight {tuple(w.shape)} {w.dtype} does not fit attention's {c['H'] * c['D']}")
    out = torch.empty(1, 1, n, device=qkv.device, dtype=residual.dtype)
    args += [w, scale if scale is not None else w, residual, out, *state(qkv.device), n]
    c.update(K=k, HAS_SCALE=scale is not None, ACT=attention.ACT_TYPES[qkv.dtype], SP=triton.next_power_of_2(c["SPLITS"]))

    def grid(rows: int) -> tuple[int]:  # programs past N's rows store nothing
        return (max(triton.cdiv(n, rows), c["HKV"] * c["SPLITS"], c["H"]),)

    def consts(rows: int, pre_bytes: int) -> dict:  # PRE_K: a power of two, as all of these are
        pre_k = min(triton.next_power_of_2(k), pre_bytes // (rows * w.element_size()))
        return dict(c, ROWS=rows, PRE_K=pre_k, EVEN=k % pre_k == 0 and grid(rows)[0] * rows == n)

    if os.environ.get("TRITON_INTERPRET") == "1" or qkv.device.type != "cuda":
        rows, warps, _, pre_bytes = SHAPES[0]
        for phase in (1, 2, 4):  # one after another: no program may wait for a later one
            _attn_dense[grid(rows)](*args, **consts(rows, pre_bytes), PHASES=phase, BARRIER=False, num_warps=warps)
        return out
    key = (qkv.device.index, n, k, w.dtype, tuple(sorted((name, str(v)) for name, v in c.items())))
    if key not in _CHOSEN:
        _CHOSEN[key] = None
        sms = torch.cuda.get_device_properties(qkv.device).multi_processor_count
        for rows, warps, per_sm, pre_bytes in SHAPES:
            kernel = _attn_dense.warmup(
                *args, **consts(rows, pre_bytes), PHASES=7, BARRIER=True, num_warps=warps, grid=grid(rows)
            )
            kernel._init_handles()
            ok = grid(rows)[0] <= per_sm * sms and resident(kernel, qkv.device, per_sm)
            TRIED.append({"rows": rows, "warps": warps, "per_sm": per_sm, "registers": kernel.n_regs, "resident": ok})
            if ok:
                _CHOSEN[key] = (rows, warps, pre_bytes)
                break
    if _CHOSEN[key] is None:
        raise ValueError(f"attn_dense: no program shape of {SHAPES} is resident on {torch.cuda.get_device_name(qkv.device)}")
    rows, warps, pre_bytes = _CHOSEN[key]
    _attn_dense[grid(rows)](*args, **consts(rows, pre_bytes), PHASES=7, BARRIER=True, num_warps=warps)
    return out


if triton is not None:  # an opaque op to torch.compile and CUDA graphs: two cache writes and a fresh output
    attention_dense = torch.library.custom_op("mossbuild::attention_dense", launch, mutates_args=("k_cache", "v_cache"))

    @attention_dense.register_fake
    def _(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, kv_len, eps, w, residual, scale=None, quant=None, splits=0):
        return residual.new_empty(1, 1, w.shape[0])
