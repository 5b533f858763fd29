"""Fused decode attention (one new token per sequence), written in Triton.

In decode, `layer.layer_step` does between the qkv projection and the dense one: the
q and k RMSNorms, rope on both, two `index_copy_` cache writes, SDPA with a mask, and the
transposes around them: half a dozen tiny kernels per layer, each costing a couple of
microseconds whatever it does. This kernel does all of it in one launch. A program takes one
(sequence, kv head) and the G = H / Hkv query heads sharing it, and

- prologue: loads the group's q rows and the new k and v rows from qkv, applies the q/k
  RMSNorms and rope with the roundings of `rms_norm` and `rope` (float32 math, cast to the
  input dtype at the same points), and writes the new k and v into the caches at the sequence's own position;
- body: streams the cached K and V of positions < pos in BLOCK_S chunks with an online
  (float32) softmax; the new token's own score and value come from registers, never from the
  cache row just written, so no program reads what another one writes;
- split-S (flash-decoding, `splits` > 1): SPLITS programs per (sequence, kv head), each over a
  slice of the positions, write partial max / sum / accumulator to a float32 scratch, and a
  small second kernel combines them. At batch 1 there are only Hkv programs otherwise;
- epilogue: y rounded to the input dtype, as SDPA's output is; with `quant` (dense's FP8
  activation scale) then quantized as `fp8.quantize` does, so no quantize kernel runs between
  attention and dense's GEMV.

Measured on an H100 (bf16, Hkv 8, G 4, D 128, in a CUDA graph): 4.2-4.6 us at kv_len 128 (one
kernel); at kv_len 1024 / 4096 one kernel takes 13-17 / 43-59 us at batch 1, 16 splits 6 / 9 us;
at batch 4 and 4096, 4 splits 30 us against 44-61. `choose_splits` follows those numbers.

Scores go through tl.dot with the group padded to 16 rows (the smallest MMA tile): G is
4 in the real model, and a broadcast-multiply over [G, BLOCK_S, D] would cost far more
registers. Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine works without it (SDPA)
    triton = None

BLOCK_S, NUM_WARPS = 64, 4  # defaults; to be tuned on the GPU
ACT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32} if triton else {}


def available() -> bool:
    return triton is not None


def choose_splits(batch: int, kv_heads: int, kv_len: int, device: torch.device) -> int:
    """Enough programs to fill the SMs once; one kernel below 512 positions, where the second
    launch (about 1.5 us) costs more than the split saves. Each slice keeps >= BLOCK_S rows."""
    if kv_len < 512:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128
    splits = max(1, min(sms // (batch * kv_heads), kv_len // BLOCK_S))
    return 1 << (splits.bit_length() - 1)


if triton is not None:

    @triton.jit
    def _norm_rope(x1, x2, w_ptr, cos, sin, eps, D: tl.constexpr, D2: tl.constexpr):
        """RMSNorm then rope of rows given as halves [R, D/2], rounded as rms_norm and rope."""
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + eps)
        d = tl.arange(0, D2)
        w1, w2 = tl.load(w_ptr + d).to(tl.float32), tl.load(w_ptr + D2 + d).to(tl.float32)
        n1 = (w1[None, :] * (f1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2[None, :] * (f2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        return (n1 * cos[None, :] - n2 * sin[None, :]).to(dt), (n2 * cos[None, :] + n1 * sin[None, :]).to(dt)

    @triton.jit
    def _decode_attn(
        qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, m_ptr, l_ptr, acc_ptr, quant_ptr,
        qkv_stride, c_sb, c_sh, c_ss, pos_step, angle_step, eps, qk_scale,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        KV_LEN: tl.constexpr, SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_S: tl.constexpr,
        PRECISION: tl.constexpr, QUANT: tl.constexpr,
    ):  # fmt: skip
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        D2: tl.constexpr = D // 2
        g, d2, d = tl.arange(0, GP), tl.arange(0, D2), tl.arange(0, D)
        g_ok = g < G
        pos = tl.load(pos_ptr + b * pos_step).to(tl.int32)  # this sequence's own position and angles
        cos, sin = tl.load(cos_ptr + b * angle_step + d2), tl.load(sin_ptr + b * angle_step + d2)
        row = qkv_ptr + b * qkv_stride
        q_ptrs = row + (kvh * G + g)[:, None] * D + d2[None, :]
        q1, q2 = _norm_rope(
            tl.load(q_ptrs, mask=g_ok[:, None], other=0.0), tl.load(q_ptrs + D2, mask=g_ok[:, None], other=0.0),
            qn_ptr, cos, sin, eps, D, D2,
        )  # fmt: skip
        k_row = row + (H + kvh) * D
        k1, k2 = _norm_rope(tl.load(k_row + d2)[None, :], tl.load(k_row + D2 + d2)[None, :], kn_ptr, cos, sin, eps, D, D2)
        v_new = tl.load(row + (H + HKV + kvh) * D + d)
        kc, vc = kc_ptr + b * c_sb + kvh * c_sh, vc_ptr + b * c_sb + kvh * c_sh
        writer = split == 0  # no program reads row pos from the cache, so any one may write it
        tl.store(kc + pos * c_ss + d2[None, :], k1, mask=writer & (d2 < D2)[None, :])
        tl.store(kc + pos * c_ss + D2 + d2[None, :], k2, mask=writer & (d2 < D2)[None, :])
        tl.store(vc + pos * c_ss + d, v_new, mask=writer & (d < D))
        # the new token starts the online softmax of the program whose slice holds pos
        lo = split * SPLIT_LEN
        own = (pos >= lo) & (pos < lo + SPLIT_LEN)
        s_new = tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1) + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)
        m_i = tl.where(own, s_new * qk_scale, -1.0e30)  # finite: a slice with nothing left gives no NaN
        l_i = tl.where(own, 1.0, 0.0) + tl.zeros((GP,), tl.float32)
        acc = tl.where(own, v_new.to(tl.float32)[None, :], 0.0) + tl.zeros((GP, D), tl.float32)
        for i in range(0, SPLIT_LEN // BLOCK_S):
            s = lo + i * BLOCK_S + tl.arange(0, BLOCK_S)
            ok = (s < pos) & (s < KV_LEN)  # rows beyond pos are never read (they may hold anything)
            kt = kc + s[None, :] * c_ss + d2[:, None]
            k1t = tl.load(kt, mask=ok[None, :], other=0.0)
            k2t = tl.load(kt + D2, mask=ok[None, :], other=0.0)
            qk = tl.dot(q1, k1t, input_precision=PRECISION) + tl.dot(q2, k2t, input_precision=PRECISION)
            qk = tl.where(ok[None, :], qk * qk_scale, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok[None, :], tl.exp2(qk - m_new[:, None]), 0.0)
            v = tl.load(vc + s[:, None] * c_ss + d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        h = kvh * G + g
        if SPLITS == 1:
            y = _output(acc / l_i[:, None], quant_ptr, qkv_ptr.dtype.element_ty, QUANT)
            tl.store(y_ptr + b * H * D + h[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:  # partials [B, H, SPLITS(, D)], m in log2 units
            part = (b * H + h) * SPLITS + split
            tl.store(m_ptr + part, m_i, mask=g_ok)
            tl.store(l_ptr + part, l_i, mask=g_ok)
            tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _combine(
        y_ptr, m_ptr, l_ptr, acc_ptr, quant_ptr,
        H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
    ):  # fmt: skip
        """y of one (sequence, head) from its SPLITS partial softmaxes."""
        bh = tl.program_id(0) * H + tl.program_id(1)
        sp, d = tl.arange(0, SP), tl.arange(0, D)
        ok = sp < SPLITS
        m = tl.load(m_ptr + bh * SPLITS + sp, mask=ok, other=-1.0e30)
        w = tl.where(ok, tl.exp2(m - tl.max(m, axis=0)), 0.0)
        l_sum = tl.sum(w * tl.load(l_ptr + bh * SPLITS + sp, mask=ok, other=0.0), axis=0)
        acc = tl.load(acc_ptr + (bh * SPLITS + sp)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        y = _output(tl.sum(w[:, None] * acc, axis=0) / l_sum, quant_ptr, ACT, QUANT)
        tl.store(y_ptr + bh * D + d, y.to(y_ptr.dtype.element_ty))

    @triton.jit
    def _fp8_round(v):
        """v rounded to the nearest float8_e4m3fn value (ties to even), saturating at +-448, kept
        in float32: exact arithmetic (no float8 cast, which Triton's interpreter rounds wrongly
        where the mantissa carries), so the kernel and its CPU tests agree bit for bit."""
        a = tl.abs(v)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3's subnormals: 2^-6
        ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): three mantissa bits
        steps = (a * ((130 - e) << 23).to(tl.float32, bitcast=True) + 8388608.0) - 8388608.0  # rint(a / ulp) < 16
        q = tl.minimum(steps * ulp, 448.0)
        return tl.where(v < 0, -q, q)

    @triton.jit
    def _output(y, quant_ptr, ACT: tl.constexpr, QUANT: tl.constexpr):
        """y rounded to the activations' dtype, as SDPA's output is; with QUANT, then quantized
        for dense's FP8 input as `fp8.quantize` does."""
        y = y.to(ACT)
        if QUANT:
            y = _fp8_round(tl.math.div_rn(y.to(tl.float32), tl.load(quant_ptr)))
        return y


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
    splits: int = 0,
    block_s: int = BLOCK_S,
    num_warps: int = NUM_WARPS,
    quant: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [B, 1, H*D] for qkv [B, 1, (H + 2 Hkv) D]; writes the new k, v into the caches
    [Bmax, Hkv, S, D], row b at pos[b] (int64 [B], or [1] shared by the batch), rope's angles
    cos/sin [B, D/2] (or [1, D/2]). Row b attends to its positions < kv_len that are <= pos[b]
    (every pos < kv_len); splits > 1: that many programs per (sequence, kv head), then a
    combine; 0: `choose_splits`. quant: dense's activation scale (float32 [1]), and y is its
    float8_e4m3fn input."""
    b, t, width = qkv.shape
    _, hkv, seq, d = k_cache.shape
    h = width // d - 2 * hkv
    if t != 1 or h <= 0 or h % hkv or width % d:
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} does not fit caches {tuple(k_cache.shape)} at t=1")
    if d & (d - 1) or d < 32 or kv_len > seq or b > k_cache.shape[0] or v_cache.stride() != k_cache.stride():
        raise ValueError(f"decode_attention: head_dim {d} (a power of 2 >= 32), kv_len {kv_len}, batch {b}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("decode_attention: qkv and the caches need unit stride on the last dimension")
    if pos.numel() not in (1, b) or cos.numel() not in (d // 2, b * d // 2) or not cos.is_contiguous():
        raise ValueError(f"decode_attention: pos {tuple(pos.shape)} and angles {tuple(cos.shape)} for a batch of {b}")
    pos_step, angle_step = (0, 0) if pos.numel() == 1 else (1, d // 2)
    splits = splits or choose_splits(b, hkv, kv_len, qkv.device)
    split_len = triton.cdiv(triton.cdiv(kv_len, splits), block_s) * block_s
    y = torch.empty(b, 1, h * d, device=qkv.device, dtype=qkv.dtype if quant is None else torch.float8_e4m3fn)
    parts = torch.empty(b * h * splits * (d + 2) if splits > 1 else 1, device=qkv.device, dtype=torch.float32)
    m, l_, acc = parts[: b * h * splits], parts[b * h * splits : 2 * b * h * splits], parts[2 * b * h * splits :]
    g = h // hkv
    _decode_attn[(b, hkv, splits)](
        qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, y, m, l_, acc, qkv if quant is None else quant,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pos_step, angle_step, eps,
        math.log2(math.e) / math.sqrt(d),
        H=h, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, KV_LEN=kv_len, SPLITS=splits,
        SPLIT_LEN=split_len, BLOCK_S=block_s, PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        QUANT=quant is not None, num_warps=num_warps,
    )  # fmt: skip
    if splits > 1:
        _combine[(b, h)](
            y, m, l_, acc, qkv if quant is None else quant, H=h, D=d, SPLITS=splits, SP=triton.next_power_of_2(splits),
            ACT=ACT_TYPES[qkv.dtype], QUANT=quant is not None, num_warps=4,
        )  # fmt: skip
    return y


if triton is not None:  # an opaque op to torch.compile and CUDA graphs: two cache writes and a fresh output
    decode_attention = torch.library.custom_op("mossbuild::decode_attention", launch, mutates_args=("k_cache", "v_cache"))

    @decode_attention.register_fake
    def _(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, kv_len, eps, splits=0, block_s=BLOCK_S,
          num_warps=NUM_WARPS, quant=None):  # fmt: skip
        h = qkv.shape[-1] // k_cache.shape[-1] - 2 * k_cache.shape[1]
        return qkv.new_empty(qkv.shape[0], 1, h * k_cache.shape[-1], dtype=qkv.dtype if quant is None else torch.float8_e4m3fn)
